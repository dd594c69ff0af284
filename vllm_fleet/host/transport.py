"""The one way vllm-fleet reaches a host outside a pyinfra operation: pyinfra's own connectors.

`status`, `diff`, the bench/tune helper sessions and any probe that is not an operation run here,
through the connector pyinfra picks for the inventory host (``@local``: this machine's shell, a
child process of this one (:meth:`Transport._run_local`), never SSH to its own address;
an address: pyinfra's SSH connector with the host's ``ssh_*`` data; ``@docker/...`` and the other
``@`` connectors alike), so a host the deploy reaches is reached the same way by every command.

    with Transport(hosts) as t:                          # hosts: {name: {"address", "data"}} (the inventory reader's)
        r = t.run("lab1", argv("systemctl", "is-active", unit))   # Result(ok, code, stdout, stderr)
        rows = t.map(lambda name: t.run(name, cmd), names) # every host at once (one thread per host)
        s = t.session("lab1", argv(py, "-u", "-c", boot))  # a live stdin/stdout/stderr channel

Commands are pyinfra ``StringCommand``\\ s (vllm_fleet.host.programs) or plain command lines; a
host whose ``ssh_user`` is not root runs them with ``sudo -n`` (the deploy's own preflight
proves it works without a password). A host that cannot be reached gives a :class:`HostError`
naming it; the others go on.
"""

from __future__ import annotations

import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeVar

from pyinfra.api import Config, Inventory, State, StringCommand

T = TypeVar("T")


class HostError(Exception):
    """A host could not be reached or the command could not be started there."""


@dataclass
class Result:
    ok: bool
    code: int | None
    stdout: str
    stderr: str

    @property
    def lines(self) -> list[str]:
        return self.stdout.splitlines()


def _text(command: Any) -> str:
    return command.get_raw_value() if isinstance(command, StringCommand) else str(command)


def needs_sudo(data: dict[str, Any], name: str) -> bool:
    """Whether commands run with ``sudo -n`` there: the host data's ``_sudo`` where it says (as
    the deploy's operations do), else a login as another user than root (``ssh_user``, or the
    ``user@`` of the host's name); never by default on ``@local``, where the command runs as
    whoever runs vllm-fleet."""
    if data.get("_sudo") is not None:
        return bool(data["_sudo"])
    if name.startswith("@"):
        return False
    user = data.get("ssh_user") or (name.rpartition("@")[0] if "@" in name else "") or "root"
    return user != "root"


def is_local(name: str) -> bool:
    """pyinfra's ``@local`` connector: this machine, reached by a child process (no SSH)."""
    return name == "@local"


