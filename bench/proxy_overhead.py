"""Proxy overhead on time to first token: streamed chats through nginx vs straight at vLLM.

Runs on the server host itself (over SSH, with the deployment's own Python), so both paths use
the same client on the same machine: http://127.0.0.1:<proxy.listen> (nginx) and
http://127.0.0.1:<server.port> (vLLM), alternating, N requests each. Prints JSON and a table.

    .venv/bin/python bench/proxy_overhead.py [--spec deployments/lab-tiny.yaml] [--host lab1] [-n 40]

Needs a deployed lab (`make demo` or `pyinfra -y inventory/lab.py deploys/serve.py`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vllm_fleet.lab.inventory import lab_hosts  # noqa: E402
from vllm_fleet.render.secrets import read_secret  # noqa: E402
from vllm_fleet.specs.load import load, resolve  # noqa: E402

REMOTE = r"""
import json, time, requests
KEY, MODEL, N, TARGETS = {key!r}, {model!r}, {n}, {targets!r}
def ttft(base):
    body = {{"model": MODEL, "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 16,
             "stream": True, "temperature": 0}}
    t0 = time.perf_counter()
    with requests.post(base + "/v1/chat/completions", json=body, stream=True, timeout=60,
                       headers={{"Authorization": "Bearer " + KEY}}) as r:
        r.raise_for_status()
        first = None
        for line in r.iter_lines():
            if line.startswith(b"data:") and first is None:
                first = time.perf_counter() - t0
        return first, time.perf_counter() - t0
out = {{name: {{"ttft": [], "total": []}} for name in TARGETS}}
for name, base in TARGETS.items():  # warm-up
    ttft(base)
for _ in range(N):
    for name, base in TARGETS.items():
        f, t = ttft(base)
        out[name]["ttft"].append(f); out[name]["total"].append(t)
print(json.dumps(out))
"""


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default=str(REPO / "deployments" / "lab-tiny.yaml"))
    ap.add_argument("--host", default="lab1")
    ap.add_argument("-n", type=int, default=40)
    args = ap.parse_args()
    spec_obj = load(args.spec)
    spec = resolve(spec_obj)
    hosts, why = lab_hosts()
    data = dict(hosts).get(args.host)
    if not data:
        print(f"proxy_overhead: host {args.host} not in the lab ({why or 'not up'})", file=sys.stderr)
        return 1
    key = read_secret(spec["server"].get("api_key"), yaml_path="server.api_key", base_dir=spec_obj.base_dir)
    targets = {
        "nginx": f"http://127.0.0.1:{spec['proxy']['listen']}",
        "direct": f"http://127.0.0.1:{spec['server']['port']}",
    }
    script = REMOTE.format(key=key, model=spec["model"]["served_name"], n=args.n, targets=targets)
    py = f"{spec['install']['prefix']}/env/bin/python"
    ssh = [
        "ssh",
        "-i",
        data["ssh_key"],
        "-o",
        f"UserKnownHostsFile={data['ssh_known_hosts_file']}",
        "-o",
        "BatchMode=yes",
        f"root@{data['ssh_hostname']}",
        py,
        "-",
    ]
    r = subprocess.run(ssh, input=script, capture_output=True, text=True, timeout=600)  # the key travels on stdin
    if r.returncode != 0:
        print(r.stderr[-2000:], file=sys.stderr)
        return 1
    raw = json.loads(r.stdout.strip().splitlines()[-1])
    result = {"host": args.host, "spec": spec["name"], "n": args.n, "unit": "ms"}
    for name, series in raw.items():
        result[name] = {
            f"ttft_{k}": round(pct(series["ttft"], p) * 1000, 2) for k, p in (("p50", 50), ("p90", 90), ("p99", 99))
        }
        result[name]["ttft_mean"] = round(statistics.mean(series["ttft"]) * 1000, 2)
        result[name]["total_p50"] = round(pct(series["total"], 50) * 1000, 2)
    result["overhead_ttft_p50_ms"] = round(result["nginx"]["ttft_p50"] - result["direct"]["ttft_p50"], 2)
    print(json.dumps(result, indent=2))
    print(f"\n{'path':<8} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'total p50':>10}  (ms, n={args.n}, 16 output tokens)")
    for name in ("direct", "nginx"):
        s = result[name]
        print(f"{name:<8} {s['ttft_p50']:>9} {s['ttft_p90']:>8} {s['ttft_p99']:>8} {s['total_p50']:>10}")
    print(f"nginx adds {result['overhead_ttft_p50_ms']} ms to the median TTFT")
    return 0


if __name__ == "__main__":
    sys.exit(main())
