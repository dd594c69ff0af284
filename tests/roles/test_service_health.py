"""The service role's health wait proves the unit's own process answers, waits for a unit that
systemd is still starting, and restarts nothing for an owner/mode-only change (issues 24 and 25).

- The listener check (host/scripts/port_owner.sh, plain sh + /proc) run for real on this machine against a socket
  this test holds, with a stand-in ``systemctl`` that names the unit's cgroup: "own" when the
  listener's process is in that cgroup, "other PID COMM" when not.
- ``_wait_healthy`` through pyinfra's local connector, against a real HTTP server on a port
  that another process (this test) holds while the unit crash-loops: no "healthy", a failure
  naming the unit, NRestarts, the PID that answers and the journal tail.
- Plan time, against a host snapshot (``HostState``): a converged instance that systemd is
  restarting (auto-restart), or whose process started after its configuration was last recorded
  healthy and less than ``server.health_timeout`` ago, gets the wait and nothing else; a healthy
  one and an old one get no operation; an env file whose content is the same but whose mode
  differs gets its put and no restart.
"""

from __future__ import annotations

import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("pyinfra")

from pyinfra.api import Config, Inventory, State  # noqa: E402
from pyinfra.api.connect import connect_all  # noqa: E402
from pyinfra.context import ctx_host, ctx_state  # noqa: E402

from fleetutil import health_server  # noqa: E402

from vllm_fleet.host import programs  # noqa: E402
from vllm_fleet.roles import service  # noqa: E402
from vllm_fleet.host.state import HostState, Snapshot  # noqa: E402


def _my_cgroup() -> str:
    """One cgroup path of this process as /proc/self/cgroup names it (the unit's, in the test)."""
    lines = [line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()]
    return max(lines, key=len)


def _fake_tools(tmp_path: Path, cgroup: str, *, active: str = "active", crash_every: int = 0) -> Path:
    """A ``systemctl`` answering for one unit (ControlGroup, is-active, NRestarts: +1 every
    ``crash_every`` calls when set) and a ``journalctl`` printing a crash line."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    count = tmp_path / "calls"
    count.write_text("0")
    (bin_ / "systemctl").write_text(f"""#!/bin/sh
case "$*" in
  *ControlGroup*) echo '{cgroup}' ;;
  is-active*) echo {active} ;;
  *NRestarts*) n=$(cat {count}); n=$((n + 1)); echo $n > {count}
               if [ {crash_every} -gt 0 ]; then echo $((n / {crash_every})); else echo 0; fi ;;
  *ExecMainStartTimestamp*) date -u '+%a %Y-%m-%d %H:%M:%S.000000 UTC' ;;
  *MainPID*) echo $$ ;;
