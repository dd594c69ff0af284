"""Everything, in order: bare hosts -> a smoke-tested vLLM service behind nginx.

    pyinfra -y inventory/lab.py deploys/serve.py                      # the lab's tiny CPU model
    VLLM_FLEET_SPEC=deployments/x.yaml pyinfra -y inventory/fleet.py deploys/serve.py

The spec comes from pyinfra data `vllm_fleet_spec` (`--data`, host or group data: each group
may have its own), else $VLLM_FLEET_SPEC; only the lab inventory falls back to
deployments/lab-tiny.yaml (vllm_fleet/specsource.py). It is validated (schema, semantic and
hardware checks), its secrets are read (vllm_fleet.secrets.SPEC_SECRETS) and its files rendered
once, before any operation exists: a bad spec stops here and no host is changed. A secret file
to generate is written on the control machine only when the deploy executes (not with --dry).
`vllm-fleet deploy` does the same checks before pyinfra connects to any host. Runs from any
directory (vllm_fleet.roles is part of the installed package).

Groups: `servers` run vLLM (single node); `proxy` runs nginx and the smoke tests go through it.
A multi-node spec (parallel.nodes > 1, backend ray): the one `servers` host is the Ray head and
runs vLLM, hosts in `ray_workers` (or `workers`) are Ray worker nodes; every node gets the same
env, vLLM, Ray and model weights (at the same path) before any Ray node starts (vllm_fleet/roles/ray:
head, then workers, then the cluster wait; then vLLM on the head). A host in no such group is
left alone. With monitoring.enabled, hosts in `monitoring` run Prometheus (vllm_fleet/roles/monitoring), and
every host the deploy touches gets the node exporter.
"""

from pyinfra import host

from vllm_fleet import monitoring as _monitoring, render as _render
from vllm_fleet.roles.common import inventory_hosts, load_deploy_spec, preflight, rendered_for_host, write_generated_secrets


def serve() -> None:
    """Converge the current host (pyinfra runs this once per inventory host)."""
    ctx = load_deploy_spec()
    spec = ctx["spec"]
    rendered = rendered_for_host(ctx)
    groups = set(host.groups)
    is_server = "servers" in groups
    # Ray nodes (head and workers) as the renderer laid them out: only for multi-node ray specs.
    p = _render.paths(spec)
    is_ray_node = p["ray_head_unit"] in rendered or p["ray_worker_unit"] in rendered
    is_proxy = "proxy" in groups and spec["proxy"]["enabled"]
    if is_server or is_ray_node or is_proxy:
        preflight()  # root works on this host (passwordless sudo), else a clear stop
        write_generated_secrets(ctx)  # a new API key file on this machine, before it reaches a host

    if is_server or is_ray_node:
        from vllm_fleet.roles.service import install_server_stack, install_service

        # driver, service user and dirs, env, system libraries, vLLM, model (as deploys/rollout.py)
        vllm_changed, model_changed = install_server_stack(spec=spec, hub_token=ctx["secrets"]["hub_token"])
        restart_on = [*vllm_changed, *model_changed]
        service_files = rendered
        if is_ray_node:
            from vllm_fleet.roles.ray import install_ray

            ray = install_ray(spec=spec, rendered=rendered, inventory_hosts=inventory_hosts(), restart_on=vllm_changed)
            service_files = {path: f for path, f in rendered.items() if path not in ray.owned}
            restart_on += [*ray.env_ops, ray.cluster_restarted]
        if is_server:
            install_service(spec=spec, rendered=service_files, api_key=ctx["secrets"]["api_key"], restart_on=restart_on)

    if is_proxy:
        from vllm_fleet.roles.nginx import install_nginx
        from vllm_fleet.roles.smoke import run_smoke

        install_nginx(spec=spec, rendered=rendered, api_key=ctx["secrets"]["api_key"],
                      tls_key=ctx["secrets"]["tls_key"], tls_certificate=ctx["secrets"]["tls_certificate"])
        run_smoke(spec=spec, api_key=ctx["secrets"]["api_key"])

    # Monitoring last (monitoring.enabled): exporters on every host above, Prometheus on `monitoring` hosts.
    if spec["monitoring"]["enabled"] and set(rendered) & set(_monitoring.paths(spec).values()):
        from vllm_fleet.roles.monitoring import install_monitoring

        install_monitoring(spec=spec, rendered=rendered)
