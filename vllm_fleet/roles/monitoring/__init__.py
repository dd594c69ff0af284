"""Monitoring: node exporter on every host the deploy touches, DCGM exporter on GPU hosts,
Prometheus (+ the blackbox exporter for /health probes, + Grafana provisioning) on the hosts of
the `monitoring` group. Every file is rendered by vllm_fleet.render.monitoring; this role places them,
installs Debian's packages, validates with promtool and restarts/reloads only on change.

Query + apply over the one state read (vllm_fleet.roles.common.state): :func:`state_query` asks
the monitoring files, their directories, the packages, the services, the dcgm-exporter binary
and Grafana's unit; deploys/serve.py puts it in the deploy's one read, and
:func:`install_monitoring` takes its snapshot with ``role_state`` (one read when it runs on its
own). A read that did not complete stops the host with ``StateUnknown`` where the role must know
(the dcgm-exporter binary, Grafana installed); puts and packages then fall back to pyinfra's own
operations, which read their facts.
"""

from __future__ import annotations

import os
from typing import Any

from pyinfra import host, logger
from pyinfra.api import deploy
from pyinfra.operations import files, server, systemd
from pyinfra.operations.util import any_changed

from vllm_fleet.host.programs import argv as cmd
from vllm_fleet.render import monitoring
from vllm_fleet.render.parts import Paths, files_of
from vllm_fleet.roles.common import DeployError, directory, packages as common_packages, put_rendered, rendered_query
from vllm_fleet.roles.common import remove, role_data, service_running
from vllm_fleet.host.state import Query, Snapshot
from vllm_fleet.roles.common.state import pending, role_state, unknown
from vllm_fleet.specs.sections import reads

from .defaults import DEFAULTS

#: The spec sections this role reads (vllm_fleet.specs.sections); its README lists them.
SECTIONS = ("name", "install", "monitoring")

PROMETHEUS = "prometheus"
NODE_EXPORTER = "prometheus-node-exporter"
BLACKBOX = "prometheus-blackbox-exporter"
DCGM_EXPORTER = "dcgm-exporter"
GRAFANA = "grafana-server"
#: The packaged service each monitoring file configures (vllm_fleet.render.monitoring.paths keys): what
#: the role's ``present=False`` stops when it removes a deployment's file (units like DCGM's are rendered).
SERVICE_OF = {
    "node_exporter_defaults": NODE_EXPORTER,
    "prometheus_defaults": PROMETHEUS,
    "prometheus_config": PROMETHEUS,
    "blackbox_defaults": BLACKBOX,
    "blackbox_config": BLACKBOX,
}


def _data(key: str) -> Any:
    return role_data(key, DEFAULTS)


def _parts(spec: dict[str, Any], where: Paths, rendered: dict[str, Any]) -> list[tuple[str, list[str], list[str]]]:
    """``(path that calls for the part, its packages, its services)`` of each monitoring part this
    host's rendered files call for: node exporter, DCGM, Prometheus (+ the blackbox exporter)."""
    p, probe = where.monitoring, spec["monitoring"]["health_probe"]
    parts = [
        (p["node_exporter_defaults"], [_data("monitoring_node_exporter_package")], [NODE_EXPORTER]),
        (p["dcgm_unit"], list(_data("monitoring_dcgm_packages")), [DCGM_EXPORTER]),
        (
            p["prometheus_config"],
            [_data("monitoring_prometheus_package"), *([_data("monitoring_blackbox_package")] if probe else [])],
            [PROMETHEUS, *([BLACKBOX] if probe else [])],
        ),
    ]
    return [part for part in parts if part[0] in rendered]


@reads(*SECTIONS)
def state_query(spec: dict[str, Any], where: Paths, rendered: dict[str, Any]) -> Query:
    """What install_monitoring compares against (vllm_fleet.roles.common.state): this host's
    rendered monitoring files and their directories, the packages and services of its parts, the
    dcgm-exporter binary (GPU hosts) and Grafana's unit (Grafana provisioning)."""
    p = where.monitoring
    rendered = files_of(rendered, spec["name"], "monitoring")
    mine = [x for x in p.values() if x in rendered]
    parts = _parts(spec, where, rendered)
    q = rendered_query(rendered, mine) | Query(
        stat=tuple(sorted({os.path.dirname(x) for x in mine}))
        + ((monitoring.DCGM_BINARY,) if p["dcgm_unit"] in rendered else ()),
        debs=tuple(n for _, pkgs, _ in parts for n in pkgs),
        units=tuple(f"{u}.service" for _, _, units in parts for u in units),
    )
    return q | (Query(units=(f"{GRAFANA}.service",)) if p["grafana_datasource"] in rendered else Query())


