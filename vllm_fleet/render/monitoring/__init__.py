"""Monitoring files of a deployment: Prometheus (config, alert rules, listen address), the
exporters (node, blackbox for /health, DCGM on GPU hosts) and Grafana provisioning.

    node_files(resolved, node, all_nodes, with_inventory) -> {path: RenderedFile}

called by :mod:`vllm_fleet.render.files` for every node of the layout. Scrape targets come from the
layout (the inventory): every vLLM API server, every Ray node of a multi-node ``ray`` spec,
every host the deploy touches (node exporter), GPU hosts (DCGM). Everything binds to a host's
private address (host data ``private_address``, else its inventory address) or to loopback,
never 0.0.0.0; vLLM's own /metrics is read

* at 127.0.0.1:<server.port> when the monitoring host is that vLLM host,
* at <address>:<server.port> when that vLLM listens on a non-loopback address,
* through that host's own nginx (``/metrics``, allowed only for ``proxy.metrics_allow``)
  when vLLM listens on loopback behind a local proxy; the monitoring host's address must then
  be in ``proxy.metrics_allow`` (a :class:`~vllm_fleet.render.files.RenderError` says so otherwise).

The alert rules (``rules.yml.j2``, thresholds from ``monitoring.alerts``) and the Grafana
dashboard (``dashboard.json``) are files of this package. Pure: no host, no pyinfra.
"""

from __future__ import annotations

import ipaddress
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import yaml

from vllm_fleet.render.parts import BLACKBOX_LISTEN, SYSTEMD_DIR, Node as _Node, _multi
from vllm_fleet.render.text import HEADER, RenderedFile, RenderError, systemd_command
from vllm_fleet.specs.ports import RAY_FIXED_PORTS


HERE = Path(__file__).resolve().parent
DASHBOARD = HERE / "dashboard.json"
RULES_TEMPLATE = "rules.yml.j2"

PROMETHEUS_DEFAULTS = "/etc/default/prometheus"
PROMETHEUS_CONFIG = "/etc/prometheus/prometheus.yml"
RULES_DIR = "/etc/prometheus/vllm-fleet"
NODE_EXPORTER_DEFAULTS = "/etc/default/prometheus-node-exporter"
BLACKBOX_DEFAULTS = "/etc/default/prometheus-blackbox-exporter"
BLACKBOX_CONFIG = "/etc/prometheus/vllm-fleet-blackbox.yml"
DCGM_UNIT = f"{SYSTEMD_DIR}/dcgm-exporter.service"
DCGM_COUNTERS = "/etc/dcgm-exporter/vllm-fleet-counters.csv"
DCGM_BINARY = "/usr/local/bin/dcgm-exporter"
GRAFANA_DATASOURCE = "/etc/grafana/provisioning/datasources/vllm-fleet.yaml"
GRAFANA_DASHBOARDS = "/etc/grafana/provisioning/dashboards/vllm-fleet.yaml"
GRAFANA_DATASOURCE_UID = "vllm-fleet-prometheus"

#: DCGM fields exported on GPU hosts (dcgm-exporter's CSV: field, Prometheus type, help).
DCGM_FIELDS = [
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
]


def paths(resolved: dict[str, Any]) -> dict[str, str]:
    """Every path the monitoring files live at, by a short name."""
    mon = resolved["monitoring"]
    return {
        "prometheus_defaults": PROMETHEUS_DEFAULTS,
        "prometheus_config": PROMETHEUS_CONFIG,
        "rules": f"{RULES_DIR}/{resolved['name']}.rules.yml",
        "node_exporter_defaults": NODE_EXPORTER_DEFAULTS,
        "blackbox_defaults": BLACKBOX_DEFAULTS,
        "blackbox_config": BLACKBOX_CONFIG,
        "dcgm_unit": DCGM_UNIT,
        "dcgm_counters": DCGM_COUNTERS,
        "grafana_datasource": GRAFANA_DATASOURCE,
        "grafana_dashboards": GRAFANA_DASHBOARDS,
        "grafana_dashboard": f"{mon['grafana']['dashboards_dir']}/vllm-fleet.json",
    }


