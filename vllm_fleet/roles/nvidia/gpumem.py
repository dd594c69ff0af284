"""The GPU memory a deploy can plan with: the free memory of each GPU, not its total (issue 38).

A GPU in the machine under the desk also drives the desktop: the display server (Xorg, a
Wayland compositor) and the browser hold some of its memory. vLLM takes
``--gpu-memory-utilization`` x the GPU's whole memory at start and refuses to start when less
than that is free ("Free memory on device ... is less than desired GPU memory utilization",
vllm/v1/worker/utils.py ``request_memory``). So what a deploy can plan with on a GPU is its free
memory plus what this deploy's own vLLMs hold there now (a restart gives that back): never the
memory of a process outside this deploy's units.

Read in the deploy's one state read (:func:`query`): nvidia-smi's ``index,uuid,memory.total,
memory.used,memory.free`` per GPU, its compute processes (``--query-compute-apps``: the GPU, pid,
memory, name), every process holding a ``/dev/nvidiaN`` open with its cgroup and name (the
display server is no compute process: nvidia-smi's CSV does not list it) and each GPU's minor N
from the driver's ``/proc/driver/nvidia/gpus/*/information`` (nvidia-smi has no field for it:
the H200's 580 driver refuses ``minor_number``, and the whole query with it). A process is
this deploy's when its cgroup is one of the deploy's units on the host (by unit, not by name: a
desktop user's own ``vllm serve`` in a terminal is someone else's). A process whose cgroup this
read cannot see (another PID namespace) is neither: its memory is "not attributed", as is the
memory no listed process explains while a process of our units holds the device (nvidia-smi
listing nothing in a PID namespace); only a GPU that does not fit even when that memory is
counted as ours stops the deploy.

Plain functions of nvidia-smi's lines (:func:`gpu_memory`, :func:`describe`, :func:`problems`),
so tests feed them captured output; :func:`refuse` is the deploy's step (beside the clash check).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from vllm_fleet.host.state import Query, Snapshot

MEMORY_FIELDS = "index,uuid,memory.total,memory.used,memory.free"
APPS_FIELDS = "gpu_uuid,pid,used_memory,process_name"
MIB = 1024
ANY_MINOR = -1  # the minor of a machine's only GPU when the driver's files were not read


def query() -> Query:
    """What :func:`refuse` reads (the deploy's one state read)."""
    return Query(gpus=(MEMORY_FIELDS,), gpuapps=(APPS_FIELDS,))


@dataclass
class GpuMemory:
    """One GPU's memory as nvidia-smi reports it (MiB) and who holds it."""

    index: int
    uuid: str
    minor: int | None
    total: int
    used: int
    free: int
    ours: dict[str, int] = field(default_factory=dict)  # unit of this deploy -> MiB its processes hold
    others: dict[str, int | None] = field(
        default_factory=dict
    )  # name -> MiB (None: not listed by nvidia-smi, e.g. Xorg)
    unattributed: int = 0  # MiB of compute processes whose cgroup this read could not see

    @property
    def held_by_others(self) -> int:
        """MiB used by anything outside this deploy's units (the display server and the driver's
        own share included), less what could not be attributed."""
        return max(0, self.used - sum(self.ours.values()) - self.unattributed)

    @property
    def plannable(self) -> int:
        """MiB a vLLM of this deploy can take at its start: the free memory and what this deploy's
        own vLLMs hold now (their restart gives it back)."""
        return self.free + sum(self.ours.values())

    @property
    def cuda_total(self) -> int:
        """The total vLLM multiplies by its --gpu-memory-utilization (CUDA's: used + free; newer
        drivers keep a reserved part outside both)."""
        return self.used + self.free


def _int(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() else None


def parse_memory(lines: list[str], minors: dict[str, int] | None = None) -> list[GpuMemory]:
    """``nvidia-smi --query-gpu=index,uuid,memory.total,memory.used,memory.free
    --format=csv,noheader,nounits`` lines (``0, GPU-5d..., 24576, 1243, 23017``), each GPU's
    ``/dev/nvidiaN`` minor from ``minors`` ({uuid: N}, the driver's /proc files); a line that is
    not five fields with numeric memory (nvidia-smi's driver message) is skipped. The only GPU of
    a machine whose minor was not read takes every minor (:data:`ANY_MINOR`)."""
    out = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        index, uuid, total, used, free = parts
        nums = [_int(x) for x in (index, total, used, free)]
        if any(n is None for n in nums):
            continue
        minor = (minors or {}).get(uuid)
        out.append(GpuMemory(index=nums[0], uuid=uuid, minor=minor, total=nums[1], used=nums[2], free=nums[3]))  # type: ignore[arg-type]
    if len(out) == 1 and out[0].minor is None:
        out[0].minor = ANY_MINOR  # one GPU: every /dev/nvidiaN a process holds is that one
    return out


def parse_apps(lines: list[str]) -> list[dict[str, Any]]:
    """``nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory,process_name
    --format=csv,noheader,nounits`` lines: ``{"gpu_uuid", "pid", "mib" (None: [N/A]), "name"}``."""
    out = []
    for line in lines:
        parts = [p.strip() for p in line.split(",", 3)]
        if len(parts) != 4 or _int(parts[1]) is None:
            continue
        out.append({"gpu_uuid": parts[0], "pid": int(parts[1]), "mib": _int(parts[2]), "name": parts[3]})
    return out


def unit_of_cgroup(cgroup: str | None) -> str | None:
    """The systemd unit a cgroup path belongs to (``/system.slice/vllm-x-0.service`` ->
    ``vllm-x-0.service``; the innermost ``.service``), else None (a user session's scope)."""
    for part in reversed((cgroup or "").split("/")):
        if part.endswith(".service"):
            return part
    return None


def gpu_memory(
    smi: list[str],
    apps: list[str],
    holders: dict[int, dict],
    our_units: set[str],
    minors: dict[str, int] | None = None,
) -> list[GpuMemory]:
    """Each GPU's memory and who holds it, from the read's lines (:func:`parse_memory`,
    :func:`parse_apps`), ``holders`` ({pid: {"minors", "cgroup", "comm"}}) and ``minors`` ({uuid:
    N of /dev/nvidiaN}): a process is ours when its cgroup's unit is in ``our_units``. A GPU
    whose minor is not known (several GPUs, no /proc/driver/nvidia) names no unlisted holder."""
    gpus = parse_memory(smi, minors)
    by_uuid = {g.uuid: g for g in gpus}
    listed: set[tuple[int, str]] = set()
    for app in parse_apps(apps):
        g = by_uuid.get(app["gpu_uuid"])
        if g is None:
            continue
        listed.add((app["pid"], g.uuid))
        mib = app["mib"] or 0
        h = holders.get(app["pid"])
        if h is None or not h.get("cgroup"):
            g.unattributed += mib
            continue
        unit = unit_of_cgroup(h["cgroup"])
        if unit in our_units:
            g.ours[unit] = g.ours.get(unit, 0) + mib
        else:
            name = f"{os.path.basename(app['name']) or h.get('comm') or 'pid'} (pid {app['pid']})"
            g.others[name] = (g.others.get(name) or 0) + mib
    # processes nvidia-smi does not list (the display server, a compositor): named, without a figure
    for g in gpus:
        unlisted = max(0, g.used - sum(g.ours.values()) - sum(v or 0 for v in g.others.values()) - g.unattributed)
        for pid, h in sorted(holders.items()):
            holds = g.minor == ANY_MINOR or (g.minor is not None and g.minor in h.get("minors", []))
            if not holds or (pid, g.uuid) in listed:
                continue
            if unit_of_cgroup(h.get("cgroup")) in our_units:
                # our own process holds the GPU but nvidia-smi does not list it (it runs in another
                # PID namespace than the driver reports): the memory nobody is listed for may be ours
                g.unattributed += unlisted
                unlisted = 0
            else:
                g.others.setdefault(f"{h.get('comm') or 'pid'} (pid {pid})", None)
    return gpus


def _gib(mib: float) -> str:
    return f"{mib / MIB:.1f} GiB"


def describe(g: GpuMemory) -> str:
    """``GPU 0: 24.0 GiB total, 1.2 GiB held by other processes (Xorg (pid 1523)), planning with 22.5 GiB``."""
    parts = [f"GPU {g.index}: {_gib(g.total)} total"]
    names = sorted(g.others, key=lambda n: -(g.others[n] or 0))
    parts.append(f"{_gib(g.held_by_others)} held by other processes" + (f" ({', '.join(names)})" if names else ""))
    if g.ours:
        parts.append(
            f"{_gib(sum(g.ours.values()))} by this deployment ({', '.join(sorted(g.ours))}: given back when it "
            "restarts)"
        )
    if g.unattributed:
        parts.append(f"{_gib(g.unattributed)} by processes this read could not attribute (another PID namespace)")
    return ", ".join(parts) + f", planning with {_gib(g.plannable)}"


def problems(gpus: list[GpuMemory], shares: dict[int, dict[str, float]]) -> tuple[list[str], list[str]]:
    """(errors, warnings) for this deploy's vLLMs on each GPU: ``shares`` {gpu index: {unit:
    --gpu-memory-utilization}}. vLLM asks share x the GPU's memory at start; the units of one
    deploy on a GPU together must find that much free (a rolling restart: each finds the others'
    shares taken). An error when even the unattributed memory counted as ours does not give
    enough; a warning when only that memory would."""
    errors, warnings = [], []
    by_index = {g.index: g for g in gpus}
    for index, units in sorted(shares.items()):
        g = by_index.get(index)
        if g is None or not units:
            continue
        total_share = sum(units.values())
        need = g.cuda_total * total_share
        asks = " + ".join(f"{u} {s:g}" for u, s in sorted(units.items()))
        if need <= g.plannable:
            continue
        most = math.floor(100 * g.plannable / g.cuda_total) / 100 if g.cuda_total else 0.0
        what = (
            f"GPU {index}: {asks} = {total_share:g} x {g.cuda_total / MIB:.2f} GiB = {need / MIB:.2f} GiB asked at "
            f"start (engine.gpu_memory_utilization), but only {g.plannable / MIB:.2f} GiB is free for this deployment "
            f"({describe(g)})"
        )
        if need <= g.plannable + g.unattributed:
            warnings.append(f"{what}; it fits only if the processes not attributed are this deployment's own")
            continue
        errors.append(
            f"{what}: vLLM refuses to start with less free memory than that ('Free memory on device ... is less "
            f"than desired GPU memory utilization'). Fix: engine.gpu_memory_utilization {most:.2f} or lower "
            "(a GPU shared with a desktop: 0.95 -> 0.90), or close what holds the GPU"
        )
    return errors, warnings


def our_units(files: dict[str, Any], managed: set[str], snap: Snapshot | None = None) -> set[str]:
    """This deploy's units on a host: every unit file it renders there, and every replica unit of
    a deployment it manages that the read found there (a replica the layout no longer gives runs
    until it is pruned, after the new ones serve)."""
    from vllm_fleet.render.layout import SYSTEMD_DIR
    from vllm_fleet.roles.common.clash import UNITS, unit_of

    found = (snap.matching(UNITS) or {}) if snap is not None else {}
    return {os.path.basename(p) for p in files if p.startswith(f"{SYSTEMD_DIR}/") and p.endswith(".service")} | {
        os.path.basename(p) for p in found if unit_of(p) in managed
    }


def wanted_shares(specs: dict[str, dict[str, Any]], h: Any) -> dict[int, dict[str, float]]:
    """{gpu index: {unit: --gpu-memory-utilization}} of this deploy's vLLMs on host ``h``."""
    from vllm_fleet.roles.common.clash import wanted

    out: dict[int, dict[str, float]] = {}
    for held in wanted(specs, h).values():
        for gpu in held.units:
            out.setdefault(gpu, {}).update(held.on_gpu(gpu))
    return out


def check(specs: dict[str, dict[str, Any]], h: Any, snap: Snapshot) -> tuple[list[str], list[str], list[str]]:
    """(lines, errors, warnings) of host ``h``'s GPUs from the one read: one line per GPU this
    deploy uses there (:func:`describe`), and :func:`problems`. Nothing when the GPUs were not
    read (no nvidia-smi, a CPU spec)."""
    shares = wanted_shares(specs, h)
    known, smi = snap.nvidia_smi(MEMORY_FIELDS)
    known_apps, apps, holders = snap.gpu_apps(APPS_FIELDS)
    if not shares or not known or not known_apps:
        return [], [], []
    gpus = gpu_memory(smi or [], apps or [], holders, our_units(h.files, set(specs), snap), snap.gpu_minors)
    if not any(g.index in shares for g in gpus):
        return [not_read(sorted(shares), smi)], [], []
    lines = [describe(g) for g in gpus if g.index in shares]
    errors, warnings = problems(gpus, shares)
    return lines, errors, warnings


def not_read(indexes: list[int], smi: list[str] | None) -> str:
    """The line for GPUs the read could not size: no nvidia-smi on the host's PATH (the driver not
    installed yet: this deploy's nvidia part installs it), or its answer not a GPU's memory (its
    own message, e.g. that it cannot talk to the driver). vLLM then meets the GPU as it is."""
    gpus = ", ".join(str(i) for i in indexes)
    why = (
        "no nvidia-smi on the host's PATH"
        if smi is None
        else f"nvidia-smi said {(next((x for x in smi if x.strip()), '') or 'nothing').strip()[:160]!r}"
    )
    return (
        f"GPU {gpus}: free memory not read ({why}): planning with each GPU's total; "
        "what another process holds there is not known before vLLM starts"
    )


def refuse(specs: dict[str, dict[str, Any]], h: Any, host_name: str, snap: Snapshot, log: Any = None) -> None:
    """The deploy's step: say each GPU's line (``log``), warn, and raise DeployError before any
    operation exists when a GPU cannot give this deploy's vLLMs their share."""
    lines, errors, warnings = check(specs, h, snap)
    for line in lines + [f"warning: {w}" for w in warnings]:
        if log:
            log(line)
    if errors:
        from pyinfra.api.exceptions import DeployError

        raise DeployError(
            f"host {host_name}: not enough free GPU memory:\n  "
            + "\n  ".join(errors)
            + "\n  nothing was uploaded or changed"
        )


# -- this machine, for `vllm-fleet plan` and `validate` with an inventory holding @local ---------

LOCAL = "@local"


def read_here(q: Query) -> Snapshot:
    """The one state read's command (host_state.sh) run on this machine as a child process, as
    the deploy runs it on an @local host: nothing is contacted."""
    import subprocess

    from vllm_fleet.host.state import state_command

    r = subprocess.run(["sh", "-c", state_command(q).get_raw_value()], capture_output=True, text=True, timeout=120)
    snap = Snapshot.parse(r.stdout.splitlines())
    snap.query = q
    return snap


def report_here(
    resolved: list[dict[str, Any]], inventory: dict[str, Any] | None
) -> tuple[list[str], list[str], list[str]] | None:
    """(lines, errors, warnings) of this machine's GPUs for the specs' vLLMs on the inventory's
    ``@local`` host (:func:`check` on a read made here); None when the inventory has no @local
    host or puts no vLLM on a GPU there. Without nvidia-smi here: one line that says so."""
    if not inventory or LOCAL not in inventory:
        return None
    from vllm_fleet.render.layout import build
    from vllm_fleet.roles.common.clash import query as clash_query

    specs = {r["name"]: r for r in resolved}
    h = build(resolved, inventory).hosts.get(LOCAL)
    if h is None or not wanted_shares(specs, h):
        return None
    snap = read_here(query() | clash_query())
    if not snap.known or snap.nvidia_smi(MEMORY_FIELDS)[1] is None:
        return [f"{LOCAL}: no nvidia-smi answered on this machine: its GPUs' free memory was not read"], [], []
    lines, errors, warnings = check(specs, h, snap)
    return (
        [f"{LOCAL}: {line}" for line in lines],
        [f"{LOCAL}: {e}" for e in errors],
        [f"{LOCAL}: {w}" for w in warnings],
    )
