"""How every role undoes what it placed (its ``present=False``): which of a deployment's files may
be on a host, which of them the host's copy shows as the deployment's own, and the operations that
stop, disable and remove them.

The roles own their parts: a rendered file names its deployment and part (RenderedFile.part), and
a path the layout does not render is looked up in the parts' declared paths, which the layout
holds per deployment (``where``: vllm_fleet.render.parts.Paths, Layout.paths; the roles are given
it and work out no path themselves). This module owns the rules the roles share:

- :func:`candidates`: every path a deployment may have on a host (its rendered files, plus every
  path its parts declare: the TLS files, the router's unit, the firewalls, ...);
- :func:`leftovers`: of those, what the host's layout no longer gives it (serve's pruning);
- :func:`removal_query` and :func:`mine`: the one state read's questions and the one rule for
  "this file is the deployment's" (it lies in the deployment's own directories, or its text names
  the deployment); another deployment's file, or a package's own, is never touched;
- :func:`owned`, :func:`stop_units`, :func:`remove_files`: the operations, over that read alone.

`down` (vllm_fleet.deploys.down) is the roles with ``present=False`` in the reverse of serve's
order; serve (vllm_fleet.deploys.serve) ends with the roles whose part the layout dropped, on
just those paths.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from pyinfra.operations import files, server, systemd
from pyinfra.operations.util import any_changed

from vllm_fleet.host.programs import argv as cmd
from vllm_fleet.host.programs import chain, if_then, quiet
from vllm_fleet.render import files as render
from vllm_fleet.render.layout import SYSTEMD_DIR, UNIT_SUFFIXES, Node, Paths, files_of
from vllm_fleet.roles.common import clash, op_per
from vllm_fleet.host.state import Query, Snapshot
from vllm_fleet.roles.common.state import role_state, unknown

UNIT_DIR = f"{SYSTEMD_DIR}/"

#: The firewall units the roles place ({unit path: nftables table}): stopping one deletes its
#: table, unless it was not running (then the table is deleted on its own).
FIREWALL_TABLES = {
    f"{UNIT_DIR}{render.API_FIREWALL_UNIT}": render.API_FIREWALL_TABLE,
    f"{UNIT_DIR}{render.RAY_FIREWALL_UNIT}": render.RAY_FIREWALL_TABLE,
}


def marker(name: str) -> str:
    """The text every file of deployment ``name`` carries (the renderer's header, the roles' own);
    the colon keeps `lab-tiny` from matching `lab-tiny-replicas`'s files."""
    return f"for deployment {name}:"


def candidates(spec: dict[str, Any], where: Paths, rendered: dict[str, Any]) -> list[str]:
    """Every path this deployment may have placed on the host: its rendered files
    (RenderedFile.deployment), the host-wide ones (the API firewall), and every path its parts
    declare (``where.parts``: the TLS files of its nginx site, the router's
    unit, the Ray firewall, the monitoring files of another layout, ...)."""
    declared = where.declared()
    return sorted(set(files_of(rendered, spec["name"])) | set(files_of(rendered, "")) | declared)


def part_of(spec: dict[str, Any], where: Paths, rendered: dict[str, Any], path: str) -> str | None:
    """The part whose role places ``path`` for this deployment: the part the rendered file names,
    else the first part that declares the path (``where.part_of``), else a
    replica's unit or env file the service's (its globs); None: no part of this deployment."""
    f = rendered.get(path)
    if f is not None and f.deployment in (spec["name"], ""):
        return f.part
    part = where.part_of(path)
    if part is None and _glob_of(spec, path) is not None:
        return "service"
    return part


def by_part(spec: dict[str, Any], where: Paths, rendered: dict[str, Any], paths: list[str]) -> dict[str, list[str]]:
    """``paths`` by the part whose role places each (:func:`part_of`), in a stable order; a path
    of no part of this deployment is in none."""
    out: dict[str, list[str]] = {}
    for x in sorted(paths):
        part = part_of(spec, where, rendered, x)
        if part is not None:
            out.setdefault(part, []).append(x)
    return out


def placed(spec: dict[str, Any], where: Paths, rendered: dict[str, Any], part: str) -> list[str]:
    """Every path the role ``part`` may have placed for this deployment on a host with these
    rendered files (:func:`candidates` of that part): a role's ``present=False`` default."""
    return by_part(spec, where, rendered, candidates(spec, where, rendered)).get(part, [])


