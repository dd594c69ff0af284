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
        data = {"private_address": h.data.get("private_address")} if h.data.get("private_address") else {}
        if h.name in down or h.data.get("upstream_down"):
            data["upstream_down"] = True
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
    from vllm_fleet import render
    from vllm_fleet.pipeline import check
    from vllm_fleet.secrets import SecretError, read_secret

    checked = check(path)
    if not checked.ok:
        text = "\n".join(f"  {p.format()}" for p in checked.problems)
        print(f"vllm-fleet: {path}: the spec has errors; no host was changed\n{text}", file=sys.stderr)
        raise DeployError(f"{path}: invalid spec ({len(checked.errors)} error(s), listed above); no host was changed")
    resolved, problems, spec = checked.resolved, checked.problems, checked.spec
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


def preflight() -> None:
    """Stop before any operation when this host cannot become root the way the deploy will.

    With ``_sudo`` (the usual non-root SSH user) and no ``_sudo_password``, ``sudo -n true`` runs
    first, as the SSH user: without passwordless sudo pyinfra would ask for a password at its first
    root fact and, without a terminal, fail with a traceback. This names the host, the user and
    the fix instead. The deploy file runs for every host before any operation executes, so no
    host has been changed when this raises.
    """
    from pyinfra.facts.server import Command

    if not host.data.get("_sudo") or host.data.get("_sudo_password"):
        return
    user = host.data.get("ssh_user") or "the SSH user"
    out = host.get_fact(Command, "sudo -n true 2>/dev/null && echo vllm-fleet-sudo-ok || echo vllm-fleet-sudo-no", _sudo=False)
    if (out or "").strip() != "vllm-fleet-sudo-ok":
        raise DeployError(
            f"host {host.name}: user {user} cannot run sudo without a password (`sudo -n true` failed), "
            "and every deploy step needs root. Fix: give the user passwordless sudo (a sudoers line "
            f"`{user} ALL=(ALL) NOPASSWD: ALL`), connect as root (ssh_user: root, _sudo: False), or set "
            "_sudo_password in the host's data; no host was changed")


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


UNIT_SUFFIXES = (".service", ".socket", ".timer", ".path", ".mount", ".target")


@operation()
def atomic_put(dest: str, content: str, user: str = "root", group: str = "root", mode: str = "644"):
    """
    Place a text file atomically: a reader (systemd, nginx, a rebooting host) sees the old file
    or the new one, never a half-written one, even when the deploy is killed mid-way.

    pyinfra's ``files.put`` with ``_sudo`` uploads to /tmp and then runs ``cp`` over the
    destination, rewriting it in place. This uploads to ``DEST.tmp-vllm-fleet`` (same
    directory, so the same filesystem), sets owner and mode there, then renames it over DEST.

    + dest: remote path (its directory must exist)
    + content: the file's exact text
    + user, group, mode: ownership and permissions (mode as octal digits, e.g. "644")

    Nothing happens when the content (sha256), owner, group and mode already match; when only
    owner/mode differ they are fixed in place.

    **Example:**

    .. code:: python

        atomic_put(name="Put /etc/systemd/system/vllm.service", dest="/etc/systemd/system/vllm.service",
                   content=unit_text, mode="644")
    """
    import hashlib

    want = hashlib.sha256(content.encode()).hexdigest()
    remote = host.get_fact(File, path=dest)
    have = host.get_fact(Sha256File, path=dest) if remote else None
    if have != want:
        tmp = f"{dest}.tmp-vllm-fleet"
        yield FileUploadCommand(StringIO(content), tmp, remote_temp_filename=host.get_temp_filename(tmp))
        if user or group:
            yield StringCommand("chown", f"{user}:{group}" if group else user, tmp)
        yield StringCommand("chmod", mode, tmp)
        yield StringCommand("mv", "-f", tmp, dest)
        return
    # pyinfra's File fact gives the mode as the octal digits read as an int (0644 -> 644).
    if (user and remote.get("user") != user) or (group and remote.get("group") != group):
        yield StringCommand("chown", f"{user}:{group}" if group else user, dest)
    if int(remote.get("mode") or 0) != int(mode):
        yield StringCommand("chmod", mode, dest)


def put_rendered(rendered: dict[str, Any], paths: list[str] | None = None) -> dict[str, Any]:
    """Put rendered files atomically (:func:`atomic_put`); return {path: OperationMeta}.

    Unit files go last, after the files they name (EnvironmentFile=, ExecStartPre= scripts): a
    deploy killed in between never leaves a unit that a reboot would start against missing files.
    """
    out = {}
    for path, f in sorted(rendered.items(), key=lambda kv: (kv[0].endswith(UNIT_SUFFIXES), kv[0])):
        if paths is not None and path not in paths:
            continue
        out[path] = atomic_put(name=f"Put {path}", dest=path, content=f.content, user=f.owner, group=f.group,
                               mode=f"{f.mode:o}")
    return out
