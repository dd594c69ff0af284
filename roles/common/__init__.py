"""Shared pieces of the roles: loading the spec once per deploy, putting rendered files, and
writing secrets without ever showing their value (not even with pyinfra's --diff).
"""

from __future__ import annotations

import os
import sys
from io import StringIO
from pathlib import Path
from typing import Any

from pyinfra import host, inventory, logger
from pyinfra.api import FileUploadCommand, StringCommand, operation
from pyinfra.api.exceptions import PyinfraError
from pyinfra.facts.files import File, Sha256File
from pyinfra.operations import files

DEFAULT_SPEC = "deployments/lab-tiny.yaml"
_CACHE: dict[str, Any] = {}


class DeployError(PyinfraError):
    """A problem found before any host is touched (bad spec, missing secret)."""


def spec_path() -> str:
    """The spec a deploy uses: host data `vllm_fleet_spec`, else $VLLM_FLEET_SPEC, else the lab's."""
    return str(host.data.get("vllm_fleet_spec") or os.environ.get("VLLM_FLEET_SPEC") or DEFAULT_SPEC)


#: Replicas the nginx upstream marks `down` (comma-separated host names): set by `vllm-fleet
#: rollout` for the batch being updated; host data `upstream_down: true` does the same.
UPSTREAM_DOWN_ENV = "VLLM_FLEET_UPSTREAM_DOWN"


def upstream_down() -> set[str]:
    return {n.strip() for n in os.environ.get(UPSTREAM_DOWN_ENV, "").split(",") if n.strip()}


def inventory_hosts() -> dict[str, dict[str, Any]]:
    """The inventory as the renderers want it: {name: {address, groups, data}}."""
    out = {}
    down = upstream_down()
    for h in inventory:
        data = {"upstream_down": True} if (h.name in down or h.data.get("upstream_down")) else {}
        out[h.name] = {"address": h.data.get("ssh_hostname") or h.name, "groups": list(h.groups), "data": data}
    return out


def load_deploy_spec() -> dict[str, Any]:
    """Validate, resolve and render the spec once per deploy (the deploy file runs per host).

    Every problem is printed with its YAML path and fix, and the deploy stops before any
    operation exists, so no host is changed.
    """
    path = spec_path()
    if path in _CACHE:
        return _CACHE[path]
    from vllm_fleet import checks, render, spec as specmod
    from vllm_fleet.secrets import SecretError, read_secret

    try:
        spec = specmod.load(path)
        problems = specmod.schema_problems(spec)
        if not any(p.severity == "error" for p in problems):
            resolved = specmod.resolve(spec)
            try:
                from vllm_fleet.hwchecks import apply_model_facts
                apply_model_facts(resolved)
            except ImportError:  # pragma: no cover
                pass
            problems += checks.run(resolved, spec)
        if any(p.severity == "error" for p in problems):
            raise specmod.SpecError(problems, path)
    except specmod.SpecError as exc:
        text = "\n".join(f"  {p.format()}" for p in exc.problems)
        print(f"vllm-fleet: {path}: the spec has errors; no host was changed\n{text}", file=sys.stderr)
        raise DeployError(f"{path}: invalid spec ({len([p for p in exc.problems if p.severity == 'error'])} error(s), listed above); no host was changed") from None
    for p in problems:
        logger.warning(f"{path}: {p.format()}")
    secrets = {}
    try:
        secrets["api_key"] = read_secret(resolved["server"].get("api_key"), yaml_path="server.api_key", base_dir=spec.base_dir)
        secrets["hub_token"] = read_secret(resolved["model"].get("hub_token"), yaml_path="model.hub_token", base_dir=spec.base_dir)
    except SecretError as exc:
        raise DeployError(f"{path}: {exc}; no host was changed") from None
    if resolved["model"]["transfer"] == "upload" and not Path(resolved["model"]["local_dir"]).is_dir():
        raise DeployError(f"{path}: model.source: {resolved['model']['local_dir']} is not a directory on this machine "
                          "(for the lab: `vllm-fleet tiny-model`); no host was changed")
    try:
        rendered = render.render(resolved, inventory_hosts())
    except render.RenderError as exc:  # e.g. an inventory with no host in a server group
        raise DeployError(f"{path}: {exc}; no host was changed") from None
    _CACHE[path] = {"path": path, "spec": resolved, "secrets": secrets, "rendered": rendered, "base_dir": spec.base_dir}
    return _CACHE[path]


def rendered_for_host(ctx: dict[str, Any]) -> dict[str, Any]:
    return ctx["rendered"].get(host.name, {})


@operation()
def secret_file(path: str, content: str, user: str = "root", group: str = "root", mode: str = "600"):
    """
    Place a file holding a secret, never showing its content (pyinfra's ``files.put`` prints
    file contents with ``--diff``).

    + path: remote path
    + content: the file's content (the secret)
    + user, group, mode: ownership and permissions (default root:root 0600)

    **Example:**

    .. code:: python

        secret_file(name="API key", path="/etc/vllm-fleet/x/secrets.env",
                    content=f"VLLM_API_KEY={key}\\n")
    """
    import hashlib

    want = hashlib.sha256(content.encode()).hexdigest()
    remote = host.get_fact(File, path=path)
    have = host.get_fact(Sha256File, path=path) if remote else None
    if have != want:
        parent = os.path.dirname(path)
        # Create the directory private if it is missing; never loosen an existing one.
        yield StringCommand("test", "-d", parent, "||", "install", "-d", "-m", "700", parent)
        tmp = f"{path}.tmp-vllm-fleet"
        # Create the temp file with the final mode before the content lands in it.
        yield StringCommand("install", "-m", "600", "/dev/null", tmp)
        yield FileUploadCommand(StringIO(content), tmp)
        yield StringCommand("chown", f"{user}:{group}", tmp)
        yield StringCommand("chmod", mode, tmp)
        yield StringCommand("mv", "-f", tmp, path)  # atomic: never a half-written secret
    # pyinfra's File fact gives the mode as the octal digits read as an int (0600 -> 600).
    elif remote and (remote.get("user") != user or remote.get("group") != group or int(remote.get("mode") or 0) != int(mode)):
        yield StringCommand("chown", f"{user}:{group}", path)
        yield StringCommand("chmod", mode, path)


def put_rendered(rendered: dict[str, Any], paths: list[str] | None = None) -> dict[str, Any]:
    """Put rendered files (RenderedFile: content, mode, owner, group); return {path: OperationMeta}."""
    out = {}
    for path, f in sorted(rendered.items()):
        if paths is not None and path not in paths:
            continue
        out[path] = files.put(
            name=f"Put {path}",
            src=StringIO(f.content),
            dest=path,
            user=f.owner,
            group=f.group,
            mode=f"{f.mode:o}",
        )
    return out