def _must_know(snap: Snapshot, what: str) -> None:
    if not snap.known:
        raise unknown(what)


def _put(rendered: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """put_rendered, after making missing parent directories (atomic puts need them: e.g.
    /etc/prometheus before its package exists). Existing directories are left as they are
    (Grafana's own, for instance)."""
    for d in sorted({os.path.dirname(path) for path in paths if path in rendered}):
        directory(name=f"Directory {d}", path=d)
    return put_rendered(rendered, paths)


def _apt(name: str, packages: list[str]):
    # installed packages: no operation, so no apt lists refresh hours later (roles.common.packages)
    return common_packages(
        name=name,
        packages=packages,
        update=True,
        no_recommends=True,
        cache_time=int(_data("monitoring_apt_cache_time")),
    )


@deploy("monitoring", data_defaults=DEFAULTS)
@reads(*SECTIONS)
def install_monitoring(
    spec: dict[str, Any],
    where: Paths,
    rendered: dict[str, Any],
    present: bool = True,
    paths: list[str] | None = None,
):
    """
    Install and configure what this host's rendered monitoring files call for, or
    (``present=False``) remove them.

    + spec: the resolved deployment spec (``monitoring.enabled`` true)
    + where: where its files live (the layout's: ``ctx.layout.paths[name]``, vllm_fleet.render.parts.Paths)
    + rendered: this host's rendered files ({path: RenderedFile}); the monitoring ones are used:
      node exporter defaults (every host), the DCGM exporter unit (GPU hosts), Prometheus'
      defaults, config and rules, the blackbox exporter's, Grafana's provisioning (monitoring hosts)
    + present: False stops and disables the exporters and Prometheus whose configuration is this
      deployment's (and its rendered units, DCGM's), then removes those files; the packages stay
    + paths: with ``present=False``, remove only these (serve's pruning: monitoring turned off);
      default: every monitoring file of the deployment

    What is on the host comes from the state read (:func:`state_query`, through ``role_state``:
    the deploy's, or one read when the role runs on its own).

    **Example:**

    .. code:: python

        where = ctx.layout.paths[ctx.first]
        install_monitoring(spec=ctx.spec, where=where, rendered=rendered_for_host(ctx))
        install_monitoring(spec=ctx.spec, where=where, rendered=rendered_for_host(ctx), present=False)
    """
    if not present:
        return _absent(spec, where, rendered, paths)
    rendered = files_of(rendered, spec["name"], "monitoring")  # what this role places, and nothing else
    p = where.monitoring
    snap = role_state(state_query(spec, where, rendered))  # the deploy's read: no command
    if p["node_exporter_defaults"] in rendered:
        # The listen address first: the package starts the exporter at install time, and dpkg
        # (--force-confold) keeps this file, so it never listens on 0.0.0.0.
        args = _put(rendered, [p["node_exporter_defaults"]])
        _apt("node exporter package", [_data("monitoring_node_exporter_package")])
        service_running(name="node exporter running and enabled", service=NODE_EXPORTER)
        _restart_on("Restart node exporter (listen address changed)", NODE_EXPORTER, args.values())
    if p["dcgm_unit"] in rendered:
        _dcgm(p, rendered, snap)
    if p["prometheus_config"] in rendered:
        _prometheus(spec, p, rendered, snap)


def _absent(spec: dict[str, Any], where: Paths, rendered: dict[str, Any], paths: list[str] | None) -> dict[str, Any]:
    """present=False: 1. the deployment's monitoring units stopped and disabled, and the packaged
    services whose configuration file is this deployment's (:data:`SERVICE_OF`), once each; 2. the
    files removed. {path: its remove operation}."""
    paths = remove.placed(spec, where, rendered, "monitoring") if paths is None else paths
    owned, _ = remove.owned(spec, where, paths, "monitoring files")
    remove.stop_units(remove.units_of(owned))
    mon = where.monitoring
    services = dict.fromkeys(svc for key, svc in SERVICE_OF.items() if mon.get(key) in owned)
    remove.stop_units(list(services), why=f" (its configuration was {spec['name']}'s)")
    return remove.remove_files(owned, "monitoring")


def _dcgm(p: dict[str, str], rendered: dict[str, Any], snap: Snapshot) -> None:
    _apt("NVIDIA DCGM packages", list(_data("monitoring_dcgm_packages")))
    binary = _data("monitoring_dcgm_exporter_binary")
    changed = []
    if binary:
        if not os.path.isfile(os.path.expanduser(binary)):
            raise DeployError(
                f"{host.name}: monitoring_dcgm_exporter_binary {binary} is not a file on this machine; no host was "
                "changed"
            )
        changed.append(
            files.put(
                name="dcgm-exporter binary", src=os.path.expanduser(binary), dest=monitoring.DCGM_BINARY, mode="755"
            )
        )
    elif not _is_file(snap, monitoring.DCGM_BINARY):
        raise DeployError(
            f"{host.name}: monitoring.dcgm_exporter is on for this GPU host but {monitoring.DCGM_BINARY} is missing: "
            "set host data `monitoring_dcgm_exporter_binary` to a dcgm-exporter binary on the control machine "
            "(NVIDIA/dcgm-exporter, `make binary`), or set monitoring.dcgm_exporter: false"
        )
    put = _put(rendered, [p["dcgm_counters"], p["dcgm_unit"]])
    changed += put.values()
    if pending(put[p["dcgm_unit"]]):
        systemd.daemon_reload(
            name="systemd daemon-reload (dcgm-exporter unit changed)", _if=put[p["dcgm_unit"]].did_change
        )
    service_running(name="dcgm-exporter running and enabled", service=DCGM_EXPORTER)
    _restart_on("Restart dcgm-exporter (changed)", DCGM_EXPORTER, changed)


def _restart_on(name: str, service: str, ops: Any) -> None:
    """Restart ``service`` when one of ``ops`` (puts, package installs) changes. None of them can
    when the state read shows their files as rendered (they are ``Converged``): then no
    operation, so a converged host sends no systemd command (pyinfra's systemd.service reads its
    facts while the deploy plans, even when its ``_if`` is false)."""
    ops = pending(*ops)
    if ops:
        systemd.service(name=name, service=service, restarted=True, _if=any_changed(*ops))


def _is_file(snap: Snapshot, path: str) -> bool:
    """Whether the state read shows a regular file at ``path`` (StateUnknown when it did not complete)."""
    _must_know(snap, f"whether {path} is there")
    return bool((st := snap.path(path)[1]) and st["type"] == "file")


def _prometheus(spec: dict[str, Any], p: dict[str, str], rendered: dict[str, Any], snap: Snapshot) -> None:
    mon = spec["monitoring"]
    defaults = [p["prometheus_defaults"]] + (
        [p["blackbox_defaults"], p["blackbox_config"]] if p["blackbox_defaults"] in rendered else []
    )
    # Listen addresses (and the prober's config its arguments name) before the packages: their
    # postinst starts the services, and dpkg's --force-confold keeps these files.
    args = _put(rendered, defaults)
    packages = [_data("monitoring_prometheus_package")]
    if mon["health_probe"]:
        packages.append(_data("monitoring_blackbox_package"))
    _apt("Prometheus packages", packages)
    config = _put(rendered, [p["prometheus_config"], p["rules"]])
    if pending(*config.values()):
        server.shell(
            name="promtool check config (validate before reload)",
            commands=[cmd("promtool", "check", "config", p["prometheus_config"])],
            _if=any_changed(*config.values()),
        )
    service_running(name="Prometheus running and enabled", service=PROMETHEUS)
    _restart_on("Restart Prometheus (arguments changed)", PROMETHEUS, [args[p["prometheus_defaults"]]])
    if pending(*config.values()):
        config_changed = any_changed(*config.values())
        systemd.service(
            name="Reload Prometheus (config or rules changed)",
            service=PROMETHEUS,
            reloaded=True,
            _if=lambda: config_changed() and not args[p["prometheus_defaults"]].did_change(),
        )  # a restart reads them anyway
    if mon["health_probe"]:
        service_running(name="blackbox exporter running and enabled", service=BLACKBOX)
        _restart_on(
            "Restart blackbox exporter (changed)", BLACKBOX, [args[p["blackbox_defaults"]], args[p["blackbox_config"]]]
        )
    if p["grafana_datasource"] in rendered:
        graf = _put(rendered, [p["grafana_datasource"], p["grafana_dashboards"], p["grafana_dashboard"]])
        _must_know(snap, "whether Grafana is installed")
        if (snap.unit(f"{GRAFANA}.service") or {}).get("LoadState") == "loaded":  # its package's unit
            _restart_on("Restart Grafana (provisioning changed)", GRAFANA, graf.values())
        else:
            logger.warning(
                f"{host.name}: monitoring.grafana.enabled but Grafana is not installed: the datasource and dashboard "
                "are provisioned and load when grafana-server is installed (Grafana's apt repository)"
            )
