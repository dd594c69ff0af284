"""The Vagrantfile (the same lab as VMs) is valid, and the inventory serves it with VLLM_FLEET_LAB=vagrant."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from labkit import REPO

pytestmark = pytest.mark.lab


def _vagrant() -> str:
    exe = shutil.which("vagrant")
    if exe:
        return exe
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("vagrant is not installed and cannot be (needs root and apt-get: Debian's `vagrant` package)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    res = subprocess.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", "vagrant"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        stdin=subprocess.DEVNULL,
    )
    if res.returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600, stdin=subprocess.DEVNULL)
        res = subprocess.run(
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", "vagrant"],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            stdin=subprocess.DEVNULL,
        )
    if res.returncode != 0 or not shutil.which("vagrant"):
        pytest.skip(f"Debian's vagrant package did not install: {res.stderr.strip()[-300:]}")
    return shutil.which("vagrant")


def test_vagrantfile_validates(tmp_path):
    vagrant = _vagrant()
    env = dict(
        os.environ,
        VAGRANT_HOME=str(tmp_path / "vagrant.d"),
        XDG_DATA_HOME=str(tmp_path / "data"),
        VAGRANT_CHECKPOINT_DISABLE="1",
        VLLM_FLEET_LAB_HOSTS="3",
    )
    res = subprocess.run(
        [vagrant, "validate"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
    )
    if res.returncode != 0 and "provider" in res.stderr:
        # no VirtualBox/libvirt on this machine: validate everything but the provider blocks
        res = subprocess.run(
            [vagrant, "validate", "--ignore-provider"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "validated successfully" in res.stdout
    assert not (tmp_path / "data").exists()  # validate makes no key; only up/provision/reload do


def test_vagrant_provision_script_parses(tmp_path):
    _vagrant()
    ruby = shutil.which("ruby")
    if not ruby:
        pytest.skip("no ruby (comes with Debian's vagrant package)")
    # load the Vagrantfile with a stub Vagrant module and print its provisioning script
    script = subprocess.run(
        [
            ruby,
            "-e",
            "module Vagrant; def self.configure(*); end; end; "
            "ARGV.replace(['validate']); load 'Vagrantfile'; print PROVISION",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, XDG_DATA_HOME=str(tmp_path)),
    )
    assert script.returncode == 0, script.stderr
    assert "useradd" in script.stdout
    res = subprocess.run(["bash", "-n"], input=script.stdout, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_inventory_selects_vagrant(monkeypatch):
    from vllm_fleet.specs.inventory import load_inventory

    monkeypatch.setenv("VLLM_FLEET_LAB", "vagrant")
    monkeypatch.setenv("VLLM_FLEET_LAB_HOSTS", "3")
    inv = load_inventory(REPO / "inventory" / "lab.py")
    assert [inv[n]["address"] for n in ("lab1", "lab2", "lab3")] == ["10.10.0.11", "10.10.0.12", "10.10.0.13"]
    assert inv["lab1"]["data"]["ssh_user"] == "lab"
    assert "ray_workers" in inv["lab3"]["groups"] and "servers" in inv["lab1"]["groups"]
    # the Vagrantfile uses the same user, addresses and key path
    text = (REPO / "Vagrantfile").read_text()
    assert '"10.10.0.#{10 + i}"' in text and "useradd" in text and "lab-vagrant" in text
