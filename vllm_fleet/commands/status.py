"""`vllm-fleet status INVENTORY`: one row per vLLM instance (as the layout puts the spec on the
inventory): its unit's state, the installed vLLM version, the served model and health, read by
vllm_fleet/host/scripts/status_probe.py on every host at once through the one transport
(vllm_fleet.host.transport: pyinfra's connectors, so @local and SSH hosts alike). A unit in a
crash loop (systemd's auto-restart, or active again only moments after a restart) is failing even
when something answers on its port; any row that is not "ok" makes the exit code 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from vllm_fleet.specs.inventory import InventoryError, load_inventory


#: a unit that became active less than this many seconds ago after a restart is in a crash loop
#: (systemd restarts it every RestartSec: it is "active" for moments between the failures)
RECENT_RESTART_S = 120


def probe_command(resolved: dict[str, Any], instances: list[Any]) -> Any:
    """The status probe (vllm_fleet/host/scripts/status_probe.py, the system python3) for these instances."""
    from vllm_fleet.host.programs import python
    from vllm_fleet.render import command
    from vllm_fleet.render.files import paths

    return python(
        "python3",
        "status_probe.py",
        command.env_python(resolved),
        resolved["install"]["vllm_package"],
        paths(resolved)["secrets_env"],
        *(f"{i.unit}:{i.port}" for i in instances),
    )


def judge(inst: dict[str, Any]) -> tuple[str, str]:
    """(unit column, health column) of one instance as status_probe.py read it: a crash loop
    (systemd's auto-restart between failures, or active again only moments after a restart) is
    failing, whatever answers on the port; healthy is an active unit whose /health says 200."""
    active, sub, restarts = inst.get("active") or "unknown", inst.get("sub") or "", int(inst.get("restarts") or 0)
    unit = active if sub in ("", "running", "exited") or active == sub else f"{active} ({sub})"
    since = inst.get("active_for_s")
    looping = (
        sub == "auto-restart"
        or (active == "activating" and restarts > 0)
        or (active == "active" and restarts > 0 and since is not None and since < RECENT_RESTART_S)
    )
    if inst.get("load") == "not-found":
        return "not-found", "down (no unit)"
    if looping:
        return unit, f"failing (crash loop: {restarts} restarts)"
    if active != "active":
        return unit, f"failing ({active})"
    code = inst.get("health")
    return unit, "ok" if code == 200 else f"down ({code or 'no answer'})"


def probe_hosts(
    resolved: dict[str, Any], hosts: dict[str, dict[str, Any]], servers: dict[str, list[Any]]
) -> list[dict[str, Any]]:
    """One row per instance, every host at once through the one transport; an unreachable host
    is one row with ``error``."""
    from vllm_fleet.host.transport import HostError, Transport

    def one(name: str) -> list[dict[str, Any]]:
        base = {"host": name, "address": hosts[name]["address"]}
        try:
            r = t.run(name, probe_command(resolved, servers[name]), timeout=90)
            doc = json.loads(r.stdout.strip().splitlines()[-1])
        except HostError as exc:
            return [{**base, "error": str(exc)}]
        except (ValueError, IndexError):
            return [{**base, "error": f"the status probe printed no result: {(r.stderr or r.stdout).strip()[-300:]}"}]
        rows = []
        for i, inst in zip(servers[name], doc["instances"]):
            unit, health = judge(inst)
            rows.append(
                {
                    **base,
                    "instance": f"{name}:{i.index}",
                    "unit": unit,
                    "enabled": inst.get("enabled") or "-",
                    "restarts": inst.get("restarts"),
                    "version": doc.get("version") or "none",
                    "health": health,
                    "models": inst.get("models") or [],
                }
            )
        return rows

    with Transport({n: hosts[n] for n in servers}) as t:
        return [row for rows in t.map(one, servers) for row in rows]


def status_main(args: argparse.Namespace) -> int:
    from vllm_fleet.commands.problems import load_or_exit as _load

    from vllm_fleet.specs.source import SpecSourceError, spec_source

    try:
        hosts = load_inventory(args.inventory, args.data or [])
    except InventoryError as exc:
        print(f"vllm-fleet status: {exc}", file=sys.stderr)
        return 1
    # The spec: --spec, else the inventory's own (vllm_fleet.specs.source: data vllm_fleet_spec,
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
        print(
            f"vllm-fleet status: {args.inventory}: no vLLM instance of {resolved['name']} in the layout",
            file=sys.stderr,
        )
        return 1
    rows = probe_hosts(resolved, hosts, servers)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'instance':<14} {'address':<15} {'unit':<24} {'enabled':<9} {'vllm':<12} {'health':<32} models")
        for r in rows:
            label = r.get("instance", r["host"])
            if "error" in r:
                print(f"{label:<14} {r['address']:<15} UNREACHABLE: {r['error']}")
                continue
            print(
                f"{label:<14} {r['address']:<15} {r.get('unit', '?'):<24} {r.get('enabled', '?'):<9} "
                f"{r.get('version', '?'):<12} {r['health']:<32} {','.join(r['models']) or '-'}"
            )
    bad = [r for r in rows if "error" in r or r.get("health") != "ok"]
    return 1 if bad else 0
