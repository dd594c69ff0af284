"""Grow a fleet under load: the deploy that adds replicas, while clients send chats through the
proxy. Zero failed requests is the bar (issue 25: growing 3 -> 6 replicas gave one 502 among the
smoke tests' concurrent chats right after the new replicas turned healthy). Prints JSON.

    .venv/bin/python bench/grow_under_load.py [--spec deployments/lab-tiny-replicas.yaml] \
        [--from lab1] [--to lab1,lab2,lab3] [--concurrency 3] [--out FILE]

1. `deploys/serve.py` with VLLM_FLEET_LAB_SERVERS=FROM (the fleet before; nginx on lab1).
2. vllm_fleet.serving.loadgen through nginx (bounded threads, plain and streamed chats, the one
   SDK-like retry of a request whose connection closed before any answer byte), then the deploy
   with VLLM_FLEET_LAB_SERVERS=TO: the new hosts get vLLM, nginx on lab1 the bigger upstream, and
   the deploy's own smoke tests (4 concurrent chats through nginx) and per-replica chats run.
3. The load stops 3 s after the deploy. Result: the deploy's exit and smoke lines, the load's
   counts during the deploy and over the run, and nginx's error log lines on the proxy host
   written meanwhile (the reason of any 502: `upstream prematurely closed connection`, ...).

Needs the lab up (docs/lab.md) and the lock that every lab user takes. Not a timed test: on a
shared 2-core lab the numbers move with whatever else runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vllm_fleet.render.secrets import read_secret  # noqa: E402
from vllm_fleet.serving.loadgen import LoadGen  # noqa: E402
from vllm_fleet.specs.load import load, resolve  # noqa: E402


def deploy(spec: Path, servers: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "VLLM_FLEET_SPEC": str(spec), "VLLM_FLEET_LAB_SERVERS": servers}
    r = subprocess.run(
        [str(Path(sys.executable).parent / "pyinfra"), "-y", "inventory/lab.py", "deploys/serve.py"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    r.out = r.stdout + r.stderr  # type: ignore[attr-defined]
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default=str(REPO / "deployments" / "lab-tiny-replicas.yaml"))
    ap.add_argument("--from", dest="before", default="lab1")
    ap.add_argument("--to", dest="after", default="lab1,lab2,lab3")
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out")
    a = ap.parse_args()

    from vllm_fleet.lab.inventory import lab_hosts

    import tempfile

    import yaml

    hosts = dict(lab_hosts()[0])
    # named lab-tiny (as tests/lab/test_rollout.py does): lab1's env, model, key and site, so that
    # the fleet replaces lab1's lab-tiny instead of clashing with it on port 8000
    raw = yaml.safe_load(Path(a.spec).read_text())
    raw["name"] = "lab-tiny"
    raw["server"]["api_key"] = {"file": "~/.config/vllm-fleet/lab-tiny.key", "generate": True}
    raw["proxy"]["metrics_allow"] = ["127.0.0.1", hosts["lab1"]["ssh_hostname"].rsplit(".", 1)[0] + ".0/24"]
    raw["model"]["source"] = str(Path(os.path.expanduser(raw["model"]["source"])))
    spec_path = Path(tempfile.mkdtemp(prefix="bench-grow-")) / "lab-tiny.yaml"
    spec_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    spec = load(spec_path)
    r = resolve(spec)
    first = deploy(spec_path, a.before)
    if first.returncode != 0:
        print(first.out[-4000:], file=sys.stderr)
        return 1
    key = read_secret(r["server"]["api_key"], yaml_path="server.api_key", base_dir=spec.base_dir)
    proxy = hosts["lab1"]
    ssh = [
        "ssh",
        "-i",
        proxy["ssh_key"],
        "-o",
        "BatchMode=yes",
        "-o",
        f"UserKnownHostsFile={proxy['ssh_known_hosts_file']}",
        "-o",
        "StrictHostKeyChecking=yes",
        f"root@{proxy['ssh_hostname']}",
    ]
    mark = (
        subprocess.run([*ssh, "wc -l < /var/log/nginx/error.log"], capture_output=True, text=True).stdout.strip() or "0"
    )
    gen = LoadGen(
        f"http://{proxy['ssh_hostname']}",
        r["model"]["served_name"],
        key,
        concurrency=a.concurrency,
        max_tokens=a.max_tokens,
    ).start()
    time.sleep(5)
    t0 = time.monotonic()
    grow = deploy(spec_path, a.after)
    t1 = time.monotonic()
    time.sleep(3)
    st = gen.stop()
    during = [rec for rec in gen.records if t0 - gen._t0 <= rec.start <= t1 - gen._t0]
    errors = subprocess.run(
        [*ssh, f"tail -n +{int(mark) + 1} /var/log/nginx/error.log"], capture_output=True, text=True
    ).stdout
    out = {
        "spec": str(spec_path),
        "from": a.before,
        "to": a.after,
        "concurrency": a.concurrency,
        "max_tokens": a.max_tokens,
        "deploy_ok": grow.returncode == 0,
        "deploy_s": round(t1 - t0, 1),
        "deploy_lines": [
            ln.strip()
            for ln in grow.out.splitlines()
            if re.search(r"smoke|PASS|FAIL|healthy after|answers a chat|Grand total|Error", ln)
        ][-30:],
        "requests_during_deploy": {
            "total": len(during),
            "ok": sum(x.ok for x in during),
            "failed": sum(not x.ok for x in during),
            "streamed": sum(x.stream for x in during),
        },
        "requests_whole_run": st.as_dict(),
        "nginx_error_log_during": [ln for ln in errors.splitlines() if ln.strip()][-40:],
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    # back to what the lab tests expect: lab-tiny on lab1 alone (loopback); the grown hosts' units removed
    for name in set(a.after.split(",")) - set(a.before.split(",")):
        h = hosts[name]
        subprocess.run(
            [
                "ssh",
                "-i",
                h["ssh_key"],
                "-o",
                "BatchMode=yes",
                "-o",
                f"UserKnownHostsFile={h['ssh_known_hosts_file']}",
                f"root@{h['ssh_hostname']}",
                "systemctl disable --now vllm-lab-tiny-0.service vllm-fleet-api-firewall.service; "
                "rm -f /etc/systemd/system/vllm-lab-tiny-0.service "
                "/etc/systemd/system/vllm-fleet-api-firewall.service; systemctl daemon-reload",
            ],
            capture_output=True,
            text=True,
        )
    back = deploy(REPO / "deployments" / "lab-tiny.yaml", "lab1")
    out["lab1_back_to_lab_tiny"] = back.returncode == 0
    text = json.dumps(out, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    if grow.returncode != 0:
        print(grow.out[-4000:], file=sys.stderr)
    return 0 if grow.returncode == 0 and out["requests_during_deploy"]["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