def _ray_cluster(resolved: dict[str, Any]) -> bool:
    """A multi-node deployment on a Ray cluster (its nodes export Ray's metrics)."""
    return _multi(resolved) and resolved["parallel"]["backend"] == "ray"


@lru_cache(maxsize=1)
def _jinja() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(HERE)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def private_address(node: "_Node", with_inventory: bool) -> str:
    """Where a host's exporters listen: host data ``private_address``, else its address."""
    if not with_inventory:
        return "127.0.0.1"  # no inventory: rendered as if everything ran on one host
    data = node.data or {}
    return str(data.get("private_address") or node.address or node.target)


def prometheus_address(resolved: dict[str, Any], node: "_Node", with_inventory: bool) -> str:
    if resolved["monitoring"]["prometheus_listen"] == "loopback":
        return "127.0.0.1"
    return private_address(node, with_inventory)


def _allowed(address: str, allow: list[str]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in ipaddress.ip_network(a, strict=False) for a in allow)


def scrape_source(mon_node: "_Node", target: "_Node", with_inventory: bool) -> str:
    """The address a scrape from the monitoring host arrives from at ``target``: loopback on the
    same host, else the monitoring host's private address (as every firewall and allow list of
    the layout reads it)."""
    if not with_inventory or target.target == mon_node.target:
        return "127.0.0.1"
    return private_address(mon_node, True)


def through_nginx(resolved: dict[str, Any], mon_node: "_Node", target: "_Node", with_inventory: bool, what: str) -> str:
    """The one rule of a scrape through ``target``'s nginx (/metrics/N, /health/N,
    /metrics/router): ``proxy.metrics_allow`` must admit the address it comes from; returns
    nginx's address and port as the scrape names them (``target``'s private address)."""
    prx = resolved["proxy"]
    source = scrape_source(mon_node, target, with_inventory)
    allow = prx.get("metrics_allow") or []
    if not _allowed(source, allow):
        raise RenderError(
            f"monitoring: {mon_node.target} ({source}) reads {what} of {target.target} through its nginx, but "
            f"proxy.metrics_allow ({', '.join(allow) or 'empty'}) does not include it: add {source} (or its subnet) "
            "to proxy.metrics_allow"
        )
    port, default = prx["listen"], (443 if prx["tls"]["enabled"] else 80)
    address = source if source == "127.0.0.1" else private_address(target, True)
    return address if port == default else f"{address}:{port}"


