"""vllm_fleet/roles/pyenv, through the commands it would send (no conda channel reachable here).
What is on the host comes from the one state read (HostState, scripted as host_state.sh prints it)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from pyinfra.facts.deb import DebPackages
from pyinfra.facts.files import Directory
from pyinfra.facts.server import Groups, Os, Users, Which

from vllm_fleet.roles.common.state import StateUnknown
from vllm_fleet.roles.pyenv import EnvMismatch, pyenv, service_dirs
from vllm_fleet.render.files import deployment_paths
from vllm_fleet.specs.load import load, resolve

REPO = Path(__file__).resolve().parents[2]
SHA = "848194851a98903134187fbb4ab50efe87b003e0c0f808f97644b7524a62bf2c"


def spec_of(name, **install):
    spec = copy.deepcopy(resolve(load(REPO / "deployments" / name)))
    spec["install"].update(install)
    return spec


def directory(mode, user="root", group="root"):
    return {"mode": mode, "user": user, "group": group}


# ------------------------------------------------------------------------------------- venv


def test_venv_fresh(harness):
    spec = spec_of("lab-tiny.yaml")
    run = harness.run(pyenv, spec, deployment_paths(spec), facts={**_state(), Directory: None})
    prefix = spec["install"]["prefix"]
    assert run.op("Install prefix").commands == [
        f"mkdir -p {prefix}",
        f"chmod 755 {prefix}",
        f"chown root:root {prefix}",
    ]
    assert any(c.endswith("install python3-venv") for c in run.op("python3-venv").commands)
    assert run.op("venv at").commands == [f"test -x {prefix}/env/bin/python || python3 -m venv {prefix}/env"]
    assert deployment_paths(spec)["python"] == f"{prefix}/env/bin/python"
    assert "conda" not in "\n".join(run.commands) and "miniforge" not in "\n".join(run.commands).lower()


def _state(debs=(), python=None, env="/opt/vllm-fleet/lab-tiny/env/bin/python", conda=None, complete=True, prefix=None):
    """The one state read's answer (vllm_fleet.roles.common.state): these packages installed, the
    env's python (None: absent), ``conda``: the Miniforge at /opt/miniforge3 (None: absent, "":
    there with no recorded version, else the recorded version), ``prefix``: the install prefix
    there (root:root 0755); ``complete=False``: the read stopped before its end (nothing known)."""
    import base64

    from vllm_fleet.host.state import HostState, Snapshot

    lines = (
        [f"deb\t{d}\tii \t1" for d in debs] + ([f"py\t{env}\tpython {python}"] if python else []) + [f"py\t{env}\t."]
    )
    if prefix:
        lines.append(f"stat\t{prefix}\tdirectory\troot\troot\t755\t4096")
    if conda is not None:
        lines.append("stat\t/opt/miniforge3/bin/conda\tregular file\troot\troot\t755\t100")
        if conda:
            lines.append(
                "read\t/opt/miniforge3/.vllm-fleet-miniforge-version\t"
                + base64.b64encode(f"{conda}\n".encode()).decode()
            )
    return {HostState: lambda query: Snapshot.parse([*lines, *(["end"] if complete else [])])}


CONDA_ENV = deployment_paths(spec_of("rtx3090-qwen7b-awq-realtime.yaml"))["python"]


def test_venv_present_no_changes(harness):
    """Packages and the env's python from the one state read (the role on its own reads it once):
    no DebPackages fact, no operation."""
    spec = spec_of("lab-tiny.yaml")
    run = harness.run(
        pyenv,
        spec,
        deployment_paths(spec),
        facts=_state(["python3-venv"], "3.11.2", prefix=spec["install"]["prefix"]),
        strict=True,
    )
    assert not run.changed, run
    assert [n for n, _ in run.asked] == ["HostState"], run.asked


def test_a_venv_whose_read_did_not_complete_is_made_only_when_absent(harness):
    spec = spec_of("lab-tiny.yaml")
    run = harness.run(
        pyenv, spec, deployment_paths(spec), facts={**_state(complete=False), Directory: None}
    )  # the read stopped before its end
    prefix = spec["install"]["prefix"]
    assert run.op("venv at").commands == [f"test -x {prefix}/env/bin/python || python3 -m venv {prefix}/env"]


# ------------------------------------------------------------------------------------ conda


def test_conda_fresh_checksum_before_installer(harness):
    spec = spec_of("rtx3090-qwen7b-awq-realtime.yaml")
    prefix = spec["install"]["prefix"]
    run = harness.run(
        pyenv, spec, deployment_paths(spec), facts={**_state(env=CONDA_ENV), DebPackages: {}, Directory: None}
    )
    c = run.commands
    download = run.index("curl -fsSL")
    check = run.index("sha256sum --check")
    install = run.index("bash /var/cache/vllm-fleet/Miniforge3-26.3.2-3-Linux-x86_64.sh")
    assert download < check < install
    assert "releases/download/26.3.2-3/Miniforge3-26.3.2-3-Linux-x86_64.sh" in c[download]
    assert SHA in c[check]
    # the checked file is the one run (downloaded as .part, renamed only after the check)
    assert c[download].split(" -o ")[1].split()[0] in c[check]
    assert c[install].endswith("-b -p /opt/miniforge3")
    assert run.commands[-1] == (
        f"/opt/miniforge3/bin/conda create -y -p {prefix}/env --override-channels -c conda-forge python=3.12"
    )


def test_conda_present_no_changes(harness):
    spec = spec_of("rtx3090-qwen7b-awq-realtime.yaml")
    facts = _state(["gcc"], "3.12.7", env=CONDA_ENV, conda="26.3.2-3", prefix=spec["install"]["prefix"])
    run = harness.run(pyenv, spec, deployment_paths(spec), facts=facts, strict=True)
    assert not run.changed, run
    assert [n for n, _ in run.asked] == ["HostState"], run.asked  # Miniforge, the env's python, gcc: one read


def test_conda_other_miniforge_version_updated_in_place_env_kept(harness):
    spec = spec_of("rtx3090-qwen7b-awq-realtime.yaml")
    facts = {
        **_state(["gcc"], "3.12.7", env=CONDA_ENV, conda="24.11.0-0"),
        DebPackages: {"curl": ["7"], "ca-certificates": ["1"]},
        Directory: directory(755),
    }
    run = harness.run(pyenv, spec, deployment_paths(spec), facts=facts)
    installs = [c for c in run.commands if c.startswith("bash ")]
    assert installs == ["bash /var/cache/vllm-fleet/Miniforge3-26.3.2-3-Linux-x86_64.sh -b -u -p /opt/miniforge3"]
    assert not any("conda create" in c for c in run.commands)


def test_conda_env_with_other_python_stops(harness):
    spec = spec_of("rtx3090-qwen7b-awq-realtime.yaml")
    facts = {**_state(["gcc"], "3.10.14", env=CONDA_ENV, conda="26.3.2-3"), Directory: directory(755)}
    with pytest.raises(EnvMismatch, match="host gpu4: .*/env has Python 3.10, the spec asks for install.python 3.12"):
        harness.run(pyenv, spec, deployment_paths(spec), facts=facts, host="gpu4")


# ----------------------------------------------------------------------- user and directories


def test_service_dirs_fresh(harness):
    spec = spec_of("lab-tiny.yaml")
    ins, user = spec["install"], spec["server"]["user"]
    facts = {
        Os: "Linux",
        Users: {},
        Groups: [],
        Directory: None,
        Which: harness.per_arg("command", {"useradd": "/usr/sbin/useradd"}),
    }
    run = harness.run(service_dirs, spec, facts=facts)
    useradd = run.op("System user").commands[0]
    assert useradd.startswith("useradd") and "-r" in useradd.split() and user in useradd.split()
    assert "-s /usr/sbin/nologin" in useradd and "-d /var/lib/vllm-fleet" in useradd
    assert run.op("Config directory").commands[1:] == [
        f"chmod 750 {ins['config_dir']}",
        f"chown root:{user} {ins['config_dir']}",
    ]
    assert run.op("State directory").commands[1:] == [
        f"chmod 750 {ins['state_dir']}",
        f"chown {user}:{user} {ins['state_dir']}",
    ]


def test_service_dirs_present_no_changes(harness):
    spec = spec_of("lab-tiny.yaml")
    ins, user = spec["install"], spec["server"]["user"]
    dirs = {
        ins["prefix"]: directory(755),
        ins["config_dir"]: directory(750, "root", user),
        ins["state_dir"]: directory(750, user, user),
    }
    users = {
        user: {
            "home": "/var/lib/vllm-fleet",
            "shell": "/usr/sbin/nologin",
            "group": user,
            "groups": [],
            "comment": None,
            "uid": 998,
            "gid": 998,
        }
    }
    facts = {
        Os: "Linux",
        Users: users,
        Groups: [user],
        Directory: harness.per_arg("path", dirs),
        Which: harness.per_arg("command", {"useradd": "/usr/sbin/useradd"}),
    }
    run = harness.run(service_dirs, spec, facts=facts)
    assert not run.changed, run


def test_cuda_venv_gets_python_headers_and_a_c_compiler(harness):
    """Triton builds its launcher against Python.h with the system cc at vLLM's first start."""
    spec = spec_of("h200-qwen7b-bf16.yaml")  # accelerator cuda, env_manager venv
    run = harness.run(
        pyenv,
        spec,
        deployment_paths(spec),
        facts={**_state(env=deployment_paths(spec)["python"]), DebPackages: {}, Directory: None},
    )
    install = [c for c in run.op("python3-venv").commands if " install " in c]
    assert install and install[0].endswith("install python3-venv python3-dev gcc")
    # installed: nothing
    again = harness.run(
        pyenv,
        spec,
        deployment_paths(spec),
        facts={
            **_state(["python3-venv", "python3-dev", "gcc"], "3.12.3", env=deployment_paths(spec)["python"]),
            Directory: directory(755),
        },
    )
    assert not again.changed
    # the CPU venv (lab) stays without them
    lab = spec_of("lab-tiny.yaml")
    cpu = harness.run(pyenv, lab, deployment_paths(lab), facts={**_state(), DebPackages: {}, Directory: None})
    assert "python3-dev" not in "\n".join(cpu.commands)


