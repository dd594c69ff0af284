"""Shared pieces of the roles: loading the spec once per deploy, putting rendered files, and
writing secrets without ever showing their value (not even with pyinfra's --diff).
"""

from __future__ import annotations

import hashlib
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from io import StringIO
from pathlib import Path
from typing import Any

from pyinfra import host, inventory, logger
from pyinfra.api import FileUploadCommand, operation
from pyinfra.api.exceptions import DeployError as PyinfraDeployError
from pyinfra.api.exceptions import PyinfraError
from pyinfra.facts.files import File, Sha256File

from vllm_fleet.host.programs import argv, chain
from vllm_fleet.host.network import Ipv4Interfaces, detect_ifname
from vllm_fleet.host.pyinfra_run import install_sigint
from vllm_fleet.host.results import fail_host
from vllm_fleet.render.layout import SERVICE_PARTS, UNIT_SUFFIXES, Layout, LayoutError, build, render_entry
from vllm_fleet.render.secrets import SecretError, read_spec_secrets, write_generated
from vllm_fleet.roles.common import progress
from vllm_fleet.specs import localpath
from vllm_fleet.specs.pipeline import check
from vllm_fleet.specs.source import SpecSourceError, spec_sources


@dataclass
class DeployContext:
    """What one deploy plans once, before any operation (:func:`load_deploy_spec`): every spec
    checked, its secrets read, the fleet's one layout. pyinfra runs the deploy file per host; each
    host's roles take their part of this."""

    #: the fleet's layout (vllm_fleet.render.layout): every host's parts and files
    layout: Layout
    #: {deployment: resolved spec}, in the order the specs were given
    specs: dict[str, dict[str, Any]]
    #: {deployment: its secrets' values} (vllm_fleet.render.secrets.SPEC_SECRETS, the TLS certificate)
    all_secrets: dict[str, dict[str, Any]]
    #: {deployment: its spec file}
    sources: dict[str, str]
    #: the first spec file given
    path: str
    #: ``generate: true`` secrets planned this run ({path: value}), written at execute time
    generated: dict[Path, str] = field(default_factory=dict)
    #: the inventory the layout was built from ({host: {address, groups, data}}, with what the
    #: deploy filled in from facts): :func:`relayout_host` builds it again with more host data
    inventory: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def first(self) -> str:
        """The first deployment's name (the single-deployment commands: down, rollout)."""
        return next(iter(self.specs))

    @property
    def spec(self) -> dict[str, Any]:
        """The first deployment's resolved spec."""
        return self.specs[self.first]

    @property
    def secrets(self) -> dict[str, Any]:
        """The first deployment's secrets (every deployment's: :attr:`all_secrets`)."""
        return self.all_secrets[self.first]

    @property
    def rendered(self) -> dict[str, dict[str, Any]]:
        """{host: {path: RenderedFile}}, ``client`` last (Layout.files)."""
        return self.layout.files()


_CACHE: dict[str, DeployContext] = {}
_GENERATED: dict[Path, str] = {}  # generate: true secrets planned this run ({path: value}), written at execute time


class DeployError(PyinfraError):
    """A problem found before any host is touched (bad spec, missing secret), or, raised while one
    host's operations are planned (inside :func:`this_host_only`), a problem of that host."""


#: What a role raises about the host it plans (the sudo preflight, NoSpace, StateUnknown, a clash,
#: a download that failed): inside :func:`this_host_only` it fails that host only.
HOST_PROBLEMS: tuple[type[Exception], ...] = (DeployError, PyinfraDeployError)


@contextmanager
def this_host_only():
    """Plan the current host's operations; a problem of this host (:data:`HOST_PROBLEMS`) fails
    THIS host the pyinfra way (vllm_fleet.host.results.fail_host: ``state.fail_hosts``, its error
    printed with the host's prefix, pyinfra's ``--fail-percent`` checked) and the other hosts go
    on. Code after the block still runs: put the rest of the host's planning inside it.
    What :func:`load_deploy_spec` raises (a bad spec, a layout that does not fit) is the fleet's
    problem and stays outside: it stops every host before any operation exists.

    **Example:**

    .. code:: python

        ctx = load_deploy_spec()
        with this_host_only():
            preflight()
            ...
    """
    try:
        yield
    except HOST_PROBLEMS as exc:
        # the message was written for a run that stops here; the other hosts go on
        fail_host(host, str(exc).replace("no host was changed", "nothing was changed on this host"))


