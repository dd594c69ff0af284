"""vllm_fleet/roles/common/state: one read of a host's state, and roles that create operations only
where the host differs.

- host_state.sh run for real (sh, on this machine) against a temporary tree: what it prints is
  checked with Python's own os.stat / hashlib / pwd (independent readers);
- a converged proxy and service (the snapshot shows every file, package and unit in place) get no
  operation at all; one file that differs gets its put and what follows from it, nothing else;
- with no snapshot (a role called on its own) the operations are those of before;
- packages: installed packages bring no apt operation (no lists refresh), a missing one does.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest
from pyinfra.api import deploy
from pyinfra.facts.deb import DebPackages

from vllm_fleet.host.state import HostState, Query, Snapshot

from vllm_fleet.roles.common.state import load_host_state
from vllm_fleet.render.files import deployment_paths

REPO = Path(__file__).resolve().parents[2]


def run_script(query: Query) -> list[str]:
    cmd = HostState().command(query).get_raw_value()
    r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def test_the_script_reads_files_dirs_users_and_an_env(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    f = tmp_path / "d" / "a.txt"
    f.write_text("hello\n")
    f.chmod(0o640)
    (tmp_path / "d" / "sub" / "b.bin").write_bytes(b"\0" * 10)
    me = pwd.getpwuid(os.getuid())
    q = Query(
        stat=(str(f), str(tmp_path / "d"), str(tmp_path / "nope")),
        sha=(str(f), str(tmp_path / "nope")),
        read=(str(f), str(tmp_path / "nope")),
        ls=(str(tmp_path / "d"), str(tmp_path / "nope")),
        find=(str(tmp_path / "d"),),
        users=(me.pw_name, "no-such-user-vf"),
        envs=(
            (sys.executable, ("dist:pyinfra", "dist:no-such-dist-vf", "file:no-such.pth")),
            (str(tmp_path / "no-env" / "python"), ("dist:x",)),
        ),
    )
    lines = run_script(q)
    assert lines[-1] == "end"
    s = Snapshot.parse(lines)
    s.query = q
    st = os.stat(f)
    assert s.stats[str(f)] == {
        "type": "file",
        "user": me.pw_name,
        "group": s.stats[str(f)]["group"],
        "mode": 0o640,
        "size": 6,
    }
    assert s.shas[str(f)] == hashlib.sha256(b"hello\n").hexdigest() and st.st_size == 6
    assert s.file_ok(str(f), hashlib.sha256(b"hello\n").hexdigest(), me.pw_name, None, "640")
    assert not s.file_ok(str(f), hashlib.sha256(b"hello\n").hexdigest(), me.pw_name, None, "644")  # mode differs
    assert s.directory_ok(str(tmp_path / "d"), me.pw_name) and s.absent(str(tmp_path / "nope"))
    assert s.content(str(f)) == (True, "hello\n") and s.content(str(tmp_path / "nope")) == (True, None)
    assert s.content("/etc/not-asked") == (False, None)  # not asked: unknown, never "absent"
    assert sorted(s.listing(str(tmp_path / "d"))) == ["a.txt", "sub"] and s.listing(str(tmp_path / "nope")) == []
    assert s.files_under(str(tmp_path / "d")) == {"a.txt": 6, "sub/b.bin": 10}
    assert s.user_ok(me.pw_name, home=me.pw_dir) and not s.user_ok("no-such-user-vf")
    env = s.env(sys.executable)
    from importlib.metadata import version

    assert env["python"] == ".".join(map(str, sys.version_info[:3]))
    assert env["dist"] == {"pyinfra": version("pyinfra"), "no-such-dist-vf": None} and env["file"] == {
        "no-such.pth": None
    }
    assert s.env(str(tmp_path / "no-env" / "python")) == {"python": None, "dist": {}, "file": {}, "done": True}


def _ns(text: str) -> int:
    """find's ``%T@`` (seconds.fraction) in nanoseconds."""
    sec, _, frac = text.partition(".")
    return int(sec) * 10**9 + int((frac + "0" * 9)[:9])


