"""The inventory, its host data and the command line are input too (issue 21).

Every check reads what a user reads (the CLI's exit status and stderr, from a separate process,
or the files ``render`` writes, read back by nginx / nft); inventories hold only TEST-NET
addresses (192.0.2.0/24) and nothing here connects to them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fleetutil import REPO, run_cli

SPEC = REPO / "deployments" / "lab-tiny.yaml"


def _spec(tmp_path: Path, name: str = "lab-tiny", **changes) -> Path:
    """lab-tiny, listening beyond loopback (a proxy on another host reaches it), plus ``changes``
    ({section: {key: value}})."""
    data = yaml.safe_load(SPEC.read_text())
    data["name"] = name
    data["server"]["host"] = "0.0.0.0"
    for section, values in changes.items():
        data[section] = {**data.get(section, {}), **values}
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def _write(tmp_path: Path, text: str, name: str = "inv.py") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# ---------------------------------------------------------------------------------------------
# Class 13: an inventory file that exits, raises or calls os._exit is an input error

EXITS = {
    "sys.exit(3)": "import sys\nservers = ['a']\nsys.exit(3)\n",
    "KeyboardInterrupt": "servers = ['a']\nraise KeyboardInterrupt\n",
    "os._exit(0)": "import os\nservers = ['a']\nos._exit(0)\n",
}

COMMANDS = {
    "validate": lambda inv: ["validate", str(SPEC), "--inventory", str(inv)],
    "render": lambda inv: ["render", str(SPEC), "--inventory", str(inv), "--out", str(inv.parent / "out")],
    "rollout": lambda inv: ["rollout", str(inv), "--spec", str(SPEC), "--dry"],
    "bench": lambda inv: ["bench", str(inv), "--spec", str(SPEC)],
    "tune": lambda inv: ["tune", str(inv), "--spec", str(SPEC), "--target", "ttft_p99_ms=500", "--dry"],
    "status": lambda inv: ["status", str(inv), "--spec", str(SPEC)],
}


@pytest.mark.parametrize("how", list(EXITS))
def test_an_inventory_that_exits_is_an_input_error(tmp_path, how):
    inv = _write(tmp_path, EXITS[how])
    r = run_cli(*COMMANDS["validate"](inv))
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert str(inv) in r.stderr and "Traceback" not in r.stderr and "valid" not in r.stdout, r.stderr


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "validate"])
def test_every_command_refuses_an_inventory_that_calls_os_exit(tmp_path, command):
    inv = _write(tmp_path, EXITS["os._exit(0)"])
    r = run_cli(*COMMANDS[command](inv))
    assert r.returncode == 1, (command, r.returncode, r.stdout, r.stderr)
    assert str(inv) in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_every_command_reads_group_data_as_the_deploy_does(tmp_path):
    """group_data/servers.py beside the inventory is pyinfra's: validate sees its private_address."""
    inv = _write(tmp_path, "servers = [('gpu1', {'ssh_hostname': '192.0.2.10'})]\nproxy = [('lb', {'ssh_hostname': '192.0.2.20'})]\n")
    (tmp_path / "group_data").mkdir()
    (tmp_path / "group_data" / "servers.py").write_text("private_address = '192.0.2.99'\n")
    out = tmp_path / "out"
    r = run_cli("render", str(_spec(tmp_path)), "--inventory", str(inv), "--out", str(out))
    assert r.returncode == 0, r.stderr
    site = next((out / "lb").rglob("vllm-fleet-*.conf")).read_text()
    assert "192.0.2.99:" in site and "192.0.2.10:" not in site, site


def test_the_servers_group_order_is_kept(tmp_path):
    """pyinfra keeps groups in `all` order; the reader keeps the order the group lists them."""
    from vllm_fleet.spec.inventory import load_inventory

    inv = _write(tmp_path, "proxy = ['b']\nservers = ['c', 'b', 'a']\n")
    hosts = load_inventory(inv)
    assert sorted(hosts, key=lambda n: hosts[n]["order"]["servers"]) == ["c", "b", "a"]
