"""The install stack's roles (pyenv, vllm, model) take the deployment's env from the layout's paths
(``where``: vllm_fleet.render.parts.Paths, issue 34 item 3), not from the spec: given a ``where``
whose env lies elsewhere, every command and the state read name that env and none names
``{install.prefix}/env``."""

from __future__ import annotations

import copy
import dataclasses
import shlex
import sys
from pathlib import Path

from pyinfra.facts.files import Directory, File

from vllm_fleet.host.state import HostState, Snapshot
from vllm_fleet.render.files import deployment_paths
from vllm_fleet.roles.model import install_model
from vllm_fleet.roles.pyenv import pyenv
from vllm_fleet.roles.vllm import install_vllm
from vllm_fleet.specs.load import load, resolve

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fleetutil import env_state  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OTHER = "/srv/other-env"


def _spec() -> dict:
    spec = copy.deepcopy(resolve(load(REPO / "deployments" / "lab-tiny.yaml")))
    spec["install"]["wheels"] = "host"  # no fleet wheelhouse download while testing
    return spec


def _elsewhere(spec: dict):
    """The layout's paths of ``spec`` with the env moved to OTHER (nothing else changed)."""
    base = deployment_paths(spec)
    env = {"env": OTHER, "python": f"{OTHER}/bin/python", "uv": f"{OTHER}/bin/uv"}
    assert {k: base[k] for k in env} == {k: f"{spec['install']['prefix']}/env{v[len(OTHER) :]}" for k, v in env.items()}
    return dataclasses.replace(base, named={**base.named, **env})


def _asked_pythons(run) -> set[str]:
    return {py for name, kw in run.asked if name == "HostState" for py, _ in kw["query"].envs}


def test_pyenv_makes_the_env_where_the_layout_says(harness):
    spec = _spec()
    run = harness.run(pyenv, spec, _elsewhere(spec), facts={**env_state(python=None), Directory: None})
    assert run.op("venv at").commands == [f"test -x {OTHER}/bin/python || python3 -m venv {OTHER}"]
    assert _asked_pythons(run) == {f"{OTHER}/bin/python"}
    assert not any(f"{spec['install']['prefix']}/env" in c for c in run.commands)


def test_vllm_installs_with_the_layouts_python_and_uv(harness):
    spec = _spec()
    run = harness.run(install_vllm, spec, _elsewhere(spec), facts=env_state({}))
    joined = "\n".join(run.commands)
    assert f"{OTHER}/bin/python -m pip install " in joined, joined  # pip (and uv's bootstrap)
    assert f"{OTHER}/bin/uv pip install --no-progress --python {OTHER}/bin/python " in joined, joined
    assert f"{OTHER}/bin/python -c " in joined  # the CPU build's site files and the import check
    assert _asked_pythons(run) == {f"{OTHER}/bin/python"}
    assert not any(f"{spec['install']['prefix']}/env" in c for c in run.commands)


def test_model_downloads_with_the_layouts_python(harness):
    spec = _spec()
    spec["model"].update(
        transfer="hub", source="Qwen/Qwen2.5-7B-Instruct-AWQ", revision="a" * 40, local_dir=None, hub_fetch="host"
    )
    no_marker = Snapshot.parse([f"read\t{spec['model']['path']}/.vllm-fleet-hub\t-", "end"])
    run = harness.run(install_model, spec, _elsewhere(spec), facts={HostState: lambda query: no_marker, File: None})
    (dl,) = [c for c in run.commands if "snapshot_download" in c]
    assert f"{OTHER}/bin/python" in shlex.split(dl)
    assert not any(f"{spec['install']['prefix']}/env" in c for c in run.commands)
