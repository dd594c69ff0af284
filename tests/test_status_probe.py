"""`vllm-fleet status` reads each host with vllm_fleet/host/scripts/status_probe.py through the one
transport (pyinfra's connector: @local here) and judges each instance: a crash loop is failing
even when something answers on its port (issue 24: a crash-looping unit showed "active ... ok")."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from vllm_fleet.commands.status import judge, probe_command
from vllm_fleet.host.transport import HostError, Transport
from vllm_fleet.specs.load import load, resolve

from fleetutil import REPO  # noqa: F401  (tests/ on sys.path)


@pytest.mark.parametrize(
    "inst, unit, health",
    [
        ({"active": "active", "sub": "running", "restarts": 0, "active_for_s": 900, "health": 200}, "active", "ok"),
        # systemd waits RestartSec between failures: activating (auto-restart)
        (
            {"active": "activating", "sub": "auto-restart", "restarts": 7, "active_for_s": None, "health": 200},
            "activating (auto-restart)",
            "failing (crash loop: 7 restarts)",
        ),
        # between two failures the unit is "active" for moments: restarted, and active only 4 s
        (
            {"active": "active", "sub": "running", "restarts": 3, "active_for_s": 4.0, "health": 200},
            "active",
            "failing (crash loop: 3 restarts)",
        ),
        # restarted once long ago, healthy since: ok
        ({"active": "active", "sub": "running", "restarts": 1, "active_for_s": 3600, "health": 200}, "active", "ok"),
        (
            {"active": "failed", "sub": "failed", "restarts": 5, "active_for_s": None, "health": None},
            "failed",
            "failing (failed)",
        ),
        (
            {"active": "active", "sub": "running", "restarts": 0, "active_for_s": 900, "health": 503},
            "active",
            "down (503)",
        ),
        ({"load": "not-found", "active": "inactive", "sub": "dead", "restarts": 0}, "not-found", "down (no unit)"),
    ],
)
def test_judge_reports_crash_loops_as_failing(inst, unit, health):
    assert judge(inst) == (unit, health)


def test_status_probe_through_the_local_transport(tmp_path):
    """The probe on this machine: /health and /v1/models of a stand-in, the key read from the
    secrets file (the stand-in lists models only with it), a unit systemd does not know."""
    seen = []

    class H(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen.append(self.headers.get("Authorization"))
            if self.path == "/health":
                body, code = b"", 200
            elif self.headers.get("Authorization") == "Bearer k'ey $x":
                body, code = json.dumps({"data": [{"id": "tiny"}]}).encode(), 200
            else:
                body, code = b"{}", 401
            self.send_response(code)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    spec = resolve(load(REPO / "deployments" / "lab-tiny.yaml"))
    from vllm_fleet.render.files import env_file

    secrets = tmp_path / "secrets.env"
    secrets.write_text(env_file({"VLLM_API_KEY": "k'ey $x"}))
    spec["install"]["config_dir"] = str(tmp_path)
    inst = SimpleNamespace(unit="vllm-fleet-no-such-unit-0.service", port=srv.server_port, index=0)
    try:
        with Transport({"@local": {"address": "@local", "data": {}}}) as t:
            r = t.run("@local", probe_command(spec, [inst]), timeout=60)
    finally:
        srv.shutdown()
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    (got,) = doc["instances"]
    assert got["health"] == 200 and got["models"] == ["tiny"], (doc, r.stderr)
    assert got["unit"] == inst.unit and doc["version"] is None  # no env at the spec's prefix here
    assert "Bearer k'ey $x" in seen


def test_an_unreachable_host_is_a_host_error_naming_it():
    hosts = {"gone": {"address": "127.0.0.1", "data": {"ssh_port": 1, "ssh_user": "root"}}}
    with Transport(hosts, connect_timeout=3) as t, pytest.raises(HostError, match="^gone: cannot connect"):
        t.run("gone", "true")