def test_tree_lists_each_file_with_its_size_mtime_and_ctime_before_any_hash(tmp_path):
    """The ``tree`` kind (the model stamp's listing): every regular file under the directory
    with the size, mtime and ctime os.stat reads (an mtime set back by its owner included); a
    directory that is not there lists nothing; the listing comes before the hashes of the same
    read (a file written after it shows another ctime next time)."""
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "a.bin").write_bytes(b"x" * 5)
    (d / "sub" / "b").write_bytes(b"")
    os.utime(d / "a.bin", ns=(1, 1_700_000_000_123_456_789))  # touch -d: the owner may set it
    q = Query(tree=(str(d), str(tmp_path / "nope")), sha=(str(d / "a.bin"),))
    argv = q.argv()
    assert argv.index("tree") < argv.index("sha")
    s = Snapshot.parse(run_script(q))
    s.query = q
    tree = s.tree(str(d))
    assert set(tree) == {"a.bin", "sub/b"}
    for rel, (size, mtime, ctime) in tree.items():
        st = os.stat(d / rel)
        assert (size, _ns(mtime), _ns(ctime)) == (st.st_size, st.st_mtime_ns, st.st_ctime_ns), (rel, tree[rel])
    assert _ns(tree["a.bin"][1]) == 1_700_000_000_123_456_789
    assert s.tree(str(tmp_path / "nope")) == {} and s.files_under(str(d)) == {"a.bin": 5, "sub/b": 0}
    assert s.tree("/not/asked") is None


def test_a_glob_sees_every_matching_file_and_the_text_of_those_up_to_1_mib(tmp_path):
    """A unit of 200 KiB (a long comment block) is read whole; one over 1 MiB is there with no
    text (never taken for absent, as a 64 KiB limit once did); a directory that matches is not."""
    big, huge = tmp_path / "vllm-a-0.service", tmp_path / "vllm-b-0.service"
    big.write_text("# for deployment a:\n" + "#" * 200_000 + "\n")
    huge.write_text("#" * (1024 * 1024 + 1))
    (tmp_path / "vllm-c-0.service").mkdir()
    snap = Snapshot.parse(run_script(q := Query(globs=(f"{tmp_path}/vllm-*.service",))))
    snap.query = q
    found = snap.matching(f"{tmp_path}/vllm-*.service")
    assert sorted(found) == [str(big), str(huge)]
    assert found[str(big)] == big.read_text() and found[str(huge)] is None


def test_the_script_reads_free_bytes_where_a_path_is_or_will_be(tmp_path):
    """``free``: df's "avail" of the path's filesystem, or of its nearest existing parent for a
    path not made yet (model.path before the first upload), checked against os.statvfs (an
    independent reader; the figures move with other writers, so within a margin)."""
    (tmp_path / "d").mkdir()
    asked = (str(tmp_path / "d"), str(tmp_path / "not" / "made" / "yet"), "/proc/no-such-vf")

    def avail(path):
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize

    before = avail(tmp_path)
    q = Query(free=asked)
    lines = run_script(q)
    after = avail(tmp_path)
    assert lines[-1] == "end" and [ln.split("\t")[:2] for ln in lines[:-1]] == [["free", p] for p in asked], lines
    s = Snapshot.parse(lines)
    s.query = q
    margin = 256 << 20
    for path in asked[:2]:
        known, n = s.free(path)
        assert known and min(before, after) - margin <= n <= max(before, after) + margin, (path, n, before, after)
    assert s.free(asked[2]) == (True, avail("/proc"))  # /proc: df's figure for its filesystem (0)
    assert s.free("/not-asked") == (False, None)
    assert Snapshot.parse(["free\t/x\t-", "end"]).avail == {"/x": None}  # df gave no figure
    cut = Snapshot.parse(lines[:-1])  # no `end`: a figure from a read that did not complete is not believed
    cut.query = q
    assert cut.free(asked[0]) == (False, None)


