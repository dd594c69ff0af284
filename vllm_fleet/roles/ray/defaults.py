"""Every user-facing default of the ray role, in one place (documented in README.md).

Host data (``@deploy`` data_defaults): override per host or group in the inventory.
"""

DEFAULTS = {
    # The interface Gloo/NCCL use between nodes (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME in
    # node.env). None: parallel.socket_ifname from the spec, else detected on each host: the one
    # interface holding the node's address (`ip -o -4 addr show`).
    "socket_ifname": None,
    # Seconds the deploy waits, after (re)starting Ray nodes, for the head to see every node
    # (the rendered wait-ray-cluster, run on the head). On timeout the deploy fails naming the
    # missing node addresses.
    "ray_cluster_wait_timeout": 180,
    # nftables: allow Ray's ports only from the cluster's own addresses (plus these extra
    # addresses/CIDRs, e.g. a monitoring host). False: leave the host's firewall alone (then
    # put Ray's ports behind your own firewall: they have no authentication).
    "ray_firewall": True,
    "ray_firewall_allow": [],
    # Compare Python, Ray and vLLM versions across all Ray nodes before anything (re)starts.
    "ray_version_check": True,
}

#: The firewall's nftables table, its rules file and the unit that loads it at boot.
FIREWALL_TABLE = "vllm_fleet_ray"
FIREWALL_FILE = "/etc/vllm-fleet/ray-firewall.nft"
FIREWALL_UNIT = "vllm-fleet-ray-firewall.service"
SYSTEMD_DIR = "/etc/systemd/system"

#: What the version check compares on every node (distribution names; "python" is the
#: interpreter's own version).
VERSION_DISTS = ("ray",)