esac
""")
    (bin_ / "journalctl").write_text("#!/bin/sh\necho 'OSError: [Errno 98] Address already in use'\n")
    for f in ("systemctl", "journalctl"):
        (bin_ / f).chmod(0o755)
    return bin_


def _owner(port: int, bin_: Path) -> str:
    import subprocess

    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}")
    r = subprocess.run(
        ["sh", "-c", programs.script("port_owner.sh") + f"owner {port} vllm-x-0.service"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_the_listener_check_tells_the_units_process_from_another(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        assert _owner(port, _fake_tools(tmp_path, _my_cgroup())) == "own"
        other = _owner(port, _fake_tools(tmp_path, "/system.slice/vllm-other-0.service"))
        assert other.split()[:2] == ["other", str(os.getpid())], other
        assert other.split()[2] == Path(f"/proc/{os.getpid()}/comm").read_text().strip()
    finally:
        s.close()
    assert _owner(port, _fake_tools(tmp_path, _my_cgroup())) == "unknown"  # nobody listens now


@pytest.fixture
def health_port():
    srv, port = health_server()
    yield port
    srv.shutdown()
    srv.server_close()


def _wait(port: int, bin_: Path, monkeypatch, deadline: int = 20, stamp: str | None = None) -> list[str]:
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    inv = Inventory((["@local"], {}))
    state = State(inv, Config())
    connect_all(state)
    h = inv.get_host("@local")
    logged: list[str] = []
    monkeypatch.setattr(h, "log", lambda msg, *a, **k: logged.append(msg))
    with ctx_state.use(state), ctx_host.use(h):
        service._wait_healthy(
            port=port, deadline=deadline, interval=0.2, journal_lines=5, unit="vllm-x-0.service", stamp=stamp
        )
    return logged


def test_another_process_answering_on_the_port_is_not_healthy(tmp_path, health_port, monkeypatch):
    """Issue 24: a second deployment on the same ports said "healthy after 0 s" because the other
    one answered; its own unit crash-looped on "Address already in use"."""
    bin_ = _fake_tools(tmp_path, "/system.slice/vllm-x-0.service", active="activating", crash_every=3)
    with pytest.raises(RuntimeError) as e:
        _wait(health_port, bin_, monkeypatch)
    msg = str(e.value)
    assert "vllm-x-0.service not healthy" in msg and "NRestarts" in msg, msg
    assert f"answered by PID {os.getpid()}" in msg and "not by vllm-x-0.service" in msg, msg
    assert "crashed while starting" in msg and "Address already in use" in msg, msg
    # the journal's own error first, then where the whole journal is (issue 37)
    assert msg.splitlines()[1:3] == [
        "  root cause: OSError: [Errno 98] Address already in use",
        "  full journal: journalctl -u vllm-x-0.service --no-pager (on @local)",
    ], msg


def test_the_units_own_listener_is_healthy(tmp_path, health_port, monkeypatch):
    import time

    stamp = tmp_path / "replica-0.applied"
    stamp.write_text("token\n")
    os.utime(stamp, (time.time() - 3600, time.time() - 3600))
    logged = _wait(health_port, _fake_tools(tmp_path, _my_cgroup()), monkeypatch, stamp=str(stamp))
    assert any("vllm-x-0.service healthy after" in line for line in logged), logged
    # this start was seen healthy: the stamp is newer than it, so the next deploy does not wait again
    assert time.time() - stamp.stat().st_mtime < 60 and stamp.read_text() == "token\n"


# -- plan time: what a re-deploy does for an instance systemd is still starting -------------------


def _plan(harness, extra: list[str] | None = None, drop: tuple[str, ...] = (), mode_of: dict[str, str] | None = None):
    from tests.roles.test_host_state import _lab, _service_and_nginx, converged_lines

    spec, h, node = _lab()
    lines = [line for line in converged_lines(spec, h, node, "k3y") if not line.startswith(drop)]
    for path, mode in (mode_of or {}).items():  # the same content, another mode
        for i, line in enumerate(lines):
            f = line.split("\t")
            if f[:2] == ["stat", path]:
                lines[i] = "\t".join(f[:5] + [mode] + f[6:])
    lines = lines[:-1] + (extra or []) + ["end"]
    from pyinfra.facts.files import File, Sha256File
    from pyinfra.facts.systemd import SystemdEnabled, SystemdStatus

    run = harness.run(
        _service_and_nginx,
        spec,
        h,
        node,
        "k3y",
        facts={
            HostState: lambda query: Snapshot.parse(lines),
            File: {"user": "root", "mode": 600},
            Sha256File: "x",
            SystemdStatus: {},
            SystemdEnabled: {},
        },
    )
    unit = node.instances[0].unit
    stamp = f"{spec['install']['config_dir']}/replica-{node.instances[0].index}.applied"
    return run, [op.name.rsplit(" | ", 1)[-1] for op in run.ops], unit, stamp, spec, h


def _unit_lines(unit: str, active: str, sub: str, restarts: int) -> list[str]:
    return [
        f"unit\tId={unit}",
        "unit\tLoadState=loaded",
        f"unit\tActiveState={active}",
        f"unit\tSubState={sub}",
        "unit\tUnitFileState=enabled",
        f"unit\tNRestarts={restarts}",
        "unit\t",
    ]


def test_a_unit_systemd_is_restarting_is_waited_for_not_restarted(harness):
    from tests.roles.test_host_state import _lab

    spec, h, node = _lab()
    unit = node.instances[0].unit
    run, names, unit, _, _, _ = _plan(
        harness, extra=_unit_lines(unit, "activating", "auto-restart", 4), drop=(f"unit\t",)
    )
    waits = [n for n in names if n.startswith(f"Wait for {unit} /health")]
    assert len(waits) == 1 and "activating (auto-restart), NRestarts 4" in waits[0], names
    assert not any(n.startswith("Restart ") or n.startswith("Put ") for n in names), names
    assert any(c == "python:_wait_healthy" for c in run.commands)


_SERVES = (
    '{"model": "%s", "choices": [{"message": {"content": "OK"}, "finish_reason": "stop"}], "usage": '
    '{"completion_tokens": 1}}'
)


@pytest.mark.parametrize(
    "started,stamp_age,chat,waits",
    [
        (40, 3600, None, True),  # systemd restarted it (a crash, a kill) after it was last seen healthy
        (40, 3600, "502", True),  # ... and its short chat in the state read fails: not serving yet
        (40, 3600, "200", False),  # ... but its short chat in the same read answered: it serves, nothing to wait for
        (40, 30, None, False),  # this deploy's own start, recorded healthy after it: the no-op stays a no-op
        (4000, 9000, None, False),  # older than the health timeout: not "still starting"
    ],
)
def test_a_recent_start_not_yet_seen_healthy_is_waited_for(harness, started, stamp_age, chat, waits):
    import base64

    from tests.roles.test_host_state import _lab

    spec, h, node = _lab()
    unit = node.instances[0].unit
    stamp = f"{spec['install']['config_dir']}/replica-{node.instances[0].index}.applied"
    assert spec["server"]["health_timeout"] < 4000
    port = node.instances[0].port
    extra = [f"started\t{unit}\t{started}", f"age\t{stamp}\t{stamp_age}"]
    if chat:
        body = _SERVES % spec["model"]["served_name"] if chat == "200" else "Bad Gateway"
        extra.append(f"chat\t{port}\t{chat}\t{base64.b64encode(body.encode()).decode()}")
    run, names, _, _, _, _ = _plan(harness, extra=extra)
    check = f"{unit} answers a chat on port {port}"  # every replica proven (test_replica_chat below)
    if waits:
        assert names == [
            f"Wait for {unit} /health on port {port} (deadline {spec['server']['health_timeout']} s; "
            f"its process started {started} s ago, not yet seen healthy)",
            check,
        ], names
        assert run.ops[1].conditional  # the chat check runs only where the wait (which chats itself) did not
    else:
        assert names == [check] and run.ops[0].commands == [], names


def test_a_mode_only_change_puts_the_file_and_restarts_nothing(harness):
    """Issue 24: `diff` showed only 644 -> 600 on an env file and the deploy restarted vLLM."""
    from tests.roles.test_host_state import _lab

    spec, h, node = _lab()
    env = next(p for p in h.files if p.endswith("/vllm.env"))
    want = f"{h.files[env].mode:o}"
    other = "644" if want != "644" else "600"
    run, names, unit, _, _, _ = _plan(harness, mode_of={env: other})
    assert f"Put {env}" in names, names  # the mode is fixed
    assert not any(n.startswith(("Restart ", "Wait for ")) for n in names), names
    # (a content change still restarts: test_host_state's test_one_file_that_differs_gets_its_put...)


def test_the_state_script_reads_a_units_start_and_a_files_age(tmp_path, monkeypatch):
    """host_state.sh for real: ``started`` from systemctl's ExecMainStartTimestamp (in words, as
    systemctl prints it) and ``age`` from the file's mtime, both against the host's clock."""
    import subprocess
    import time

    from vllm_fleet.host.state import Query

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "systemctl").write_text("""#!/bin/sh
case "$*" in
  *ExecMainStartTimestamp*) date -d '-50 seconds' '+%a %Y-%m-%d %H:%M:%S %Z' ;;
  *) printf '%s\\n' Id=vllm-x-0.service LoadState=loaded ActiveState=activating SubState=auto-restart NRestarts=3 \\
       UnitFileState=enabled ;;
