#!/usr/bin/env python3
"""Serve one deployed spec on the GPU machine, smoke-test it, benchmark it, compare the planner.

    python3 bench/gpu/run_spec.py deployments/h200-qwen7b-bf16.yaml OUTDIR

Runs after bench/gpu/deploy_gpu.py has put the rendered unit and environment files. That machine
has no systemd as PID 1, so the unit is run the way systemd would run it: ExecStart from
/etc/systemd/system/vllm.service, a clean environment (systemd's default PATH, HOME/USER/LOGNAME/
SHELL of User=) plus each EnvironmentFile= in order, as User= in WorkingDirectory=. The unit's
sandboxing (ProtectSystem=, PrivateTmp=, ...) is not applied. If CUDA does not initialise in that
environment the run says so and falls back to the machine's own environment (recorded in
``mode``).

Then: wait for /health (server.health_timeout), vllm_fleet.serving.smoke.smoke_checks with the key read from
the rendered secrets.env, `vllm bench serve` (random token prompts, 512 in / 256 out, ignore_eos)
at concurrency 1 and 16, the KV cache vLLM logged against vllm_fleet.specs.planner.plan, and SIGTERM /
SIGKILL as KillMode=mixed. Writes OUTDIR/NAME.json (+ bench JSONs, server log).
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from vllm_fleet.specs import planner  # noqa: E402

from vllm_fleet.render import files as render
from vllm_fleet.serving.smoke import smoke_checks, wait_healthy  # noqa: E402
from vllm_fleet.specs.load import load_and_check  # noqa: E402

SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"
BENCH = [(1, 8), (16, 64)]  # (concurrency, prompts)
IN_LEN, OUT_LEN = 512, 256


def unit_settings(path: str) -> dict:
    out: dict = {"env_files": []}
    for line in Path(path).read_text().splitlines():
        key, sep, value = line.partition("=")
        if not sep or line.startswith("#"):
            continue
        if key == "ExecStart":
            out["argv"] = shlex.split(value)
        elif key == "EnvironmentFile":
            out["env_files"].append(value)
        elif key in ("User", "WorkingDirectory"):
            out[key] = value
    return out


def read_env_file(path: str) -> dict[str, str]:
    env = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        k, v = line.split("=", 1)
        if len(v) >= 2 and v[0] == v[-1] == '"':
            v = v[1:-1].replace('\\"', '"').replace("\\\\", "\\")
        env[k] = v
    return env


def systemd_env(unit: dict) -> dict[str, str]:
    pw = pwd.getpwnam(unit["User"])
    env = {"PATH": SYSTEMD_PATH, "HOME": pw.pw_dir, "USER": pw.pw_name, "LOGNAME": pw.pw_name, "SHELL": pw.pw_shell}
    for f in unit["env_files"]:
        env.update(read_env_file(f))
    return env


def as_user(user: str, argv: list[str]) -> list[str]:
    return ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "--", *argv]


def sh(cmd: str) -> str:
    return subprocess.run(cmd, shell=True, text=True, capture_output=True).stdout.strip()


def main(spec_path: str, out_dir: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    resolved, _ = load_and_check(spec_path)
    name = resolved["name"]
    p = render.paths(resolved)
    unit = unit_settings(p["vllm_unit"])
    python = unit["argv"][0].rsplit("/", 1)[0] + "/python"
    result: dict = {
        "spec": spec_path,
        "spec_text": Path(spec_path).read_text(),
        "name": name,
        "exec_start": unit["argv"],
        "environment_files": unit["env_files"],
        "user": unit["User"],
    }
    env = systemd_env(unit)
    probe = [
        python,
        "-c",
        "import torch; torch.cuda.init(); print(torch.cuda.device_count(), torch.cuda.get_device_name(0))",
    ]
    pr = subprocess.run(
        as_user(unit["User"], probe), env=env, cwd=unit["WorkingDirectory"], text=True, capture_output=True
    )
    if pr.returncode == 0:
        mode, argv = "systemd-like (clean env + EnvironmentFiles, as User=)", as_user(unit["User"], unit["argv"])
    else:
        print(f"CUDA probe failed in the systemd-like environment:\n{pr.stderr[-2000:]}", flush=True)
        env = {**os.environ, **{k: v for f in unit["env_files"] for k, v in read_env_file(f).items()}}
        mode, argv = "fallback: machine env + EnvironmentFiles, as root", unit["argv"]
    result["mode"] = mode
    result["cuda_probe"] = (pr.stdout or pr.stderr[-500:]).strip()
    print(f"[{name}] {mode}: {' '.join(argv)}", flush=True)
    log_path = out / f"{name}.server.log"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv, env=env, cwd=unit["WorkingDirectory"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    base = f"http://127.0.0.1:{resolved['server']['port']}"
    try:
        deadline = resolved["server"]["health_timeout"]
        while True:
            try:
                wait_healthy(f"{base}/health", 5)
                break
            except TimeoutError:
                if proc.poll() is not None:
                    raise RuntimeError(f"vLLM exited {proc.returncode} before /health; see {log_path}")
                if time.monotonic() - t0 > deadline:
                    raise
        result["start_to_healthy_s"] = round(time.monotonic() - t0, 1)
        print(f"[{name}] healthy after {result['start_to_healthy_s']} s", flush=True)
        result["nvidia_smi_serving"] = sh(
            "nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader"
        )
        key = read_env_file(p["secrets_env"])["VLLM_API_KEY"]
        sm = resolved["smoke"]
        res = smoke_checks(
            base,
            resolved["model"]["served_name"],
            key,
            prompt=sm["prompt"],
            max_tokens=sm["max_tokens"],
            concurrency=sm["concurrency"],
            expect_auth=True,
        )
        print(res.summary(), flush=True)
        result["smoke"] = res.as_dict()
        vllm_bin = unit["argv"][0]
        tok = (
            unit["argv"][unit["argv"].index("--tokenizer") + 1]
            if "--tokenizer" in unit["argv"]
            else resolved["model"]["path"]
        )
        result["bench"] = {}
        for conc, n in BENCH:
            fn = f"{name}.bench-c{conc}.json"
            cmd = [
                vllm_bin,
                "bench",
                "serve",
                "--backend",
                "openai",
                "--endpoint",
                "/v1/completions",
                "--base-url",
                base,
                "--model",
                resolved["model"]["served_name"],
                "--tokenizer",
                tok,
                "--dataset-name",
                "random",
                "--random-input-len",
                str(IN_LEN),
                "--random-output-len",
                str(OUT_LEN),
                "--num-prompts",
                str(n),
                "--max-concurrency",
                str(conc),
                "--ignore-eos",
                "--seed",
                "0",
                "--percentile-metrics",
                "ttft,tpot,itl,e2el",
                "--metric-percentiles",
                "50,99",
                "--save-result",
                "--result-dir",
                str(out),
                "--result-filename",
                fn,
            ]
            benv = {**os.environ, **read_env_file(unit["env_files"][0]), "OPENAI_API_KEY": key}
            benv.pop("TMPDIR", None)
            br = subprocess.run(cmd, env=benv, text=True, capture_output=True, timeout=300)
            (out / f"{name}.bench-c{conc}.log").write_text(br.stdout[-20000:] + br.stderr[-20000:])
            if br.returncode != 0 or not (out / fn).exists():
                print(f"[{name}] bench c={conc} failed:\n{br.stderr[-3000:]}", flush=True)
                continue
            j = json.loads((out / fn).read_text())
            keep = {
                k: j.get(k)
                for k in (
                    "completed",
                    "total_input_tokens",
                    "total_output_tokens",
                    "duration",
                    "request_throughput",
                    "output_throughput",
                    "total_token_throughput",
                    "median_ttft_ms",
                    "p99_ttft_ms",
                    "median_tpot_ms",
                    "p99_tpot_ms",
                    "median_itl_ms",
                    "p99_itl_ms",
                    "median_e2el_ms",
                    "p99_e2el_ms",
                )
            }
            result["bench"][f"c{conc}"] = {
                "concurrency": conc,
                "num_prompts": n,
                "input_len": IN_LEN,
                "output_len": OUT_LEN,
                **keep,
            }
            print(
                f"[{name}] c={conc}: "
                + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in keep.items()),
                flush=True,
            )
    finally:
        # KillMode=mixed: SIGTERM to the main process, then SIGKILL to what is left of the group.
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log_text = log_path.read_text(errors="replace")

        def grab(rx, cast=float):
            m = re.findall(rx, log_text)
            return cast(m[-1].replace(",", "")) if m else None

        vllm_kv = {
            "gpu_kv_cache_tokens": grab(r"GPU KV cache size: ([\d,]+) tokens", int),
            "available_kv_cache_gib": grab(r"Available KV cache memory: ([\d.]+) GiB"),
            "model_loading_gib": grab(r"Model loading took ([\d.]+) GiB"),
            "max_concurrency_x": grab(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x"),
            "cuda_graph_gib": grab(r"[Gg]raph capturing finished in [\d.]+ secs?, took ([\d.-]+) GiB"),
            "init_engine_s": grab(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
            "torch_compile_s": grab(r"torch.compile took ([\d.]+) s in total"),
        }
        pl = planner.plan(resolved)
        planned = {
            k: pl.get(k)
            for k in (
                "weights_gib",
                "overhead_gib",
                "overhead_parts",
                "kv_cache_gib",
                "kv_tokens",
                "kv_blocks",
                "budget_gib",
                "kv_bytes_per_token",
            )
        }
        cmp = {"planner": planned, "vllm": vllm_kv}
        if vllm_kv["gpu_kv_cache_tokens"]:
            cmp["kv_tokens_error_pct"] = round(
                100 * (pl["kv_tokens"] - vllm_kv["gpu_kv_cache_tokens"]) / vllm_kv["gpu_kv_cache_tokens"], 2
            )
        if vllm_kv["available_kv_cache_gib"]:
            cmp["kv_gib_error_pct"] = round(
                100 * (pl["kv_cache_gib"] - vllm_kv["available_kv_cache_gib"]) / vllm_kv["available_kv_cache_gib"], 2
            )
            cmp["vllm_non_kv_gib"] = round(pl["budget_gib"] - vllm_kv["available_kv_cache_gib"], 2)
            cmp["vllm_overhead_gib"] = round(
                pl["budget_gib"] - vllm_kv["available_kv_cache_gib"] - (vllm_kv["model_loading_gib"] or 0), 2
            )
        result["kv_compare"] = cmp
        print(f"[{name}] KV: {json.dumps(cmp)}", flush=True)
        result["gpu"] = sh("nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader")
        result["vllm_version"] = sh(f"{python} -c 'import vllm; print(vllm.__version__)'")
        result["torch_version"] = sh(f"{python} -c 'import torch; print(torch.__version__)'")
        (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
