"""The lab tier: real hosts (systemd-nspawn containers) brought up once per session.

Fixtures for any test under tests/lab (deploy tests included):
  lab        session: the lab's state dict (hosts, ssh_key, known_hosts, pip_cache_dir, ...);
             brings up VLLM_FLEET_LAB_TEST_HOSTS (default 2) hosts, or reuses a running lab
             (and then leaves it up); tears down at the end, also on failure, unless
             VLLM_FLEET_KEEP_LAB=1.
  lab_hosts  session: [LabHost(name, address, user, key, known_hosts)], with .ssh(cmd) and
             .ssh_argv() helpers that use plain OpenSSH (an independent reader, not pyinfra).
Helpers (LabHost, lab_cli) live in tests/lab/labkit.py. Tests marked `lab_last` run after every other test (e.g. the one
that takes the lab down).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from labkit import REPO, LabHost, lab_cli  # noqa: E402,F401  (helpers other lab tests import too)

sys.path.insert(0, str(REPO))
from vllm_fleet.lab import nspawn  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "lab: needs the local lab hosts (vllm-fleet lab up); slow")
    config.addinivalue_line("markers", "lab_last: run after all other tests (takes the lab down)")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("lab_last") is not None)  # stable sort


@pytest.fixture(scope="session")
def lab():
    if os.geteuid() != 0:
        why = "the lab tier needs root (bridge, NAT, containers)"
        if os.environ.get("VLLM_FLEET_REQUIRE_LAB") == "1":
            pytest.fail(f"{why}; VLLM_FLEET_REQUIRE_LAB=1 makes this an error", pytrace=False)
        pytest.skip(why)
    want = int(os.environ.get("VLLM_FLEET_LAB_TEST_HOSTS", "2"))
    before = nspawn.load_state(nspawn.LabConfig())
    have = len((before or {}).get("hosts", []))
    # a lab that is up (or being brought up by someone else) with enough hosts: reuse it, leave it up
    reused = have >= max(2, want)
    keep = reused or os.environ.get("VLLM_FLEET_KEEP_LAB") == "1"
    try:
        # reused: `up` with its own size is a no-op, or waits for a concurrent `up` and repairs
        res = lab_cli("up", "--hosts", str(have if reused else want))
        if res.returncode != 0:
            pytest.fail(f"lab up failed ({res.returncode}):\n{res.stdout}\n{res.stderr}", pytrace=False)
        st = nspawn.status(probe=True)
        st["reused"] = reused
        st["owned"] = not keep  # the session will take it down: tests may too (lab_last)
        yield st
    finally:
        if not keep:
            res = lab_cli("down", timeout=300)
            if res.returncode != 0:
                print(f"lab down failed ({res.returncode}):\n{res.stdout}\n{res.stderr}", file=sys.stderr)


@pytest.fixture(scope="session")
def lab_hosts(lab) -> list[LabHost]:
    return [LabHost(h["name"], h["address"], lab["ssh_user"], lab["ssh_key"], lab["known_hosts"]) for h in lab["hosts"]]


@pytest.fixture(scope="session")
def three_hosts(lab) -> list[LabHost]:
    """lab1..lab3: the multi-node and rollout tests need a third host (outside the 2-node
    cluster; the third replica). Grows a smaller lab to 3 hosts."""
    if len(lab["hosts"]) < 3:
        res = lab_cli("up", "--hosts", "3")
        assert res.returncode == 0, res.stdout + res.stderr
    st = nspawn.status(probe=True)
    return [LabHost(h["name"], h["address"], st["ssh_user"], st["ssh_key"], st["known_hosts"]) for h in st["hosts"]][:3]
