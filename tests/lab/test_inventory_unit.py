"""inventory/lab.py without a running lab: hosts from a state file, groups and their overrides."""

from __future__ import annotations

import json

import pytest

from labkit import REPO


@pytest.fixture
def fake_state(tmp_path, monkeypatch):
    st = {
        "ssh_user": "lab",
        "ssh_key": "/k",
        "known_hosts": "/kh",
        "pip_cache_dir": "/var/cache/vllm-fleet/pip",
        "hosts": [{"name": f"lab{i}", "address": f"10.10.0.{10 + i}", "index": i} for i in (1, 2, 3)],
    }
    (tmp_path / "state.json").write_text(json.dumps(st))
    monkeypatch.setenv("VLLM_FLEET_LAB_DIR", str(tmp_path))
    for g in ("SERVERS", "PROXY", "RAY_HEAD", "RAY_WORKERS", "MONITORING"):
        monkeypatch.delenv(f"VLLM_FLEET_LAB_{g}", raising=False)
    monkeypatch.delenv("VLLM_FLEET_LAB", raising=False)
    return st


def _groups(inv, name):
    return set(inv[name]["groups"])


def test_default_layout(fake_state):
    from vllm_fleet.specs.inventory import load_inventory

    inv = load_inventory(REPO / "inventory" / "lab.py")
    assert {"servers", "proxy", "ray_head", "monitoring"} <= _groups(inv, "lab1")
    assert "ray_workers" not in _groups(inv, "lab1")
    assert "ray_workers" in _groups(inv, "lab2") and "ray_workers" in _groups(inv, "lab3")
    d = inv["lab2"]["data"]
    assert d["ssh_hostname"] == d["private_address"] == "10.10.0.12"
    assert d["ssh_user"] == "lab" and d["ssh_key"] == "/k" and d["ssh_known_hosts_file"] == "/kh"
    assert d["pip_cache_dir"] == "/var/cache/vllm-fleet/pip"


def test_group_overrides(fake_state, monkeypatch):
    from vllm_fleet.lab.inventory import groups

    monkeypatch.setenv("VLLM_FLEET_LAB_SERVERS", "lab1,lab2,lab3")
    monkeypatch.setenv("VLLM_FLEET_LAB_RAY_WORKERS", "")
    g = groups()
    assert [n for n, _ in g["servers"]] == ["lab1", "lab2", "lab3"]
    assert g["ray_workers"] == []
    monkeypatch.setenv("VLLM_FLEET_LAB_PROXY", "lab9")
    with pytest.raises(ValueError, match="lab9"):
        groups()


def test_lab_down_gives_no_hosts(tmp_path, monkeypatch):
    from vllm_fleet.lab.inventory import lab_hosts

    monkeypatch.setenv("VLLM_FLEET_LAB_DIR", str(tmp_path / "none"))
    monkeypatch.delenv("VLLM_FLEET_LAB", raising=False)
    hosts, why = lab_hosts()
    assert hosts == [] and "lab up" in why


def test_disk_space_error(tmp_path):
    from vllm_fleet.lab.nspawn import LabError, check_disk

    with pytest.raises(LabError, match="not enough disk space.*VLLM_FLEET_LAB_DIR"):
        check_disk(tmp_path, 1 << 60, "the lab hosts")


def test_rootfs_key_is_a_hash_of_the_recipe():
    from vllm_fleet.lab.nspawn import RECIPE, rootfs_key

    # packaged (a wheel builds the lab too); the checkout's lab/rootfs.sh is a link to it
    assert RECIPE == REPO / "vllm_fleet" / "lab" / "rootfs.sh" and (REPO / "lab" / "rootfs.sh").resolve() == RECIPE
    assert len(rootfs_key()) == 16


def test_lab_up_raises_the_inotify_limit_a_large_lab_needs_and_never_lowers_it(tmp_path):
    """32 hosts failed to boot on the default fs.inotify.max_user_instances (128: "Too many open
    files" in the 29th host's systemd); `lab up` raises it for N hosts and says so (a file stands
    in for /proc/sys/fs/inotify/max_user_instances)."""
    from vllm_fleet.lab.nspawn import ensure_inotify, inotify_instances_needed

    sysctl = tmp_path / "max_user_instances"
    sysctl.write_text("128\n")
    said = ensure_inotify(32, sysctl)
    assert int(sysctl.read_text()) == inotify_instances_needed(32) > 128 + 4 * 32
    assert said == f"raised fs.inotify.max_user_instances from 128 to {inotify_instances_needed(32)} for 32 hosts" + (
        " (each host's systemd takes ~4)"
    )
    assert ensure_inotify(3, sysctl) is None and int(sysctl.read_text()) == inotify_instances_needed(32)
    sysctl.write_text("2048\n")
    assert ensure_inotify(50, sysctl) is None and sysctl.read_text() == "2048\n"


def test_lab_down_puts_the_inotify_limit_back_unless_it_was_changed_since(tmp_path):
    """`lab down` leaves the machine as `lab up` found it: the limit it raised goes back to what
    it was; a value someone changed since is left alone and said."""
    from vllm_fleet.lab.nspawn import ensure_inotify, inotify_now, restore_inotify

    sysctl = tmp_path / "max_user_instances"
    sysctl.write_text("128\n")
    made = {"inotify_before": inotify_now(sysctl)}
    assert ensure_inotify(32, sysctl)
    made["inotify_set"] = inotify_now(sysctl)
    assert restore_inotify(made, sysctl) == f"put fs.inotify.max_user_instances back from {made['inotify_set']} to 128"
    assert sysctl.read_text() == "128\n"
    sysctl.write_text("4096\n")
    assert "something changed it since" in restore_inotify(made, sysctl) and sysctl.read_text() == "4096\n"
    assert restore_inotify({}, sysctl) is None
