"""Another vllm-fleet deployment already on a host (vllm_fleet/roles/common/clash.py): what it holds
is read by host_state.sh's `glob` for real (sh, a temporary tree laid out as a host's /etc), and a
port, GPU or nginx default-server clash is refused with the deployment and the fix named.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from vllm_fleet.roles.common import clash
from vllm_fleet.host.state import HostState, Query, Snapshot

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden" / "8xh100-qwen7b-tp2x4+inventory" / "h100-a"


def _read(query: Query) -> Snapshot:
    cmd = HostState().command(query).get_raw_value()
    r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    s = Snapshot.parse(r.stdout.splitlines())
    s.query = query
    return s


def _host_tree(tmp_path: Path) -> dict[str, str]:
    """The golden qwen7b-tp2x4 host's units, replica envs and site under tmp_path: {glob: tmp glob}."""
    for sub in ("etc/systemd/system", "etc/nginx/conf.d", "etc/vllm-fleet/qwen7b-tp2x4"):
        (tmp_path / sub).mkdir(parents=True)
        for f in (GOLDEN / sub).iterdir():
            if f.is_file() and (f.suffix in (".service", ".conf") or f.name.startswith("replica-")):
                (tmp_path / sub / f.name).write_text(f.read_text())
    return {g: str(tmp_path) + g for g in (clash.UNITS, clash.SITES, clash.REPLICA_ENVS)}


def test_the_state_read_finds_what_another_deployment_holds(tmp_path):
    globs = _host_tree(tmp_path)
    snap = _read(Query(globs=tuple(globs.values()) + (str(tmp_path / "none-*.x"),)))
    assert snap.matching(str(tmp_path / "none-*.x")) == {}  # nothing matched: known, empty
    assert snap.matching("/etc/not-asked-*") is None  # not asked: unknown
    found = {g: {p.removeprefix(str(tmp_path)): t for p, t in snap.matching(tg).items()} for g, tg in globs.items()}
    units = sorted(found[clash.UNITS])
    assert units == [f"/etc/systemd/system/vllm-qwen7b-tp2x4-{i}.service" for i in range(4)]
    assert found[clash.UNITS][units[1]] == (GOLDEN / units[1][1:]).read_text()  # the file itself
    states = {
        p.removeprefix(str(tmp_path)): st for p in snap.matching(globs[clash.UNITS]) if (st := snap.unit_file_state(p))
    }
    assert sorted(states) == units  # each unit file's (is-active, is-enabled), as this machine's systemctl says
    held = clash.held_on_host(found)["qwen7b-tp2x4"]  # states unknown: every unit holds
    assert held.ports == {8000 + i: f"vllm-qwen7b-tp2x4-{i}.service" for i in range(4)}
    assert held.gpus == {g: f"vllm-qwen7b-tp2x4-{g // 2}.service" for g in range(8)}
    assert [(listen, sn, default) for listen, sn, default, _ in held.sites] == [(80, "_", True)]


def _want(ports=(), gpus=(), site=None) -> clash.Held:
    return clash.Held(
        {p: f"vllm-new-{i}.service" for i, p in enumerate(ports)},
        [site] if site else [],
        {g: ["vllm-new-0.service"] for g in gpus},
    )


def test_clashes_name_the_other_deployment_and_the_fix(tmp_path):
    theirs = {
        "old": clash.Held(
            {8000: "vllm-old-0.service"},
            [(80, "_", True, "/etc/nginx/conf.d/vllm-fleet-old.conf")],
            {0: ["vllm-old-0.service"], 1: ["vllm-old-0.service"]},
        )
    }
    lines = clash.clashes({"new": _want([8000], [1], (80, "_", True, "proxy.listen 80"))}, theirs, {"new"})
    assert lines == [
        "port 8000 (vllm-new-0.service) is taken by deployment 'old' (vllm-old-0.service): give new another "
        "server.port",
        "GPU 1 (vllm-new-0.service) is used by deployment 'old' (vllm-old-0.service): give new other GPUs (hardware, "
        "replicas), or this host to one of them",
        "nginx port 80: both are the default server (/etc/nginx/conf.d/vllm-fleet-old.conf of deployment 'old'): give "
        "new its own proxy.server_name or proxy.listen",
    ]
    # no clash: other ports, other GPUs, a named server on the same nginx port
    assert (
        clash.clashes({"new": _want([8100], [2, 3], (80, "api.example", False, "proxy.listen 80"))}, theirs, {"new"})
        == []
    )
    # the same deployment again (a redeploy), or one this deploy manages too: not "another"
    assert clash.clashes({"old": _want([8000], [0])}, theirs, {"old"}) == []
    assert clash.clashes({"new": _want([8000])}, theirs, {"new", "old"}) == []