def removal_query(spec: dict[str, Any], where: Paths, paths: list[str], units: tuple[str, ...] = ()) -> Query:
    """What :func:`mine` and :func:`owned` compare against (vllm_fleet.roles.common.state): of each
    path, a stat when the path alone says it is this deployment's (:func:`owned_by_path`: never
    the TLS key's content), else its text (to find the :func:`marker`); a replica unit or env file
    through the glob that covers it (the clash check reads those already); plus ``units``."""
    single = [x for x in paths if _glob_of(spec, x) is None]
    return Query(
        stat=tuple(x for x in single if owned_by_path(spec, where, x)),
        read=tuple(x for x in single if not owned_by_path(spec, where, x)),
        globs=tuple(dict.fromkeys(g for x in paths if (g := _glob_of(spec, x)) is not None)),
        units=units,
    )


def _globs(spec: dict[str, Any]) -> tuple[str, str]:
    return clash.UNITS, _replica_envs(spec)


def _glob_of(spec: dict[str, Any], path: str) -> str | None:
    """The glob of :func:`removal_query` that reads ``path`` (a ``vllm-*.service`` unit, a
    ``replica-N.env`` file), or None (the path is stat'ed or read on its own)."""
    return next((g for g in _globs(spec) if PurePosixPath(path).match(g)), None)


def _replica_envs(spec: dict[str, Any]) -> str:
    """The glob of the replicas' env files: clash's own (already read for every deploy) when
    install.config_dir is the default place, else one under config_dir."""
    cfg = spec["install"]["config_dir"]
    return (
        clash.REPLICA_ENVS
        if PurePosixPath(f"{cfg}/replica-0.env").match(clash.REPLICA_ENVS)
        else f"{cfg}/replica-*.env"
    )


def owned_by_path(spec: dict[str, Any], where: Paths, path: str) -> bool:
    """Whether the path alone says the file is this deployment's: it lies in its own directories
    (install.prefix, install.config_dir) or is its site's TLS certificate or key. Any other file
    is its own only when it names it (:func:`marker`)."""
    ins = spec["install"]
    own_dirs = (ins["prefix"] + "/", ins["config_dir"] + "/")
    return path.startswith(own_dirs) or path in (where["tls_certificate"], where["tls_certificate_key"])


def mine(spec: dict[str, Any], where: Paths, path: str, snap: Snapshot) -> bool | None:
    """Whether the state read (:func:`removal_query`) shows ``path`` as this deployment's file on
    the host: a regular file there that lies in its own directories (:func:`owned_by_path`) or
    whose text names it (:func:`marker`; a package's own /etc/default/prometheus or another
    deployment's unit does not). None when the read did not ask it or did not complete."""
    glob = _glob_of(spec, path)
    if glob is not None:
        found = snap.matching(glob)
        if found is None:
            return None
        return path in found and (owned_by_path(spec, where, path) or marker(spec["name"]) in (found[path] or ""))
    if owned_by_path(spec, where, path):
        known, st = snap.path(path)
        return bool(st and st["type"] == "file") if known else None
    known, text = snap.content(path)
    return marker(spec["name"]) in (text or "") if known else None


def _leftover_candidates(spec: dict[str, Any], where: Paths, node: Node | None, rendered: dict[str, Any]) -> list[str]:
    """The paths this deployment's parts declare (``where.parts``) that this
    host's layout does not render; while its site is still here, not what the nginx role puts
    beside it (the TLS files)."""
    out = where.declared()
    if node is not None and "proxy" in node.roles:  # the role's own files beside a site still here
        out -= {where["tls_certificate"], where["tls_certificate_key"]}
    return sorted(out - set(rendered))


def leftover_query(spec: dict[str, Any], where: Paths, node: Node | None, rendered: dict[str, Any]) -> Query:
    """What the deploy's one state read must see to find this deployment's leftovers on the host
    (:func:`leftovers`) and to remove them (the roles' ``present=False`` then adds no command):
    its fixed paths that this host's layout does not render, its replicas' units and env files
    (the globs), nginx's unit (reloaded when a site goes and nginx runs)."""
    found = _leftover_candidates(spec, where, node, rendered)
    units = ("nginx.service",) if where["nginx_site"] in found else ()
    return removal_query(spec, where, found, units=units) | Query(globs=_globs(spec))


