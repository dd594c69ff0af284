"""roles/router: where vllm-router's wheels come from (roles.common.wheels' order, the vllm
role's: install.wheelhouse, else the fleet wheelhouse, else the host's index), through the pip
command the role would send."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

import vllm_fleet.fetch.wheelhouse as wh
from vllm_fleet.render import files as render
from vllm_fleet.roles.router import install_router
from vllm_fleet.specs import load as spec_load
from vllm_fleet.render.files import deployment_paths

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fleetutil import env_state  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
INV = {"lab1": {"address": "10.10.0.11", "groups": ["servers", "proxy"], "data": {}}}


def _run(harness, monkeypatch, tmp_path, data=None, **install):
    spec = spec_load.resolve(spec_load.load(REPO / "deployments" / "lab-tiny-routing.yaml"))
    spec["install"].update(install)
    house = tmp_path / "wheelhouse" / "k3y"
    house.mkdir(parents=True, exist_ok=True)
    ensured = []
    monkeypatch.setattr(wh, "ensure", lambda reqs, target, **kw: ensured.append(reqs) or house)
    monkeypatch.setattr(wh, "serve", lambda directory, address: (4242, "tok3n"))
    run = harness.run(
        install_router,
        spec,
        deployment_paths(spec),
        render.render(spec, INV)["lab1"],
        data=data or {},
        facts=env_state(target={"python": "3.11", "glibc": "2.36", "machine": "x86_64"}),
    )
    pip = next(shlex.split(c) for c in run.commands if " -m pip install " in c)
    return spec, run, pip, ensured


def _source(pip: list[str]) -> list[str]:
    return pip[pip.index("--timeout") + 2 : -1]  # between pip's own flags and the requirement


def test_fleet_wheels_over_http(harness, monkeypatch, tmp_path):
    """Served: fetched into the router's wheels dir, each wheel checked against the sha256 the
    list (put over SSH) names, then installed from there with --no-index (no URL in pip's argv)."""
    import json

    spec, run, pip, ensured = _run(
        harness, monkeypatch, tmp_path, data={"vllm_wheel_serve_address": "10.10.0.1"}, wheels="fleet"
    )
    assert ensured == [[f"vllm-router=={spec['proxy']['routing']['router']['version']}"]] and not run.has_op(
        "wheels to"
    )  # fetched over HTTP
    dest = render.paths(spec)["router_env"] + "-wheels"
    assert json.loads(run.uploads[f"{dest}.fetch.json"])["sources"] == ["http://10.10.0.1:4242/tok3n/"]
    op = run.op(f"pip install vllm-router=={spec['proxy']['routing']['router']['version']}")
    fetch = shlex.split(op.commands[0])
    assert fetch[0] == "python3" and fetch[-2:] == [f"{dest}.fetch.json", dest]
    assert _source(pip) == ["--no-index", "--find-links", dest]
    assert op.commands[-1] == f"rm -rf {dest}"  # install-time only, as when uploaded


@pytest.mark.parametrize("how", ["wheelhouse", "fleet"])
def test_uploaded_wheels(harness, monkeypatch, tmp_path, how):
    install = {"wheelhouse": str(tmp_path)} if how == "wheelhouse" else {"wheels": "fleet"}
    spec, run, pip, _ = _run(harness, monkeypatch, tmp_path, **install)
    dest = render.paths(spec)["router_env"] + "-wheels"
    what = "wheelhouse" if how == "wheelhouse" else "router's wheels"
    assert run.has_op(f"Upload the {what} to {dest}")
    assert _source(pip) == ["--no-index", "--find-links", dest]
    # install-time only: removed once vllm-router answers --help, as the vllm role's wheelhouse
    op = run.op(f"pip install vllm-router=={spec['proxy']['routing']['router']['version']}")
    assert op.commands[-1] == f"rm -rf {dest}" and "vllm-router --help" in op.commands[-2], op.commands


def test_uploaded_or_fetched_wheels_kept_when_asked(harness, monkeypatch, tmp_path):
    spec, run, _, _ = _run(
        harness, monkeypatch, tmp_path, data={"vllm_keep_wheelhouse": True}, wheelhouse=str(tmp_path)
    )
    assert not any(c.startswith("rm -rf") for c in run.commands), run.commands
    spec, run, _, _ = _run(
        harness,
        monkeypatch,
        tmp_path,
        data={"vllm_wheel_serve_address": "10.10.0.1", "vllm_keep_wheelhouse": True},
        wheels="fleet",
    )
    assert not any(c.startswith("rm -rf") for c in run.commands), run.commands


def test_the_hosts_index(harness, monkeypatch, tmp_path):
    _, run, pip, ensured = _run(harness, monkeypatch, tmp_path, wheels="host", index_url="https://pypi.example/simple")
    assert not ensured and _source(pip) == ["--index-url", "https://pypi.example/simple"]


def test_the_target_comes_from_the_state_read(harness, monkeypatch, tmp_path):
    """The router's fleet wheels are downloaded for the host's python3, C library and machine
    as the state read gives them (one read of them when the role runs on its own; no fact of
    their own); a read that did not complete downloads nothing."""
    from vllm_fleet.host.state import HostState, Snapshot
    from vllm_fleet.roles.common.state import StateUnknown

    _, run, _, ensured = _run(harness, monkeypatch, tmp_path, wheels="fleet")
    assert ensured and "PythonTarget" not in {n for n, _ in run.asked}, run.asked
    assert [kw["query"].targets for n, kw in run.asked if n == "HostState" and kw["query"].targets] == [("python3",)]
    spec = spec_load.resolve(spec_load.load(REPO / "deployments" / "lab-tiny-routing.yaml"))
    spec["install"]["wheels"] = "fleet"
    monkeypatch.setattr(wh, "ensure", lambda *a, **kw: pytest.fail("downloaded on a guess"))
    with pytest.raises(
        StateUnknown,
        match="host testhost: the read of this host's state did not complete, so which "
        "Python, C library and machine the fleet wheelhouse must fit is not known",
    ):
        harness.run(
            install_router,
            spec,
            deployment_paths(spec),
            render.render(spec, INV)["lab1"],
            facts={HostState: lambda query: Snapshot.parse(["target\tpython3\tmachine=x86_64"])},
        )


def test_the_serve_deploys_one_read_asks_the_target_once_for_vllm_and_the_router(harness):
    import copy

    from pyinfra.api import deploy

    from vllm_fleet.deploys.serve import state_query
    from vllm_fleet.render.layout import build
    from vllm_fleet.roles import router, vllm
    from vllm_fleet.roles.common import DeployContext

    spec = spec_load.resolve(spec_load.load(REPO / "deployments" / "lab-tiny-routing.yaml"))
    spec["install"]["wheels"] = "fleet"
    layout = build([spec], copy.deepcopy(INV))
    h = layout.hosts["lab1"]
    assert {"router", "proxy"} <= h.parts[spec["name"]].roles and h.parts[spec["name"]].instances
    got = {}

    @deploy("serve's query")
    def serve_query():
        got["serve"] = state_query(DeployContext(layout, {spec["name"]: spec}, {}, {}, ""), h)
        got["vllm"], got["router"] = (
            vllm.state_query(spec, layout.paths[spec["name"]]),
            router.state_query(spec, layout.paths[spec["name"]], h.files),
        )

    harness.run(serve_query)
    assert got["vllm"].targets == got["router"].targets == got["serve"].targets == ("python3",)
