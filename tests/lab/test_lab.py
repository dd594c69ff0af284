"""The lab itself, checked with independent readers (plain ssh, systemctl, iptables, /proc)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from labkit import REPO, lab_cli
from vllm_fleet.lab import nspawn

pytestmark = pytest.mark.lab
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))


def test_hosts_are_running(lab_hosts):
    assert len(lab_hosts) >= 2
    for h in lab_hosts:
        assert h.ssh("systemctl is-system-running --wait", user="root").stdout.strip() == "running"
        # the lab user has passwordless sudo
        assert h.ssh("sudo -n id -u").stdout.strip() == "0"
        assert h.ssh("hostname").stdout.strip() == h.name


def test_hosts_reach_each_other(lab_hosts):
    for a in lab_hosts:
        for b in lab_hosts:
            if a is b:
                continue
            a.ssh(f"ping -c1 -W3 {b.address} && timeout 5 bash -c '</dev/tcp/{b.address}/22' && getent hosts {b.name}")


def test_pip_in_a_venv_downloads_over_tls(lab_hosts):
    h = lab_hosts[0]
    res = h.ssh(
        "rm -rf /tmp/t /tmp/dl && python3 -m venv /tmp/t && "
        "/tmp/t/bin/pip download --no-cache-dir --no-deps -q -d /tmp/dl six && ls /tmp/dl",
        timeout=300,
    )
    assert ".whl" in res.stdout


def test_shared_pip_cache(lab, lab_hosts):
    cache = lab["pip_cache_dir"]
    marker = f"lab-test-{uuid.uuid4().hex}"
    try:
        lab_hosts[0].ssh(f"touch {cache}/{marker}")
        for h in lab_hosts[1:]:
            h.ssh(f"test -f {cache}/{marker}")
        assert (Path(cache) / marker).exists()  # on the control machine, the same path
    finally:
        (Path(cache) / marker).unlink(missing_ok=True)


def test_pyinfra_exec_over_the_inventory(lab_hosts):
    res = subprocess.run(
        [PYINFRA, "-y", "inventory/lab.py", "exec", "--", "systemctl", "is-system-running"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    for h in lab_hosts:
        assert f"[{h.name}] running" in res.stdout + res.stderr


def test_inventory_data_and_groups(lab, lab_hosts):
    from vllm_fleet.specs.inventory import load_inventory  # the project's independent inventory reader

    inv = load_inventory(REPO / "inventory" / "lab.py")
    assert sorted(inv) == sorted(h.name for h in lab_hosts)
    first = lab_hosts[0].name
    for group in ("servers", "proxy", "ray_head", "monitoring"):
        assert group in inv[first]["groups"]
    for h in lab_hosts[1:]:
        assert "ray_workers" in inv[h.name]["groups"]
        assert inv[h.name]["address"] == h.address
        assert inv[h.name]["data"]["pip_cache_dir"] == lab["pip_cache_dir"]


def test_reboot_via_pyinfra(lab, lab_hosts, tmp_path):
    h = lab_hosts[-1]
    boot_id = h.ssh("cat /proc/sys/kernel/random/boot_id").stdout.strip()
    deploy = tmp_path / "reboot.py"
    deploy.write_text(
        "from pyinfra.operations import server\n"
        "server.reboot(name='reboot', delay=2, interval=1, reboot_timeout=120, _sudo=True)\n"
    )
    t0 = time.monotonic()
    res = subprocess.run(
        [PYINFRA, "-y", "--limit", h.name, "inventory/lab.py", str(deploy)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert time.monotonic() - t0 < 120
    assert h.ssh("systemctl is-system-running --wait", user="root").stdout.strip() == "running"
    uptime = float(h.ssh("cut -d' ' -f1 /proc/uptime").stdout)
    assert uptime < 120, uptime
    # a new boot of the same host: the container (and its systemd) started again
    journal_boots = h.ssh("journalctl --list-boots --no-pager | wc -l", user="root").stdout.strip()
    assert int(journal_boots) >= 2 or h.ssh("cat /proc/sys/kernel/random/boot_id").stdout.strip() != boot_id


def test_status_cli(lab_hosts):
    res = lab_cli("status", "--json", timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    st = json.loads(res.stdout)
    assert [h["name"] for h in st["hosts"]] == [h.name for h in lab_hosts]
    assert all(h["state"] == "running" for h in st["hosts"])


def test_up_again_is_a_fast_noop(lab, lab_hosts):
    t0 = time.monotonic()
    res = lab_cli("up", "--hosts", str(len(lab_hosts)), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "already up" in res.stderr
    assert time.monotonic() - t0 < 15


def test_errors_a_user_can_act_on(lab, tmp_path):
    env = dict(os.environ, VLLM_FLEET_LAB_DIR=str(tmp_path / "other"))
    cmd = [sys.executable, "-m", "vllm_fleet.lab", "up", "--hosts", "1"]
    # the bridge name is taken (by the running lab)
    res = subprocess.run(
        cmd, cwd=REPO, env={**env, "VLLM_FLEET_LAB_BRIDGE": lab["bridge"]}, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 2 and "already exists" in res.stderr and "VLLM_FLEET_LAB_BRIDGE" in res.stderr
    # the subnet is taken
    res = subprocess.run(
        cmd, cwd=REPO, env={**env, "VLLM_FLEET_LAB_BRIDGE": "vftest9"}, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 2 and "overlaps" in res.stderr and "VLLM_FLEET_LAB_SUBNET" in res.stderr
    assert not (tmp_path / "other").exists() and not Path("/sys/class/net/vftest9").exists()
    # not root
    res = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "needs root" in res.stderr


def test_lxcfs_left_dead_by_an_earlier_run_is_replaced(tmp_path):
    """A lab whose lxcfs died (killed, or a machine restored from an image) leaves a FUSE mount
    that fails every stat with ENOTCONN: `up` and `down` must take it off, not crash on it.
    Its own state dir, no lab fixture: the shared lab's lxcfs is not touched."""
    if os.geteuid() != 0:
        pytest.skip("mounting lxcfs needs root")
    import errno
    import signal

    cfg = nspawn.LabConfig(state_dir=tmp_path / "state")
    cfg.state_dir.mkdir()
    st = {"made": {}}
    try:
        nspawn.lxcfs_up(cfg, st)
        pid = nspawn.read_pid(cfg.state_dir / "lxcfs.pid")
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)  # our child: reaped, its FUSE connection is gone
        with pytest.raises(OSError) as stale:
            os.listdir(cfg.lxcfs_dir)  # a readdir reaches the (gone) daemon; a stat may be cached
        assert stale.value.errno == errno.ENOTCONN  # the situation CI met

        nspawn.lxcfs_up(cfg, st)  # up again: a live lxcfs on the same path
        assert float((cfg.lxcfs_dir / "proc" / "uptime").read_text().split()[0]) >= 0

        pid = nspawn.read_pid(cfg.state_dir / "lxcfs.pid")
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        nspawn.lxcfs_down(cfg)  # down over a dead one
        assert not nspawn.mounted(cfg.lxcfs_dir)
        assert cfg.lxcfs_dir.is_dir()
    finally:
        if nspawn.mounted(cfg.lxcfs_dir):
            subprocess.run(["umount", "-l", str(cfg.lxcfs_dir)], check=False)
        pid = nspawn.read_pid(cfg.state_dir / "lxcfs.pid")
        if pid and nspawn.pid_alive(pid, "lxcfs"):
            os.kill(pid, 9)


