"""Facts for the ray role (the host's interfaces: vllm_fleet.host.network). Whether the node's
unit is active comes from the one state read (vllm_fleet.roles.common.state), not a fact."""

from __future__ import annotations

# the ray role's names
from vllm_fleet.host.network import Ipv4Interfaces, detect_ifname, parse_ipv4_interfaces  # noqa: F401
