"""The sha256 of every file of a directory tree on the control machine, hashed once per content:
what ``transfer: upload`` builds its manifest from (vllm_fleet.roles.model.local_manifest).

Every deploy process (and each rollout batch is one) needs the manifest of ``model.local_dir``;
hashing a 140 GB model takes minutes. :func:`hash_tree` keeps what it hashed in a cache that
outlives the process: one JSON file per tree under :func:`cache_dir`, holding for each file its
size, mtime_ns, ctime_ns and inode (``os.stat``, links followed) with its sha256. A file whose
four values are unchanged is not read again; any other file is (an edit, a copy over it, a
``touch``: the ctime moves even where a tool puts the old mtime back). The file is written to a
temporary name in the same directory and renamed over the old one, so a reader (another deploy,
another user's shell) sees the old record or the new one, and two writers leave one of their
two complete records.

The hashing runs off the gevent loop when pyinfra has patched this process (gevent's threadpool:
the other hosts' greenlets keep their connections and facts going), and once per tree at a time
in a process (the other greenlets wait on a lock, then find it cached). ``vllm-fleet deploy``
hashes before pyinfra starts (:func:`hash_tree` from commands/deploy.py), so the deploy process
finds every file in the cache.

Nothing here imports pyinfra (part of the core).

Example::

    from vllm_fleet.fetch.treehash import hash_tree

    shas = hash_tree("~/models/llama")          # {"config.json": "ab12...", "model-00001-of-00004.safetensors": ...}
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable

from vllm_fleet.fetch.wheelhouse import named_lock

_VERSION = 1


def cache_dir() -> Path:
    """``$VLLM_FLEET_HASH_CACHE``, else ``$XDG_CACHE_HOME/vllm-fleet/sha256`` (default
    ``~/.cache/vllm-fleet/sha256``): the user's own (the hashes are of the user's files, and no
    other user can write a hash there that a deploy would then trust)."""
    if os.environ.get("VLLM_FLEET_HASH_CACHE"):
        return Path(os.environ["VLLM_FLEET_HASH_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vllm-fleet" / "sha256"


def _record_path(root: Path) -> Path:
    return cache_dir() / f"{hashlib.sha256(str(root).encode()).hexdigest()[:32]}.json"


def _files(root: Path) -> dict[str, tuple[Path, tuple[int, int, int, int]]]:
    """``{relative posix path: (path, (size, mtime_ns, ctime_ns, inode))}`` of every regular file
    under ``root`` (symbolic links followed, as a reader of the file would)."""
    out = {}
    for p in sorted(root.rglob("*")):
        try:
            st = p.stat()
        except OSError:  # a dangling link, a file removed meanwhile
            continue
        if p.is_file():
            out[p.relative_to(root).as_posix()] = (p, (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _load(record: Path, root: Path) -> dict[str, list]:
    try:
        doc = json.loads(record.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("version") != _VERSION or doc.get("root") != str(root):
        return {}
    files = doc.get("files")
    return files if isinstance(files, dict) else {}


def _save(record: Path, root: Path, files: dict[str, list]) -> None:
    """Write-then-rename; a cache that cannot be written costs a re-hash next time, nothing else."""
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=record.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": _VERSION, "root": str(root), "files": files}, f)
            os.replace(tmp, record)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass


def _hash(root: Path, log: Callable[[str], None] | None) -> tuple[dict[str, str], int]:
    """The tree's ``{rel: sha256}`` and the number of files read (not found in the cache)."""
    record = _record_path(root)
    cached = _load(record, root)
    now = _files(root)
    todo = [
        rel
        for rel, (_, sig) in now.items()
        if not (isinstance(cached.get(rel), list) and len(cached[rel]) == 5 and tuple(cached[rel][:4]) == sig)
    ]
    if todo and log:
        size = sum(now[rel][1][0] for rel in todo)
        log(
            f"hashing {len(todo)} file(s) of {root} ({size / 2**30:.2f} GiB) not hashed before; "
            f"kept in {cache_dir()} for the next deploy"
        )
    out = {}
    for rel, (path, sig) in now.items():
        if rel in todo:
            cached[rel] = [*sig, _sha256(path)]
        out[rel] = cached[rel][4]
    if todo or set(cached) - set(now):
        _save(record, root, {rel: cached[rel] for rel in now})
    return out, len(todo)


def _off_loop(fn: Callable, *args):
    """``fn(*args)`` in gevent's threadpool when gevent has patched this process (pyinfra's),
    so the loop and every other greenlet go on meanwhile; else here."""
    try:
        from gevent import get_hub, monkey
    except ImportError:
        return fn(*args)
    if not monkey.is_module_patched("threading"):
        return fn(*args)
    return get_hub().threadpool.apply(fn, args)


def hash_tree(directory: str | Path, log: Callable[[str], None] | None = None) -> dict[str, str]:
    """``{relative posix path: sha256}`` of every regular file under ``directory`` (``~``
    expanded, made absolute), sorted by path: from the cache where a file's size, mtime,
    ctime and inode are those recorded, else read (off the gevent loop) and recorded. ``log``:
    told once when files are read (how many, how large). One tree is hashed by one caller of
    this process at a time; the others wait and find it cached."""
    root = Path(os.path.abspath(os.path.expanduser(str(directory))))
    with named_lock(f"treehash:{root}"):
        shas, _ = _off_loop(_hash, root, log)
    return shas


def wheel_manifest(directory: str | Path) -> dict[str, list]:
    """``{wheel file name: [size, sha256]}`` of the wheels directly in ``directory`` (a fleet
    wheelhouse), from :func:`hash_tree`: what each host checks a fetched wheel against (the list
    reaches the host over SSH, never over the wheel server: vllm_fleet.roles.common.wheels)."""
    root = Path(os.path.abspath(os.path.expanduser(str(directory))))
    shas = hash_tree(root)
    return {
        rel: [(root / rel).stat().st_size, sha] for rel, sha in shas.items() if "/" not in rel and rel.endswith(".whl")
    }