@pytest.mark.lab_last
def test_down_removes_everything_and_is_idempotent(lab):
    if not lab["owned"]:
        pytest.skip("the lab was already running (or VLLM_FLEET_KEEP_LAB=1): not taking it down")
    cfg = nspawn.LabConfig()
    pids = []
    for h in lab["hosts"]:
        pids += [p for p in nspawn.host_pids(cfg, h["name"]) if p]
    lxcfs_pid = nspawn.read_pid(cfg.state_dir / "lxcfs.pid")
    assert pids and lxcfs_pid
    forward_before = lab["made"]["ip_forward_before"]

    res = lab_cli("down", timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr

    assert not Path(f"/sys/class/net/{lab['bridge']}").exists()
    # This lab's veths only (vb-<machine>): another lab on another bridge may be up beside it.
    from vllm_fleet.lab.nspawn import LabConfig

    mine = tuple(f"vb-{LabConfig().machine(h['name'])}@" for h in lab["hosts"])
    assert not [
        ln
        for ln in subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout.splitlines()
        if ln.startswith(mine)
    ]
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
    assert "vllm-fleet-lab" not in rules
    for pid in [*pids, lxcfs_pid]:
        assert not Path(f"/proc/{pid}").exists() or nspawn.pid_alive(pid) is False, pid
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(cfg.state_dir) not in mounts
    assert not any(Path("/sys/fs/cgroup").glob("*/vllm-fleet-lab"))
    if not [p for p in Path("/sys/class/net").glob("vfleet*")]:  # no other lab needs forwarding
        assert Path("/proc/sys/net/ipv4/ip_forward").read_text().strip() == forward_before
    assert not cfg.state_dir.exists()
    assert Path(lab["pip_cache_dir"]).is_dir()  # the cache stays

    res = lab_cli("down", timeout=60)
    assert res.returncode == 0 and "nothing to do" in res.stderr
