"""The host's IPv4 interfaces, and which one holds a node's address (multi-node deploys pick the
interface NCCL/Gloo/Ray bind to from it: vllm_fleet.roles.common, vllm_fleet.roles.ray)."""

from __future__ import annotations

from pyinfra.api import FactBase, StringCommand


def detect_ifname(interfaces: dict[str, list[str]], address: str) -> str | None:
    """The one interface holding ``address`` ({ifname: [ipv4 addresses]}), or None."""
    found = [name for name, addrs in interfaces.items() if address in addrs]
    return found[0] if len(found) == 1 else None


def parse_ipv4_interfaces(lines: list[str]) -> dict[str, list[str]]:
    """``{ifname: [address, ...]}`` from ``ip -o -4 addr show`` lines."""
    out: dict[str, list[str]] = {}
    for line in lines:
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "inet":
            name = parts[1].split("@", 1)[0]
            out.setdefault(name, []).append(parts[3].split("/", 1)[0])
    return out


class Ipv4Interfaces(FactBase):
    """``{ifname: [IPv4 address, ...]}`` of the host (``ip -o -4 addr show``)."""

    def command(self) -> StringCommand:
        return StringCommand("ip", "-o", "-4", "addr", "show")

    def requires_command(self) -> str:
        return "ip"

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output: list[str]) -> dict[str, list[str]]:
        return parse_ipv4_interfaces(output)