class Transport:
    """Connections to inventory hosts through pyinfra's connectors, opened on first use, one per
    host, closed by :meth:`close` (or the ``with`` block)."""

    def __init__(self, hosts: dict[str, dict[str, Any]], *, connect_timeout: int = 10):
        self.hosts = hosts
        entries = []
        for name, h in hosts.items():
            data = dict(h.get("data") or {})
            if not name.startswith("@") and h.get("address"):
                data.setdefault("ssh_hostname", h["address"])
            entries.append((name, data))
        self._inventory = Inventory((entries, {}))
        self._state = State(self._inventory, Config(CONNECT_TIMEOUT=connect_timeout))
        self._lock = threading.Lock()
        self._connected: dict[str, Any] = {}
        self._locks: dict[str, threading.Lock] = {}

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _host(self, name: str):
        with self._lock:
            lock = self._locks.setdefault(name, threading.Lock())
        with lock:
            if name in self._connected:
                return self._connected[name]
            host = self._inventory.get_host(name)
            if host is None:
                raise HostError(f"{name}: not in the inventory")
            try:
                host.connect(reason="vllm-fleet", raise_exceptions=True)
            except Exception as exc:  # pyinfra's ConnectError and whatever the connector raises
                raise HostError(f"{name}: cannot connect ({type(exc).__name__}: {exc})") from None
            self._connected[name] = host
            return host

    def sudo(self, name: str) -> bool:
        return needs_sudo((self.hosts.get(name) or {}).get("data") or {}, name)

    def run(self, name: str, command: Any, *, timeout: int = 60, sudo: bool | None = None) -> Result:
        """Run one command line on host ``name``; :class:`HostError` when it cannot be reached."""
        sudo = self.sudo(name) if sudo is None else sudo
        if is_local(name):
            return self._run_local(command, timeout=timeout, sudo=sudo)
        host = self._host(name)
        cmd = command if isinstance(command, StringCommand) else StringCommand(command)
        try:
            ok, out = host.run_shell_command(cmd, _sudo=sudo, _timeout=timeout, print_output=False, print_input=False)
        except Exception as exc:
            raise HostError(f"{name}: {type(exc).__name__}: {exc}") from None
        stdout = "\n".join(getattr(out, "stdout_lines", []) or [])
        stderr = "\n".join(getattr(out, "stderr_lines", []) or [])
        return Result(bool(ok), 0 if ok else None, stdout + ("\n" if stdout else ""), stderr)

    def _run_local(self, command: Any, *, timeout: int, sudo: bool) -> Result:
        """``@local``: the command line run by ``sh`` in a child process of this one. Not through
        pyinfra's local connector: it waits on its child with gevent, whose child watcher works in
        the main thread only, and :meth:`map` runs every host in a thread of its own (that was
        "TypeError: child watchers are only available on the default loop")."""
        line = _text(command)
        if sudo:
            line = "sudo -n -H sh -c " + _text(StringCommand(_quote(line)))
        try:
            r = subprocess.run(
                ["sh", "-c", line], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            raise HostError(f"@local: the command did not finish in {timeout} s") from None
        except OSError as exc:
            raise HostError(f"@local: cannot run sh: {exc}") from None
        return Result(r.returncode == 0, r.returncode, r.stdout, r.stderr)

    def map(self, fn: Callable[[str], T], names: Iterable[str], workers: int = 16) -> list[T]:
        """``fn(name)`` for every host at once (a thread each; pyinfra's connector per host)."""
        names = list(names)
        if not names:
            return []
        with ThreadPoolExecutor(max_workers=min(workers, len(names))) as pool:
            return list(pool.map(fn, names))

    def session(self, name: str, command: Any, *, sudo: bool | None = None) -> "Session":
        """A live channel to a command on the host: text ``stdin``/``stdout``/``stderr`` (line
        buffered), ``wait(timeout)``, ``kill()``, ``returncode``. ``@local``: a child process."""
        sudo = self.sudo(name) if sudo is None else sudo
        line = _text(command)
        if sudo:
            line = "sudo -n -H sh -c " + _text(StringCommand(_quote(line)))
        if is_local(name):
            return Session(
                proc=subprocess.Popen(
                    ["sh", "-c", line],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    bufsize=1,
                )
            )
        host = self._host(name)
        client = getattr(host.connector, "client", None)
        if client is None or not hasattr(client, "get_transport"):
            raise HostError(f"{name}: its connector ({type(host.connector).__name__}) has no live channel")
        chan = client.get_transport().open_session()
        chan.exec_command(line)
        return Session(chan=chan)

    def close(self) -> None:
        for host in self._connected.values():
            try:
                host.disconnect()
            except Exception:
                pass
        self._connected.clear()


def _quote(text: str):
    from pyinfra.api import QuoteString

    return QuoteString(text)


class Session:
    """A running command with its three streams (a paramiko channel, or a local child process)."""

    def __init__(self, proc: subprocess.Popen | None = None, chan: Any = None):
        self.proc, self.chan = proc, chan
        if proc is not None:
            self.stdin, self.stdout, self.stderr = proc.stdin, proc.stdout, proc.stderr
        else:
            # paramiko's own files, line buffered, text (str) both ways: their readline returns as
            # soon as a line has arrived. Not io.TextIOWrapper over them: it reads 8 KiB chunks,
            # and paramiko's read(n) waits for n bytes or EOF, so a one-line answer never came
            # back (tests/test_transport_session.py).
            self.stdin = chan.makefile_stdin("w", 1)
            self.stdout = chan.makefile("r", 1)
            self.stderr = chan.makefile_stderr("r", 1)

    @property
    def returncode(self) -> int | None:
        if self.proc is not None:
            return self.proc.poll()
        return self.chan.recv_exit_status() if self.chan.exit_status_ready() else None

    def wait(self, timeout: float | None = None) -> int | None:
        if self.proc is not None:
            return self.proc.wait(timeout=timeout)
        import time

        end = None if timeout is None else time.monotonic() + timeout
        while not self.chan.exit_status_ready():
            if end is not None and time.monotonic() > end:
                raise TimeoutError("the host command did not exit")
            time.sleep(0.1)
        return self.chan.recv_exit_status()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
        else:
            self.chan.close()
