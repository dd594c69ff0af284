"""Shared helpers of the lab benchmarks (bench/deploy_scaling.py, bench/serve_latency.py).

The lab instance is the one the environment names (VLLM_FLEET_LAB_DIR, VLLM_FLEET_LAB_BRIDGE,
VLLM_FLEET_LAB_SUBNET), as for `vllm-fleet lab` and inventory/lab.py. Nothing here imports
pyinfra: deploys run as a user runs them, `pyinfra -y inventory/lab.py deploys/serve.py`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BIN = Path(sys.executable).parent
LAB_SPEC = REPO / "deployments" / "lab-tiny.yaml"
BENCH_NAME = "lab-bench"


def state_dir() -> Path:
    return Path(os.environ.get("VLLM_FLEET_LAB_DIR", "/var/lib/vllm-fleet-lab"))


def lab_state() -> dict | None:
    try:
        return json.loads((state_dir() / "state.json").read_text())
    except FileNotFoundError:
        return None


def lab_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("VLLM_FLEET_LAB")}


def lab_up(n: int) -> float:
    """`vllm-fleet lab up --hosts n` (grows or shrinks a lab that is up); seconds it took."""
    t0 = time.monotonic()
    r = subprocess.run(
        [str(BIN / "vllm-fleet"), "lab", "up", "--hosts", str(n)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
        stdin=subprocess.DEVNULL,
    )
    if r.returncode != 0:
        raise SystemExit(f"lab up --hosts {n} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return round(time.monotonic() - t0, 1)


def host_rss_mib() -> dict[str, int]:
    """RSS of every process of each lab host (its cgroup, supervisor and nspawn included), MiB."""
    from vllm_fleet.lab import nspawn

    st = nspawn.status(nspawn.LabConfig(), probe=False)
    return {h["name"]: h.get("rss_mib") for h in st.get("hosts", [])}


def ssh_argv(st: dict, host: str, user: str = "root") -> list[str]:
    addr = {h["name"]: h["address"] for h in st["hosts"]}[host]
    return [
        "ssh",
        "-i",
        st["ssh_key"],
        "-o",
        f"UserKnownHostsFile={st['known_hosts']}",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "BatchMode=yes",
        "-o",
        "ConnectTimeout=10",
        "-o",
        "LogLevel=ERROR",
        f"{user}@{addr}",
    ]


def ssh(
    st: dict, host: str, command: str, *, input: str | None = None, timeout: float = 600, check: bool = True
) -> subprocess.CompletedProcess:
    r = subprocess.run([*ssh_argv(st, host), command], input=input, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"ssh {host} {command!r} -> {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r


def machine() -> dict[str, Any]:
    """What else the control machine was doing: load average, memory, other labs' hosts."""
    load = Path("/proc/loadavg").read_text().split()[:3]
    mem = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        if k in ("MemTotal", "MemAvailable"):
            mem[k] = round(int(v.split()[0]) / 1024)
    # every systemd-nspawn on the machine (this lab's and other labs'): how busy the machine is
    nspawns = subprocess.run(["pgrep", "-c", "-x", "systemd-nspawn"], capture_output=True, text=True).stdout.strip()
    return {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "loadavg_1_5_15": [float(x) for x in load],
        "cpus": os.cpu_count(),
        "mem_total_mib": mem.get("MemTotal"),
        "mem_available_mib": mem.get("MemAvailable"),
        "nspawn_hosts_on_machine": int(nspawns or 0),
    }


def bench_spec(subnet: str, *, kv_gib: int = 1, out_dir: Path | None = None) -> Path:
    """deployments/lab-tiny.yaml for benchmarks: its own name (own paths, nginx site, client
    settings and key file, so it never overwrites lab-tiny's), the smallest KV cache the schema
    allows (engine.cpu_kv_cache_gib is a whole number of GiB, at least 1), vLLM bound to
    0.0.0.0 so one nginx can front several servers, /metrics open to this lab's subnet, and a
    longer health deadline (several vLLMs start at once on few cores)."""
    spec = yaml.safe_load(LAB_SPEC.read_text())
    spec["name"] = BENCH_NAME
    spec["description"] = (
        "benchmarks: lab-tiny with a small KV cache, vLLM on 0.0.0.0 for several servers behind one nginx"
    )
    spec["engine"]["cpu_kv_cache_gib"] = kv_gib
    spec["server"]["host"] = "0.0.0.0"
    spec["server"]["health_timeout"] = 1200
    spec["server"]["api_key"] = {"file": f"~/.config/vllm-fleet/{BENCH_NAME}.key", "generate": True}
    spec["proxy"]["metrics_allow"] = ["127.0.0.1", subnet]
    out_dir = out_dir or Path(tempfile.mkdtemp(prefix="vllm-fleet-bench-"))
    path = out_dir / f"{BENCH_NAME}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    r = subprocess.run([str(BIN / "vllm-fleet"), "validate", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench spec invalid:\n{r.stdout}{r.stderr}")
    return path


