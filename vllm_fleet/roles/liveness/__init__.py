"""The liveness probe of a deployment's replicas (``server.liveness``): on each host serving its
API, the rendered probe (``{install.prefix}/bin/vllm-liveness``), its oneshot unit and the timer
that starts it every ``period`` seconds; the timer enabled and running. systemd restarts a vLLM
that exits; the probe restarts one that hangs (README.md here). It never touches vLLM's own
files, so turning it on or off restarts no replica.
"""

from __future__ import annotations

from typing import Any

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import systemd

from vllm_fleet.host.state import Query
from vllm_fleet.render.parts import Paths, files_of
from vllm_fleet.roles.common import DeployError, directory, put_rendered, remove, rendered_query
from vllm_fleet.roles.common.state import pending, role_state
from vllm_fleet.specs.sections import reads

#: The spec sections this role reads (vllm_fleet.specs.sections); its README lists them.
SECTIONS = ("install", "name", "server")


def _unit(where: Paths, key: str) -> str:
    return where[key].rsplit("/", 1)[1]


@reads(*SECTIONS)
def state_query(spec: dict[str, Any], where: Paths, rendered: dict[str, Any]) -> Query:
    """What install_liveness compares against: its three files, the probe's directory and its
    timer's state."""
    mine = files_of(rendered, spec["name"], "liveness")
    bin_dir = where["liveness_probe"].rsplit("/", 1)[0]
    return rendered_query(mine) | Query(stat=(bin_dir,), units=(_unit(where, "liveness_timer"),))


@deploy("vLLM liveness probe")
@reads(*SECTIONS)
def install_liveness(
    spec: dict[str, Any],
    where: Paths,
    rendered: dict[str, Any],
    present: bool = True,
    paths: list[str] | None = None,
):
    """
    Place the liveness probe of this deployment's replicas on this host and start its timer, or
    (``present=False``) stop it and remove its files.

    + spec: the resolved deployment spec (``server.liveness``)
    + where: where its files live (the layout's: vllm_fleet.render.parts.Paths)
    + rendered: this host's rendered files (the probe, its unit and its timer are used)
    + present: False stops and disables the timer and the unit and removes the three files
      (liveness turned off, the host no longer serves the deployment, `down`)
    + paths: with ``present=False``, remove only these; default: every file of the part

    **Example:**

    .. code:: python

        install_liveness(spec=spec, where=ctx.layout.paths[spec["name"]], rendered=rendered)
        install_liveness(spec=spec, where=ctx.layout.paths[spec["name"]], rendered=rendered, present=False)
    """
    if not present:
        paths = remove.placed(spec, where, rendered, "liveness") if paths is None else paths
        return remove.remove_units_and_files(spec, where, paths, "liveness")
    mine = files_of(rendered, spec["name"], "liveness")
    if where["liveness_timer"] not in mine:
        raise DeployError(
            f"{host.name}: no liveness probe rendered for {spec['name']} (server.liveness is off, or the layout gives "
            "this host no replica of it)"
        )
    timer = _unit(where, "liveness_timer")
    snap = role_state(state_query(spec, where, rendered))  # the deploy's read, or one of its own
    bin_dir = where["liveness_probe"].rsplit("/", 1)[0]  # the service role's helper scripts' too
    directory(name="Helper scripts directory", path=bin_dir, user="root", group="root", mode="755")
    put = put_rendered(mine)
    units = pending(put[where["liveness_timer"]], put[where["liveness_unit"]])
    if units:
        systemd.daemon_reload(name="systemd daemon-reload (liveness probe)")
    timer_changed = pending(put[where["liveness_timer"]])
    if timer_changed or not snap.unit_ok(timer, running=True, enabled=True):
        # a new period takes effect when the timer restarts (pyinfra starts it when it is not running)
        systemd.service(
            name=f"Start {timer} (every {spec['server']['liveness']['period']} s)",
            service=timer,
            running=True,
            enabled=True,
            restarted=bool(timer_changed),
        )


__all__ = ["install_liveness", "state_query"]
