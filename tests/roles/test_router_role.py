"""roles/router: where vllm-router's wheels come from (roles.common.wheels' order, the vllm
role's: install.wheelhouse, else the fleet wheelhouse, else the host's index), through the pip
command the role would send."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

import vllm_fleet.fetch.wheelhouse as wh
from vllm_fleet.render import files as render
from vllm_fleet.roles.router import install_router
from vllm_fleet.roles.vllm.facts import PythonTarget
from vllm_fleet.spec import load as spec_load

REPO = Path(__file__).resolve().parents[2]
INV = {"lab1": {"address": "10.10.0.11", "groups": ["servers", "proxy"], "data": {}}}


def _run(harness, monkeypatch, tmp_path, data=None, **install):
    spec = spec_load.resolve(spec_load.load(REPO / "deployments" / "lab-tiny-routing.yaml"))
    spec["install"].update(install)
    house = tmp_path / "wheelhouse" / "k3y"
    house.mkdir(parents=True, exist_ok=True)
    ensured = []
    monkeypatch.setattr(wh, "ensure", lambda reqs, target, **kw: ensured.append(reqs) or house)
    monkeypatch.setattr(wh, "serve", lambda directory, address: 4242)
    run = harness.run(install_router, spec, render.render(spec, INV)["lab1"], data=data or {},
                      facts={PythonTarget: {"python": "3.11", "glibc": "2.36", "machine": "x86_64"}})
    pip = next(shlex.split(c) for c in run.commands if " -m pip install " in c)
    return spec, run, pip, ensured


def _source(pip: list[str]) -> list[str]:
    return pip[pip.index("--timeout") + 2:-1]  # between pip's own flags and the requirement


def test_fleet_wheels_over_http(harness, monkeypatch, tmp_path):
    spec, run, pip, ensured = _run(harness, monkeypatch, tmp_path, data={"vllm_wheel_serve_address": "10.10.0.1"},
                                   wheels="fleet")
    assert ensured == [[f"vllm-router=={spec['proxy']['routing']['router']['version']}"]] and not run.has_op("wheels to")  # fetched over HTTP
    assert _source(pip) == ["--no-index", "--find-links", "http://10.10.0.1:4242/k3y/", "--trusted-host", "10.10.0.1"]


@pytest.mark.parametrize("how", ["wheelhouse", "fleet"])
def test_uploaded_wheels(harness, monkeypatch, tmp_path, how):
    install = {"wheelhouse": str(tmp_path)} if how == "wheelhouse" else {"wheels": "fleet"}
    spec, run, pip, _ = _run(harness, monkeypatch, tmp_path, **install)
    dest = render.paths(spec)["router_env"] + "-wheels"
    what = "wheelhouse" if how == "wheelhouse" else "router's wheels"
    assert run.has_op(f"Upload the {what} to {dest}")
    assert _source(pip) == ["--no-index", "--find-links", dest]


def test_the_hosts_index(harness, monkeypatch, tmp_path):
    _, run, pip, ensured = _run(harness, monkeypatch, tmp_path, wheels="host", index_url="https://pypi.example/simple")
    assert not ensured and _source(pip) == ["--index-url", "https://pypi.example/simple"]
