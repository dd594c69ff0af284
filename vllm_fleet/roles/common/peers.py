"""Once through the control machine's link, then host to host (issue 36, item 1).

An artifact (a directory of files with the control machine's sha256 of each: the model tree of
``transfer: upload`` and ``hub_fetch: fleet``) goes to the hosts that need it in rounds:

- round 0: when no host of this deploy already holds a verified copy, the first host that needs
  it (the layout's host order, i.e. the inventory's) gets it from the control machine over SSH,
  as before (one copy through the control link); the others wait.
- round k >= 1: as many hosts as there are sources fetch, each from every source in turn
  (``scripts/fetch_files.py``: each file checked against the control machine's sha256 before it
  is kept; a copy that differs is refused and the next source tried). Sources are the hosts that
  held a verified copy when the plan was made (their stamp: staged earlier) and those that
  fetched in an earlier round, so they double each round.

A source serves its copy with ``scripts/serve_files.py`` in a transient systemd unit
(``vllm-fleet-peer-KEY.service``: DynamicUser, ProtectSystem=strict, the artifact's directory bound
read-only, no capability, RuntimeMaxSec as a backstop) bound to its ``private_address`` at host
data ``peer_port``, serving only the artifact's files under a token new with each deploy (handed
to the unit as a systemd credential, never on a command line). The last operation stops every
server this deploy started.

How it fits pyinfra: the plan of each host is built before any runs, one host after the other, so
a host knows only its own state while its operations are made. Each host that needs the
artifact registers here (its address, what it lacks) and gets the same operations: one per round
(pyinfra runs an operation on every host before the next: a barrier) and a last one; a host that
holds a verified copy registers as a source and gets none (a converged fleet: no operation, no
server). The rounds themselves (:func:`plan_rounds`) are worked out when the first of those
operations runs, from every host's registration, so a host staged earlier serves though it has
no operation of its own: the first host that needs the artifact starts its server (and stops it
at the end) over that host's own connection.

A host without ``private_address`` (or with host data ``peer_fetch`` false) is not part of it: it
gets the files from the control machine as before, and the plan says so. A host whose fetch from
its peers fails (unreachable, every copy refused) gets what it lacks from the control machine
(said in the output), so a network that does not let hosts reach each other costs what it cost
before, never a failed deploy.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
from dataclasses import dataclass, field
from io import StringIO
from pathlib import Path
from typing import Any

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, operation

from vllm_fleet.host.programs import argv as cmd
from vllm_fleet.host.programs import python, script

SYSTEM_PYTHON = "python3"

#: Host data of every transfer host to host (the model role's DEFAULTS include them; the fleet
#: wheelhouse reads them here): where a host serves its verified copy during the transfer (on
#: private_address), how long a peer server may live if the deploy that started it dies, and
#: whether the fleet wheelhouse goes host to host too (off until proven on the lab: the model is).
DEFAULTS = {"peer_port": 8471, "peer_max_seconds": 3600, "wheels_peer_fetch": False}
RUN_DIR = "/run/vllm-fleet-peer"  # root-only: the fetch lists and the servers' lists (with the token)


def plan_rounds(needs: list[str], holders: list[str], seeds: int = 1) -> list[list[tuple[str, list[str]]]]:
    """The rounds: ``rounds[k]`` lists ``(host, its sources in the order it tries them)``.
    ``rounds[0]`` are the seeds, fetched from the control machine (sources ``[]``): the first
    ``seeds`` of ``needs`` when there is no holder, else none. Each later round takes as many
    hosts (in ``needs``' order) as there are sources, host i trying the sources from the i-th on
    (so each source serves one host first); the hosts of a round are sources from the next."""
    rounds: list[list[tuple[str, list[str]]]] = []
    sources, todo = list(holders), list(needs)
    if sources or not todo:
        rounds.append([])
    else:
        rounds.append([(h, []) for h in todo[: max(1, seeds)]])
        sources, todo = [h for h, _ in rounds[0]], todo[max(1, seeds) :]
    while todo:
        batch, todo = todo[: len(sources)], todo[len(sources) :]
        rounds.append([(h, sources[i:] + sources[:i]) for i, h in enumerate(batch)])
        sources = sources + batch
    return rounds


def round_count(hosts: int, seeds: int = 1) -> int:
    """How many rounds :func:`plan_rounds` can need for ``hosts`` hosts at most (no holder): the
    number of round operations each host that needs an artifact gets."""
    if hosts <= seeds:
        return 1
    return 1 + math.ceil(math.log2(hosts / seeds))


@dataclass
class Member:
    name: str
    address: str
    lacks: list[str]  # relative paths the host does not hold verified (empty: a holder)


@dataclass
class Artifact:
    """One artifact of one deploy: ``files`` ({relative path: [size, sha256]}) of the control
    machine's ``local`` directory, at ``root`` on each host, owned by ``owner`` with ``mode``."""

    key: str
    what: str
    local: Path
    root: str
    files: dict[str, list]
    owner: str
    mode: str
    dir_mode: str
    port: int
    seconds: int
    control_urls: list = field(default_factory=list)  # the control machine's HTTP server; none: SSH
    prune: bool = False  # files under root the artifact does not name are removed (a wheelhouse)
    members: dict[str, Member] = field(default_factory=dict)
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    rounds: list | None = None
    started: set = field(default_factory=set)  # hosts whose server this deploy started

    @property
    def unit(self) -> str:
        return f"vllm-fleet-peer-{hashlib.sha256(self.key.encode()).hexdigest()[:12]}"


_ARTIFACTS: dict[tuple[int, str], Artifact] = {}


def _artifact(key: str, **kw) -> Artifact:
    from pyinfra.context import ctx_state

    st = ctx_state.get()
    k = (id(st), key)
    found = _ARTIFACTS.get(k)
    if found is None or getattr(found, "_state", None) is not st:
        found = Artifact(key=key, **kw)
        found._state = st  # type: ignore[attr-defined]
        _ARTIFACTS[k] = found
    return found


def address() -> str | None:
    """This host's address on the fleet's private network for peer transfers, or None (then the
    control machine sends it everything, as before): host data ``private_address`` unless
    ``peer_fetch`` is false."""
    if str(host.data.get("peer_fetch")).lower() in ("false", "0", "no"):
        return None
    return str(host.data.get("private_address") or "") or None


def hosts_in_deploy() -> int:
    from pyinfra import state

    return len(list(state.inventory))


def peer_hosts(deployment: str | None) -> int:
    """How many hosts of this run could take the artifact of ``deployment`` host to host: in a
    deploy of the fleet (``load_deploy_spec``'s layout), the hosts with its install stack and a
    private address; in a deploy of one's own (no layout), the inventory's hosts with one."""
    from pyinfra import state

    from vllm_fleet.render.layout import SERVICE_PARTS
    from vllm_fleet.roles import common

    inventory = {h.name: h for h in state.inventory}
    for ctx in (
        [] if deployment is None else reversed(list(common._CACHE.values()))
    ):  # the latest deploy of this process
        if deployment in ctx.layout.deployments:
            return sum(
                1
                for name, hl in ctx.layout.hosts.items()
                if deployment in hl.parts
                and hl.parts[deployment].roles & SERVICE_PARTS
                and name in inventory
                and inventory[name].data.get("private_address")
            )
    return sum(1 for h in inventory.values() if h.data.get("private_address"))


def join(
    key: str,
    what: str,
    local: Path,
    root: str,
    files: dict[str, list],
    lacks: list[str],
    *,
    owner: str,
    mode: str,
    dir_mode: str,
    port: int,
    seconds: int,
    deployment: str | None,
    control_urls: list[str] | None = None,
    prune: bool = False,
) -> list | None:
    """Register this host for the artifact ``key`` (``lacks``: what it still needs; empty: it
    holds a verified copy). None when the host takes no part (no private address, or it is the
    only host of ``deployment`` that could: nothing to share): the caller sends the files as
    before. Else the operations added here (one per round and the last one, when something is
    lacking; none for a holder). ``control_urls``: where the control machine serves the files
    over HTTP (the fleet wheelhouse); without, the seed and a fallback get them over SSH."""
    addr = address()
    if addr and peer_hosts(deployment) < 2:
        return None
    if not addr:
        if lacks:
            logger.info(
                f"{host.name}: {what}: no private_address (or peer_fetch false): "
                "from the control machine to this host, as before"
            )
        return None
    art = _artifact(
        key,
        what=what,
        local=local,
        root=root,
        files=files,
        owner=owner,
        mode=mode,
        dir_mode=dir_mode,
        port=port,
        seconds=seconds,
        control_urls=list(control_urls or []),
        prune=prune,
    )
    art.members[host.name] = Member(host.name, addr, list(lacks))
    if not lacks:
        return []
    ops = []
    for k in host.loop(range(round_count(hosts_in_deploy()))):
        ops.append(peer_round(name=f"{what}: peer round {k}", key=key, k=k))
    ops.append(peer_done(name=f"{what}: stop the peer servers", key=key))
    return ops


# ------------------------------------------------------------------------------------------------
# What runs while the plan executes (each host's operations call these with their own host)


def _root_args(state, h) -> dict[str, Any]:
    from pyinfra.api.arguments import pop_global_arguments

    args, _ = pop_global_arguments(state, h, {})
    return {
        k: v
        for k, v in args.items()
        if k.startswith(("_sudo", "_use_sudo", "_preserve_sudo", "_su_", "_use_su", "_preserve_su", "_doas", "_dzdo"))
    }


def _run(state, h, command, timeout: int = 120) -> tuple[bool, list[str]]:
    ok, out = h.run_shell_command(command, **_root_args(state, h), _timeout=timeout)
    lines = [ln.strip() for ln in (getattr(out, "stdout_lines", []) or []) + (getattr(out, "stderr_lines", []) or [])]
    return bool(ok), lines


def _put_private(state, h, content: str, path: str) -> bool:
    """``content`` as a root-only file at ``path`` on ``h`` (mode 600 before and after)."""
    tmp = f"{path}.tmp-vllm-fleet"
    ok, _ = _run(state, h, cmd("install", "-d", "-m", "700", RUN_DIR))
    ok = ok and _run(state, h, cmd("install", "-m", "600", "/dev/null", tmp))[0]
    ok = ok and h.put_file(StringIO(content), tmp, **_root_args(state, h))
    return bool(ok and _run(state, h, cmd("sh", "-c", 'chmod 600 "$1" && mv -f "$1" "$2"', "sh", tmp, path))[0])


def server_argv(art: Artifact, address: str) -> list:
    """The transient unit that serves ``art`` from a host at ``address`` (systemd-run)."""
    props = [
        "DynamicUser=yes",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "PrivateDevices=yes",
        "NoNewPrivileges=yes",
        "CapabilityBoundingSet=",
        "RestrictAddressFamilies=AF_INET AF_INET6",
        "RestrictNamespaces=yes",
        "LockPersonality=yes",
        "MemoryDenyWriteExecute=yes",
        "UMask=0077",
        "TemporaryFileSystem=/srv:ro",
        f"BindReadOnlyPaths={art.root}:/srv/artifact",
        f"LoadCredential=list:{RUN_DIR}/{art.unit}.serve.json",
        f"RuntimeMaxSec={int(art.seconds)}",
    ]
    return [
        "systemd-run",
        f"--unit={art.unit}",
        "--collect",
        "--quiet",
        *(f"--property={p}" for p in props),
        SYSTEM_PYTHON,
        "-I",
        "-c",
        script("serve_files.py"),
        "/srv/artifact",
        address,
        str(int(art.port)),
        f"/run/credentials/{art.unit}.service/list",
    ]


def _start_server(state, h, art: Artifact) -> bool:
    """Start ``h``'s peer server for ``art`` and wait until it answers (a HEAD of one file)."""
    m = art.members[h.name]
    listing = json.dumps({"token": art.token, "files": art.files}, sort_keys=True)
    if not _put_private(state, h, listing, f"{RUN_DIR}/{art.unit}.serve.json"):
        return False
    _run(
        state,
        h,
        cmd(
            "sh",
            "-c",
            'systemctl stop "$1" 2>/dev/null; systemctl reset-failed "$1" 2>/dev/null; true',
            "sh",
            f"{art.unit}.service",
        ),
    )
    ok, lines = _run(state, h, cmd(*server_argv(art, m.address)))
    if not ok:
        logger.warning(f"{h.name}: {art.what}: the peer server did not start: {' '.join(lines)[-300:]}")
        return False
    art.started.add(h.name)
    probe = sorted(art.files)[0]
    url = f"http://{m.address}:{int(art.port)}/{art.token}/{probe}"
    ok, _ = _run(state, h, python(SYSTEM_PYTHON, "peer_probe.py", url))
    if not ok:
        logger.warning(f"{h.name}: {art.what}: the peer server does not answer on {m.address}:{art.port}")
    return ok


def _stop_server(state, h, art: Artifact) -> None:
    _run(
        state,
        h,
        cmd(
            "sh",
            "-c",
            'systemctl stop "$1" 2>/dev/null; rm -f "$2"; true',
            "sh",
            f"{art.unit}.service",
            f"{RUN_DIR}/{art.unit}.serve.json",
        ),
    )


def _plan(state, art: Artifact) -> list:
    """The rounds, made once (when the first round runs: every host has registered)."""
    if art.rounds is None:
        holders, needs = _holders(state, art), _needs(state, art)
        art.rounds = plan_rounds(needs, holders)
        lines = [f"{art.what}: {len(needs)} host(s) to fill, {len(holders)} holding a verified copy"]
        for k, r in enumerate(art.rounds):
            for name, srcs in r:
                lines.append(f"  round {k}: {name} <- " + (", ".join(srcs) if srcs else "the control machine"))
        logger.info("\n".join(lines))
    return art.rounds


def _order(state, art: Artifact) -> list[str]:
    """The members in the inventory's order (the layout's host order), whatever order they planned in."""
    names = [h.name for h in state.inventory]
    return sorted(art.members, key=lambda n: names.index(n) if n in names else len(names))


def _holders(state, art: Artifact) -> list[str]:
    return [n for n in _order(state, art) if not art.members[n].lacks]


def _needs(state, art: Artifact) -> list[str]:
    return [n for n in _order(state, art) if art.members[n].lacks]


def _inventory_host(state, name: str):
    return state.inventory.get_host(name)


def _from_control(state, h, art: Artifact, rels: list[str]) -> bool:
    """Today's path: the files ``rels`` from the control machine (its HTTP server when it has
    one, else over SSH), then checked."""
    if art.control_urls:
        return _fetch(state, h, art, [], urls=art.control_urls)
    args = _root_args(state, h)
    for rel in rels:
        if not h.put_file(str(art.local / rel), f"{art.root}/{rel}", **args):
            return False
    return _fetch(state, h, art, [])


def _fetch(state, h, art: Artifact, sources: list[str], urls: list[str] | None = None) -> bool:
    """scripts/fetch_files.py on ``h``: every file of ``art`` checked (and what is not there or
    differs fetched from ``sources``' servers, or ``urls``), owned and moded as the artifact says."""
    urls = list(urls or []) + [f"http://{art.members[s].address}:{int(art.port)}/{art.token}/" for s in sources]
    listing = f"{RUN_DIR}/{art.unit}.fetch.json"
    content = json.dumps(
        {
            "sources": urls,
            "files": art.files,
            "prune": art.prune,
            "owner": art.owner,
            "mode": art.mode,
            "dir_mode": art.dir_mode,
        },
        sort_keys=True,
    )
    if not _put_private(state, h, content, listing):
        return False
    ok, lines = _run(state, h, python(SYSTEM_PYTHON, "fetch_files.py", listing, art.root), timeout=24 * 3600)
    _run(state, h, cmd("rm", "-f", listing))
    for line in lines:
        logger.info(f"{h.name}: {line}")
    return ok


def run_round(state, host, key: str, k: int) -> bool:  # noqa: F811 (pyinfra passes state, host by name)
    """Round ``k`` on ``host`` (a ``peer_round`` operation)."""
    h = host
    art = _ARTIFACTS[(id(state), key)]
    rounds = _plan(state, art)
    needs = _needs(state, art)
    if k == 0 and needs and h.name == needs[0]:
        # the hosts staged earlier have no operation here: their servers start from this one
        for name, m in art.members.items():
            if not m.lacks and len(rounds) > 1 and not _start_server(state, _inventory_host(state, name), art):
                logger.warning(f"{name}: {art.what}: not a source this time (its peer server did not start)")
    mine = [srcs for r in rounds[k : k + 1] for name, srcs in r if name == h.name]
    if not mine:
        return True
    sources = mine[0]
    if sources:
        ok = _fetch(state, h, art, [s for s in sources if s in art.members])
        if not ok:
            logger.warning(
                f"{h.name}: {art.what}: no verified copy from its peers ({', '.join(sources)}): "
                "what it lacks comes from the control machine"
            )
            ok = _from_control(state, h, art, art.members[h.name].lacks)
    else:
        ok = _from_control(state, h, art, art.members[h.name].lacks)
    if not ok:
        raise RuntimeError(f"{h.name}: {art.what}: no verified copy (see the fetch lines above)")
    if k + 1 < len(rounds) and any(h.name in srcs for r in rounds[k + 1 :] for _, srcs in r):
        _start_server(state, h, art)
    return True


def run_done(state, host, key: str) -> bool:  # noqa: F811
    """The last operation: this host's server stopped (and, on the first host that needed the
    artifact, every server this deploy started: those of hosts staged earlier, and of any host
    that failed before its own last operation)."""
    h = host
    art = _ARTIFACTS[(id(state), key)]
    needs = _needs(state, art)
    # the first host also stops those of hosts that have no last operation to run: staged earlier,
    # or failed on the way (pyinfra runs nothing more there); a stop twice is harmless
    names = [h.name] + (sorted(art.started - {h.name}) if needs and needs[0] == h.name else [])
    for name in names:
        if name in art.started:
            _stop_server(state, _inventory_host(state, name), art)
    return True


@operation(is_idempotent=False)
def peer_round(key: str, k: int):
    """
    Round ``k`` of the artifact ``key``'s transfer on this host (vllm_fleet.roles.common.peers):
    fetch it from the hosts that hold a verified copy when this host's turn is round ``k``,
    then serve it if a later round fetches from this host; nothing in the other rounds.

    + key: the artifact (peers.join registered it)
    + k: the round
    """
    yield FunctionCommand(run_round, (key, k), {})


@operation(is_idempotent=False)
def peer_done(key: str):
    """
    Stop the peer servers of the artifact ``key`` this host ran (vllm_fleet.roles.common.peers).

    + key: the artifact
    """
    yield FunctionCommand(run_done, (key,), {})


__all__ = ["plan_rounds", "round_count", "join", "address", "server_argv", "peer_round", "peer_done"]
