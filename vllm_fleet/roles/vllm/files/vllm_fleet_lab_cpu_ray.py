"""vllm-fleet LAB-ONLY adaptation: lets vLLM's CPU build use the Ray executor (CPU lab only).

Installed by vllm-fleet's vllm role into the deployment's Python env ONLY when the spec says
``install.accelerator: cpu`` and ``parallel.backend: ray`` (never for ``cuda``), together with
``vllm_fleet_lab_cpu_ray.pth``, which imports this module at interpreter start in every process
of that env: the vLLM API server on the head and the Ray worker processes on every node (Ray
starts them with the env's python).

What it changes, and nothing else (each right after vLLM's own module is imported):

1. ``vllm.platforms.cpu``: the CPU platform declares ``ray_device_key = ""`` ("this platform does
   not support Ray"); this sets it to ``"GPU"``, so vLLM's Ray executor places one worker per Ray
   "GPU". The Ray nodes of a CPU deployment are started with ``--num-gpus 1`` (gpus_per_node) by
   the rendered units, so each lab host offers exactly one such slot: stage N lands on node N.
2. ``vllm.distributed.device_communicators.cpu_communicator``: the CPU build's shared-memory
   communicator (``/dev/shm`` segments) names its segment from the rendezvous port only, so the
   ranks of a group on *different hosts* agree on one name and each opens a segment that exists
   only on the other host ("open shm in SHMManager failed. errno: 2"). The host's address
   (``VLLM_HOST_IP``) is added to the name: ranks on one host still share it, a group spanning
   hosts sees different names and vLLM falls back to torch.distributed (gloo over the network),
   its own documented fallback ("ranks do not share the same SHM group name").
3. ``vllm.v1.worker.gpu_model_runner`` (the CPU runner inherits it): a later pipeline stage copies
   what it receives into a buffer that only the warm-up's dummy run allocates; the CPU build skips
   that warm-up with ``enforce_eager`` (compilation mode NONE and an explicit KV cache size), so
   stage 2 fails its first request with ``assert self.intermediate_tensors is not None``. The
   buffer is allocated on first use, exactly as the dummy run would have.

The other two things the CPU lab needs are not patches but settings every deployment gets:
``GLOO_SOCKET_IFNAME`` naming the interface that holds the node's address and ``VLLM_HOST_IP``
set to it (node.env, written by vllm_fleet/roles/ray).

Removing: delete this file and the .pth beside it (the vllm role removes both when the spec is no
longer cpu + ray).
"""

from __future__ import annotations

import importlib.abc
import os
import socket
import sys

RAY_DEVICE_KEY = "GPU"


def _patch_platform(module) -> None:
    platform = getattr(module, "CpuPlatform", None)
    if platform is not None and not getattr(platform, "ray_device_key", ""):
        platform.ray_device_key = RAY_DEVICE_KEY


def _patch_shm_name(module) -> None:
    shm = getattr(module, "_CPUSHMDistributed", None)
    original = getattr(shm, "make_group_name", None)
    if original is None or getattr(original, "_vllm_fleet_host", False):
        return

    def make_group_name(communicator):
        host = os.environ.get("VLLM_HOST_IP") or socket.gethostname()
        return f"{original(communicator)}-{host}"

    make_group_name._vllm_fleet_host = True
    shm.make_group_name = staticmethod(make_group_name)


def _patch_pp_buffer(module) -> None:
    runner = getattr(module, "GPUModelRunner", None)
    original = getattr(runner, "sync_and_gather_intermediate_tensors", None)
    if original is None or getattr(original, "_vllm_fleet_alloc", False):
        return

    def sync_and_gather_intermediate_tensors(self, *args, **kwargs):
        if self.intermediate_tensors is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device
            )
        return original(self, *args, **kwargs)

    sync_and_gather_intermediate_tensors._vllm_fleet_alloc = True
    runner.sync_and_gather_intermediate_tensors = sync_and_gather_intermediate_tensors


PATCHES = {
    "vllm.platforms.cpu": _patch_platform,
    "vllm.distributed.device_communicators.cpu_communicator": _patch_shm_name,
    "vllm.v1.worker.gpu_model_runner": _patch_pp_buffer,
}


class _Loader(importlib.abc.Loader):
    def __init__(self, wrapped):
        self._wrapped = wrapped

    def create_module(self, spec):
        return self._wrapped.create_module(spec)

    def exec_module(self, module):
        self._wrapped.exec_module(module)
        PATCHES[module.__name__](module)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loaders of the modules in PATCHES so each patch lands right after it executes."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
