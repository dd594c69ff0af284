"""Facts for the ray role (the host's interfaces: vllm_fleet.host.network)."""

from __future__ import annotations

from pyinfra.api import FactBase, StringCommand

from vllm_fleet.host.network import Ipv4Interfaces, detect_ifname, parse_ipv4_interfaces  # noqa: F401  (the ray role's names)
from vllm_fleet.host.programs import argv


class SystemdActive(FactBase):
    """``systemctl is-active UNIT`` (``active``, ``inactive``, ``failed``, ...)."""

    def command(self, unit: str) -> StringCommand:
        return StringCommand(argv("systemctl", "is-active", unit), "||", "true")

    @staticmethod
    def default() -> str:
        return ""

    def process(self, output: list[str]) -> str:
        return (output[0].strip() if output else "")
