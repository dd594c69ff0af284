"""Facts for the ray role."""

from __future__ import annotations


from pyinfra.api import FactBase, StringCommand

from vllm_fleet.host.programs import argv


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


class SystemdActive(FactBase):
    """``systemctl is-active UNIT`` (``active``, ``inactive``, ``failed``, ...)."""

    def command(self, unit: str) -> StringCommand:
        return StringCommand(argv("systemctl", "is-active", unit), "||", "true")

    @staticmethod
    def default() -> str:
        return ""

    def process(self, output: list[str]) -> str:
        return (output[0].strip() if output else "")
