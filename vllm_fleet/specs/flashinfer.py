"""FlashInfer's pre-built kernels for hosts that cannot download them (issue 25).

vLLM's CUDA wheels depend on ``flashinfer-python`` at one exact version (vLLM 0.33.0:
``flashinfer-python==0.7.2.post1``). Its kernels come three ways:

- ``flashinfer-cubin`` (same version, exactly): pre-built cubins (the trtllm-gen attention and MoE
  kernels FlashInfer picks on Blackwell, some Hopper kernels). Without it FlashInfer downloads
  them from its artifact server at first use, which an offline host cannot. vLLM up to ~0.25
  required it (0.20.2: ``flashinfer-cubin==0.6.8.post1``); since then it is no requirement, so a
  plain ``pip install vllm`` or ``pip download vllm`` leaves it out.
- JIT: the remaining kernels are compiled at first use with ``nvcc`` (CUDA_HOME, ``nvcc`` on
  PATH or ``/usr/local/cuda``). PyPI's torch brings no nvcc ("Could not find nvcc"); the nvidia
  role installs a CUDA toolkit unless host data ``nvidia_install_toolkit: false``.
- ``flashinfer-jit-cache`` (same version, a build per CUDA version, ``+cu130``): the JIT kernels
  compiled in advance, from FlashInfer's own wheel index only (not the package index).

The vllm role installs ``flashinfer-cubin==<the env's flashinfer-python>`` with vLLM from the same
source (index or wheelhouse); the fleet wheelhouse downloads it beside vLLM; ``validate`` warns
where a given wheelhouse lacks it and where a chosen feature needs FlashInfer's JIT on an offline
host. Nothing here imports pyinfra (part of the core).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable

PYTHON = "flashinfer-python"
CUBIN = "flashinfer-cubin"
JIT_CACHE = "flashinfer-jit-cache"

_PIN = re.compile(r"^\s*flashinfer[-_.]python\s*==\s*([^\s;,]+)", re.I)


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_python(requires_dist: Iterable[str]) -> str | None:
    """The ``flashinfer-python`` version a distribution pins with ``==`` (vLLM's Requires-Dist), or None."""
    for req in requires_dist:
        if ";" in req and "extra ==" in req.split(";", 1)[1]:
            continue
        m = _PIN.match(req)
        if m:
            return m.group(1)
    return None


def companions(versions: dict[str, str | None]) -> list[str]:
    """What must join an install whose resolved set is ``versions`` ({distribution: version}):
    ``flashinfer-cubin==V`` when flashinfer-python V is in it and the cubin is not at V."""
    v = {norm(k): val for k, val in versions.items()}
    have = v.get(PYTHON)
    if not have or v.get(CUBIN) == have:
        return []
    return [f"{CUBIN}=={have}"]


def report_versions(report: dict[str, Any]) -> dict[str, str]:
    """{distribution: version} of a ``pip install --dry-run --report`` document's ``install`` list."""
    return {norm(it["metadata"]["name"]): it["metadata"]["version"] for it in report.get("install", [])}


def resolved_set(report: dict[str, Any], vllm_version: str) -> dict[str, str]:
    """The FlashInfer part of what installing ``vllm==vllm_version`` resolves to, from a report
    (``--no-deps`` reports too: vLLM's own pin names flashinfer-python's version):
    ``{"flashinfer-python": V, "flashinfer-cubin": V or absent}``."""
    out: dict[str, str] = {}
    for it in report.get("install", []):
        md = it["metadata"]
        if norm(md["name"]) == "vllm" and md["version"] == vllm_version:
            pin = pinned_python(md.get("requires_dist") or [])
            if pin:
                out[PYTHON] = pin
            for req in md.get("requires_dist") or []:
                m = re.match(r"^\s*flashinfer[-_.]cubin\s*==\s*([^\s;,]+)", req, re.I)
                if m and not (";" in req and "extra ==" in req):
                    out[CUBIN] = m.group(1)
    return out


def wheel_versions(directory: str | Path) -> dict[str, set[str]]:
    """{distribution: {versions}} of the wheels in a directory (from their file names, PEP 427)."""
    out: dict[str, set[str]] = {}
    for p in Path(directory).glob("*.whl"):
        parts = p.name[:-4].split("-")
        if len(parts) >= 5:
            out.setdefault(norm(parts[0]), set()).add(parts[1])
    return out


def wheelhouse_lacks_cubin(directory: str | Path) -> str | None:
    """The flashinfer-python version whose cubin package a wheelhouse lacks, or None (no
    flashinfer-python in it, or the matching cubin is there)."""
    have = wheel_versions(directory)
    missing = sorted(v for v in have.get(PYTHON, ()) if v not in have.get(CUBIN, set()))
    return missing[-1] if missing else None


#: Features that make vLLM use FlashInfer kernels compiled at first use (JIT): the FlashInfer
#: attention backend (chosen, or vLLM's default on Blackwell, compute capability 10+), its
#: sampler. (On Hopper and Ampere vLLM's default attention is FlashAttention: no JIT.)
JIT_ENV = {"VLLM_ATTENTION_BACKEND": "FLASHINFER", "VLLM_USE_FLASHINFER_SAMPLER": "1"}


def jit_features(resolved: dict[str, Any], compute_capability: float | None) -> list[str]:
    """Why this spec's vLLM will JIT-compile FlashInfer kernels (human-readable), [] when it will not."""
    why = []
    env = {k: str(v) for k, v in (resolved.get("env") or {}).items()}
    for key, val in JIT_ENV.items():
        if env.get(key, "").upper() == val:
            why.append(f"env.{key}={val}")
    args = [str(a) for a in resolved["engine"]["extra_args"]]
    for i, a in enumerate(args):
        if a == "--attention-backend" and i + 1 < len(args) and args[i + 1].upper() == "FLASHINFER":
            why.append("engine.extra_args --attention-backend FLASHINFER")
        elif a.upper() == "--ATTENTION-BACKEND=FLASHINFER":
            why.append(f"engine.extra_args {a}")
    if compute_capability is not None and compute_capability >= 10 and not why:
        why.append(
            f"hardware.gpu (compute capability {compute_capability:g}: vLLM's default attention there is FlashInfer's)"
        )
    return why