def test_units_and_packages_parse_and_an_unfinished_read_knows_nothing():
    lines = [
        "unit\tId=nginx.service",
        "unit\tLoadState=loaded",
        "unit\tActiveState=active",
        "unit\tUnitFileState=enabled",
        "unit\t",
        "unit\tLoadState=not-found",
        "unit\tId=x.service",
        "unit\tActiveState=failed",
        "unit\tUnitFileState=",
        "unit\t",
        "deb\tnginx\tii \t1.22",
        "deb\tlibnuma1\trc \t2.0",
        "end",
    ]
    s = Snapshot.parse(lines)
    s.query = Query(units=("nginx.service", "x.service", "y.service"), debs=("nginx", "libnuma1", "curl"))
    assert s.unit_ok("nginx.service") and not s.unit_ok("x.service") and s.unit("x.service")["ActiveState"] == "failed"
    assert s.unit("y.service") is None or not s.unit_ok("y.service")
    assert s.debs_installed(["nginx"]) and not s.debs_installed(["libnuma1"]) and not s.debs_installed(["curl"])
    cut = Snapshot.parse(lines[:-1])  # no `end`: the script did not finish
    cut.query = s.query
    assert not cut.known and not cut.unit_ok("nginx.service") and not cut.debs_installed(["nginx"])


def test_held_packages_count_as_installed_and_patterns_read_every_match():
    """dpkg's ``hi`` (held: NVIDIA drivers often are) is installed, as pyinfra's DebPackages
    counts it; ``rc`` is not. A pattern asked with ``debs`` is handed to dpkg-query as it is
    (run here for real): every package it matches is known, a name it does not match is not."""
    s = Snapshot.parse(["deb\tnvidia-driver-cuda\thi \t580.1", "deb\tx\trc \t1", "end"])
    s.query = Query(debs=("nvidia-driver-cuda", "x"))
    assert s.debs_installed(["nvidia-driver-cuda"]) and not s.debs_installed(["x"])
    q = Query(debs=("dpk?",))
    r = subprocess.run(
        ["/bin/sh", "-c", HostState().command(q).get_raw_value()], capture_output=True, text=True, timeout=60
    )
    real = Snapshot.parse(r.stdout.splitlines())
    real.query = q
    assert real.known and real.debs_installed(["dpkg"])  # this machine's dpkg, matched by the pattern
    assert not real.debs_installed(["dpkg-no-such-package"]) and not real.debs_installed(["tar"])


def test_queries_merge_without_repeats():
    a = Query(stat=("/a", "/b"), envs=(("/py", ("dist:x",)),))
    b = Query(stat=("/b", "/c"), units=("u",), envs=(("/py", ("dist:x", "dist:y")), ("/py2", ())))
    m = a | b
    assert m.stat == ("/a", "/b", "/c") and m.units == ("u",)
    assert m.envs == (("/py", ("dist:x", "dist:y")), ("/py2", ()))


def test_a_role_reads_only_what_the_deploys_read_did_not_ask(harness):
    """role_state: nothing more when the deploy's one read asked it all; else one read of just the
    rest, added to the snapshot (a role called on its own reads its state itself)."""
    from vllm_fleet.roles.common.state import role_state

    deploy_q, role_q = Query(stat=("/a",), units=("x.service",)), Query(stat=("/a", "/b"), units=("x.service",))
    lines = {"/a": "stat\t/a\t-", "/b": "stat\t/b\tdirectory\troot\troot\t755\t4096"}

    def read(query):
        return Snapshot.parse([lines[path] for path in query.stat] + ["end"])

    seen = {}

    @deploy("a deploy's read, then a role's")
    def both(first):
        if first is not None:
            load_host_state(first)
        snap = role_state(role_q)
        seen.update(absent=snap.absent("/a"), b=snap.directory_ok("/b", "root"), known=snap.known)

    for first, reads in (
        (role_q | deploy_q, [role_q | deploy_q]),
        (deploy_q, [deploy_q, Query(stat=("/b",))]),
        (None, [role_q]),
    ):
        run = harness.run(both, first, facts={HostState: read}, strict=True)
        assert [kw["query"] for _, kw in run.asked] == reads
        assert seen == {"absent": True, "b": True, "known": True}
    assert not role_q - (role_q | deploy_q) and (role_q - deploy_q) == Query(stat=("/b",))
    envs = Query(envs=(("/py", ("dist:x", "dist:y")),)) - Query(envs=(("/py", ("dist:x",)),))
    assert envs == Query(envs=(("/py", ("dist:y",)),))
    assert Query(envs=(("/py", ("dist:x",)),)) - Query(targets=("python3",)) == Query(envs=(("/py", ("dist:x",)),))


