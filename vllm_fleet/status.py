"""`vllm-fleet status INVENTORY`: per host, the vLLM unit's state, the installed vLLM version,
the served model and health, read over SSH in parallel (fabric), independent of pyinfra.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .inventory import InventoryError, load_inventory



def _probe_script(resolved: dict[str, Any]) -> str:
    prefix = resolved["install"]["prefix"]
    pkg = resolved["install"]["vllm_package"]
    port = resolved["server"]["port"]
    py = f"{prefix}/env/bin/python"
    return "; ".join([
        "echo unit=$(systemctl is-active vllm.service 2>/dev/null || true)",
        "echo enabled=$(systemctl is-enabled vllm.service 2>/dev/null || true)",
        f"echo version=$({shlex.quote(py)} -c {shlex.quote(f'import importlib.metadata as m; print(m.version({pkg!r}))')} 2>/dev/null || echo none)",
        f"echo health=$(curl -s -o /dev/null -w '%{{http_code}}' --max-time 5 http://127.0.0.1:{port}/health || true)",
        f"echo models=$(curl -s --max-time 5 -H \"Authorization: Bearer $(sed -n 's/^VLLM_API_KEY=//p' {resolved['install']['config_dir']}/secrets.env 2>/dev/null)\" "
        f"http://127.0.0.1:{port}/v1/models | tr -d '\\n' | head -c 2000)",
    ])


def connection(address: str, data: dict[str, Any]) -> Any:
    """A fabric Connection with the inventory's SSH data (ssh_user, ssh_key, ssh_port, host-key checking)."""
    from fabric import Connection

    kwargs: dict[str, Any] = {}
    if data.get("ssh_key"):
        kwargs["key_filename"] = os.path.expanduser(data["ssh_key"])
    conn = Connection(address, user=data.get("ssh_user", "root"), port=data.get("ssh_port", 22),
                      connect_timeout=10, connect_kwargs=kwargs)
    # Host keys are new on every lab bring-up; the inventory says whether to check them.
    if data.get("ssh_strict_host_key_checking", "yes") in ("no", False, "off"):
        from paramiko import AutoAddPolicy

        conn.client.set_missing_host_key_policy(AutoAddPolicy())
    elif data.get("ssh_known_hosts_file") and os.path.isfile(os.path.expanduser(data["ssh_known_hosts_file"])):
        conn.client.load_host_keys(os.path.expanduser(data["ssh_known_hosts_file"]))
    return conn


def probe_host(name: str, info: dict[str, Any], script: str) -> dict[str, Any]:
    data = info["data"]
    conn = connection(info["address"], data)
    sudo = data.get("ssh_user", "root") != "root"
    out: dict[str, Any] = {"host": name, "address": info["address"]}
    try:
        r = (conn.sudo if sudo else conn.run)(f"bash -c {shlex.quote(script)}", hide=True, warn=True, timeout=30)
        for line in r.stdout.splitlines():
            key, _, value = line.partition("=")
            out[key] = value
        try:
            out["models"] = [m["id"] for m in json.loads(out.get("models") or "{}").get("data", [])]
        except ValueError:
            out["models"] = []
        out["health"] = "ok" if out.get("health") == "200" else f"down ({out.get('health') or 'no answer'})"
    except Exception as exc:  # unreachable host, bad key: report, go on with the others
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return out


def status_main(args: argparse.Namespace) -> int:
    from .cli import _load
    from .specsource import SpecSourceError, spec_source

    try:
        hosts = load_inventory(args.inventory)
    except InventoryError as exc:
        print(f"vllm-fleet status: {exc}", file=sys.stderr)
        return 1
    servers = {n: h for n, h in hosts.items() if set(h["groups"]) & {"servers", "ray_head"}} or hosts
    # The spec: --spec, else each host's own (vllm_fleet.specsource: data vllm_fleet_spec, $VLLM_FLEET_SPEC, the lab's)
    scripts: dict[str, str] = {}
    jobs = []
    for name, info in servers.items():
        try:
            path = args.spec or spec_source(info["data"], name)[0]
        except SpecSourceError as exc:
            print(f"vllm-fleet status: {exc} (here: `vllm-fleet status INVENTORY --spec SPEC`)", file=sys.stderr)
            return 1
        if path not in scripts:
            scripts[path] = _probe_script(_load(path, hardware=False)[0])
        jobs.append((name, info, scripts[path]))
    with ThreadPoolExecutor(max_workers=min(16, len(jobs))) as pool:
        rows = list(pool.map(lambda job: probe_host(*job), jobs))
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'host':<10} {'address':<15} {'unit':<10} {'enabled':<9} {'vllm':<12} {'health':<14} models")
        for r in rows:
            if "error" in r:
                print(f"{r['host']:<10} {r['address']:<15} UNREACHABLE: {r['error']}")
                continue
            print(f"{r['host']:<10} {r['address']:<15} {r.get('unit', '?'):<10} {r.get('enabled', '?'):<9} {r.get('version', '?'):<12} {r['health']:<14} {','.join(r['models']) or '-'}")
    bad = [r for r in rows if "error" in r or r.get("health") != "ok"]
    return 1 if bad else 0
