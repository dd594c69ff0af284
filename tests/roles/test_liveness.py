"""server.liveness (roles/liveness): the spec key and its defaults, the files the layout renders
(systemd's own parser reads the unit and the timer), the probe itself run against a real HTTP
server, and the role's operations on a bare and on a converged host. The lab test
(tests/lab/test_liveness.py) freezes a real replica and watches systemd restart it.
"""

from __future__ import annotations

import copy
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from vllm_fleet.render import files as render
from vllm_fleet.render.files import deployment_paths
from vllm_fleet.roles.liveness import install_liveness
from vllm_fleet.specs import load as spec_load

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fleetutil import host_state  # noqa: E402
from test_rendered_validity import _commands, needs_systemd, systemd_root  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / "vllm_fleet" / "render" / "templates" / "vllm-liveness.py"
INV = {
    "lab1": {"address": "10.10.0.11", "groups": ["servers", "proxy"], "data": {}},
    "lab2": {"address": "10.10.0.12", "groups": ["servers"], "data": {}},
    "edge": {"address": "10.10.0.5", "groups": ["proxy"], "data": {}},
}


def spec_with(liveness: dict | None = None, name: str = "lab-tiny-replicas") -> dict:
    raw = spec_load.load(REPO / "deployments" / f"{name}.yaml").raw
    raw = copy.deepcopy(raw)
    if liveness is not None:
        raw.setdefault("server", {})["liveness"] = liveness
    return spec_load.resolve(spec_load.loads(json.dumps(raw), "test"))


def liveness_files(files: dict) -> dict:
    return {p: f for p, f in files.items() if f.part == "liveness"}


# ---------------------------------------------------------------------------------------------
# The spec


def test_defaults_come_from_the_schema_also_for_a_partial_section():
    assert spec_with()["server"]["liveness"] == {"enabled": False, "period": 10, "timeout": 5, "failures": 3}
    assert spec_with({"enabled": True, "failures": 5})["server"]["liveness"] == {
        "enabled": True,
        "period": 10,
        "timeout": 5,
        "failures": 5,
    }


@pytest.mark.parametrize(
    "value,path",
    [
        ({"period": 1}, "server.liveness.period"),
        ({"failures": 0}, "server.liveness.failures"),
        ({"timeout": "5s"}, "server.liveness.timeout"),
        ({"every": 10}, "server.liveness.every"),
    ],
)
def test_a_bad_value_is_refused_naming_its_path(value, path):
    raw = copy.deepcopy(spec_load.load(REPO / "deployments" / "lab-tiny.yaml").raw)
    raw["server"]["liveness"] = value
    problems = spec_load.schema_problems(spec_load.loads(json.dumps(raw), "test"))
    assert any(p.path == path for p in problems), [(p.path, p.message) for p in problems]


# ---------------------------------------------------------------------------------------------
# The layout's files


def test_off_by_default_no_file_and_no_part():
    for files in render.render(spec_with(), copy.deepcopy(INV)).values():
        assert not liveness_files(files)


def test_on_every_host_serving_the_api_one_unit_over_its_replicas():
    spec = spec_with({"enabled": True, "period": 7, "timeout": 2, "failures": 4})
    spec["replicas"]["per_host"] = 2
    out = render.render(spec, copy.deepcopy(INV))
    p = deployment_paths(spec)
    assert not liveness_files(out["edge"])  # a proxy alone: nothing to probe
    for host in ("lab1", "lab2"):
        mine = liveness_files(out[host])
        assert set(mine) == {p["liveness_probe"], p["liveness_unit"], p["liveness_timer"]}, host
        assert {f.deployment for f in mine.values()} == {"lab-tiny-replicas"}
        assert mine[p["liveness_probe"]].mode == 0o755 and mine[p["liveness_unit"]].mode == 0o644
        unit = mine[p["liveness_unit"]].content
        exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
        assert exec_start.split()[-5:] == [
            "${RUNTIME_DIRECTORY}",
            "2",
            "4",
            "vllm-lab-tiny-replicas-0.service=8000",
            "vllm-lab-tiny-replicas-1.service=8001",
        ]
        assert "RuntimeDirectory=vllm-fleet-liveness/lab-tiny-replicas\n" in unit
        timer = mine[p["liveness_timer"]].content
        assert "OnUnitActiveSec=7\n" in timer and "WantedBy=timers.target" in timer


