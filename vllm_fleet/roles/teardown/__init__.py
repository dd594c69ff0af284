"""Remove one deployment from a host: its units stopped, disabled and removed, its files, its
nginx site (then `nginx -t` and reload), its API firewall table, its exporters' configuration;
environments and weights stay unless purged. Other deployments on the host are left alone.

Query + apply over the one state read (vllm_fleet.roles.common.state): :func:`state_query` asks
what removing needs to know (which candidate files are there and this deployment's, whether
nginx runs), :func:`remove_deployment` takes its snapshot with ``role_state`` (on serve, the
deploy's read: :func:`leftover_query` holds it; on ``down``, one read) and decides from it alone
(:func:`mine`). A read that did not complete raises ``StateUnknown``: nothing is removed on a guess.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from pyinfra import host
from pyinfra.api import StringCommand, deploy
from pyinfra.operations import files, server, systemd
from pyinfra.operations.util import any_changed

from vllm_fleet.host.programs import argv as cmd
from vllm_fleet.host.programs import if_then
from vllm_fleet.render import files as render
from vllm_fleet.render import monitoring
from vllm_fleet.render.layout import Node
from vllm_fleet.roles.common import clash, op_per
from vllm_fleet.roles.common.state import Query, Snapshot, role_state, unknown
from vllm_fleet.roles.monitoring import SERVICE_OF
from vllm_fleet.roles.ray import defaults as ray_defaults
from vllm_fleet.roles.router import wheels_dir as router_wheels_dir
from vllm_fleet.roles.service import defaults as service_defaults
from vllm_fleet.roles.vllm import defaults as vd

from .defaults import DEFAULTS

UNIT_DIR = "/etc/systemd/system/"
UNIT_SUFFIXES = (".service", ".socket", ".timer", ".path", ".mount", ".target")


def marker(name: str) -> str:
    """The text every file of deployment ``name`` carries (the renderer's header, the roles' own);
    the colon keeps `lab-tiny` from matching `lab-tiny-replicas`'s files."""
    return f"for deployment {name}:"


def candidates(spec: dict[str, Any], rendered: dict[str, Any]) -> list[str]:
    """Every path this deployment may have placed on the host: its rendered files, the TLS files
    of its nginx site, and the role-placed API firewall (rules and unit)."""
    p = render.paths(spec)
    out = set(rendered)
    if p["nginx_site"] in rendered:
        # the router's unit too: a spec whose policy is no longer cache_aware still removes it
        out |= {p["tls_certificate"], p["tls_certificate_key"], p["router_unit"]}
    if any(x.startswith(UNIT_DIR) for x in rendered):
        out |= {f for f, _, _ in firewalls()}
        out |= {u for _, u, _ in firewalls()}
    return sorted(out)


# What `serve` removes from a host when the layout no longer gives it there (monitoring turned off,
# the proxy moved, the deployment dropped from the host's data, fewer Ray nodes), by render.paths'
# names: the units, the configuration and the nginx site. The environment, the weights and
# vLLM's caches stay, as after `down` without --purge (a later deploy reuses them).
LEFTOVER_PATHS = ("vllm_env", "secrets_env", "node_env", "wait_ray", "wait_health", "nginx_site", "nginx_auth",
                  "tls_certificate", "tls_certificate_key", "router_unit", "ray_head_unit", "ray_worker_unit",
                  "api_firewall_rules", "api_firewall_unit", "ray_firewall_rules", "ray_firewall_unit")


def leftover_query(spec: dict[str, Any], node: Node | None, rendered: dict[str, Any]) -> Query:
    """What the deploy's one state read must see to find this deployment's leftovers on the host
    (:func:`leftovers`) and to remove them (:func:`state_query` of those paths, so the pruning's
    ``remove_deployment`` adds no command): its fixed paths that this host's layout does not
    render, its replicas' units and env files (the globs), nginx's unit."""
    return state_query(spec, rendered, _leftover_candidates(spec, node, rendered)) | Query(globs=_globs(spec))


