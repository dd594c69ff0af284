"""Other vllm-fleet deployments already on a host: refuse a port or GPU clash before any change.

The fleet layout (vllm_fleet.render.layout) proves the deployments of ONE deploy fit together.
A deployment put on a host from another inventory (or another checkout) is not in that layout:
without this check the deploy uploads and installs a second environment, then its unit
crash-loops on "Address already in use" while the health wait hears the other deployment, and
its nginx site breaks `nginx -t` for every site on the host.

What another deployment holds is read from its files on the host, in the deploy's one state read
(vllm_fleet.roles.common.state, the ``globs`` of :func:`query`): its units' ``--port`` and the
GPUs of their ``replica-N.env`` (``CUDA_VISIBLE_DEVICES``) while the unit runs or is enabled (a
stopped, disabled unit file left behind holds nothing) with each unit's
``--gpu-memory-utilization`` (a GPU may be shared with another deployment while every vLLM's
share on it sums to at most 1, as within one deploy), its nginx site's ``listen`` port and
``server_name`` (two sites on one port clash when both are the default server, or name the
same server). :func:`refuse` raises before any operation of the deploy exists, so nothing is
uploaded, installed or changed on any host. The host's memory is checked the same way
(:func:`refuse_memory`): every replica's CPU tier of the KV cache on it, this deploy's and the
other deployments' (their units' ``--kv-offloading-size``), plus the reserve, against MemTotal.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from vllm_fleet.render.layout import SYSTEMD_DIR, HostLayout
from vllm_fleet.render.parts import kv_offload_on
from vllm_fleet.specs.planner import (
    HOST_RESERVE_GIB,
    REPLICA_HOST_GIB,
    host_memory,
    replica_gpu_utilization,
    shares_fit_one_gpu,
)

from .state import Query, Snapshot

UNITS = f"{SYSTEMD_DIR}/vllm-*.service"
SITES = "/etc/nginx/conf.d/vllm-fleet-*.conf"
REPLICA_ENVS = "/etc/vllm-fleet/*/replica-*.env"

_UNIT = re.compile(rf"^{re.escape(SYSTEMD_DIR)}/vllm-(?P<name>.+)-(?P<index>\d+)\.service$")
_SITE = re.compile(r"^/etc/nginx/conf\.d/vllm-fleet-(?P<name>.+)\.conf$")
_ENV = re.compile(r"^/etc/vllm-fleet/(?P<name>[^/]+)/replica-(?P<index>\d+)\.env$")


def query() -> Query:
    return Query(globs=(UNITS, SITES, REPLICA_ENVS))


def unit_of(path: str) -> str | None:
    """The deployment whose replica unit ``path`` is (``vllm-NAME-N.service``), else None."""
    m = _UNIT.match(path)
    return m.group("name") if m else None


@dataclass
class Held:
    """What one deployment holds on a host: {port: where}, [(listen, server_name, default,
    where)], {gpu: [units]} (several: replicas.per_gpu) and {unit: its
    --gpu-memory-utilization}, the share of each of its GPUs it takes (a unit not listed: all)."""

    ports: dict[int, str] = field(default_factory=dict)
    sites: list[tuple[int, str, bool, str]] = field(default_factory=list)
    units: dict[int, list[str]] = field(default_factory=dict)
    shares: dict[str, float] = field(default_factory=dict)

    @property
    def gpus(self) -> dict[int, str]:
        """{gpu: the unit on it} (the last one placed there, when several share it)."""
        return {gpu: units[-1] for gpu, units in self.units.items() if units}

    def use_gpu(self, gpu: int, unit: str, share: float | None = None) -> None:
        if unit not in self.units.setdefault(gpu, []):
            self.units[gpu].append(unit)
        if share is not None:
            self.shares[unit] = share

    def on_gpu(self, gpu: int) -> dict[str, float]:
        """{unit: share} of this deployment's units on GPU ``gpu``."""
        return {u: self.shares.get(u, 1.0) for u in self.units.get(gpu, [])}


