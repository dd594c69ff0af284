"""Replicas behind one nginx and the rolling update, without the lab.

- batches: sizes, percentages, the order (inventory order; replicas a failed rollout left out
  first), and refusing a batch that would empty the upstream;
- the orchestration (vllm_fleet.commands.rollout) with pyinfra replaced by a recorder: which step runs on
  which hosts with which replicas marked down, stop at the first failed batch, what it prints;
- a real nginx serving the rendered replicas site in front of fake replicas: least_conn spreads
  the load, a replica marked `down` gets nothing, a refused connect goes to another replica;
- the load generator against a fake server: ok/failed counts and reasons;
- the rollout role's pure helpers and the API firewall rules.
"""

from __future__ import annotations

import http.server
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from vllm_fleet.render import files as render

from vllm_fleet.specs import load as spec
from vllm_fleet.serving.loadgen import LoadGen
from vllm_fleet.commands.rollout import Rollout, RolloutError, batch_size, plan_batches
from fleetutil import host_state, wait_listening
from vllm_fleet.host.state import HostState

#: A host with none of the deployment's files or units, as its state read answers.
bare_host = host_state()[HostState]

REPO = Path(__file__).resolve().parent.parent
SPEC = REPO / "deployments" / "lab-tiny-replicas.yaml"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
needs_nginx = pytest.mark.skipif(not Path(NGINX).exists(), reason="nginx not installed")
sys.path.insert(0, str(REPO))


# ---------------------------------------------------------------------------------------------
# batches


def test_batch_size_and_percent():
    assert batch_size(3) == 1
    assert batch_size(6, size=2) == 2
    assert batch_size(6, percent=50) == 3
    assert batch_size(3, percent=10) == 1  # rounded down, at least 1
    with pytest.raises(RolloutError, match="every replica"):
        batch_size(3, size=3)
    with pytest.raises(RolloutError, match="every replica"):
        batch_size(2, percent=100)
    with pytest.raises(RolloutError, match="deploys/serve.py"):
        batch_size(1)
    with pytest.raises(RolloutError, match="not both"):
        batch_size(4, size=1, percent=50)


def test_batches_keep_inventory_order_and_put_left_out_first():
    servers = ["lab1", "lab2", "lab3", "lab4", "lab5"]
    assert plan_batches(servers, 2) == [["lab1", "lab2"], ["lab3", "lab4"], ["lab5"]]
    assert plan_batches(servers, 1, first=["lab4"]) == [["lab4"], ["lab1"], ["lab2"], ["lab3"], ["lab5"]]
    assert plan_batches(servers, 2, first=["lab5", "lab2", "gone"]) == [["lab2", "lab5"], ["lab1", "lab3"], ["lab4"]]


# ---------------------------------------------------------------------------------------------
# orchestration with a recording runner


def _inventory(tmp_path: Path, servers: list[str]) -> str:
    inv = tmp_path / "inv.py"
    # proxy listed first: the order of replicas is the servers list's, not the file's host order
    inv.write_text(
        f"proxy = [('lab1', {{'ssh_hostname': '10.9.0.11'}})]\n"
        f"servers = {[(s, {'ssh_hostname': '10.9.0.' + str(10 + int(s[3:]))}) for s in servers]!r}\n"
    )
    return str(inv)


class Recorder:
    def __init__(self, fail_on: tuple[str, str] | None = None):
        self.calls: list[dict] = []
        self.fail_on = fail_on

    def __call__(self, argv, env):
        limit = [argv[i + 1] for i, a in enumerate(argv) if a == "--limit"]
        call = {
            "step": env["VLLM_FLEET_ROLLOUT_STEP"],
            "limit": limit,
            "down": env["VLLM_FLEET_UPSTREAM_DOWN"],
            "update": env["VLLM_FLEET_UPDATE"],
            "deploy": argv[3],
            "spec": env["VLLM_FLEET_SPEC"],
        }
        self.calls.append(call)
        if self.fail_on and (call["step"], ",".join(limit)) == self.fail_on:
            return (
                1,
                "--> Starting operation: x\n    [lab2] RuntimeError: lab2: vllm.service not healthy after 31 s (unit "
                "failed)\n",
            )
        return 0, "    [lab2] nginx reloaded; old workers gone after 0.4 s\n"


