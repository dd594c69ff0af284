"""proxy.routing (docs/routing.md): what each policy renders, the router's command line against
vllm-router 0.1.17's own --help, the layout's `router` part and ports, the client settings, and
a real nginx in front of three fake replicas: `session` keeps a header's requests on one replica
and spreads requests without it."""

from __future__ import annotations

import copy
import http.server
import json
import re
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from test_rendered_validity import NGINX, _free_port, _nginx_prefix, needs_nginx
from vllm_fleet.render import files as render
from vllm_fleet.render.layout import AUTO_POLICY, build
from vllm_fleet.serving import multiturn
from vllm_fleet.specs import load as spec

REPO = Path(__file__).resolve().parent.parent
HELP = (Path(__file__).resolve().parent / "fixtures" / "vllm-router-0.1.17-help.txt").read_text()
INV = {
    f"lab{i}": {"address": f"10.10.0.1{i}", "groups": ["servers"] + (["proxy"] if i == 1 else []), "data": {}}
    for i in (1, 2, 3)
}
SITE = "/etc/nginx/conf.d/vllm-fleet-lab-tiny-routing.conf"
UNIT = "/etc/systemd/system/vllm-router-lab-tiny-routing.service"


def resolved(policy: str | None = None, **router) -> dict:
    r = spec.resolve(spec.load(REPO / "deployments" / "lab-tiny-routing.yaml"))
    if policy:
        r["proxy"]["routing"]["policy"] = policy
    r["proxy"]["routing"]["router"].update(router)
    return r


def test_router_flags_exist_in_the_pinned_release():
    """Every flag of the rendered command line is in vllm-router 0.1.17's --help (captured in
    tests/fixtures), and the version pinned by the schema is that one."""
    r = resolved("cache_aware")
    assert r["proxy"]["routing"]["router"]["version"] == "0.1.17"
    argv = render.router_argv(r, ["http://127.0.0.1:8000"])
    flags = [a for a in argv if a.startswith("--")]
    assert len(flags) > 10
    known = set(re.findall(r"(--[a-z][a-z0-9-]+)", HELP))
    assert not [f for f in flags if f not in known]
    assert "cache_aware" in re.search(r"--policy \{([^}]*)\}", HELP).group(1)


def test_cache_aware_renders_the_router_behind_nginx():
    out = render.render(resolved("cache_aware"), copy.deepcopy(INV))
    site, unit = out["lab1"][SITE].content, out["lab1"][UNIT].content
    assert "server 127.0.0.1:8190;" in site and "least_conn" not in site
    assert "10.10.0.12:8000" not in site  # the router picks the replica, not nginx
    assert "location = /metrics/router" in site and "proxy_pass http://127.0.0.1:8191/metrics;" in site
    assert (
        "proxy_buffering off;" in site and "if ($vfa_lab_tiny_routing = 0)" in site
    )  # TLS/key/streaming stay at nginx
    assert "--worker-urls http://127.0.0.1:8000 http://10.10.0.12:8000 http://10.10.0.13:8000" in unit
    assert "--host 127.0.0.1 --port 8190" in unit and "--prometheus-host 127.0.0.1 --prometheus-port 8191" in unit
    assert "--cache-threshold 0.3 --balance-abs-threshold 16 --balance-rel-threshold 1.5" in unit
    for line in (
        "DynamicUser=yes",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "CapabilityBoundingSet=",
        "PrivateDevices=yes",
    ):
        assert line in unit.splitlines()
    assert not [p for h in ("lab2", "lab3") for p in out[h] if "router" in p]  # only the proxy host runs it
    # knobs reach the command line
    unit = render.render(resolved("cache_aware", cache_threshold=0.7, balance_abs_threshold=8), copy.deepcopy(INV))[
        "lab1"
    ][UNIT].content
    assert "--cache-threshold 0.7 --balance-abs-threshold 8" in unit