def _gpus(env_text: str | None) -> list[int]:
    m = re.search(r"^CUDA_VISIBLE_DEVICES=([0-9, ]+)$", env_text or "", re.M)
    return [int(x) for x in m.group(1).replace(" ", "").split(",") if x] if m else []


def _sites(text: str, where: str) -> list[tuple[int, str, bool, str]]:
    out = []
    for block in re.split(r"^server\s*\{", text, flags=re.M)[1:]:
        names = re.search(r"^\s*server_name\s+([^;]+);", block, re.M)
        for m in re.finditer(r"^\s*listen\s+(?:[\[\]0-9a-fA-F.:]*:)?(\d+)([^;]*);", block, re.M):
            out.append(
                (int(m.group(1)), (names.group(1).strip() if names else ""), "default_server" in m.group(2), where)
            )
    return out


def holds(state: tuple[str, str] | None) -> bool:
    """A unit holds its port and GPUs unless it is known to be stopped and not enabled (a unit
    file left behind, disabled: it starts neither now nor at boot). Unknown: it holds."""
    if state is None or not state[0]:  # not read, or systemctl could not say
        return True
    active, enabled = state
    return active not in ("inactive", "failed", "") or enabled.startswith(("enabled", "linked", "alias"))


def held_on_host(
    globbed: dict[str, dict[str, str | None]], unit_states: dict[str, tuple[str, str]] | None = None
) -> dict[str, Held]:
    """{deployment: Held} from the files the ``globs`` read found (``unit_states``: a unit
    file's (is-active, is-enabled); a stopped, disabled unit holds nothing)."""
    out: dict[str, Held] = {}
    envs = globbed.get(REPLICA_ENVS) or {}
    for path, text in (globbed.get(UNITS) or {}).items():
        m = _UNIT.match(path)
        if not m or text is None or not holds((unit_states or {}).get(path)):
            continue
        name, index = m.group("name"), m.group("index")
        held = out.setdefault(name, Held())
        unit = path.rsplit("/", 1)[1]
        port = re.search(r"^ExecStart=.*\s--port[ =](\d+)", text, re.M)
        if port:
            held.ports[int(port.group(1))] = unit
        share = re.search(r"^ExecStart=.*\s--gpu-memory-utilization[ =]([0-9.]+)", text, re.M)
        env = next(
            (
                t
                for p, t in envs.items()
                if (e := _ENV.match(p)) and e.group("name") == name and e.group("index") == index
            ),
            None,
        )
        for g in _gpus(env):
            held.use_gpu(g, unit, float(share.group(1)) if share else None)
    for path, text in (globbed.get(SITES) or {}).items():
        m = _SITE.match(path)
        if m and text is not None:
            out.setdefault(m.group("name"), Held()).sites += _sites(text, path)
    return out


def wanted(specs: dict[str, dict[str, Any]], h: HostLayout) -> dict[str, Held]:
    """{deployment: Held} of what this deploy puts on host ``h`` (its layout)."""
    out: dict[str, Held] = {}
    for name, node in h.parts.items():
        held = out.setdefault(name, Held())
        share = replica_gpu_utilization(specs[name]) if any(i.gpu_ids for i in node.instances) else None
        for inst in node.instances:
            held.ports[inst.port] = inst.unit
            for g in inst.gpu_ids or []:
                held.use_gpu(g, inst.unit, share)
        if "proxy" in node.roles:
            prx = specs[name]["proxy"]
            if prx["enabled"]:
                sn = prx["server_name"]
                held.sites.append((int(prx["listen"]), sn, sn == "_", f"proxy.listen {prx['listen']}"))
    return out


