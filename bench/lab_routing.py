"""Routing policies on the lab (issue 23's lab proof), long runs kept out of CI.

    VLLM_FLEET_LAB_SERVERS=lab1,lab2,lab3 .venv/bin/python bench/lab_routing.py compare [--out DIR]
    VLLM_FLEET_LAB_SERVERS=lab1,lab2,lab3 .venv/bin/python bench/lab_routing.py kill [--out FILE]

Needs deployments/lab-tiny-routing.yaml deployed on lab1..lab3 (one tiny CPU replica each, nginx
and vLLM's router on lab1): `vllm-fleet deploy inventory/lab.py --spec ... -y` with
VLLM_FLEET_LAB_SERVERS. Hold the lab lock (docs/lab.md).

compare  `vllm-fleet bench --multi-turn --policies least_conn,round_robin,session,cache_aware`
         (each policy a deploy of the proxy part only, on lab1), private prefixes and a shared
         system prompt; writes DIR/routing.json + routing.html (+ routing.png).
kill     cache_aware under a bounded load through nginx: SIGKILL one replica's vLLM (lab3) and
         keep it down (its unit stopped) for a while; counts the requests that failed, how many
         the router sent to that replica after the kill (its own counters, read through nginx's
         /metrics/router), and when it marked it unhealthy; then starts it again.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vllm_fleet.render.secrets import read_secret  # noqa: E402
from vllm_fleet.serving.loadgen import LoadGen  # noqa: E402
from vllm_fleet.specs.load import load, resolve  # noqa: E402

SPEC = REPO / "deployments" / "lab-tiny-routing.yaml"
INV = REPO / "inventory" / "lab.py"


def lab_ssh(host: str, command: str) -> subprocess.CompletedProcess:
    from vllm_fleet.lab.inventory import lab_hosts

    data = dict(lab_hosts()[0])[host]
    argv = [
        "ssh",
        "-i",
        data["ssh_key"],
        "-o",
        f"UserKnownHostsFile={data['ssh_known_hosts_file']}",
        "-o",
        "BatchMode=yes",
        f"{data.get('ssh_user', 'lab')}@{data['ssh_hostname']}",
        f"sudo sh -c {json.dumps(command)}",
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def router_metrics(base: str) -> dict[str, dict[str, float]]:
    text = urllib.request.urlopen(f"{base}/metrics/router", timeout=10).read().decode()
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = re.match(r'^(vllm_router_[a-z_]+)\{([^}]*)\}\s+([0-9.eE+-]+)', line)
        if m:
            w = re.search(r'worker="([^"]+)"', m.group(2))
            if w:
                out.setdefault(m.group(1), {})[w.group(1)] = out.setdefault(m.group(1), {}).get(
                    w.group(1), 0.0
                ) + float(m.group(3))
    return out


def cmd_compare(args: argparse.Namespace) -> int:
    argv = [
        sys.executable,
        "-m",
        "vllm_fleet",
        "bench",
        str(INV),
        "--spec",
        str(args.spec),
        "--multi-turn",
        "--policies",
        args.policies,
        "--conversations",
        str(args.conversations),
        "--prefix-len",
        str(args.prefix_len),
        "--turns",
        str(args.turns),
        "--user-len",
        str(args.user_len),
        "--reply-len",
        str(args.reply_len),
        "--think-time",
        str(args.think_time),
        "--system-prompt-len",
        args.system_prompt_len,
        "--out",
        str(args.out),
    ]
    print("+", " ".join(argv), flush=True)
    return subprocess.run(argv).returncode


def cmd_kill(args: argparse.Namespace) -> int:
    r = resolve(load(str(args.spec)))
    key = read_secret(r["server"]["api_key"], yaml_path="server.api_key", base_dir=Path(args.spec).parent)
    base = "http://10.10.0.11"
    victim_host, victim_url = args.host, f"http://{args.address}:{r['server']['port']}"
    unit = f"vllm-{r['name']}-0.service"
    lab_ssh(victim_host, f"systemctl start {unit}")
    gen = LoadGen(base, r["model"]["served_name"], key, concurrency=args.concurrency, max_tokens=16)
    gen.start()
    time.sleep(args.warm)
    before = router_metrics(base)
    t_kill = time.monotonic()
    # SIGKILL (no drain), then keep it down: systemd would restart it 10 s later
    k = lab_ssh(victim_host, f"systemctl kill -s SIGKILL {unit}; systemctl stop {unit}")
    unhealthy_after = None
    samples = []
    while time.monotonic() - t_kill < args.down:
        m = router_metrics(base)
        health = (m.get("vllm_router_worker_health") or {}).get(victim_url)
        sent = (m.get("vllm_router_processed_requests_total") or {}).get(victim_url, 0.0)
        samples.append({"t": round(time.monotonic() - t_kill, 1), "health": health, "processed": sent})
        if unhealthy_after is None and health == 0:
            unhealthy_after = round(time.monotonic() - t_kill, 1)
        time.sleep(0.5)
    after = router_metrics(base)
    stats = gen.stop()
    lab_ssh(victim_host, f"systemctl start {unit}")
    out = {
        "kind": "lab routing kill",
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "policy": r["proxy"]["routing"]["policy"],
        "router": r["proxy"]["routing"]["router"],
        "victim": {"host": victim_host, "url": victim_url, "unit": unit, "kill_rc": k.returncode},
        "concurrency": args.concurrency,
        "down_s": args.down,
        "router_marked_unhealthy_after_s": unhealthy_after,
        "router_processed_by_worker_before_kill": (before.get("vllm_router_processed_requests_total") or {}),
        "router_processed_by_worker_after": (after.get("vllm_router_processed_requests_total") or {}),
        "router_errors_by_worker_after": (after.get("vllm_router_request_errors_total") or {}),
        "router_retries_by_worker_after": (after.get("vllm_router_retries_total") or {}),
        "samples": samples,
        "load": stats.as_dict(),
        "load_summary": stats.summary(),
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(stats.summary())
    print(
        f"router marked {victim_url} unhealthy after {unhealthy_after} s; processed by it: "
        f"{out['router_processed_by_worker_before_kill'].get(victim_url)} before the kill, "
        f"{out['router_processed_by_worker_after'].get(victim_url)} at the end"
    )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("compare")
    c.add_argument("--spec", default=str(SPEC))
    c.add_argument("--policies", default="least_conn,round_robin,session,cache_aware")
    c.add_argument("--conversations", type=int, default=12)
    # the tiny model's tokenizer makes ~3.8 tokens of each word and max_model_len is 512: the
    # last turn (system + prefix + 4 x (user + reply)) stays near 400 tokens
    c.add_argument("--prefix-len", type=int, default=40)
    c.add_argument("--turns", type=int, default=4)
    c.add_argument("--user-len", type=int, default=5)
    c.add_argument("--reply-len", type=int, default=8)
    c.add_argument("--think-time", type=float, default=1.0)
    c.add_argument("--system-prompt-len", default="0,30")
    c.add_argument("--out", default=str(REPO / "bench" / "results" / "lab-routing"))
    c.set_defaults(func=cmd_compare)
    k = sub.add_parser("kill")
    k.add_argument("--spec", default=str(SPEC))
    k.add_argument("--host", default="lab3")
    k.add_argument("--address", default="10.10.0.13")
    k.add_argument("--concurrency", type=int, default=6)
    k.add_argument("--warm", type=float, default=8.0)
    k.add_argument("--down", type=float, default=25.0)
    k.add_argument("--out", default=str(REPO / "bench" / "results" / "lab-routing-kill.json"))
    k.set_defaults(func=cmd_kill)
    args = ap.parse_args()
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
