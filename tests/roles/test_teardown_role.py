"""roles/teardown (what `vllm-fleet down` runs): from the host's rendered files, the commands that
remove one deployment; another deployment's files are left alone; a second run changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyinfra.facts.files import Directory, File
from pyinfra.facts.server import Command
from pyinfra.facts.systemd import SystemdEnabled, SystemdStatus

from vllm_fleet.render import files as render
from vllm_fleet.roles.teardown import owned_script, remove_deployment
from vllm_fleet.spec.load import load_and_check

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def replicas():
    """lab-tiny-replicas on lab1 (server + proxy) and lab2 (a replica behind it): firewall, nginx site."""
    resolved, _ = load_and_check(REPO / "deployments" / "lab-tiny-replicas.yaml", hardware=False)
    inv = {"lab1": {"address": "10.10.0.11", "groups": ["servers", "proxy"], "data": {}},
           "lab2": {"address": "10.10.0.12", "groups": ["servers"], "data": {}}}
    return resolved, render.render(resolved, inv)


def _facts(owned: list[str], nginx_active: bool = True, dirs: list[str] = ()):
    def command(_args=()):
        cmd = _args[0]
        if cmd.startswith("systemctl is-active nginx"):
            return "active" if nginx_active else "inactive"
        return "\n".join(owned)

    present = {p: {"mode": 644, "user": "root", "group": "root", "size": 1} for p in owned}
    units = {Path(p).name: True for p in owned if p.startswith("/etc/systemd/system/")}
    return {Command: command, File: lambda path=None: present.get(path),
            Directory: lambda path=None: {"mode": 755} if path in dirs else None,
            SystemdStatus: {**units, "nginx.service": nginx_active}, SystemdEnabled: units}


def test_removes_units_files_site_and_firewall_of_this_deployment(harness, replicas):
    spec, rendered = replicas
    files = rendered["lab1"]
    owned = sorted({*files, "/etc/vllm-fleet/api-firewall.nft", "/etc/systemd/system/vllm-fleet-api-firewall.service"})
    stamp = "/etc/vllm-fleet/lab-tiny-replicas/replica-0.applied"  # written by the service role, not rendered
    run = harness.run(remove_deployment, spec=spec, rendered=files, facts=_facts([*owned, stamp]))
    units = [p for p in owned if p.startswith("/etc/systemd/system/")]
    assert {Path(u).name for u in units} == {"vllm-lab-tiny-replicas-0.service", "vllm-fleet-api-firewall.service"}  # names from the files
    for u in units:  # stopped and disabled before their files go
        op = run.op(f"Stop and disable {Path(u).name}")
        assert any("systemctl stop" in c for c in op.commands) and any("systemctl disable" in c for c in op.commands)
        assert run.index(f"systemctl stop {Path(u).name}") < run.index(f"rm -f {u}")
    for p in owned:
        assert f"rm -f {p}" in run.commands
    # the service role's record of the instance's configuration goes too (the config dir can go)
    assert f"rm -f {stamp}" in run.commands
    assert run.index("rm -f /etc/systemd/system/vllm-lab-tiny-replicas-0.service") < run.index("systemctl daemon-reload")
    assert "nft delete table inet vllm_fleet_api" in " ".join(run.commands)
    site = "/etc/nginx/conf.d/vllm-fleet-lab-tiny-replicas.conf"
    assert run.index(f"rm -f {site}") < run.index("nginx -t") < run.index("systemctl reload nginx")
    assert run.op("nginx -t").conditional and run.op("Reload nginx").conditional
    assert not any("/opt/vllm-fleet" in c or "/var/lib/vllm-fleet" in c for c in run.commands)  # env and weights stay


def test_nothing_of_it_left_is_a_no_op(harness, replicas):
    spec, rendered = replicas
    run = harness.run(remove_deployment, spec=spec, rendered=rendered["lab1"], facts=_facts([]))
    assert not run.changed, run


def test_another_deployments_files_are_not_candidates_unless_they_name_this_one(replicas):
    """Which files are this deployment's is decided on the host: they name it, or lie in its own
    directories; a shared path (the firewall rules, the node exporter's defaults) is grepped."""
    spec, rendered = replicas
    script = owned_script(spec, ["/etc/vllm-fleet/api-firewall.nft", "/etc/vllm-fleet/lab-tiny-replicas/vllm.env"]).get_raw_value()
    assert "grep -qsF 'for deployment lab-tiny-replicas:' /etc/vllm-fleet/api-firewall.nft" in script
    assert "[ -f /etc/vllm-fleet/lab-tiny-replicas/vllm.env ] && echo" in script


def test_owned_script_on_a_real_directory(tmp_path, replicas):
    """The script run here on stand-in files: ours and other deployments' side by side."""
    import subprocess

    spec, _ = replicas
    ours = tmp_path / "ours.conf"
    ours.write_text("# Rendered by vllm-fleet for deployment lab-tiny-replicas: edit the spec\n")
    theirs = tmp_path / "theirs.conf"
    theirs.write_text("# Rendered by vllm-fleet for deployment other: edit the spec\n")
    prefix_clash = tmp_path / "prefix.conf"  # `lab-tiny` must not match `lab-tiny-replicas`'s files or vice versa
    prefix_clash.write_text("# Rendered by vllm-fleet for deployment lab-tiny: edit the spec\n")
    out = subprocess.run(["bash", "-c", owned_script(spec, [str(ours), str(theirs), str(prefix_clash), str(tmp_path / "gone")]).get_raw_value()],
                         capture_output=True, text=True).stdout.split()
    assert out == [str(ours)]
    short = {**spec, "name": "lab-tiny"}  # and the shorter name does not take the longer one's files
    out = subprocess.run(["bash", "-c", owned_script(short, [str(ours), str(prefix_clash)]).get_raw_value()], capture_output=True, text=True).stdout.split()
    assert out == [str(prefix_clash)]


def test_purge_removes_environment_weights_and_config(harness, replicas):
    spec, rendered = replicas
    ins = spec["install"]
    dirs = [ins["prefix"], ins["state_dir"], ins["config_dir"]]
    run = harness.run(remove_deployment, spec=spec, rendered=rendered["lab2"], facts=_facts([], dirs=dirs),
                      data={"vllm_fleet_purge": True})
    for d in dirs:
        assert f"rm -rf {d}" in run.commands


def test_exporters_whose_configuration_was_this_deployments_are_stopped(harness):
    """lab-tiny-monitoring on one host: Prometheus, blackbox and node exporter configs are its own
    (they name it), so they go and the services that read them are stopped and disabled."""
    resolved, _ = load_and_check(REPO / "deployments" / "lab-tiny-monitoring.yaml", hardware=False)
    inv = {"lab1": {"address": "10.10.0.11", "groups": ["servers", "proxy", "monitoring"], "data": {}}}
    files = render.render(resolved, inv)["lab1"]
    owned = sorted(files)
    facts = _facts(owned)
    facts[SystemdStatus] = {**facts[SystemdStatus], "prometheus.service": True, "prometheus-node-exporter.service": True,
                            "prometheus-blackbox-exporter.service": True}
    facts[SystemdEnabled] = dict(facts[SystemdStatus])
    run = harness.run(remove_deployment, spec=resolved, rendered=files, facts=facts)
    for service in ("prometheus", "prometheus-node-exporter", "prometheus-blackbox-exporter"):
        assert f"systemctl stop {service}.service" in run.commands and f"systemctl disable {service}.service" in run.commands
    assert "rm -f /etc/prometheus/prometheus.yml" in run.commands and "rm -f /etc/default/prometheus-node-exporter" in run.commands


def _snap(files: dict[str, str], query, globs: dict[str, list[str]]):
    """A state read of a host holding ``files`` ({path: text}): host_state.sh's output lines for
    the query's stat, read and glob entries, parsed as the deploy parses them."""
    import base64

    from vllm_fleet.roles.common.state import Snapshot

    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    lines = [f"stat\t{p}\t" + ("regular file\troot\troot\t644\t10" if p in files else "-") for p in query.stat]
    lines += [f"read\t{p}\t" + (b64(files[p]) if p in files else "-") for p in query.read]
    for g, paths in globs.items():
        lines.append(f"glob\t{g}\t.")
        lines += [f"glob\t{g}\t{p}\t{b64(files.get(p, 'x'))}" for p in paths]
    snap = Snapshot.parse([*lines, "end"])
    snap.query = query
    return snap


def test_leftovers_are_what_the_layout_no_longer_gives_the_host(replicas):
    """serve's leftovers (issue 22): lab2 dropped from the deployment keeps nothing of it; lab1
    still its proxy keeps its site, TLS files and router unit out of the list; a converged host
    has none. Paths only: whether each names the deployment is checked on the host at removal."""
    from vllm_fleet.roles.common import clash
    from vllm_fleet.roles.teardown import leftover_query, leftovers

    resolved, rendered = replicas
    lab1, lab2_had = dict(rendered["lab1"]), sorted(rendered["lab2"])
    assert "/etc/systemd/system/vllm-lab-tiny-replicas-0.service" in lab2_had and "/etc/vllm-fleet/api-firewall.nft" in lab2_had
    envs = clash.REPLICA_ENVS  # the default config_dir: the glob the clash check reads anyway
    # lab2, no part of the layout any more: everything of the deployment that is there
    q = leftover_query(resolved, None, {})
    assert set(q.globs) == {clash.UNITS, envs}
    units = [p for p in lab2_had if p.startswith("/etc/systemd/system/vllm-lab-tiny-replicas-")]
    on_lab2 = {p: rendered["lab2"][p].content for p in lab2_had}
    # not this deployment's: a package's own defaults file (no marker), another deployment's unit
    on_lab2["/etc/default/prometheus-node-exporter"] = 'ARGS=""\n'
    on_lab2["/etc/systemd/system/vllm-lab-tiny-replicas-x-0.service"] = "# Rendered by vllm-fleet for deployment lab-tiny-replicas-x: ...\n"
    snap = _snap(on_lab2, q, {clash.UNITS: [*units, "/etc/systemd/system/vllm-lab-tiny-replicas-x-0.service"],
                              envs: [*(p for p in lab2_had if "/replica-" in p), "/etc/vllm-fleet/other/replica-0.env"]})
    assert leftovers(resolved, None, {}, snap) == sorted(lab2_had)  # not the package's file, not the other deployment's unit
    assert render.paths(resolved)["tls_certificate_key"] in q.stat and render.paths(resolved)["tls_certificate_key"] not in q.read
    # lab1 converged: nothing (its own files are rendered for it, the TLS files and router unit are the roles')
    class Node:
        roles, instances = {"server", "proxy"}, [object()]

    q1 = leftover_query(resolved, Node(), lab1)
    assert not set(q1.stat) & set(lab1)
    assert render.paths(resolved)["tls_certificate"] not in q1.stat
    snap1 = _snap({}, q1, {clash.UNITS: [p for p in lab1 if p.startswith("/etc/systemd/system/vllm-")], envs: []})
    assert leftovers(resolved, Node(), lab1, snap1) == []
    # not read (no snapshot): nothing is known, nothing listed
    from vllm_fleet.roles.common.state import Snapshot

    assert leftovers(resolved, None, {}, Snapshot()) == []
