"""One step of a rolling update; `vllm-fleet rollout` runs it per step, in its own batch order.

    VLLM_FLEET_ROLLOUT_STEP=upstream VLLM_FLEET_UPSTREAM_DOWN=lab2 \
        pyinfra -y inventory/lab.py deploys/rollout.py --limit proxy      # lab2 out, drained at nginx
    VLLM_FLEET_ROLLOUT_STEP=update VLLM_FLEET_UPSTREAM_DOWN=lab2 \
        pyinfra -y inventory/lab.py deploys/rollout.py --limit lab2       # drain, update, check lab2
    VLLM_FLEET_ROLLOUT_STEP=upstream pyinfra -y inventory/lab.py deploys/rollout.py --limit proxy

Steps ($VLLM_FLEET_ROLLOUT_STEP):
  upstream  on the proxy hosts: the nginx site rendered with the hosts in $VLLM_FLEET_UPSTREAM_DOWN
            marked `down`; when it changed, nginx -t, reload, wait for the old workers (bounded).
  update    on replicas (`servers`): wait until vLLM has no running/waiting request (bounded), then
            the serve deploy's server part (env, vLLM, model, unit: restarted when its inputs
            changed, then /health), then the replica's own smoke test (on the host, not through
            the proxy). Nothing of nginx is touched, also on a proxy host that is a replica.
The spec comes from where deploys/serve.py takes it (vllm_fleet/specsource.py); $VLLM_FLEET_DRAIN_TIMEOUT (seconds,
default the spec's rollout.drain_timeout) bounds both waits. Single-node replicas only.
"""

import os

from vllm_fleet import render
from vllm_fleet.roles.common import DeployError, load_deploy_spec, rendered_for_host, write_generated_secrets


def rollout_step() -> None:
    """One rollout step on the current host ($VLLM_FLEET_ROLLOUT_STEP)."""
    ctx = load_deploy_spec()
    spec = ctx["spec"]
    rendered = rendered_for_host(ctx)
    step = os.environ.get("VLLM_FLEET_ROLLOUT_STEP", "")
    drain_timeout = float(os.environ.get("VLLM_FLEET_DRAIN_TIMEOUT") or spec["rollout"]["drain_timeout"])

    if spec["parallel"]["nodes"] > 1:
        raise DeployError(f"{ctx['path']}: a rolling update replaces single-node replicas (parallel.nodes is {spec['parallel']['nodes']}); "
                          "redeploy a multi-node server with deploys/serve.py; no host was changed")
    if step not in ("upstream", "update"):
        raise DeployError(f"VLLM_FLEET_ROLLOUT_STEP must be `upstream` or `update` (got {step!r}); `vllm-fleet rollout` sets it")

    # Who plays which part comes from the renderer (as in serve.py's layout): a host with this
    # deployment's nginx site is a proxy (the `proxy` group, or every server when there is none), a
    # host with vllm.service is a replica.
    paths = render.paths(spec)
    if paths["nginx_site"] in rendered or paths["vllm_unit"] in rendered:
        write_generated_secrets(ctx)
    if step == "upstream" and paths["nginx_site"] in rendered:
        from vllm_fleet.roles.rollout import upstream

        upstream(spec=spec, rendered=rendered, drain_timeout=drain_timeout)

    if step == "update" and paths["vllm_unit"] in rendered:
        from vllm_fleet.roles.rollout import drain, smoke_replica
        from vllm_fleet.roles.service import install_server_stack, install_service

        drain(spec=spec, drain_timeout=drain_timeout)
        # The same server part as deploys/serve.py (single node), with the rollout's health deadline.
        spec = {**spec, "server": {**spec["server"], "health_timeout": spec["rollout"]["health_timeout"]}}
        vllm_changed, model_changed = install_server_stack(spec=spec, hub_token=ctx["secrets"]["hub_token"])
        install_service(spec=spec, rendered=rendered, api_key=ctx["secrets"]["api_key"], restart_on=[*vllm_changed, *model_changed])
        smoke_replica(spec=spec)
