"""The no-op re-deploy at two model sizes (issue 36, item 3): is a converged host cheap whatever
the size of its weights?

    flock /tmp/vf-lab.lock .venv/bin/python bench/noop_model_size.py [--size-gib 1] [--runs 3] [--label after]
        [--only big|tiny] [--out bench/results/noop-model-size.json]

Two specs, both `transfer: upload`: deployments/lab-tiny.yaml as shipped, and the same with
``model.source`` pointing at a copy of the tiny model plus one synthetic file of --size-gib GiB
(``pad.bin``, random bytes; vLLM never reads it), kept under /var/tmp/vllm-fleet-bench (never in
the checkout; made once and reused, so the control machine's hash cache may already know it).
For each (big first, then tiny, which leaves lab1 as the lab tests expect it): one deploy that
converges lab1 (the upload or the removal of pad.bin, and the restart that a model change
brings), a `sync` on lab1 and one more deploy, not timed (the upload's writeback and vLLM's
first requests after its restart are not what a no-op costs; on a host whose copy was verified
before stamps existed it writes the stamp), then --runs no-op re-deploys, timed (each must
change nothing), then one more no-op
with `-vv` that counts the commands pyinfra sent each host (not a timed run: the printing slows
it). The deploy is `pyinfra -y inventory/lab.py deploys/serve.py` with lab1 the server and proxy
(bench/labbench.py: deploy); every lab host is in the inventory. The size of model.path on lab1
is read with `du -sb` over ssh (the file is really there).

``--only big`` converges and times the big model and leaves lab1 with it (to time the same
no-op with another tool); ``--only tiny`` puts lab-tiny back. Prints a table and JSON; the
result is merged into --out under --label. Not a test: numbers on a shared 2-core machine are
noisy (the JSON says how busy the machine was).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import labbench as lb  # noqa: E402

WORK = Path("/var/tmp/vllm-fleet-bench")
SERVERS = ["lab1"]


def big_model(size_gib: float) -> Path:
    """A copy of the lab's tiny model plus ``pad.bin`` of ``size_gib`` GiB (random bytes), reused
    when it is already there with that size."""
    tiny = Path(os.path.expanduser(yaml.safe_load(lb.LAB_SPEC.read_text())["model"]["source"]))
    if not (tiny / "config.json").is_file():
        raise SystemExit(f"no tiny model at {tiny}: run `vllm-fleet tiny-model`")
    size = int(size_gib * 2**30)
    d = WORK / f"model-{size_gib:g}g"
    d.mkdir(parents=True, exist_ok=True)
    for f in tiny.iterdir():
        if f.is_file() and (not (d / f.name).exists() or (d / f.name).read_bytes() != f.read_bytes()):
            shutil.copyfile(f, d / f.name)
    pad = d / "pad.bin"
    if not pad.exists() or pad.stat().st_size != size:
        block = os.urandom(1 << 20)
        with open(pad.with_suffix(".part"), "wb") as out:
            left = size
            while left > 0:
                out.write(block[: min(left, len(block))])
                left -= len(block)
        pad.with_suffix(".part").rename(pad)
    return d


def big_spec(model_dir: Path, size_gib: float) -> Path:
    spec = yaml.safe_load(lb.LAB_SPEC.read_text())
    spec["model"]["source"] = str(model_dir)
    path = WORK / f"lab-tiny-{size_gib:g}g.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def model_bytes(st: dict, host: str, spec: Path) -> int | None:
    root = f"/var/lib/vllm-fleet/{yaml.safe_load(spec.read_text())['name']}/model"
    r = lb.ssh(st, host, f"du -sb {root}", check=False)
    return int(r.stdout.split()[0]) if r.returncode == 0 and r.stdout.split() else None


def series(st: dict, name: str, spec: Path, runs: int) -> dict:
    """Converge, then ``runs`` timed no-ops and one counted (-vv) no-op, with ``spec``."""
    first = lb.deploy(spec, SERVERS)
    if first["rc"] != 0:
        raise SystemExit(f"{name}: the converging deploy failed:\n{first['output_tail']}")
    # not timed: the upload's writeback (a GiB of dirty pages) and vLLM's first requests after
    # its restart (the no-op's state read and smoke tests chat with it)
    lb.ssh(st, "lab1", "sync")
    settle = lb.deploy(spec, SERVERS)
    timed = []
    for _ in range(runs):
        r = lb.deploy(spec, SERVERS)
        if r["rc"] != 0 or (r["grand_total"] or {}).get("changed"):
            raise SystemExit(
                f"{name}: a no-op changed something or failed: {r['changed_ops']}\n{r['output_tail'] or ''}"
            )
        timed.append(r)
    counted = lb.deploy(spec, SERVERS, count_commands=True)
    walls = [r["wall_s"] for r in timed]
    return {
        "spec": str(spec),
        "model_path_bytes_on_lab1": model_bytes(st, "lab1", spec),
        "converge_s": first["wall_s"],
        "converge_changed": first["changed_ops"],
        "settle_s": settle["wall_s"],
        "settle_changed": settle["changed_ops"],
        "noop_wall_s": walls,
        "noop_median_s": round(lb.median(walls), 2),
        "noop_min_s": min(walls),
        "noop_max_s": max(walls),
        "noop_prepare_median_s": round(lb.median([r["phases"].get("prepare_s") for r in timed]), 2),
        "noop_phases": [r["phases"] for r in timed],
        "noop_changed": max((r["grand_total"] or {}).get("changed", 0) for r in timed),
        "remote_commands": counted.get("remote_commands"),
        "loadavg1_before": [r["loadavg1_before"] for r in timed],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--label", default="now")
    ap.add_argument("--only", choices=("big", "tiny"))
    ap.add_argument("--out", default=str(lb.REPO / "bench" / "results" / "noop-model-size.json"))
    args = ap.parse_args()
    st = lb.lab_state()
    if not st:
        raise SystemExit("the lab is down: `vllm-fleet lab up`")
    result = {"label": args.label, "commit": lb.git_commit(), "machine_before": lb.machine(), "size_gib": args.size_gib}
    t0 = time.monotonic()
    if args.only != "tiny":
        result["big"] = series(st, "big", big_spec(big_model(args.size_gib), args.size_gib), args.runs)
    if args.only != "big":
        result["tiny"] = series(st, "tiny", lb.LAB_SPEC, args.runs)
    result["machine_after"] = lb.machine()
    result["bench_s"] = round(time.monotonic() - t0, 1)
    if "big" in result and "tiny" in result:
        result["big_over_tiny"] = round(result["big"]["noop_median_s"] / result["tiny"]["noop_median_s"], 2)
    out = Path(args.out)
    merged = json.loads(out.read_text()) if out.exists() else {}
    merged[args.label] = result
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(merged, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    print(
        f"\n{'model':<8} {'model.path on lab1':>20} {'no-op median (min-max)':>26} {'prepare':>8} "
        f"{'commands per host':>24}"
    )
    for name in ("tiny", "big"):
        if name in result:
            r = result[name]
            print(
                f"{name:<8} {r['model_path_bytes_on_lab1'] or 0:>20,} {r['noop_median_s']:>10.2f} s "
                f"({r['noop_min_s']:.2f}-{r['noop_max_s']:.2f}) {r['noop_prepare_median_s']:>8.2f} "
                f"{json.dumps(r['remote_commands']):>24}"
            )
    if "big_over_tiny" in result:
        print(f"big / tiny: {result['big_over_tiny']}x")


if __name__ == "__main__":
    main()