PHASES = (
    ("connect", "--> Connecting to hosts"),
    ("prepare", "--> Preparing operation"),
    ("run", "--> Beginning operation run"),
    ("results", "--> Results"),
)


def deploy(spec: Path, servers: list[str], timeout: float = 3600, count_commands: bool = False) -> dict[str, Any]:
    """One `pyinfra -y inventory/lab.py deploys/serve.py` with `servers` in the servers group
    (the proxy stays on lab1). Wall time, time per phase (from pyinfra's own headings, read as
    they arrive), pyinfra's grand total and the operations that changed something.
    ``count_commands``: with `-vv`, pyinfra prints every command it sends (`[host] >>> ...`,
    facts included): their number per host is recorded (the printing slows the run a little,
    so such a run is not one of the timed ones)."""
    env = {
        **os.environ,
        "VLLM_FLEET_SPEC": str(spec),
        "VLLM_FLEET_LAB_SERVERS": ",".join(servers),
        "VLLM_FLEET_LAB_PROXY": "lab1",
        "PYTHONUNBUFFERED": "1",
    }
    argv = [str(BIN / "pyinfra"), "-y", *(["-vv"] if count_commands else []), "inventory/lab.py", "deploys/serve.py"]
    load1 = os.getloadavg()[0]
    t0 = time.monotonic()
    p = subprocess.Popen(
        argv,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
        bufsize=1,
    )
    marks: dict[str, float] = {}
    lines = []
    assert p.stdout is not None
    for line in p.stdout:
        lines.append(line)
        for name, head in PHASES:
            if name not in marks and line.startswith(head):
                marks[name] = time.monotonic() - t0
        if "smoke" not in marks and line.startswith("--> Starting operation: Smoke tests"):
            marks["smoke"] = time.monotonic() - t0
    rc = p.wait(timeout=timeout)
    wall = time.monotonic() - t0
    out = "".join(lines)
    seq = [("start", 0.0)] + [(n, marks[n]) for n, _ in PHASES if n in marks] + [("end", wall)]
    phases = {f"{a}_s": round(tb - ta, 2) for (a, ta), (_, tb) in zip(seq, seq[1:]) if a != "start"}
    phases["load_s"] = round(marks.get("connect", wall), 2)  # python start, config, inventory, the spec's checks
    if "smoke" in marks and "results" in marks:
        phases["smoke_s"] = round(marks["results"] - marks["smoke"], 2)
    total = grand_total(out)
    result = {
        "servers": servers,
        "rc": rc,
        "loadavg1_before": round(load1, 2),
        "wall_s": round(wall, 2),
        "phases": phases,
        "grand_total": total,
        "changed_ops": changed_ops(out),
        "output_tail": out[-4000:] if rc else None,
        "_out": out,
    }
    if count_commands:
        result["remote_commands"] = remote_commands(out)
    return result


def remote_commands(out: str) -> dict[str, int]:
    """{host: commands pyinfra sent it} from `-vv` output (`[lab1] >>> sudo -H -n sh -c '...'`)."""
    counts: dict[str, int] = {}
    for line in re.sub(r"\x1b\[[0-9;]*m", "", out).splitlines():
        m = re.match(r"^\s*\[([^\]]+)\]\s+>>> ", line)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return dict(sorted(counts.items()))


def grand_total(out: str) -> dict[str, int] | None:
    """pyinfra's results table: 'Grand total  <ops>  <success>  <error>  <no change>' ('-' = 0)."""
    m = re.search(r"Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", out)
    if not m:
        return None
    num = [0 if g == "-" else int(g) for g in m.groups()]
    return dict(zip(("ops", "changed", "error", "no_change"), num))


def changed_ops(out: str) -> list[str]:
    rows = []
    for line in out.splitlines():
        m = re.match(r"\s{4}(.+?)\s{2,}(\d+)\s+(\d+|-)\s+(\d+|-)\s+(\d+|-)\s*$", line)
        if m and m.group(3) != "-" and not m.group(1).startswith("Grand total"):
            rows.append(m.group(1).strip())
    return rows


def median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    n = len(values)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def pip_cache() -> dict[str, Any]:
    st = lab_state() or {}
    d = Path(st.get("pip_cache_dir") or "/var/cache/vllm-fleet/pip")
    size = 0
    files = 0
    if d.is_dir():
        for f in d.rglob("*"):
            if f.is_file():
                files += 1
                size += f.stat().st_size
    return {"dir": str(d), "mib": round(size / 2**20), "files": files}


def git_commit() -> str | None:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    return (r.stdout.strip() + ("+changes" if dirty else "")) if r.returncode == 0 else None


def which(name: str) -> str | None:
    return shutil.which(name)