# -- roles against a snapshot -------------------------------------------------------------------


def _lab(replicas: bool = False):
    from vllm_fleet.render.layout import build
    from vllm_fleet.specs.load import load, resolve

    spec = resolve(load(REPO / "deployments" / "lab-tiny.yaml"))
    layout = build(
        [spec], copy.deepcopy({"testhost": {"address": "10.10.0.11", "groups": ["servers", "proxy"], "data": {}}})
    )
    h = layout.hosts["testhost"]
    return spec, h, h.parts[spec["name"]]


def converged_lines(spec, h, node, api_key: str, *, drift: str | None = None) -> list[str]:
    """host_state.sh's output for a host where the service and nginx roles' state is in place
    (``drift``: one path whose content differs)."""
    from vllm_fleet.render import files as render
    from vllm_fleet.roles.service import applied_token
    from vllm_fleet.render.secrets import host_secret_files

    files = {p: (f.content, f.owner, f.group, f"{f.mode:o}") for p, f in h.files.items()}
    for p, text in host_secret_files(spec, {"api_key": api_key}).items():
        files[p] = (text, "root", "root", "600")
    for inst in node.instances:
        files[f"{spec['install']['config_dir']}/replica-{inst.index}.applied"] = (
            applied_token(spec, h.files, inst, api_key) + "\n",
            "root",
            "root",
            "600",
        )
    out = []
    for p, (text, user, group, mode) in files.items():
        sha = hashlib.sha256(("changed" if p == drift else text).encode()).hexdigest()
        out += [f"stat\t{p}\tregular file\t{user}\t{group}\t{mode}\t{len(text)}", f"sha\t{p}\t{sha}"]
        if p.endswith(".applied"):
            import base64

            out.append(f"read\t{p}\t{base64.b64encode(text.encode()).decode()}")
    from vllm_fleet.roles.service import _instance_dirs

    user = spec["server"]["user"]
    for d in _instance_dirs(spec, node):
        out.append(f"stat\t{d}\tdirectory\t{user}\t{user}\t750\t4096")
    out += [
        "stat\t/etc/nginx/sites-enabled/default\t-",
        f"read\t{render.SYSTEMD_DIR}/vllm.service\t-",
        f"ls\t{render.SYSTEMD_DIR}\t.",
        *(f"ls\t{render.SYSTEMD_DIR}\t{i.unit}" for i in node.instances),
        "deb\tnginx\tii \t1.22.1",
    ]
    for unit in ["nginx.service", *(i.unit for i in node.instances)]:
        out += [
            f"unit\tId={unit}",
            "unit\tLoadState=loaded",
            "unit\tActiveState=active",
            "unit\tUnitFileState=enabled",
            "unit\t",
        ]
    return out + ["end"]


@deploy("service and nginx from a snapshot")
def _service_and_nginx(spec, h, node, api_key):
    from vllm_fleet.roles import nginx, service

    from vllm_fleet.render.files import deployment_paths

    where = deployment_paths(spec)
    load_host_state(service.state_query(spec, where, node, h.files) | nginx.state_query(spec, where, h.files))
    service.install_service(spec=spec, where=where, node=node, rendered=h.files, api_key=api_key)
    nginx.install_nginx(spec=spec, where=where, rendered=h.files, api_key=api_key)