def test_rollout_steps_in_order(tmp_path):
    rec, said = Recorder(), []
    ro = Rollout(
        _inventory(tmp_path, ["lab3", "lab1", "lab2"]),
        str(SPEC),
        cwd=str(REPO),
        state_dir=str(tmp_path / "st"),
        runner=rec,
        say=said.append,
    )
    assert ro.batches == [["lab3:0"], ["lab1:0"], ["lab2:0"]]  # the servers group's order; instances HOST:N
    res = ro.run()
    assert res.ok and res.failed_batch is None
    seq = [(c["step"], ",".join(c["limit"]), c["down"], c["update"]) for c in rec.calls]
    assert seq == [
        ("upstream", "lab1", "lab3:0", ""),
        ("update", "lab3", "lab3:0", "lab3:0"),
        ("upstream", "lab1", "", ""),
        ("upstream", "lab1", "lab1:0", ""),
        ("update", "lab1", "lab1:0", "lab1:0"),
        ("upstream", "lab1", "", ""),
        ("upstream", "lab1", "lab2:0", ""),
        ("update", "lab2", "lab2:0", "lab2:0"),
        ("upstream", "lab1", "", ""),
    ]
    assert all(c["deploy"] == "vllm_fleet.deploys.rollout:rollout_step" and c["spec"] == str(SPEC) for c in rec.calls)
    # never more than the batch out of the upstream
    assert all(len([d for d in c["down"].split(",") if d]) <= 1 for c in rec.calls)
    assert "done, 3 replica(s)" in said[-1]


def test_rollout_stops_at_the_first_failed_batch_and_says_what_to_do(tmp_path):
    rec, said = Recorder(fail_on=("update", "lab2")), []
    inv = _inventory(tmp_path, ["lab1", "lab2", "lab3"])
    ro = Rollout(inv, str(SPEC), cwd=str(REPO), state_dir=str(tmp_path / "st"), runner=rec, say=said.append)
    res = ro.run()
    assert not res.ok and res.failed_batch == 2 and res.left_out == ["lab2:0"]
    # lab3 untouched; lab2 not put back
    assert [(c["step"], ",".join(c["limit"]), c["down"]) for c in rec.calls][-1] == ("update", "lab2", "lab2:0")
    assert not any("lab3" in c["limit"] for c in rec.calls)
    text = said[-1]
    assert "lab2:0: left OUT of the nginx upstream" in text
    assert "not yet updated, old configuration: lab3:0" in text and "updated: lab1:0" in text
    assert "journalctl -u vllm-lab-tiny-replicas-0.service" in text and "10.9.0.12" in text
    assert f"vllm-fleet rollout {inv} --spec {SPEC}" in text
    assert "not healthy after 31 s" in text
    # the next rollout (the fix) starts with lab2, which is out already
    rec2 = Recorder()
    ro2 = Rollout(inv, str(SPEC), cwd=str(REPO), state_dir=str(tmp_path / "st"), runner=rec2, say=said.append)
    assert ro2.batches == [["lab2:0"], ["lab1:0"], ["lab3:0"]]
    assert ro2.run().ok
    assert not (tmp_path / "st" / "lab-tiny-replicas.json").exists()


def test_rollout_refuses_bad_input_before_any_host(tmp_path):
    rec = Recorder()
    with pytest.raises(RolloutError, match="every replica"):
        Rollout(_inventory(tmp_path, ["lab1", "lab2"]), str(SPEC), size=2, cwd=str(REPO), runner=rec)
    with pytest.raises(RolloutError, match="spec has errors"):
        bad = tmp_path / "bad.yaml"
        bad.write_text(SPEC.read_text().replace("batch_size: 1", "batch_size: 0"))
        Rollout(_inventory(tmp_path, ["lab1", "lab2"]), str(bad), cwd=str(REPO), runner=rec)
    assert rec.calls == []