def spec_paths(h: Any = None) -> list[str]:
    """The specs a host's deploy uses (:mod:`vllm_fleet.specs.source`: data `vllm_fleet_spec`, a
    path or a list, else $VLLM_FLEET_SPEC, paths separated by ``:``, else the lab's own for the lab
    inventory); no spec: a DeployError saying how."""
    h = h or host
    try:
        return spec_sources(h.data, h.name)[0]
    except SpecSourceError as exc:
        raise DeployError(f"{exc}; no host was changed") from None


def spec_path(h: Any = None) -> str:
    """The first spec (see :func:`spec_paths`)."""
    return spec_paths(h)[0]


def _norm(p: str) -> str:
    return os.path.abspath(os.path.expanduser(p))


def _inventory_specs() -> tuple[list[str], dict[str, list[str] | None]]:
    """Every spec the inventory's hosts name (first-seen order, each once) and each host's list
    (None: no spec), read once per run: pyinfra runs the deploy file per host, and reading every
    host's data for each host grew as the square of the hosts (1 s at 512 hosts). Kept on the
    inventory object itself (a new run, a new inventory), with the $VLLM_FLEET_SPEC it was read under."""
    inv = inventory._get_module() if hasattr(inventory, "_get_module") else inventory
    env = os.environ.get("VLLM_FLEET_SPEC", "")
    cached = getattr(inv, "_vllm_fleet_specs", None)
    if cached and cached[0] == env:
        return cached[1]
    per_host: dict[str, list[str] | None] = {}
    order: list[str] = []
    seen: set[str] = set()
    for h in inv:
        try:
            paths = spec_paths(h)
        except DeployError:
            per_host[h.name] = None
            continue
        per_host[h.name] = paths
        for path in paths:
            if _norm(path) not in seen:
                seen.add(_norm(path))
                order.append(path)
    try:
        inv._vllm_fleet_specs = (env, (order, per_host))
    except AttributeError:  # an inventory that takes no attribute: read again next time
        pass
    return order, per_host


def fleet_spec_paths() -> tuple[list[str], dict[str, list[str] | None]]:
    """Every spec any inventory host names, in first-seen order (this host's first), and each
    host's own list (None: a host with no spec, which deploys nothing)."""
    mine = spec_paths()
    everyone, per_host = _inventory_specs()
    have = {_norm(p) for p in mine}
    return list(mine) + [p for p in everyone if _norm(p) not in have], dict(per_host)


#: Replicas the nginx upstream marks `down`: instance ids (``HOST:N``) or host names (all of
#: that host's), comma-separated: set by `vllm-fleet rollout` for the batch being updated; host
#: data `upstream_down: true` does the same for a host.
UPSTREAM_DOWN_ENV = "VLLM_FLEET_UPSTREAM_DOWN"


def upstream_down() -> set[str]:
    return {n.strip() for n in os.environ.get(UPSTREAM_DOWN_ENV, "").split(",") if n.strip()}


def inventory_hosts() -> dict[str, dict[str, Any]]:
    """The inventory as the layout wants it: {name: {address, groups, data}} (the host data the
    layout reads: vllm_fleet.render.layout's docstring; vllm_fleet.render.layout.render_entry)."""
    return {h.name: render_entry(h.name, list(h.groups), h.data) for h in inventory}


def _detect_ifnames(layout: Layout, hosts: dict[str, dict[str, Any]]) -> bool:
    """Multi-node nodes without a configured interface: the one holding the node's private
    address (a fact of that host), into its data. True when anything was filled in."""
    filled = False
    for dep, r in layout.deployments.items():
        if int(r["parallel"]["nodes"]) < 2 or r["parallel"].get("socket_ifname"):
            continue
        for node in layout.nodes(dep):
            data = hosts[node.target].setdefault("data", {})
            if not node.roles & SERVICE_PARTS or data.get("socket_ifname"):
                continue
            interfaces = inventory.get_host(node.target).get_fact(Ipv4Interfaces)
            ifname = detect_ifname(interfaces or {}, str(node.private))
            if not ifname:
                raise DeployError(
                    f"{node.target}: no single interface holds the node address {node.private} "
                    f"(IPv4 interfaces: {interfaces or 'none read'}); set parallel.socket_ifname or host data "
                    "socket_ifname; no host was changed"
                )
            data["socket_ifname"] = ifname
            filled = True
    return filled


