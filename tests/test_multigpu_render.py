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
from vllm_fleet.spec import load as spec

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
    for line in ("CapabilityBoundingSet=", "RestrictNamespaces=yes", "RemoveIPC=yes", "PrivateTmp=yes",
                 "SystemCallFilter=@system-service", "SystemCallErrorNumber=EPERM", "LimitMEMLOCK=infinity"):
        assert line in unit.splitlines(), f"{line!r} missing from the GPU unit"
    # a device allow-list would shut out /dev/nvidia*; /dev/shm must stay the host's (NCCL's shared memory)
    assert "PrivateDevices=yes" not in unit and "DevicePolicy=closed" not in unit
    assert not any(l.startswith(("InaccessiblePaths=/dev/shm", "TemporaryFileSystem=/dev/shm")) for l in unit.splitlines())


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
