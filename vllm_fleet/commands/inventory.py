"""Read a pyinfra inventory file without pyinfra (for `render --inventory` and `status`).

A pyinfra inventory is a Python file whose module-level lists are groups; entries are host
names or ``(name, data)`` tuples; a list may also be a ``(hosts, group_data)`` tuple. The
address of a host is its ``ssh_hostname`` data, else its name.
"""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any


class InventoryError(Exception):
    pass


def load_inventory(path: str | Path) -> dict[str, dict[str, Any]]:
    """Return {host: {"address": str, "groups": [str], "data": dict, "order": {group: position}}}
    in file order."""
    p = Path(path)
    if not p.is_file():
        raise InventoryError(f"inventory {p}: no such file (pass a pyinfra inventory .py file)")
    try:
        module = runpy.run_path(str(p))
    except Exception as exc:  # a user file: report, don't trace
        raise InventoryError(f"inventory {p}: failed to load: {type(exc).__name__}: {exc}") from None
    hosts: dict[str, dict[str, Any]] = {}
    for group, value in module.items():
        if group.startswith("_"):
            continue
        group_data: dict[str, Any] = {}
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], list) and isinstance(value[1], dict):
            value, group_data = value
        if not isinstance(value, list):
            continue
        for position, entry in enumerate(value):
            if isinstance(entry, str):
                name, data = entry, {}
            elif isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str) and isinstance(entry[1], dict):
                name, data = entry
            else:
                continue
            h = hosts.setdefault(name, {"address": name, "groups": [], "data": {}})
            h["groups"].append(group)
            h.setdefault("order", {})[group] = position  # a host's place in each group (rollout batches)
            h["data"] = {**group_data, **h["data"], **data}
            h["address"] = h["data"].get("ssh_hostname", name)
    if not hosts:
        raise InventoryError(f"inventory {p}: no hosts found (module-level lists of host names)")
    return hosts


def render_entry(name: str, groups: list[str], data: dict[str, Any], down: bool = False) -> dict[str, Any]:
    """One host as the layout reads it: {"address", "groups", "data"} (only the host data the
    layout and renderers use: :data:`vllm_fleet.render.files.HOST_DATA_KEYS` and
    :data:`vllm_fleet.render.layout.HOST_DATA_DEFAULTS`).

    ``down``: the rollout marks this replica down in the nginx upstream (also host data ``upstream_down``).
    """
    from vllm_fleet.render.layout import HOST_DATA_DEFAULTS
    from vllm_fleet.render.files import HOST_DATA_KEYS

    out = {k: data.get(k) for k in (*HOST_DATA_KEYS, *HOST_DATA_DEFAULTS) if data.get(k) is not None}
    out.pop("upstream_down", None)
    if down or data.get("upstream_down"):
        out["upstream_down"] = True
    return {"address": data.get("ssh_hostname") or name, "groups": list(groups), "data": out}
