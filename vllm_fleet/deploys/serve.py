"""Everything, in order: bare hosts -> a smoke-tested vLLM service behind nginx.

    pyinfra -y inventory/lab.py deploys/serve.py                      # the lab's tiny CPU model
    VLLM_FLEET_SPEC=deployments/x.yaml pyinfra -y inventory/fleet.py deploys/serve.py

The specs come from pyinfra data `vllm_fleet_spec` (`--data`, host or group data: each group
may have its own; a path or a list), else $VLLM_FLEET_SPEC (paths separated by `:`); only the
lab inventory falls back to deployments/lab-tiny.yaml (vllm_fleet/spec/source.py). They are
validated (schema, semantic and hardware checks), their secrets read
(vllm_fleet.render.secrets.SPEC_SECRETS) and the fleet's layout (vllm_fleet.render.layout: which host runs
which instances, Ray nodes, nginx, monitoring, and every file each gets) built once, before any
operation exists: a bad spec or a layout that does not fit stops here and no host is changed.
A secret file to generate is written on the control machine only when the deploy executes (not
with --dry). `vllm-fleet deploy` does the same checks before pyinfra connects to any host. Runs
from any directory (vllm_fleet.roles is part of the installed package).

What each host does comes from the layout only (its groups mean what vllm_fleet.render.layout says):
per deployment on the host, in spec order: the install stack (driver, user and dirs, env, vLLM,
model), its Ray node (multi-node `ray` specs: head, then workers, then the cluster wait), its
vLLM instances (one unit per replica; an older release's vllm.service of the deployment is
removed); then (proxy.routing cache_aware) vLLM's router, nginx and the smoke tests for every
deployment the host proxies (through nginx, the path users take); monitoring last.
Last, what the layout no longer gives a host (monitoring turned off, the proxy moved, a
deployment dropped from the host's data) is removed by the roles that placed it, with
``present=False`` (vllm_fleet.deploys.down.remove_deployment on just those paths: only files that
name the deployment; its environment and weights stay, as after `down`). A host with no part gets
the one state read for that and is otherwise left alone.
"""

from pyinfra import host

from vllm_fleet.render import monitoring as _monitoring
from vllm_fleet.render.files import paths as render_paths
from vllm_fleet.render.layout import SERVICE_PARTS, HostLayout
from vllm_fleet.deploys.down import remove_deployment
from vllm_fleet.roles import monitoring, nginx, ray, router, service
from vllm_fleet.roles.common import clash, host_layout, load_deploy_spec, preflight, remove, write_generated_secrets
from vllm_fleet.host.state import Query, Snapshot
from vllm_fleet.roles.common.state import load_host_state
from vllm_fleet.roles.monitoring import install_monitoring
from vllm_fleet.roles.nginx import install_nginx
from vllm_fleet.roles.ray import install_ray
from vllm_fleet.roles.router import install_router
from vllm_fleet.roles.service import api_firewall, install_server_stack, install_service
from vllm_fleet.roles.smoke import run_smoke


def state_query(ctx: dict, h: HostLayout | None) -> Query:
    """What the roles serve() runs on this host compare against (vllm_fleet.roles.common.state);
    ``h`` None (no part here): only what earlier deploys may have left."""
    rendered = dict(h.files) if h else {}
    q = Query()
    for name, spec in ctx.specs.items():  # what earlier deploys left that the layout no longer gives
        q = q | remove.leftover_query(spec, h.parts.get(name) if h else None, rendered)
    if not h:  # no clash check (nothing is put here), so not the other deployments' sites
        return q
    q = q | clash.query() | (service.api_firewall_query(rendered) if any(n.instances for n in h.parts.values()) else Query())
    for name, node in h.parts.items():
        spec = ctx.specs[name]
        if node.roles & SERVICE_PARTS:
            q = q | service.server_stack_query(spec)
            if node.instances:
                q = q | service.state_query(spec, node, rendered)
            q = q | ray.state_query(spec, node, rendered)  # Query() unless a Ray head or worker
        if "proxy" in node.roles:
            # the router's unit: removed by the router role (present=False) when the policy is no longer cache_aware
            q = q | nginx.state_query(spec, rendered) | remove.removal_query(spec, [render_paths(spec)["router_unit"]])
        if "router" in node.roles:
            q = q | router.state_query(spec, rendered)
        if _monitors(spec, rendered):
            q = q | monitoring.state_query(spec, rendered)
    return q


def _monitors(spec: dict, rendered: dict) -> bool:
    """Whether serve() runs the monitoring role for this deployment here (monitoring.enabled, and
    the layout gives the host monitoring files)."""
    return bool(spec["monitoring"]["enabled"] and set(rendered) & set(_monitoring.paths(spec).values()))