esac
""")
    (bin_ / "systemctl").chmod(0o755)
    stamp = tmp_path / "replica-0.applied"
    stamp.write_text("x\n")
    os.utime(stamp, (time.time() - 120, time.time() - 120))
    q = Query(units=("vllm-x-0.service",), ages=(str(stamp), str(tmp_path / "nope")))
    r = subprocess.run(
        ["sh", "-c", HostState().command(q).get_raw_value()],
        capture_output=True,
        text=True,
        timeout=30,
        env=dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}"),
    )
    s = Snapshot.parse(r.stdout.splitlines())
    s.query = q
    assert s.unit("vllm-x-0.service")["SubState"] == "auto-restart" and s.unit("vllm-x-0.service")["NRestarts"] == "3"
    # the script reads its clock before the stand-in systemctl runs: on a loaded machine seconds
    # apart (48 once), so the bounds allow for that, not for a misread (0, or minutes off)
    assert 40 <= s.started_ago("vllm-x-0.service") <= 60, r.stdout
    known, age = s.age(str(stamp))
    assert known and 110 <= age <= 130, r.stdout
    assert s.age(str(tmp_path / "nope")) == (True, None)


# -- every replica proven on its host: one short chat (issue 25 part 4) -----------------------------


class _Chat(BaseHTTPRequestHandler):
    seen: list = []
    model = "tiny"

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Chat.seen.append((self.headers.get("Authorization"), body))
        import json

        doc = {
            "model": _Chat.model,
            "choices": [{"message": {"role": "assistant", "content": "OK"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 4},
        }
        data = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def test_the_state_read_chats_with_each_replica_with_the_key_off_the_command_line(tmp_path):
    """host_state.sh's ``chat`` for real against a local server standing in for vLLM: the key comes
    from the env file (quoted as the deploy writes it) in the Authorization header, never in argv;
    the answer is judged as the deploy does (served model, message, completion tokens)."""
    import subprocess

    from vllm_fleet.host.state import Query
    from vllm_fleet.serving.smoke import judge_replica_chat

    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Chat)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    secrets = tmp_path / "secrets.env"
    secrets.write_text("# managed by vllm-fleet\nVLLM_API_KEY='s3cret-key'\n")
    try:
        q = Query(chats=(f"{port} {secrets} tiny 4",))
        cmd = HostState().command(q).get_raw_value()
        assert "s3cret-key" not in cmd
        r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=60)
        snap = Snapshot.parse(r.stdout.splitlines())
        snap.query = q
        code, body = snap.chat(port)
        assert code == "200" and judge_replica_chat(code, body, "tiny") is None, (code, body)
        assert _Chat.seen[-1][0] == "Bearer s3cret-key"
        assert b'"max_tokens": 4' in _Chat.seen[-1][1] and b'"model": "tiny"' in _Chat.seen[-1][1]
        _Chat.model = "other-deployment"
        r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=60)
        snap = Snapshot.parse(r.stdout.splitlines())
        snap.query = q
        assert "not 'tiny'" in judge_replica_chat(*snap.chat(port), "tiny")
    finally:
        _Chat.model = "tiny"
        srv.shutdown()
        srv.server_close()
    # nobody on the port: no answer, judged as such
    r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=60)
    snap = Snapshot.parse(r.stdout.splitlines())
    snap.query = q
    assert judge_replica_chat(*snap.chat(port), "tiny").startswith("HTTP 000") or "no answer" in judge_replica_chat(
        *snap.chat(port), "tiny"
    )


@pytest.mark.parametrize(
    "code,body,bad",
    [
        (
            "200",
            '{"model": "tiny", "choices": [{"message": {"content": "OK"}, "finish_reason": "stop"}], "usage": '
            '{"completion_tokens": 1}}',
            None,
        ),
        ("502", "Bad Gateway", "HTTP 502"),
        ("200", "<html>", "not JSON"),
        ("200", '{"model": "tiny", "choices": [], "usage": {"completion_tokens": 1}}', "no message"),
        (
            "200",
            '{"model": "tiny", "choices": [{"message": {"content": ""}, "finish_reason": "length"}], "usage": '
            '{"completion_tokens": 0}}',
            "no completion tokens",
        ),
    ],
)
def test_judging_a_replicas_chat(code, body, bad):
    from vllm_fleet.serving.smoke import judge_replica_chat

    got = judge_replica_chat(code, body, "tiny")
    assert (got is None) if bad is None else (bad in got), got


def test_replica_chat_fails_the_host_when_the_replica_does_not_serve(harness):
    """The check op: with the state read's chat showing a failed answer, executing it fails the
    host naming the replica and port (run through the op's own generator, executing)."""
    from pyinfra import state as pstate  # noqa: F401

    from vllm_fleet.roles import smoke
    from vllm_fleet.roles.common import state as st

    class _Snap:
        def chat(self, port):
            return ("500", '{"error": "engine dead"}')

    spec = {"model": {"served_name": "tiny"}}
    import types

    gen_mod = types.SimpleNamespace(is_executing=True)
    orig_state, orig_host_state = smoke.state, st.host_state
    smoke.state, st.host_state = gen_mod, lambda: _Snap()
    try:
        host_obj = types.SimpleNamespace(name="lab2", noop=lambda *_: None)
        orig_host = smoke.host
        smoke.host = host_obj
        try:
            cmds = list(
                smoke.replica_chat._inner(
                    spec=spec,
                    where={"secrets_env": "/etc/vllm-fleet/x/secrets.env"},
                    unit="vllm-x-1.service",
                    port=8001,
                )
            )
        finally:
            smoke.host = orig_host
    finally:
        smoke.state, st.host_state = orig_state, orig_host_state
    assert len(cmds) == 1
    with pytest.raises(RuntimeError, match=r"lab2: replica vllm-x-1.service \(port 8001\) does not serve: .*HTTP 500"):
        cmds[0].function(*cmds[0].args, **cmds[0].kwargs)