def _gpu_clash(
    gpu: int, name: str, ours: dict[str, Held], theirs: dict[str, Held], other: str, managed: set[str]
) -> str | None:
    """GPU ``gpu`` of deployment ``name`` is also used by deployment ``other``. Each vLLM takes its
    --gpu-memory-utilization share of the whole GPU at start, so sharing is fine while all the
    shares on it sum to at most 1 (the other deployment already runs: ours, started after it,
    sees what it took). A unit whose share is not known takes the whole GPU."""
    mine = [(u, s) for w in ours.values() for u, s in w.on_gpu(gpu).items()]
    others = [(o, u, s) for o, h in sorted(theirs.items()) if o not in managed for u, s in h.on_gpu(gpu).items()]
    shares = [s for _, s in mine] + [s for _, _, s in others]
    if shares_fit_one_gpu(shares):
        return None
    total = sum(shares)
    unit, their = ours[name].gpus[gpu], theirs[other].gpus[gpu]
    if not theirs[other].shares:
        return (
            f"GPU {gpu} ({unit}) is used by deployment {other!r} ({their}): "
            f"give {name} other GPUs (hardware, replicas), or this host to one of them"
        )
    parts = " + ".join([*(f"{u} {s:g}" for u, s in mine), *(f"{u} {s:g} (deployment {o!r})" for o, u, s in others)])
    return (
        f"GPU {gpu} ({unit}) is shared with deployment {other!r} ({their}): {parts} = {total:.3g} of its memory "
        "(each vLLM takes its --gpu-memory-utilization share of the whole GPU at start): lower "
        f"engine.gpu_memory_utilization of {name} so the shares sum to at most 1, give {name} other GPUs "
        "(hardware.gpu_ids), or this host to one of them"
    )


def clashes(ours: dict[str, Held], theirs: dict[str, Held], managed: set[str]) -> list[str]:
    """One line per clash between what this deploy wants and the deployments not in it."""
    out = []
    for other, have in sorted(theirs.items()):
        if other in managed:
            continue
        for name, want in ours.items():
            for port, unit in sorted(want.ports.items()):
                if port in have.ports:
                    out.append(
                        f"port {port} ({unit}) is taken by deployment {other!r} ({have.ports[port]}): "
                        f"give {name} another server.port"
                    )
            for gpu in sorted(want.gpus):
                if gpu in have.gpus and (line := _gpu_clash(gpu, name, ours, theirs, other, managed)):
                    out.append(line)
            for listen, sn, default, _ in want.sites:
                for olisten, osn, odefault, where in have.sites:
                    if listen == olisten and (default and odefault or sn == osn):
                        why = "both are the default server" if default and odefault else f"both are server_name {sn}"
                        out.append(
                            f"nginx port {listen}: {why} ({where} of deployment {other!r}): give {name} "
                            "its own proxy.server_name or proxy.listen"
                        )
    return out


def refuse(specs: dict[str, dict[str, Any]], h: HostLayout, host_name: str, snap: Snapshot) -> None:
    """Raise DeployError naming every clash with a deployment already on this host; nothing
    is known (no snapshot): nothing is refused."""
    globbed = {g: snap.matching(g) for g in (UNITS, SITES, REPLICA_ENVS)}
    if any(v is None for v in globbed.values()):
        return
    states = {p: st for p in (globbed[UNITS] or {}) if (st := snap.unit_file_state(p)) is not None}
    lines = clashes(wanted(specs, h), held_on_host(globbed, states), set(specs))  # type: ignore[arg-type]
    if lines:
        from pyinfra.api.exceptions import DeployError

        raise DeployError(
            f"host {host_name}: another vllm-fleet deployment already on this host is in the way:\n  "
            + "\n  ".join(lines)
            + "\n  (or remove it first: `vllm-fleet down` with its own inventory); nothing was uploaded or changed"
        )


# ---- the host's memory: every replica's CPU tier of the KV cache + the reserve -------------------

MEMINFO = "/proc/meminfo"


def memory_query(specs: dict[str, dict[str, Any]], h: HostLayout) -> Query:
    """/proc/meminfo and every vLLM unit on the host (the other deployments' tiers) in the deploy's
    one state read, when a deployment on this host has a CPU tier of the KV cache (engine.kv_offload)."""
    tiers = any(kv_offload_on(specs[name], node.data) is not None and node.instances for name, node in h.parts.items())
    return Query(read=(MEMINFO,), globs=(UNITS,)) if tiers else Query()


def mem_total(text: str | None) -> int | None:
    """MemTotal of /proc/meminfo, in bytes (None when absent)."""
    m = re.search(r"^MemTotal:\s+(\d+)\s*kB", text or "", re.M)
    return int(m.group(1)) * 1024 if m else None