def serve() -> None:
    """Converge the current host (pyinfra runs this once per inventory host)."""
    ctx = load_deploy_spec()
    h = host_layout(ctx)
    if h is None or not h.parts:
        # nothing of this deploy here, but an earlier deploy may have put a deployment of it here
        preflight()
        if not prune_leftovers(ctx, None, load_host_state(state_query(ctx, None))):
            host.noop("no part of the layout on this host")
        return
    rendered = dict(h.files)
    preflight()  # root works on this host (passwordless sudo), else a clear stop
    write_generated_secrets(ctx)  # a new API key file on this machine, before it reaches a host
    # Everything the roles below compare against, read in one round trip; they then create
    # operations only where this host differs (a converged host: none).
    snap = load_host_state(state_query(ctx, h))
    # Another deployment already on this host (deployed from elsewhere) on our ports or GPUs:
    # stop before any upload or change (vllm_fleet.roles.common.clash).
    clash.refuse(ctx.specs, h, host.name, snap)

    # vLLM beyond loopback: one firewall over every deployment's instances here, before they start
    if any(n.instances for n in h.parts.values()):
        api_firewall(rendered=rendered)
    install_servers(ctx, h, rendered)
    install_proxies(ctx, h, rendered)
    for name, node in h.parts.items():  # after every site is in: each deployment's own checks
        if "proxy" in node.roles:
            local = [i.port for i in node.instances if i.role == "server"]
            run_smoke(spec=ctx.specs[name], api_key=ctx.all_secrets[name]["api_key"], local_port=local[0] if local else None)
    # Monitoring last (monitoring.enabled): exporters on every host above, Prometheus on `monitoring` hosts.
    for name in h.parts:
        spec = ctx.specs[name]
        if _monitors(spec, rendered):
            install_monitoring(spec=spec, rendered=rendered)
    # Last, once the new parts serve: what the layout no longer gives this host
    prune_leftovers(ctx, h, snap)


def prune_leftovers(ctx: dict, h: HostLayout | None, snap: Snapshot) -> bool:
    """Remove what an earlier deploy of these deployments put on this host and the layout no
    longer gives it (monitoring turned off, the proxy moved, the deployment dropped from the
    host's data): the roles that placed them, with ``present=False``, on just those paths
    (vllm_fleet.roles.common.remove.leftovers; vllm_fleet.deploys.down.remove_deployment).
    True when there was something to remove. A converged host: nothing, and no operation."""
    rendered = dict(h.files) if h else {}
    found = False
    for name, spec in ctx.specs.items():
        paths = remove.leftovers(spec, h.parts.get(name) if h else None, rendered, snap)
        if paths:
            remove_deployment(spec=spec, rendered=rendered, paths=paths)
            found = True
    return found


def install_servers(ctx: dict, h: HostLayout, rendered: dict) -> None:
    """Per deployment with a server part here: driver, service user and dirs, env, system
    libraries, vLLM, model (as deploys/rollout.py), its Ray node, then its vLLM units."""
    for name, node in h.parts.items():
        if not node.roles & SERVICE_PARTS:
            continue
        spec, secrets = ctx.specs[name], ctx.all_secrets[name]
        vllm_changed, model_changed = install_server_stack(spec=spec, hub_token=secrets["hub_token"])
        restart_on = [*vllm_changed, *model_changed]
        if node.roles & {"ray-head", "ray-worker"}:  # each role places the files of its part (RenderedFile.part)
            ray = install_ray(spec=spec, node=node, layout=ctx.layout, rendered=rendered, restart_on=vllm_changed)
            restart_on += [*ray.env_ops, ray.cluster_restarted]
        if node.instances:
            install_service(spec=spec, node=node, rendered=rendered, api_key=secrets["api_key"], restart_on=restart_on)


def install_proxies(ctx: dict, h: HostLayout, rendered: dict) -> None:
    """Per deployment this host proxies: vLLM's router first (cache_aware: it serves before
    nginx points at it), nginx, then the router removed where the policy no longer uses it
    (after nginx stopped pointing at it)."""
    for name, node in h.parts.items():
        if "proxy" not in node.roles:
            continue
        spec, sec = ctx.specs[name], ctx.all_secrets[name]
        if "router" in node.roles:
            install_router(spec=spec, rendered=rendered)
        install_nginx(spec=spec, rendered=rendered, api_key=sec["api_key"], tls_key=sec["tls_key"], tls_certificate=sec["tls_certificate"])
        if "router" not in node.roles:
            install_router(spec=spec, rendered=rendered, present=False)
