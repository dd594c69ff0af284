"""What one pyinfra run did to each host, read from pyinfra's own state, and the pyinfra way to
fail one host while the deploy is being planned.

- :func:`fail_host`: a problem found while the deploy file runs for one host (the sudo
  preflight, ``NoSpace``, ``StateUnknown``, a clash, a failed download) fails THAT host as
  pyinfra fails a host whose fact cannot be read in the same stage: ``state.fail_hosts({host})``
  (the host leaves the active hosts, so no operation of it runs; pyinfra's ``--fail-percent``
  is checked there and stops the run when exceeded). The other hosts go on.
- :func:`from_state`: per host of the run, ``converged`` (every operation ran, none changed
  anything), ``changed``, ``failed`` (and why, one line), ``not attempted`` (the run stopped
  before the host's operations ran: ``--fail-percent`` reached, or none left); with ``--dry``
  ``would change`` / ``converged``.
- :func:`write` / :func:`read`: the JSON file ``$VLLM_FLEET_RESULTS`` names, which the pyinfra
  child of ``vllm-fleet deploy|down`` (:mod:`vllm_fleet.host.pyinfra_run`) writes when pyinfra
  ends; the command reads it for its summary (:mod:`vllm_fleet.commands.outcome`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

CONVERGED, CHANGED, FAILED, NOT_ATTEMPTED, WOULD_CHANGE = (
    "converged",
    "changed",
    "failed",
    "not attempted",
    "would change",
)
#: every status, in the order a summary lists them
STATUSES = (FAILED, NOT_ATTEMPTED, CHANGED, WOULD_CHANGE, CONVERGED)

#: the file the pyinfra child writes its per-host results to (set by the parent command)
RESULTS_ENV = "VLLM_FLEET_RESULTS"


@dataclass
class HostResult:
    host: str
    status: str
    reason: str = ""


#: host name -> why the deploy failed it while planning (:func:`fail_host`), for :func:`from_state`
_REASONS: dict[str, str] = {}


def one_line(text: str, limit: int = 240) -> str:
    """The first non-blank line of ``text``, cut to ``limit`` characters."""
    line = next((s.strip() for s in str(text).splitlines() if s.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def fail_host(host: Any, reason: str) -> None:
    """Fail ``host`` now, the way pyinfra fails a host during its prepare stage (a fact it cannot
    read: ``state.fail_hosts``): its error is printed with its prefix, it leaves the active hosts
    (none of its operations runs) and pyinfra's fail percent is checked, which raises pyinfra's
    own error when the run must stop. The caller adds no more operations for the host."""
    from pyinfra import logger
    from pyinfra.context import ContextObject

    if isinstance(host, ContextObject):  # `from pyinfra import host`: the Host itself goes into pyinfra's sets
        host = host._get_module()
    _REASONS.setdefault(host.name, one_line(reason))
    logger.error(f"{host.print_prefix}\x1b[31mError: {reason}\x1b[0m")
    host.state.fail_hosts({host})


def failure_reason(name: str) -> str | None:
    return _REASONS.get(name)


def _op_name(state: Any, op_hash: str) -> str:
    meta = state.op_meta[op_hash]
    return sorted(meta.names)[0] if meta.names else op_hash


def from_state(state: Any, dry: bool = False) -> list[HostResult]:
    """Each host pyinfra was asked to run on (its ``--limit``), in inventory order, from pyinfra's
    state after the run (or after it stopped)."""
    out: list[HostResult] = []
    from pyinfra.api.state import StateStage

    order = state.get_op_order() if state.op_meta else []
    executed = state.current_stage >= StateStage.Execute
    for host in state.inventory:
        if not state.is_host_in_limit(host):
            continue
        ops = state.ops.get(host, {})
        if host in state.failed_hosts:
            why = _REASONS.get(host.name)
            if why is None and host not in state.activated_hosts:
                why = "could not connect (pyinfra's output above says why)"
            if why is None:
                for op_hash in order:
                    if op_hash in ops:
                        meta = ops[op_hash].operation_meta
                        if meta.is_complete() and not meta.did_succeed(_raise_if_not_complete=False):
                            tail = [s for s in meta.stderr_lines if s.strip()] or [
                                s for s in meta.stdout_lines if s.strip()
                            ]
                            why = f"`{_op_name(state, op_hash)}` failed" + (f": {one_line(tail[-1])}" if tail else "")
                            break
            out.append(HostResult(host.name, FAILED, why or "failed (pyinfra's output above says why)"))
            continue
        if dry:
            change = any(
                op.operation_meta._maybe_is_change is not False for op in ops.values()
            )  # None: not checked (-y)
            out.append(HostResult(host.name, WOULD_CHANGE if change else CONVERGED))
            continue
        if not executed:
            out.append(HostResult(host.name, NOT_ATTEMPTED, "the run stopped before any operation ran"))
            continue
        metas = [op.operation_meta for op in ops.values()]
        if any(not m.is_complete() for m in metas):
            out.append(HostResult(host.name, NOT_ATTEMPTED, "the run stopped before this host's operations ran"))
        elif host not in state.activated_hosts:
            out.append(HostResult(host.name, NOT_ATTEMPTED, "not connected"))
        else:
            out.append(HostResult(host.name, CHANGED if any(m.did_change() for m in metas) else CONVERGED))
    return out


def write(path: str, results: list[HostResult]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"hosts": [asdict(r) for r in results]}, f, indent=1)
    os.replace(tmp, path)


def read(path: str) -> list[HostResult] | None:
    """The results a child wrote to ``path``; None when it wrote none (it stopped before)."""
    try:
        with open(path) as f:
            data = json.load(f)
        return [HostResult(h["host"], h["status"], h.get("reason", "")) for h in data["hosts"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_from_context(dry: bool) -> None:
    """In the pyinfra child, when pyinfra ends: its state's results to ``$VLLM_FLEET_RESULTS``
    (nothing when unset, or when pyinfra stopped before it had a state)."""
    path = os.environ.get(RESULTS_ENV)
    if not path:
        return
    from pyinfra.context import ctx_state

    state = ctx_state.get()
    if state is None or not getattr(state, "initialised", False):
        return
    write(path, from_state(state, dry))