def test_cuda_conda_env_gets_a_c_compiler(harness):
    spec = spec_of("rtx3090-qwen7b-awq-realtime.yaml")  # conda (the default)
    assert spec["install"]["env_manager"] == "conda"
    run = harness.run(
        pyenv, spec, deployment_paths(spec), facts={**_state(env=CONDA_ENV), DebPackages: {}, Directory: None}
    )
    assert any(c.endswith("install gcc") for c in run.op("C compiler").commands)


def test_conda_miniforge_there_without_a_recorded_version_is_updated_in_place(harness):
    """bin/conda there (the read's stat) but no version recorded: the pinned installer runs with
    -u over it; the env with the asked Python stays."""
    spec = spec_of("rtx3090-qwen7b-awq-realtime.yaml")
    facts = {
        **_state(["gcc"], "3.12.7", env=CONDA_ENV, conda=""),
        DebPackages: {"curl": ["7"], "ca-certificates": ["1"]},
        Directory: directory(755),
    }
    run = harness.run(pyenv, spec, deployment_paths(spec), facts=facts)
    assert [c for c in run.commands if c.startswith("bash ")] == [
        "bash /var/cache/vllm-fleet/Miniforge3-26.3.2-3-Linux-x86_64.sh -b -u -p /opt/miniforge3"
    ]
    assert not any("conda create" in c for c in run.commands)


def test_conda_whose_read_did_not_complete_changes_nothing(harness):
    """Whether Miniforge and the env are there is not known: StateUnknown (names the host, how to
    retry), never the installer or `conda create -y` (which would replace an env that is there)."""
    spec = spec_of("rtx3090-qwen7b-awq-realtime.yaml")
    with pytest.raises(
        StateUnknown, match="host gpu4: the read of this host's state did not complete.*run the deploy again"
    ):
        harness.run(
            pyenv,
            spec,
            deployment_paths(spec),
            facts={
                **_state(["gcc"], "3.12.7", env=CONDA_ENV, conda="26.3.2-3", complete=False),
                DebPackages: {"gcc": ["1"]},
                Directory: directory(755),
            },
            host="gpu4",
        )
