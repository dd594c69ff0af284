#!/usr/bin/env python3
"""The measuring half of the systemd proof on the GPU machine (bench/gpu/systemd_proof.sh runs it
inside the systemd namespace, so systemctl / journalctl / systemd-analyze talk to that systemd).

    python3 bench/gpu/systemd_proof.py deployed SPEC DEPLOY_LOG          # after deploy 1: smoke, KV figure
    python3 bench/gpu/systemd_proof.py second SPEC DEPLOY_LOG            # after deploy 2: changes counted
    python3 bench/gpu/systemd_proof.py bench SPEC                        # vllm bench serve, nginx + direct, c1 + c16
    python3 bench/gpu/systemd_proof.py kill SPEC                         # kill -9 MainPID -> /health, smoke
    python3 bench/gpu/systemd_proof.py security SPEC                     # systemd-analyze security + sandbox trials
    python3 bench/gpu/systemd_proof.py report SPEC OUTFILE               # one JSON (bench/results/h200-systemd-*.json)

Every step adds its part to /var/tmp/vllm-fleet-proof/state.json, so a step that runs out of time leaves the
others' results. Readers are independent of the code under test where that matters: curl-like
HTTP (requests) for /health, `systemctl show`, `journalctl`, `systemd-analyze security`, and
pyinfra's own summary table for the change count.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from vllm_fleet.specs import planner  # noqa: E402

from vllm_fleet.render import files as render
from vllm_fleet.serving.smoke import smoke_checks  # noqa: E402
from vllm_fleet.specs.load import load_and_check  # noqa: E402

STATE = Path("/var/tmp/vllm-fleet-proof/state.json")
# the layout's unit for deployments/h200-systemd.yaml (the recorded run: vllm.service)
UNIT = "vllm-h200-systemd-0.service"
BENCH = [(1, 8), (16, 64)]  # (concurrency, prompts)
IN_LEN, OUT_LEN = 512, 256
DROPIN = Path(f"/etc/systemd/system/{UNIT}.d/zz-proof.conf")


def state() -> dict:
    return json.loads(STATE.read_text()) if STATE.exists() else {}


def save(**parts) -> None:
    s = state()
    s.update(parts)
    STATE.parent.mkdir(parents=True, exist_ok=True)
    STATE.write_text(json.dumps(s, indent=2) + "\n")


def sh(cmd: str, timeout: float = 120) -> str:
    r = subprocess.run(cmd, shell=True, text=True, capture_output=True, timeout=timeout)
    return (r.stdout + r.stderr).strip()


def read_env_file(path: str) -> dict[str, str]:
    env = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            if len(v) >= 2 and v[0] == v[-1] == '"':
                v = v[1:-1].replace('\\"', '"').replace("\\\\", "\\")
            env[k] = v
    return env


def ctx(spec_path: str) -> dict:
    resolved, _ = load_and_check(spec_path)
    p = render.paths(resolved)
    key = read_env_file(p["secrets_env"])["VLLM_API_KEY"]
    return {
        "r": resolved,
        "p": p,
        "key": key,
        "direct": f"http://127.0.0.1:{resolved['server']['port']}",
        "nginx": f"http://127.0.0.1:{resolved['proxy']['listen']}",
    }


def smoke(c: dict, base: str) -> dict:
    sm = c["r"]["smoke"]
    res = smoke_checks(
        base,
        c["r"]["model"]["served_name"],
        c["key"],
        prompt=sm["prompt"],
        max_tokens=sm["max_tokens"],
        concurrency=sm["concurrency"],
        expect_auth=True,
    )
    return res.as_dict()


def smoke_ok(d: dict) -> bool:
    return all(ch["ok"] for ch in d.get("checks", []))


def health(base: str) -> int:
    import requests

    try:
        return requests.get(f"{base}/health", timeout=2).status_code
    except requests.RequestException:
        return 0


def pyinfra_totals(log: str) -> dict:
    """pyinfra's own summary: the 'Grand total' row (operations, changed, errors, no change) and
    each operation row that changed something (the lab tests read it the same way)."""
    m = re.search(r"Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", log)
    total = dict(zip(("ops", "changed", "error", "no_change"), m.groups())) if m else {}
    changed = []
    for line in log.splitlines():
        row = re.match(r"\s{4}(.+?)\s{2,}(\d+)\s+(\d+|-)\s+(\d+|-)\s+(\d+|-)\s*$", line)
        if row and row.group(3) != "-" and not row.group(1).startswith("Grand total"):
            changed.append(row.group(1).strip())
    n = total.get("changed")
    return {
        "grand_total": total,
        "changed": 0 if n in (None, "-") else int(n),
        "changed_operations": changed,
        "deploy_smoke_lines": re.findall(r"\b(PASS|WARN|FAIL)  ([a-z0-9-]+)", log),
    }


def cmd_deployed(spec_path: str, log_path: str) -> None:
    c = ctx(spec_path)
    log = Path(log_path).read_text(errors="replace")
    t = pyinfra_totals(log)
    save(
        deploy1={
            "totals": t["grand_total"],
            "smoke_lines": t["deploy_smoke_lines"],
            "seconds": state().get("deploy1_s"),
            "log_tail": log[-4000:],
        },
        smoke={"through_nginx": smoke(c, c["nginx"]), "direct": smoke(c, c["direct"])},
        unit_state=sh(
            f"systemctl show -p ActiveState -p SubState -p NRestarts -p MainPID -p ExecMainStartTimestamp {UNIT} "
            "nginx.service"
        ),
        systemd=sh("systemctl --version | head -1"),
        system_state=sh("systemctl is-system-running"),
        journal_start=sh(
            f"journalctl -u {UNIT} -o cat --no-pager | grep -E 'GPU KV cache size|Available KV cache memory|Model "
            "loading took|init engine|torch.compile took|Graph capturing finished|Maximum concurrency' | tail -20"
        ),
    )


def cmd_second(spec_path: str, log_path: str) -> None:
    log = Path(log_path).read_text(errors="replace")
    t = pyinfra_totals(log)
    save(
        second_deploy={
            "totals": t["grand_total"],
            "changed_operations": t["changed_operations"],
            "smoke_lines": t["deploy_smoke_lines"],
            "seconds": state().get("deploy2_s"),
            "log_tail": log[-3000:],
        },
        second_deploy_changed=t["changed"],
    )


def cmd_bench(spec_path: str) -> None:
    c = ctx(spec_path)
    r = c["r"]
    vllm_bin = f"{r['install']['prefix']}/env/bin/vllm"
    tok = r["engine"]["extra_args"][r["engine"]["extra_args"].index("--tokenizer") + 1]
    out = Path("/var/tmp/vllm-fleet-proof/bench")
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    env = {**os.environ, **read_env_file(c["p"]["vllm_env"]), "OPENAI_API_KEY": c["key"]}
    env.pop("TMPDIR", None)
    env["HOME"] = "/root"
    for path in ("nginx", "direct"):
        for conc, n in BENCH:
            fn = f"{path}-c{conc}.json"
            cmd = [
                vllm_bin,
                "bench",
                "serve",
                "--backend",
                "openai",
                "--endpoint",
                "/v1/completions",
                "--base-url",
                c[path],
                "--model",
                r["model"]["served_name"],
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
                str((10 if path == "nginx" else 20) + conc),
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
            br = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=240)
            if br.returncode != 0 or not (out / fn).exists():
                results[f"{path}-c{conc}"] = {"error": (br.stdout + br.stderr)[-2000:]}
                print(f"bench {path} c={conc} failed: {(br.stdout + br.stderr)[-1500:]}", flush=True)
                continue
            j = json.loads((out / fn).read_text())
            keep = {
                k: j.get(k)
                for k in (
                    "completed",
                    "failed",
                    "duration",
                    "request_throughput",
                    "output_throughput",
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
            results[f"{path}-c{conc}"] = {
                "path": path,
                "base_url": c[path],
                "concurrency": conc,
                "num_prompts": n,
                "input_len": IN_LEN,
                "output_len": OUT_LEN,
                **keep,
            }
            print(
                f"bench {path} c={conc}: ttft p50 {keep['median_ttft_ms']:.1f} ms p99 {keep['p99_ttft_ms']:.1f}, "
                f"tpot p50 {keep['median_tpot_ms']:.2f} p99 {keep['p99_tpot_ms']:.2f} ms, "
                f"{keep['output_throughput']:.0f} tok/s",
                flush=True,
            )
    for conc, _ in BENCH:
        a, b = results.get(f"nginx-c{conc}", {}), results.get(f"direct-c{conc}", {})
        if "median_ttft_ms" in a and "median_ttft_ms" in b:
            results[f"proxy_ttft_overhead_c{conc}_ms"] = {
                "p50": round(a["median_ttft_ms"] - b["median_ttft_ms"], 2),
                "p99": round(a["p99_ttft_ms"] - b["p99_ttft_ms"], 2),
            }
    old = state().get("bench")
    if old:  # the first run used one seed for both paths: the second path hit the prefix cache
        save(bench_first_run_same_prompts=old)
    save(bench=results)


def wait_smoke(c: dict, t0: float, deadline: float) -> tuple[float | None, float | None, dict]:
    t_health = None
    while time.monotonic() - t0 < deadline:
        if health(c["direct"]) == 200:
            t_health = time.monotonic() - t0
            break
        time.sleep(0.25)
    if t_health is None:
        return None, None, {}
    last: dict = {}
    while time.monotonic() - t0 < deadline:
        last = smoke(c, c["nginx"])
        if smoke_ok(last):
            return t_health, time.monotonic() - t0, last
        time.sleep(1)
    return t_health, None, last


def cmd_kill(spec_path: str) -> None:
    c = ctx(spec_path)
    pid = sh(f"systemctl show -p MainPID --value {UNIT}")
    restarts0 = sh(f"systemctl show -p NRestarts --value {UNIT}")
    assert pid.isdigit() and pid != "0", f"no MainPID: {pid}"
    t0 = time.monotonic()
    os.kill(int(pid), 9)
    # /health goes away first (the API server is the main process)
    while health(c["direct"]) == 200 and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    t_health, t_smoke, last = wait_smoke(c, t0, 400)
    save(
        restart_after_kill_s={
            "killed_main_pid": int(pid),
            "health_200": round(t_health, 1) if t_health else None,
            "smoke_pass": round(t_smoke, 1) if t_smoke else None,
            "restart_sec": render.RESTART_SEC if hasattr(render, "RESTART_SEC") else None,
            "nrestarts": [restarts0, sh(f"systemctl show -p NRestarts --value {UNIT}")],
            "new_main_pid": sh(f"systemctl show -p MainPID --value {UNIT}"),
            "smoke_after": last.get("checks") if last else None,
        }
    )
    print(f"kill -9 {pid}: /health after {t_health}, smoke after {t_smoke}", flush=True)


def exposure() -> tuple[float | None, str]:
    out = sh(f"systemd-analyze security {UNIT} --no-pager", timeout=60)
    m = re.search(r"Overall exposure level for \S+: ([\d.]+) (\S+)", out)
    return (float(m.group(1)) if m else None), out


def nvidia_device_allow() -> list[str]:
    """DeviceAllow= lines for every NVIDIA character device group the kernel lists."""
    names = []
    for line in Path("/proc/devices").read_text().splitlines():
        words = line.split()
        if len(words) == 2 and "nvidia" in words[1] and words[1] not in names:
            names.append(words[1])
    return [f"DeviceAllow=char-{n} rw" for n in names]


TRIALS = {
    # the CPU unit's filter: an ordinary service's system calls, anything else EPERM
    "syscall-filter": ["SystemCallFilter=@system-service", "SystemCallErrorNumber=EPERM"],
    # and a closed device policy that lets only the NVIDIA devices (and the pseudo devices) in,
    # which also allows ProtectClock= (it implies a device allow-list)
    "syscall-filter+devices": [
        "SystemCallFilter=@system-service",
        "SystemCallErrorNumber=EPERM",
        "DevicePolicy=closed",
        "@NVIDIA_DEVICES@",
        "ProtectClock=yes",
    ],
}


def trial(c: dict, name: str, lines: list[str]) -> dict:
    body = []
    for line in lines:
        body += nvidia_device_allow() if line == "@NVIDIA_DEVICES@" else [line]
    DROPIN.parent.mkdir(parents=True, exist_ok=True)
    DROPIN.write_text("[Service]\n" + "\n".join(body) + "\n")
    sh("systemctl daemon-reload")
    score, _ = exposure()
    t0 = time.monotonic()
    sh(f"systemctl restart {UNIT}", timeout=60)
    t_health, t_smoke, last = wait_smoke(c, t0, 300)
    ok = t_smoke is not None
    res = {
        "lines": body,
        "exposure": score,
        "healthy_after_s": round(t_health, 1) if t_health else None,
        "smoke_pass": ok,
        "smoke_checks": [(ch["name"], ch["ok"]) for ch in last.get("checks", [])] if last else None,
    }
    if not ok:
        res["journal_tail"] = sh(f"journalctl -u {UNIT} -n 60 --no-pager -o cat")[-6000:]
    res["dmesg_seccomp"] = sh("dmesg | grep -i -E 'audit.*(seccomp|syscall)' | tail -5")
    print(f"trial {name}: exposure {score}, smoke {'pass' if ok else 'FAIL'}", flush=True)
    return res


def cmd_security(spec_path: str) -> None:
    c = ctx(spec_path)
    DROPIN.unlink(missing_ok=True)
    sh("systemctl daemon-reload")
    score, table = exposure()
    Path("/var/tmp/vllm-fleet-proof/security-rendered.txt").write_text(table + "\n")
    result = {"rendered_unit": score, "rendered_table_tail": table[-2500:], "trials": {}}
    save(exposure=result)
    for name, lines in TRIALS.items():
        result["trials"][name] = trial(c, name, lines)
        save(exposure=result)
        if not result["trials"][name]["smoke_pass"]:
            break


def cmd_report(spec_path: str, out_file: str) -> None:
    resolved, _ = load_and_check(spec_path)
    s = state()
    python = f"{resolved['install']['prefix']}/env/bin/python"
    journal = sh(f"journalctl -u {UNIT} -o cat --no-pager", timeout=60)

    def first(rx, cast=float):
        m = re.findall(rx, journal)
        return cast(m[0].replace(",", "")) if m else None

    vllm_kv = {
        "gpu_kv_cache_tokens": first(r"GPU KV cache size: ([\d,]+) tokens", int),
        "available_kv_cache_gib": first(r"Available KV cache memory: ([\d.]+) GiB"),
        "model_loading_gib": first(r"Model loading took ([\d.]+) GiB"),
        "init_engine_s": first(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
        "torch_compile_s": first(r"torch.compile took ([\d.]+) s in total"),
    }
    pl = planner.plan(resolved)
    kv = {
        "planner": {k: pl.get(k) for k in ("weights_gib", "overhead_gib", "kv_cache_gib", "kv_tokens", "budget_gib")},
        "vllm": vllm_kv,
    }
    if vllm_kv["gpu_kv_cache_tokens"]:
        kv["kv_tokens_error_pct"] = round(
            100 * (pl["kv_tokens"] - vllm_kv["gpu_kv_cache_tokens"]) / vllm_kv["gpu_kv_cache_tokens"], 2
        )
    report = {
        "gpu": sh("nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader"),
        "vllm_version": sh(f"{python} -c 'import vllm; print(vllm.__version__)' 2>/dev/null | tail -1"),
        "torch_version": sh(f"{python} -c 'import torch; print(torch.__version__)' 2>/dev/null | tail -1"),
        "spec": {
            "path": spec_path,
            "text": Path(ROOT / spec_path).read_text()
            if not Path(spec_path).is_absolute()
            else Path(spec_path).read_text(),
        },
        "systemd": s.get("systemd") or sh("systemctl --version | head -1"),
        "smoke": s.get("smoke"),
        "second_deploy_changed": s.get("second_deploy_changed"),
        "restart_after_kill_s": s.get("restart_after_kill_s"),
        "exposure": s.get("exposure"),
        "bench": s.get("bench"),
        "kv_compare": kv,
        **{
            k: s.get(k)
            for k in (
                "image",
                "deploy1",
                "second_deploy",
                "unit_state",
                "system_state",
                "deploy1_s",
                "deploy2_s",
                "rendered_unit",
                "exec_start_pre",
                "no_deb",
                "deploy1_rc",
                "not_done",
            )
        },
    }
    Path(out_file).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out_file}", flush=True)


def cmd_note(key: str, value: str) -> None:
    """Record a value from the shell script (JSON if it parses, else the text; @FILE reads a file)."""
    if value.startswith("@"):
        value = Path(value[1:]).read_text(errors="replace")
    try:
        save(**{key: json.loads(value)})
    except ValueError:
        save(**{key: value.strip()})


if __name__ == "__main__":
    what, *args = sys.argv[1:]
    {
        "note": cmd_note,
        "deployed": cmd_deployed,
        "second": cmd_second,
        "bench": cmd_bench,
        "kill": cmd_kill,
        "security": cmd_security,
        "report": cmd_report,
    }[what](*args)