def state_query(spec: dict[str, Any], rendered: dict[str, Any], paths: list[str] | None = None) -> Query:
    """What :func:`remove_deployment` compares against (vllm_fleet.roles.common.state): of each
    path (default: :func:`candidates`), a stat when the path alone says it is this deployment's
    (:func:`owned_by_path`: never the TLS key's content), else its text (to find the
    :func:`marker`); a replica unit or env file through the glob that covers it (the clash check
    reads those already); nginx's unit when the site is among them (reloaded only when it runs)."""
    paths = candidates(spec, rendered) if paths is None else paths
    single = [x for x in paths if _glob_of(spec, x) is None]
    return Query(stat=tuple(x for x in single if owned_by_path(spec, x)),
                 read=tuple(x for x in single if not owned_by_path(spec, x)),
                 globs=tuple(dict.fromkeys(g for x in paths if (g := _glob_of(spec, x)) is not None)),
                 units=("nginx.service",) if render.paths(spec)["nginx_site"] in paths else ())


def _globs(spec: dict[str, Any]) -> tuple[str, str]:
    return clash.UNITS, _replica_envs(spec)


def _glob_of(spec: dict[str, Any], path: str) -> str | None:
    """The glob of :func:`state_query` that reads ``path`` (a ``vllm-*.service`` unit, a
    ``replica-N.env`` file), or None (the path is stat'ed or read on its own)."""
    return next((g for g in _globs(spec) if PurePosixPath(path).match(g)), None)


def mine(spec: dict[str, Any], path: str, snap: Snapshot) -> bool | None:
    """Whether the state read (:func:`state_query`) shows ``path`` as this deployment's file on
    the host: a regular file there that lies in its own directories (:func:`owned_by_path`) or
    whose text names it (:func:`marker`; a package's own /etc/default/prometheus or another
    deployment's unit does not). None when the read did not ask it or did not complete."""
    glob = _glob_of(spec, path)
    if glob is not None:
        found = snap.matching(glob)
        if found is None:
            return None
        return path in found and (owned_by_path(spec, path) or marker(spec["name"]) in (found[path] or ""))
    if owned_by_path(spec, path):
        known, st = snap.path(path)
        return bool(st and st["type"] == "file") if known else None
    known, text = snap.content(path)
    return marker(spec["name"]) in (text or "") if known else None


def _replica_envs(spec: dict[str, Any]) -> str:
    """The glob of the replicas' env files: clash's own (already read for every deploy) when
    install.config_dir is the default place, else one under config_dir."""
    cfg = spec["install"]["config_dir"].rstrip("/")
    return clash.REPLICA_ENVS if PurePosixPath(f"{cfg}/replica-0.env").match(clash.REPLICA_ENVS) else f"{cfg}/replica-*.env"


def _leftover_candidates(spec: dict[str, Any], node: Node | None, rendered: dict[str, Any]) -> list[str]:
    p = render.paths(spec)
    out = {p[k] for k in LEFTOVER_PATHS} | set(monitoring.paths(spec).values())
    if node is not None and "proxy" in node.roles:  # the roles' own files beside a site still here
        out -= {p["tls_certificate"], p["tls_certificate_key"], p["router_unit"]}
    return sorted(out - set(rendered))


def leftovers(spec: dict[str, Any], node: Node | None, rendered: dict[str, Any], snap: Snapshot) -> list[str]:
    """Paths on this host (as the state read of :func:`leftover_query` saw them) that an earlier
    deploy of this deployment put there and this host's layout no longer gives it: its fixed
    paths, and (when no instance of it is left here: the service role removes the units of fewer
    replicas itself) its ``vllm-NAME-N.service`` units and ``replica-N.env`` files. Only files
    that are this deployment's (:func:`mine`), so a converged host has none (and no operation);
    a read that did not complete finds none."""
    found = [x for x in _leftover_candidates(spec, node, rendered) if mine(spec, x, snap)]
    if node is None or not node.instances:
        prefix = spec["install"]["config_dir"].rstrip("/") + "/replica-"
        found += [x for x in (snap.matching(clash.UNITS) or {})
                  if clash.unit_of(x) == spec["name"] and x not in rendered and mine(spec, x, snap)]
        found += [x for x in (snap.matching(_replica_envs(spec)) or {}) if x.startswith(prefix) and x not in rendered]
    return sorted(set(found))


