"""Multi-node on the lab: one vLLM server across lab2 (Ray head, API, nginx) and lab3 (Ray worker),
pipeline parallel 2 over Ray, deployed with deploys/serve.py from deployments/lab-tiny-pp2.yaml
(inventory/lab.py with its groups pointed at lab2 and lab3: VLLM_FLEET_LAB_RAY_HEAD=lab2, ...).

Checked with independent readers (ssh + systemctl/ps/ray status/nc on the hosts, curl from the
control machine): smoke tests through nginx, the second stage's process on the worker, Ray's ports
closed from outside the cluster (lab1, and the control machine), and two faults: the worker's Ray
unit stopped (unhealthy within a bound, healthy again when it is back), the head started without
the worker (the cluster wait fails naming the missing node).

Not on lab1: lab1 runs the single-node deployment of test_deploy.py (vllm-lab-tiny-0.service,
nginx default server), which the modules before and after this one use. With lab1 as the head this
module had to set it aside and deploy lab-tiny again at its end (62 s of the CI run's teardown,
issue 35). Should the head run a lab-tiny of its own, it is set aside (stopped, its site removed)
and not put back: the tests that deploy lab-tiny to lab2 deploy it themselves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from labkit import REPO, LabHost
from test_deploy import why

pytestmark = pytest.mark.lab

SPEC = REPO / "deployments" / "lab-tiny-pp2.yaml"
PYINFRA = str(Path(sys.executable).parent / "pyinfra")
KEY_FILE = Path(os.path.expanduser("~/.config/vllm-fleet/lab-tiny-pp2.key"))
RAY_ENV = "RAY_TMPDIR=/var/lib/vllm-fleet/ray"
RAY_BIN = "/opt/vllm-fleet/lab-tiny-pp2/env/bin/ray"
UNHEALTHY_WITHIN = 60  # s after the worker's Ray unit stops
RECOVER_WITHIN = 420  # s after it is back (cluster wait + vLLM start on 2 shared cores)
RESULTS: dict[str, object] = {}
_LEFT = {"head_restarting": False}  # what a test left for the next one


#: inventory/lab.py's groups for this module: lab2 the head (server, proxy), lab3 the worker
GROUPS = {"SERVERS": "lab2", "PROXY": "lab2", "RAY_HEAD": "lab2", "MONITORING": "lab2", "RAY_WORKERS": "lab3"}


def deploy(spec: Path, timeout: float = 2400) -> subprocess.CompletedProcess:
    env = {**os.environ, "VLLM_FLEET_SPEC": str(spec), **{f"VLLM_FLEET_LAB_{g}": h for g, h in GROUPS.items()}}
    t0 = time.monotonic()
    r = subprocess.run(
        [PYINFRA, "-y", "inventory/lab.py", "deploys/serve.py"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    r.elapsed = time.monotonic() - t0  # type: ignore[attr-defined]
    r.out = r.stdout + r.stderr  # type: ignore[attr-defined]
    return r


def curl_code(url: str, *args: str) -> str:
    r = subprocess.run(
        ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "10", *args, url],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return r.stdout.strip()


def rss_mib(host: LabHost) -> int:
    out = host.ssh("ps -u vllm -o rss= | awk '{s+=$1} END {print s+0}'", user="root").stdout.strip()
    return int(out) // 1024


def ray_status(head: LabHost, address: str) -> str:
    return head.ssh(
        f"runuser -u vllm -- env {RAY_ENV} {RAY_BIN} status --address {address}:6379",
        user="root",
        check=False,
        timeout=120,
    ).stdout


@pytest.fixture(scope="module")
def cluster(three_hosts, tmp_path_factory):
    outside, head, worker = three_hosts[:3]
    assert (head.name, worker.name) == (GROUPS["RAY_HEAD"], GROUPS["RAY_WORKERS"])
    spec = yaml.safe_load(SPEC.read_text())
    subnet = head.address.rsplit(".", 1)[0]
    spec["parallel"]["head_address"] = head.address  # the lab's own subnet (a dev lab may differ)
    spec["proxy"]["metrics_allow"] = ["127.0.0.1", f"{subnet}.0/24"]
    path = tmp_path_factory.mktemp("pp2") / "lab-tiny-pp2.yaml"
    path.write_text(yaml.safe_dump(spec))
    # One deployment per host: a lab-tiny on the head is set aside (its nginx site claims the default
    # server, its vLLM the port the head's vLLM takes); see the module's docstring.
    head.ssh(
        "rm -f /etc/nginx/conf.d/vllm-fleet-lab-tiny.conf; systemctl disable --now vllm-lab-tiny-0.service",
        user="root",
        check=False,
    )
    fresh = worker.ssh("test -e /opt/vllm-fleet/lab-tiny-pp2/env/bin/ray", user="root", check=False).returncode != 0
    try:
        r = deploy(path)
        RESULTS["deploy_s" if not fresh else "bare_to_healthy_s"] = round(r.elapsed, 1)
        (REPO / ".pytest_cache").mkdir(exist_ok=True)
        (REPO / ".pytest_cache" / "deploy-multinode.log").write_text(r.out)
        assert r.returncode == 0, "deploy failed:\n" + why(r)
        RESULTS["rss_mib"] = {head.name: rss_mib(head), worker.name: rss_mib(worker)}
        yield {"head": head, "worker": worker, "outside": outside, "spec": path, "deploy": r}
    finally:
        # Teardown, also when the deploy above failed: the 2-node service off (later lab tests
        # deploy lab-tiny to lab2 and expect its site alone and port 8000 free).
        head.ssh(
            "systemctl disable --now vllm-lab-tiny-pp2-0.service ray-head.service vllm-fleet-ray-firewall.service; "
            # a unit that failed on its way down stays listed (`loaded failed`) until reset:
            # test_rollout's dropped-host test lists vllm-lab-tiny* units on lab2 and expects none
            "for u in vllm-lab-tiny-pp2-0 ray-head vllm-fleet-ray-firewall; do systemctl reset-failed $u.service; "
            "done; rm -f /etc/nginx/conf.d/vllm-fleet-lab-tiny-pp2.conf; systemctl reload nginx || true",
            user="root",
            check=False,
        )
        # Ray's worker, its head gone, took 57 s to stop (SIGKILL at its TimeoutStopSec=60): this is
        # the test's cleanup, not `down`, so it is killed first
        worker.ssh(
            "systemctl kill -s SIGKILL ray-worker.service; "
            "systemctl disable --now ray-worker.service vllm-fleet-ray-firewall.service; "
            "for u in ray-worker vllm-fleet-ray-firewall; do systemctl reset-failed $u.service; done",
            user="root",
            check=False,
        )
        (REPO / ".pytest_cache").mkdir(exist_ok=True)
        (REPO / ".pytest_cache" / "multinode-results.json").write_text(json.dumps(RESULTS, indent=2))
        print("\nmulti-node results:", RESULTS)


@pytest.fixture(autouse=True)
def _cluster_healthy(request):
    """A test after test_head_without_worker_times_out_naming_it first waits for the head it left
    starting (that test is the module's last: the fixture's teardown stops the cluster anyway, so
    the minute of the restart is waited only when a test needs it)."""
    if _LEFT["head_restarting"] and "cluster" in request.fixturenames:
        head = request.getfixturevalue("cluster")["head"]
        t0 = time.monotonic()
        while curl_code(f"http://{head.address}/health") != "200":
            assert time.monotonic() - t0 < RECOVER_WITHIN
            time.sleep(5)
        _LEFT["head_restarting"] = False
    yield


def test_smoke_through_nginx(cluster):
    out = cluster["deploy"].out
    for check in ("PASS  chat", "PASS  stream-done", "PASS  concurrent"):
        assert check in out, out[-4000:]
    head = cluster["head"]
    key = KEY_FILE.read_text().strip()
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    r = subprocess.run(
        [
            "curl",
            "-s",
            "--max-time",
            "120",
            "-H",
            f"Authorization: Bearer {key}",
            "-H",
            "Content-Type: application/json",
            "-d",
            body,
            f"http://{head.address}/v1/chat/completions",
        ],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert json.loads(r.stdout)["usage"]["completion_tokens"] > 0, r.stdout


def test_second_stage_runs_on_the_worker(cluster):
    head, worker = cluster["head"], cluster["worker"]
    # vLLM's Ray worker process on the worker holds the second half of the model (~1.7 GiB RSS here)
    ps = worker.ssh("ps -u vllm -o rss=,args=", user="root").stdout.splitlines()
    stage = [line for line in ps if "RayWorkerProc" in line]
    assert stage and int(stage[0].split()[0]) > 500 * 1024, ps
    assert "vllm.entrypoints" not in "\n".join(ps)  # the API server runs on the head only
    status = ray_status(head, head.address)
    assert "2.0/2.0 GPU" in status, status  # both nodes' slots held by vLLM's placement group
    assert worker.ssh("systemctl is-active ray-worker.service", user="root").stdout.strip() == "active"
    env = worker.ssh("cat /etc/vllm-fleet/lab-tiny-pp2/node.env", user="root").stdout
    assert f"VLLM_HOST_IP={worker.address}" in env and "GLOO_SOCKET_IFNAME=host0" in env


def test_ray_ports_closed_outside_the_cluster(cluster):
    head, worker, outside = cluster["head"], cluster["worker"], cluster["outside"]
    probe = "timeout 5 bash -c '</dev/tcp/{}/{}' && echo open || echo closed"
    for port in (6379, 6380):
        assert worker.ssh(probe.format(head.address, port), check=False).stdout.strip() == "open", port
        assert outside.ssh(probe.format(head.address, port), check=False).stdout.strip() == "closed", port
    r = subprocess.run(["bash", "-c", probe.format(head.address, 6379)], capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() == "closed"  # the control machine is outside the cluster too
    assert "closed" == outside.ssh(probe.format(worker.address, 6380), check=False).stdout.strip()
    # nginx (port 80) is not a Ray port: still reachable from outside
    assert (
        outside.ssh(
            f"curl -s -o /dev/null -w '%{{http_code}}' --max-time 5 http://{head.address}/health", check=False
        ).stdout.strip()
        == "200"
    )


def test_second_deploy_changes_nothing(cluster):
    r = deploy(cluster["spec"])
    assert r.returncode == 0, why(r)
    import re

    m = re.search(r"Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", r.out)
    assert m and m.group(2) == "-" and m.group(3) == "-", r.out[-5000:]
    RESULTS["warm_deploy_s"] = round(r.elapsed, 1)


def test_worker_down_unhealthy_then_recovers(cluster):
    head, worker = cluster["head"], cluster["worker"]
    url = f"http://{head.address}/health"
    assert curl_code(url) == "200"
    worker.ssh("systemctl stop ray-worker.service", user="root")
    t0 = time.monotonic()
    try:
        while curl_code(url) == "200":
            assert time.monotonic() - t0 < UNHEALTHY_WITHIN, "still healthy with the worker's Ray node gone"
            time.sleep(2)
        RESULTS["unhealthy_after_s"] = round(time.monotonic() - t0, 1)
    finally:
        worker.ssh("systemctl start ray-worker.service", user="root")
    t1 = time.monotonic()
    while curl_code(url) != "200":
        assert time.monotonic() - t1 < RECOVER_WITHIN, head.ssh(
            "journalctl -u vllm -n 30 --no-pager -o cat", user="root"
        ).stdout
        time.sleep(5)
    RESULTS["recovered_after_s"] = round(time.monotonic() - t1, 1)


def test_head_without_worker_times_out_naming_it(cluster):
    head, worker = cluster["head"], cluster["worker"]
    drop_in = "/run/systemd/system/vllm-lab-tiny-pp2-0.service.d/zz-test-short-wait.conf"
    worker.ssh("systemctl stop ray-worker.service", user="root")
    try:
        # The unit's own ExecStartPre with a 30 s deadline instead of 600 s (a runtime drop-in).
        pre = head.ssh("systemctl show -p ExecStartPre --value vllm-lab-tiny-pp2-0.service", user="root").stdout
        argv = pre.split("argv[]=", 1)[1].split(";", 1)[0].strip()
        assert "--timeout 600" in argv
        short = argv.replace("--timeout 600", "--timeout 30")
        head.ssh(
            f"mkdir -p {os.path.dirname(drop_in)} && printf '[Service]\\nExecStartPre=\\nExecStartPre={short}\\n"
            f"Restart=no\\n' > {drop_in} && systemctl daemon-reload && systemctl restart ray-head.service",
            user="root",
        )
        head.ssh("systemctl start vllm-lab-tiny-pp2-0.service", user="root", check=False, timeout=240)
        state = head.ssh("systemctl is-active vllm-lab-tiny-pp2-0.service", user="root", check=False).stdout.strip()
        log = head.ssh("journalctl -u vllm-lab-tiny-pp2-0.service -n 40 --no-pager -o cat", user="root").stdout
        assert state != "active", log
        assert "timed out after 30 s" in log and f"missing node(s): {worker.address}" in log, log
    finally:
        head.ssh(
            f"rm -f {drop_in} && systemctl daemon-reload && systemctl reset-failed vllm-lab-tiny-pp2-0.service || true",
            user="root",
        )
        worker.ssh("systemctl start ray-worker.service", user="root")
        head.ssh("systemctl start --no-block vllm-lab-tiny-pp2-0.service", user="root")
        _LEFT["head_restarting"] = True  # a later test waits for it (_cluster_healthy)
