"""FlashInfer's pre-built kernels for hosts without internet (issue 25, vllm_fleet.specs.flashinfer).

- The resolved set, from pip's own ``install --dry-run --report`` output recorded as a fixture
  (tests/fixtures/flashinfer/, no network here): vLLM 0.33.0 pins flashinfer-python 0.7.2.post1
  and no longer requires flashinfer-cubin (0.20.2 required both at 0.6.8.post1), so the install
  must add ``flashinfer-cubin==0.7.2.post1`` itself.
- The commands the vllm role issues for a CUDA host (index, wheelhouse), and that command run for
  real by sh against a stand-in env Python: the cubin at the env's flashinfer-python version
  exactly, from the same source flags as vLLM; a warning, not a failure, when the source lacks it.
- The fleet wheelhouse adds the cubin beside flashinfer-python (pip download from a local
  find-links, offline), or records once that the source has none.
- ``validate`` warns for a given wheelhouse without the cubin, and for a JIT feature offline.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from vllm_fleet.render.files import deployment_paths
from vllm_fleet.specs import flashinfer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fleetutil import env_state  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
REPORT = json.loads((REPO / "tests" / "fixtures" / "flashinfer" / "vllm-0.33.0-0.20.2-report.json").read_text())


def stub_wheel(folder: Path, name: str, version: str) -> Path:
    """A metadata-only wheel pip can download and install."""
    dist = name.replace("-", "_")
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    di = f"{dist}-{version}.dist-info"
    files = {
        f"{di}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{di}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as z:
        rec = []
        for rel, text in files.items():
            z.writestr(rel, text)
            rec.append(
                f"{rel},sha256="
                f"{base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},{len(text)}"
            )
        z.writestr(f"{di}/RECORD", "\n".join(rec + [f"{di}/RECORD,,"]) + "\n")
    return path


def test_the_resolved_set_of_vllm_0_33_0_needs_the_cubin_added():
    new = flashinfer.resolved_set(REPORT, "0.33.0")
    assert new == {"flashinfer-python": "0.7.2.post1"}  # no flashinfer-cubin requirement any more
    assert flashinfer.companions(new) == ["flashinfer-cubin==0.7.2.post1"]
    old = flashinfer.resolved_set(REPORT, "0.20.2")
    assert old == {"flashinfer-python": "0.6.8.post1", "flashinfer-cubin": "0.6.8.post1"}
    assert flashinfer.companions(old) == []  # 0.20.2 still brought it
    # the index this was resolved against listed no flashinfer-cubin 0.7.2.post1 (newest 0.6.13):
    # hence a warning, not a failure, where the source lacks it
    assert (
        "0.7.2.post1" not in REPORT["flashinfer_cubin_versions"]
        and "0.6.8.post1" in REPORT["flashinfer_cubin_versions"]
    )
    assert flashinfer.companions({"flashinfer_python": "0.7.2.post1", "flashinfer-cubin": "0.7.2.post1"}) == []
    assert flashinfer.companions({"vllm": "0.33.0"}) == []


def _spec(**install):
    import copy

    from vllm_fleet.specs.load import load, resolve

    spec = copy.deepcopy(resolve(load(REPO / "deployments" / "rtx3090-qwen7b-awq-realtime.yaml")))
    spec["install"].update({"wheels": "host", "installer": "pip", **install})
    return spec


def test_a_cuda_install_adds_the_cubin_from_the_same_index(harness):
    from vllm_fleet.roles.vllm import install_vllm

    spec = _spec(index_url="https://mirror.example/simple")
    run = harness.run(install_vllm, spec, deployment_paths(spec), facts={**env_state({})})
    install, cubin = run.commands[0], run.commands[1]
    assert (
        "--index-url https://mirror.example/simple" in install and "--index-url https://mirror.example/simple" in cubin
    )
    assert "flashinfer-cubin" in cubin
    assert "--no-deps" in cubin
    assert run.index("flashinfer-cubin") > run.index("vllm==0.33.0")  # after vLLM, at its flashinfer's version
    # installed already: nothing at all (no op, so no restart)
    assert not harness.run(install_vllm, spec, deployment_paths(spec), facts={**env_state({"vllm": "0.33.0"})}).changed
    # the CPU build: no cubin
    from vllm_fleet.specs.load import load, resolve

    cpu = resolve(load(REPO / "deployments" / "lab-tiny.yaml"))
    cpu["install"].update({"wheels": "host", "installer": "pip"})
    assert not any(
        "flashinfer" in c
        for c in harness.run(install_vllm, cpu, deployment_paths(cpu), facts={**env_state({})}).commands
    )


def _fake_env(tmp_path: Path, fi_version: str | None, pip_rc: int = 0) -> Path:
    """A stand-in env python: prints fi_version for the version read, records pip's argv."""
    py = tmp_path / "env" / "bin" / "python"
    py.parent.mkdir(parents=True)
    read = f"echo {fi_version}" if fi_version else "exit 1"
    py.write_text(f"""#!/bin/sh
if [ "$1" = -c ]; then {read}; fi
if [ "$1" = -m ]; then printf '%s\\n' "$@" > {tmp_path}/pip-argv; exit {pip_rc}; fi
""")
    py.chmod(0o755)
    return py


