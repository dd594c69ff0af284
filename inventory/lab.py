"""pyinfra inventory of the local lab (`vllm-fleet lab up`): `pyinfra -y inventory/lab.py ...`.

Reads which hosts are up from the lab's state file ($VLLM_FLEET_LAB_DIR/state.json, default
/var/lib/vllm-fleet-lab). VLLM_FLEET_LAB=vagrant selects the Vagrantfile's VMs instead.

Groups: servers, proxy, ray_head, monitoring (default lab1) and ray_workers (default lab2..N);
override any with a comma-separated env var, e.g. VLLM_FLEET_LAB_SERVERS=lab1,lab2,lab3.
Host data: ssh_hostname, ssh_user (lab, passwordless sudo), ssh_key, ssh_known_hosts_file,
ssh_strict_host_key_checking, private_address (the host's lab address), pip_cache_dir (the shared
pip cache, the same path on every host and on the control machine), vllm_wheel_serve_address (the
bridge's address: the fleet wheelhouse is served to the hosts there), lab_kind.
"""

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))

from vllm_fleet.lab.inventory import groups as _groups, lab_hosts as _lab_hosts  # noqa: E402

_hosts, _why = _lab_hosts()
if not _hosts:
    print(f"inventory/lab.py: {_why}", file=_sys.stderr)

_g = _groups()
servers = _g["servers"]
proxy = _g["proxy"]
ray_head = _g["ray_head"]
ray_workers = _g["ray_workers"]
monitoring = _g["monitoring"]
all = _hosts  # noqa: A001  (pyinfra's "all" group: every lab host, with its data)
