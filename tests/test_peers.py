"""Host to host transfers (vllm_fleet.roles.common.peers, issue 36 item 1): the round plan, the
file server every source runs (host/scripts/serve_files.py, the control machine's wheel server
too) and the fetch that checks each file (host/scripts/fetch_files.py), read with urllib and the
file system; the transient unit's properties read by systemd's own parser."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from types import SimpleNamespace
from pathlib import Path

import pytest

from vllm_fleet.host.programs import python, text
from vllm_fleet.roles.common.peers import Artifact, plan_rounds, round_count, server_argv


def _hosts(n):
    return [f"h{i}" for i in range(1, n + 1)]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9, 16, 31, 32, 33, 100])
def test_sources_double_each_round_and_one_copy_leaves_the_control_machine(n):
    rounds = plan_rounds(_hosts(n), [])
    assert rounds[0] == [("h1", [])]  # the only copy from the control machine
    have = ["h1"]
    for k, r in enumerate(rounds[1:], 1):
        assert len(r) == min(len(have), n - len(have))  # as many as there are sources, fewer at the end
        for name, srcs in r:
            assert sorted(srcs) == sorted(have)  # every host that holds a verified copy, none other
        assert [s[0] for _, s in r] == have[: len(r)]  # each source serves one host first
        have += [name for name, _ in r]
        if k < len(rounds) - 1:
            assert len(have) == 2**k  # doubled
    assert have == _hosts(n)  # every host once, in the layout's order
    assert len(rounds) <= round_count(n)  # the operations each host gets are enough


def test_hosts_staged_earlier_are_sources_and_no_copy_leaves_the_control_machine():
    rounds = plan_rounds(["h2", "h4", "h5", "h6", "h7"], ["h1", "h3"])
    assert rounds[0] == []
    assert rounds[1] == [("h2", ["h1", "h3"]), ("h4", ["h3", "h1"])]
    assert [n for n, _ in rounds[2]] == ["h5", "h6", "h7"] and rounds[2][0][1] == ["h1", "h3", "h2", "h4"]
    assert plan_rounds([], ["h1"]) == [[]]  # a converged fleet: nothing to do
    assert plan_rounds(_hosts(5), [], seeds=2)[0] == [("h1", []), ("h2", [])]


def test_round_count():
    assert [round_count(n) for n in (1, 2, 3, 4, 5, 8, 32, 33)] == [1, 2, 3, 3, 4, 4, 6, 7]


# ------------------------------------------------------------------------------------------------
# the server and the fetch, as the hosts run them

SCRIPTS = Path(__file__).resolve().parents[1] / "vllm_fleet" / "host" / "scripts"


def _tree(root: Path) -> dict[str, list]:
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(os.urandom(300_000))
    (root / "sub" / "b.bin").write_bytes(os.urandom(1000))
    (root / "secret.txt").write_text("not in the list")
    return {
        rel: [(root / rel).stat().st_size, hashlib.sha256((root / rel).read_bytes()).hexdigest()]
        for rel in ("a.bin", "sub/b.bin")
    }


@pytest.fixture
def server(tmp_path):
    """serve_files.py on 127.0.0.1, its names and token from a list file (as a peer's unit gets it)."""
    procs = []

    def start(root: Path, files: dict, token: str = "t" * 32):
        listing = tmp_path / f"serve-{len(procs)}.json"
        listing.write_text(json.dumps({"token": token, "files": files}))
        env = {k: v for k, v in os.environ.items() if k != "VLLM_FLEET_SERVE_TOKEN"}
        p = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "serve_files.py"), str(root), "127.0.0.1", "0", str(listing)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        procs.append(p)
        return int(p.stdout.readline()), token

    yield start
    for p in procs:
        p.terminate()
        p.wait(5)