@pytest.mark.parametrize(
    "fi_version,pip_rc,installs,warns",
    [
        ("0.7.2.post1", 0, True, False),  # the cubin at exactly the env's flashinfer-python version
        ("0.7.2.post1", 1, True, True),  # the source lacks it: a warning, the install goes on
        (None, 0, False, False),  # no flashinfer-python in the env: nothing
    ],
)
def test_the_cubin_command_run_by_sh(tmp_path, fi_version, pip_rc, installs, warns):
    from vllm_fleet.roles.vllm import flashinfer_cubin_command

    _fake_env(tmp_path, fi_version, pip_rc)
    spec = _spec(prefix=str(tmp_path))
    cmd = flashinfer_cubin_command(
        spec, deployment_paths(spec), cache_dir=None, wheelhouse=f"{tmp_path}/wheelhouse"
    ).get_raw_value()  # a StringCommand
    r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    argv = (tmp_path / "pip-argv").read_text().split("\n") if (tmp_path / "pip-argv").exists() else []
    if installs:
        assert (
            argv[-2:] == [f"flashinfer-cubin=={fi_version}", ""]
            and "--no-index" in argv
            and f"{tmp_path}/wheelhouse" in argv
        ), argv
    else:
        assert not argv
    assert ("WARNING: flashinfer-cubin==0.7.2.post1" in r.stderr) == warns, r.stderr


def test_the_fleet_wheelhouse_gets_the_cubin_or_says_once_it_cannot(tmp_path, monkeypatch):
    from vllm_fleet.fetch import wheelhouse as wh

    target = {"python": f"{sys.version_info[0]}.{sys.version_info[1]}", "glibc": "2.36", "machine": "x86_64"}
    empty_index = tmp_path / "simple"
    empty_index.mkdir()
    links = tmp_path / "links"
    links.mkdir()
    house = tmp_path / "house"
    house.mkdir()
    stub_wheel(house, "flashinfer-python", "0.7.2.post1")
    said: list[str] = []
    # the source lacks it: recorded once, a warning
    why = wh.add_flashinfer_cubin(house, target, index_url=empty_index.as_uri(), find_links=str(links), log=said.append)
    assert why and "flashinfer-cubin==0.7.2.post1" in why and "WARNING" in said[-1]
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("asked the index again"))
    assert wh.add_flashinfer_cubin(house, target, index_url=empty_index.as_uri(), find_links=str(links)) == why
    monkeypatch.undo()
    # the source has it: downloaded beside flashinfer-python (pip download, offline: a local find-links)
    (house / ".flashinfer-cubin-0.7.2.post1-unavailable").unlink()
    stub_wheel(links, "flashinfer-cubin", "0.7.2.post1")
    assert (
        wh.add_flashinfer_cubin(house, target, index_url=empty_index.as_uri(), find_links=str(links), log=said.append)
        is None
    )
    assert (house / "flashinfer_cubin-0.7.2.post1-py3-none-any.whl").exists()
    assert flashinfer.wheelhouse_lacks_cubin(house) is None


def test_validate_warns_for_a_wheelhouse_without_the_cubin_and_for_jit_offline(tmp_path):
    from vllm_fleet.specs import hwchecks

    stub_wheel(tmp_path, "flashinfer-python", "0.7.2.post1")
    spec = _spec(wheelhouse=str(tmp_path))
    found = [p for p in hwchecks.hardware_problems(spec) if "flashinfer" in p.message.lower()]
    assert len(found) == 1 and found[0].path == "install.wheelhouse" and found[0].severity == "warning"
    assert "flashinfer-cubin==0.7.2.post1" in found[0].fix
    stub_wheel(tmp_path, "flashinfer-cubin", "0.7.2.post1")
    assert not [p for p in hwchecks.hardware_problems(spec) if "flashinfer" in p.message.lower()]
    spec["env"] = {"VLLM_ATTENTION_BACKEND": "FLASHINFER"}
    jit = [p for p in hwchecks.hardware_problems(spec) if "JIT" in p.message]
    assert len(jit) == 1 and "nvcc" in jit[0].message and "flashinfer-jit-cache" in jit[0].fix
    spec["install"]["wheelhouse"] = None  # online (the index): the nvidia role's toolkit brings nvcc
    assert not [p for p in hwchecks.hardware_problems(spec) if "JIT" in p.message]
