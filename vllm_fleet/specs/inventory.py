"""The one inventory reader: a pyinfra inventory as pyinfra itself reads it (a .py file, or the
hosts inline: ``@local``, ``user@host``, ``@ssh/host``, comma-separated lists, with ``--data``).

    load_inventory(path, data=()) -> {host: {"address", "groups", "data", "order"}}

Every command (validate, render, status, rollout, bench, tune, deploy, diff, down) reads the
inventory here, so each sees the layout the deploy sees: pyinfra's own loader
(``pyinfra_cli.inventory.make_inventory``, the function behind ``pyinfra INVENTORY ...``), its
data precedence (``--data`` > host > group, ``group_data/*.py`` beside the inventory or in the
current directory included > ``all``), the file-name group.

The inventory is a Python file the user wrote: it runs in a child interpreter, so that one which
calls ``sys.exit``, raises (``KeyboardInterrupt`` included), hangs or calls ``os._exit`` is an
input error (:class:`InventoryError`, naming the file) and never this process's exit. The child
writes its answer to a file it is given, never to stdout, so that what the inventory prints does
not matter.

Hosts given inline belong to no group of the file, so they are put in the ``servers`` group
(:func:`vllm_fleet.specs.hostdata.inline_groups`, which the deploy's own read of pyinfra's hosts
uses too); ``user@host[:port]`` gives the host data ``ssh_user`` (and ``ssh_port``) unless set.

``address``: the host's ``ssh_hostname`` data, else its name (``user@host``: the host). ``order``: the host's place in
each group (a rollout's batches follow the ``servers`` group's order). The host data itself is checked
by :mod:`vllm_fleet.specs.hostdata` (the layout does that for every command).

No host is contacted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from vllm_fleet.specs.source import SpecSourceError, spec_source

#: Seconds an inventory file may take to load (a file that blocks is an input error, not a hang).
LOAD_TIMEOUT = 60


class InventoryError(Exception):
    """The inventory cannot be read; ``lines``: what and how to fix it (the first names the file)."""

    def __init__(self, lines: Sequence[str] | str):
        self.lines = [lines] if isinstance(lines, str) else list(lines)
        super().__init__("\n".join(self.lines))


def load_inventory(path: str | Path, data: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """{host: {"address": str, "groups": [str], "data": dict, "order": {group: position}}}, hosts
    in pyinfra's order. ``data``: ``KEY=VALUE`` strings, as pyinfra's ``--data`` (highest
    precedence). Raises :class:`InventoryError`."""
    p = Path(path)
    if not str(path).strip() or not (p.is_file() or is_inline(str(path))):
        raise InventoryError(
            f"inventory {path}: no such file (pass a pyinfra inventory .py file, or the hosts "
            "inline as pyinfra takes them: @local, user@host, @ssh/host, host1,host2)"
        )
    for d in data:
        if "=" not in d:
            raise InventoryError(f"--data {d}: give KEY=VALUE")
    with tempfile.TemporaryDirectory(prefix="vllm-fleet-inventory-") as tmp:
        answer = Path(tmp) / "inventory.json"
        argv = [sys.executable, "-m", "vllm_fleet.specs.inventory", str(p), str(answer), *data]
        env = {**os.environ, "PYINFRA_PROGRESS": "off"}
        # the child imports vllm_fleet from where this process does (a checkout without install)
        here = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            r = subprocess.run(
                argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env, timeout=LOAD_TIMEOUT
            )
        except subprocess.TimeoutExpired:
            raise InventoryError(
                f"inventory {p}: did not finish loading in {LOAD_TIMEOUT} s: an inventory file must "
                "only define groups of hosts (no waiting, no network)"
            ) from None
        doc = None
        if answer.is_file():
            try:
                doc = json.loads(answer.read_text())
            except ValueError:
                doc = None
    if r.returncode != 0 or not isinstance(doc, dict):
        tail = [t for t in (r.stderr + r.stdout).strip().splitlines() if t.strip()][-8:]
        if isinstance(doc, dict) and doc.get("error"):
            first = f"inventory {p}: pyinfra could not load it: {doc['error']}"
        elif r.returncode < 0:
            first = f"inventory {p}: loading it was killed by signal {-r.returncode}"
        else:
            first = (
                f"inventory {p}: the file exited (status {r.returncode}) before pyinfra finished reading it: "
                "an inventory file must only define groups of hosts (no sys.exit, os._exit or raise)"
            )
        raise InventoryError([first, *("  " + t for t in tail)])
    from vllm_fleet.specs.hostdata import host_address, inline_groups, login_data

    hosts = {}
    for row in doc["hosts"]:
        data = login_data(row["name"], row["data"])
        groups = inline_groups(row["groups"])
        order = {**row["order"], **{g: i for g, i in _inline_order(doc["hosts"], row["name"]).items() if g in groups}}
        hosts[row["name"]] = {
            "address": host_address(row["name"], data),
            "groups": groups,
            "data": data,
            "order": order,
        }
    if not hosts:
        raise InventoryError(f"inventory {p}: no hosts found (module-level lists of host names)")
    return hosts


def is_inline(text: str) -> bool:
    """Whether ``text`` names hosts inline, as pyinfra's command line takes them instead of a file:
    a connector (``@local``, ``@ssh/host``, ``@docker/...``), ``user@host``, or a comma-separated
    list of those or of addresses / host names. A lone word (``inventory``, ``hosts.py``) is not:
    a file name with a typo stays "no such file" instead of a host vllm-fleet would try to reach."""
    from vllm_fleet.specs.hostdata import is_ipv4

    text = text.strip()
    if not text or "\n" in text or text.endswith(".py"):
        return False
    return "@" in text or "," in text or is_ipv4(text)


def for_pyinfra(inventory: str) -> str:
    """The inventory argument to hand the pyinfra CLI (deploy, down, diff's dry run, rollout and
    tune steps): as given, except an inline list naming a ``user@host[:port]``, which pyinfra 3's
    CLI looks up as a host name ("Could not resolve hostname"). That one becomes a generated file
    (under ~/.cache/vllm-fleet/inline/, named by the text's sha256) listing the same hosts in the
    same order in ``servers``, each ``user@host`` with the ``ssh_hostname``/``ssh_user``/``ssh_port``
    its name gives: the hosts, names, groups and data :func:`load_inventory` reads (``--data``
    still has the last word)."""
    import hashlib

    from vllm_fleet.specs.hostdata import host_address, login_data

    if Path(inventory).is_file() or not is_inline(inventory):
        return inventory
    names = [n.strip() for n in inventory.split(",") if n.strip()]
    if not any("@" in n and not n.startswith("@") for n in names):
        return inventory
    rows = [
        n if n.startswith("@") or "@" not in n else (n, {"ssh_hostname": host_address(n, {}), **login_data(n, {})})
        for n in names
    ]
    text = (
        f'"""Written by vllm-fleet for the inline inventory {inventory!r} (pyinfra reads user@host as a name)."""\n'
        f'\nservers = {rows!r}\n'
    )
    where = Path(os.path.expanduser("~/.cache/vllm-fleet/inline"))
    path = where / f"inline_{hashlib.sha256(inventory.encode()).hexdigest()[:16]}.py"
    if not path.is_file() or path.read_text() != text:
        where.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(path)


def _inline_order(rows: list[dict[str, Any]], name: str) -> dict[str, int]:
    """An inline host's place in the groups :func:`~vllm_fleet.specs.hostdata.inline_groups` gives
    it: the order the hosts were written in (the inline hosts among ``rows``)."""
    from vllm_fleet.specs.hostdata import INLINE_GROUPS, inline_groups

    names = [r["name"] for r in rows if inline_groups(r["groups"]) != list(r["groups"])]
    return {g: names.index(name) for g in INLINE_GROUPS} if name in names else {}


def _child(path: str, answer: str, data: Sequence[str]) -> int:
    """In the child: load with pyinfra, write {"hosts": [...]} (or {"error": ...}) to ``answer``."""
    cwd = os.getcwd()
    if cwd not in sys.path:  # as the pyinfra CLI does
        sys.path.append(cwd)
    try:
        from pyinfra.api import Config, State
        from pyinfra.context import ctx_inventory, ctx_state
        import pyinfra_cli.inventory as cli_inventory
        from pyinfra_cli.util import parse_cli_arg

        # pyinfra keeps a group's hosts in the `all` order; a rollout wants the order the group
        # lists them in: keep the groups as pyinfra read them from the file (read once).
        listed: dict[str, Any] = {}
        read_groups = cli_inventory._get_groups_from_filename

        def keep_groups(filename: str):
            groups = read_groups(filename)
            listed.update(groups)
            return groups

        cli_inventory._get_groups_from_filename = keep_groups

        state = State(check_for_changes=False)  # as pyinfra_cli.cli sets up before loading
        state.cwd = cwd
        ctx_state.set(state)
        override = {k: parse_cli_arg(v) for k, v in (d.split("=", 1) for d in data)}
        inventory = cli_inventory.make_inventory(path, cwd=cwd, override_data=override)
        ctx_inventory.set(inventory)
        state.init(inventory, Config())
        hosts = []
        for host in inventory:
            groups = [g for g in host.groups]
            order = {}
            for g in groups:
                members = [h.name for h in inventory.get_group(g, [])]
                if g in listed:
                    value = listed[g][0] if isinstance(listed[g], tuple) else listed[g]
                    members = [m[0] if isinstance(m, tuple) else m for m in value]
                if host.name in members:
                    order[g] = members.index(host.name)
            hosts.append({"name": host.name, "groups": groups, "data": host.data.dict(), "order": order})
        text = json.dumps({"hosts": hosts}, default=str)
    except BaseException as exc:  # the user's file: report it, don't trace
        if isinstance(exc, SystemExit):
            raise
        Path(answer).write_text(json.dumps({"error": _describe(exc, path)}))
        return 1
    Path(answer).write_text(text)
    return 0


def _describe(exc: BaseException, path: str) -> str:
    """``ZeroDivisionError: division by zero (line 3)``: the user's error, not pyinfra's wrapper."""
    import traceback

    inner = getattr(exc, "exception", None)  # pyinfra_cli's UnexpectedExternalError wraps it
    if isinstance(inner, BaseException):
        exc = inner
    try:
        text = f"{type(exc).__name__}: {exc}".rstrip(": ")
    except Exception:
        text = type(exc).__name__
    where = [
        f.lineno
        for f in traceback.extract_tb(exc.__traceback__)
        if os.path.abspath(f.filename) == os.path.abspath(path)
    ]
    return text + (f" (line {where[-1]})" if where else "")


def spec_for(inventory: str, spec: str | None, data: Sequence[str] = ()) -> str:
    """``--spec``, else the one spec the inventory's hosts name (vllm_fleet.specs.source, as
    ``vllm-fleet rollout`` finds it). Raises ValueError with what to do."""
    if spec:
        return spec
    try:
        found = {spec_source(h["data"], n)[0] for n, h in load_inventory(inventory, data).items()}
    except (InventoryError, SpecSourceError) as exc:
        raise ValueError(str(exc)) from None
    if len(found) != 1:
        raise ValueError(
            f"the inventory's hosts name {len(found)} specs ({', '.join(sorted(found))}): give one with --spec"
        )
    return found.pop()


if __name__ == "__main__":  # pragma: no cover - run by load_inventory
    sys.exit(_child(sys.argv[1], sys.argv[2], sys.argv[3:]))
