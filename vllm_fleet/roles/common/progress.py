"""Progress lines while a person waits on a long step of a deploy (an upload over SSH, a pip or uv
install, a hub download, a health wait): pyinfra prints "Starting operation" and then nothing
until the step ends, for a minute or more.

While such an operation runs on a host, one plain line every ``VLLM_FLEET_PROGRESS_INTERVAL``
seconds (default 10; 0: none), in pyinfra's own ``    [host] ...`` form and through its logger,
so the lines sit between its own and a log captured without a terminal holds no control codes:

    [lab1] Upload the fleet wheelhouse to /opt/vllm-fleet/x/wheelhouse: 412.1 MB of 893.4 MB (7.1 MB/s), 58 s
    [lab1] pip install vllm==0.11.0 ...: 45 s, waiting for pip on the host

Bytes are counted as pyinfra's SSH connector reads the local files it sends (a wrapper around
its ``_put_file``); the total comes from :func:`expect` (the role that creates the upload knows
its size). :func:`install` (called by the packaged deploys) registers the callback once per
pyinfra state. No operation, command or fact is added: a deploy's plan is the same with it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def size(n: int) -> str:
    """Bytes in decimal units, as a person reads them: 893.4 MB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


LONG = {  # words of an operation's name -> what it waits for
    "upload": "",  # bytes instead
    "model file": "",
    "pip install": "pip on the host",
    "uv pip install": "uv on the host",
    "cpu build fixes": "pip on the host",
    "download": "the download on the host",
    "wait for": "the unit to answer",
    "smoke tests": "the smoke tests",
    "ray cluster": "the Ray cluster",
}
_sent: dict[str, int] = {}  # host name -> bytes read for uploads so far
_totals: dict[tuple[str, str], int] = {}  # (host name, op hash) -> bytes the upload sends at most
_installed: set[int] = set()


def interval() -> float:
    try:
        return float(os.environ.get("VLLM_FLEET_PROGRESS_INTERVAL", "10"))
    except ValueError:
        return 10.0


def tree_size(path: str | Path) -> int:
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def expect(op: Any, total: int) -> Any:
    """Note that ``op`` (an OperationMeta of this host) uploads at most ``total`` bytes; returns op."""
    from pyinfra import host

    h = getattr(op, "_hash", None)
    if h:
        _totals[(host.name, h)] = total
    return op


def line(name: str, elapsed: float, sent: int | None = None, total: int | None = None) -> str:
    """One progress line (without the host prefix)."""
    secs = f"{elapsed:.0f} s"
    if sent is not None:
        rate = f"{size(int(sent / elapsed))}/s" if elapsed > 0 else "-"
        of = f" of {size(total)}" if total else ""
        return f"{name}: {size(sent)}{of} ({rate}), {secs}"
    low = name.lower()
    awaited = next((what for word, what in LONG.items() if word in low and what), "the host")
    return f"{name}: {secs}, waiting for {awaited}"


def _long(name: str) -> bool:
    low = name.lower()
    return any(word in low for word in LONG)


def _counting_put_file(orig):
    def put_file(self, filename_or_io, remote_location, *args, **kwargs):
        name = self.host.name
        if isinstance(filename_or_io, str):
            with open(filename_or_io, "rb") as f:
                return orig(self, _Counted(f, name), remote_location, *args, **kwargs)
        return orig(self, filename_or_io, remote_location, *args, **kwargs)

    put_file._vllm_fleet_counting = True  # type: ignore[attr-defined]
    return put_file


class _Counted:
    """A binary file whose reads are added to ``_sent[host]`` (what paramiko's putfo sends)."""

    def __init__(self, f, host_name: str):
        self._f, self._host = f, host_name

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        _sent[self._host] = _sent.get(self._host, 0) + len(data)
        return data

    def seek(self, *a):
        return self._f.seek(*a)

    def tell(self):
        return self._f.tell()

    def __getattr__(self, name):
        return getattr(self._f, name)


def _callback():
    from pyinfra.api.state import BaseStateCallback

    class Callback(_Callback, BaseStateCallback):
        pass

    return Callback()


class _Callback:
    """pyinfra state callbacks: a ticker greenlet per long operation on a host."""

    def __init__(self) -> None:
        self.tickers: dict[tuple[str, str], Any] = {}

    def _name(self, state, op_hash) -> str:
        try:
            return ", ".join(sorted(state.get_op_meta(op_hash).names))
        except Exception:  # pragma: no cover
            return ""

    def operation_host_start(self, state, host, op_hash):
        every = interval()
        name = self._name(state, op_hash)
        if every <= 0 or not _long(name):
            return
        import gevent
        from pyinfra import logger

        key = (host.name, op_hash)
        total = _totals.get(key)
        upload = "upload" in name.lower() or "model file" in name.lower()

        def tick():
            t0, base = time.monotonic(), _sent.get(host.name, 0)
            while True:
                gevent.sleep(every)
                sent = _sent.get(host.name, 0) - base if upload else None
                logger.info(f"    [{host.name}] {line(name, time.monotonic() - t0, sent, total)}")

        self.tickers[key] = gevent.spawn(tick)

    def _stop(self, host, op_hash):
        g = self.tickers.pop((host.name, op_hash), None)
        if g is not None:
            g.kill(block=False)

    def operation_host_success(self, state, host, op_hash, *a, **k):
        self._stop(host, op_hash)

    def operation_host_error(self, state, host, op_hash, *a, **k):
        self._stop(host, op_hash)


def install() -> None:
    """Register the progress lines for this pyinfra run (once per state; safe to call per host)."""
    import pyinfra
    from pyinfra.context import ctx_state

    if not getattr(pyinfra, "is_cli", False):  # pyinfra's API in another program: its own output
        return
    st = ctx_state.get()
    if st is None or id(st) in _installed:
        return
    _installed.add(id(st))
    try:
        from pyinfra.connectors.ssh import SSHConnector

        if not getattr(SSHConnector._put_file, "_vllm_fleet_counting", False):
            SSHConnector._put_file = _counting_put_file(SSHConnector._put_file)  # type: ignore[method-assign]
    except ImportError:  # pragma: no cover
        pass
    st.add_callback_handler(_callback())
