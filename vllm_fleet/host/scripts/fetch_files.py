"""Fetch an artifact's files over HTTP into DEST, each one checked against the sha256 the control
machine sent over SSH before it is kept (vllm_fleet.roles.common.wheels: the fleet wheelhouse).

    python3 fetch_files.py LIST DEST

LIST (a root-only JSON file the deploy put here over SSH): {"sources": [base URL, ...],
"files": {name: [size, sha256]}}, a name a relative path (``a/b.safetensors``; no ``..``). A
file already in DEST with that size and sha256 is kept (no transfer); any other is fetched from
the first source that gives a verified copy (a copy whose size or sha256 differs is refused,
never kept, and the next source is tried); with no source at all, what is in DEST is only
checked. Optional: ``"prune": false`` keeps files in DEST that LIST does not name (default: they
are removed, DEST mirrors the artifact; the model role removes its own stale files),
``"owner": USER`` and ``"mode": "644"`` for each fetched file (and ``"dir_mode"`` for the
directories made), set before it is renamed into place (and on a verified file already there
that differs: the control machine's copy put over SSH is root's). Standard library only: this
runs on the host's system python3 before any environment exists. Exit 0 when every file is in
place; 1 with the file, each source tried and why, when one is not.
"""

import hashlib
import json
import os
import sys
import time
import urllib.request

CHUNK = 1 << 20


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def open_new(path):
    """``path`` created for writing, never through a link or over a file someone put there (DEST
    may belong to the service user while this runs as root: O_EXCL|O_NOFOLLOW after an unlink)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb")


def fetch(url, part, size, sha, ids=None, mode=0o644):
    """Download ``url`` into ``part`` hashing as it goes, owner and mode set on the open file;
    the reason it was refused, or None."""
    h, got = hashlib.sha256(), 0
    with urllib.request.urlopen(url, timeout=60) as r, open_new(part) as out:
        for block in iter(lambda: r.read(CHUNK), b""):
            got += len(block)
            if got > size:
                return f"more than the {size} bytes expected"
            h.update(block)
            out.write(block)
        if ids:
            os.fchown(out.fileno(), *ids)
        os.fchmod(out.fileno(), mode)
    if got != size:
        return f"{got} bytes, {size} expected"
    if h.hexdigest() != sha:
        return f"sha256 {h.hexdigest()[:16]}..., {sha[:16]}... expected: refused"
    return None


def safe_name(name):
    """A relative path inside DEST: no absolute path, no empty, '.' or '..' part."""
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def owner_ids(owner):
    if not owner:
        return None
    import pwd

    pw = pwd.getpwnam(owner)
    return pw.pw_uid, pw.pw_gid


def make_dirs(dest, sub, ids, dir_mode):
    """DEST/SUB, each directory made here owned by ``ids`` with ``dir_mode``."""
    path = dest
    for part in [p for p in sub.split("/") if p]:
        path = os.path.join(path, part)
        if not os.path.isdir(path):
            os.mkdir(path, dir_mode)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                os.fchmod(fd, dir_mode)
                if ids:
                    os.fchown(fd, *ids)
            finally:
                os.close(fd)


def main(listing, dest):
    with open(listing) as f:
        want = json.load(f)
    sources, files = want["sources"], want["files"]
    for name in files:
        if not safe_name(name):
            print(f"fetch: {name!r}: not a relative path inside {dest}; nothing fetched", file=sys.stderr)
            return 1
    ids = owner_ids(want.get("owner"))
    mode = int(want.get("mode") or "644", 8)
    dir_mode = int(want.get("dir_mode") or "755", 8)
    os.makedirs(dest, mode=0o755, exist_ok=True)
    if want.get("prune", True):
        for name in os.listdir(dest):
            if name not in files and os.path.isfile(os.path.join(dest, name)):
                os.remove(os.path.join(dest, name))
    t0, fetched, kept, by = time.monotonic(), 0, 0, {}
    for name, (size, sha) in sorted(files.items()):
        path = os.path.join(dest, name)
        if (
            os.path.isfile(path)
            and not os.path.islink(path)
            and os.path.getsize(path) == size
            and sha256_of(path) == sha
        ):
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                st = os.fstat(fd)
                if ids and (st.st_uid, st.st_gid) != ids:
                    os.fchown(fd, *ids)
                if "mode" in want and st.st_mode & 0o7777 != mode:
                    os.fchmod(fd, mode)
            finally:
                os.close(fd)
            kept += 1
            continue
        make_dirs(dest, os.path.dirname(name), ids, dir_mode)
        why = []
        for i, base in enumerate(sources):
            part = os.path.join(os.path.dirname(path), f".{os.path.basename(name)}.part")
            try:
                reason = fetch(base + name, part, size, sha, ids, mode)
            except OSError as exc:
                reason = str(exc)
            if reason is None:
                os.replace(part, path)
                fetched += size
                source = base.split("//", 1)[-1].split("/", 1)[0]
                by[source] = by.get(source, 0) + size
                if i:  # the sources that refused, then the one that gave it
                    print(f"fetch: {name}: {'; '.join(why)}; then a verified copy from {source}", file=sys.stderr)
                break
            if os.path.exists(part):
                os.remove(part)
            why.append(f"{base.split('//', 1)[-1].split('/', 1)[0]}: {reason}")
        else:
            print(f"fetch: {name}: no source gave a verified copy ({'; '.join(why) or 'no source'})", file=sys.stderr)
            return 1
    secs = time.monotonic() - t0
    froms = ", ".join(f"{b / 1e6:.1f} MB from {src}" for src, b in sorted(by.items()))
    print(
        f"fetch: {len(files)} files in {dest}: {kept} already there, {fetched / 1e6:.1f} MB fetched and verified"
        f" in {secs:.1f} s" + (f" ({froms})" if froms else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
