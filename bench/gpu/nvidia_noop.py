r"""The nvidia role on a real GPU host whose driver is in place: serve's one state read of the
server stack, the role (which must add no operation and no command), then the role's
after-reboot check (``read_now`` through ``python.call``, as after a driver install) run for
real against the host's nvidia-smi.

    VLLM_FLEET_SPEC=deployments/h200-systemd.yaml python3 -m pyinfra -y -vv \
        bench/gpu/inventory_systemd.py bench/gpu/nvidia_noop.py

``-vv`` lists every command sent (``[@local] >>> ...``): the proof counts them
(bench/gpu/nvidia_noop.sh). ``VLLM_FLEET_CHECK_BRANCH`` sets the branch the after-reboot check
wants (default: the spec's), so a branch above the loaded one shows the check failing.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pyinfra.operations import python  # noqa: E402

from vllm_fleet.render.files import deployment_paths  # noqa: E402
from vllm_fleet.roles.common.state import load_host_state  # noqa: E402
from vllm_fleet.roles.nvidia import _check_gpus_now, nvidia  # noqa: E402
from vllm_fleet.roles.service import server_stack_query  # noqa: E402
from vllm_fleet.specs.load import load_and_check  # noqa: E402

spec, _ = load_and_check(os.environ["VLLM_FLEET_SPEC"], hardware=False)
# what deploys/serve.py reads for the stack, in one round trip
load_host_state(server_stack_query(spec, deployment_paths(spec)))
nvidia(spec=spec)
python.call(
    name="After-reboot check: nvidia-smi read now (read_now)",
    function=_check_gpus_now,
    branch=os.environ.get("VLLM_FLEET_CHECK_BRANCH", str(spec["install"]["nvidia"]["driver_branch"])),
    hardware=spec["hardware"],
)
