"""Defaults of the service role (documented in README.md beside this file).

The unit, its environment and its command line come from the spec through the renderers
(vllm_fleet.render / vllm_fleet.command); these are the role's own knobs.
"""

DEFAULTS = {
    # Seconds between /health polls while waiting for the service after a (re)start.
    "vllm_fleet_health_interval": 3,
    # Lines of the journal shown when the service does not become healthy in time.
    "vllm_fleet_journal_lines": 60,
    # When vLLM listens on a non-loopback address (server.host, e.g. 0.0.0.0 for replicas behind a
    # proxy on another host): an nftables table lets only the proxy hosts (and loopback) reach
    # server.port; these addresses/CIDRs are allowed too (e.g. a monitoring host). False: leave
    # the host's firewall alone (then close the port yourself: vLLM's /metrics and /health are
    # unauthenticated).
    "vllm_api_firewall": True,
    "vllm_api_firewall_allow": [],
}

#: The API port firewall's nftables table, rules file and the unit that loads it at boot.
API_FIREWALL_TABLE = "vllm_fleet_api"
API_FIREWALL_FILE = "/etc/vllm-fleet/api-firewall.nft"
API_FIREWALL_UNIT = "vllm-fleet-api-firewall.service"