def test_turning_it_on_changes_no_file_of_the_service():
    """The replicas restart only when their files change: the probe adds files, it changes none."""
    off = render.render(spec_with(), copy.deepcopy(INV))
    on = render.render(spec_with({"enabled": True}), copy.deepcopy(INV))
    for host in off:
        assert {p: f for p, f in on[host].items() if f.part != "liveness"} == off[host], host


@needs_systemd
def test_systemd_reads_the_unit_and_the_timer_without_a_word(tmp_path):
    spec = spec_with({"enabled": True})
    files = render.render(spec, copy.deepcopy(INV))["lab1"]
    units = {p: f for p, f in files.items() if p.endswith((".service", ".timer"))}
    root = systemd_root(tmp_path, [c for f in units.values() for c in _commands(f.content)])
    for path, f in units.items():
        (root / path.lstrip("/")).write_text(f.content)
    p = deployment_paths(spec)
    for path in (p["liveness_unit"], p["liveness_timer"]):
        out = subprocess.run(["systemd-analyze", f"--root={root}", "verify", path], capture_output=True, text=True)
        assert out.returncode == 0 and (out.stdout + out.stderr).strip() == "", out.stdout + out.stderr


# ---------------------------------------------------------------------------------------------
# The probe, against a real HTTP server (systemctl: a stand-in on PATH that records what it is asked)


class Replica(http.server.BaseHTTPRequestHandler):
    status = 200
    stall = threading.Event()

    def do_GET(self):  # noqa: N802
        if Replica.stall.is_set():
            threading.Event().wait(3)  # keep the connection open, answer nothing (the probe waits 1 s)
            return
        self.send_response(Replica.status)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def replica():
    Replica.status = 200
    Replica.stall.clear()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Replica)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    Replica.stall.clear()
    srv.shutdown()


