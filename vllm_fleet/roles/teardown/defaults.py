"""Defaults of the teardown role (documented in README.md beside this file)."""

DEFAULTS = {
    # Also remove the deployment's environment (install.prefix), weights and caches
    # (install.state_dir, model.path) and its config directory. `vllm-fleet down --purge` sets it.
    "vllm_fleet_purge": False,
}