def nginx_scheme(prx: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """(scheme, Prometheus tls_config or None) of a scrape through nginx."""
    tls = prx["tls"]
    if not tls["enabled"]:
        return "http", None
    return "https", {"insecure_skip_verify": True} if tls["self_signed"] else (
        {"server_name": prx["server_name"]} if prx["server_name"] != "_" else {}
    )


def vllm_targets(
    resolved: dict[str, Any], mon_node: "_Node", all_nodes: list["_Node"], with_inventory: bool
) -> list[dict[str, Any]]:
    """How the monitoring host reads each API server's /metrics and /health.

    [{"replica", "scheme", "address", "metrics_path", "health_path", "tls": {...} or None}] for
    every replica of every node with the server role. Through a host's nginx (vLLM on loopback,
    the monitoring host elsewhere) replica N is read at /metrics/N and /health/N: that host's
    replica alone, not the upstream's balance over all of them.
    """
    srv, prx = resolved["server"], resolved["proxy"]
    loopback = srv["host"] in ("127.0.0.1", "localhost", "::1")
    out = []
    for s, inst in ((s, i) for s in all_nodes if "server" in s.roles for i in (s.instances or [None])):
        port = inst.port if inst else srv["port"]
        replica = s.target if not inst or len(s.instances) == 1 else inst.id
        target = {
            "replica": replica,
            "scheme": "http",
            "address": f"127.0.0.1:{port}",
            "metrics_path": "/metrics",
            "health_path": "/health",
            "tls": None,
        }
        if with_inventory and s.target != mon_node.target:
            if not loopback:
                target["address"] = f"{private_address(s, True)}:{port}"
            elif "proxy" in s.roles:
                n = inst.index if inst else 0
                target["scheme"], target["tls"] = nginx_scheme(prx)
                target["address"] = through_nginx(resolved, mon_node, s, True, f"/metrics/{n} and /health/{n}")
                target["metrics_path"], target["health_path"] = f"/metrics/{n}", f"/health/{n}"
            else:
                raise RenderError(
                    f"monitoring: {mon_node.target} cannot read vLLM's /metrics on {s.target}: vLLM listens on "
                    f"{srv['host']} and no proxy runs there: set server.host: 0.0.0.0 (firewalled to the private "
                    f"network), or put {s.target} in the monitoring group"
                )
        out.append(target)
    return out


def router_targets(
    resolved: dict[str, Any], mon_node: "_Node", all_nodes: list["_Node"], with_inventory: bool
) -> list[tuple[str, dict[str, str]]]:
    """vLLM's router (proxy.routing cache_aware) on each proxy host: its Prometheus port is on
    loopback, read through that host's nginx at /metrics/router (:func:`through_nginx`)."""
    return [
        (
            through_nginx(resolved, mon_node, n, with_inventory, "/metrics/router"),
            {"deployment": resolved["name"], "replica": f"router@{n.target}"},
        )
        for n in all_nodes
        if "router" in n.roles
    ]


def scrapers(resolved: dict[str, Any], all_nodes: list["_Node"]) -> list[str]:
    """The private addresses of the hosts that scrape this deployment directly (its Prometheus
    and blackbox probe: the monitoring hosts), for the firewalls of the hosts they read."""
    if not resolved["monitoring"]["enabled"]:
        return []
    return [private_address(n, True) for n in all_nodes if "monitoring" in n.roles]


def _scrape(job: str, targets: list[tuple[str, dict[str, str]]], **extra: Any) -> dict[str, Any]:
    """A scrape config with one static group per target (its labels)."""
    return {"job_name": job, **extra, "static_configs": [{"targets": [t], "labels": labels} for t, labels in targets]}


def prometheus_config(
    resolved: dict[str, Any], mon_node: "_Node", all_nodes: list["_Node"], with_inventory: bool
) -> dict[str, Any]:
    mon, name = resolved["monitoring"], resolved["name"]
    listen = f"{prometheus_address(resolved, mon_node, with_inventory)}:{mon['prometheus_port']}"
    scrapes: list[dict[str, Any]] = [
        _scrape("prometheus", [(listen, {"deployment": name, "replica": mon_node.target})])
    ]

    vllm = vllm_targets(resolved, mon_node, all_nodes, with_inventory)
    by_kind: dict[tuple[str, str], list[tuple[str, dict[str, str]]]] = {}
    for t in vllm:
        key = (t["scheme"], json.dumps(t["tls"], sort_keys=True))
        labels = {"deployment": name, "replica": t["replica"]}
        if t["metrics_path"] != "/metrics":  # Prometheus reads a target's own path from this label
            labels["__metrics_path__"] = t["metrics_path"]
        by_kind.setdefault(key, []).append((t["address"], labels))
    for i, ((scheme, tls), targets) in enumerate(sorted(by_kind.items())):
        extra: dict[str, Any] = {"scheme": scheme, "metrics_path": "/metrics"}
        if json.loads(tls) is not None:
            extra["tls_config"] = json.loads(tls)
        job = _scrape("vllm", targets, **extra)
        if len(by_kind) > 1:  # one job name per scheme: `job` stays "vllm" through a relabel
            job["job_name"] = f"vllm-{i}"
            job["relabel_configs"] = [{"target_label": "job", "replacement": "vllm"}]
        scrapes.append(job)

    router = router_targets(resolved, mon_node, all_nodes, with_inventory)
    if router:
        scheme, tls_config = nginx_scheme(resolved["proxy"])
        scrapes.append(
            _scrape(
                "vllm-router",
                router,
                metrics_path="/metrics/router",
                **({"scheme": scheme, "tls_config": tls_config} if tls_config is not None else {}),
            )
        )

    if mon["health_probe"]:
        urls = [
            (f"{t['scheme']}://{t['address']}{t['health_path']}", {"deployment": name, "replica": t["replica"]})
            for t in vllm
        ]
        scrapes.append(
            _scrape("vllm-health", urls, metrics_path="/probe", params={"module": ["vllm_health"]})
            | {
                "relabel_configs": [
                    {"source_labels": ["__address__"], "target_label": "__param_target"},
                    {"source_labels": ["__param_target"], "target_label": "instance"},
                    {"target_label": "__address__", "replacement": BLACKBOX_LISTEN},
                ]
            }
        )

    if mon["node_exporter"]:
        nodes: dict[str, dict[str, str]] = {}  # by address: without an inventory every role is one host
        for n in (n for n in all_nodes if n.roles):
            nodes.setdefault(
                f"{private_address(n, with_inventory)}:{mon['node_exporter_port']}",
                {"deployment": name, "replica": n.target},
            )
        scrapes.append(_scrape("node", list(nodes.items())))
    if mon["ray"] and _ray_cluster(resolved):
        ray = [n for n in all_nodes if n.roles & {"ray-head", "ray-worker"}]
        scrapes.append(
            _scrape(
                "ray",
                [
                    (
                        f"{private_address(n, with_inventory)}:{RAY_FIXED_PORTS['metrics_export']}",
                        {"deployment": name, "replica": n.target},
                    )
                    for n in ray
                ],
            )
        )
    gpu_nodes = _gpu_nodes(resolved, all_nodes)
    if gpu_nodes:
        scrapes.append(
            _scrape(
                "dcgm",
                [
                    (
                        f"{private_address(n, with_inventory)}:{mon['dcgm_exporter_port']}",
                        {"deployment": name, "replica": n.target},
                    )
                    for n in gpu_nodes
                ],
            )
        )
    return {
        "global": {
            "scrape_interval": mon["scrape_interval"],
            "evaluation_interval": mon["evaluation_interval"],
            "external_labels": {"monitor": f"vllm-fleet-{name}"},
        },
        "rule_files": [f"{RULES_DIR}/*.rules.yml"],
        "scrape_configs": scrapes,
    }


def _gpu_nodes(resolved: dict[str, Any], all_nodes: list["_Node"]) -> list["_Node"]:
    if not resolved["monitoring"]["dcgm_exporter"] or resolved["install"]["accelerator"] != "cuda":
        return []
    return [n for n in all_nodes if n.roles & {"server", "worker", "ray-head", "ray-worker"}]


def ray_node_count(resolved: dict[str, Any], all_nodes: list["_Node"]) -> int:
    if not (resolved["monitoring"]["ray"] and _ray_cluster(resolved)):
        return 0
    return len([n for n in all_nodes if n.roles & {"ray-head", "ray-worker"}])


def _num(x: float) -> str:
    return f"{x:g}"


def rules(resolved: dict[str, Any], all_nodes: list["_Node"]) -> str:
    mon = resolved["monitoring"]
    a = mon["alerts"]
    return (
        _jinja()
        .get_template(RULES_TEMPLATE)
        .render(
            header=HEADER.format(name=resolved["name"]),
            name=resolved["name"],
            health_probe=mon["health_probe"],
            node_exporter=mon["node_exporter"],
            gpu=bool(_gpu_nodes(resolved, all_nodes)),
            ray_nodes=ray_node_count(resolved, all_nodes),
            kv_cache_usage=_num(a["kv_cache_usage"]),
            kv_cache_pct=_num(a["kv_cache_usage"] * 100),
            waiting_requests=a["waiting_requests"],
            ttft_p99_seconds=_num(a["ttft_p99_seconds"]),
            gpu_memory_usage=_num(a["gpu_memory_usage"]),
            gpu_memory_pct=_num(a["gpu_memory_usage"] * 100),
            for_=a["for"],
        )
    )


def _yaml(header: str, doc: dict[str, Any]) -> str:
    return f"# {header}\n" + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=200)


