"""Defaults of the monitoring role (documented in README.md beside this file).

What is scraped, where things listen and the alert thresholds come from the spec's `monitoring`
section (rendered by vllm_fleet.render.monitoring); these are the role's own knobs.
"""

DEFAULTS = {
    # Debian packages (bookworm: prometheus 2.42, node exporter 1.5, blackbox exporter 0.23).
    "monitoring_prometheus_package": "prometheus",
    "monitoring_node_exporter_package": "prometheus-node-exporter",
    "monitoring_blackbox_package": "prometheus-blackbox-exporter",
    # NVIDIA DCGM on GPU hosts, from the CUDA apt repository vllm_fleet/roles/nvidia configures
    # (DCGM 4 splits it: e.g. ["datacenter-gpu-manager-4-core", "datacenter-gpu-manager-4-cuda12"]).
    "monitoring_dcgm_packages": ["datacenter-gpu-manager"],
    # dcgm-exporter is not in the apt repositories: a binary on the control machine (built from
    # NVIDIA/dcgm-exporter, `make binary`) uploaded to /usr/local/bin/dcgm-exporter. None: the
    # host must already have it there (the deploy stops with this hint otherwise).
    "monitoring_dcgm_exporter_binary": None,
    # apt cache validity (s): re-deploys within it change nothing.
    "monitoring_apt_cache_time": 3600,
}
