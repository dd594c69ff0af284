"""vllm_fleet/roles/monitoring through the commands it would send (scripted facts): Debian's exporters and
Prometheus with their listen addresses placed before the packages start them, promtool before
every reload, and on GPU hosts NVIDIA's DCGM + dcgm-exporter (no GPU here: the commands only).
What is on the host comes from the one state read (HostState, scripted as host_state.sh prints it)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
from pyinfra.api.exceptions import PyinfraError

from vllm_fleet.host.state import HostState

from vllm_fleet.roles.common.state import StateUnknown
from vllm_fleet.roles.monitoring import install_monitoring, state_query
from vllm_fleet.render import monitoring
from vllm_fleet.render import files as render
from vllm_fleet.specs.load import load, resolve
from vllm_fleet.render.files import deployment_paths

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fleetutil import host_state  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LAB = {
    "testhost": {
        "address": "10.10.0.11",
        "groups": ["servers", "proxy", "monitoring"],
        "data": {"private_address": "10.10.0.11"},
    }
}
GPU2 = {
    "testhost": {"address": "10.10.0.11", "groups": ["servers"], "data": {}},
    "gpu-b": {"address": "10.10.0.12", "groups": ["workers"], "data": {}},
    "edge": {"address": "10.10.0.5", "groups": ["proxy", "monitoring"], "data": {}},
}


def spec_of(name: str, **mon) -> dict:
    spec = copy.deepcopy(resolve(load(REPO / "deployments" / name)))
    spec["install"].pop("wheelhouse", None)
    spec["monitoring"]["enabled"] = True
    spec["monitoring"].update(mon)
    return spec


def run(harness, spec, inventory, facts=None, data=None, host="testhost"):
    rendered = render.render(spec, copy.deepcopy(inventory))[host]
    f = host_state()  # a host with nothing of it (the read completed)
    f.update(facts or {})
    return harness.run(
        install_monitoring, spec=spec, where=deployment_paths(spec), rendered=rendered, facts=f, data=data or {}
    ), rendered


def uploaded(r, path: str) -> str:
    """The text uploaded for path (atomic puts upload to PATH.tmp-vllm-fleet, then rename)."""
    for dest in (path, f"{path}.tmp-vllm-fleet"):
        if dest in r.uploads:
            return r.uploads[dest]
    raise AssertionError(f"nothing uploaded for {path}: {sorted(r.uploads)}")


def installs(r) -> list[str]:
    return [c for c in r.commands if "apt-get" in c and " install " in c]


def test_lab_host_listen_addresses_first_then_packages_then_promtool(harness):
    running = {f"{u}.service": True for u in ("prometheus", "prometheus-node-exporter", "prometheus-blackbox-exporter")}
    r, rendered = run(harness, spec_of("lab-tiny-monitoring.yaml"), LAB, facts={"SystemdStatus": running})
    p = monitoring.paths(spec_of("lab-tiny-monitoring.yaml"))
    # the exporters' and Prometheus' /etc/default files land before the package that starts them
    assert r.index(f"upload:{p['node_exporter_defaults']}") < r.index(
        "install --no-install-recommends prometheus-node-exporter"
    )
    assert r.index(f"upload:{p['prometheus_defaults']}") < r.index("install --no-install-recommends prometheus")
    assert r.index(f"upload:{p['blackbox_defaults']}") < r.index(
        "install --no-install-recommends prometheus prometheus-blackbox-exporter"
    )
    # the prober's config too: its arguments name it, and the package starts it at install time
    assert r.index(f"upload:{p['blackbox_config']}") < r.index(
        "install --no-install-recommends prometheus prometheus-blackbox-exporter"
    )
    assert "--web.listen-address=10.10.0.11:9100" in uploaded(r, p["node_exporter_defaults"])
    assert "--web.listen-address=10.10.0.11:9090" in uploaded(r, p["prometheus_defaults"])
    assert "--web.listen-address=127.0.0.1:9115" in uploaded(r, p["blackbox_defaults"])
    assert all("0.0.0.0" not in text for text in r.uploads.values())
    # the directories atomic puts need exist first (/etc/prometheus before its package)
    assert r.index("mkdir -p /etc/prometheus") < r.index("upload:/etc/prometheus/vllm-fleet-blackbox.yml")
    # promtool validates before the reload; both only when something changed
    check = r.op("promtool check config")
    assert check.conditional and check.commands == ["promtool check config /etc/prometheus/prometheus.yml"]
    assert r.index("promtool check config") < r.index("systemctl reload prometheus")
    assert r.op("Reload Prometheus").conditional and r.op("Restart Prometheus").conditional
    for unit in ("prometheus", "prometheus-node-exporter", "prometheus-blackbox-exporter"):
        assert f"systemctl enable {unit}.service" in r.commands
    assert not r.has_op("dcgm")  # a CPU host


SERVICES = ("prometheus", "prometheus-node-exporter", "prometheus-blackbox-exporter")


def test_second_run_changes_nothing(harness):
    """A converged monitoring host (the state read shows every file with its owner and mode, the
    directories, the packages, the services active and enabled): no operation at all (not even
    a conditional restart: pyinfra's systemd.service would read SystemdStatus while planning)
    and no fact but the one state read."""
    spec = spec_of("lab-tiny-monitoring.yaml")
    rendered = render.render(spec, copy.deepcopy(LAB))["testhost"]
    files = {path: (f.content, f.owner, f.group, f.mode) for path, f in rendered.items()}
    dirs = {str(Path(p).parent): ("root", "root", 0o755) for p in rendered}
    units = {f"{u}.service": {"ActiveState": "active", "UnitFileState": "enabled"} for u in SERVICES}
    r = harness.run(
        install_monitoring,
        spec=spec,
        where=deployment_paths(spec),
        rendered=rendered,
        facts=host_state(files, dirs, units, debs=SERVICES),
    )
    assert r.ops == [], r
    assert [n for n, _ in r.asked] == ["HostState"], r.asked


def test_the_serve_deploys_one_read_holds_what_the_role_compares(harness):
    """deploys/serve.py's one query holds install_monitoring's (the files, packages, services,
    Grafana's unit), so the role adds no read of its own."""
    from pyinfra.api import deploy

    from vllm_fleet.deploys.serve import state_query as serve_query
    from vllm_fleet.render.layout import build
    from vllm_fleet.roles.common import DeployContext

    spec = spec_of(
        "lab-tiny-monitoring.yaml",
        grafana={"enabled": True, "dashboards_dir": "/var/lib/grafana/dashboards/vllm-fleet"},
    )
    layout = build([spec], copy.deepcopy(LAB))
    h = layout.hosts["testhost"]
    got = {}

    @deploy("serve's query")
    def queries():
        ctx = DeployContext(layout, {spec["name"]: spec}, {}, {}, "")
        got["serve"], got["role"] = serve_query(ctx, h), state_query(spec, layout.paths[spec['name']], dict(h.files))

    harness.run(queries)
    q = got["role"]
    assert monitoring.PROMETHEUS_CONFIG in q.sha and "prometheus-node-exporter" in q.debs
    assert "grafana-server.service" in q.units and "prometheus.service" in q.units
    assert not q - got["serve"], q - got["serve"]


def test_gpu_hosts_get_dcgm_and_the_exporter_on_the_private_address(harness, tmp_path):
    spec = spec_of("2node-ray-pp2.yaml")
    binary = tmp_path / "dcgm-exporter"
    binary.write_text("#!/bin/sh\n")
    r, rendered = run(harness, spec, GPU2, data={"monitoring_dcgm_exporter_binary": str(binary)})
    assert any("datacenter-gpu-manager" in c for c in installs(r))
    assert "upload:/usr/local/bin/dcgm-exporter" in r.commands
    unit = uploaded(r, monitoring.DCGM_UNIT)
    assert "--address 10.10.0.11:9400" in unit and "--collectors /etc/dcgm-exporter/vllm-fleet-counters.csv" in unit
    assert "DCGM_FI_DEV_FB_USED, gauge" in uploaded(r, monitoring.DCGM_COUNTERS)
    assert r.index("upload:/etc/systemd/system/dcgm-exporter.service") < r.index("systemctl daemon-reload")
    assert r.index("upload:/etc/dcgm-exporter/vllm-fleet-counters.csv") < r.index(
        "upload:/etc/systemd/system/dcgm-exporter.service"
    )
    assert "systemctl enable dcgm-exporter.service" in r.commands
    assert not r.has_op("Prometheus running")  # Prometheus runs on the monitoring host (edge) only


def test_gpu_host_without_a_dcgm_exporter_binary_stops_with_a_hint(harness):
    with pytest.raises(PyinfraError, match="monitoring_dcgm_exporter_binary"):
        run(harness, spec_of("2node-ray-pp2.yaml"), GPU2)


def test_gpu_host_with_dcgm_exporter_already_installed(harness):
    r, _ = run(
        harness,
        spec_of("2node-ray-pp2.yaml"),
        GPU2,
        facts=host_state({monitoring.DCGM_BINARY: ("ELF", "root", "root", 0o755)}),
    )
    assert "upload:/usr/local/bin/dcgm-exporter" not in r.commands
    assert "systemctl enable dcgm-exporter.service" in r.commands
    assert not [a for a in r.asked if a[0] == "File" and a[1].get("path") == monitoring.DCGM_BINARY], (
        r.asked
    )  # as the read saw it


def test_gpu_host_whose_read_did_not_complete_stops_without_a_guess(harness):
    """Whether dcgm-exporter is on the host is not known: StateUnknown (names the host, how to
    retry), not the "missing" hint and not a unit that would start without its binary."""
    with pytest.raises(
        StateUnknown,
        match="host testhost: the read of this host's state did not complete.*"
        "whether /usr/local/bin/dcgm-exporter is there",
    ):
        run(harness, spec_of("2node-ray-pp2.yaml"), GPU2, facts=host_state(complete=False))


def test_dcgm_off_or_cpu_means_no_dcgm(harness):
    r, _ = run(harness, spec_of("2node-ray-pp2.yaml", dcgm_exporter=False), GPU2)
    assert not r.has_op("dcgm") and not any("datacenter-gpu-manager" in c for c in r.commands)


def test_monitoring_host_of_a_gpu_fleet(harness):
    r, rendered = run(harness, spec_of("2node-ray-pp2.yaml"), GPU2, host="edge")
    cfg = uploaded(r, "/etc/prometheus/prometheus.yml")
    assert "10.10.0.11:9400" in cfg and "10.10.0.12:6384" in cfg  # DCGM and Ray metrics of the nodes
    assert not r.has_op("dcgm")  # edge has no GPU role


def test_grafana_provisioned_and_restarted_only_when_installed(harness):
    spec = spec_of(
        "lab-tiny-monitoring.yaml",
        grafana={"enabled": True, "dashboards_dir": "/var/lib/grafana/dashboards/vllm-fleet"},
    )
    installed = {"grafana-server.service": {"ActiveState": "active", "UnitFileState": "enabled"}}  # its package's unit
    r, _ = run(harness, spec, LAB, facts=host_state(units=installed))
    assert uploaded(r, "/etc/grafana/provisioning/datasources/vllm-fleet.yaml")
    assert "vllm-fleet-vllm" in uploaded(r, "/var/lib/grafana/dashboards/vllm-fleet/vllm-fleet.json")
    assert "url: http://10.10.0.11:9090" in uploaded(r, "/etc/grafana/provisioning/datasources/vllm-fleet.yaml")
    assert r.op("Restart Grafana").conditional
    r2, _ = run(harness, spec, LAB)  # Grafana not installed (no such unit): the files, no restart
    assert uploaded(r2, "/etc/grafana/provisioning/dashboards/vllm-fleet.yaml") and not r2.has_op("Restart Grafana")
    assert "Which" not in {n for n, _ in r.asked + r2.asked}