def test_layout_has_the_router_part_and_its_ports():
    lay = build([resolved("cache_aware")], copy.deepcopy(INV))
    assert "router" in lay.hosts["lab1"].roles() and "router" not in lay.hosts["lab2"].roles()
    assert lay.hosts_with("router") == ["lab1"]
    from vllm_fleet.render.layout import _listen_ports

    ports = {
        lo: what for lo, _, what in _listen_ports(resolved("cache_aware"), lay.hosts["lab1"].parts["lab-tiny-routing"])
    }
    assert 8190 in ports and 8191 in ports and "router" in ports[8190]
    assert "router" not in build([resolved("session")], copy.deepcopy(INV)).hosts["lab1"].roles()


def test_auto_least_conn_for_one_replica_the_measured_best_for_more():
    one = {"lab1": {"address": "10.10.0.11", "groups": ["servers", "proxy"], "data": {}}}
    site = render.render(resolved("auto"), one)["lab1"][SITE].content
    assert "least_conn;" in site and "hash " not in site and UNIT not in render.render(resolved("auto"), one)["lab1"]
    many = render.render(resolved("auto"), copy.deepcopy(INV))
    assert (
        json.loads(many["client"]["~/.config/vllm-fleet/lab-tiny-routing/openai.json"].content)["routing"]["policy"]
        == AUTO_POLICY
    )


def test_balance_is_still_read():
    r = spec.resolve(spec.load(REPO / "deployments" / "lab-tiny-replicas.yaml"))
    assert r["proxy"]["routing"]["policy"] == "least_conn" and "balance" not in r["proxy"]
    raw = spec.load(REPO / "deployments" / "lab-tiny-replicas.yaml")
    raw.raw["proxy"]["balance"] = "round_robin"
    assert spec.resolve(raw)["proxy"]["routing"]["policy"] == "round_robin"


def test_session_client_settings_say_how_to_send_the_header():
    r = resolved("session")
    r["proxy"]["routing"]["session_header"] = "X-Conversation"
    out = render.render(r, copy.deepcopy(INV))
    doc = json.loads(out["client"]["~/.config/vllm-fleet/lab-tiny-routing/openai.json"].content)
    assert doc["routing"]["session_header"] == "X-Conversation" and "X-Conversation" in doc["routing"]["how"]
    env = out["client"]["~/.config/vllm-fleet/lab-tiny-routing/openai.env"].content
    assert "VLLM_FLEET_SESSION_HEADER=X-Conversation" in env and "default_headers" in env
    site = out["lab1"][SITE].content
    assert (
        "hash $http_x_conversation consistent;" in site
        and "proxy_pass http://$vllm_fleet_lab_tiny_routing_pool;" in site
    )


def test_router_scraped_and_on_the_dashboard():
    from vllm_fleet.render import monitoring

    r = resolved("cache_aware")
    r["monitoring"]["enabled"] = True
    inv = copy.deepcopy(INV)
    inv["lab1"]["groups"].append("monitoring")
    text = render.render(r, inv)["lab1"][monitoring.PROMETHEUS_CONFIG].content
    import yaml

    jobs = {j["job_name"]: j for j in yaml.safe_load(text)["scrape_configs"]}
    assert jobs["vllm-router"]["metrics_path"] == "/metrics/router"
    assert jobs["vllm-router"]["static_configs"][0]["targets"] == ["127.0.0.1"]
    exprs = " ".join(monitoring.dashboard_queries())
    assert "vllm_router_policy_decisions_total" in exprs and "vllm:prefix_cache_hits_total" in exprs


