"""vllm_fleet.fetch.treehash: the control machine hashes a model tree once, across processes.

The hashes are checked against the system's sha256sum; that the cache answered (and no file was
read) is seen by planting a wrong hash in its record: only a cache hit can return it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_fleet.fetch import treehash


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("VLLM_FLEET_HASH_CACHE", str(d))
    return d


@pytest.fixture
def tree(tmp_path):
    d = tmp_path / "model"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 4096)
    (d / "sub" / "t.json").write_text("{}")
    return d


def sha256sum(d: Path) -> dict[str, str]:
    rels = sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())
    out = subprocess.run(["sha256sum", *rels], cwd=d, capture_output=True, text=True, check=True).stdout
    return {line.split("  ", 1)[1]: line.split()[0] for line in out.splitlines()}


def record(cache: Path) -> Path:
    (found,) = [p for p in cache.iterdir() if p.suffix == ".json"]
    return found


def plant(cache: Path, rel: str, sha: str) -> None:
    """Put a wrong hash for ``rel`` in the record (its size, mtime, ctime and inode kept)."""
    doc = json.loads(record(cache).read_text())
    doc["files"][rel][4] = sha
    record(cache).write_text(json.dumps(doc))


def hash_in_a_new_process(d: Path) -> dict[str, str]:
    code = (
        "import json, sys; from vllm_fleet.fetch.treehash import hash_tree; print(json.dumps(hash_tree(sys.argv[1])))"
    )
    r = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, check=True, env=os.environ)
    return json.loads(r.stdout)


def test_a_tree_is_read_once_then_answered_from_the_cache_by_the_next_process(cache, tree):
    said = []
    assert hash_in_a_new_process(tree) == sha256sum(tree)  # the first deploy process reads every file
    plant(cache, "model.safetensors", "0" * 64)
    shas = treehash.hash_tree(tree, log=said.append)  # the next one: size, mtime, ctime, inode as recorded
    assert shas["model.safetensors"] == "0" * 64 and said == []
    assert {k: v for k, v in shas.items() if k != "model.safetensors"} == {
        k: v for k, v in sha256sum(tree).items() if k != "model.safetensors"
    }


@pytest.mark.parametrize("change", ["content", "mtime set back", "touch", "replaced", "added"])
def test_a_file_that_changed_in_any_way_is_read_again(cache, tree, change):
    """Another content (same size, the mtime put back: the ctime moved), a touch, a file
    replaced by another inode with the old times, a new file: read, and only that one."""
    treehash.hash_tree(tree)
    plant(cache, "model.safetensors", "0" * 64)
    plant(cache, "config.json", "1" * 64)  # not changed: stays the cache's answer
    f = tree / "model.safetensors"
    st = f.stat()
    if change == "content":
        f.write_bytes(bytes(255 - b for b in f.read_bytes()))
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif change == "mtime set back":
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif change == "touch":
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    elif change == "replaced":
        (tree / "new").write_bytes(f.read_bytes())
        os.utime(tree / "new", ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(tree / "new", f)
    else:
        (tree / "extra.bin").write_bytes(b"x")
    said = []
    shas = treehash.hash_tree(tree, log=said.append)
    want = {**sha256sum(tree), "config.json": "1" * 64}
    if change == "added":  # the new file read, the others from the cache
        want["model.safetensors"] = "0" * 64
    assert shas == want
    assert len(said) == 1 and said[0].startswith("hashing 1 file(s) of "), said


def test_concurrent_writers_leave_one_complete_record(cache, tree):
    """Four processes hash the same tree at once: each gets the right hashes and the record is
    one of theirs, whole (written to a temporary name, then renamed)."""
    code = (
        "import json, sys; from vllm_fleet.fetch.treehash import hash_tree; print(json.dumps(hash_tree(sys.argv[1])))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tree)], stdout=subprocess.PIPE, text=True) for _ in range(4)
    ]
    outs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    want = sha256sum(tree)
    assert outs == [want] * 4
    assert [p.name for p in cache.iterdir()] == [record(cache).name]  # no temporary file left
    assert {rel: v[4] for rel, v in json.loads(record(cache).read_text())["files"].items()} == want


def test_an_unwritable_cache_costs_a_rehash_not_a_failure(tmp_path, monkeypatch, tree):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("VLLM_FLEET_HASH_CACHE", str(blocker / "sha256"))
    assert treehash.hash_tree(tree) == sha256sum(tree)


def test_the_hashing_runs_off_the_gevent_loop(tmp_path):
    """Under gevent's patching (pyinfra's deploy process) another greenlet keeps running while a
    64 MiB file is hashed; in the loop itself it would stand still until the hash is done."""
    big = tmp_path / "big"
    big.mkdir()
    (big / "w.bin").write_bytes(os.urandom(1 << 20) * 64)
    script = textwrap.dedent("""
        from gevent import monkey; monkey.patch_all()
        import json, sys, time, gevent
        from vllm_fleet.fetch import treehash
        ticks = []
        def tick():
            while True:
                ticks.append(time.monotonic()); gevent.sleep(0.005)
        g = gevent.spawn(tick); gevent.sleep(0.02)
        t0 = time.monotonic(); treehash.hash_tree(sys.argv[1]); t1 = time.monotonic()
        g.kill()
        print(json.dumps({"during": sum(1 for t in ticks if t0 < t < t1), "hash_s": t1 - t0}))
    """)
    r = subprocess.run(
        [sys.executable, "-c", script, str(big)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "VLLM_FLEET_HASH_CACHE": str(tmp_path / "cache")},
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["during"] >= 5, got