_PLAIN_ARG = re.compile(r"[A-Za-z0-9_@+=:,./\[\]-]+")


def _args_file(header: str, what: str, args: list[str]) -> str:
    # Debian's units run `$ARGS` unquoted: plain words only (addresses, paths, durations).
    for a in args:
        if not _PLAIN_ARG.fullmatch(a):
            raise RenderError(
                f"monitoring: {a!r} is not a plain word (an address, path or duration): it cannot go into ARGS of "
                f"{what.split(':')[0]}"
            )
    return f"# {header}\n# {what}\nARGS=\"{' '.join(args)}\"\n"


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and the variables' label_values()."""
    d = dashboard()
    exprs = [t["expr"] for p in d["panels"] for t in p["targets"]]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.*), *\w+\)", v["definition"])
            if not m:
                raise ValueError(f"dashboard variable {v['name']}: unexpected query {v['definition']!r}")
            exprs.append(m.group(1))
    return exprs


def vllm_series(exprs: list[str]) -> set[str]:
    """The `vllm:` series names the expressions read (histograms as their _bucket/_sum/_count)."""
    return {m for e in exprs for m in re.findall(r"vllm:[A-Za-z0-9_:]+", e)}


def _dcgm_unit(header: str, argv: list[str]) -> str:
    """dcgm-exporter's systemd unit."""
    return "\n".join(
        [
            f"# {header}",
            "[Unit]",
            "Description=NVIDIA DCGM exporter (GPU metrics for Prometheus, private address only)",
            "After=network-online.target nvidia-dcgm.service",
            "Wants=network-online.target",
            "",
            "[Service]",
            f"ExecStart={systemd_command(argv)}",
            "Restart=on-failure",
            "RestartSec=10",
            "",
            "[Install]",
            "WantedBy=multi-user.target",
            "",
        ]
    )


