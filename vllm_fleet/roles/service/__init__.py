"""The vLLM systemd service: system user, directories, environment files (the API key in a
0600 file), the rendered unit; daemon-reload and restart only when something relevant changed;
then wait until /health answers, with a deadline and the journal tail in the error.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import files, python, server, systemd
from pyinfra.operations.util import any_changed

from vllm_fleet.host import programs
from vllm_fleet.host.programs import argv as cmd
from vllm_fleet.host.programs import if_then
from vllm_fleet.roles.common import (
    as_root,
    directory,
    op_per,
    put_rendered,
    put_secret,
    remove,
    rendered_query,
    service_running,
)
from vllm_fleet.host.state import Query, Snapshot
from vllm_fleet.roles.common.state import Converged, pending, role_state, unknown
from vllm_fleet.render import command
from vllm_fleet.render import files as render
from vllm_fleet.render.layout import LEGACY_UNIT, Node, Paths, files_of
from vllm_fleet.render.secrets import host_secret_files
from vllm_fleet.roles import model, nvidia, pyenv, vllm
from vllm_fleet.roles.router import wheels_dir as router_wheels_dir
from vllm_fleet.roles.smoke import chat_on_host, replica_chat, replica_chat_query
from vllm_fleet.roles.vllm import defaults as vd
from vllm_fleet.serving.smoke import judge_replica_chat
from vllm_fleet.specs.sections import reads

from . import defaults as d
from .rootcause import JOURNAL_READ, failure_text
from .defaults import DEFAULTS

#: The spec sections this role reads (vllm_fleet.specs.sections); its README lists them.
SECTIONS = ("engine", "env", "install", "model", "monitoring", "name", "parallel", "proxy", "server", "smoke")

#: What install_server_stack hands its roles (nvidia, pyenv, vllm, model): the union of theirs.
STACK_SECTIONS = tuple(sorted(set().union(*(r.SECTIONS for r in (nvidia, pyenv, vllm, model)))))

UNIT = LEGACY_UNIT  # the default name of _wait_healthy's unit (callers pass an instance's)


# ``owner PORT UNIT`` (host/scripts/port_owner.sh, a shell function included by health_probe.sh):
# who holds the listening socket of a port, "own", "other PID COMM" or "unknown".


def _probe(url: str, unit: str, port: int | None = None) -> tuple[str, str, int, str]:
    """``(HTTP code of url, the unit's ActiveState, NRestarts, who listens on port)``; the last
    only when the code is 200 and a port is given (else "")."""
    ok, out = host.run_shell_command(
        programs.shell("health_probe.sh", url, unit, "" if port is None else int(port)), **as_root()
    )
    lines = [line.strip() for line in getattr(out, "stdout_lines", [])] + ["", "", "", ""]
    restarts = int(lines[2]) if lines[2].isdigit() else 0
    return lines[0], lines[1], restarts, lines[3]


#: vLLM raises its open-files soft limit to this at start (``set_ulimit``) and warns below it.
VLLM_NOFILE = 65535


def _start_to_healthy(unit: str) -> tuple[str, int | None]:
    """How long the unit's process took from its start to a healthy /health: systemd's
    ExecMainStartTimestamp (wall clock, microseconds) against the host's clock now. What a
    rollout waits per replica on top of the drain, whoever started the process (this deploy or
    systemd). Not /proc/uptime against the monotonic timestamp: containers (lxcfs) virtualise it.
    Also the open-files limit the main process got (None when unknown)."""
    _, out = host.run_shell_command(programs.shell("unit_started.sh", unit), **as_root())
    lines = [line.strip() for line in getattr(out, "stdout_lines", [])] + ["", "", ""]
    nofile = int(lines[2]) if lines[2].isdigit() else None
    try:
        secs = float(lines[1]) - float(lines[0])
    except ValueError:
        return "start to healthy: unknown", nofile
    return f"start to healthy {secs:.1f} s", nofile


def _wait_healthy(
    port: int,
    deadline: int,
    interval: float,
    journal_lines: int,
    unit: str = UNIT,
    spec: dict[str, Any] | None = None,
    where: Paths | None = None,
    stamp: str | None = None,
) -> None:  # noqa: D401
    """Runs on the host at execute time: poll /health there until 200 from the unit's own process.

    A 200 counts only when the process listening on the port belongs to the unit (its cgroup):
    another deployment or process on the same port answers /health too (issue 24: "healthy after
    0 s" while the new unit crash-looped on "Address already in use"). Fails early, with the
    journal tail, when the unit fails or systemd restarts it (a crash while starting repeats on
    every restart: waiting out the deadline would only hide it). With ``spec`` (its smoke tests
    on; ``where``: its paths, the layout's), healthy then also means one short chat on the host
    answers (roles.smoke.replica_chat).
    ``stamp`` (the instance's ``replica-N.applied``) is touched once healthy: this start was seen
    healthy, so the next deploy does not wait for it again (_still_starting).
    """
    t0 = time.monotonic()
    url = f"http://127.0.0.1:{port}/health"
    _, _, restarts0, _ = _probe(url, unit)
    last = ""
    while time.monotonic() - t0 < deadline:
        code, state, restarts, owner = _probe(url, unit, port)
        if code == "200" and owner in ("own", "unknown"):
            # printed at pyinfra's default verbosity (host.noop only with -v): what a restart costs
            took, nofile = _start_to_healthy(unit)
            host.log(f"{unit} healthy after {time.monotonic() - t0:.0f} s of waiting; {took}")
            if nofile is not None and nofile < VLLM_NOFILE:
                host.log(
                    f"{unit} runs with an open-files limit of {nofile} (the unit asks LimitNOFILE=1048576; vLLM wants "
                    f">= {VLLM_NOFILE}): the host's init could not raise it (a container's limit); see "
                    "docs/gpu-proof.md"
                )
            if spec is not None:
                why = judge_replica_chat(*chat_on_host(spec, where, port), spec["model"]["served_name"])
                if why:
                    raise RuntimeError(
                        f"{host.name}: {unit} answers /health but not a chat on port {port}: {why}; look: journalctl "
                        f"-u {unit}"
                    )
            if stamp:
                host.run_shell_command(cmd("touch", "-c", stamp), **as_root())
            return
        last = f"/health -> {code or 'no answer'}, unit {state}, NRestarts {restarts}"
        if code == "200":
            _, pid, comm = (owner.split(" ", 2) + ["", "", ""])[:3]
            last += (
                f"; port {port} is answered by PID {pid} ({comm}), not by {unit}: another deployment or process "
                "holds the port"
            )
        if state == "failed" or restarts > restarts0:
            last += f", the unit crashed while starting (restarts {restarts0} -> {restarts})"
            break
        time.sleep(interval)
    # Enough of the journal to hold the engine's own error above the API server's traceback
    # (rootcause.JOURNAL_READ); the message shows that line first, then the last journal_lines.
    _, out = host.run_shell_command(
        cmd("journalctl", "-u", unit, "-n", JOURNAL_READ, "--no-pager", "-o", "cat"), **as_root()
    )
    raise RuntimeError(
        failure_text(
            host.name,
            unit,
            f"not healthy after {time.monotonic() - t0:.0f} s (deadline {deadline} s; {last}).",
            list(getattr(out, "stdout_lines", []) or []),
            int(journal_lines),
        )
    )


@deploy("vLLM API port firewall", data_defaults=DEFAULTS)
def api_firewall(rendered: dict[str, Any]):
    """
    Close vLLM's API ports to everyone but the proxy hosts, when vLLM listens beyond loopback.

    vLLM's /health and /metrics need no key, and its API checks the key itself only; replicas
    behind a proxy on another host listen on ``server.host`` (0.0.0.0). The layout renders one
    nftables table per host over every deployment there (``inet vllm_fleet_api``, rules in
    ``/etc/vllm-fleet/api-firewall.nft``, loaded by ``vllm-fleet-api-firewall.service`` before
    vLLM) that accepts the instances' ports from loopback, the proxy hosts' private addresses and
    host data ``vllm_api_firewall_allow``, and drops them from everywhere else. This puts those
    files and loads them when they changed; nothing when the layout rendered none (loopback only,
    no proxy, or host data ``vllm_api_firewall: false``).

    + rendered: this host's rendered files ({path: RenderedFile})

    **Example:**

    .. code:: python

        api_firewall(rendered=rendered_for_host(ctx))
    """
    rules_path, unit_path = render.API_FIREWALL_FILE, f"{render.SYSTEMD_DIR}/{render.API_FIREWALL_UNIT}"
    rendered = files_of(rendered, "", "service")  # the host-wide files this role places: the firewall's
    if rules_path not in rendered:
        return []
    # Before the install (deploys/serve.py calls this first on a host): its directory may not exist yet.
    directory(
        name=f"Directory {Path(rules_path).parent}",
        path=str(Path(rules_path).parent),
        user="root",
        group="root",
        mode="755",
    )
    put = put_rendered(rendered, [rules_path, unit_path])
    rules, unit = put[rules_path], put[unit_path]
    # (operations only where something differs: a converged host gets none, vllm_fleet.roles.common.state)
    if pending(unit):
        systemd.daemon_reload(name="systemd daemon-reload (API firewall unit)", _if=unit.did_change)
    if pending(rules, unit):
        systemd.service(
            name=f"{d.API_FIREWALL_UNIT}: load the rules (they changed)",
            service=d.API_FIREWALL_UNIT,
            running=True,
            restarted=True,
            enabled=True,
            _if=any_changed(rules, unit),
        )
    service_running(
        name=f"{d.API_FIREWALL_UNIT} active and enabled", service=d.API_FIREWALL_UNIT, running=True, enabled=True
    )
    return [rules, unit]


def api_firewall_query(rendered: dict[str, Any]) -> Query:
    """What api_firewall compares against (vllm_fleet.roles.common.state)."""
    rules_path, unit_path = render.API_FIREWALL_FILE, f"{render.SYSTEMD_DIR}/{render.API_FIREWALL_UNIT}"
    rendered = files_of(rendered, "", "service")
    if rules_path not in rendered:
        return Query()
    return rendered_query(rendered, [rules_path, unit_path]) | Query(
        stat=(str(Path(rules_path).parent),), units=(d.API_FIREWALL_UNIT,)
    )


@reads(*STACK_SECTIONS)
def install_server_stack(
    spec: dict[str, Any],
    where: Paths,
    hub_token: str | None = None,
    present: bool = True,
    purge: bool | None = None,
) -> tuple[list, list] | dict[str, Any]:
    """
    Everything the vLLM units stand on, in order: the NVIDIA driver (GPU hosts), the service user
    and directories, the Python env, vLLM's system libraries, the pinned vLLM, the model weights.
    The one place deploys/serve.py (every vLLM host) and deploys/rollout.py (a replica's update)
    get them from.

    + spec: the resolved deployment spec
    + where: where the deployment's files live (the layout's: ``ctx.layout.paths[name]``,
      vllm_fleet.render.parts.Paths): the env and its python (pyenv, vllm, model); with
      ``present=False`` the router's uploaded wheels beside its venv
    + hub_token: the model hub token's value (None when the model is local or public)
    + present: False removes what only an install needs (the vllm role's uploaded wheelhouse and
      find-links, uv's cache, the router's uploaded wheels); the environment, the weights and
      vLLM's caches stay for a later deploy, and the driver, the service user and the
      distribution packages always stay
    + purge: with ``present=False``, also the deployment's own directories: the environment
      (install.prefix), install.state_dir, model.path and install.config_dir (default: host data
      ``vllm_fleet_purge``; `vllm-fleet down --purge` sets it)

    Returns ``(vllm_changed, model_changed)``: the operations that change vLLM and the model, for
    ``install_service(restart_on=...)`` (and roles.ray's, which restarts Ray on vLLM changes only);
    with ``present=False`` {directory: its remove operation}.

    **Example:**

    .. code:: python

        vllm_changed, model_changed = install_server_stack(spec=spec, where=where, hub_token=ctx.secrets["hub_token"])
        install_service(spec=spec, rendered=rendered, api_key=key, restart_on=[*vllm_changed, *model_changed])
        install_server_stack(spec=spec, present=False, purge=True, where=where)  # `down --purge`
    """
    if not present:
        return _stack_absent(spec, where, purge)
    nvidia.nvidia(spec=spec)
    pyenv.service_dirs(spec=spec)
    pyenv.pyenv(spec=spec, where=where)
    vllm.install_system_libraries(spec=spec)
    vllm_changed = vllm.install_vllm(spec=spec, where=where)
    model_changed = model.install_model(spec=spec, where=where, hub_token=hub_token)
    return list(vllm_changed or []), list(model_changed or [])


def purging(purge: bool | None = None) -> bool:
    """``purge``, else host data ``vllm_fleet_purge`` (true, "true", "1", "yes")."""
    value = host.data.get("vllm_fleet_purge") if purge is None else purge
    return value in (True, "true", "True", "1", 1, "yes")


def _stack_absent(spec: dict[str, Any], where: Paths, purge: bool | None) -> dict[str, Any]:
    ins = spec["install"]
    if purging(purge):
        return remove.directories(
            sorted({ins["prefix"], ins["state_dir"], spec["model"]["path"], ins["config_dir"]}), "purge"
        )
    # what only an install needs (uploaded wheels, uv's cache): never kept after down (the vllm
    # and router roles remove them after a verified install already, unless vllm_keep_wheelhouse)
    prefix = ins["prefix"]
    return remove.directories(
        [
            *(f"{prefix}/{sub}" for sub in (vd.WHEELHOUSE_SUBDIR, vd.FIND_LINKS_SUBDIR, vd.UV_CACHE_SUBDIR)),
            router_wheels_dir(where),
        ],
        "install-time only",
    )


@reads(*STACK_SECTIONS)
def server_stack_query(spec: dict[str, Any], where: Paths) -> Query:
    """What install_server_stack's roles compare against (vllm_fleet.roles.common.state): what
    the NVIDIA driver's install decides from (CUDA hosts), the service user and directories, the env, vLLM's system
    libraries and distributions, the model."""
    return (
        nvidia.state_query(spec)
        | pyenv.state_query(spec, where)
        | vllm.state_query(spec, where)
        | model.state_query(spec)
    )


def applied_token(spec: dict[str, Any], rendered: dict[str, Any], inst: Any, api_key: str | None) -> str:
    """What an instance runs with, as one hash: its unit, the deployment's files on this host
    (env files, helper scripts), the key (hashed), the install and model sections. Written to
    ``replica-N.applied`` after the instance was healthy; an instance whose token differs is
    restarted even when this run changed none of its files (another instance's update on the
    same host, e.g. an earlier rollout batch, already wrote them)."""
    cfg = spec["install"]["config_dir"] + "/"
    mine = {
        p: f.content
        for p, f in rendered.items()
        if p == f"{render.SYSTEMD_DIR}/{inst.unit}"
        or (p.startswith(cfg) and not p.endswith(".applied"))
        or p.startswith(spec["install"]["prefix"] + "/bin/")
    }
    doc = {
        "files": mine,
        "key": hashlib.sha256((api_key or "").encode()).hexdigest(),
        "install": spec["install"],
        "model": spec["model"],
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def _instance_dirs(spec: dict[str, Any], node: Node) -> list[str]:
    """The state, cache and temp directories the instances' environment names (parents first)."""
    ins = spec["install"]
    dirs = sorted({v for v in command.vllm_env(spec).values() if v.startswith(ins["state_dir"] + "/")})
    for inst in node.instances:
        dirs += [inst.state_dir, *sorted(command.state_env(inst.state_dir).values())]
    return sorted(set(dirs), key=lambda x: (x.count("/"), x))


@reads(*SECTIONS)
def state_query(spec: dict[str, Any], where: Paths, node: Node, rendered: dict[str, Any]) -> Query:
    """What install_service compares against (vllm_fleet.roles.common.state): its directories,
    files (rendered, the key's env file), units and their state, the recorded configurations,
    the older release's unit and the unit directory's listing (replicas no longer in the layout)."""
    ins, p = spec["install"], where
    dirs = _instance_dirs(spec, node) + [p["ray_tmpdir"], f"{ins['prefix']}/bin"]
    mine = list(files_of(rendered, spec["name"], "service"))
    stamps = [f"{ins['config_dir']}/replica-{i.index}.applied" for i in node.instances]
    return rendered_query(rendered, mine + [p["secrets_env"], *stamps]) | Query(
        stat=tuple(dirs),
        read=(f"{render.SYSTEMD_DIR}/{LEGACY_UNIT}", *stamps),
        ls=(render.SYSTEMD_DIR,),
        units=tuple(i.unit for i in node.instances),
        ages=tuple(stamps),
        chats=_chats(spec, where, node),
    )


def _chats(spec: dict[str, Any], where: Paths, node: Node) -> tuple[str, ...]:
    """One short chat per replica of this host, read with the host's state (roles.smoke.replica_chat)."""
    if not spec["smoke"]["enabled"]:
        return ()
    return tuple(replica_chat_query(spec, where, i.port) for i in node.instances if i.role == "server")


def _still_starting(
    snap: Snapshot, unit: str, stamp: str, health_timeout: int, port: int | None = None, served_name: str | None = None
) -> str | None:
    """Why an instance that this deploy does not restart must still be waited for, or None.

    From the host's snapshot: systemd is starting it or waiting to restart it (``activating``,
    ``auto-restart``), or its process started after its configuration was last recorded healthy
    (``replica-N.applied``, written after each healthy wait) and less than ``health_timeout``
    seconds ago: systemd restarted it (a crash, a kill, a reboot) or a deploy was cut before the
    wait. A process proven healthy since its start, or one older than the timeout, is not waited for;
    nor one whose short chat in the same state read (``port``, ``served_name``: every replica proven,
    issue 25) already answered: it serves now, so there is nothing to wait for and the no-op stays a
    no-op (a restart outside the deploy, e.g. systemd's after a kill, then costs no operation)."""
    u = snap.unit(unit)
    if not u or u.get("LoadState") != "loaded":
        return None
    active, sub = u.get("ActiveState"), u.get("SubState")
    if active in ("activating", "reloading") or sub == "auto-restart":
        return f"the unit is {active} ({sub}), NRestarts {u.get('NRestarts', '?')}"
    ago = snap.started_ago(unit)
    known, recorded = snap.age(stamp)
    if (
        active == "active"
        and ago is not None
        and ago < health_timeout
        and known
        and (recorded is None or ago < recorded)
    ):
        seen = snap.chat(port) if port is not None and served_name else None
        if seen is not None:
            if judge_replica_chat(*seen, served_name) is None:
                return None
        return f"its process started {ago} s ago, not yet seen healthy"
    return None


@deploy("vLLM service", data_defaults=DEFAULTS)
@reads(*SECTIONS)
def install_service(
    spec: dict[str, Any],
    where: Paths,
    node: Node | None = None,
    rendered: dict[str, Any] | None = None,
    api_key: str | None = None,
    restart_on: list | None = None,
    only: list[int] | None = None,
    prove_replicas: bool = True,
    present: bool = True,
    paths: list[str] | None = None,
):
    """
    Install and (re)start this host's vLLM instances of one deployment from the layout, or
    (``present=False``) stop and remove them.

    + spec: the resolved deployment spec
    + where: where its files live (the layout's: ``ctx.layout.paths[name]``, vllm_fleet.render.parts.Paths)
    + node: this deployment's part of the host's layout (``vllm_fleet.render.layout.Node``: its instances)
    + rendered: this host's rendered files ({path: RenderedFile})
    + api_key: the API key's value (written only to ``{config_dir}/secrets.env``, 0600 root)
    + restart_on: operation results (vLLM install, model) whose change must restart vLLM
    + only: instance indexes to (re)start (a rollout's batch); the others are left as they run
    + prove_replicas: one short chat per replica on its host (``smoke.enabled``; roles.smoke.replica_chat);
      False where the caller proves them itself (the rollout's smoke_replica)
    + present: False stops and disables the deployment's units here (its replicas' and the API
      firewall's, when the host's copy names it), removes them, its env files, helper scripts and
      the replicas' ``.applied`` records, and deletes the firewall's nftables table; ``node`` and
      ``api_key`` are not needed then
    + paths: with ``present=False``, remove only these (serve's pruning: what the layout no
      longer gives the host); default: every service file of the deployment here

    Units of this deployment that the layout no longer has (fewer replicas) and an older
    release's ``vllm.service`` of this deployment are stopped, disabled and removed first, so
    that their ports are free before the new instances start.

    **Example:**

    .. code:: python

        where = ctx.layout.paths[spec["name"]]
        install_service(spec=spec, where=where, node=host_layout(ctx).parts[spec["name"]],
                        rendered=rendered_for_host(ctx), api_key=ctx.secrets["api_key"], restart_on=[vllm_op, model_op])
        install_service(spec=spec, where=where, rendered=rendered_for_host(ctx), present=False)
    """
    if not present:
        return _absent(spec, where, rendered or {}, paths)
    rendered = files_of(rendered or {}, spec["name"], "service")  # what this role places, and nothing else
    # what the deploy's one state read holds (deploys/serve.py, rollout.py); called on its own: read now
    snap = role_state(state_query(spec, where, node, rendered))
    if not snap.known:
        # every instance's record unknown: each would restart on a guess and stop serving for nothing
        raise unknown(
            f"what each vLLM instance of {spec['name']} runs",
            changed="restarting them on a guess would interrupt serving; nothing was changed on this host",
        )
    _service_directories(spec, where, node, rendered)
    files_ = _put_service_files(spec, where, node, rendered, api_key)
    removed = _remove_stale_units(spec["name"], node, snap)
    unit_ops = [files_.put[u] for u in files_.units.values()]
    if pending(*unit_ops, *removed):
        systemd.daemon_reload(name="systemd daemon-reload", _if=any_changed(*unit_ops, *removed))
    shared = [
        _restart_trigger(snap, files_.secrets_env, files_.secrets_op, files_.secret_text),
        *(
            _restart_trigger(snap, path, files_.put[path], rendered[path].content)
            for path in files_.others
            if not path.endswith(".env") or path in (files_.vllm_env, files_.node_env)
        ),
        *(restart_on or []),
    ]
    restarts = []
    for inst in node.instances:
        if only is not None and inst.index not in only:
            continue
        restarts.append(_converge_instance(spec, where, rendered, inst, api_key, snap, files_, shared, prove_replicas))
    return restarts


def _absent(spec: dict[str, Any], where: Paths, rendered: dict[str, Any], paths: list[str] | None) -> dict[str, Any]:
    """present=False: the units stopped and disabled, the files removed (the firewall's table
    deleted), then each removed replica's ``replica-N.applied`` record. {path: its operation}."""
    paths = remove.placed(spec, where, rendered, "service") if paths is None else paths
    removed = remove.remove_units_and_files(spec, where, paths, "service")
    cfg = spec["install"]["config_dir"] + "/replica-"
    stamps = [x[: -len(".env")] + ".applied" for x in sorted(removed) if x.startswith(cfg) and x.endswith(".env")]
    for stamp in stamps:  # the service role's record of what each instance runs, beside its replica-N.env
        with op_per(stamp):
            removed[stamp] = files.file(name=f"Remove {stamp}", path=stamp, present=False)
    return removed


def _service_directories(spec: dict[str, Any], where: Paths, node: Node, rendered: dict[str, Any]) -> None:
    """Each instance's own state dir and the cache and temp directories its environment names
    (ReadWritePaths must exist), Ray's temp directory (multi-node Ray), the helper scripts'
    directory. The system user and the install's directories come from
    vllm_fleet.roles.pyenv.service_dirs, which deploys/serve.py runs first (the model role needs
    them too)."""
    ins, srv = spec["install"], spec["server"]
    for dirpath in _instance_dirs(spec, node):
        directory(name=f"Directory {dirpath}", path=dirpath, user=srv["user"], group=srv["user"], mode="750")
    if spec["parallel"]["backend"] == "ray" and spec["parallel"]["nodes"] > 1:
        directory(
            name="Ray temp directory",
            path=where["ray_tmpdir"],
            user=srv["user"],
            group=srv["user"],
            mode="750",
        )
    if any(path.startswith(ins["prefix"] + "/bin/") for path in rendered):
        directory(name="Helper scripts directory", path=f"{ins['prefix']}/bin", user="root", group="root", mode="755")


@dataclass
class _ServiceFiles:
    """What _put_service_files put: the operations per path, the units' paths per instance index,
    the other files (config dir, then helper scripts), the key's env file and its operation."""

    put: dict[str, Any]
    units: dict[int, str]
    others: list[str]
    secrets_env: str
    secrets_op: Any
    secret_text: str
    vllm_env: str
    node_env: str


def _put_service_files(
    spec: dict[str, Any], where: Paths, node: Node, rendered: dict[str, Any], api_key: str | None
) -> _ServiceFiles:
    """Everything the units name first, the key's env file (0600), the units last (a kill in
    between leaves no unit that points at a missing file)."""
    p = where
    units = {inst.index: f"{render.SYSTEMD_DIR}/{inst.unit}" for inst in node.instances}
    # ``rendered``: this role's files (files_of its part); the key's env file is put with the key
    other = [path for path in rendered if path != p["secrets_env"] and path not in units.values()]
    put = put_rendered(rendered, other)
    secret_text = host_secret_files(spec, {"api_key": api_key})[p["secrets_env"]]
    secrets_op = put_secret(name="API key (0600, never shown)", path=p["secrets_env"], content=secret_text)
    put.update(put_rendered(rendered, list(units.values())))
    return _ServiceFiles(
        put=put,
        units=units,
        others=other,
        secrets_env=p["secrets_env"],
        secrets_op=secrets_op,
        secret_text=secret_text,
        vllm_env=p["vllm_env"],
        node_env=p["node_env"],
    )


def _stale_units(name: str, node: Node, snap: Snapshot) -> list[str]:
    """Units of deployment ``name`` that the layout no longer has: an older release's
    ``vllm.service`` of it (its text, read with the host's state: ``Description=vLLM NAME: ...``),
    and replicas above the current count (the unit directory's listing, read with it). A read that
    did not complete knows of none: nothing is removed on a guess."""
    _, legacy_text = snap.content(f"{render.SYSTEMD_DIR}/{LEGACY_UNIT}")
    mine = re.compile(re.escape(f"Description=vLLM {name}:") + ".*")
    stale = [LEGACY_UNIT] if any(mine.fullmatch(line) for line in (legacy_text or "").splitlines()) else []
    pattern = re.compile("^vllm-" + re.escape(name) + "-[0-9]+[.]service$")
    current = {i.unit for i in node.instances}
    return stale + sorted(u for u in snap.listing(render.SYSTEMD_DIR) or [] if pattern.search(u) and u not in current)


def _remove_stale_units(name: str, node: Node, snap: Snapshot) -> list:
    """Stop, disable and remove the units _stale_units finds, before the new ones start (their
    ports are then free); returns the removals (a daemon-reload follows them)."""
    removed = []
    for unit in _stale_units(name, node, snap):
        systemd.service(
            name=f"Stop and disable {unit} (not in the layout any more)", service=unit, running=False, enabled=False
        )
        removed.append(
            files.file(name=f"Remove {render.SYSTEMD_DIR}/{unit}", path=f"{render.SYSTEMD_DIR}/{unit}", present=False)
        )
    return removed


def _restart_trigger(snap: Snapshot, path: str, op: Any, content: str) -> Any:
    """``op`` as a restart trigger: a put that changes only a file's owner or mode (the content
    vLLM and systemd read is the same) restarts nothing (issue 24: ``diff`` showed 644 -> 600 on
    an env file and the deploy restarted vLLM)."""
    if snap.same_content(path, hashlib.sha256(content.encode()).hexdigest()):
        return Converged(f"{path} (owner/mode only)")
    return op


def _recorded_token(snap: Snapshot, stamp: str) -> str:
    """The configuration an instance was last recorded healthy with (``replica-N.applied``, read
    with the host's state; "" when none or not read: the instance then restarts)."""
    _, text = snap.content(stamp)
    return (text or "").strip()


def _failed_now(snap: Snapshot, unit: str) -> bool:
    """Whether systemd has the unit failed now (its ActiveState in the host's state read)."""
    return (snap.unit(unit) or {}).get("ActiveState") == "failed"


def _converge_instance(
    spec: dict[str, Any],
    where: Paths,
    rendered: dict[str, Any],
    inst: Any,
    api_key: str | None,
    snap: Snapshot,
    files_: _ServiceFiles,
    shared: list,
    prove_replicas: bool,
) -> Any:
    """One instance: restarted when its inputs changed or it runs another configuration than
    recorded, running and enabled, waited for (and proven with a chat) when it (re)starts, its
    configuration recorded. Operations only where something may change
    (vllm_fleet.roles.common.state): a converged instance gets none. Returns its restart."""
    unit = inst.unit
    own = [
        _restart_trigger(snap, path, files_.put[path], rendered[path].content)
        for path in (files_.units[inst.index], inst.env_file)
        if path in files_.put
    ]
    token = applied_token(spec, rendered, inst, api_key)
    stamp = f"{spec['install']['config_dir']}/replica-{inst.index}.applied"
    have = _recorded_token(snap, stamp)
    relevant = [*own, *shared]
    stale_now = have != token
    restart = _restart_instance(unit, snap, relevant, stale_now, have)
    running = service_running(name=f"{unit} running and enabled", service=unit, running=True, enabled=True)
    proves = prove_replicas and spec["smoke"]["enabled"] and inst.role == "server"
    wait = _wait_instance(spec, where, inst, snap, stamp, [restart, running, *relevant], stale_now, proves)
    # Every replica proven on its host (issue 25): one short chat, from the state read when
    # nothing here restarts it, else by the wait above after its start.
    if proves:
        replica_chat(
            name=f"{unit} answers a chat on port {inst.port}",
            spec=spec,
            where=where,
            unit=unit,
            port=inst.port,
            _if=(lambda w=wait: not w.did_change()) if wait is not None else None,
        )
    # Healthy with this configuration: remember it (0600: a hash of the key is in it).
    put_secret(name=f"{unit}: record the configuration it runs", path=stamp, content=token + "\n")
    return restart


def _restart_instance(unit: str, snap: Snapshot, relevant: list, stale_now: bool, have: str) -> Any:
    """Clear the unit's failed state and restart it, when its inputs (``relevant``) changed or it
    runs an older configuration (``stale_now``); Converged when neither can be."""
    when = (lambda: True) if stale_now else any_changed(*relevant)
    # A unit that is failed (e.g. it hit StartLimitBurst in an earlier crash loop) refuses to
    # start until reset: reset it when it is failed now or when it is about to restart.
    failed_now = _failed_now(snap, unit)
    if failed_now or stale_now or pending(*relevant):
        server.shell(
            name=f"Clear {unit}'s failed state before (re)starting",
            commands=[if_then(cmd("systemctl", "is-failed", "--quiet", unit), cmd("systemctl", "reset-failed", unit))],
            _if=(lambda: True) if failed_now else when,
        )
    why = (
        "its inputs changed"
        if not stale_now
        else "it runs an older configuration"
        if have
        else "first start of this configuration"
    )  # no stamp: never started by a deploy
    return (
        systemd.service(
            name=f"Restart {unit} ({why})", service=unit, running=True, restarted=True, enabled=True, _if=when
        )
        if stale_now or pending(*relevant)
        else Converged(f"restart {unit}")
    )


def _wait_instance(
    spec: dict[str, Any],
    where: Paths,
    inst: Any,
    snap: Snapshot,
    stamp: str,
    triggers: list,
    stale_now: bool,
    proves: bool,
) -> Any:
    """The health wait (``_wait_healthy`` at execute time) when the instance (re)starts
    (``triggers``: its restart, running and inputs) or systemd may still be starting it
    (_still_starting: after a crash, a kill, or a deploy that was cut, the smoke tests that follow
    would meet a 502); None when neither."""
    srv, unit = spec["server"], inst.unit
    restart = triggers[0]
    starting = (
        _still_starting(
            snap, unit, stamp, srv["health_timeout"], inst.port if proves else None, spec["model"]["served_name"]
        )
        if not (stale_now or pending(restart))
        else None
    )
    if not (stale_now or starting or pending(*triggers)):
        return None
    return python.call(
        name=f"Wait for {unit} /health on port {inst.port} (deadline {srv['health_timeout']} s"
        + (f"; {starting})" if starting else ")"),
        function=_wait_healthy,
        port=inst.port,
        deadline=srv["health_timeout"],
        interval=host.data.get("vllm_fleet_health_interval"),
        journal_lines=host.data.get("vllm_fleet_journal_lines"),
        unit=unit,
        spec=spec if proves else None,
        where=where,
        stamp=stamp,
        _if=any_changed(*triggers) if not (stale_now or starting) else (lambda: True),
    )