def test_refuse_raises_before_anything_and_knows_nothing_without_a_read():
    from pyinfra.api.exceptions import DeployError

    class Node:
        instances = [type("I", (), {"port": 8000, "unit": "vllm-new-0.service", "gpu_ids": None})()]
        roles = {"server"}

    h = type("H", (), {"parts": {"new": Node()}})()
    specs = {"new": {}}
    clash.refuse(specs, h, "lab1", Snapshot())  # nothing read: nothing refused
    s = Snapshot.parse(
        [
            "glob\t" + clash.UNITS + "\t.",
            "glob\t"
            + clash.UNITS
            + "\t/etc/systemd/system/vllm-old-0.service\t"
            + __import__("base64").b64encode(b"ExecStart=/x/vllm serve m --host 127.0.0.1 --port 8000\n").decode(),
            "glob\t" + clash.SITES + "\t.",
            "glob\t" + clash.REPLICA_ENVS + "\t.",
            "end",
        ]
    )
    s.query = clash.query()
    with pytest.raises(
        DeployError,
        match=(
            r"(?s)host lab1: another vllm-fleet deployment .*\n  port 8000 .* deployment 'old'.*nothing was "
            r"uploaded or changed"
        ),
    ):
        clash.refuse(specs, h, "lab1", s)


def test_a_stopped_disabled_unit_left_behind_holds_nothing():
    assert clash.holds(None) and clash.holds(("active", "enabled")) and clash.holds(("inactive", "enabled"))
    assert clash.holds(("activating", "disabled")) and clash.holds(("failed", "enabled"))  # a crash loop, or at boot
    assert (
        not clash.holds(("inactive", "disabled"))
        and not clash.holds(("failed", "disabled"))
        and not clash.holds(("inactive", ""))
    )
    assert clash.holds(("", ""))  # no answer: holds
    unit = "/etc/systemd/system/vllm-old-0.service"
    found = {clash.UNITS: {unit: "ExecStart=/x/vllm serve m --port 8000\n"}, clash.SITES: {}, clash.REPLICA_ENVS: {}}
    assert clash.held_on_host(found, {unit: ("inactive", "disabled")}).get("old", clash.Held()).ports == {}
    assert clash.held_on_host(found, {unit: ("", "")})["old"].ports == {
        8000: "vllm-old-0.service"
    }  # systemctl could not say
    assert clash.held_on_host(found, {unit: ("active", "disabled")})["old"].ports == {8000: "vllm-old-0.service"}


def _gpu_host(share: str | None) -> dict:
    """A host with deployment old's one replica on GPU 0 (its --gpu-memory-utilization: share)."""
    flag = f" --gpu-memory-utilization {share}" if share else ""
    return {
        clash.UNITS: {"/etc/systemd/system/vllm-old-0.service": f"ExecStart=/x/vllm serve m{flag} --port 8000\n"},
        clash.SITES: {},
        clash.REPLICA_ENVS: {"/etc/vllm-fleet/old/replica-0.env": "CUDA_VISIBLE_DEVICES=0\n"},
    }


def test_a_gpu_is_shared_with_another_deployment_while_the_shares_fit():
    """Several models on one GPU from separate deploys (issue 23 part 2): allowed while every
    vLLM's --gpu-memory-utilization on the GPU sums to at most 1, refused with the numbers."""
    theirs = clash.held_on_host(_gpu_host("0.45"))
    assert theirs["old"].on_gpu(0) == {"vllm-old-0.service": 0.45}
    half = clash.Held({8100: "vllm-new-0.service"})
    half.use_gpu(0, "vllm-new-0.service", 0.45)
    assert clash.clashes({"new": half}, theirs, {"new"}) == []  # 0.45 + 0.45 fits
    big = clash.Held({8100: "vllm-new-0.service"})
    big.use_gpu(0, "vllm-new-0.service", 0.9)
    assert clash.clashes({"new": big}, theirs, {"new"}) == [
        "GPU 0 (vllm-new-0.service) is shared with deployment 'old' (vllm-old-0.service): vllm-new-0.service 0.9 + "
        "vllm-old-0.service 0.45 (deployment 'old') = 1.35 of its memory (each vLLM takes its --gpu-memory-utilization "
        "share of the whole GPU at start): lower engine.gpu_memory_utilization of new so the shares sum to at most 1, "
        "give new other GPUs (hardware.gpu_ids), or this host to one of them"
    ]
    # two replicas of ours on the GPU (replicas.per_gpu) count both
    two = clash.Held({8100: "vllm-new-0.service", 8101: "vllm-new-1.service"})
    two.use_gpu(0, "vllm-new-0.service", 0.3)
    two.use_gpu(0, "vllm-new-1.service", 0.3)
    assert len(clash.clashes({"new": two}, theirs, {"new"})) == 1  # 0.3 + 0.3 + 0.45
    # a unit without the flag (vLLM's default 0.9, or not ours to know): it takes the GPU
    assert clash.clashes({"new": half}, clash.held_on_host(_gpu_host(None)), {"new"}) == [
        "GPU 0 (vllm-new-0.service) is used by deployment 'old' (vllm-old-0.service): give new other GPUs (hardware, "
        "replicas), or this host to one of them"
    ]


def test_what_this_deploy_wants_carries_each_replicas_share():
    class Inst:
        def __init__(self, i):
            self.port, self.unit, self.gpu_ids = 8100 + i, f"vllm-new-{i}.service", [0]

    node = type("N", (), {"instances": [Inst(0), Inst(1)], "roles": {"server"}})()
    spec = {"engine": {"gpu_memory_utilization": 0.8}, "replicas": {"per_gpu": 2}, "proxy": {}}
    want = clash.wanted({"new": spec}, type("H", (), {"parts": {"new": node}})())["new"]
    assert want.on_gpu(0) == {"vllm-new-0.service": 0.4, "vllm-new-1.service": 0.4}