def _exporter_files(
    resolved: dict[str, Any],
    p: dict[str, str],
    node: "_Node",
    all_nodes: list["_Node"],
    with_inventory: bool,
    header: str,
) -> dict[str, Any]:
    """What every monitored node runs: the node exporter's settings and, on a GPU node, dcgm-exporter's fields and unit
    (``p``: :func:`paths`)."""
    mon = resolved["monitoring"]
    out: dict[str, Any] = {}
    addr = private_address(node, with_inventory)
    if mon["node_exporter"]:
        out[p["node_exporter_defaults"]] = RenderedFile(
            _args_file(
                header,
                "prometheus-node-exporter: only the host's private address (not every interface).",
                [f"--web.listen-address={addr}:{mon['node_exporter_port']}"],
            ),
            0o644,
        )
    if node in _gpu_nodes(resolved, all_nodes):
        csv = [f"# {header}", "# DCGM fields dcgm-exporter exports (field, Prometheus type, help)."]
        csv += [f"{f}, {t}, {h}" for f, t, h in DCGM_FIELDS]
        out[p["dcgm_counters"]] = RenderedFile("\n".join(csv) + "\n", 0o644)
        argv = [DCGM_BINARY, "--address", f"{addr}:{mon['dcgm_exporter_port']}", "--collectors", p["dcgm_counters"]]
        out[p["dcgm_unit"]] = RenderedFile(_dcgm_unit(header, argv), 0o644)
    return out


