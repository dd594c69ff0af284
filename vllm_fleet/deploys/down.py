"""Remove a deployment from its hosts (what `vllm-fleet down` runs; pyinfra runs it per host).

    pyinfra -y INVENTORY vllm_fleet.deploys.down.down --data vllm_fleet_spec=SPEC [--data vllm_fleet_purge=true]

The spec comes from where the serve deploy takes it (vllm_fleet/specs/source.py) and is validated
the same way. `down` is the roles serve runs, with ``present=False``, in the reverse of serve's
order (vllm_fleet.roles.parts.PARTS): monitoring, nginx (site gone, `nginx -t`, reload), the
router, the vLLM units and their files (and the API firewall), the Ray node, then what only an install needs (or,
purged, the environment, weights, caches and config directory). Each role removes only the files the host's
copy shows as the deployment's (vllm_fleet.roles.common.remove). Hosts with nothing of the
deployment are left alone.
"""

from __future__ import annotations

from typing import Any

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import server
from pyinfra.operations.util import any_changed

from vllm_fleet.host.programs import argv as cmd
from vllm_fleet.render.layout import Paths
from vllm_fleet.roles import model
from vllm_fleet.roles.common import load_deploy_spec, preflight, remove, rendered_for_host, this_host_only
from vllm_fleet.roles.common.state import role_state, unknown
from vllm_fleet.roles.parts import PARTS, removals
from vllm_fleet.roles.service import purging
from vllm_fleet.roles.service.defaults import DEFAULTS


def down() -> None:
    """Remove the current host's part of the deployment."""
    ctx = load_deploy_spec()
    rendered = rendered_for_host(ctx)
    if not rendered:
        return
    with this_host_only():  # a problem of this host (sudo, its state read) fails it alone
        preflight()
        remove_deployment(spec=ctx.spec, where=ctx.layout.paths[ctx.first], rendered=rendered)


@deploy("Remove the deployment", data_defaults=DEFAULTS)
def remove_deployment(
    spec: dict[str, Any],
    where: Paths,
    rendered: dict[str, Any],
    purge: bool | None = None,
    paths: list[str] | None = None,
):
    """
    Remove this deployment from the host: each role that placed a part of it, with ``present=False``.

    + spec: the resolved deployment spec
    + where: where its files live (the layout's: ``ctx.layout.paths[name]``, vllm_fleet.render.parts.Paths)
    + rendered: this host's rendered files ({path: RenderedFile}); a file is removed only when
      the host's copy names this deployment (another deployment's file is left alone)
    + purge: also remove the environment, weights, caches and config directory (default: host
      data ``vllm_fleet_purge``)
    + paths: remove only these (serve's pruning: what the layout no longer gives the host), each
      by the role that places it and still only when it names this deployment; the install-time
      directories are left to the vllm role and nothing is purged

    What is on the host comes from one state read (vllm_fleet.roles.common.remove.removal_query of
    every path; on serve the deploy's read already holds it); the roles then take their share of
    that snapshot and add no command. A read that did not complete raises ``StateUnknown`` and
    removes nothing. Idempotent: a second run finds nothing of the deployment and changes nothing.

    **Example:**

    .. code:: python

        ctx = load_deploy_spec()
        remove_deployment(spec=ctx.spec, where=ctx.layout.paths[ctx.first], rendered=rendered_for_host(ctx))
    """
    pruning = paths is not None
    purge = purging(purge) and not pruning
    paths = remove.candidates(spec, where, rendered) if paths is None else paths
    units = ("nginx.service",) if where["nginx_site"] in paths else ()
    snap = role_state(remove.removal_query(spec, where, paths, units=units))
    if not snap.known:
        raise unknown(
            f"which files of deployment {spec['name']} are there",
            changed="nothing was removed from this host",
            run="the command",
        )
    parts = remove.by_part(spec, where, rendered, paths)
    removed: dict[str, Any] = {}
    for part, role in removals():  # the parts that place files, in the reverse of serve's order
        if part in parts:
            removed |= role(spec=spec, where=where, rendered=rendered, present=False, paths=parts[part])
    if not pruning:  # then what only an install needs (vllm_fleet.roles.parts: Part.uninstall)
        for p in reversed(PARTS):
            if p.uninstall is not None:
                p.uninstall(spec, where, purge)
    cfg = spec["install"]["config_dir"]
    in_cfg = [op for x, op in removed.items() if x.startswith(cfg + "/")]
    if not purge and in_cfg:  # it held only this deployment's files, and the stamp of its weights
        # (the weights stay; the next deploy verifies them again: roles.model.stamp_path)
        server.shell(
            name=f"Remove {cfg} if empty (and the model's stamp)",
            commands=[cmd("rm", "-f", model.stamp_path(spec)), cmd("rmdir", "--ignore-fail-on-non-empty", cfg)],
            _if=any_changed(*in_cfg),
        )
    if not removed and not purge and not pruning:
        host.noop(f"nothing of deployment {spec['name']} on this host")
