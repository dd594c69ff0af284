"""Callbacks that run commands on a host at execute time (the /health wait, the smoke tests'
direct stream, the rollout's drain, Ray's status) run them with the host's own privilege
arguments, not a fixed ``_sudo=True``: a host reached as root may have no sudo at all (a minimal
Debian image; the GPU machine of issue 17, where every /health probe failed with "sudo: not
found" and the deploy waited out its 600 s deadline with vLLM healthy).

Real pyinfra: an ``@local`` host through pyinfra's local connector, the wait's real probe against
a loopback HTTP server, with a PATH that has no sudo."""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("pyinfra")

from pyinfra.api import Config, Inventory, State  # noqa: E402
from pyinfra.api.connect import connect_all  # noqa: E402
from pyinfra.context import ctx_host, ctx_state  # noqa: E402

from fleetutil import health_server  # noqa: E402


@pytest.fixture
def health_url():
    srv, port = health_server()
    yield f"http://127.0.0.1:{port}/health"
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def no_sudo_path(tmp_path, monkeypatch):
    """A PATH with sh and curl and nothing else (no sudo, no systemctl)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for tool in ("sh", "curl"):
        found = shutil.which(tool)
        if not found:
            pytest.skip(f"{tool} not installed")
        os.symlink(found, bin_ / tool)
    monkeypatch.setenv("PATH", str(bin_))
    return bin_


def _local(data: dict, **config):
    inv = Inventory((["@local"], data))
    state = State(inv, Config(**config))
    connect_all(state)
    return state, inv.get_host("@local")


def _as_root(state, h):
    from vllm_fleet.roles.common import as_root

    with ctx_state.use(state), ctx_host.use(h):
        return as_root()


def test_the_health_probe_works_on_a_root_host_without_sudo(health_url, no_sudo_path):
    from vllm_fleet.roles import service

    state, h = _local({})
    with ctx_state.use(state), ctx_host.use(h):
        code, _, _, _ = service._probe(health_url, "vllm-none.service")
    assert code == "200", f"the /health probe read {code!r}, not the server's 200 (was sudo used?)"


def test_privilege_arguments_follow_host_data_and_config():
    assert not _as_root(*_local({})).get("_sudo")
    assert _as_root(*_local({"_sudo": True}))["_sudo"] is True
    assert _as_root(*_local({"_sudo": True, "_sudo_user": "vllm"}))["_sudo_user"] == "vllm"
    assert _as_root(*_local({}, SUDO=True))["_sudo"] is True  # pyinfra --sudo
    assert _as_root(*_local({"_doas": True}))["_doas"] is True
    # only privilege arguments: a callback's own _timeout / _env are not overridden
    assert not {k for k in _as_root(*_local({"_sudo": True, "_timeout": 5})) if k in ("_timeout", "_env", "_chdir")}
