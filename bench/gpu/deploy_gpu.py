"""The GPU proof's deploy on a host without systemd as PID 1 (the lent GPU machine): the same roles
and calls as deploys/serve.py for a server, except the service role's systemd steps.

    VLLM_FLEET_SPEC=deployments/h200-qwen7b-bf16.yaml pyinfra -y bench/gpu/inventory_local.py bench/gpu/deploy_gpu.py

- service_dirs: the service user and the prefix / config / state directories;
- install_vllm: the pinned vLLM from install.wheelhouse (uploaded to {prefix}/wheelhouse, then
  `pip install --no-index --find-links`); a no-op when the env already has it;
- install_model: transfer none, the plan-time check that config.json is at model.path;
- the service role's files, with its own helpers (put_rendered, secret_file): vllm.service,
  vllm.env, node.env, secrets.env (0600, the key from server.api_key) and the cache/temp
  directories the unit's environment names. systemctl daemon-reload / restart / the health wait
  are left to bench/gpu/run_spec.py, which starts the unit's ExecStart with its EnvironmentFiles
  as systemd would.

Not run: roles.nvidia (the image has the driver and CUDA), roles.pyenv (the image's Python env,
/opt/torch/.venv with torch 2.11.0+cu130, is linked at {prefix}/env by bench/gpu/device.sh).
"""

from pyinfra import host
from pyinfra.operations import files

from vllm_fleet.roles.common import load_deploy_spec, put_rendered, rendered_for_host, secret_file
from vllm_fleet.roles.model import install_model
from vllm_fleet.roles.pyenv import service_dirs
from vllm_fleet.roles.vllm import install_vllm
from vllm_fleet.render import command
from vllm_fleet.render import files as render

ctx = load_deploy_spec()
spec = ctx.spec
rendered = rendered_for_host(ctx)
assert "servers" in host.groups and rendered, "bench/gpu/inventory_local.py puts @local in servers"

where = ctx.layout.paths[spec["name"]]  # where its files live (the layout's)

service_dirs(spec=spec)
install_vllm(spec=spec, where=where)
install_model(spec=spec, where=where, hub_token=ctx.secrets["hub_token"])

ins, srv = spec["install"], spec["server"]
for d in sorted({v for v in command.vllm_env(spec).values() if v.startswith(ins["state_dir"] + "/")}):
    files.directory(name=f"Directory {d}", path=d, user=srv["user"], group=srv["user"], mode="750")
keep = [
    p
    for p in rendered
    if p.startswith("/etc/systemd/system/")
    or (p.startswith(ins["config_dir"] + "/") and not p.endswith("/secrets.env"))
]
put_rendered(rendered, keep)
secret_file(
    name="API key (0600, never shown)",
    path=render.paths(spec)["secrets_env"],
    content=render.secrets_env_content(spec, ctx.secrets["api_key"]),
)
