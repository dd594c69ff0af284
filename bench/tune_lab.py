"""A longer `vllm-fleet tune` on the lab by hand (the lab test runs a short one).

    .venv/bin/python bench/tune_lab.py [--servers lab1,lab2,lab3] [--host lab3] [--target ...] [--grid ...]
        [--budget 60] [--resume] [--no-deploy] [--out bench/results/lab-tune]

Brings the lab up to as many hosts as --servers names (bench/labbench.py), deploys
deployments/lab-tiny-replicas.yaml on them (`pyinfra -y inventory/lab.py deploys/serve.py`, nginx
on lab1; skip with --no-deploy when it is deployed), then runs `vllm-fleet tune` on --host with
the default CPU grid (or --grid), 128 in / 128 out tokens, while the other replicas serve. The
tune's own files (tune.jsonl, tune.json, report.html, pareto.png with the bench extra,
overlay.yaml, tuned-spec.yaml) land in --out; --resume goes on with a cut run. Leaves the lab up
(`vllm-fleet lab down` after). Not a test: on a shared 2-core machine the numbers are noisy.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import labbench as lb  # noqa: E402

SPEC = lb.REPO / "deployments" / "lab-tiny-replicas.yaml"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", default="lab1,lab2,lab3")
    ap.add_argument("--host", default=None, help="the replica to tune (default: the last one that is not the proxy)")
    ap.add_argument("--target", default="ttft_p99_ms=2000,tpot_p99_ms=100")
    ap.add_argument("--grid", default=None)
    ap.add_argument("--budget", default="60", help="minutes")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--no-deploy", action="store_true")
    ap.add_argument("--out", default=str(lb.REPO / "bench" / "results" / "lab-tune"))
    args = ap.parse_args()
    servers = args.servers.split(",")
    env = {**os.environ, "VLLM_FLEET_LAB_SERVERS": args.servers, "VLLM_FLEET_SPEC": str(SPEC)}
    if not args.no_deploy:
        print(f"lab up --hosts {len(servers)}: {lb.lab_up(len(servers))} s", flush=True)
        r = subprocess.run(
            [str(lb.BIN / "pyinfra"), "-y", "inventory/lab.py", "deploys/serve.py"], cwd=lb.REPO, env=env
        )
        if r.returncode != 0:
            return r.returncode
    argv = [
        str(lb.BIN / "vllm-fleet"),
        "tune",
        "inventory/lab.py",
        "--spec",
        str(SPEC),
        "--target",
        args.target,
        "--out",
        args.out,
        "--budget",
        args.budget,
        "--input-len",
        "128",
        "--output-len",
        "128",
    ]
    argv += ["--host", args.host] if args.host else []
    argv += ["--grid", args.grid] if args.grid else []
    argv += ["--resume"] if args.resume else []
    return subprocess.run(argv, cwd=lb.REPO, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