def test_counters_and_hit_rate():
    page = (
        'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 300.0\n'
        'vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 400.0\n'
        'vllm:request_success_total{finished_reason="length"} 7.0\nvllm:request_success_total{finished_reason="stop"} '
        '1.0\n'
    )
    assert multiturn.parse_counters(page) == {"hits": 300.0, "queries": 400.0, "requests": 8.0}
    d = multiturn.counter_delta(
        {"a:0": {"hits": 100, "queries": 200, "requests": 2}, "b:0": {"hits": 0, "queries": 0, "requests": 0}},
        {"a:0": {"hits": 300, "queries": 400, "requests": 8}, "b:0": {"hits": 50, "queries": 200, "requests": 4}},
    )
    assert d["per_replica"]["a:0"]["hit_rate"] == 1.0 and d["hit_rate"] == round(250 / 400, 4)
    assert d["requests_per_replica"] == {"a:0": 6, "b:0": 4}


def test_the_kv_caches_cpu_tier_is_counted_per_replica(tmp_path):
    """The CPU tier's work (issue 37): vLLM 0.20's offload bytes by transfer_type (its metric names,
    as measured on the H200) and the flat names of later releases, the external prefix-cache hits
    as a share of the prompt tokens beside the GPU's; the 0.32 page of tests/fixtures has the
    external counters at 0."""
    page = (
        'vllm:prefix_cache_hits_total{engine="0"} 100.0\nvllm:prefix_cache_queries_total{engine="0"} 1000.0\n'
        'vllm:external_prefix_cache_hits_total{engine="0"} 600.0\n'
        'vllm:external_prefix_cache_queries_total{engine="0"} 900.0\n'
        'vllm:kv_offload_total_bytes_total{engine="0",transfer_type="CPU_to_GPU"} 2147483648.0\n'
        'vllm:kv_offload_total_bytes_total{engine="0",transfer_type="GPU_to_CPU"} 4294967296.0\n'
        'vllm:kv_offload_total_time_total{engine="0",transfer_type="CPU_to_GPU"} 3.0\n'
    )
    c = multiturn.parse_counters(page)
    assert c == {
        "hits": 100.0,
        "queries": 1000.0,
        "ext_hits": 600.0,
        "ext_queries": 900.0,
        "legacy_load_bytes": 2 * 1024**3,
        "legacy_store_bytes": 4 * 1024**3,
    }
    d = multiturn.counter_delta({"a:0": {}}, {"a:0": c})
    assert (d["hit_rate"], d["tier_hit_rate"], d["total_hit_rate"]) == (0.1, 0.6, 0.7)
    assert d["per_replica"]["a:0"]["load_bytes"] == 2 * 1024**3 and d["store_bytes"] == 4 * 1024**3
    flat = multiturn.parse_counters(
        'vllm:kv_offload_load_bytes_total{engine="0"} 10.0\nvllm:kv_offload_store_bytes_total{engine="0"} 20.0\n' + page
    )
    assert multiturn.counter_delta({}, {"a:0": flat})["load_bytes"] == 10.0  # the flat name wins: no double count
    real = multiturn.parse_counters((Path(__file__).parent / "fixtures" / "vllm-metrics-0.32.0.txt").read_text())
    assert real["ext_hits"] == 0.0 and real["ext_queries"] == 0.0 and "hits" in real
    run = {
        "policy": "session",
        "result": multiturn.summarize(
            [{"ok": True, "ttft_s": 0.1, "e2e_s": 0.5, "completion_tokens": 8, "prompt_tokens": 100}], 1.0
        ),
        "counters": d,
    }
    row = multiturn.format_table([run]).splitlines()
    assert row[0].split()[:6] == ["policy", "hit", "rate", "CPU", "tier", "CPU->GPU"]
    assert row[2].split()[1:4] == ["0.100", "0.600", "2.0GiB"]
    files = multiturn.report({"runs": [run], "deployment": "x"}, tmp_path)  # the page and its plots
    html = (tmp_path / "routing.html").read_text()
    assert (
        "CPU-tier hit rate" in html
        and "CPU -&gt; GPU (GiB)" in html
        and "<td>0.6</td>" in html
        and "<td>2.0</td>" in html
    ), html[-3000:]
    assert files[0] == tmp_path / "routing.html"


# ---------------------------------------------------------------------------------------------
# A real nginx: the session policy