def firewalls() -> list[tuple[str, str, str]]:
    """(rules file, unit path, nftables table) of the firewalls the roles place beside the
    rendered units (roles.service: the API port; roles.ray: Ray's ports)."""
    return [(service_defaults.API_FIREWALL_FILE, f"{UNIT_DIR}{service_defaults.API_FIREWALL_UNIT}", service_defaults.API_FIREWALL_TABLE),
            (ray_defaults.FIREWALL_FILE, f"{UNIT_DIR}{ray_defaults.FIREWALL_UNIT}", ray_defaults.FIREWALL_TABLE)]


def owned_by_path(spec: dict[str, Any], path: str) -> bool:
    """Whether the path alone says the file is this deployment's: it lies in its own directories
    (install.prefix, install.config_dir) or is its site's TLS certificate or key. Any other file
    is its own only when it names it (:func:`marker`)."""
    ins, p = spec["install"], render.paths(spec)
    own_dirs = (ins["prefix"].rstrip("/") + "/", ins["config_dir"].rstrip("/") + "/")
    return path.startswith(own_dirs) or path in (p["tls_certificate"], p["tls_certificate_key"])


@deploy("Remove the deployment", data_defaults=DEFAULTS)
def remove_deployment(spec: dict[str, Any], rendered: dict[str, Any], purge: bool | None = None,
                      paths: list[str] | None = None):
    """
    Remove this deployment from the host; what to remove comes from its rendered files.

    + spec: the resolved deployment spec
    + rendered: this host's rendered files ({path: RenderedFile}); a file is removed only when
      the host's copy names this deployment (another deployment's file is left alone)
    + purge: also remove the environment, weights, caches and config directory (default: host
      data ``vllm_fleet_purge``)
    + paths: remove only these (serve's :func:`leftovers`: what the layout no longer gives the
      host), each still only when it names this deployment; the install-time directories are
      left to the vllm role and nothing is purged

    What is on the host comes from the state read (:func:`state_query`, through ``role_state``:
    serve's one read already holds it, else one read). A read that did not complete raises
    ``StateUnknown`` and removes nothing. Idempotent: a second run finds nothing of the
    deployment and changes nothing.

    **Example:**

    .. code:: python

        ctx = load_deploy_spec()
        remove_deployment(spec=ctx["spec"], rendered=rendered_for_host(ctx))
    """
    purge = host.data.get("vllm_fleet_purge") if purge is None else purge
    purge = purge in (True, "true", "True", "1", 1, "yes") and paths is None
    pruning = paths is not None
    p = render.paths(spec)
    paths = candidates(spec, rendered) if paths is None else paths
    snap = role_state(state_query(spec, rendered, paths))
    if not snap.known:
        raise unknown(f"which files of deployment {spec['name']} are there", changed="nothing was removed from this host",
                      run="the command")
    owned = [x for x in paths if mine(spec, x, snap)]
    units = [x for x in owned if x.startswith(UNIT_DIR) and x.endswith(UNIT_SUFFIXES)]

    _stop(spec, owned, units)
    removed = _remove_files(owned, units)
    if p["nginx_site"] in owned:
        _reload_nginx(removed[p["nginx_site"]], snap)
    _remove_directories(spec, owned, removed, purge=purge, install_time=not pruning)
    if not owned and not purge and not pruning:
        host.noop(f"nothing of deployment {spec['name']} on this host")


def _stop(spec: dict[str, Any], owned: list[str], units: list[str]) -> None:
    """1. units: stopped and disabled before their files go (the firewall unit's stop deletes its
    table); 2. exporters and Prometheus whose configuration is this deployment's, once each.
    (op_per: one operation per unit or path on every host, so hosts with different files do not
    show merged or repeated names in pyinfra's output.)"""
    for unit_path in units:
        unit = unit_path[len(UNIT_DIR):]
        with op_per(unit_path):
            systemd.service(name=f"Stop and disable {unit}", service=unit, running=False, enabled=False)
    mon = monitoring.paths(spec)
    for service in dict.fromkeys(svc for key, svc in SERVICE_OF.items() if mon.get(key) in owned):
        with op_per(service):
            systemd.service(name=f"Stop and disable {service} (its configuration was {spec['name']}'s)",
                            service=service, running=False, enabled=False)


