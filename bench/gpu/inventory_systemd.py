"""pyinfra inventory for the systemd proof on the GPU machine (docs/gpu-proof.md): the machine
deploys to itself (`@local`, as root) as the spec's vLLM server and its nginx proxy.

    VLLM_FLEET_SPEC=deployments/h200-systemd.yaml pyinfra -y bench/gpu/inventory_systemd.py deploys/serve.py

Host data for what that image is (bench/gpu/systemd_proof.sh says why and records it):
- nvidia_install_toolkit: False: vLLM's wheels bring their CUDA libraries; the image has no
  CUDA toolkit as a .deb, and no package source can be reached there.
- VLLM_FLEET_PROOF_NO_DEB: a comma-separated list of apt packages the roles would install that
  the image has only outside dpkg (e.g. its Python headers and gcc come from the image's own
  build, not from packages): left out of the pyenv role's lists, since nothing can be fetched.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from vllm_fleet.roles.pyenv.defaults import DEFAULTS as _PYENV  # noqa: E402
from vllm_fleet.roles.router.defaults import DEFAULTS as _ROUTER  # noqa: E402

_missing = {p for p in os.environ.get("VLLM_FLEET_PROOF_NO_DEB", "").split(",") if p}
_data = {
    "ssh_hostname": "127.0.0.1",
    "nvidia_install_toolkit": False,
    **{k: [p for p in _PYENV[k] if p not in _missing] for k in ("pyenv_venv_packages", "pyenv_cuda_venv_packages")},
    "router_venv_packages": [p for p in _ROUTER["router_venv_packages"] if p not in _missing],
}

servers = (["@local"], _data)
proxy = (["@local"], _data)
