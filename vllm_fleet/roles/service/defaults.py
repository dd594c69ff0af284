"""Defaults of the service role (documented in README.md beside this file).

The unit, its environment and its command line come from the spec through the renderers
(vllm_fleet.render.files / vllm_fleet.render.command); these are the role's own knobs.
"""

DEFAULTS = {
    # Seconds between /health polls while waiting for the service after a (re)start.
    "vllm_fleet_health_interval": 3,
    # Lines of the journal shown when the service does not become healthy in time.
    "vllm_fleet_journal_lines": 60,
    # `down` (install_server_stack(present=False)): also remove the deployment's environment
    # (install.prefix), weights and caches (install.state_dir, model.path) and its config
    # directory. `vllm-fleet down --purge` sets it.
    "vllm_fleet_purge": False,
}
# vllm_api_firewall / vllm_api_firewall_allow (host data): read by the layout, which renders the
# firewall (vllm_fleet.render.layout.HOST_DATA_DEFAULTS has their defaults and meaning).

#: The API port firewall's nftables table, rules file and the unit that loads it at boot (rendered by the layout).
from vllm_fleet.render.files import API_FIREWALL_FILE, API_FIREWALL_TABLE, API_FIREWALL_UNIT  # noqa: E402,F401
