"""Defaults of the service role (documented in README.md beside this file).

The unit, its environment and its command line come from the spec through the renderers
(vllm_fleet.render / vllm_fleet.command); these are the role's own knobs.
"""

DEFAULTS = {
    # Seconds between /health polls while waiting for the service after a (re)start.
    "vllm_fleet_health_interval": 3,
    # Lines of the journal shown when the service does not become healthy in time.
    "vllm_fleet_journal_lines": 60,
}