def leftovers(
    spec: dict[str, Any], where: Paths, node: Node | None, rendered: dict[str, Any], snap: Snapshot
) -> list[str]:
    """Paths on this host (as the state read of :func:`leftover_query` saw them) that an earlier
    deploy of this deployment put there and this host's layout no longer gives it: its fixed
    paths, and (when no instance of it is left here: the service role removes the units of fewer
    replicas itself) its ``vllm-NAME-N.service`` units and ``replica-N.env`` files. Only files
    that are this deployment's (:func:`mine`), so a converged host has none (and no operation);
    a read that did not complete finds none."""
    found = [x for x in _leftover_candidates(spec, where, node, rendered) if mine(spec, where, x, snap)]
    if node is None or not node.instances:
        prefix = spec["install"]["config_dir"] + "/replica-"
        found += [
            x
            for x in (snap.matching(clash.UNITS) or {})
            if clash.unit_of(x) == spec["name"] and x not in rendered and mine(spec, where, x, snap)
        ]
        found += [x for x in (snap.matching(_replica_envs(spec)) or {}) if x.startswith(prefix) and x not in rendered]
    return sorted(set(found))


def owned(
    spec: dict[str, Any], where: Paths, paths: list[str], what: str, units: tuple[str, ...] = ()
) -> tuple[list[str], Snapshot]:
    """Of ``paths``, those the host holds as this deployment's (:func:`mine`), and the snapshot
    (``role_state``: the deploy's one read when it asked :func:`removal_query` already, else one
    read). A read that did not complete raises ``StateUnknown`` naming ``what``: nothing is
    removed on a guess."""
    snap = role_state(removal_query(spec, where, paths, units))
    if not snap.known:
        raise unknown(
            f"which {what} of deployment {spec['name']} are there",
            changed="nothing was removed from this host",
            run="the command",
        )
    return [x for x in paths if mine(spec, where, x, snap)], snap


def units_of(paths: list[str]) -> list[str]:
    """The systemd units among ``paths`` (unit files under /etc/systemd/system)."""
    return [x for x in paths if x.startswith(UNIT_DIR) and x.endswith(UNIT_SUFFIXES)]


def stop_units(units: list[str], why: str = "") -> None:
    """Stop and disable each unit (paths under /etc/systemd/system, or names) before its file goes
    (op_per: one operation per unit on every host, so hosts with different files do not show
    merged or repeated names in pyinfra's output)."""
    for unit in units:
        name = unit[len(UNIT_DIR) :] if unit.startswith(UNIT_DIR) else unit
        with op_per(unit):
            systemd.service(name=f"Stop and disable {name}{why}", service=name, running=False, enabled=False)


def remove_files(paths: list[str], what: str) -> dict[str, Any]:
    """Remove the files (already stopped: :func:`stop_units`); when units were among them, systemd
    reloaded and their failed state reset (a unit that crash-looped stays listed "not-found
    failed" after its file is gone, and the host "degraded", until reset-failed); a firewall
    unit's table deleted (:data:`FIREWALL_TABLES`). ``what`` names the role in the operations'
    names. Returns {path: its remove operation}."""
    removed = {}
    for x in paths:
        with op_per(x):
            removed[x] = files.file(name=f"Remove {x}", path=x, present=False)
    units = units_of(paths)
    if units:
        gone = any_changed(*(removed[u] for u in units))
        systemd.daemon_reload(name=f"systemd daemon-reload ({what}: units removed)", _if=gone)
        names = [u[len(UNIT_DIR) :] for u in units]
        with op_per(f"systemctl reset-failed {what}"):
            server.shell(
                name=f"systemctl reset-failed ({what}: the removed units)",
                commands=[chain(quiet(cmd("systemctl", "reset-failed", *names), out=False), cmd("true"), op="||")],
                _if=gone,
            )
    for unit_path, table in FIREWALL_TABLES.items():
        if unit_path in paths:  # its stop deleted the table, unless it was not running
            with op_per(table):
                server.shell(
                    name=f"Delete nftables table inet {table}",
                    commands=[
                        if_then(
                            quiet(cmd("nft", "list", "table", "inet", table)),
                            cmd("nft", "delete", "table", "inet", table),
                        )
                    ],
                )
    return removed


def remove_units_and_files(spec: dict[str, Any], where: Paths, paths: list[str], what: str) -> dict[str, Any]:
    """A role's ``present=False`` when it placed only files and units: of ``paths``, those that
    are this deployment's (:func:`owned`), their units stopped and disabled, then removed
    (:func:`remove_files`). {path: its remove operation}; nothing there: {} and no operation."""
    mine_, _ = owned(spec, where, paths, what)
    stop_units(units_of(mine_))
    return remove_files(mine_, what) if mine_ else {}


def directories(dirs: list[str], why: str) -> dict[str, Any]:
    """Remove directories (and all below them): {path: operation}."""
    out = {}
    for d in dirs:
        with op_per(d):
            out[d] = files.directory(name=f"Remove {d} ({why})", path=d, present=False)
    return out