def _their_tiers(
    globbed: dict[str, str | None], states: dict[str, tuple[str, str]], managed: set[str]
) -> list[tuple[str, float | None, str]]:
    """(unit, GiB of its tier or None, deployment) of every vLLM unit of another deployment that
    holds its memory (running or enabled), from its ExecStart's --kv-offloading-size."""
    out = []
    for path, text in sorted(globbed.items()):
        m = _UNIT.match(path)
        if not m or text is None or m.group("name") in managed or not holds(states.get(path)):
            continue
        size = re.search(r"^ExecStart=.*\s--kv-offloading-size[ =]([0-9.]+)", text, re.M)
        out.append((path.rsplit("/", 1)[1], float(size.group(1)) if size else None, m.group("name")))
    return out


def memory_plan(
    specs: dict[str, dict[str, Any]], h: HostLayout, snap: Snapshot
) -> tuple[dict[str, Any] | None, list[str], dict[str, int]]:
    """The host's memory against every replica's CPU tier on it (this deploy's and the other
    deployments' already there) plus the reserve (spec.planner.host_memory): ``(figures, problems,
    {deployment: GiB per replica}`` for the ``auto`` ones). Nothing known (no read, or no tier
    here): ``(None, [], {})``."""
    ours = [
        (inst.unit, kv_offload_on(specs[name], node.data), name)
        for name, node in h.parts.items()
        for inst in node.instances
    ]
    if not any(t is not None for _, t, _ in ours):
        return None, [], {}
    known, text = snap.content(MEMINFO)
    total = mem_total(text) if known else None
    globbed = snap.matching(UNITS)
    if total is None or globbed is None:
        return None, [], {}
    states = {p: st for p in globbed if (st := snap.unit_file_state(p)) is not None}
    theirs = _their_tiers(globbed, states, set(specs))
    every = ours + theirs
    fig = host_memory(total, [(u, t) for u, t, _ in every])
    auto = {name: fig["auto_gib"] for _, t, name in ours if t == "auto"} if fig["fits"] else {}
    if fig["fits"]:
        return fig, [], auto
    n = fig["replicas"]
    parts = " + ".join(
        f"{u} {t if t == 'auto' else f'{t:g} GiB'}" + ("" if name in specs else f" (deployment {name!r})")
        for u, t, name in every
        if t is not None
    )
    lines = [
        f"the CPU tiers of the KV cache do not fit in its memory: {fig['total_gib']:g} GiB of RAM (MemTotal) - reserve "
        f"{fig['reserve_gib']:g} GiB ({HOST_RESERVE_GIB:g} + {REPLICA_HOST_GIB:g} x {n} vLLM replicas) - tiers {parts} "
        f"= {fig['left_gib']:g} GiB" + (" (each `auto` replica needs at least 1 GiB)" if fig["left_gib"] >= 0 else "")
    ]
    for name in [d for d in specs if any(dn == d and t is not None for _, t, dn in ours)]:
        mine = sum(1 for _, t, dn in ours if dn == name and t is not None)
        others = sum(float(t) for _, t, dn in every if dn != name and t not in (None, "auto"))
        largest = math.floor((fig["total_gib"] - fig["reserve_gib"] - others) / mine)
        lines.append(
            f"the largest engine.kv_offload.size_gib of {name} that fits here ({mine} replica(s)): "
            + (
                f"{largest} GiB (or `auto`)"
                if largest >= 1
                else "none: lower the other replicas' tiers or put fewer replicas here"
            )
        )
    return fig, lines, {}


def refuse_memory(specs: dict[str, dict[str, Any]], h: HostLayout, host_name: str, snap: Snapshot) -> dict[str, int]:
    """Raise DeployError when the CPU tiers on this host do not fit in its RAM (with the numbers
    and the largest size that fits); else the ``auto`` deployments' GiB per replica here."""
    _, lines, auto = memory_plan(specs, h, snap)
    if lines:
        from pyinfra.api.exceptions import DeployError

        raise DeployError(f"host {host_name}: " + "\n  ".join(lines) + "\n  nothing was uploaded or changed")
    return auto