def _blackbox_files(resolved: dict[str, Any], p: dict[str, str], header: str) -> dict[str, Any]:
    """The blackbox exporter's module (GET /health, the self-signed certificate accepted) and its settings."""
    tls = resolved["proxy"]["tls"]
    module: dict[str, Any] = {
        "prober": "http",
        "timeout": "5s",
        "http": {"valid_status_codes": [200], "method": "GET", "preferred_ip_protocol": "ip4"},
    }
    if tls["enabled"] and tls["self_signed"]:
        module["http"]["tls_config"] = {"insecure_skip_verify": True}
    return {
        p["blackbox_config"]: RenderedFile(_yaml(header, {"modules": {"vllm_health": module}}), 0o644),
        p["blackbox_defaults"]: RenderedFile(
            _args_file(
                header,
                "prometheus-blackbox-exporter: probes /health for Prometheus; loopback only.",
                [f"--config.file={p['blackbox_config']}", f"--web.listen-address={BLACKBOX_LISTEN}"],
            ),
            0o644,
        ),
    }


def _grafana_files(resolved: dict[str, Any], p: dict[str, str], header: str, listen: str) -> dict[str, Any]:
    """Grafana's provisioning: the Prometheus data source at ``listen``, the dashboards' provider, the dashboard."""
    mon = resolved["monitoring"]
    ds = {
        "apiVersion": 1,
        "datasources": [
            {
                "name": "vllm-fleet Prometheus",
                "uid": GRAFANA_DATASOURCE_UID,
                "type": "prometheus",
                "access": "proxy",
                "url": f"http://{listen}",
                "isDefault": False,
                "editable": False,
            }
        ],
    }
    dash = {
        "apiVersion": 1,
        "providers": [
            {
                "name": "vllm-fleet",
                "folder": "vllm-fleet",
                "type": "file",
                "disableDeletion": True,
                "allowUiUpdates": False,
                "options": {"path": mon["grafana"]["dashboards_dir"]},
            }
        ],
    }
    return {
        p["grafana_datasource"]: RenderedFile(_yaml(header, ds), 0o644),
        p["grafana_dashboards"]: RenderedFile(_yaml(header, dash), 0o644),
        p["grafana_dashboard"]: RenderedFile(json.dumps(dashboard(), indent=2) + "\n", 0o644),
    }


def node_files(
    resolved: dict[str, Any], node: "_Node", all_nodes: list["_Node"], with_inventory: bool
) -> dict[str, Any]:
    """Monitoring files of one node (empty when monitoring is off): the exporters on every
    monitored node; Prometheus, its rules, the blackbox exporter and Grafana on the monitoring node."""
    mon = resolved["monitoring"]
    if not mon["enabled"] or not node.roles:  # a host the deploy does not touch gets nothing
        return {}
    header = HEADER.format(name=resolved["name"])
    p = paths(resolved)  # once per node: every part below places its files there
    out: dict[str, RenderedFile] = _exporter_files(resolved, p, node, all_nodes, with_inventory, header)
    if "monitoring" not in node.roles:
        return out
    listen = f"{prometheus_address(resolved, node, with_inventory)}:{mon['prometheus_port']}"
    out[p["prometheus_defaults"]] = RenderedFile(
        _args_file(
            header,
            "Prometheus: the monitoring host's private address or loopback only (monitoring.prometheus_listen).",
            [
                f"--config.file={p['prometheus_config']}",
                f"--web.listen-address={listen}",
                f"--storage.tsdb.retention.time={mon['retention']}",
            ],
        ),
        0o644,
    )
    out[p["prometheus_config"]] = RenderedFile(
        _yaml(header, prometheus_config(resolved, node, all_nodes, with_inventory)), 0o644
    )
    out[p["rules"]] = RenderedFile(rules(resolved, all_nodes), 0o644)
    if mon["health_probe"]:
        out.update(_blackbox_files(resolved, p, header))
    if mon["grafana"]["enabled"]:
        out.update(_grafana_files(resolved, p, header, listen))
    return out