def load_deploy_spec() -> DeployContext:
    """Check every spec, read their secrets and build the fleet's layout once per deploy (the
    deploy file runs per host).

    Every problem is printed with its YAML path and fix, and the deploy stops before any
    operation exists, so no host is changed. Returns the :class:`DeployContext` (the same one
    for every host of the run).
    """
    install_sigint()  # Ctrl-C: one line and exit 130, not pyinfra's traceback and exit 0

    progress.install()  # a line every few seconds while an upload, install or wait runs
    paths, per_host = fleet_spec_paths()
    key = os.pathsep.join(_norm(p) for p in paths) + "|" + os.environ.get(UPSTREAM_DOWN_ENV, "")
    if key in _CACHE:
        return _CACHE[key]
    specs: dict[str, dict[str, Any]] = {}
    secrets: dict[str, dict[str, Any]] = {}
    sources: dict[str, str] = {}
    names: dict[str, str] = {}  # normalised spec path -> deployment name
    # One value per generated secret for the whole run: pyinfra loads the deploy for its hosts
    # in parallel greenlets, and a load that waits on another host's facts (_detect_ifnames) lets
    # the next one in before _CACHE is set; both must plan (and write) the same key.
    generated = _GENERATED
    for path in paths:
        resolved, sec = _checked_spec(path, generated)
        if resolved["name"] in specs:
            raise DeployError(
                f"{path}: deployment {resolved['name']} is also in {sources[resolved['name']]}: each spec needs its "
                "own name; no host was changed"
            )
        specs[resolved["name"]], secrets[resolved["name"]], sources[resolved["name"]] = resolved, sec, path
        names[_norm(path)] = resolved["name"]
    hosts = inventory_hosts()
    _hosts_own_deployments(hosts, per_host, names)
    layout = _fleet_layout(specs, hosts, sources, paths)
    for w in layout.warnings:  # allowed but costly (e.g. many servers without a `proxy` group), with the fix
        logger.warning(f"vllm-fleet: {w}")
    _CACHE[key] = DeployContext(layout, specs, secrets, sources, paths[0], generated, hosts)
    return _CACHE[key]


