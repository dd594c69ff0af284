"""One read of a host's state per deploy: what every role compares against, in one round trip.

pyinfra's operations each read their own facts (a directory: one ``sudo sh -c`` round trip; a
file: two; a unit: two; a user: three), and each operation's generator runs twice, once while
the plan is built and once when it executes: a no-op deploy of one lab host was 86 round trips.
Here the deploy (vllm_fleet/deploys/serve.py; the rollout's update step too) first asks each
role what it will compare (``state_query`` of nvidia, pyenv, vllm, model, service, ray, nginx, router), reads all of it
with one :class:`~vllm_fleet.host.state.HostState` fact (the script ``vllm_fleet/host/scripts/host_state.sh``;
what a read asks and answers, :class:`~vllm_fleet.host.state.Query` and
:class:`~vllm_fleet.host.state.Snapshot`, live in vllm_fleet.host.state), and the roles then
create an operation only where the state differs. A converged host gets no operation (so also
no fact and no command when the plan executes); a host that differs gets pyinfra's own
operation, which reads its facts and converges as it always did.

A role that is query + apply (service, ray) takes its snapshot with :func:`role_state` (its own
``state_query``): the deploy's one read when it asked all of that (no further command), else the
part it did not ask, read then in one round trip (a role called on its own: an own deploy, the
role tests). Where no snapshot was loaded for a role that reads :func:`host_state` alone,
nothing is known and every operation is created as before. A snapshot is read while the plan is
built and is not refreshed: an operation decides once, from the state the plan saw.

Example::

    from vllm_fleet.host.state import Query
    from vllm_fleet.roles.common.state import host_state, load_host_state

    load_host_state(Query(stat=("/etc/x",), sha=("/etc/x",), units=("nginx.service",)))
    if not host_state().unit_ok("nginx.service", running=True, enabled=True):
        systemd.service(name="nginx running and enabled", service="nginx", running=True, enabled=True)
"""

from __future__ import annotations

from typing import Any

from pyinfra import host
from pyinfra.api.exceptions import DeployError

from vllm_fleet.host.state import HostState, Query, Snapshot


class StateUnknown(DeployError):
    """A role cannot decide from a state read that did not complete (no ``end``), and guessing
    would change or disrupt something: the message names the host and how to retry."""


def unknown(what: str, changed: str = "nothing was changed on this host", run: str = "the deploy") -> StateUnknown:
    """The :class:`StateUnknown` of this host for ``what`` (e.g. "whether /x is there") not known."""
    return StateUnknown(
        f"host {host.name}: the read of this host's state did not complete, so {what} is not known "
        f"({changed}). Check that the host is reachable and that its sudo works, then run {run} again."
    )


class Converged:
    """Stands in for an operation that was not created because the state already matched:
    ``did_change()`` is False, so ``any_changed``/``_if`` treat it as an unchanged operation."""

    changed = False
    will_change = False

    def __init__(self, what: str = "") -> None:
        self.what = what

    def did_change(self) -> bool:
        return False

    def did_not_change(self) -> bool:
        return True

    def did_succeed(self, _raise_if_not_complete: bool = True) -> bool:
        return True

    def __repr__(self) -> str:
        return f"Converged({self.what!r})"


def pending(*ops: Any) -> list:
    """The operations among ``ops`` that exist (not :class:`Converged`, not None)."""
    return [op for op in ops if op is not None and not isinstance(op, Converged)]


_SNAPSHOTS: dict[tuple[int, str], tuple[Any, Snapshot]] = {}


def _key() -> tuple[Any, tuple[int, str]]:
    from pyinfra.context import ctx_state

    st = ctx_state.get()
    return st, (id(st), host.name)


def host_state() -> Snapshot:
    """This host's snapshot for this deploy, or an empty one (nothing known) when none was loaded."""
    st, key = _key()
    found = _SNAPSHOTS.get(key)
    return found[1] if found and found[0] is st else Snapshot()


def _read(query: Query) -> Snapshot:
    snap = host.get_fact(HostState, query=query)
    if not isinstance(snap, Snapshot):  # a scripted or failed fact: nothing known
        snap = Snapshot()
    snap.query = query
    return snap


def read_now(query: Query, on: Any = None) -> Snapshot:
    """Read ``query`` on a host now, not kept for the roles: a check while the plan executes
    (e.g. the GPUs after a reboot), where the plan's snapshot is no longer the host's state.
    ``on``: the host a ``python.call`` function was given (default: the current one)."""
    snap = (on or host).get_fact(HostState, query=query)
    if not isinstance(snap, Snapshot):
        snap = Snapshot()
    snap.query = query
    return snap


def load_host_state(query: Query) -> Snapshot:
    """Read ``query`` on this host in one round trip (the HostState fact) and keep it for this
    deploy's roles (:func:`host_state`)."""
    st, key = _key()
    snap = _read(query)
    _SNAPSHOTS[key] = (st, snap)
    return snap


def role_state(query: Query) -> Snapshot:
    """The snapshot a role compares against (its ``state_query``): this host's, when the deploy's
    one read asked all of ``query`` (deploys/serve.py and rollout.py do: no further command);
    else what it did not ask, read now in one round trip and added to it (a role called on its
    own, e.g. from a deploy of the user's own, reads its state itself: never a fact per file)."""
    st, key = _key()
    found = _SNAPSHOTS.get(key)
    if not found or found[0] is not st:
        return load_host_state(query)
    snap = found[1]
    missing = query - snap.query
    if missing:
        snap.merge(_read(missing))
    return snap
