"""The fleet wheelhouse: every wheel a deploy installs, downloaded once per fleet on the control
machine, then installed by every host with ``--no-index`` over the private network.

``install.wheels: fleet`` (the schema's default) uses it through the vllm role:

1. :func:`ensure` runs ``pip download`` once for the hosts' interpreter and platform (a host's
   Python version, glibc and machine, from the host's state read: roles.common.wheels.host_target) into
   ``$VLLM_FLEET_CACHE/wheelhouse/<key>`` (default ``/var/cache/vllm-fleet``), where the key
   hashes the requirements, the target and the sources (index URL, find-links). It is built in
   ``<key>.part`` and renamed when complete, under a lock, so concurrent deploys share one
   download and an interrupted one leaves nothing half-built behind. This is the only time the
   wheels cross the slow link.
2. :func:`serve` (when host data ``vllm_wheel_serve_address`` names the control machine's address
   on the hosts' network) starts one small HTTP file server bound to that address, on a free
   port, for the life of the deploy process. It serves the wheels of one directory and nothing
   else (no listing), under a random path only this deploy knows. Hosts fetch each wheel with
   ``host/scripts/fetch_files.py`` and keep it only when its sha256 is the one
   ``treehash.wheel_manifest`` gives (sent over SSH), then install from that local copy with ``--no-index``. Without
   that address the role uploads the directory over SSH instead.

Nothing here imports pyinfra (part of the core). The server is ``host/scripts/serve_files.py DIR
ADDR 0`` (its path token in $VLLM_FLEET_SERVE_TOKEN; prints its port, exits when its parent
does), the same file the hosts' peer servers run (vllm_fleet.roles.common.peers).
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

COMPLETE_MARKER = ".vllm-fleet-complete"
#: The oldest glibc minor a manylinux_2_X tag names (PEP 600: manylinux1 = 2_5).
_OLDEST_GLIBC_MINOR = 5


class WheelhouseError(RuntimeError):
    """The fleet wheelhouse could not be filled (the message says why and what to do)."""


def cache_root() -> Path:
    """``$VLLM_FLEET_WHEELHOUSE``, else ``$VLLM_FLEET_CACHE/wheelhouse`` (default /var/cache/vllm-fleet)."""
    if os.environ.get("VLLM_FLEET_WHEELHOUSE"):
        return Path(os.environ["VLLM_FLEET_WHEELHOUSE"])
    return Path(os.environ.get("VLLM_FLEET_CACHE", "/var/cache/vllm-fleet")) / "wheelhouse"


# pyinfra plans every host in its own greenlet: they wait for one another on this lock (made when
# first needed, so that it is gevent's cooperative lock once pyinfra has patched threading; an
# OS-level flock alone would block the one thread all greenlets share). The flock in ensure()
# is for other processes.
_locks: dict[str, threading.Lock] = {}
_locks_guard: list[threading.Lock] = []


def named_lock(name: str) -> threading.Lock:
    """One lock per name for this deploy process (pyinfra's host greenlets and threads alike):
    what fills a cache once while every host waits (the wheelhouse, vllm_fleet.fetch.hubcache)."""
    if not _locks_guard:
        _locks_guard.append(threading.Lock())
    with _locks_guard[0]:
        return _locks.setdefault(name, threading.Lock())


def platform_tags(glibc: str, machine: str) -> list[str]:
    """The platform tags a glibc ``X.Y`` Linux ``machine`` host accepts, newest first
    (``manylinux_2_Y`` down to 2_5, the legacy aliases, ``linux_<machine>``): pip's
    ``--platform`` does not expand ``manylinux_2_Y`` to the older tags by itself."""
    major, minor = (int(x) for x in glibc.split(".")[:2])
    if major != 2:
        raise WheelhouseError(f"glibc {glibc}: only glibc 2.x hosts are known")
    tags = [f"manylinux_2_{m}_{machine}" for m in range(minor, _OLDEST_GLIBC_MINOR - 1, -1)]
    # PEP 599/571/513 aliases: manylinux2014 = 2_17 (every arch), 2010 = 2_12 and 1 = 2_5 (x86 only)
    legacy = [
        (17, "manylinux2014", None),
        (12, "manylinux2010", ("x86_64", "i686")),
        (5, "manylinux1", ("x86_64", "i686")),
    ]
    tags += [f"{name}_{machine}" for m, name, arches in legacy if m <= minor and (arches is None or machine in arches)]
    return [*dict.fromkeys(tags), f"linux_{machine}"]


def download_argv(
    python: str,
    requirements: list[str],
    dest: str | Path,
    target: dict,
    *,
    index_url: str | None = None,
    find_links: str | None = None,
) -> list[str]:
    """``pip download`` of ``requirements`` and every dependency, as wheels for ``target``
    (``{"python": "3.11", "glibc": "2.36", "machine": "x86_64"}``)."""
    py = target["python"]
    abi = "cp" + py.replace(".", "")
    argv = [
        python,
        "-m",
        "pip",
        "download",
        "--no-input",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "--dest",
        str(dest),
        "--only-binary=:all:",
        "--python-version",
        py,
        "--implementation",
        "cp",
        "--abi",
        abi,
    ]
    for tag in platform_tags(target["glibc"], target["machine"]):
        argv += ["--platform", tag]
    if index_url:
        argv += ["--index-url", index_url]
    if find_links:
        argv += ["--find-links", str(find_links)]
    return argv + list(requirements)


def key(requirements: list[str], target: dict, *, index_url: str | None = None, find_links: str | None = None) -> str:
    """The cache key: requirements, target and sources (the find-links directory by its wheels' names)."""
    links = sorted(p.name for p in Path(find_links).glob("*")) if find_links and Path(find_links).is_dir() else []
    text = json.dumps(
        {"requirements": sorted(requirements), "target": target, "index_url": index_url, "find_links": links},
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fill_once(root: Path, k: str, fill) -> Path:
    """``root/k``, filled once: unless it is complete (holds ``COMPLETE_MARKER``), ``fill(part)``
    fills ``root/k.part`` (kept when a fill is interrupted, so the next one can resume what is
    there) and returns the record to write into the marker; then ``part`` is renamed to
    ``root/k``. Concurrent callers wait: pyinfra's greenlets on a cooperative lock, other
    processes on an flock. The fleet wheelhouse and the fleet hub cache
    (:mod:`vllm_fleet.fetch.hubcache`) are both filled this way."""
    dest = root / k
    if (dest / COMPLETE_MARKER).exists():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    with named_lock(f"ensure:{dest}"), open(root / f".{k}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / COMPLETE_MARKER).exists():
            return dest
        part = root / f"{k}.part"
        record = fill(part)
        (part / COMPLETE_MARKER).write_text(json.dumps(record, indent=1) + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        part.rename(dest)
        return dest


def ensure(
    requirements: list[str],
    target: dict,
    *,
    index_url: str | None = None,
    find_links: str | None = None,
    root: Path | None = None,
    python: str | None = None,
    log=None,
) -> Path:
    """The filled wheelhouse directory for these requirements and target (downloaded once;
    later calls return the same directory without touching the network)."""
    root = root or cache_root()
    k = key(requirements, target, index_url=index_url, find_links=find_links)
    dest = root / k

    def fill(part: Path) -> dict:
        argv = download_argv(
            python or sys.executable, requirements, part, target, index_url=index_url, find_links=find_links
        )
        if log:
            log(
                f"fleet wheelhouse: downloading {' '.join(requirements)} for Python {target['python']} "
                f"glibc {target['glibc']} {target['machine']} into {dest} (once per fleet)"
            )
        t0 = time.monotonic()
        proc = _run_with_progress(argv, part, log)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
            raise WheelhouseError(
                f"install.wheels: fleet: `pip download` on the control machine failed (exit {proc.returncode}):\n"
                f"{tail}\nFix: make the index reachable from the control machine (install.index_url for a mirror), "
                "give a complete wheelhouse (install.wheelhouse), or let every host download for itself "
                "(install.wheels: host)"
            )
        wheels = sorted(p.name for p in part.glob("*.whl"))
        return {
            "requirements": requirements,
            "target": target,
            "index_url": index_url,
            "seconds": round(time.monotonic() - t0, 1),
            "wheels": len(wheels),
            "bytes": sum((part / w).stat().st_size for w in wheels),
        }

    return fill_once(root, k, fill)


def progress_interval() -> float:
    """Seconds between progress lines (VLLM_FLEET_PROGRESS_INTERVAL, default 10; 0: none)."""
    try:
        return float(os.environ.get("VLLM_FLEET_PROGRESS_INTERVAL", "10"))
    except ValueError:
        return 10.0


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


class Ticker:
    """While a download fills ``part``: ``log`` a line every progress_interval() seconds with the
    bytes there (of ``total``) and the rate. A thread (a greenlet under pyinfra's gevent)."""

    def __init__(self, log, what: str, part: Path, total: int | None = None):
        self.log, self.what, self.part, self.total = log, what, part, total
        self.done = threading.Event()
        self.every = progress_interval()
        self.t0 = time.monotonic()
        self.thread = threading.Thread(target=self._run, daemon=True) if log and self.every > 0 else None

    def _run(self) -> None:
        while not self.done.wait(self.every):
            got, secs = dir_bytes(self.part), time.monotonic() - self.t0
            of = f" of {self.total / 1e6:.1f} MB" if self.total else ""
            self.log(f"{self.what}: {got / 1e6:.1f} MB{of} so far ({got / 1e6 / secs:.1f} MB/s), {secs:.0f} s")

    def __enter__(self) -> "Ticker":
        if self.thread:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()


def _run_with_progress(argv: list[str], part: Path, log) -> subprocess.CompletedProcess:
    """``pip download`` into ``part``; while it runs, a line every VLLM_FLEET_PROGRESS_INTERVAL
    seconds (default 10, 0: none) with the bytes there so far and the rate."""
    try:
        every = float(os.environ.get("VLLM_FLEET_PROGRESS_INTERVAL", "10"))
    except ValueError:
        every = 10.0
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    t0 = time.monotonic()
    while True:
        try:
            out, err = proc.communicate(timeout=every if log and every > 0 else None)
            break
        except subprocess.TimeoutExpired:
            got = sum(f.stat().st_size for f in part.glob("*") if f.is_file()) if part.is_dir() else 0
            secs = time.monotonic() - t0
            log(f"fleet wheelhouse: downloading: {got / 1e6:.1f} MB so far ({got / 1e6 / secs:.1f} MB/s), {secs:.0f} s")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def add_flashinfer_cubin(
    directory: Path,
    target: dict,
    *,
    index_url: str | None = None,
    find_links: str | None = None,
    python: str | None = None,
    log=None,
) -> str | None:
    """Put ``flashinfer-cubin`` beside the ``flashinfer-python`` of a filled CUDA wheelhouse (the
    same version exactly; vLLM >= 0.26 no longer requires it, so ``pip download vllm`` leaves it
    out: :mod:`vllm_fleet.specs.flashinfer`). Once per wheelhouse: when the source has no such
    version, that is recorded beside the wheels and returned (a warning, not a failure: FlashInfer
    then downloads its kernels at first use, which only a host with internet can)."""
    from vllm_fleet.specs import flashinfer

    version = flashinfer.wheelhouse_lacks_cubin(directory)
    if not version:
        return None
    marker = directory / f".{flashinfer.CUBIN}-{version}-unavailable"
    if marker.exists():
        return marker.read_text().strip()
    with named_lock(f"cubin:{directory}"), open(directory.parent / f".{directory.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not flashinfer.wheelhouse_lacks_cubin(directory):
            return None
        argv = download_argv(
            python or sys.executable,
            ["--no-deps", f"{flashinfer.CUBIN}=={version}"],
            directory,
            target,
            index_url=index_url,
            find_links=find_links,
        )
        proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if proc.returncode == 0 and not flashinfer.wheelhouse_lacks_cubin(directory):
            if log:
                log(
                    f"fleet wheelhouse: added {flashinfer.CUBIN}=={version} (FlashInfer's pre-built kernels, for "
                    "hosts without internet)"
                )
            return None
        why = (
            f"{flashinfer.CUBIN}=={version} (the version of {flashinfer.PYTHON} in the wheelhouse) is not on the "
            "index: FlashInfer will download its pre-built kernels at first use, which a host without internet cannot; "
            f"put the wheel into the fleet's find-links (host data vllm_find_links) or install.wheelhouse"
        )
        marker.write_text(why + "\n")
        if log:
            log(f"fleet wheelhouse: WARNING: {why}")
        return why


def info(directory: Path) -> dict:
    """What :func:`ensure` recorded (requirements, seconds, wheels, bytes)."""
    return json.loads((Path(directory) / COMPLETE_MARKER).read_text())


# ------------------------------------------------------------------------------------------------
# The manifest and the HTTP server the hosts fetch from

TOKEN_ENV = "VLLM_FLEET_SERVE_TOKEN"
# the one file server: the hosts' peer servers run it too (vllm_fleet.roles.common.peers)
SERVE_SCRIPT = Path(__file__).resolve().parent.parent / "host" / "scripts" / "serve_files.py"


_servers: dict[tuple[str, str], tuple[subprocess.Popen, int, str]] = {}


def serve(directory: Path, address: str) -> tuple[int, str]:
    """Serve the wheels of ``directory`` (and nothing else: no listing, no other file of the
    cache) on ``address`` at a free port for the rest of this process, under a path only this
    deploy knows: returns ``(port, token)``, each wheel at ``http://ADDRESS:PORT/TOKEN/NAME``.
    One server per (directory, address), stopped by PID when this process exits (and it stops
    itself when its parent is gone). What a host fetches is checked against
    ``vllm_fleet.fetch.treehash.wheel_manifest``."""
    with named_lock(f"serve:{directory}:{address}"):
        return _serve(Path(directory), address)


def _serve(directory: Path, address: str) -> tuple[int, str]:
    import secrets

    k = (str(directory), address)
    running = _servers.get(k)
    if running and running[0].poll() is None:
        return running[1], running[2]
    token = secrets.token_urlsafe(24)
    # the token in the environment (readable by this user only), not in argv (ps shows argv to all)
    proc = subprocess.Popen(
        [sys.executable, str(SERVE_SCRIPT), str(directory), address, "0"],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env={**os.environ, TOKEN_ENV: token},
    )
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.strip().isdigit():
        proc.kill()
        raise WheelhouseError(
            f"vllm_wheel_serve_address {address}: the wheel server did not start "
            f"(is {address} an address of this machine?)"
        )
    port = int(line)
    _servers[k] = (proc, port, token)
    atexit.register(_stop, proc)
    return port, token


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
