"""Every user-facing default of the ray role, in one place (documented in README.md).

Host data (``@deploy`` data_defaults): override per host or group in the inventory.
"""

DEFAULTS = {
    # socket_ifname (host data, read by the layout): the interface Gloo/NCCL use between nodes
    # (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME in node.env). Unset: parallel.socket_ifname from
    # the spec, else detected on each host before the layout is built: the one interface holding
    # the node's private address (`ip -o -4 addr show`).
    # Seconds the deploy waits, after (re)starting Ray nodes, for the head to see every node
    # (the rendered wait-ray-cluster, run on the head). On timeout the deploy fails naming the
    # missing node addresses.
    "ray_cluster_wait_timeout": 180,
    # ray_firewall / ray_firewall_allow (host data, read by the layout, which renders the rules;
    # defaults in vllm_fleet.render.layout.HOST_DATA_DEFAULTS): Ray's ports only from the cluster's own
    # private addresses (plus these). False: leave the host's firewall alone.
    # Compare Python, Ray and vLLM versions across all Ray nodes before anything (re)starts.
    "ray_version_check": True,
}

#: The firewall's nftables table, its rules file and the unit that loads it at boot.
from vllm_fleet.render.files import (
    RAY_FIREWALL_FILE as FIREWALL_FILE,
    RAY_FIREWALL_TABLE as FIREWALL_TABLE,
    RAY_FIREWALL_UNIT as FIREWALL_UNIT,
)  # noqa: E402,F401

#: What the version check compares on every node (distribution names; "python" is the
#: interpreter's own version).
VERSION_DISTS = ("ray",)