def _get(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def test_the_peer_server_serves_the_listed_files_under_its_token_and_nothing_else(tmp_path, server):
    root = tmp_path / "art"
    files = _tree(root)
    port, token = server(root, files)
    base = f"http://127.0.0.1:{port}"
    assert _get(f"{base}/{token}/sub/b.bin") == (200, (root / "sub/b.bin").read_bytes())
    assert _get(f"{base}/{token}/a.bin")[1] == (root / "a.bin").read_bytes()
    for path in (
        "/",
        f"/{token}/",
        f"/{token}/secret.txt",
        "/a.bin",
        f"/{token}x/a.bin",
        f"/{token}/sub/../a.bin",
        f"/{token}/../art/a.bin",
        f"/{token}/%2e%2e/art/a.bin",
        f"/{'u' * 32}/a.bin",
        f"/{token}/sub",
    ):
        assert _get(base + path)[0] == 404, path


def test_no_token_no_server(tmp_path):
    (tmp_path / "l.json").write_text(json.dumps({"files": {}}))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_FLEET_SERVE_TOKEN"}
    r = subprocess.run(
        [sys.executable, str(SCRIPTS / "serve_files.py"), str(tmp_path), "127.0.0.1", "0", str(tmp_path / "l.json")],
        capture_output=True,
        text=True,
        timeout=10,
        env=env,
    )
    assert r.returncode == 2 and "no token" in r.stderr


def _fetch(listing: dict, dest: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "fetch.json"
    path.write_text(json.dumps(listing))
    return subprocess.run(
        ["sh", "-c", text(python(sys.executable, "fetch_files.py", str(path), str(dest)))],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_tree_is_fetched_from_a_peer_and_a_corrupt_peer_copy_refused(tmp_path, server):
    good, bad = tmp_path / "good", tmp_path / "bad"
    files = _tree(good)
    shutil.copytree(good, bad)
    data = bytearray((bad / "a.bin").read_bytes())
    data[1000] ^= 0xFF  # same size, one byte off: a corrupted copy on a peer
    (bad / "a.bin").write_bytes(bytes(data))
    (pb, tb), (pg, tg) = server(bad, files, "b" * 32), server(good, files, "g" * 32)
    dest = tmp_path / "dest"
    (dest).mkdir()
    (dest / "MANIFEST.sha256").write_text("kept: not in the list, prune false")
    listing = {"sources": [f"http://127.0.0.1:{pb}/{tb}/"], "files": files, "prune": False, "mode": "640"}
    r = _fetch(listing, dest, tmp_path)
    assert r.returncode == 1 and "a.bin: no source gave a verified copy" in r.stderr and "refused" in r.stderr, r.stderr
    assert not (dest / "a.bin").exists() and not list(dest.rglob("*.part"))  # nothing of the bad copy kept
    listing["sources"].append(f"http://127.0.0.1:{pg}/{tg}/")
    r = _fetch(listing, dest, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "a.bin: 127.0.0.1:%d: sha256" % pb in r.stderr and "then a verified copy from 127.0.0.1:%d" % pg in r.stderr
    for rel, (size, sha) in files.items():
        assert hashlib.sha256((dest / rel).read_bytes()).hexdigest() == sha
        assert (dest / rel).stat().st_mode & 0o777 == 0o640
    assert (dest / "MANIFEST.sha256").exists() and not (dest / "secret.txt").exists()
    # in place: nothing fetched again, even with no source at all (a check only)
    r = _fetch({"sources": [], "files": files, "prune": False}, dest, tmp_path)
    assert r.returncode == 0 and "2 already there, 0.0 MB fetched" in r.stdout, r.stdout + r.stderr
    (dest / "sub/b.bin").write_bytes(b"x" * files["sub/b.bin"][0])
    r = _fetch({"sources": [], "files": files, "prune": False}, dest, tmp_path)
    assert r.returncode == 1 and "sub/b.bin: no source gave a verified copy (no source)" in r.stderr


def test_a_path_out_of_the_directory_is_refused(tmp_path):
    r = _fetch({"sources": [], "files": {"../x": [1, "0" * 64]}}, tmp_path / "d", tmp_path)
    assert r.returncode == 1 and "not a relative path" in r.stderr


def _art(tmp_path):
    return Artifact(
        key="model:/srv/m:abc",
        what="the model",
        local=tmp_path,
        root="/var/lib/models/m",
        files={"a": [1, "0" * 64]},
        owner="vllm",
        mode="644",
        dir_mode="755",
        port=8471,
        seconds=900,
    )


def test_the_peer_unit_is_sandboxed_and_has_no_token_on_its_command_line(tmp_path):
    art = _art(tmp_path)
    argv = [str(a) for a in server_argv(art, "10.0.0.5")]
    props = dict(a.split("=", 1)[1].split("=", 1) for a in argv if a.startswith("--property="))
    assert props["DynamicUser"] == "yes" and props["ProtectSystem"] == "strict" and props["NoNewPrivileges"] == "yes"
    assert props["BindReadOnlyPaths"] == "/var/lib/models/m:/srv/artifact" and props["CapabilityBoundingSet"] == ""
    assert props["RuntimeMaxSec"] == "900" and props["LoadCredential"].startswith("list:/run/vllm-fleet-peer/")
    assert argv[-4:] == ["/srv/artifact", "10.0.0.5", "8471", f"/run/credentials/{art.unit}.service/list"]
    assert art.token not in " ".join(argv)


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_systemd_parses_every_property_of_the_peer_unit(tmp_path):
    """The same properties as a unit file, read by systemd-analyze verify (an unknown or
    malformed property is an error there, as systemd-run would refuse it)."""
    art = _art(tmp_path)
    argv = [str(a) for a in server_argv(art, "10.0.0.5")]
    props = [a.split("=", 1)[1] for a in argv if a.startswith("--property=")]
    exe = tmp_path / "usr/bin/python3"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    unit = tmp_path / "etc/systemd/system" / f"{art.unit}.service"
    unit.parent.mkdir(parents=True)
    unit.write_text("[Service]\n" + "".join(f"{p}\n" for p in props) + "ExecStart=/usr/bin/python3 -I -c pass\n")
    out = subprocess.run(
        ["systemd-analyze", f"--root={tmp_path}", "verify", f"/etc/systemd/system/{unit.name}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    bad = [
        ln
        for ln in (out.stdout + out.stderr).splitlines()
        if "Unknown" in ln or "Failed to parse" in ln or "nvalid" in ln
    ]
    assert not bad, "\n".join(bad)


def test_only_a_fleet_takes_part():
    """No layout in this process: the inventory's hosts with a private address count; fewer
    than two and the model role puts its files as before (peers.join gives None)."""
    from pyinfra.api import Config, Inventory, State
    from pyinfra.context import ctx_state

    from vllm_fleet.roles.common import peers

    inv = Inventory(([("a", {"private_address": "10.0.0.1"}), ("b", {}), ("c", {"private_address": "10.0.0.3"})], {}))
    with ctx_state.use(State(inv, Config())):
        assert peers.peer_hosts("no-such-deployment-here") == 2
    inv = Inventory(([("a", {"private_address": "10.0.0.1"}), ("b", {})], {}))
    with ctx_state.use(State(inv, Config())):
        assert peers.peer_hosts("no-such-deployment-here") == 1


def test_the_fetch_writes_through_no_link_the_directory_owner_left(tmp_path, server):
    """DEST belongs to the service user while the fetch runs as root: a link planted at the
    partial file's name (or at a file's own name) is never written through."""
    good = tmp_path / "good"
    files = _tree(good)
    port, token = server(good, files)
    dest, victim = tmp_path / "dest", tmp_path / "victim"
    dest.mkdir()
    victim.write_text("untouched")
    (dest / ".a.bin.part").symlink_to(victim)
    (dest / "a.bin").symlink_to(victim)
    r = _fetch(
        {"sources": [f"http://127.0.0.1:{port}/{token}/"], "files": files, "prune": False, "mode": "600"},
        dest,
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert victim.read_text() == "untouched" and victim.stat().st_mode & 0o777 != 0o600
    assert (
        not (dest / "a.bin").is_symlink()
        and hashlib.sha256((dest / "a.bin").read_bytes()).hexdigest() == files["a.bin"][1]
    )


# ------------------------------------------------------------------------------------------------
# the rounds as the operations run them, with stand-in hosts that record what they were asked


class _Host:
    def __init__(self, name, fail_fetch=False):
        self.name, self.fail_fetch, self.ran, self.put = name, fail_fetch, [], []

    def run_shell_command(self, command, **kw):
        line = text(command)
        self.ran.append(line)
        ok = not (self.fail_fetch and "fetch_files" in line and '"sources": ["http' in self._last_list)
        return ok, SimpleNamespace(stdout_lines=[], stderr_lines=[])

    def put_file(self, src, dest, **kw):
        self.put.append(dest)
        self._last_list = src.getvalue() if hasattr(src, "getvalue") else ""
        return True

    _last_list = ""


class _Inventory(list):
    def get_host(self, name):
        return next(h for h in self if h.name == name)


def _members(tmp_path, monkeypatch, names, holders=(), fail=()):
    from vllm_fleet.roles.common import peers

    monkeypatch.setattr(peers, "_root_args", lambda state, h: {})
    hosts = _Inventory(_Host(n, fail_fetch=n in fail) for n in names)
    state = SimpleNamespace(inventory=hosts)
    art = Artifact(
        key="k",
        what="m",
        local=tmp_path,
        root="/m",
        files={"a": [1, "0" * 64], "b/c": [1, "1" * 64]},
        owner="vllm",
        mode="644",
        dir_mode="755",
        port=8471,
        seconds=60,
    )
    for i, n in enumerate(names):
        art.members[n] = peers.Member(n, f"10.0.0.{i + 1}", [] if n in holders else ["a", "b/c"])
    peers._ARTIFACTS[(id(state), "k")] = art
    return peers, state, hosts, art


def _run_all(peers, state, hosts, art):
    for k in range(peers.round_count(len(hosts))):
        for h in hosts:
            if art.members[h.name].lacks:
                assert peers.run_round(state, h, "k", k) is True
    for h in hosts:
        if art.members[h.name].lacks:
            peers.run_done(state, h, "k")


def _served(h):
    return [ln for ln in h.ran if ln.startswith("systemd-run")]


def _stops(h):
    return [ln for ln in h.ran if "systemctl stop" in ln and "rm -f" in ln]


def test_the_rounds_as_they_run(tmp_path, monkeypatch):
    peers, state, hosts, art = _members(tmp_path, monkeypatch, ["h1", "h2", "h3"])
    _run_all(peers, state, hosts, art)
    h1, h2, h3 = hosts
    assert h1.put[-2:] != [] and "/m/a" in h1.put and "/m/b/c" in h1.put  # the seed: over SSH from here
    assert not any(p.startswith("/m/") for p in h2.put + h3.put)  # the others: nothing from here
    assert len(_served(h1)) == 1 and len(_served(h2)) == 1 and _served(h3) == []  # h3 serves no later round
    assert "10.0.0.1" in _served(h1)[0] and art.token not in _served(h1)[0]
    assert _stops(h1) and _stops(h2) and not _stops(h3)


def test_a_host_staged_earlier_serves_without_an_operation_of_its_own(tmp_path, monkeypatch):
    peers, state, hosts, art = _members(tmp_path, monkeypatch, ["h1", "h2", "h3"], holders=["h1"])
    _run_all(peers, state, hosts, art)
    h1, h2, h3 = hosts
    assert not any(p.startswith("/m/") for h in hosts for p in h.put)  # nothing from the control machine
    assert len(_served(h1)) == 1 and _stops(h1)  # started and stopped by h2 over h1's connection


def test_a_host_its_peers_fail_gets_it_from_the_control_machine(tmp_path, monkeypatch):
    peers, state, hosts, art = _members(tmp_path, monkeypatch, ["h1", "h2"], fail=["h2"])
    _run_all(peers, state, hosts, art)
    assert "/m/a" in hosts[1].put  # the fallback: over SSH, as before


def test_the_fleet_wheelhouse_goes_host_to_host_only_when_asked(tmp_path):
    """roles.common.wheels.reach_fleet_wheelhouse on two hosts with a private address: with
    host data wheels_peer_fetch the rounds put the wheels in place (nothing to run first); by
    default the fetch list from the control machine's server, as before."""
    from pyinfra.api import Config, Inventory, State
    from pyinfra.context import ctx_host, ctx_inventory, ctx_state

    from vllm_fleet.roles.common import wheels

    house = tmp_path / "house"
    house.mkdir()
    (house / "x-1.0-py3-none-any.whl").write_bytes(b"wheel")
    for asked in (True, False):
        data = {"private_address": None, "wheels_peer_fetch": asked, "vllm_wheel_serve_address": "127.0.0.1"}
        inv = Inventory(
            ([("a", {**data, "private_address": "10.0.0.1"}), ("b", {**data, "private_address": "10.0.0.2"})], {})
        )
        st = State(inv, Config())
        got = {}
        with ctx_inventory.use(inv), ctx_state.use(st):
            for h in inv:
                with ctx_host.use(h):
                    got[h.name] = wheels.reach_fleet_wheelhouse(house, "/opt/x/wheelhouse", "upload")
            names = {h.name: [sorted(st.op_meta[o].names)[0] for o in h.op_hash_order] for h in inv}
        if asked:
            assert got == {"a": ("/opt/x/wheelhouse", []), "b": ("/opt/x/wheelhouse", [])}
            assert (
                names["a"]
                == names["b"]
                == [
                    "the wheelhouse /opt/x/wheelhouse: peer round 0",
                    "the wheelhouse /opt/x/wheelhouse: peer round 1",
                    "the wheelhouse /opt/x/wheelhouse: stop the peer servers",
                ]
            )
        else:
            assert all("fetch_files" in text(cmds[0]) for _, cmds in got.values()) and all(
                len(n) == 1 for n in names.values()
            )
