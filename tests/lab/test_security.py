"""Security on the lab, read by independent tools: systemd-analyze on the host, curl from the
control machine and from another lab host.

Already covered in test_deploy.py (not repeated here): the API key in no argv/unit/journal/
world-readable file; the proxy refusing requests without the key; vLLM's port closed to other
hosts. Measured numbers go to .pytest_cache/security.json (docs/hardening.md records them).
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from labkit import REPO
from test_deploy import SPEC, api_key, changed_ops, curl, deploy, grand_total, why

pytestmark = pytest.mark.lab

RESULTS: dict[str, object] = {}
# systemd 252 (Debian 12) scale 0 (safe) .. 10 (unsafe). 9.6 is an unsandboxed service; this
# unit measured 6.5 (MEDIUM) before the hardening of issue 7 and 1.8 (OK) after (docs/hardening.md).
EXPOSURE_MAX = 2.5


@pytest.fixture(scope="module", autouse=True)
def _results():
    yield
    (REPO / ".pytest_cache").mkdir(exist_ok=True)
    (REPO / ".pytest_cache" / "security.json").write_text(json.dumps(RESULTS, indent=2))
    print("\nsecurity:", RESULTS)


@pytest.fixture(scope="module")
def server(lab_hosts):
    r = deploy()
    assert r.returncode == 0, why(r)
    return lab_hosts[0]


def test_vllm_unit_exposure_score(server):
    out = server.ssh("systemd-analyze security --no-pager vllm-lab-tiny-0.service", user="root").stdout
    m = re.search(r"Overall exposure level for vllm-lab-tiny-0\.service: ([0-9.]+) (\w+)", out)
    assert m, out[-2000:]
    RESULTS["exposure"] = float(m.group(1))
    RESULTS["exposure_level"] = m.group(2)
    RESULTS["exposure_failing"] = [line.split()[1] for line in out.splitlines() if line.startswith("\u2717")]
    assert float(m.group(1)) <= EXPOSURE_MAX, out
    # ... and vLLM still serves with that sandbox (through the proxy, with the key)
    r = curl("-H", f"Authorization: Bearer {api_key()}", f"http://{server.address}/v1/models")
    assert [m["id"] for m in json.loads(r.stdout)["data"]] == ["tiny"]


def test_vllm_runs_unprivileged(server):
    pid = server.ssh("systemctl show -p MainPID --value vllm-lab-tiny-0.service", user="root").stdout.strip()
    status = server.ssh(f"grep -E '^(Uid|CapEff|NoNewPrivs):' /proc/{pid}/status", user="root").stdout
    uid = re.search(r"Uid:\s+(\d+)", status).group(1)
    assert uid != "0"
    assert re.search(r"CapEff:\s+0+\s", status + "\n"), status
    assert re.search(r"NoNewPrivs:\s+1", status), status


@pytest.fixture(scope="module")
def locked_proxy(server, tmp_path_factory):
    """lab1 deployed with a spec variant: /metrics only from the host itself, TLS self-signed on
    443. Restores deployments/lab-tiny.yaml afterwards."""
    spec = yaml.safe_load(SPEC.read_text())
    spec["proxy"]["metrics_allow"] = ["127.0.0.1"]
    spec["proxy"]["listen"] = 443
    spec["proxy"]["tls"] = {"enabled": True, "self_signed": True}
    f = tmp_path_factory.mktemp("spec") / "lab-tiny.yaml"
    f.write_text(yaml.safe_dump(spec))
    r = deploy(f)
    try:
        assert r.returncode == 0, why(r)
        yield server, r, f
    finally:
        back = deploy()
        assert back.returncode == 0, why(back)


def code(*args: str) -> str:
    return curl("-o", "/dev/null", "-w", "%{http_code}", *args).stdout


def test_tls_self_signed_serves_with_the_key(locked_proxy):
    server, r, _ = locked_proxy
    base = f"https://{server.address}"
    assert "PASS  chat" in r.out  # the deploy's own smoke tests went through TLS
    assert code("-k", "-H", f"Authorization: Bearer {api_key()}", f"{base}/v1/models") == "200"
    assert code("-k", f"{base}/v1/models") == "401"
    # the certificate is really one: without -k curl refuses it as self-signed (not a plain-HTTP port)
    v = curl("-o", "/dev/null", "-w", "%{ssl_verify_result}", f"{base}/health")
    assert v.returncode == 60, (v.returncode, v.stderr)
    cert = server.ssh(
        "echo | openssl s_client -connect 127.0.0.1:443 2>/dev/null | openssl x509 -noout -subject 2>/dev/null || true",
        user="root",
    ).stdout
    RESULTS["tls_subject"] = cert.strip()
    # nothing answers plain HTTP on the old port any more
    assert code("--max-time", "5", f"http://{server.address}/v1/models") == "000"


def test_tls_redeploy_is_two_remote_commands(locked_proxy):
    """A re-deploy with the self-signed certificate in place changes nothing and sends lab1 two
    commands (pyinfra -vv lists each): the sudo check and the one state read, which also says the
    certificate is there (no fact of its own)."""
    server, _, spec = locked_proxy
    r = deploy(spec, 600, "-vv")
    assert r.returncode == 0, why(r)
    total = grand_total(r.out)
    assert total["changed"] == "-" and total["error"] == "-", (changed_ops(r.out), total)
    sent = re.findall(rf"^\s*\[{server.name}\] >>> .*", r.out, re.M)
    RESULTS["tls_noop_commands"] = len(sent)
    assert len(sent) == 2, "\n".join(s[:200] for s in sent)


def test_metrics_only_from_the_allowed_addresses(locked_proxy, lab_hosts):
    server, _, _ = locked_proxy
    other = lab_hosts[1]
    outside = other.ssh(
        f"curl -sk -o /dev/null -w '%{{http_code}}' --max-time 10 https://{server.address}/metrics", check=False
    ).stdout.strip()
    control = code("-k", f"https://{server.address}/metrics")
    inside = server.ssh(
        "curl -sk -o /dev/null -w '%{http_code}' --max-time 10 https://127.0.0.1/metrics", user="root"
    ).stdout.strip()
    body = server.ssh("curl -sk --max-time 10 https://127.0.0.1/metrics", user="root").stdout
    RESULTS["metrics"] = {"other_host": outside, "control_machine": control, "loopback": inside}
    assert outside == "403" and control == "403"
    assert inside == "200" and "vllm:" in body
