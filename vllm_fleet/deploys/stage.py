"""Stage ahead: what a deploy would transfer, put on every host of the layout, nothing else.

    vllm-fleet stage inventory/lab.py --spec deployments/lab-tiny.yaml -y
    pyinfra -y --data nvidia_reboot=False inventory/lab.py vllm_fleet.deploys.stage.stage

Runs the parts of vllm_fleet.roles.parts.PARTS marked ``stages`` (the install stack: the service
user and directories, the Python env, vLLM's system libraries, the pinned vLLM from the fleet
wheelhouse, the model weights and their stamp), for every deployment of the host they apply to,
in the registry's order, from the same one state read as serve (the union of those parts'
queries). No unit, no service config (env files, nginx, firewall) is written, nothing is
started or restarted: the changes the stack returns (which serve hands to the service part as
its restart triggers) are dropped. A later `vllm-fleet deploy` or `rollout` then finds env and
weights in place (the env installed, the model's stamp matching): those parts are no-ops and a
rollout batch costs a restart and a health wait.

A GPU host whose driver would need a reboot is not rebooted: `vllm-fleet stage` passes host
data ``nvidia_reboot=False`` (the nvidia role then stops that host with the fix).
"""

from pyinfra import host

from vllm_fleet.roles.common import DeployContext, host_layout, load_deploy_spec, preflight, this_host_only
from vllm_fleet.roles.common.state import load_host_state
from vllm_fleet.roles.parts import host_query, host_steps, staged


def stage() -> None:
    """Stage the current host (pyinfra runs this once per inventory host). As in serve, a problem
    of the fleet (the specs, the layout) stops every host; a problem of this host (sudo, a full
    disk, a state read that did not complete, a download) fails this host only (this_host_only)."""
    ctx = load_deploy_spec()
    with this_host_only():
        stage_host(ctx)


def stage_host(ctx: DeployContext) -> None:
    h = host_layout(ctx)
    names = staged()
    steps = host_steps(ctx, h, names) if h is not None else []
    if not steps:
        host.noop("nothing of the layout to stage on this host")
        return
    preflight()  # root works on this host (passwordless sudo), else a clear stop
    # Everything the staged parts compare against, read in one round trip (as serve does)
    load_host_state(host_query(ctx, h, names))
    for part, step in steps:
        part.install(step)