@pytest.fixture
def systemctl(tmp_path):
    """A `systemctl` on PATH: `show` answers from state.json ({unit: [ActiveState, InvocationID]}),
    every call is appended to calls.log."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (tmp_path / "state.json").write_text(json.dumps({"vllm-x-0.service": ["active", "inv1"]}))
    (bin_ / "systemctl").write_text(
        "#!/usr/bin/env python3\n"
        "import json, sys\n"
        f"open({str(tmp_path / 'calls.log')!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "if sys.argv[1] == 'show':\n"
        f"    state = json.load(open({str(tmp_path / 'state.json')!r})).get(sys.argv[-1], ['inactive', ''])\n"
        "    print(f'ActiveState={state[0]}'); print(f'InvocationID={state[1]}')\n"
    )
    (bin_ / "systemctl").chmod(0o755)
    (tmp_path / "run").mkdir()

    class Ctl:
        def set(self, active, invocation):
            (tmp_path / "state.json").write_text(json.dumps({"vllm-x-0.service": [active, invocation]}))

        def restarts(self):
            log = tmp_path / "calls.log"
            return [c for c in (log.read_text().splitlines() if log.exists() else []) if c.startswith("restart")]

        def probe(self, port, failures=3):
            env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}"}
            argv = [sys.executable, str(PROBE), str(tmp_path / "run"), "1", str(failures), f"vllm-x-0.service={port}"]
            return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)

    return Ctl()


def test_a_healthy_replica_that_stops_answering_is_restarted_after_failures_in_a_row(replica, systemctl):
    assert systemctl.probe(replica).returncode == 0 and systemctl.restarts() == []  # healthy: seen
    Replica.status = 503
    for n in (1, 2):
        out = systemctl.probe(replica)
        assert f"HTTP 503 ({n} of 3 in a row)" in out.stdout and systemctl.restarts() == []
    out = systemctl.probe(replica)
    assert systemctl.restarts() == ["restart --no-block vllm-x-0.service"], out.stdout
    assert "restarting it: 3 failed liveness probes in a row" in out.stdout


def test_no_answer_in_time_counts_and_one_success_resets_the_count(replica, systemctl):
    systemctl.probe(replica)
    Replica.stall.set()
    out = systemctl.probe(replica)
    assert "no answer within 1 s" in out.stdout and "(1 of 3 in a row)" in out.stdout
    Replica.stall.clear()
    systemctl.probe(replica)  # healthy again: count back to 0
    Replica.status = 500
    systemctl.probe(replica)
    out = systemctl.probe(replica)
    assert "(2 of 3 in a row)" in out.stdout and systemctl.restarts() == []


def test_a_replica_still_loading_or_stopped_is_left_alone(replica, systemctl):
    Replica.status = 503  # never healthy since its start: loading weights
    for _ in range(5):
        assert systemctl.probe(replica, failures=1).stdout == ""
    systemctl.set("inactive", "")
    Replica.status = 200
    for _ in range(3):
        systemctl.probe(replica, failures=1)
    assert systemctl.restarts() == []


def test_a_new_start_of_the_unit_starts_the_count_again(replica, systemctl):
    systemctl.probe(replica)  # healthy in invocation inv1
    Replica.status = 503
    systemctl.probe(replica)
    systemctl.probe(replica)
    systemctl.set("active", "inv2")  # restarted by someone else, now loading
    for _ in range(3):
        systemctl.probe(replica)
    assert systemctl.restarts() == []


# ---------------------------------------------------------------------------------------------
# The role


def _role_run(harness, spec, present=True, have=None, units=None, dirs=None):
    files = render.render(spec, copy.deepcopy(INV))["lab2"]
    return harness.run(
        install_liveness,
        spec,
        deployment_paths(spec),
        files,
        present=present,
        facts=host_state(files=have or {}, units=units or {}, dirs=dirs or {}),
    ), liveness_files(files)


def test_the_role_puts_its_files_and_starts_the_timer_then_has_nothing_to_do(harness):
    spec = spec_with({"enabled": True})
    p = deployment_paths(spec)
    timer = p["liveness_timer"].rsplit("/", 1)[1]
    run, mine = _role_run(harness, spec)
    assert set(run.uploads) == set(mine)
    assert run.uploads[p["liveness_probe"]] == PROBE.read_text()
    names = [op.name.rsplit(" | ", 1)[-1] for op in run.ops]
    assert "systemd daemon-reload (liveness probe)" in names and f"Start {timer} (every 10 s)" in names
    assert names.index("Helper scripts directory") < names.index(f"Put {p['liveness_probe']}"), names
    assert any(f"systemctl enable {timer}" in c for c in run.commands), run.commands
    have = {path: (f.content, f.owner or "root", f.group or "root", f.mode) for path, f in mine.items()}
    running = {timer: {"ActiveState": "active", "UnitFileState": "enabled"}}
    bin_dir = {p["liveness_probe"].rsplit("/", 1)[0]: ("root", "root", 0o755)}
    again, _ = _role_run(harness, spec, have=have, units=running, dirs=bin_dir)
    assert not again.changed, again.ops


def test_the_role_with_present_false_stops_the_timer_and_removes_its_files(harness):
    on = spec_with({"enabled": True})
    p = deployment_paths(on)
    placed = liveness_files(render.render(on, copy.deepcopy(INV))["lab2"])
    have = {path: (f.content, "root", "root", f.mode) for path, f in placed.items()}
    run, _ = _role_run(harness, spec_with({"enabled": False}), present=False, have=have)
    names = [op.name.rsplit(" | ", 1)[-1] for op in run.ops]
    for key in ("liveness_timer", "liveness_unit"):
        assert f"Stop and disable {p[key].rsplit('/', 1)[1]}" in names, names
    for path in placed:
        assert run.has_op(f"Remove {path}"), (path, names)
