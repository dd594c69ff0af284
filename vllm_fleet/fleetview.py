"""Which hosts of a deployment are replicas and proxies, their unit names and ports, and how to
reach them over SSH: read from the renderer's layout, never from group names or fixed names.

    view = fleet_view(resolved, inventory)      # inventory: vllm_fleet.inventory.load_inventory()
    view.replicas[0].unit, .port, .host; view.proxies; view.ssh_argv("lab3")

A host is a replica when the renderer places this deployment's vLLM unit there, a proxy when it
places its nginx site (``render.paths``). One place to adapt when the per-host layout changes
(several instances per host: one Replica each).

Core module: no pyinfra.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from typing import Any

from . import render


@dataclass(frozen=True)
class Replica:
    host: str
    address: str
    unit: str          # the systemd unit name, e.g. vllm.service
    unit_path: str
    port: int          # where vLLM listens on the host
    files: tuple[str, ...]  # rendered paths a restart with other engine settings may change


@dataclass
class FleetView:
    replicas: list[Replica]
    proxies: list[str]
    proxy_listen: int | None
    hosts: dict[str, dict[str, Any]] = field(default_factory=dict)

    def replica(self, host: str) -> Replica | None:
        return next((r for r in self.replicas if r.host == host), None)

    def ssh_argv(self, host: str) -> list[str]:
        return ssh_argv(self.hosts.get(host) or {"address": host, "data": {}})

    def sudo(self, host: str) -> list[str]:
        data = (self.hosts.get(host) or {}).get("data") or {}
        user = data.get("ssh_user") or os.environ.get("USER", "root")
        return [] if user == "root" else ["sudo", "-n"]


def fleet_view(resolved: dict[str, Any], inventory: dict[str, dict[str, Any]]) -> FleetView:
    rendered = render.render(resolved, inventory)
    p = render.paths(resolved)
    unit_path = p["vllm_unit"]
    replicas, proxies = [], []
    for host, files in rendered.items():
        if host == "client":
            continue
        if unit_path in files:
            changeable = tuple(sorted(path for path in (unit_path, p["vllm_env"], p["node_env"]) if path in files))
            replicas.append(Replica(host, str(inventory.get(host, {}).get("address") or host), os.path.basename(unit_path),
                                    unit_path, int(resolved["server"]["port"]), changeable))
        if p["nginx_site"] in files:
            proxies.append(host)
    listen = int(resolved["proxy"]["listen"]) if resolved["proxy"].get("enabled", True) else None
    return FleetView(replicas, proxies, listen, inventory)


def ssh_argv(h: dict[str, Any]) -> list[str]:
    """OpenSSH argv for an inventory host ({address, data}) from pyinfra's connection data."""
    data = h.get("data") or {}
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR", "-o", "ServerAliveInterval=15"]
    if data.get("ssh_key"):
        argv += ["-i", os.path.expanduser(str(data["ssh_key"]))]
    if data.get("ssh_port"):
        argv += ["-p", str(data["ssh_port"])]
    if data.get("ssh_known_hosts_file"):
        argv += ["-o", f"UserKnownHostsFile={os.path.expanduser(str(data['ssh_known_hosts_file']))}"]
    strict = data.get("ssh_strict_host_key_checking")
    if strict is not None:
        argv += ["-o", f"StrictHostKeyChecking={'yes' if strict in (True, 'yes') else 'no' if strict in (False, 'no') else strict}"]
    user = data.get("ssh_user")
    addr = str(data.get("ssh_hostname") or h.get("address"))
    argv.append(f"{user}@{addr}" if user else addr)
    return argv


def remote(argv: list[str]) -> str:
    """A remote command line (what ssh sends to the login shell), every argument quoted."""
    return " ".join(shlex.quote(a) for a in argv)
