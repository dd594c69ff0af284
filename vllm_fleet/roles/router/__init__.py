"""vLLM's router (``proxy.routing.policy: cache_aware``): the pinned ``vllm-router`` in its own
venv on the proxy host, its rendered hardened unit on loopback, started (restarted when its unit
or its version changed) and waited for before nginx points at it.

Wheels, like vLLM's (vllm_fleet/roles/vllm): ``install.wheelhouse`` (a directory on the control
machine, uploaded, ``--no-index``: air-gapped fleets) wins; else ``install.wheels: fleet`` (the
control machine downloads vllm-router and its dependencies once for the host's Python and
platform, vllm_fleet.fetch.wheelhouse); else the host's own index.

Switching the policy is a deploy of this part and nginx only: nothing here touches vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pyinfra import host
from pyinfra.api import StringCommand, deploy
from pyinfra.api.exceptions import DeployError as PyDeployError
from pyinfra.operations import server, systemd

from vllm_fleet.fetch import wheelhouse as wh
from vllm_fleet.host import programs
from vllm_fleet.host.programs import argv as cmd
from vllm_fleet.host.programs import chain, group, quiet
from vllm_fleet.roles.common import DeployError, packages, put_rendered, remove, rendered_query
from vllm_fleet.roles.common.wheels import host_target, source_args, target_query, wheel_source
from vllm_fleet.host.state import Query
from vllm_fleet.render.parts import Paths, files_of
from vllm_fleet.roles.common.state import host_state, pending
from vllm_fleet.specs.sections import reads

from .defaults import DEFAULTS

#: The spec sections this role reads (vllm_fleet.specs.sections); its README lists them.
SECTIONS = ("install", "monitoring", "name", "proxy")

PACKAGE = "vllm-router"


def requirement(spec: dict[str, Any]) -> str:
    return f"{PACKAGE}=={spec['proxy']['routing']['router']['version']}"


@reads(*SECTIONS)
def state_query(spec: dict[str, Any], where: Paths, rendered: dict[str, Any]) -> Query:
    """What install_router compares against: its unit, its venv's vllm-router, the unit's state
    and (fleet wheels) what the wheelhouse must fit on the host (the vllm role asks the same)."""
    return (
        rendered_query(rendered, [where["router_unit"]])
        | Query(
            units=(where["router_unit"].rsplit("/", 1)[1],),
            debs=tuple(host.data.get("router_venv_packages") or DEFAULTS["router_venv_packages"]),
            envs=((f"{where['router_env']}/bin/python", (f"dist:{PACKAGE}",)),),
        )
        | target_query(spec)
    )


def wheels_dir(where: Paths) -> str:
    """Where the router's wheels are uploaded on the host (install-time only: removed after a
    verified install, and by `down`): beside its venv."""
    return f"{where['router_env']}-wheels"


def _wheel_source(spec: dict[str, Any], where: Paths) -> tuple[list[str], str | None, list]:
    """pip's source arguments for this host (roles.common.wheels' order), the directory the wheels
    were put in (None: none), and the commands to run first (the fetch of the fleet wheelhouse
    over HTTP, checked against its sha256: roles.common.wheels.reach_fleet_wheelhouse)."""
    dest = wheels_dir(where)
    wheelhouse, first = wheel_source(
        spec, dest, f"Upload the router's wheels to {dest}", lambda: _fleet_directory(spec)
    )
    uploaded = dest if wheelhouse == dest else None
    return source_args(spec, wheelhouse=wheelhouse), uploaded, first


def _fleet_directory(spec: dict[str, Any]) -> Path:
    """``install.wheels: fleet``: the control machine's wheelhouse of vllm-router for this host's
    Python and platform (vllm_fleet.fetch.wheelhouse)."""
    target = host_target()
    lacking = [k for k in ("python", "glibc", "machine") if not target.get(k)]
    if lacking:
        raise PyDeployError(
            f"host {host.name}: the router's wheels (install.wheels: fleet) need the host's {', '.join(lacking)}; "
            "set install.wheels: host to let the host download for itself"
        )
    try:
        return wh.ensure([requirement(spec)], target, index_url=spec["install"].get("index_url"))
    except wh.WheelhouseError as exc:
        raise PyDeployError(str(exc)) from None


def _pip_install(spec: dict[str, Any], env: str, source: list[str], uploaded: str | None) -> list[StringCommand]:
    """The router's venv (made when missing), the pinned vllm-router installed into it from
    ``source``, its console script run once (``--help``), then the ``uploaded`` wheels removed
    (install-time only, as the vllm role's, unless host data ``vllm_keep_wheelhouse``)."""
    py = f"{env}/bin/python"
    pip = cmd(
        py,
        "-m",
        "pip",
        "install",
        "--no-input",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "--no-cache-dir",
        "--timeout",
        str(int(host.data.get("router_pip_timeout"))),
        *source,
        requirement(spec),
    )
    commands = [
        chain(cmd("test", "-x", py), cmd("python3", "-m", "venv", env), op="||"),
        pip,
        quiet(cmd(f"{env}/bin/vllm-router", "--help"), err=False),
    ]
    if uploaded and not host.data.get("vllm_keep_wheelhouse"):
        commands.append(cmd("rm", "-rf", uploaded))
    return commands


def _wait_command(unit: str, port: int, timeout: float) -> StringCommand:
    """Wait until the router lists its workers on loopback (scripts/router_wait.py: it serves once
    its startup wait is over) and print what it lists; after ``timeout`` seconds print the unit's
    journal and fail."""
    return chain(
        programs.python("python3", "router_wait.py", int(port), float(timeout)),
        group(cmd("journalctl", "-u", unit, "-n", "30", "--no-pager"), cmd("exit", "1")),
        op="||",
    )


@deploy("vLLM router", data_defaults=DEFAULTS)
@reads(*SECTIONS)
def install_router(
    spec: dict[str, Any],
    where: Paths,
    rendered: dict[str, Any],
    present: bool = True,
    paths: list[str] | None = None,
):
    """
    Install and start vLLM's router for this deployment (proxy hosts with part ``router``), or
    (``present=False``) stop and remove it.

    + spec: the resolved deployment spec
    + where: where its files live (the layout's: vllm_fleet.render.parts.Paths)
    + rendered: this host's rendered files (the router's unit is used)
    + present: False stops, disables and removes the router's unit (the policy is no longer
      cache_aware here, the proxy moved, `down`); its venv stays
    + paths: with ``present=False``, remove only these; default: the router's unit

    **Example:**

    .. code:: python

        install_router(spec=spec, where=ctx.layout.paths[spec["name"]], rendered=rendered)
        install_router(spec=spec, where=ctx.layout.paths[spec["name"]], rendered=rendered, present=False)
    """
    if not present:
        return _absent(spec, where, rendered, paths)
    mine = files_of(rendered, spec["name"], "router")  # what this role places: the router's unit
    if where["router_unit"] not in mine:
        raise DeployError(
            f"{host.name}: no router unit rendered for {spec['name']} (the layout gives this host no `router` part)"
        )
    unit = where["router_unit"].rsplit("/", 1)[1]
    env = where["router_env"]
    py = f"{env}/bin/python"
    version = spec["proxy"]["routing"]["router"]["version"]
    changed = []
    wanted = list(host.data.get("router_venv_packages") or [])
    if wanted:
        packages(name="the router's venv packages", packages=wanted)
    probed = host_state().env(py)
    have = (probed or {}).get("dist", {}).get(PACKAGE) if probed is not None else None
    if have != version:
        source, uploaded, first = _wheel_source(spec, where)
        changed.append(
            server.shell(
                name=f"pip install {requirement(spec)} into {env}",
                commands=[*first, *_pip_install(spec, env, source, uploaded)],
            )
        )
    else:
        host.noop(f"{requirement(spec)} already installed in {env}")
    put = put_rendered(mine)
    unit_op = put[where["router_unit"]]
    if pending(unit_op):
        systemd.daemon_reload(name="systemd daemon-reload (router unit)", _if=unit_op.did_change)
    if pending(unit_op, *changed) or not host_state().unit_ok(unit, running=True, enabled=True):
        # restarted: a new unit or version takes effect (pyinfra starts it instead when it is not running)
        systemd.service(
            name=f"Start {unit}", service=unit, running=True, enabled=True, restarted=bool(pending(unit_op, *changed))
        )
        server.shell(
            name=f"Wait for {unit} on 127.0.0.1:{spec['proxy']['routing']['router']['port']}",
            commands=[
                _wait_command(unit, spec["proxy"]["routing"]["router"]["port"], host.data.get("router_start_timeout"))
            ],
        )


def _absent(spec: dict[str, Any], where: Paths, rendered: dict[str, Any], paths: list[str] | None) -> dict[str, Any]:
    """present=False: the router's unit stopped, disabled and removed (when the host's copy is this
    deployment's); its venv stays, as the vLLM environment does. {path: its remove operation}."""
    paths = remove.placed(spec, where, rendered, "router") if paths is None else paths
    return remove.remove_units_and_files(spec, where, paths, "router")


__all__ = ["install_router", "state_query", "requirement", "wheels_dir"]