class _Replica(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        time.sleep(0.02)
        body = json.dumps({"port": self.server.server_address[1]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@needs_nginx
def test_session_keeps_a_conversation_on_one_replica_and_spreads_the_rest(tmp_path):
    r = resolved("session")
    r["proxy"]["auth"] = "none"
    base_port, listen = _free_port(), _free_port()
    r["server"]["port"] = base_port
    r["replicas"]["per_host"] = 3
    site = render.render(r)["proxy"][SITE].content
    ports = [int(p) for p in re.findall(r"server 127\.0\.0\.1:(\d+) ", site)]
    assert len(set(ports)) == 3
    servers = []
    for p in sorted(set(ports)):
        s = http.server.ThreadingHTTPServer(("127.0.0.1", p), _Replica)
        threading.Thread(target=s.serve_forever, daemon=True).start()
        servers.append(s)
    prefix = _nginx_prefix(tmp_path, site, None, port=listen)
    proc = subprocess.Popen(
        [NGINX, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-e", str(prefix / "logs/error.log")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:

        def ask(headers=None) -> int:
            for _ in range(100):
                try:
                    req = urllib.request.Request(
                        f"http://127.0.0.1:{listen}/v1/chat/completions",
                        data=b"{}",
                        headers={"Content-Type": "application/json", **(headers or {})},
                    )
                    with urllib.request.urlopen(req, timeout=5) as resp:
                        return json.loads(resp.read())["port"]
                except OSError:
                    assert proc.poll() is None, proc.stderr.read().decode()
                    time.sleep(0.05)
            raise AssertionError("nginx did not answer")

        for conv in ("a", "b", "c", "d"):
            assert len({ask({"X-Session-Id": conv}) for _ in range(6)}) == 1, conv  # sticky
        assert len({ask({"X-Session-Id": f"c{i}"}) for i in range(24)}) >= 2  # different conversations spread
        assert len({ask() for _ in range(9)}) >= 2  # no header: least_conn over all, not one hash bucket
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for s in servers:
            s.shutdown()


def test_prefix_counters_and_main_pids_are_read_on_the_host_through_the_transport(tmp_path, monkeypatch):
    """`bench --multi-turn` reads each replica's counters and vLLM PID on its host (here @local,
    pyinfra's local connector: the same transport as ssh): a /metrics stand-in on loopback, and
    a stand-in systemctl on PATH. Both readers were left calling an ssh helper that no longer
    existed (ImportError at the first policy)."""
    import os
    import sys
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from vllm_fleet.render.fleetview import FleetView, Replica
    from vllm_fleet.serving import multiturn

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = (
                '# HELP x\nvllm:prefix_cache_hits_total{model_name="tiny"} 30.0\n'
                'vllm:prefix_cache_queries_total{model_name="tiny"} 40.0\n'
                'vllm:request_success_total{finished_reason="stop",model_name="tiny"} 2.0\n'
                'vllm:request_success_total{finished_reason="length",model_name="tiny"} 3.0\n'
                'vllm:external_prefix_cache_hits_total{model_name="tiny"} 7.0\n'
                'vllm:kv_offload_total_bytes_total{model_name="tiny",transfer_type="CPU_to_GPU"} 1024.0\n'
                'vllm:kv_offload_total_bytes_total{model_name="tiny",transfer_type="GPU_to_CPU"} 4096.0\n'
            ).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "systemctl").write_text("#!/bin/sh\necho 4242\n")
    (bin_ / "systemctl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    try:
        rep = Replica(
            host="@local",
            index=0,
            address="127.0.0.1",
            unit="vllm-x-0.service",
            unit_path="/etc/systemd/system/vllm-x-0.service",
            port=srv.server_address[1],
            env_file="/etc/vllm-fleet/x/replica-0.env",
            files=(),
        )
        view = FleetView(replicas=[rep], proxies=[], proxy_listen=None, hosts={"@local": {"data": {}}})
        got = multiturn.prefix_counters(view, sys.executable)
        assert got == {
            "@local:0": {
                "hits": 30.0,
                "queries": 40.0,
                "requests": 5.0,
                "ext_hits": 7.0,
                "legacy_load_bytes": 1024.0,
                "legacy_store_bytes": 4096.0,
            }
        }, got
        assert multiturn.main_pids(view) == {"@local:0": "4242"}
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_policy_comparison_cut_short_keeps_the_runs_it_finished(tmp_path, monkeypatch, capsys):
    """`vllm-fleet bench --multi-turn --policies a,b` writes routing.json after every run: when the
    switch to the second policy fails (a deploy error, or the device call's time running out),
    the first policy's runs are on disk and the error names the file. On the H200 a whole
    comparison takes ~260 s of a device call's 600."""
    import argparse
    from types import SimpleNamespace

    from vllm_fleet.commands import bench

    view = SimpleNamespace(proxies=["lab1"], proxy_listen=80, hosts={"lab1": {"address": "10.10.0.11"}}, replicas=[])
    spec_file = REPO / "deployments" / "lab-tiny-routing.yaml"
    monkeypatch.setattr(multiturn, "load_fleet", lambda inv, s, data=(): (resolved(), None, view, "key"))
    monkeypatch.setattr(multiturn, "prefix_counters", lambda v, py: {})
    monkeypatch.setattr(multiturn.time, "sleep", lambda s: None)
    monkeypatch.setattr(
        multiturn,
        "run_workload",
        lambda *a, **k: multiturn.summarize(
            [{"ok": True, "ttft_s": 0.1, "e2e_s": 0.5, "completion_tokens": 8, "prompt_tokens": 100}], 1.0
        ),
    )

    def switch(inventory, path, policy, v, *, say, timeout, data=()):
        if policy == "cache_aware":
            raise RuntimeError("the deploy with routing cache_aware failed (rc 1)")
        return {"deploy_s": 1.0, "vllm_restarted": []}

    monkeypatch.setattr(multiturn, "switch_policy", switch)
    out = tmp_path / "cmp"
    cli = argparse.ArgumentParser()
    bench.add_cli(cli.add_subparsers())
    args = cli.parse_args(
        [
            "bench",
            "inventory/lab.py",
            "--spec",
            str(spec_file),
            "--multi-turn",
            "--policies",
            "session,cache_aware",
            "--system-prompt-len",
            "0,2000",
            "--out",
            str(out),
        ]
    )
    assert bench.cmd_multi_turn(args, str(spec_file)) == 1
    got = json.loads((out / "routing.json").read_text())
    assert got["complete"] is False
    assert [(r["policy"], r["workload_name"]) for r in got["runs"]] == [
        ("session", "private"),
        ("session", "shared-system-2000"),
    ]
    assert str(out / "routing.json") in capsys.readouterr().err
    # each invocation draws its own seed (recorded), so a second one meets no prompt of the first
    # in a warm cache; --seed repeats one
    assert got["seed"] == got["runs"][0]["seed"] - 1
    again = tmp_path / "again"
    bench.cmd_multi_turn(
        cli.parse_args(
            [
                "bench",
                "inventory/lab.py",
                "--spec",
                str(spec_file),
                "--multi-turn",
                "--policies",
                "session",
                "--out",
                str(again),
            ]
        ),
        str(spec_file),
    )
    second = json.loads((again / "routing.json").read_text())
    assert second["seed"] != got["seed"]
    repeat = tmp_path / "repeat"
    bench.cmd_multi_turn(
        cli.parse_args(
            [
                "bench",
                "inventory/lab.py",
                "--spec",
                str(spec_file),
                "--multi-turn",
                "--policies",
                "session",
                "--out",
                str(repeat),
                "--seed",
                str(got["seed"]),
            ]
        ),
        str(spec_file),
    )
    assert json.loads((repeat / "routing.json").read_text())["runs"][0]["seed"] == got["runs"][0]["seed"]