def _remove_files(owned: list[str], units: list[str]) -> dict[str, Any]:
    """3. the files; systemd reloaded and the removed units' failed state reset; the firewall
    tables deleted. {path: its remove operation}."""
    removed = {}
    for x in owned:
        with op_per(x):
            removed[x] = files.file(name=f"Remove {x}", path=x, present=False)
    if units:
        gone = any_changed(*(removed[u] for u in units))
        systemd.daemon_reload(name="systemd daemon-reload (units removed)", _if=gone)
        # a unit that had failed (a crash loop) stays listed "not-found failed" after its file is
        # gone, and the host "degraded": systemd forgets it only after reset-failed
        names = [u[len(UNIT_DIR):] for u in units]
        with op_per("systemctl reset-failed"):
            server.shell(name="systemctl reset-failed (the removed units)",
                         commands=[StringCommand(cmd("systemctl", "reset-failed", *names), "2>/dev/null", "||", "true")], _if=gone)
    for _, unit_path, table in firewalls():
        if unit_path in owned:  # its stop deleted the table, unless it was not running
            with op_per(table):
                server.shell(name=f"Delete nftables table inet {table}",
                             commands=[if_then(StringCommand(cmd("nft", "list", "table", "inet", table), ">/dev/null", "2>&1"),
                                               cmd("nft", "delete", "table", "inet", table))])
    return removed


def _reload_nginx(site: Any, snap: Snapshot) -> None:
    """4. nginx without the site: validated, then reloaded (never restarted) when it runs (its
    unit as the state read saw it)."""
    active = (snap.unit("nginx.service") or {}).get("ActiveState") == "active"
    server.shell(name="nginx -t (validate before reload)", commands=[cmd("nginx", "-t")], _if=site.did_change)
    if active:
        systemd.service(name="Reload nginx (site removed)", service="nginx", reloaded=True, _if=site.did_change)


def _remove_directories(spec: dict[str, Any], owned: list[str], removed: dict[str, Any], purge: bool, install_time: bool) -> None:
    """5. the replicas' .applied records; with purge the deployment's own directories
    (environment, weights, caches, configuration), else (``install_time``) what only an install
    needs, and the configuration directory when it held only this deployment's files."""
    cfg = spec["install"]["config_dir"].rstrip("/")
    # the service role's record of what each instance runs (replica-N.applied beside its replica-N.env)
    for x in sorted(owned):
        if x.startswith(cfg + "/replica-") and x.endswith(".env"):
            stamp = x[: -len(".env")] + ".applied"
            with op_per(stamp):
                removed[stamp] = files.file(name=f"Remove {stamp}", path=stamp, present=False)
    in_cfg = [r for x, r in removed.items() if x.startswith(cfg + "/")]
    if purge:
        ins = spec["install"]
        for d in sorted({ins["prefix"], ins["state_dir"], spec["model"]["path"], cfg}):
            with op_per(d):
                files.directory(name=f"Remove {d} (purge)", path=d, present=False)
    elif install_time:
        # what only an install needs (uploaded wheels, uv's cache): never kept after down; the
        # environment itself stays (vllm_fleet_purge removes it)
        prefix = spec["install"]["prefix"].rstrip("/")
        for d in (*(f"{prefix}/{sub}" for sub in (vd.WHEELHOUSE_SUBDIR, vd.FIND_LINKS_SUBDIR, vd.UV_CACHE_SUBDIR)),
                  router_wheels_dir(spec)):
            with op_per(d):
                files.directory(name=f"Remove {d} (install-time only)", path=d, present=False)
    if not purge and in_cfg:  # it held only this deployment's rendered files
        server.shell(name=f"Remove {cfg} if empty", commands=[cmd("rmdir", "--ignore-fail-on-non-empty", cfg)],
                     _if=any_changed(*in_cfg))
