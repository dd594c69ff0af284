"""A GPU shared with a desktop (issue 38): the deploy plans with each GPU's free memory, not its
total, names what holds the rest, and never counts this deployment's own running vLLM as a
foreign process (vllm_fleet/roles/nvidia/gpumem.py).

The nvidia-smi lines are in its CSV form (``--format=csv,noheader,nounits``). The H200 figures are
the ones nvidia-smi printed on the lent H200 while vLLM served at 0.90 (bench/results/
h200-qwen7b-awq.json: 129053 MiB used of 143771 MiB; CUDA's total there, 139.8 GiB, is
143155 MiB, so the driver keeps 616 MiB outside used + free). The RTX 3090 desktop is the 000
article's card: 24576 MiB in nvidia-smi, 23.70 GiB (24269 MiB) for CUDA, and a display server
holding 1.2 GiB.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from vllm_fleet.host.state import HostState, Snapshot
from vllm_fleet.roles.nvidia import gpumem

UUID = "GPU-5d0c3a2e-8f1b-4c6d-9e7a-0b1c2d3e4f50"
OURS = "vllm-qwen7b-awq-rt-0.service"

# The desk: Xorg and gnome-shell hold /dev/nvidia0; nvidia-smi lists no compute process.
DESK_SMI = [f"0, {UUID}, 24576, 1243, 23026"]
DESK_HOLDERS = {
    1523: {"minors": [0], "cgroup": "/system.slice/display-manager.service", "comm": "Xorg"},
    2231: {"minors": [0], "cgroup": "/user.slice/user-1000.slice/session-2.scope", "comm": "gnome-shell"},
}

# The same desk on a re-deploy: our vLLM (its API server and its engine core, both in our unit) holds 20.9 GiB.
REDEPLOY_SMI = [f"0, {UUID}, 24576, 22620, 1649"]
REDEPLOY_APPS = [
    f"{UUID}, 4242, 21377, /opt/vllm-fleet/qwen7b-awq-rt/env/bin/python3",
    f"{UUID}, 4301, 0, VLLM::EngineCore",
]
REDEPLOY_HOLDERS = {
    **DESK_HOLDERS,
    4242: {"minors": [0], "cgroup": f"/system.slice/{OURS}", "comm": "python3"},
    4301: {"minors": [0], "cgroup": f"/system.slice/{OURS}", "comm": "VLLM::EngineCo"},
}


def _g(smi, apps=(), holders=None, ours=(OURS,)):
    return gpumem.gpu_memory(list(smi), list(apps), dict(holders or {}), set(ours))


def test_the_desktops_gpu_is_planned_with_its_free_memory_and_the_holders_named():
    [g] = _g(DESK_SMI, holders=DESK_HOLDERS)
    assert (g.total, g.free, g.cuda_total, g.held_by_others, g.plannable) == (24576, 23026, 24269, 1243, 23026)
    assert gpumem.describe(g) == (
        "GPU 0: 24.0 GiB total, 1.2 GiB held by other processes (Xorg (pid 1523), "
        "gnome-shell (pid 2231)), planning with 22.5 GiB"
    )
    # the realtime profile's 0.90 asks 21.3 GiB: fits; the batch profile's 0.95 asks 22.5 GiB of 22.49: vLLM refuses
    assert gpumem.problems([g], {0: {OURS: 0.90}}) == ([], [])
    errors, warnings = gpumem.problems([g], {0: {OURS: 0.95}})
    assert warnings == [] and len(errors) == 1, errors
    assert errors[0].startswith(
        f"GPU 0: {OURS} 0.95 = 0.95 x 23.70 GiB = 22.52 GiB asked at start (engine.gpu_memory_utilization), "
        "but only 22.49 GiB is free for this deployment"
    )
    assert "engine.gpu_memory_utilization 0.94 or lower" in errors[0] and "Xorg (pid 1523)" in errors[0]


def test_our_own_running_vllm_is_not_a_foreign_process_on_a_redeploy():
    """A re-deploy reads the GPU while our vLLM holds 21 GiB of it: that memory is ours to plan
    with (its restart gives it back); only Xorg's share is someone else's."""
    [g] = _g(REDEPLOY_SMI, REDEPLOY_APPS, REDEPLOY_HOLDERS)
    assert g.ours == {OURS: 21377} and g.unattributed == 0
    assert sorted(g.others) == ["Xorg (pid 1523)", "gnome-shell (pid 2231)"]
    assert g.held_by_others == 22620 - 21377 and g.plannable == 1649 + 21377
    assert gpumem.problems([g], {0: {OURS: 0.90}}) == ([], [])
    assert gpumem.describe(g).endswith(
        f"20.9 GiB by this deployment ({OURS}: given back when it restarts), planning with 22.5 GiB"
    )
    # the same processes under a unit that is not this deploy's: 21 GiB held by others, no room
    [other] = _g(REDEPLOY_SMI, REDEPLOY_APPS, REDEPLOY_HOLDERS, ours=("vllm-else-0.service",))
    assert other.ours == {} and other.plannable == 1649
    errors, _ = gpumem.problems([other], {0: {"vllm-else-0.service": 0.90}})
    assert len(errors) == 1 and "python3 (pid 4242)" in errors[0]


def test_a_users_own_vllm_in_a_terminal_is_someone_elses_by_its_cgroup_not_its_name():
    holders = {
        **DESK_HOLDERS,
        7001: {"minors": [0], "cgroup": "/user.slice/user-1000.slice/session-2.scope", "comm": "vllm"},
    }
    [g] = _g(REDEPLOY_SMI, [f"{UUID}, 7001, 21377, /home/me/.venv/bin/vllm"], holders)
    assert g.ours == {} and g.others["vllm (pid 7001)"] == 21377
    assert gpumem.problems([g], {0: {OURS: 0.90}})[0]


def test_memory_of_a_process_this_read_cannot_see_warns_and_stops_nothing():
    """nvidia-smi lists a pid whose /proc this read does not have (another PID namespace): it may
    be ours, so a GPU that fits only when it is counted as ours is a warning, not a stop."""
    [g] = _g(REDEPLOY_SMI, REDEPLOY_APPS, DESK_HOLDERS)
    assert g.unattributed == 21377 and g.ours == {} and g.held_by_others == 1243
    errors, warnings = gpumem.problems([g], {0: {OURS: 0.90}})
    assert errors == [] and len(warnings) == 1 and "only if the processes not attributed" in warnings[0]
    assert "could not attribute" in gpumem.describe(g)


def test_two_replicas_on_one_gpu_need_their_shares_together():
    [g] = _g(DESK_SMI, holders=DESK_HOLDERS)
    assert gpumem.problems([g], {0: {"vllm-x-0.service": 0.45, "vllm-x-1.service": 0.45}}) == ([], [])
    assert len(gpumem.problems([g], {0: {"vllm-x-0.service": 0.48, "vllm-x-1.service": 0.48}})[0]) == 1


def test_lines_that_are_not_gpus_are_skipped():
    msg = [
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest "
        "NVIDIA driver is installed and running.",
        "",
    ]
    assert gpumem.parse_memory(msg) == [] and gpumem.parse_apps(msg) == []
    assert gpumem.parse_apps([f"{UUID}, 4242, [N/A], python3"])[0]["mib"] is None
    assert gpumem.unit_of_cgroup("/system.slice/vllm-x-0.service") == "vllm-x-0.service"
    assert (
        gpumem.unit_of_cgroup("/user.slice/user-1000.slice/session-2.scope") is None
        and gpumem.unit_of_cgroup(None) is None
    )


# -- through the one state read: host_state.sh for real with a stand-in nvidia-smi on PATH --------


def _stub(tmp_path: Path, smi: list[str], apps: list[str]) -> dict:
    (tmp_path / "bin").mkdir()
    (tmp_path / "smi.txt").write_text("".join(f"{x}\n" for x in smi))
    (tmp_path / "apps.txt").write_text("".join(f"{x}\n" for x in apps))
    exe = tmp_path / "bin" / "nvidia-smi"
    exe.write_text(
        f'#!/bin/sh\ncase "$1" in --query-gpu=*) cat {tmp_path}/smi.txt ;; --query-compute-apps=*) cat '
        f'{tmp_path}/apps.txt ;; esac\n'
    )
    exe.chmod(0o755)
    return {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}


def _read(env: dict) -> Snapshot:
    query = gpumem.query()
    r = subprocess.run(
        ["sh", "-c", HostState().command(query).get_raw_value()], capture_output=True, text=True, timeout=60, env=env
    )
    assert r.returncode == 0, r.stderr
    snap = Snapshot.parse(r.stdout.splitlines())
    snap.query = query
    return snap


class _Host:
    """A host of the layout with our one replica on GPU 0 at 0.95 (stands in for HostLayout)."""

    def __init__(self, share=0.95):
        inst = type("I", (), {"port": 8000, "unit": OURS, "gpu_ids": [0]})()
        self.parts = {"qwen7b-awq-rt": type("N", (), {"instances": [inst], "roles": {"server"}})()}
        self.files = {f"/etc/systemd/system/{OURS}": None}
        self.spec = {"engine": {"gpu_memory_utilization": share}, "replicas": {"per_gpu": 1}, "proxy": {}}


def test_the_one_read_asks_nvidia_smi_and_the_deploy_stops_before_anything(tmp_path):
    from pyinfra.api.exceptions import DeployError

    env = _stub(tmp_path, DESK_SMI, [])
    snap = _read(env)
    assert snap.known and snap.nvidia_smi(gpumem.MEMORY_FIELDS) == (True, DESK_SMI)
    known, apps, holders = snap.gpu_apps(gpumem.APPS_FIELDS)
    assert (
        known and apps == [] and (holders == {} or Path("/dev/nvidia0").exists())
    )  # no GPU device here: nobody holds one
    h = _Host(0.95)
    said: list[str] = []
    with pytest.raises(
        DeployError,
        match=r"(?s)host desk: not enough free GPU memory:\n  GPU 0: .*0\.9[0-4] or lower.*nothing was uploaded",
    ):
        gpumem.refuse({"qwen7b-awq-rt": h.spec}, h, "desk", snap, log=said.append)
    assert said == ["GPU 0: 24.0 GiB total, 1.2 GiB held by other processes, planning with 22.5 GiB"]
    h = _Host(0.90)
    said.clear()
    gpumem.refuse({"qwen7b-awq-rt": h.spec}, h, "desk", snap, log=said.append)
    assert said == ["GPU 0: 24.0 GiB total, 1.2 GiB held by other processes, planning with 22.5 GiB"]
    # a host without nvidia-smi (the driver not installed yet): said in one line, nothing refused
    bare = _read({**os.environ, "PATH": "/usr/bin:/bin"}) if not Path("/usr/bin/nvidia-smi").exists() else None
    if bare is not None:
        assert bare.nvidia_smi(gpumem.MEMORY_FIELDS) == (True, None)
        said.clear()
        gpumem.refuse({"qwen7b-awq-rt": h.spec}, h, "desk", bare, log=said.append)
        assert said == [
            "GPU 0: free memory not read (no nvidia-smi on the host's PATH): planning with each GPU's total; "
            "what another process holds there is not known before vLLM starts"
        ]


def test_a_driver_that_does_not_answer_is_said_not_passed_over(tmp_path):
    """The H200 deploy of the last proof printed no GPU line at all: a read that gives no GPU's
    memory (nvidia-smi's own message that it cannot reach the driver) must be said, not silent."""
    msg = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    snap = _read(_stub(tmp_path, [msg], []))
    h = _Host(0.90)
    lines, errors, warnings = gpumem.check({"qwen7b-awq-rt": h.spec}, h, snap)
    assert errors == [] and warnings == []
    assert lines == [
        f"GPU 0: free memory not read (nvidia-smi said {msg!r}): planning with each GPU's total; "
        "what another process holds there is not known before vLLM starts"
    ]


def test_the_redeploy_read_counts_our_units_processes_as_ours(tmp_path):
    """The compute apps through the real read; their cgroups as the read gives them (holders)."""
    snap = _read(_stub(tmp_path, REDEPLOY_SMI, REDEPLOY_APPS))
    known, apps, _ = snap.gpu_apps(gpumem.APPS_FIELDS)
    assert apps == REDEPLOY_APPS
    snap.holders = {p: dict(v) for p, v in REDEPLOY_HOLDERS.items()}  # what the find over /proc gives on that desk
    h = _Host(0.90)
    lines, errors, warnings = gpumem.check({"qwen7b-awq-rt": h.spec}, h, snap)
    assert errors == [] and warnings == [] and "by this deployment" in lines[0], (lines, errors)


@pytest.mark.parametrize("name,asked", [("rtx3090-qwen7b-awq-realtime.yaml", True), ("lab-tiny.yaml", False)])
def test_the_serve_deploys_one_read_asks_the_gpus_memory_on_a_gpu_host_only(harness, name, asked):
    """deploys/serve.py's one state read holds gpumem's query where this deploy puts a vLLM on a
    GPU (the RTX 3090 spec), and not on a CPU host (lab-tiny): no nvidia-smi asked there."""
    import copy

    from pyinfra.api import deploy

    from vllm_fleet.deploys.serve import state_query as serve_query
    from vllm_fleet.render.layout import build
    from vllm_fleet.roles.common import DeployContext
    from vllm_fleet.specs.load import load, resolve

    spec = copy.deepcopy(resolve(load(Path(__file__).resolve().parents[2] / "deployments" / name)))
    spec["install"].pop("wheelhouse", None)
    layout = build([spec], {"desk": {"address": "10.10.0.11", "groups": ["servers", "proxy"], "data": {}}})
    got = {}

    @deploy("serve's query")
    def queries():
        got["q"] = serve_query(DeployContext(layout, {spec["name"]: spec}, {}, {}, ""), layout.hosts["desk"])

    harness.run(queries)
    assert (not gpumem.query() - got["q"]) is asked, got["q"].gpus


def test_plan_and_validate_on_at_local_say_the_free_memory_and_refuse_what_vllm_would(tmp_path, monkeypatch, capsys):
    """`vllm-fleet plan SPEC --inventory @local` and `validate SPEC --inventory @local` read this
    machine's GPUs (the one read's command, run here: nothing contacted) and say what the deploy
    plans with; the batch profile's 0.95 on the desk's 3090 is an error at
    engine.gpu_memory_utilization (exit 1), the realtime profile's 0.90 fits (exit 0)."""
    from vllm_fleet.commands.cli import main

    root = Path(__file__).resolve().parents[2] / "deployments"
    monkeypatch.setenv("PATH", _stub(tmp_path, DESK_SMI, [])["PATH"])
    line = "@local: GPU 0: 24.0 GiB total, 1.2 GiB held by other processes, planning with 22.5 GiB"
    assert main(["plan", str(root / "rtx3090-qwen7b-awq-realtime.yaml"), "--inventory", "@local"]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines()[-1] == line and "error:" not in out.err, out
    assert re.search(r"(?m)^fits +yes$", out.out), out.out
    assert main(["plan", str(root / "rtx3090-qwen7b-awq-batch.yaml"), "--inventory", "@local"]) == 1
    out = capsys.readouterr()
    # the table's verdict is this machine's: not "yes" above an error that exits 1 (last stop's note)
    assert re.search(r"(?m)^fits +NO$", out.out) and "note: it does not fit in what this machine's GPU" in out.out
    assert (
        line in out.out
        and "error: engine.gpu_memory_utilization: @local: GPU 0: vllm-qwen7b-awq-batch-0.service 0.95" in out.err
    ), out
    assert main(["validate", str(root / "rtx3090-qwen7b-awq-batch.yaml"), "--inventory", "@local"]) == 1
    out = capsys.readouterr()
    assert line in out.out and "@local: error: @local: GPU 0: " in out.err and "0.94 or lower" in out.err, out
    assert main(["validate", str(root / "rtx3090-qwen7b-awq-realtime.yaml"), "--inventory", "@local"]) == 0
    assert line in capsys.readouterr().out
    assert main(["plan", str(root / "rtx3090-qwen7b-awq-batch.yaml"), "--inventory", "@local", "--json"]) == 1
    out = capsys.readouterr()
    assert json.loads(out.out)["fits"] is False and line in out.err, out
    # without an inventory, or one without @local: the spec alone, nothing read here
    assert main(["plan", str(root / "rtx3090-qwen7b-awq-batch.yaml")]) == 0
    assert "@local" not in capsys.readouterr().out


def test_our_unit_holding_the_gpu_unlisted_by_nvidia_smi_is_not_foreign():
    """systemd in its own PID namespace (the H200 harness, a container): nvidia-smi may list no
    compute process at all, while our unit's processes hold /dev/nvidia0. The memory nobody is
    listed for may then be ours: a warning, never a stop of a re-deploy."""
    holders = {4242: {"minors": [0], "cgroup": f"/system.slice/{OURS}", "comm": "python3"}}
    [g] = _g(["0, GPU-1, 143771, 129057, 14098"], [], holders)
    assert g.unattributed == 129057 and g.held_by_others == 0 and g.others == {}
    errors, warnings = gpumem.problems([g], {0: {OURS: 0.90}})
    assert errors == [] and len(warnings) == 1
    # the same read without our process holding the device: 126 GiB held by someone else, a stop
    [g] = _g(["0, GPU-1, 143771, 129057, 14098"], [], {})
    assert g.held_by_others == 129057 and gpumem.problems([g], {0: {OURS: 0.90}})[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="the deploy's preflight on @local needs root or passwordless sudo")
def test_a_deploy_on_at_local_says_the_line_and_stops_before_any_operation(tmp_path):
    """`vllm-fleet deploy @local --spec S --dry` for real (pyinfra's local connector, serve's one
    state read on this machine, a stand-in nvidia-smi on PATH showing the desk's 3090): the
    deploy prints the GPU's line and stops before any operation (pyinfra's exit, 3)."""
    import sys

    import yaml

    spec = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "deployments" / "rtx3090-qwen7b-awq-batch.yaml").read_text()
    )
    spec["server"]["api_key"] = {"file": str(tmp_path / "key"), "generate": True}
    spec["model"]["hub_fetch"] = "host"  # nothing fetched on this machine while planning
    spec["install"]["wheels"] = "host"
    (tmp_path / "batch.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    env = _stub(tmp_path, DESK_SMI, [])
    (tmp_path / "bin" / "nvidia-smi").write_text(  # the nvidia role's own query too: the desk's card
        f'#!/bin/sh\ncase "$1" in --query-gpu=name,*) echo "NVIDIA GeForce RTX 3090, 24576, 580.159.04, 8.6" ;; '
        f'--query-gpu=*) cat {tmp_path}/smi.txt ;; --query-compute-apps=*) cat {tmp_path}/apps.txt ;; esac\n'
    )
    r = subprocess.run(
        [sys.executable, "-m", "vllm_fleet", "deploy", "@local", "--spec", str(tmp_path / "batch.yaml"), "--dry"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 4, out[-3000:]
    assert "[@local] GPU 0: 24.0 GiB total, 1.2 GiB held by other processes, planning with 22.5 GiB" in out, out[-3000:]
    assert "host @local: not enough free GPU memory" in out and "0.94 or lower" in out, out[-3000:]
    assert not (tmp_path / "key").exists()  # --dry: nothing written, not even here


# -- the read as the H200 answered it (tests/roles/fixtures/nvidia-smi/README.md) -----------------

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "nvidia-smi"
H200_UUID = "GPU-c51a8fc2-a1f6-4f60-2964-713316a11e72"
H200_UNITS = {f"vllm-h200-kv-offload-{i}.service" for i in range(4)}


def _h200_read() -> Snapshot:
    """The captured answer, its `gpus` lines in the read's five fields (pci.bus_id dropped), and
    the minor the driver's file gives (h200-information.txt: Device Minor 0)."""
    lines = []
    for line in (FIXTURES / "h200-read-3-replicas.txt").read_text().splitlines():
        kind, key, value = line.split("\t", 2) if line.count("\t") >= 2 else (line, "", "")
        if kind == "gpus":
            fields = value.split(", ")
            value = value if value == "." else ", ".join(fields[:2] + fields[3:])
            key = gpumem.MEMORY_FIELDS
        lines.append("\t".join((kind, key, value)) if kind != "end" else line)
    lines.insert(-1, f"gpuminor\t{H200_UUID}\t0")
    snap = Snapshot.parse(lines)
    snap.query = gpumem.query()
    return snap


def test_the_h200s_read_with_three_replicas_running_is_planned_as_ours():
    """Three replicas of the x4 spec held 42.2 GiB of the H200 when it was read; their processes'
    cgroups are under the harness's /process_api/... prefix. Every MiB nvidia-smi lists is this
    deployment's (a re-deploy restarts them): planned with, not held by others."""
    snap = _h200_read()
    known, smi = snap.nvidia_smi(gpumem.MEMORY_FIELDS)
    _, apps, holders = snap.gpu_apps(gpumem.APPS_FIELDS)
    [g] = gpumem.gpu_memory(smi, apps, holders, H200_UNITS, snap.gpu_minors)
    # the API servers (pids 7365, 7806, 8519) hold /dev/nvidia0 unlisted: the 20 MiB no listed
    # process explains may be theirs, so it is "not attributed", not someone else's
    assert known and g.minor == 0 and g.others == {} and g.unattributed == 20
    assert g.ours == {
        "vllm-h200-kv-offload-0.service": 14652,
        "vllm-h200-kv-offload-1.service": 14302,
        "vllm-h200-kv-offload-2.service": 14302,
    }
    assert (g.held_by_others, g.plannable) == (0, 99880 + 43256)
    assert gpumem.describe(g).startswith("GPU 0: 140.4 GiB total, 0.0 GiB held by other processes, 42.2 GiB by")
    # the four replicas' 0.4 of the GPU (0.1 each) fit in what is plannable: no problem
    assert gpumem.problems([g], {0: {u: 0.1 for u in H200_UNITS}}) == ([], [])
    # the same read seen by another deploy (none of those units its own): 42.3 GiB held by others
    [other] = gpumem.gpu_memory(smi, apps, holders, set(), snap.gpu_minors)
    assert other.ours == {} and other.held_by_others == 43276 and other.plannable == 99880


def test_several_gpus_match_their_device_files_by_the_drivers_minor_not_their_index():
    """Two GPUs whose minors are swapped against nvidia-smi's index (the driver's numbering): Xorg
    holding /dev/nvidia1 is named on index 0 (minor 1). Without the driver's files, several GPUs
    name no unlisted holder rather than guess."""
    smi = ["0, GPU-a, 24576, 900, 23600", "1, GPU-b, 24576, 10, 24490"]
    holders = {1523: {"minors": [1], "cgroup": "/system.slice/display-manager.service", "comm": "Xorg"}}
    g0, g1 = gpumem.gpu_memory(smi, [], holders, set(), {"GPU-a": 1, "GPU-b": 0})
    assert (g0.minor, g1.minor) == (1, 0)
    assert g0.others == {"Xorg (pid 1523)": None} and g1.others == {}
    g0, g1 = gpumem.gpu_memory(smi, [], holders, set(), {})
    assert g0.others == {} and g1.others == {} and g0.minor is None


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/proc/driver").is_dir(), reason="a mount namespace needs root")
def test_the_state_read_takes_each_gpus_minor_from_the_drivers_file(tmp_path):
    """host_state.sh for real, with the H200's /proc/driver/nvidia/gpus/*/information bound over
    /proc/driver in a mount namespace of its own (unshare -m) and a stand-in nvidia-smi."""
    env = _stub(tmp_path, [f"0, {H200_UUID}, 143771, 0, 143000"], [])
    gpus = tmp_path / "driver" / "nvidia" / "gpus" / "0000:00:06.0"
    gpus.mkdir(parents=True)
    (gpus / "information").write_text(
        (FIXTURES / "h200-information.txt").read_text().replace("Minor: \t 0", "Minor: \t 3")
    )
    query = gpumem.query()
    read = shlex.quote(HostState().command(query).get_raw_value())
    script = f"mount --bind {tmp_path / 'driver'} /proc/driver && exec sh -c {read}"
    r = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    snap = Snapshot.parse(r.stdout.splitlines())
    snap.query = query
    assert snap.gpu_minors == {H200_UUID: 3}, r.stdout
    [g] = gpumem.gpu_memory(snap.nvidia_smi(gpumem.MEMORY_FIELDS)[1], [], {}, set(), snap.gpu_minors)
    assert g.minor == 3 and g.total == 143771