def _checked_spec(path: str, generated: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """One spec checked (its problems printed with YAML path and fix; errors stop the deploy), its
    secrets read on this machine and an uploaded model's directory present: ``(resolved, secrets)``."""
    checked = check(path)
    if not checked.ok:
        text = "\n".join(f"  {p.format()}" for p in checked.problems)
        print(f"vllm-fleet: {path}: the spec has errors; no host was changed\n{text}", file=sys.stderr)
        raise DeployError(f"{path}: invalid spec ({len(checked.errors)} error(s), listed above); no host was changed")
    resolved, problems, spec = checked.resolved, checked.problems, checked.spec
    for p in problems:
        logger.warning(f"{path}: {p.format()}")
    # Every secret of the spec (vllm_fleet.render.secrets.SPEC_SECRETS), read on this machine. A
    # `generate: true` file that is missing gets its value now but is written only when the
    # deploy executes (write_generated_secrets): a --dry run writes nothing here.
    try:
        sec = read_spec_secrets(resolved, spec.base_dir, generated)
        sec["tls_certificate"] = _tls_certificate(resolved, spec.base_dir)
    except SecretError as exc:
        raise DeployError(f"{path}: {exc}; no host was changed") from None
    if resolved["model"]["transfer"] == "upload" and not Path(resolved["model"]["local_dir"]).is_dir():
        raise DeployError(
            f"{path}: model.source: {resolved['model']['local_dir']} is not a directory on this machine "
            "(for the lab: `vllm-fleet tiny-model`); no host was changed"
        )
    return resolved, sec


def _hosts_own_deployments(hosts: dict[str, Any], per_host: dict[str, Any], names: dict[str, str]) -> None:
    """Hosts (groups) with their own specs: each deployment's layout is made of the hosts that
    name it (host data `deployments`, unless the inventory sets it itself)."""
    if len({tuple(_norm(p) for p in v) if v else None for v in per_host.values()}) > 1:
        for name, own in per_host.items():
            data = hosts[name].setdefault("data", {})
            if data.get("deployments") is None:
                data["deployments"] = [names[_norm(p)] for p in own or []]


def _fleet_layout(
    specs: dict[str, dict[str, Any]], hosts: dict[str, Any], sources: dict[str, str], paths: list[str]
) -> Layout:
    """The one layout of the deploy (built again when the hosts' interfaces were read: facts
    first, then the layout); a layout error stops the deploy, printed."""
    try:
        layout = build(list(specs.values()), hosts, down=upstream_down(), sources=sources)
        if _detect_ifnames(layout, hosts):  # facts first, then the one layout the deploy uses
            layout = build(list(specs.values()), hosts, down=upstream_down(), sources=sources)
    except LayoutError as exc:  # e.g. an inventory with no host in the `servers` group
        text = "\n".join(f"  {line}" for line in exc.problems)
        print(f"vllm-fleet: the fleet layout has errors; no host was changed\n{text}", file=sys.stderr)
        raise DeployError(f"{', '.join(paths)}: {exc.problems[0]}; no host was changed") from None
    return layout


def relayout_host(ctx: DeployContext, host_name: str, data: dict[str, Any]) -> Any:
    """This host's layout again, with ``data`` added to its host data (a figure the deploy read
    on the host, e.g. ``kv_offload_gib`` for `auto`): the fleet's layout is built again from the
    same inventory and only this host's part of it is taken (the other hosts' stay as they were)."""
    ctx.inventory[host_name].setdefault("data", {}).update(data)
    new = _fleet_layout(ctx.specs, ctx.inventory, ctx.sources, [ctx.path])
    ctx.layout.hosts[host_name] = new.hosts[host_name]
    return ctx.layout.hosts[host_name]


def settle_memory(ctx: DeployContext, h: Any, host_name: str, snap: Any) -> Any:
    """The CPU tiers of the KV cache (engine.kv_offload) of every replica on this host, and the
    reserve, against its RAM as the one state read found it (clash.refuse_memory: refused with the
    numbers before any change); ``auto`` sized from what is left, into the host's data
    (``kv_offload_gib``) and this host's layout built again. Returns the host's layout."""
    from vllm_fleet.roles.common import clash

    auto = clash.refuse_memory(ctx.specs, h, host_name, snap)
    if not auto:
        return h
    given = h.data.get("kv_offload_gib")
    have = dict(given) if isinstance(given, dict) else ({name: given for name in h.parts} if given is not None else {})
    return relayout_host(ctx, host_name, {"kv_offload_gib": {**have, **auto}})


def host_layout(ctx: DeployContext) -> Any:
    """This host's part of the layout (None: the deploy has nothing for it)."""
    return ctx.layout.hosts.get(host.name)


def _tls_certificate(resolved: dict[str, Any], base_dir: Path) -> str | None:
    """proxy.tls.certificate's text (a file on the control machine, relative to the spec)."""
    tls = resolved["proxy"].get("tls") or {}
    if not (tls.get("enabled") and tls.get("certificate")) or tls.get("self_signed"):
        return None
    p, why, fix = localpath.readable(tls["certificate"], "file", base_dir)
    if p is None:
        raise SecretError(
            f"proxy.tls.certificate: cannot read {tls['certificate'][:200]!r}: {why}" + (f"; {fix}" if fix else "")
        )
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SecretError(f"proxy.tls.certificate: cannot read {p}: {getattr(exc, 'strerror', None) or exc}") from None
    if "-----BEGIN" not in text:
        raise SecretError(f"proxy.tls.certificate: {p} is not a PEM file (no -----BEGIN line)")
    return text


def _write_generated(generated: dict[Path, str]) -> None:
    for p in write_generated(generated):
        logger.info(f"vllm-fleet: generated secret file {p} (mode 0600)")


def write_generated_secrets(ctx: DeployContext) -> None:
    """The first operation on every host when the deploy generated a secret: write its file on
    the control machine at execute time, before the value reaches any host (never with --dry)."""
    from pyinfra.operations import python

    if ctx.generated:
        python.call(
            name="Write generated secret files on the control machine (0600)",
            function=_write_generated,
            generated=ctx.generated,
        )


def as_root() -> dict[str, Any]:
    """The privilege arguments (``_sudo``, ``_su_user``, ``_doas`` ...) this host's operations
    run with, resolved the way pyinfra resolves them for an operation (the deploy's arguments,
    then host data, then the config: ``--sudo``), for a python callback's
    ``host.run_shell_command``. Not a fixed ``_sudo=True``: a host reached as root
    (``ssh_user: root`` or ``@local`` as root, ``_sudo`` unset) may have no sudo at all (minimal
    Debian images, the GPU machine), and ``sudo`` missing made every such command fail.

    Example:

    .. code:: python

        ok, out = host.run_shell_command("systemctl is-active nginx", **as_root())
    """
    from pyinfra import state
    from pyinfra.api.arguments import pop_global_arguments

    args, _ = pop_global_arguments(state, host, {})
    return {
        k: v
        for k, v in args.items()
        if k.startswith(("_sudo", "_use_sudo", "_preserve_sudo", "_su_", "_use_su", "_preserve_su", "_doas", "_dzdo"))
    }


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
    out = host.get_fact(
        Command, "sudo -n true 2>/dev/null && echo vllm-fleet-sudo-ok || echo vllm-fleet-sudo-no", _sudo=False
    )
    if (out or "").strip() != "vllm-fleet-sudo-ok":
        raise DeployError(
            f"host {host.name}: user {user} cannot run sudo without a password (`sudo -n true` failed), "
            "and every deploy step needs root. Fix: give the user passwordless sudo (a sudoers line "
            f"`{user} ALL=(ALL) NOPASSWD: ALL`), connect as root (ssh_user: root, _sudo: False), or set "
            "_sudo_password in the host's data; no host was changed"
        )


def role_data(key: str, defaults: dict[str, Any]) -> Any:
    """Host data ``key``, else the role's default from ``defaults`` (its DEFAULTS): inside the
    role's ``@deploy`` pyinfra's data_defaults give the same; a role's ``state_query`` runs
    outside it (deploys/serve.py builds the one read before any role runs)."""
    value = host.data.get(key)
    return defaults[key] if value is None else value


def rendered_for_host(ctx: DeployContext) -> dict[str, Any]:
    """Every file the layout places on this host ({path: RenderedFile})."""
    h = host_layout(ctx)
    return dict(h.files) if h else {}


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
    want = hashlib.sha256(content.encode()).hexdigest()
    remote = host.get_fact(File, path=path)
    have = host.get_fact(Sha256File, path=path) if remote else None
    if have != want:
        parent = os.path.dirname(path)
        # Create the directory private if it is missing; never loosen an existing one.
        yield chain(argv("test", "-d", parent), argv("install", "-d", "-m", "700", parent), op="||")
        tmp = f"{path}.tmp-vllm-fleet"
        # Create the temp file with the final mode before the content lands in it.
        yield argv("install", "-m", "600", "/dev/null", tmp)
        yield FileUploadCommand(StringIO(content), tmp)
        yield argv("chown", f"{user}:{group}", tmp)
        yield argv("chmod", mode, tmp)
        yield argv("mv", "-f", tmp, path)  # atomic: never a half-written secret
    # pyinfra's File fact gives the mode as the octal digits read as an int (0600 -> 600).
    elif remote and (
        remote.get("user") != user or remote.get("group") != group or int(remote.get("mode") or 0) != int(mode)
    ):
        yield argv("chown", f"{user}:{group}", path)
        yield argv("chmod", mode, path)


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
    want = hashlib.sha256(content.encode()).hexdigest()
    remote = host.get_fact(File, path=dest)
    have = host.get_fact(Sha256File, path=dest) if remote else None
    if have != want:
        tmp = f"{dest}.tmp-vllm-fleet"
        yield FileUploadCommand(StringIO(content), tmp, remote_temp_filename=host.get_temp_filename(tmp))
        if user or group:
            yield argv("chown", f"{user}:{group}" if group else user, tmp)
        yield argv("chmod", mode, tmp)
        yield argv("mv", "-f", tmp, dest)
        return
    # pyinfra's File fact gives the mode as the octal digits read as an int (0644 -> 644).
    if (user and remote.get("user") != user) or (group and remote.get("group") != group):
        yield argv("chown", f"{user}:{group}" if group else user, dest)
    if int(remote.get("mode") or 0) != int(mode):
        yield argv("chmod", mode, dest)


@contextmanager
def op_per(key: str):
    """Give the operation created inside one identity per ``key`` (e.g. a path), not per loop turn.

    pyinfra names an operation by where it is called and, in a loop, by the turn: the i-th
    operation of a loop is the same operation on every host. Hosts with different lists (a
    proxy host has an nginx site, a server host not) then show merged names ("Remove a, Remove
    b") and repeats in pyinfra's output, and a host's row can vanish into another's. Inside
    ``op_per(path)`` the same path is one operation on every host and another path another.
    """
    host.loop_position.append(int(hashlib.sha256(key.encode()).hexdigest()[:12], 16))
    try:
        yield
    finally:
        host.loop_position.pop()


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def put_rendered(rendered: dict[str, Any], paths: list[str] | None = None) -> dict[str, Any]:
    """Put rendered files atomically (:func:`atomic_put`); return {path: OperationMeta}, where a
    file the host's snapshot (vllm_fleet.roles.common.state) shows in place gets no operation
    but a :class:`~vllm_fleet.roles.common.state.Converged` stand-in.

    Unit files go last, after the files they name (EnvironmentFile=, ExecStartPre= scripts): a
    deploy killed in between never leaves a unit that a reboot would start against missing files.
    """
    from .state import Converged, host_state

    snap = host_state()
    out = {}
    for path, f in sorted(rendered.items(), key=lambda kv: (kv[0].endswith(UNIT_SUFFIXES), kv[0])):
        if paths is not None and path not in paths:
            continue
        if snap.file_ok(path, _sha256(f.content), f.owner, f.group, f"{f.mode:o}"):
            out[path] = Converged(path)
            continue
        out[path] = atomic_put(
            name=f"Put {path}", dest=path, content=f.content, user=f.owner, group=f.group, mode=f"{f.mode:o}"
        )
    return out


def put_secret(name: str, path: str, content: str, user: str = "root", group: str = "root", mode: str = "600") -> Any:
    """:func:`secret_file`, or a Converged stand-in when the host's snapshot shows it in place."""
    from .state import Converged, host_state

    if host_state().file_ok(path, _sha256(content), user, group, mode):
        return Converged(path)
    return secret_file(name=name, path=path, content=content, user=user, group=group, mode=mode)


def rendered_query(rendered: dict[str, Any], paths: list[str] | None = None) -> Any:
    """The snapshot :class:`~vllm_fleet.host.state.Query` of rendered files (and other
    paths, e.g. secrets) that :func:`put_rendered` / :func:`put_secret` compare against."""
    from .state import Query

    wanted = [p for p in rendered if paths is None or p in paths] + [p for p in paths or [] if p not in rendered]
    return Query(stat=tuple(wanted), sha=tuple(wanted))


# ------------------------------------------------------------------------------------------------
# pyinfra's operations, created only where the host differs (vllm_fleet.roles.common.state)


def directory(name: str, path: str, user: str | None = None, group: str | None = None, mode: Any = None) -> Any:
    """``files.directory``, or a Converged stand-in when the snapshot shows it with that owner and mode."""
    from pyinfra.operations import files

    from .state import Converged, host_state

    if host_state().directory_ok(path, user, group, mode):
        return Converged(path)
    return files.directory(name=name, path=path, user=user, group=group, mode=mode)


def packages(name: str, packages: list[str], **kwargs: Any) -> Any:
    """
    ``apt.packages`` for packages that are missing, and nothing at all when every one is installed.

    pyinfra's ``apt.packages(update=True, cache_time=N)`` refreshes apt's lists (reaching the
    network) whenever they are older than N seconds, before it looks at what is installed: a
    re-deploy hours later was no longer a no-op. Here what is installed is read first (the host's
    snapshot, else pyinfra's DebPackages fact), and only a missing package brings the lists
    refresh and the install (``update=True, cache_time=3600`` unless given).

    + name: the operation's name
    + packages: Debian package names
    + kwargs: further ``apt.packages`` arguments

    **Example:**

    .. code:: python

        packages(name="nginx package", packages=["nginx"])
    """
    from pyinfra.operations import apt

    from .state import Converged, Query, role_state

    names = list(packages)
    # the deploy's one read (the roles' state queries ask their packages), else one read of
    # just these: never dpkg's whole list as a fact beside it
    if role_state(Query(debs=tuple(names))).debs_installed(names):
        return Converged(", ".join(names))
    kwargs.setdefault("update", True)
    kwargs.setdefault("cache_time", 3600)
    return apt.packages(name=name, packages=names, **kwargs)


def service_running(name: str, service: str, running: bool = True, enabled: bool = True) -> Any:
    """``systemd.service(running, enabled)``, or a Converged stand-in when the snapshot shows the
    unit so (active and enabled)."""
    from pyinfra.operations import systemd

    from .state import Converged, host_state

    unit = service if "." in service else f"{service}.service"
    if host_state().unit_ok(unit, running=running, enabled=enabled):
        return Converged(unit)
    return systemd.service(name=name, service=service, running=running, enabled=enabled)