def test_a_converged_host_gets_no_operation(harness):
    spec, h, node = _lab()
    lines = converged_lines(spec, h, node, "k3y")
    run = harness.run(
        _service_and_nginx, spec, h, node, "k3y", facts={HostState: lambda query: Snapshot.parse(lines)}, strict=True
    )
    # only the check that the replica answers a chat (read with the state; no command: issue 25)
    assert [(op.name.rsplit(" | ", 1)[-1], op.commands) for op in run.ops] == [
        (f"{node.instances[0].unit} answers a chat on port {node.instances[0].port}", [])
    ]
    assert [name for name, _ in run.asked] == ["HostState"]  # one read, no other fact


@pytest.mark.parametrize("state", ["active", "failed"])
def test_the_service_role_on_its_own_reads_its_state_once(harness, state):
    """install_service called on its own (no deploy read the host before): its own state read is
    the only fact, the older release's unit, the unit directory, the recorded configuration and
    the unit's state come from it; a converged host gets no operation but the replica's chat, and
    a unit systemd has failed gets its failed state cleared and is started, nothing else."""
    from pyinfra.facts.systemd import SystemdEnabled, SystemdStatus

    from vllm_fleet.roles import service

    spec, h, node = _lab()
    unit = node.instances[0].unit
    lines = converged_lines(spec, h, node, "k3y")
    at = lines.index(f"unit\tId={unit}")  # the unit's own ActiveState (nginx's stays active)
    lines[at + 2] = f"unit\tActiveState={state}"
    run = harness.run(
        service.install_service,
        spec=spec,
        where=deployment_paths(spec),
        node=node,
        rendered=h.files,
        api_key="k3y",
        facts={
            HostState: lambda query: Snapshot.parse(lines),
            SystemdStatus: {unit: False},
            SystemdEnabled: {unit: True},
        },
        strict=True,
    )
    names = [op.name.rsplit(" | ", 1)[-1] for op in run.ops]
    if state == "active":
        assert [name for name, _ in run.asked] == ["HostState"]
        assert names == [f"{unit} answers a chat on port {node.instances[0].port}"]
    else:
        assert [name for name, _ in run.asked][0] == "HostState" and "Command" not in {name for name, _ in run.asked}
        assert names[:2] == [f"Clear {unit}'s failed state before (re)starting", f"{unit} running and enabled"], names
        assert not any(n.startswith(("Put ", "Restart ", "Stop and disable")) for n in names), names


def test_one_file_that_differs_gets_its_put_and_the_restart_it_needs(harness):
    spec, h, node = _lab()
    env = next(p for p in h.files if p.endswith("/vllm.env"))
    lines = converged_lines(spec, h, node, "k3y", drift=env)
    from pyinfra.facts.files import File, Sha256File
    from pyinfra.facts.systemd import SystemdEnabled, SystemdStatus

    run = harness.run(
        _service_and_nginx,
        spec,
        h,
        node,
        "k3y",
        facts={
            HostState: lambda query: Snapshot.parse(lines),
            File: {"user": "root"},
            Sha256File: "x",
            SystemdStatus: {},
            SystemdEnabled: {},
        },
    )
    names = [op.name.rsplit(" | ", 1)[-1] for op in run.ops]
    unit = node.instances[0].unit
    assert names[0] == f"Put {env}"
    assert f"Restart {unit} (its inputs changed)" in names and any(
        n.startswith(f"Wait for {unit} /health") for n in names
    )
    assert not any("nginx" in n.lower() for n in names)  # the proxy is in place: nothing of it
    assert not any(n.startswith("Directory ") or n.startswith("Put /etc/systemd") for n in names)


def test_without_a_snapshot_every_operation_is_created(harness):
    from vllm_fleet.roles import nginx

    spec, h, node = _lab()
    run = harness.run(
        nginx.install_nginx,
        spec=spec,
        where=deployment_paths(spec),
        rendered=h.files,
        api_key="k3y",
        facts={DebPackages: {}},
    )
    names = [op.name.rsplit(" | ", 1)[-1] for op in run.ops]
    assert {
        "nginx package",
        "Remove the default site",
        "nginx running and enabled",
        "Reload nginx (config changed)",
    } <= set(names)


