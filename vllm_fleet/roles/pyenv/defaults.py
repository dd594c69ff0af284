"""Every user-facing default of the pyenv role, in one place (documented in README.md).

The env's location ({install.prefix}/env), its kind (install.env_manager) and, for conda, its
Python (install.python) come from the spec; the values here are host data (``@deploy``
data_defaults, overridable per host or group) or fixed pins.
"""

# Miniforge pinned by version and the sha256 its release publishes for the Linux x86_64 installer.
# To update: take a release from the conda-forge/miniforge GitHub releases with its .sha256 file.
MINIFORGE_VERSION = "26.3.2-3"
MINIFORGE_URL = (
    "https://github.com/conda-forge/miniforge/releases/download/"
    f"{MINIFORGE_VERSION}/Miniforge3-{MINIFORGE_VERSION}-Linux-x86_64.sh"
)
MINIFORGE_SHA256 = "848194851a98903134187fbb4ab50efe87b003e0c0f808f97644b7524a62bf2c"
# The file in the Miniforge root where vllm-fleet records the version it installed.
MINIFORGE_MARKER = ".vllm-fleet-miniforge-version"

DEFAULTS = {
    # Where Miniforge is installed (shared by every deployment on the host).
    "pyenv_miniforge_root": "/opt/miniforge3",
    "pyenv_miniforge_version": MINIFORGE_VERSION,
    "pyenv_miniforge_url": MINIFORGE_URL,
    "pyenv_miniforge_sha256": MINIFORGE_SHA256,
    # Where the installer is downloaded (and checked) before it runs.
    "pyenv_download_dir": "/var/cache/vllm-fleet",
    # conda channel for `conda create` (Miniforge's default channel, written explicitly).
    "pyenv_conda_channel": "conda-forge",
    # apt packages for a venv of the system python3 (the lab uses this).
    "pyenv_venv_packages": ["python3-venv"],
    # With install.accelerator cuda: what vLLM compiles at start needs. Triton builds its CUDA
    # launcher (a C extension) against Python.h with the system C compiler the first time vLLM
    # starts: python3-dev for a venv (a conda env has its own headers), a C compiler for both.
    "pyenv_cuda_venv_packages": ["python3-dev", "gcc"],
    "pyenv_cuda_conda_packages": ["gcc"],
}

# Modes of the directories created by ``service_dirs``.
PREFIX_MODE = "0755"  # {install.prefix}: root-owned, the env lives here
CONFIG_DIR_MODE = "0750"  # {install.config_dir}: root:<server.user>; secrets.env inside is 0600
STATE_DIR_MODE = "0750"  # {install.state_dir}: owned by <server.user> (caches, model, logs)
SERVICE_SHELL = "/usr/sbin/nologin"