def test_cli_dry_prints_batches_and_what_each_would_change(tmp_path, monkeypatch, capsys):
    """--dry: the batches, and per batch `vllm-fleet diff`'s files of its replicas (bare stand-in
    hosts here: every file is new); nothing is run."""
    import yaml

    from vllm_fleet.commands import diff as diffmod
    from vllm_fleet.commands.cli import main

    inv = _inventory(tmp_path, ["lab1", "lab2", "lab3", "lab4"])
    data = yaml.safe_load(SPEC.read_text())
    (tmp_path / "model").mkdir()
    data["model"]["source"] = str(tmp_path / "model")
    data["server"]["api_key"] = {"file": str(tmp_path / "api.key"), "generate": True}
    spec_copy = tmp_path / "replicas.yaml"
    spec_copy.write_text(yaml.safe_dump(data))
    read = []
    monkeypatch.setattr(
        diffmod, "read_host", lambda name, address, data, query: read.append(address) or bare_host(query)
    )
    assert main(["rollout", inv, "--spec", str(spec_copy), "--batch-percent", "50", "--dry", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["batches"] == [["lab1:0", "lab2:0"], ["lab3:0", "lab4:0"]]
    unit = f"/etc/systemd/system/vllm-{data['name']}-0.service"
    assert sorted(out["changes"][1]) == ["lab3", "lab4"] and unit in out["changes"][1]["lab3"]
    assert sorted(read) == ["10.9.0.11", "10.9.0.12", "10.9.0.13", "10.9.0.14"]
    assert main(["rollout", inv, "--spec", str(spec_copy), "--batch-percent", "50", "--dry"]) == 0
    text = capsys.readouterr().out
    assert "batch 2: lab3:0, lab4:0" in text and f"+ {unit}: new" in text
    assert not (tmp_path / "api.key").exists()


def test_cli_refuses_a_batch_of_every_replica(tmp_path):
    inv = _inventory(tmp_path, ["lab1", "lab2", "lab3", "lab4"])
    r = subprocess.run(
        [sys.executable, "-m", "vllm_fleet", "rollout", inv, "--spec", str(SPEC), "--batch-size", "4"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "every replica" in r.stderr and "no host was changed" in r.stderr


# ---------------------------------------------------------------------------------------------
# rendering


def _resolved() -> dict:
    return spec.resolve(spec.load(SPEC))


def test_upstream_lists_every_replica_with_health_checks():
    inv = {
        f"lab{i}": {"address": f"10.9.0.1{i}", "groups": ["servers"] + (["proxy"] if i == 1 else []), "data": {}}
        for i in (1, 2, 3)
    }
    inv["lab3"]["data"]["upstream_down"] = True
    site = render.render(_resolved(), inv)["lab1"]["/etc/nginx/conf.d/vllm-fleet-lab-tiny-replicas.conf"].content
    assert "least_conn;" in site
    assert "server 127.0.0.1:8000 max_fails=2 fail_timeout=10s;" in site
    assert "server 10.9.0.12:8000 max_fails=2 fail_timeout=10s;" in site
    assert "server 10.9.0.13:8000 max_fails=2 fail_timeout=10s down;" in site
    assert "proxy_next_upstream error timeout http_502 http_503;" in site
    r = _resolved()
    r["proxy"]["routing"]["policy"] = "round_robin"
    assert (
        "least_conn" not in render.render(r, inv)["lab1"]["/etc/nginx/conf.d/vllm-fleet-lab-tiny-replicas.conf"].content
    )
    for h in inv.values():
        h["data"]["upstream_down"] = True
    with pytest.raises(render.RenderError, match="every replica marked down"):
        render.render(_resolved(), inv)


def test_api_firewall_rules():
    inv = {
        "lab1": {"address": "10.9.0.11", "groups": ["servers", "proxy"], "data": {}},
        "lab2": {
            "address": "10.9.0.12",
            "groups": ["servers"],
            "data": {"vllm_api_firewall_allow": ["10.9.0.11", "192.168.5.0/24"], "replicas_per_host": 2},
        },
    }
    text = render.render(_resolved(), inv)["lab2"]["/etc/vllm-fleet/api-firewall.nft"].content
    assert "elements = { 10.9.0.11, 192.168.5.0/24 }" in text
    # every instance of the host: server.port + its index
    assert "ip saddr @api_peers_v4 tcp dport { 8000, 8001 } accept" in text and "tcp dport { 8000, 8001 } drop" in text
    inv["lab2"]["data"]["vllm_api_firewall_allow"] = ["proxy.example"]
    with pytest.raises(
        render.RenderError,
        match=r"host lab2: data vllm_api_firewall_allow\[0\] = 'proxy.example': expected a list of IPv4",
    ):
        render.render(_resolved(), inv)


def test_rollout_role_helpers(tmp_path):
    from vllm_fleet.host import programs
    from vllm_fleet.roles.rollout import parse_metrics

    text = (
        '# HELP vllm:num_requests_running x\nvllm:num_requests_running{model_name="tiny"} 2.0\n'
        'vllm:num_requests_waiting{model_name="tiny"} 1.0\nvllm:num_requests_running{model_name="b"} 1.0\n'
    )
    assert parse_metrics(text) == {"vllm:num_requests_running": 3.0, "vllm:num_requests_waiting": 1.0}
    with pytest.raises(ValueError):
        parse_metrics("other 1\n")
    assert (
        subprocess.run(["bash", "-n", str(programs.path("nginx_reload_wait.sh"))], capture_output=True).returncode == 0
    )
    compile(programs.script("replica_smoke.py"), "smoke", "exec")


# ---------------------------------------------------------------------------------------------
# a real nginx in front of fake replicas


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fake_replica(name: str, hits: Counter, delay: float = 0.05, status: int = 200):
    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            hits[name] += 1
            time.sleep(delay)
            body = json.dumps(
                {"replica": name, "choices": [{"message": {"content": "hi"}}], "usage": {"completion_tokens": 1}}
            ).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST

    port = _free_port()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, port


@needs_nginx
def test_nginx_spreads_skips_down_and_retries_refused(tmp_path):
    from test_rendered_validity import _nginx_prefix

    hits: Counter = Counter()
    a, pa = _fake_replica("a", hits)
    b, pb = _fake_replica("b", hits)
    c, pc = _fake_replica("down", hits)
    refused = _free_port()  # nothing listens: connect refused
    r = _resolved()
    r["proxy"]["auth"] = "none"
    inv = {"p": {"address": "127.0.0.1", "groups": ["proxy"], "data": {}}}
    for n, port in (("a", pa), ("b", pb), ("down", pc), ("gone", refused)):
        # four "hosts" on this machine: their own ssh names, one private address (the upstream's)
        inv[n] = {
            "address": f"{n}.invalid",
            "groups": ["servers"],
            "data": {"upstream_down": n == "down", "private_address": "127.0.0.1"},
        }
    site = render.render(r, inv)["p"]["/etc/nginx/conf.d/vllm-fleet-lab-tiny-replicas.conf"].content
    # every replica has the same port in a spec: give each fake its own (the upstream lines are in order)
    lines = iter([pa, pb, pc, refused])
    site = "\n".join(
        line.replace("127.0.0.1:8000", f"127.0.0.1:{next(lines)}")
        if line.strip().startswith("server 127.0.0.1:8000")
        else line
        for line in site.splitlines()
    )
    listen = _free_port()
    prefix = _nginx_prefix(tmp_path, site, None, port=listen)
    proc = subprocess.Popen(
        [NGINX, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-e", str(prefix / "logs/error.log")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_listening(proc, listen)
        codes = Counter()

        def post(i):
            req = urllib.request.Request(
                f"http://127.0.0.1:{listen}/v1/chat/completions",
                data=b"{}",
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=10) as resp:
                codes[resp.status] += 1

        threads = [threading.Thread(target=post, args=(i,)) for i in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert codes == Counter({200: 40})  # the refused replica cost no request: retried elsewhere
        assert hits["down"] == 0
        assert hits["a"] > 5 and hits["b"] > 5 and hits["a"] + hits["b"] == 40, hits
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for s in (a, b, c):
            s.shutdown()


# ---------------------------------------------------------------------------------------------
# load generator


class _FakeChat(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    n = 0
    lock = threading.Lock()

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        with _FakeChat.lock:
            _FakeChat.n += 1
            n = _FakeChat.n
        if n % 5 == 0:  # every fifth request: 503
            data = b'{"error": "overloaded"}'
            self.send_response(503)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            events = [b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'] * 3
            if n % 7 != 0:  # every seventh: cut before [DONE]
                events.append(b"data: [DONE]\n\n")
            for e in events:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(e), e))
            self.wfile.write(b"0\r\n\r\n")
            return
        data = json.dumps({"choices": [{"message": {"content": "hi"}}], "usage": {"completion_tokens": 2}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_loadgen_counts_ok_and_failed_with_reasons():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeChat)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        gen = LoadGen(f"http://127.0.0.1:{srv.server_address[1]}/v1", "tiny", "k", concurrency=3, rate=200).start()
        time.sleep(0.6)
        st = gen.stop()
    finally:
        srv.shutdown()
    assert st.total == _FakeChat.n and st.total > 20
    assert st.plain > 0 and st.streamed > 0
    five = _FakeChat.n // 5
    cut = sum(1 for r in gen.records if not r.ok and r.reason.startswith("stream cut"))
    assert st.reasons.get('HTTP 503: {"error": "overloaded"}') == five
    assert st.failed == five + cut and st.ok == st.total - st.failed
    assert "failed" in st.summary() and st.as_dict()["total"] == st.total
    # bounded: never more requests in flight than threads
    assert st.seconds < 5