@pytest.mark.parametrize("lines,expect_op", [(["deb\tlibnuma1\tii \t2.0.16", "end"], False), (["end"], True)])
def test_installed_packages_bring_no_apt_operation(harness, lines, expect_op):
    """No lists refresh (`apt-get update` reaches the network) when the package is installed,
    however old the lists are; a missing package is installed after one. The role called on its
    own (no deploy snapshot) reads just its packages in one state read, never dpkg's whole list."""
    from vllm_fleet.host.state import HostState, Snapshot
    from vllm_fleet.roles.vllm import install_system_libraries

    spec, _, _ = _lab()
    asked = []

    def state(query):
        asked.append(query.debs)
        return Snapshot.parse(lines)

    run = harness.run(
        install_system_libraries,
        spec,
        facts={HostState: state, DebPackages: {"libnuma1": ["2.0.16"]} if not expect_op else {}, "AptUpdateTime": None},
    )
    assert asked == [("libnuma1",)] and ("DebPackages" in {n for n, _ in run.asked}) == expect_op, run.asked
    assert run.has_op("system libraries") == expect_op
    if expect_op:
        assert any("apt-get" in c and "update" in c for c in run.commands) and any(
            "libnuma1" in c for c in run.commands
        )
    else:
        assert not any("apt-get" in c for c in run.commands)


def test_a_fresh_nginx_install_still_removes_the_default_site_it_brings(harness):
    """The snapshot, read before nginx is installed, shows no default site; the package brings
    one, so its removal must still be planned (and decided by pyinfra's own operation)."""
    spec, h, node = _lab()
    lines = [ln for ln in converged_lines(spec, h, node, "k3y") if not ln.startswith("deb\tnginx")]
    run = harness.run(
        _service_and_nginx,
        spec,
        h,
        node,
        "k3y",
        facts={HostState: lambda query: Snapshot.parse(lines), DebPackages: {}, "Link": {"link_target": "x"}},
    )
    names = [op.name.rsplit(" | ", 1)[-1] for op in run.ops if "answers a chat" not in op.name]
    assert names[:2] == ["nginx package", "Remove the default site"], names


@deploy("model from a snapshot")
def _model(spec):
    from vllm_fleet.roles import model

    load_host_state(model.state_query(spec))
    model.install_model(spec=spec, where=deployment_paths(spec))


def _model_lines(spec, local: Path, drift: str | None = None, stamped: bool = True) -> list[str]:
    """host_state.sh's output for model.path holding the upload (sha256sum of the local files,
    as the system's tool computes them: an independent reader) and, ``stamped``, the stamp of
    that verified copy (config_dir/model.stamp: the manifest's sha256 and the same tree lines)."""
    root, user = spec["model"]["path"], spec["server"]["user"]
    rels = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    manifest = subprocess.run(["sha256sum", *rels], cwd=local, capture_output=True, text=True, check=True).stdout
    shas = {rel: line.split()[0] for rel, line in zip(rels, manifest.splitlines())}
    shas["MANIFEST.sha256"] = hashlib.sha256(manifest.encode()).hexdigest()
    sizes = {rel: (local / rel).stat().st_size for rel in rels} | {"MANIFEST.sha256": len(manifest)}
    t = "1764800000.0000000000"
    tree = [f"tree\t{root}\t."] + [f"tree\t{root}\t{sizes[rel]} {t} {t} {rel}" for rel in shas]
    out = [
        f"stat\t{root}\tdirectory\t{user}\t{user}\t755\t4096",
        f"stat\t{root}/sub\tdirectory\t{user}\t{user}\t755\t4096",
        *tree,
    ]
    for rel, sha in shas.items():
        out += [
            f"stat\t{root}/{rel}\tregular file\t{user}\t{user}\t644\t{sizes[rel]}",
            f"sha\t{root}/{rel}\t{'0' * 64 if rel == drift else sha}",
        ]
    if stamped:
        stamp = "\n".join([f"manifest\t{root}\t{hashlib.sha256(manifest.encode()).hexdigest()}", *tree, "end"]) + "\n"
        out.append(f"read\t{spec['install']['config_dir']}/model.stamp\t{base64.b64encode(stamp.encode()).decode()}")
    return out + ["end"]


