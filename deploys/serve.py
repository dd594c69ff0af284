"""Everything, in order: bare hosts -> a smoke-tested vLLM service behind nginx.

    pyinfra -y inventory/lab.py deploys/serve.py                      # the lab's tiny CPU model
    VLLM_FLEET_SPEC=deployments/x.yaml pyinfra -y inventory/fleet.py deploys/serve.py

The spec comes from host data `vllm_fleet_spec`, else $VLLM_FLEET_SPEC, else
deployments/lab-tiny.yaml. It is validated (schema, semantic and hardware checks), its secrets
are read and its files rendered once, before any operation exists: a bad spec stops here and no
host is changed. Run from the repository root (roles/ is imported from the working directory).

Groups: `servers` run vLLM (single node); `proxy` runs nginx and the smoke tests go through it.
A host in neither group is left alone.
"""

from pyinfra import host

from roles.common import load_deploy_spec, rendered_for_host

ctx = load_deploy_spec()
spec = ctx["spec"]
rendered = rendered_for_host(ctx)
groups = set(host.groups)
is_server = "servers" in groups
is_proxy = "proxy" in groups and spec["proxy"]["enabled"]

if is_server:
    from roles.model import install_model
    from roles.nvidia import nvidia
    from roles.pyenv import pyenv, service_dirs
    from roles.service import install_service
    from roles.vllm import install_system_libraries, install_vllm

    nvidia(spec=spec)
    service_dirs(spec=spec)
    pyenv(spec=spec)
    install_system_libraries(spec=spec)
    vllm_changed = install_vllm(spec=spec)
    model_changed = install_model(spec=spec, hub_token=ctx["secrets"]["hub_token"])
    install_service(spec=spec, rendered=rendered, api_key=ctx["secrets"]["api_key"],
                    restart_on=[*(vllm_changed or []), *(model_changed or [])])

if is_proxy:
    from roles.nginx import install_nginx
    from roles.smoke import run_smoke

    install_nginx(spec=spec, rendered=rendered, api_key=ctx["secrets"]["api_key"])
    run_smoke(spec=spec, api_key=ctx["secrets"]["api_key"])
