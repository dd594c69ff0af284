"""Fetch an artifact's files over HTTP into DEST, each one checked against the sha256 the control
machine sent over SSH before it is kept (vllm_fleet.roles.common.wheels: the fleet wheelhouse).

    python3 fetch_files.py LIST DEST

LIST (a root-only JSON file the deploy put here over SSH): {"sources": [base URL, ...],
"files": {name: [size, sha256]}}. A file already in DEST with that size and sha256 is kept (no
transfer); any other is fetched from the first source that gives a verified copy (a copy whose
size or sha256 differs is refused, never kept, and the next source is tried); files in DEST that
LIST does not name are removed (DEST mirrors the artifact). Standard library only: this runs on
the host's system python3 before any environment exists. Exit 0 when every file is in place;
1 with the file, each source tried and why, when one is not.
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


def fetch(url, part, size, sha):
    """Download ``url`` into ``part`` hashing as it goes; the reason it was refused, or None."""
    h, got = hashlib.sha256(), 0
    with urllib.request.urlopen(url, timeout=60) as r, open(part, "wb") as out:
        for block in iter(lambda: r.read(CHUNK), b""):
            got += len(block)
            if got > size:
                return f"more than the {size} bytes expected"
            h.update(block)
            out.write(block)
    if got != size:
        return f"{got} bytes, {size} expected"
    if h.hexdigest() != sha:
        return f"sha256 {h.hexdigest()[:16]}..., {sha[:16]}... expected: refused"
    return None


def main(listing, dest):
    with open(listing) as f:
        want = json.load(f)
    sources, files = want["sources"], want["files"]
    for name in files:
        if "/" in name or name.startswith("."):
            print(f"fetch: {name!r}: not a plain file name; nothing fetched", file=sys.stderr)
            return 1
    os.makedirs(dest, mode=0o755, exist_ok=True)
    for name in os.listdir(dest):
        if name not in files and os.path.isfile(os.path.join(dest, name)):
            os.remove(os.path.join(dest, name))
    t0, fetched, kept = time.monotonic(), 0, 0
    for name, (size, sha) in sorted(files.items()):
        path = os.path.join(dest, name)
        if os.path.isfile(path) and os.path.getsize(path) == size and sha256_of(path) == sha:
            kept += 1
            continue
        why = []
        for base in sources:
            part = os.path.join(dest, f".{name}.part")
            try:
                reason = fetch(base + name, part, size, sha)
            except OSError as exc:
                reason = str(exc)
            if reason is None:
                os.replace(part, path)
                fetched += size
                break
            if os.path.exists(part):
                os.remove(part)
            why.append(f"{base.split('//', 1)[-1].split('/', 1)[0]}: {reason}")
        else:
            print(f"fetch: {name}: no source gave a verified copy ({'; '.join(why)})", file=sys.stderr)
            return 1
    secs = time.monotonic() - t0
    print(f"fetch: {len(files)} files in {dest}: {kept} already there, {fetched / 1e6:.1f} MB fetched and verified in {secs:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