def _local_model(tmp_path: Path) -> Path:
    d = tmp_path / "tiny"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (d / "model.safetensors").write_text("weights " * 100)
    (d / "sub" / "extra.txt").write_text("x")
    return d


def test_a_model_in_place_gets_no_operation_and_a_changed_file_only_its_upload(harness, tmp_path):
    from vllm_fleet.roles.model import local_manifest

    local = _local_model(tmp_path)
    spec = copy.deepcopy(_lab()[0])
    spec["model"].update(local_dir=str(local), transfer="upload")
    assert [rel for rel, _ in local_manifest(local)] == ["config.json", "model.safetensors", "sub/extra.txt"]
    lines = _model_lines(spec, local)
    run = harness.run(_model, spec, facts={HostState: lambda query: Snapshot.parse(lines)}, strict=True)
    assert run.ops == []
    lines = _model_lines(spec, local, drift="model.safetensors", stamped=False)
    from pyinfra.facts.files import File, Sha1File

    room = [f"free\t{spec['model']['path']}\t{1 << 40}", "free\t/tmp\t" + str(1 << 40)]  # the space check's figures
    run = harness.run(
        _model,
        spec,
        facts={HostState: lambda query: Snapshot.parse(room + lines), File: {"user": "vllm"}, Sha1File: "x"},
    )
    names = [op.name.rsplit(" | ", 1)[-1] for op in run.ops]
    assert names == ["Model file model.safetensors", "Verify the model against MANIFEST.sha256 (as vllm)"], names


def _tls_lab():
    from vllm_fleet.render.layout import build
    from vllm_fleet.specs.load import load, resolve

    spec = resolve(load(REPO / "deployments" / "lab-tiny.yaml"))
    spec["proxy"]["listen"] = 443
    spec["proxy"]["tls"].update(enabled=True, self_signed=True)
    layout = build(
        [spec], copy.deepcopy({"testhost": {"address": "10.10.0.11", "groups": ["servers", "proxy"], "data": {}}})
    )
    return spec, layout.hosts["testhost"]


def test_a_self_signed_certificate_in_place_is_known_from_the_state_read_only(harness):
    """The nginx role on its own: the certificate's stat comes from one state read (no File
    fact), and a certificate that is there is never made again. When the read knows nothing the
    command itself leaves an existing certificate alone (clients may pin it)."""
    from vllm_fleet.render import files as render
    from vllm_fleet.roles import nginx
    from vllm_fleet.host.state import HostState, Snapshot

    spec, h = _tls_lab()
    crt = render.paths(spec)["tls_certificate"]
    there = [f"stat\t{crt}\tregular file\troot\troot\t644\t1200", "end"]
    run = harness.run(
        nginx.install_nginx,
        spec=spec,
        where=deployment_paths(spec),
        rendered=h.files,
        api_key="k3y",
        facts={HostState: lambda query: Snapshot.parse(there), DebPackages: {}},
    )
    assert not run.has_op("Self-signed TLS certificate"), run
    assert ("File", {"path": crt}) not in run.asked, run.asked
    unknown = harness.run(
        nginx.install_nginx,
        spec=spec,
        where=deployment_paths(spec),
        rendered=h.files,
        api_key="k3y",
        facts={DebPackages: {}},
    )
    (line,) = unknown.op("Self-signed TLS certificate").commands
    assert line.startswith(f"test -f {crt} || {{ openssl req -x509 ") and line.endswith("; }"), line
