"""`vllm-fleet status INVENTORY`: one row per vLLM instance (as the layout puts the spec on the
inventory): its unit's state, the installed vLLM version, the served model and health, read over
SSH in parallel (fabric, one connection per host), independent of pyinfra.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vllm_fleet.spec.inventory import InventoryError, load_inventory



def _probe_script(resolved: dict[str, Any], instances: list[Any] | None = None) -> str:
    """A bash script printing ``key=value`` lines; with several instances, ``[N]`` before each
    instance's lines."""
    prefix = resolved["install"]["prefix"]
    pkg = resolved["install"]["vllm_package"]
    py = f"{prefix}/env/bin/python"
    lines = [f"echo version=$({shlex.quote(py)} -c {shlex.quote(f'import importlib.metadata as m; print(m.version({pkg!r}))')} 2>/dev/null || echo none)"]
    for inst in instances or [None]:
        unit = inst.unit if inst else "vllm.service"
        port = inst.port if inst else resolved["server"]["port"]
        if inst is not None:
            lines.append(f"echo '[{inst.index}]'")
        lines += [
            f"echo unit=$(systemctl is-active {unit} 2>/dev/null || true)",
            f"echo enabled=$(systemctl is-enabled {unit} 2>/dev/null || true)",
            f"echo health=$(curl -s -o /dev/null -w '%{{http_code}}' --max-time 5 http://127.0.0.1:{port}/health || true)",
            f"echo models=$(curl -s --max-time 5 -H \"Authorization: Bearer $(sed -n 's/^VLLM_API_KEY=//p' {resolved['install']['config_dir']}/secrets.env 2>/dev/null)\" "
            f"http://127.0.0.1:{port}/v1/models | tr -d '\\n' | head -c 2000)",
        ]
    return "; ".join(lines)


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


def _parse(stdout: str) -> dict[str, dict[str, Any]]:
    """{index or "": {key: value}}: the script's output, per instance."""
    out: dict[str, dict[str, Any]] = {"": {}}
    cur = ""
    for line in stdout.splitlines():
        if line.startswith("[") and line.endswith("]"):
            cur = line[1:-1]
            out[cur] = {}
            continue
        key, _, value = line.partition("=")
        out[cur][key] = value
    return out


def probe_host(name: str, info: dict[str, Any], script: str) -> list[dict[str, Any]]:
    data = info["data"]
    conn = connection(info["address"], data)
    sudo = data.get("ssh_user", "root") != "root"
    rows: list[dict[str, Any]] = []
    try:
        r = (conn.sudo if sudo else conn.run)(f"bash -c {shlex.quote(script)}", hide=True, warn=True, timeout=60)
        parsed = _parse(r.stdout)
        common = parsed.pop("")
        for index, values in (parsed or {"": common}).items():
            out: dict[str, Any] = {"host": name, "address": info["address"], **common, **values}
            if index != "":
                out["instance"] = f"{name}:{index}"
            try:
                out["models"] = [m["id"] for m in json.loads(out.get("models") or "{}").get("data", [])]
            except ValueError:
                out["models"] = []
            out["health"] = "ok" if out.get("health") == "200" else f"down ({out.get('health') or 'no answer'})"
            rows.append(out)
    except Exception as exc:  # unreachable host, bad key: report, go on with the others
        rows.append({"host": name, "address": info["address"], "error": f"{type(exc).__name__}: {exc}"})
    finally:
        conn.close()
    return rows


def status_main(args: argparse.Namespace) -> int:
    from vllm_fleet.commands.cli import _load

    from vllm_fleet.spec.source import SpecSourceError, spec_source

    try:
        hosts = load_inventory(args.inventory)
    except InventoryError as exc:
        print(f"vllm-fleet status: {exc}", file=sys.stderr)
        return 1
    # The spec: --spec, else the inventory's own (vllm_fleet.spec.source: data vllm_fleet_spec,
    # $VLLM_FLEET_SPEC, the lab's); never a silent default for other inventories.
    spec_path, why = args.spec, f"{args.inventory}: no host"
    if not spec_path:
        servers_first = sorted(hosts, key=lambda n: "servers" not in hosts[n]["groups"])
        for name in servers_first:
            try:
                spec_path = spec_source(hosts[name]["data"], name)[0]
                break
            except SpecSourceError as exc:
                why = exc
        if not spec_path:
            print(f"vllm-fleet status: {why} (here: `vllm-fleet status INVENTORY --spec SPEC`)", file=sys.stderr)
            return 1
    resolved, _ = _load(spec_path, hardware=False)
    from vllm_fleet.render.layout import LayoutError, build

    try:
        layout = build([resolved], hosts)
    except LayoutError as exc:
        print(f"vllm-fleet status: {args.inventory}: {exc}", file=sys.stderr)
        return 1
    servers = {n: h.instances for n, h in layout.hosts.items() if h.instances}
    if not servers:
        print(f"vllm-fleet status: {args.inventory}: no vLLM instance of {resolved['name']} in the layout", file=sys.stderr)
        return 1
    with ThreadPoolExecutor(max_workers=min(16, len(servers))) as pool:
        per_host = list(pool.map(lambda item: probe_host(item[0], hosts[item[0]], _probe_script(resolved, item[1])), servers.items()))
    rows = [r for rs in per_host for r in rs]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'instance':<14} {'address':<15} {'unit':<10} {'enabled':<9} {'vllm':<12} {'health':<14} models")
        for r in rows:
            label = r.get("instance", r["host"])
            if "error" in r:
                print(f"{label:<14} {r['address']:<15} UNREACHABLE: {r['error']}")
                continue
            print(f"{label:<14} {r['address']:<15} {r.get('unit', '?'):<10} {r.get('enabled', '?'):<9} {r.get('version', '?'):<12} {r['health']:<14} {','.join(r['models']) or '-'}")
    bad = [r for r in rows if "error" in r or r.get("health") != "ok"]
    return 1 if bad else 0
