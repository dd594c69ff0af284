"""One step of a rolling update; `vllm-fleet rollout` runs it per step, in its own batch order.

    VLLM_FLEET_ROLLOUT_STEP=upstream VLLM_FLEET_UPSTREAM_DOWN=lab2 \
        pyinfra -y inventory/lab.py deploys/rollout.py --limit proxy      # lab2 out, drained at nginx
    VLLM_FLEET_ROLLOUT_STEP=update VLLM_FLEET_UPSTREAM_DOWN=lab2:0 VLLM_FLEET_UPDATE=lab2:0 \
        pyinfra -y inventory/lab.py deploys/rollout.py --limit lab2       # drain, update, check lab2:0
    VLLM_FLEET_ROLLOUT_STEP=upstream pyinfra -y inventory/lab.py deploys/rollout.py --limit proxy

Steps ($VLLM_FLEET_ROLLOUT_STEP):
  upstream  on the proxy hosts: the nginx site rendered with the hosts in $VLLM_FLEET_UPSTREAM_DOWN
            marked `down`; when it changed, nginx -t, reload, wait for the old workers (bounded).
            With proxy.routing cache_aware: the router's worker list without them (its
            /remove_worker API; the next upstream step adds them back with /add_worker).
  update    on the hosts of the batch's instances ($VLLM_FLEET_UPDATE: HOST:N ids): wait until each
            has no running/waiting request (bounded), then the serve deploy's server part (the host
            read once, as deploys/serve.py does: operations only where it differs; env,
            vLLM, model, units: the batch's instances restarted when what they run changed, then
            /health; the host's other instances are left running), then each instance's own
            smoke test (on the host, not through the proxy). Nothing of nginx is touched.
The spec comes from where deploys/serve.py takes it (vllm_fleet/specs/source.py); $VLLM_FLEET_DRAIN_TIMEOUT (seconds,
default the spec's rollout.drain_timeout) bounds both waits. Single-node replicas only.
"""

import os

from pyinfra import host

from vllm_fleet.host.state import Query
from vllm_fleet.render.layout import HostLayout
from vllm_fleet.roles.common import (
    DeployContext,
    DeployError,
    host_layout,
    load_deploy_spec,
    settle_memory,
    this_host_only,
    write_generated_secrets,
)
from vllm_fleet.roles.common.state import load_host_state

#: The instances of the batch being updated (``HOST:N``, comma-separated; a host name: all of its).
UPDATE_ENV = "VLLM_FLEET_UPDATE"


#: The parts of the update step (vllm_fleet.roles.parts): the serve deploy's server part; nginx not.
UPDATE_PARTS = ("stack", "service")


def update_query(ctx: DeployContext, h: HostLayout) -> Query:
    """What the update step's server part compares against (vllm_fleet.roles.common.state): the
    queries of the same entries deploys/serve.py reads (the firewall, the install stack and the
    service: :data:`UPDATE_PARTS`; nginx not: the update step leaves it alone)."""
    from vllm_fleet.roles.parts import host_query

    from vllm_fleet.roles.common import clash

    return host_query(ctx, h, UPDATE_PARTS) | clash.memory_query(ctx.specs, h)


def rollout_step() -> None:
    """One rollout step on the current host ($VLLM_FLEET_ROLLOUT_STEP)."""
    ctx = load_deploy_spec()
    spec = ctx.spec
    h = host_layout(ctx)
    node = h.parts.get(spec["name"]) if h else None
    rendered = dict(h.files) if h else {}
    step = os.environ.get("VLLM_FLEET_ROLLOUT_STEP", "")
    drain_timeout = float(os.environ.get("VLLM_FLEET_DRAIN_TIMEOUT") or spec["rollout"]["drain_timeout"])
    batch = {i.strip() for i in os.environ.get(UPDATE_ENV, "").split(",") if i.strip()}

    if spec["parallel"]["nodes"] > 1:
        raise DeployError(
            f"{ctx.path}: a rolling update replaces single-node replicas (parallel.nodes is "
            f"{spec['parallel']['nodes']}); redeploy a multi-node server with deploys/serve.py; no host was changed"
        )
    if step not in ("upstream", "update"):
        raise DeployError(
            f"VLLM_FLEET_ROLLOUT_STEP must be `upstream` or `update` (got {step!r}); `vllm-fleet rollout` sets it"
        )
    with this_host_only():  # a problem of this host fails it alone (the rollout reads which)
        _step_host(ctx, spec, h, node, rendered, step, drain_timeout, batch)


def _step_host(
    ctx: DeployContext,
    spec: dict,
    h: HostLayout,
    node,
    rendered: dict,
    step: str,
    drain_timeout: float,
    batch: set[str],
) -> None:
    if node is None:
        host.noop(f"no part of {spec['name']} on this host")
        return

    where = ctx.layout.paths[spec["name"]]  # where its files live (the layout's)
    if node.roles & {"proxy"} or node.instances:
        write_generated_secrets(ctx)  # a new API key file on this machine, before it reaches a host
    # Who plays which part comes from the layout: a proxy of this deployment puts its site; a
    # host with instances of it updates those of the batch ($VLLM_FLEET_UPDATE: HOST:N ids).
    if step == "upstream" and "proxy" in node.roles:
        from vllm_fleet.roles.rollout import upstream

        upstream(spec=spec, where=where, rendered=rendered, drain_timeout=drain_timeout)
        if "router" in node.roles:  # cache_aware: nginx points at the router, which picks the replica
            from vllm_fleet.render.files import worker_urls
            from vllm_fleet.roles.rollout import router_workers

            layout = ctx.layout
            urls = worker_urls(spec, node, layout.nodes(spec["name"]), layout.with_inventory)
            router_workers(spec=spec, where=where, workers=[(u, inst.down) for u, inst in urls])

    mine = [i for i in node.instances if i.id in batch or host.name in batch]
    if step == "update" and mine:
        from vllm_fleet.roles.rollout import drain, smoke_replica
        from vllm_fleet.roles.service import api_firewall, install_server_stack, install_service

        # One read of what the server part compares against; it then creates operations only
        # where this host differs (deploys/serve.py does the same). Safe here because each step
        # is its own pyinfra run (vllm_fleet.commands.rollout): the next batch reads the host afresh, and an
        # instance whose inputs an earlier batch already changed restarts on its applied token.
        snap = load_host_state(update_query(ctx, h))
        # the CPU tiers of the KV cache against the host's RAM, `auto` sized (as deploys/serve.py)
        h = settle_memory(ctx, h, host.name, snap)
        node, rendered = h.parts[spec["name"]], dict(h.files)
        mine = [i for i in node.instances if i.id in batch or host.name in batch]
        for inst in mine:
            drain(spec=spec, drain_timeout=drain_timeout, port=inst.port)
        # The same server part as deploys/serve.py (single node), with the rollout's health deadline.
        spec = {**spec, "server": {**spec["server"], "health_timeout": spec["rollout"]["health_timeout"]}}
        vllm_changed, model_changed = install_server_stack(spec=spec, where=where, hub_token=ctx.secrets["hub_token"])
        api_firewall(rendered=rendered)
        install_service(
            spec=spec,
            where=where,
            node=node,
            rendered=rendered,
            api_key=ctx.secrets["api_key"],
            restart_on=[*vllm_changed, *model_changed],
            only=[i.index for i in mine],
            prove_replicas=False,
        )  # smoke_replica below proves each (more than one chat)
        for inst in mine:
            smoke_replica(spec=spec, where=where, port=inst.port, unit=inst.unit)
