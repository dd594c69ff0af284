"""The two multi-GPU layouts of issue 26's proof (bench/gpu/x2_proof.sh), as rendered: what the
2-GPU machine will run, checked here without one.

- TP 2 (deployments/h200-qwen7b-bf16-tp2.yaml): one unit that sees both GPUs;
- one replica per GPU (deployments/h200x2-qwen7b-replicas.yaml): two units, each with its own GPU,
  port and state, behind one nginx upstream that lists both;
- both: the machine's NVLink-multicast rule in the environment every vLLM reads, and the GPU
  sandbox (no capabilities, /dev/shm shared within the unit, SysV IPC removed, the syscall filter).
"""

from __future__ import annotations

import re
from pathlib import Path

from vllm_fleet.render import files as render
from vllm_fleet.specs import load as spec

REPO = Path(__file__).resolve().parent.parent
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _files(name: str) -> dict[str, str]:
    r = spec.resolve(spec.load(REPO / "deployments" / f"{name}.yaml"))
    # per target (server, proxy, ...): {host path: RenderedFile}; the targets' paths do not overlap here
    return {path: f.content for target in render.render(r).values() for path, f in target.items()}


def _env(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#") and "=" in line)


def _units(files: dict[str, str]) -> dict[str, str]:
    return {p: t for p, t in files.items() if re.search(r"/vllm-[\w.-]+-\d+\.service$", p)}


def _assert_gpu_sandbox(unit: str) -> None:
    for line in (
        "CapabilityBoundingSet=",
        "RestrictNamespaces=yes",
        "RemoveIPC=yes",
        "PrivateTmp=yes",
        "SystemCallFilter=@system-service",
        "SystemCallErrorNumber=EPERM",
        "LimitMEMLOCK=infinity",
    ):
        assert line in unit.splitlines(), f"{line!r} missing from the GPU unit"
    # a device allow-list would shut out /dev/nvidia*; /dev/shm must stay the host's (NCCL's shared memory)
    assert "PrivateDevices=yes" not in unit and "DevicePolicy=closed" not in unit
    assert not any(
        l.startswith(("InaccessiblePaths=/dev/shm", "TemporaryFileSystem=/dev/shm")) for l in unit.splitlines()
    )


def test_tp2_is_one_unit_that_sees_both_gpus():
    files = _files("h200-qwen7b-bf16-tp2")
    units = _units(files)
    assert list(units) == ["/etc/systemd/system/vllm-h200-qwen7b-bf16-tp2-0.service"]
    replica = _env(files["/etc/vllm-fleet/h200-qwen7b-bf16-tp2/replica-0.env"])
    assert replica["CUDA_VISIBLE_DEVICES"] == "0,1"
    env = _env(files["/etc/vllm-fleet/h200-qwen7b-bf16-tp2/vllm.env"])
    assert {k: env.get(k) for k in NVLS_OFF} == NVLS_OFF
    unit = next(iter(units.values()))
    _assert_gpu_sandbox(unit)
    assert re.search(r"--tensor-parallel-size[ =]2\b", unit)


def test_one_replica_per_gpu_each_sees_only_its_own():
    name = "h200x2-qwen7b-replicas"
    files = _files(name)
    units = _units(files)
    assert sorted(units) == [f"/etc/systemd/system/vllm-{name}-{i}.service" for i in (0, 1)]
    seen = [_env(files[f"/etc/vllm-fleet/{name}/replica-{i}.env"])["CUDA_VISIBLE_DEVICES"] for i in (0, 1)]
    assert seen == ["0", "1"]
    env = _env(files[f"/etc/vllm-fleet/{name}/vllm.env"])
    assert {k: env.get(k) for k in NVLS_OFF} == NVLS_OFF
    ports = []
    for i, unit in enumerate(units[f"/etc/systemd/system/vllm-{name}-{n}.service"] for n in (0, 1)):
        _assert_gpu_sandbox(unit)
        assert f"replica-{i}.env" in unit
        assert "--tensor-parallel-size" not in unit or re.search(r"--tensor-parallel-size[ =]1\b", unit)
        ports.append(int(re.search(r"--port[ =](\d+)", unit).group(1)))
    assert ports == [8000, 8001]
    site = files[f"/etc/nginx/conf.d/vllm-fleet-{name}.conf"]
    for port in ports:
        assert re.search(rf"server 127\.0\.0\.1:{port}\b", site), f"replica on {port} not in the upstream"


# --- the syscall filter, read back by systemd's own parser (issue 39) ----------------------------


def _security(tmp_path: Path, unit: str) -> dict[str, dict]:
    """``systemd-analyze security --offline=true --json=short`` of a rendered unit: systemd 252's own
    reading of its sandbox, one entry per check (e.g. ``SystemCallFilter=~@debug``)."""
    import json
    import shutil
    import subprocess

    import pytest

    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze not installed (apt-get install systemd)")
    path = tmp_path / "vllm-probe.service"
    path.write_text(unit)
    out = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--json=short", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip(), out.stderr
    return {c["name"]: c for c in json.loads(out.stdout)}


def _syscall_checks(checks: dict[str, dict]) -> dict[str, tuple]:
    return {k: (c["set"], c["description"]) for k, c in checks.items() if k.startswith("SystemCallFilter=")}


def test_a_tp2_unit_allows_pidfd_getfd_and_nothing_else_beyond_system_service(tmp_path):
    """CUDA IPC of cuMem memory between a host's ranks needs pidfd_getfd (in @debug, not in
    @system-service). systemd's parser must read exactly one change against a one-GPU unit: @debug
    allowed, with pidfd_getfd the call it names; every other syscall group as before."""
    tp2 = next(iter(_units(_files("h200-qwen7b-bf16-tp2")).values()))
    tp1 = next(iter(_units(_files("h200-qwen7b-bf16")).values()))
    lines = [l for l in tp2.splitlines() if l.startswith("SystemCall")]
    assert lines == [
        "SystemCallArchitectures=native",
        "SystemCallFilter=@system-service",
        "SystemCallFilter=pidfd_getfd",
        "SystemCallErrorNumber=EPERM",
    ]
    two = _syscall_checks(_security(tmp_path, tp2))
    one = _syscall_checks(_security(tmp_path, tp1))
    debug = "SystemCallFilter=~@debug"
    assert one[debug][0] is True and "@debug is not included" in one[debug][1]
    assert two[debug][0] is False and "pidfd_getfd is allowed" in two[debug][1], two[debug]
    assert {k: v for k, v in two.items() if k != debug} == {k: v for k, v in one.items() if k != debug}


def test_a_one_gpu_unit_keeps_the_plain_system_service_filter(tmp_path):
    """One GPU per instance (TP 1, replicas per GPU): no rank shares memory with another, so the
    filter stays @system-service alone (systemd-analyze security: @debug not included)."""
    for name in ("h200-qwen7b-bf16", "h200x2-qwen7b-replicas"):
        for unit in _units(_files(name)).values():
            assert "SystemCallFilter=pidfd_getfd" not in unit.splitlines()
            checks = _security(tmp_path, unit)
            assert checks["SystemCallFilter=~@debug"]["set"] is True, (name, checks["SystemCallFilter=~@debug"])
