"""`down` (vllm_fleet.deploys.down.remove_deployment: the roles with present=False) from the host's
rendered files, the commands that remove one deployment; another deployment's files are left
alone; a second run changes nothing.
What is on the host comes from the one state read (HostState, scripted as host_state.sh prints it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from pyinfra.api import deploy
from pyinfra.facts.files import Directory, File
from pyinfra.facts.systemd import SystemdEnabled, SystemdStatus

from vllm_fleet.render import files as render
from vllm_fleet.host.state import HostState
from vllm_fleet.roles.common.state import StateUnknown
from vllm_fleet.deploys.down import remove_deployment
from vllm_fleet.roles.common.remove import mine, removal_query
from vllm_fleet.specs.load import load_and_check
from vllm_fleet.render.files import deployment_paths

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fleetutil import host_state  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def replicas():
    """lab-tiny-replicas on lab1 (server + proxy) and lab2 (a replica behind it): firewall, nginx site."""
    resolved, _ = load_and_check(REPO / "deployments" / "lab-tiny-replicas.yaml", hardware=False)
    inv = {
        "lab1": {"address": "10.10.0.11", "groups": ["servers", "proxy"], "data": {}},
        "lab2": {"address": "10.10.0.12", "groups": ["servers"], "data": {}},
    }
    return resolved, render.render(resolved, inv)


def _facts(on_host: dict[str, str], nginx_active: bool = True, dirs: list[str] = (), complete: bool = True):
    """A host holding ``on_host`` ({path: text}): the state read, and the facts pyinfra's own
    remove and stop operations read."""
    present = {p: {"mode": 644, "user": "root", "group": "root", "size": 1} for p in on_host}
    units = {Path(p).name: True for p in on_host if p.startswith("/etc/systemd/system/")}
    nginx = {"ActiveState": "active" if nginx_active else "inactive", "UnitFileState": "enabled"}
    return {
        **host_state(on_host, units={"nginx.service": nginx}, complete=complete),
        File: lambda path=None: present.get(path),
        Directory: lambda path=None: {"mode": 755} if path in dirs else None,
        SystemdStatus: {**units, "nginx.service": nginx_active},
        SystemdEnabled: units,
    }


def _texts(files: dict) -> dict[str, str]:
    return {p: f.content for p, f in files.items()}


def test_removes_units_files_site_and_firewall_of_this_deployment(harness, replicas):
    spec, rendered = replicas
    files = rendered["lab1"]
    owned = sorted(files)
    assert {"/etc/vllm-fleet/api-firewall.nft", "/etc/systemd/system/vllm-fleet-api-firewall.service"} <= set(owned)
    stamp = "/etc/vllm-fleet/lab-tiny-replicas/replica-0.applied"  # written by the service role, not rendered
    run = harness.run(
        remove_deployment,
        spec=spec,
        where=deployment_paths(spec),
        rendered=files,
        facts=_facts({**_texts(files), stamp: "x"}),
    )
    units = [p for p in owned if p.startswith("/etc/systemd/system/")]
    assert {Path(u).name for u in units} == {
        "vllm-lab-tiny-replicas-0.service",
        "vllm-fleet-api-firewall.service",
    }  # names from the files
    for u in units:  # stopped and disabled before their files go
        op = run.op(f"Stop and disable {Path(u).name}")
        assert any("systemctl stop" in c for c in op.commands) and any("systemctl disable" in c for c in op.commands)
        assert run.index(f"systemctl stop {Path(u).name}") < run.index(f"rm -f {u}")
    for p in owned:
        assert f"rm -f {p}" in run.commands
    # the service role's record of the instance's configuration goes too (the config dir can go)
    assert f"rm -f {stamp}" in run.commands
    assert run.index("rm -f /etc/systemd/system/vllm-lab-tiny-replicas-0.service") < run.index(
        "systemctl daemon-reload"
    )
    assert "nft delete table inet vllm_fleet_api" in " ".join(run.commands)
    site = "/etc/nginx/conf.d/vllm-fleet-lab-tiny-replicas.conf"
    assert run.index(f"rm -f {site}") < run.index("nginx -t") < run.index("systemctl reload nginx")
    assert run.op("nginx -t").conditional and run.op("Reload nginx").conditional
    assert not any("/opt/vllm-fleet" in c or "/var/lib/vllm-fleet" in c for c in run.commands)  # env and weights stay
    # what was on the host came from one state read (no command fact, no systemctl is-active)
    assert [n for n, _ in run.asked].count("HostState") == 1 and "Command" not in [n for n, _ in run.asked], run.asked


def test_install_time_wheels_go_the_environment_stays(harness, replicas):
    """Wheels uploaded for an install (vLLM's wheelhouse and find-links, uv's cache, the router's
    wheels) are removed by `down`; the environments stay (without --purge)."""
    spec, rendered = replicas
    prefix = spec["install"]["prefix"]
    install_time = [f"{prefix}/wheelhouse", f"{prefix}/find-links", f"{prefix}/uv-cache", f"{prefix}/router-wheels"]
    run = harness.run(
        remove_deployment,
        spec=spec,
        where=deployment_paths(spec),
        rendered=rendered["lab1"],
        facts=_facts(_texts(rendered["lab1"]), dirs=[*install_time, f"{prefix}/env", f"{prefix}/router"]),
    )
    for d in install_time:
        assert f"rm -rf {d}" in run.commands, (d, run.commands)
    assert not any(
        c.startswith("rm -rf") and c.split()[-1] in (f"{prefix}/env", f"{prefix}/router") for c in run.commands
    )


def test_nginx_not_running_is_validated_not_reloaded(harness, replicas):
    spec, rendered = replicas
    run = harness.run(
        remove_deployment,
        spec=spec,
        where=deployment_paths(spec),
        rendered=rendered["lab1"],
        facts=_facts(_texts(rendered["lab1"]), nginx_active=False),
    )
    assert run.has_op("nginx -t") and not run.has_op("Reload nginx")


def test_nothing_of_it_left_is_a_no_op(harness, replicas):
    spec, rendered = replicas
    run = harness.run(
        remove_deployment, spec=spec, where=deployment_paths(spec), rendered=rendered["lab1"], facts=_facts({})
    )
    assert not run.changed, run


def test_a_read_that_did_not_complete_removes_nothing(harness, replicas):
    """The state read stopped before its end: which files are the deployment's is not known, so
    the host stops with StateUnknown (naming it and how to retry) instead of removing on a guess."""
    spec, rendered = replicas
    with pytest.raises(
        StateUnknown, match="host lab1: the read of this host's state did not complete.*run the command again"
    ):
        harness.run(
            remove_deployment,
            spec=spec,
            where=deployment_paths(spec),
            rendered=rendered["lab1"],
            facts=_facts(_texts(rendered["lab1"]), complete=False),
            host="lab1",
        )


def test_another_deployments_files_are_left_alone(harness, replicas):
    """Which files are this deployment's is decided from the read: they name it, or lie in its
    own directories; a shared path (the firewall rules, a package's defaults) without the marker,
    another deployment's unit of a longer name are not."""
    spec, rendered = replicas
    files = _texts(rendered["lab2"])
    other = "# Rendered by vllm-fleet for deployment lab-tiny-replicas-x: edit the spec\n"
    files["/etc/vllm-fleet/api-firewall.nft"] = other
    files["/etc/systemd/system/vllm-fleet-api-firewall.service"] = other
    files["/etc/systemd/system/vllm-lab-tiny-replicas-x-0.service"] = other
    run = harness.run(
        remove_deployment, spec=spec, where=deployment_paths(spec), rendered=rendered["lab2"], facts=_facts(files)
    )
    assert "rm -f /etc/systemd/system/vllm-lab-tiny-replicas-0.service" in run.commands
    assert "rm -f /etc/vllm-fleet/lab-tiny-replicas/vllm.env" in run.commands
    assert not [c for c in run.commands if "firewall" in c or "lab-tiny-replicas-x" in c], run.commands


def test_which_files_are_its_own_on_a_real_directory(tmp_path, replicas):
    """host_state.sh run here on stand-in files (ours and other deployments' side by side), read
    as remove_deployment reads it: a file outside the deployment's directories is its own only
    when its text names it, and `lab-tiny` does not take `lab-tiny-replicas`'s files or back."""
    import subprocess

    from vllm_fleet.host.state import Snapshot

    spec, _ = replicas
    ours = tmp_path / "ours.conf"
    ours.write_text("# Rendered by vllm-fleet for deployment lab-tiny-replicas: edit the spec\n")
    theirs = tmp_path / "theirs.conf"
    theirs.write_text("# Rendered by vllm-fleet for deployment other: edit the spec\n")
    prefix_clash = tmp_path / "prefix.conf"  # `lab-tiny` must not match `lab-tiny-replicas`'s files or vice versa
    prefix_clash.write_text("# Rendered by vllm-fleet for deployment lab-tiny: edit the spec\n")
    paths = [str(ours), str(theirs), str(prefix_clash), str(tmp_path / "gone")]

    def owned(spec_):
        q = removal_query(spec_, render.deployment_paths(spec_), paths)
        assert set(q.read) == set(paths) and not q.stat  # none in its own directories: their text decides
        out = subprocess.run(
            ["sh", "-c", HostState().command(q).get_raw_value()], capture_output=True, text=True, timeout=60
        )
        snap = Snapshot.parse(out.stdout.splitlines())
        snap.query = q
        return [x for x in paths if mine(spec_, render.deployment_paths(spec_), x, snap)]

    assert owned(spec) == [str(ours)]
    assert owned({**spec, "name": "lab-tiny"}) == [str(prefix_clash)]


def test_purge_removes_environment_weights_and_config(harness, replicas):
    spec, rendered = replicas
    ins = spec["install"]
    dirs = [ins["prefix"], ins["state_dir"], ins["config_dir"]]
    run = harness.run(
        remove_deployment,
        spec=spec,
        where=deployment_paths(spec),
        rendered=rendered["lab2"],
        facts=_facts({}, dirs=dirs),
        data={"vllm_fleet_purge": True},
    )
    for d in dirs:
        assert f"rm -rf {d}" in run.commands


def test_exporters_whose_configuration_was_this_deployments_are_stopped(harness):
    """lab-tiny-monitoring on one host: Prometheus, blackbox and node exporter configs are its own
    (they name it), so they go and the services that read them are stopped and disabled."""
    resolved, _ = load_and_check(REPO / "deployments" / "lab-tiny-monitoring.yaml", hardware=False)
    inv = {"lab1": {"address": "10.10.0.11", "groups": ["servers", "proxy", "monitoring"], "data": {}}}
    files = render.render(resolved, inv)["lab1"]
    facts = _facts(_texts(files))
    facts[SystemdStatus] = {
        **facts[SystemdStatus],
        "prometheus.service": True,
        "prometheus-node-exporter.service": True,
        "prometheus-blackbox-exporter.service": True,
    }
    facts[SystemdEnabled] = dict(facts[SystemdStatus])
    run = harness.run(remove_deployment, spec=resolved, where=deployment_paths(resolved), rendered=files, facts=facts)
    for service in ("prometheus", "prometheus-node-exporter", "prometheus-blackbox-exporter"):
        assert (
            f"systemctl stop {service}.service" in run.commands
            and f"systemctl disable {service}.service" in run.commands
        )
    assert (
        "rm -f /etc/prometheus/prometheus.yml" in run.commands
        and "rm -f /etc/default/prometheus-node-exporter" in run.commands
    )


def _snap(files: dict[str, str], query):
    """The state read of ``query`` on a host holding ``files`` ({path: text}), parsed as the deploy parses it."""
    snap = host_state(files)[HostState](query)
    snap.query = query
    return snap


def test_leftovers_are_what_the_layout_no_longer_gives_the_host(replicas):
    """serve's leftovers (issue 22): lab2 dropped from the deployment keeps nothing of it; lab1
    still its proxy keeps its site, TLS files and router unit out of the list; a converged host
    has none. Only files the read shows as the deployment's."""
    from vllm_fleet.roles.common import clash
    from vllm_fleet.roles.common.remove import leftover_query, leftovers

    resolved, rendered = replicas
    lab1, lab2_had = dict(rendered["lab1"]), sorted(rendered["lab2"])
    assert (
        "/etc/systemd/system/vllm-lab-tiny-replicas-0.service" in lab2_had
        and "/etc/vllm-fleet/api-firewall.nft" in lab2_had
    )
    envs = clash.REPLICA_ENVS  # the default config_dir: the glob the clash check reads anyway
    # lab2, no part of the layout any more: everything of the deployment that is there
    where = render.deployment_paths(resolved)
    q = leftover_query(resolved, where, None, {})
    assert set(q.globs) == {clash.UNITS, envs}
    units = [p for p in lab2_had if p.startswith("/etc/systemd/system/vllm-lab-tiny-replicas-")]
    on_lab2 = {p: rendered["lab2"][p].content for p in lab2_had}
    # not this deployment's: a package's own defaults file (no marker), another deployment's unit
    on_lab2["/etc/default/prometheus-node-exporter"] = 'ARGS=""\n'
    on_lab2["/etc/systemd/system/vllm-lab-tiny-replicas-x-0.service"] = (
        "# Rendered by vllm-fleet for deployment lab-tiny-replicas-x: ...\n"
    )
    on_lab2["/etc/vllm-fleet/other/replica-0.env"] = "# Rendered by vllm-fleet for deployment other: ...\n"
    snap = _snap(on_lab2, q)
    assert set(snap.matching(clash.UNITS)) == {
        *units,
        "/etc/systemd/system/vllm-fleet-api-firewall.service",
        "/etc/systemd/system/vllm-lab-tiny-replicas-x-0.service",
    }
    assert leftovers(resolved, where, None, {}, snap) == sorted(
        lab2_had
    )  # not the package's file, not the other deployment's unit
    assert (
        render.paths(resolved)["tls_certificate_key"] in q.stat
        and render.paths(resolved)["tls_certificate_key"] not in q.read
    )

    # lab1 converged: nothing (its own files are rendered for it, the TLS files and router unit are the roles')
    class Node:
        roles, instances = {"server", "proxy"}, [object()]

    q1 = leftover_query(resolved, where, Node(), lab1)
    assert not set(q1.stat) & set(lab1)
    assert render.paths(resolved)["tls_certificate"] not in q1.stat
    snap1 = _snap(_texts(lab1), q1)
    assert leftovers(resolved, where, Node(), lab1, snap1) == []
    # not read (no snapshot): nothing is known, nothing listed
    from vllm_fleet.host.state import Snapshot

    assert leftovers(resolved, where, None, {}, Snapshot()) == []


def test_pruning_on_serve_takes_what_it_removes_from_the_deploys_one_read(harness, replicas):
    """serve's pruning: the deploy's one read (leftover_query) already holds what remove_deployment
    asks (removal_query of the leftovers: their stat or text, the units' glob, nginx's unit), so
    removing the leftovers of lab2, dropped from the deployment, adds no command."""
    from vllm_fleet.roles.common.state import load_host_state
    from vllm_fleet.roles.common.remove import leftover_query, leftovers

    spec, rendered = replicas

    @deploy("serve's pruning")
    def prune():
        where = render.deployment_paths(spec)
        snap = load_host_state(leftover_query(spec, where, None, {}))  # the deploy's one read (deploys/serve.py)
        remove_deployment(spec=spec, where=where, rendered={}, paths=leftovers(spec, where, None, {}, snap))

    run = harness.run(prune, facts=_facts(_texts(rendered["lab2"])))
    assert "rm -f /etc/systemd/system/vllm-lab-tiny-replicas-0.service" in run.commands
    assert "rm -f /etc/vllm-fleet/lab-tiny-replicas/replica-0.env" in run.commands
    assert [n for n, _ in run.asked].count("HostState") == 1 and "Command" not in [n for n, _ in run.asked], run.asked


def test_each_role_removes_its_own_part_and_down_goes_in_reverse_order(harness, replicas):
    """`down` is the roles with present=False: the nginx site goes (and nginx reloads) before the
    vLLM units stop, so the proxy stops sending to them first; the Ray role is not called on a
    host without Ray files."""
    spec, rendered = replicas
    files = rendered["lab1"]
    run = harness.run(
        remove_deployment, spec=spec, where=deployment_paths(spec), rendered=files, facts=_facts(_texts(files))
    )
    site = render.paths(spec)["nginx_site"]
    reload_at = run.commands.index("systemctl reload nginx.service")
    assert (
        run.commands.index(f"rm -f {site}")
        < reload_at
        < run.commands.index("systemctl stop vllm-lab-tiny-replicas-0.service")
    )
    assert not [c for c in run.commands if "ray" in c.split(" ")[-1]], run.commands


def test_the_router_role_removes_its_unit_when_routing_is_no_longer_cache_aware(harness):
    """serve on a proxy whose policy is no longer cache_aware: install_router(present=False) stops,
    disables and removes the router unit the host holds for this deployment, and leaves one that
    names another deployment; with no unit there it sends nothing."""
    from vllm_fleet.roles.router import install_router

    resolved, _ = load_and_check(REPO / "deployments" / "lab-tiny-routing.yaml", hardware=False)
    inv = {"lab1": {"address": "10.10.0.11", "groups": ["servers", "proxy"], "data": {}}}
    files = render.render(
        {
            **resolved,
            "proxy": {**resolved["proxy"], "routing": {**resolved["proxy"]["routing"], "policy": "round_robin"}},
        },
        inv,
    )["lab1"]
    unit = render.paths(resolved)["router_unit"]
    assert unit not in files
    ours = f"# Rendered by vllm-fleet for deployment {resolved['name']}: edit the spec\n[Unit]\n"
    run = harness.run(
        install_router,
        spec=resolved,
        where=deployment_paths(resolved),
        rendered=files,
        present=False,
        facts=_facts({unit: ours}),
    )
    name = Path(unit).name
    assert f"systemctl stop {name}" in run.commands and f"systemctl disable {name}" in run.commands
    assert f"rm -f {unit}" in run.commands and "systemctl daemon-reload" in run.commands
    theirs = "# Rendered by vllm-fleet for deployment other: edit the spec\n"
    assert (
        harness.run(
            install_router,
            spec=resolved,
            where=deployment_paths(resolved),
            rendered=files,
            present=False,
            facts=_facts({unit: theirs}),
        ).commands
        == []
    )
    assert (
        harness.run(
            install_router,
            spec=resolved,
            where=deployment_paths(resolved),
            rendered=files,
            present=False,
            facts=_facts({}),
        ).commands
        == []
    )


def test_the_model_stamp_goes_the_weights_stay_and_the_config_dir_is_left_empty(harness, replicas):
    """The stamp of the verified weights (model.stamp, root's, in install.config_dir) goes with the
    deployment's config files, so `down` leaves no config directory behind (the host's footprint as
    before the deploy); the weights themselves stay without --purge."""
    spec, rendered = replicas
    cfg = spec["install"]["config_dir"]
    stamp = f"{cfg}/model.stamp"
    run = harness.run(
        remove_deployment,
        spec=spec,
        where=deployment_paths(spec),
        rendered=rendered["lab1"],
        facts=_facts({**_texts(rendered["lab1"]), stamp: "x"}, dirs=[spec["model"]["path"]]),
    )
    op = run.op(f"Remove {cfg} if empty")
    assert op.commands == [f"rm -f {stamp}", f"rmdir --ignore-fail-on-non-empty {cfg}"], op.commands
    assert not any(c.startswith("rm -rf") and c.split()[-1] == spec["model"]["path"] for c in run.commands)
