"""vllm_fleet/roles/rollout and the service role's API firewall through the operations they would run
(scripted facts, no host)."""

from __future__ import annotations

from pathlib import Path

from pyinfra.facts.files import File

from vllm_fleet.roles.rollout import drain, smoke_replica, upstream
from vllm_fleet.roles.service import api_firewall
from vllm_fleet.render import files as render
from vllm_fleet.specs.load import load, resolve
from vllm_fleet.render.files import deployment_paths

REPO = Path(__file__).resolve().parents[2]


def _spec(host: str = "0.0.0.0") -> dict:
    s = resolve(load(REPO / "deployments" / "lab-tiny-replicas.yaml"))
    s["server"]["host"] = host
    return s


def _fleet(data=None) -> dict:
    return {
        "lab1": {"address": "10.10.0.11", "groups": ["proxy"], "data": {}},
        "testhost": {"address": "10.10.0.12", "groups": ["servers"], "data": dict(data or {})},
    }


def test_api_firewall_when_listening_beyond_loopback(harness):
    rendered = render.render(_spec(), _fleet({"vllm_api_firewall_allow": ["10.10.0.50"]}))["testhost"]
    run = harness.run(api_firewall, rendered, facts={})
    rules = run.uploads["/etc/vllm-fleet/api-firewall.nft"]
    assert "elements = { 10.10.0.11, 10.10.0.50 }" in rules and "tcp dport { 8000 } drop" in rules
    assert "/etc/systemd/system/vllm-fleet-api-firewall.service" in run.uploads
    assert run.op("load the rules").conditional and run.has_op("active and enabled")


def test_no_api_firewall_on_loopback_or_when_off(harness):
    spec = _spec("127.0.0.1")
    spec["proxy"]["enabled"] = False  # loopback only, nothing in front
    assert not harness.run(api_firewall, render.render(spec, _fleet())["testhost"], facts={}).ops
    assert not harness.run(
        api_firewall, render.render(_spec(), _fleet({"vllm_api_firewall": False}))["testhost"], facts={}
    ).ops


def test_upstream_puts_the_site_and_reloads_only_on_change(harness):
    spec = _spec()
    inv = {
        "testhost": {"address": "10.10.0.11", "groups": ["servers", "proxy"], "data": {}},
        "lab2": {"address": "10.10.0.12", "groups": ["servers"], "data": {"upstream_down": True}},
    }
    rendered = render.render(spec, inv)["testhost"]
    run = harness.run(upstream, spec, deployment_paths(spec), rendered, 30, facts={File: None})
    site = run.uploads["/etc/nginx/conf.d/vllm-fleet-lab-tiny-replicas.conf"]
    assert "server 10.10.0.12:8000 max_fails=2 fail_timeout=10s down;" in site
    op = run.op("reload, wait for the old workers")
    assert op.conditional and op.commands == ["python:_reload_and_wait"]
    # a host without this deployment's site (a replica that is no proxy) gets nothing
    assert not harness.run(upstream, spec, deployment_paths(spec), render.render(spec, inv)["lab2"], 30, facts={}).ops


def test_drain_and_smoke_are_checks_on_the_host(harness):
    assert harness.run(drain, _spec(), 30, facts={}).commands == ["python:_wait_idle"]
    assert harness.run(smoke_replica, _spec(), deployment_paths(_spec()), facts={}).commands == ["python:_smoke"]
