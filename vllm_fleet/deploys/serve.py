"""Everything, in order: bare hosts -> a smoke-tested vLLM service behind nginx.

    pyinfra -y inventory/lab.py deploys/serve.py                      # the lab's tiny CPU model
    VLLM_FLEET_SPEC=deployments/x.yaml pyinfra -y inventory/fleet.py deploys/serve.py

The specs come from pyinfra data `vllm_fleet_spec` (`--data`, host or group data: each group
may have its own; a path or a list), else $VLLM_FLEET_SPEC (paths separated by `:`); only the
lab inventory falls back to deployments/lab-tiny.yaml (vllm_fleet/specs/source.py). They are
validated (schema, semantic and hardware checks), their secrets read
(vllm_fleet.render.secrets.SPEC_SECRETS) and the fleet's layout (vllm_fleet.render.layout: which host runs
which instances, Ray nodes, nginx, monitoring, and every file each gets) built once, before any
operation exists: a bad spec or a layout that does not fit stops here and no host is changed.
A secret file to generate is written on the control machine only when the deploy executes (not
with --dry). `vllm-fleet deploy` does the same checks before pyinfra connects to any host. Runs
from any directory (vllm_fleet.roles is part of the installed package).

What each host does comes from the layout only (its groups mean what vllm_fleet.render.layout says):
the parts of vllm_fleet.roles.parts.PARTS, in that order, each for every deployment of the host
it applies to: the install stack (driver, user and dirs, env, vLLM, model), the Ray node
(multi-node `ray` specs: head, then workers, then the cluster wait), the vLLM instances (one unit
per replica; an older release's vllm.service of the deployment is removed), (proxy.routing
cache_aware) vLLM's router, nginx, the smoke tests for every deployment the host proxies
(through nginx, the path users take), monitoring last. Their queries are the host's one state read.
Last, what the layout no longer gives a host (monitoring turned off, the proxy moved, the routing
no longer cache_aware, a deployment dropped from the host's data) is removed by the roles that placed it, with
``present=False`` (vllm_fleet.deploys.down.remove_deployment on just those paths: only files that
name the deployment; its environment and weights stay, as after `down`). A host with no part gets
the one state read for that and is otherwise left alone.
"""

from pyinfra import host

from vllm_fleet.deploys.down import remove_deployment
from vllm_fleet.host.state import Query, Snapshot
from vllm_fleet.render.layout import HostLayout
from vllm_fleet.roles.common import (
    DeployContext,
    clash,
    host_layout,
    load_deploy_spec,
    preflight,
    remove,
    settle_memory,
    this_host_only,
    write_generated_secrets,
)
from vllm_fleet.roles.common.state import load_host_state
from vllm_fleet.roles.nvidia import gpumem
from vllm_fleet.roles.parts import host_query, host_steps
from vllm_fleet.roles.service import api_firewall


def state_query(ctx: DeployContext, h: HostLayout | None) -> Query:
    """What the roles serve() runs on this host compare against (vllm_fleet.roles.common.state):
    the queries of the parts that apply here (vllm_fleet.roles.parts.host_query), the clash
    check's, and what earlier deploys may have left; ``h`` None (no part here): only the last."""
    rendered = dict(h.files) if h else {}
    q = Query()
    for name, spec in ctx.specs.items():  # what earlier deploys left that the layout no longer gives
        q = q | remove.leftover_query(spec, ctx.layout.paths[name], h.parts.get(name) if h else None, rendered)
    if not h:  # no clash check (nothing is put here), so not the other deployments' sites
        return q
    q = q | clash.query() | clash.memory_query(ctx.specs, h) | host_query(ctx, h)
    # a GPU shared with a desktop: its free memory and who holds the rest (vllm_fleet.roles.nvidia.gpumem)
    return q | gpumem.query() if any(i.gpu_ids for i in h.instances) else q


def serve() -> None:
    """Converge the current host (pyinfra runs this once per inventory host). A problem of the
    fleet (the specs, the layout) stops every host; a problem of this host (sudo, disk space, a
    clash, a state read that did not complete, a download) fails this host only (this_host_only)."""
    ctx = load_deploy_spec()
    with this_host_only():
        serve_host(ctx)


def serve_host(ctx: DeployContext) -> None:
    h = host_layout(ctx)
    if h is None or not h.parts:
        # nothing of this deploy here, but an earlier deploy may have put a deployment of it here
        preflight()
        if not prune_leftovers(ctx, None, load_host_state(state_query(ctx, None))):
            host.noop("no part of the layout on this host")
        return
    preflight()  # root works on this host (passwordless sudo), else a clear stop
    write_generated_secrets(ctx)  # a new API key file on this machine, before it reaches a host
    # Everything the roles below compare against, read in one round trip; they then create
    # operations only where this host differs (a converged host: none).
    snap = load_host_state(state_query(ctx, h))
    # Another deployment already on this host (deployed from elsewhere) on our ports or GPUs:
    # stop before any upload or change (vllm_fleet.roles.common.clash).
    clash.refuse(ctx.specs, h, host.name, snap)
    # The CPU tiers of the KV cache (engine.kv_offload) of every replica here, and the reserve,
    # against the host's RAM: refused with the numbers, or `auto` sized from what is left.
    h = settle_memory(ctx, h, host.name, snap)
    # Each GPU's free memory, not its total: what a display server or another program holds is
    # not this deploy's to plan with; our own running vLLMs' memory is (their restart frees it).
    gpumem.refuse(ctx.specs, h, host.name, snap, log=host.log)

    # vLLM beyond loopback: one firewall over every deployment's instances here, before they start
    if any(n.instances for n in h.parts.values()):
        api_firewall(rendered=h.files)
    # Every part that applies here, in the registry's order (vllm_fleet.roles.parts.PARTS)
    for part, step in host_steps(ctx, h):
        part.install(step)
    # Last, once the new parts serve: what the layout no longer gives this host
    prune_leftovers(ctx, h, snap)


def prune_leftovers(ctx: DeployContext, h: HostLayout | None, snap: Snapshot) -> bool:
    """Remove what an earlier deploy of these deployments put on this host and the layout no
    longer gives it (monitoring turned off, the proxy moved, the routing no longer cache_aware,
    the deployment dropped from the host's data): the roles that placed them, with
    ``present=False``, on just those paths (vllm_fleet.roles.common.remove.leftovers;
    vllm_fleet.deploys.down.remove_deployment). True when there was something to remove. A
    converged host: nothing, and no operation."""
    rendered = dict(h.files) if h else {}
    found = False
    for name, spec in ctx.specs.items():
        where = ctx.layout.paths[name]
        paths = remove.leftovers(spec, where, h.parts.get(name) if h else None, rendered, snap)
        if paths:
            remove_deployment(spec=spec, where=where, rendered=rendered, paths=paths)
            found = True
    return found
