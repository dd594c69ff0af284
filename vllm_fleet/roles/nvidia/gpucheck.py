"""Compare the GPUs a host reports with the spec's hardware section (no pyinfra, no host)."""

from __future__ import annotations

from .defaults import GPU_MATCH, GPU_MEMORY_TOLERANCE


def _matches(gpu: dict, substring: str, gib: float) -> bool:
    low, high = gib * 1024 * (1 - GPU_MEMORY_TOLERANCE), gib * 1024 * (1 + GPU_MEMORY_TOLERANCE)
    return substring.lower() in gpu["name"].lower() and low <= gpu["memory_mib"] <= high


def describe(gpus: list[dict]) -> str:
    if not gpus:
        return "no GPU"
    return ", ".join(f"GPU {g['index']}: {g['name']} ({g['memory_mib']} MiB)" for g in gpus)


def gpu_mismatch(gpus: list[dict], hardware: dict, host_name: str) -> str | None:
    """A message naming the host when it has fewer than ``gpus_per_node`` GPUs of ``hardware.gpu``.

    A GPU matches by name substring and memory (see defaults.GPU_MATCH). More matching GPUs than
    needed is fine (the deployment uses a subset). A catalogue name without a match rule is
    checked by count only.
    """
    want = hardware.get("gpu")
    count = int(hardware["gpus_per_node"])
    if not want or want == "cpu":
        return None
    rule = GPU_MATCH.get(want)
    matching = [g for g in gpus if rule is None or _matches(g, *rule)]
    if len(matching) >= count:
        return None
    expected = f"{count} x {want}"
    if rule:
        expected += f" (nvidia-smi name containing {rule[0]!r}, about {rule[1]} GiB)"
    return (
        f"host {host_name}: the spec asks for {expected} (hardware.gpu / hardware.gpus_per_node) "
        f"but nvidia-smi reports {len(matching)} matching: {describe(gpus)}. "
        f"Fix hardware.gpu / hardware.gpus_per_node, or deploy this spec to other hosts."
    )
