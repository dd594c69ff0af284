"""Rollout under load: how long a rolling update of every replica takes, and how many requests
were served and failed during it. Prints JSON and a short table.

    VLLM_FLEET_LAB_SERVERS=lab1,lab2,lab3 .venv/bin/python bench/rollout.py \
        [--spec deployments/lab-tiny-replicas.yaml] [--concurrency 3] [--batch-size 1] [--out FILE]

Needs the lab up with the replicas deployed from --spec (`pyinfra -y inventory/lab.py
deploys/serve.py` with VLLM_FLEET_SPEC and VLLM_FLEET_LAB_SERVERS; --deploy does it first).
The update changes engine.max_num_seqs (16 <-> 12, read from what runs now: a second run goes
back) so that every replica restarts; the load is vllm_fleet.serving.loadgen (bounded threads, plain and
streamed chats through the proxy, no client retries). The new spec is a temporary copy; the
committed spec is not changed, so afterwards the fleet runs the copy's setting until the next
deploy or rollout of --spec.

Not a timed test: on a shared 2-core lab the numbers move with whatever else runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vllm_fleet.serving.loadgen import LoadGen  # noqa: E402
from vllm_fleet.commands.rollout import format_table  # noqa: E402,F401
from vllm_fleet.render.secrets import read_secret  # noqa: E402
from vllm_fleet.specs.load import load, resolve  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default=str(REPO / "deployments" / "lab-tiny-replicas.yaml"))
    ap.add_argument("--inventory", default="inventory/lab.py")
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--deploy", action="store_true", help="deploy --spec with deploys/serve.py first")
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args()

    spec_path = Path(a.spec)
    spec = load(spec_path)
    r = resolve(spec)
    key = read_secret(r["server"]["api_key"], yaml_path="server.api_key", base_dir=spec.base_dir)
    from vllm_fleet.commands.rollout import server_order

    servers, proxies, hosts = server_order(a.inventory, r)
    proxy = proxies[0] if proxies else servers[0].rsplit(":", 1)[0]
    base_url = f"http://{hosts[proxy]['address']}" + ("" if r["proxy"]["listen"] == 80 else f":{r['proxy']['listen']}")
    if a.deploy:
        d = subprocess.run(
            [str(Path(sys.executable).parent / "pyinfra"), "-y", a.inventory, "deploys/serve.py"],
            cwd=REPO,
            env={**os.environ, "VLLM_FLEET_SPEC": str(spec_path)},
            capture_output=True,
            text=True,
        )
        if d.returncode != 0:
            print((d.stdout + d.stderr)[-4000:], file=sys.stderr)
            return 1

    # the new configuration: max_num_seqs 16 <-> 12, judged from the proxy host's running vLLM
    raw = yaml.safe_load(spec_path.read_text())
    now = r["engine"]["max_num_seqs"]
    state = Path(os.path.expanduser(f"~/.cache/vllm-fleet/bench-rollout-{r['name']}.json"))
    if state.exists():
        now = json.loads(state.read_text()).get("max_num_seqs", now)
    new = 12 if now != 12 else 16
    raw.setdefault("engine", {})["max_num_seqs"] = new
    for k in ("api_key",):  # keep the secret reference absolute (the copy lives elsewhere)
        ref = raw["server"].get(k) or {}
        if "file" in ref:
            ref["file"] = str((spec.base_dir / os.path.expanduser(ref["file"])).resolve())
    if r["model"].get("local_dir"):
        raw["model"]["source"] = r["model"]["local_dir"]
    tmp = Path(tempfile.mkdtemp(prefix="bench-rollout-")) / spec_path.name
    tmp.write_text(yaml.safe_dump(raw, sort_keys=False))

    gen = LoadGen(base_url, r["model"]["served_name"], key, concurrency=a.concurrency, max_tokens=a.max_tokens).start()
    time.sleep(5)
    before = gen.stats()
    argv = [sys.executable, "-m", "vllm_fleet", "rollout", a.inventory, "--spec", str(tmp), "--json"]
    if a.batch_size:
        argv += ["--batch-size", str(a.batch_size)]
    t0 = time.monotonic()
    ro = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    t1 = time.monotonic()
    time.sleep(3)
    st = gen.stop()
    during = [rec for rec in gen.records if t0 - gen._t0 <= rec.start <= t1 - gen._t0]
    try:
        result = json.loads(ro.stdout)
    except ValueError:
        result = {"ok": False, "stdout": ro.stdout[-2000:]}
    state.parent.mkdir(parents=True, exist_ok=True)
    if ro.returncode == 0:
        state.write_text(json.dumps({"max_num_seqs": new}))
    out = {
        "spec": str(spec_path),
        "replicas": servers,
        "proxy": proxy,
        "change": f"engine.max_num_seqs {now} -> {new}",
        "concurrency": a.concurrency,
        "max_tokens": a.max_tokens,
        "rollout_ok": ro.returncode == 0,
        "rollout_s": round(t1 - t0, 1),
        "steps": result.get("steps", []),
        "requests_during_rollout": {
            "total": len(during),
            "ok": sum(r.ok for r in during),
            "failed": sum(not r.ok for r in during),
            "streamed": sum(r.stream for r in during),
        },
        "requests_whole_run": st.as_dict(),
        "warmup_before_rollout": before.summary(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    text = json.dumps(out, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    d = out["requests_during_rollout"]
    print()
    print(f"| rollout of {len(servers)} replicas ({out['change']}) | {'ok' if out['rollout_ok'] else 'FAILED'} |")
    print("|---|---|")
    print(f"| duration | {out['rollout_s']:.1f} s |")
    print(f"| requests during it (concurrency {a.concurrency}) | {d['total']} ({d['streamed']} streamed) |")
    print(f"| served / failed | {d['ok']} / {d['failed']} |")
    lat = st.latency_ms
    if lat:
        print(
            f"| latency over the run, plain p50/p99 | {lat.get('plain p50', 0):.0f} / {lat.get('plain p99', 0):.0f} "
            "ms |"
        )
        print(
            f"| latency over the run, streamed p50/p99 | {lat.get('stream p50', 0):.0f} / "
            f"{lat.get('stream p99', 0):.0f} ms |"
        )
    for s in out["steps"]:
        print(f"|   batch {s['batch']} {s['step']} on {','.join(s['hosts'])} | {s['seconds']:.1f} s |")
    if st.reasons:
        print("failures:", json.dumps(st.reasons, indent=2))
    if ro.returncode != 0:
        print(ro.stderr[-3000:], file=sys.stderr)
    return 0 if ro.returncode == 0 and d["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
