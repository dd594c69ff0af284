"""Three replicas behind one nginx, and rolling updates under load, on the lab.

The fleet: deployments/lab-tiny-replicas.yaml on lab1..lab3 (VLLM_FLEET_LAB_SERVERS), nginx on
lab1, deployed with deploys/serve.py. The test spec is named `lab-tiny` so that lab1 keeps the
env, model and nginx site test_deploy.py left (the same paths), and lab2/lab3 get lab1's
installed env copied over ssh (`tar`, the same path) instead of a 3 GB pip install each: the
install itself is tested by test_deploy.py; here the deploy finds vLLM in place.

While `vllm-fleet rollout` changes every replica (engine.max_num_seqs 16 -> 12), a bounded load
generator (vllm_fleet.loadgen: 2 threads, plain and streamed chats through nginx) must see no
failed request, and every replica's running vLLM must show the new flag (its main process's
command line, read over ssh). A broken update (an unknown vLLM flag in engine.extra_args: the
spec is valid, vLLM refuses to start) must stop after the first batch with lab1 left out of the
upstream (nginx's config on lab1, read over ssh), lab2/lab3 still on the good configuration and
the load still served; the next rollout with the good spec updates lab1 first and puts it back.

Teardown (also when the setup failed): vLLM and the API firewall stopped and disabled on lab2 and
lab3, lab1's API firewall off, and deployments/lab-tiny.yaml deployed again on lab1 alone (its
nginx site is the only one, vLLM back on loopback), as later lab tests expect.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from labkit import REPO, LabHost

pytestmark = pytest.mark.lab

BASE = REPO / "deployments" / "lab-tiny-replicas.yaml"
SINGLE = REPO / "deployments" / "lab-tiny.yaml"
PYINFRA = str(Path(sys.executable).parent / "pyinfra")
ENV_DIR = "/opt/vllm-fleet/lab-tiny/env"
SITE = "/etc/nginx/conf.d/vllm-fleet-lab-tiny.conf"
KEY_FILE = Path(os.path.expanduser("~/.config/vllm-fleet/lab-tiny.key"))
STATE_FILE = Path(os.path.expanduser("~/.cache/vllm-fleet/rollout/lab-tiny.json"))
SERVERS = "lab1,lab2,lab3"
RESULTS: dict[str, object] = {}


def run(argv: list[str], env: dict | None = None, timeout: float = 1800) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    r = subprocess.run(argv, cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                       timeout=timeout, stdin=subprocess.DEVNULL)
    r.elapsed = time.monotonic() - t0  # type: ignore[attr-defined]
    r.out = r.stdout + r.stderr  # type: ignore[attr-defined]
    return r


def deploy(spec: Path, servers: str | None = SERVERS) -> subprocess.CompletedProcess:
    env = {"VLLM_FLEET_SPEC": str(spec)}
    if servers:
        env["VLLM_FLEET_LAB_SERVERS"] = servers
    return run([PYINFRA, "-y", "inventory/lab.py", "deploys/serve.py"], env)


def rollout(spec: Path) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "vllm_fleet", "rollout", "inventory/lab.py", "--spec", str(spec)],
               {"VLLM_FLEET_LAB_SERVERS": SERVERS})


def cmdline(host: LabHost) -> str:
    """The running vLLM's command line (its main process), or '' when it is not running."""
    return host.ssh("pid=$(systemctl show -p MainPID --value vllm.service); "
                    "[ \"$pid\" != 0 ] && tr '\\0' ' ' < /proc/$pid/cmdline || true", user="root").stdout


def write_spec(path: Path, subnet: str, **engine) -> Path:
    spec = yaml.safe_load(BASE.read_text())
    spec["name"] = "lab-tiny"  # lab1's env, model and site from test_deploy.py; see the docstring
    spec["server"]["api_key"] = {"file": str(KEY_FILE), "generate": True}
    spec["proxy"]["metrics_allow"] = ["127.0.0.1", subnet]
    spec["engine"].update(engine)
    # vLLM's CPU build starts in 30-100 s alone; on a 2-core host shared with other vLLMs under
    # load a start took over 300 s here: give the update room (a crash still fails at once).
    spec["rollout"]["health_timeout"] = 900
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def fleet(three_hosts, tmp_path_factory):
    hosts = three_hosts
    tmp = tmp_path_factory.mktemp("rollout")
    subnet = hosts[0].address.rsplit(".", 1)[0] + ".0/24"  # the lab's own subnet (a dev lab may differ)
    specs = {"base": write_spec(tmp / "base.yaml", subnet),
             "new": write_spec(tmp / "new.yaml", subnet, max_num_seqs=12),
             "broken": write_spec(tmp / "broken.yaml", subnet, max_num_seqs=12, extra_args=["--no-such-vllm-flag"])}
    STATE_FILE.unlink(missing_ok=True)
    lab1 = hosts[0]
    try:
        if lab1.ssh(f"test -x {ENV_DIR}/bin/python", user="root", check=False).returncode != 0:
            r = deploy(SINGLE, servers=None)  # lab1 alone first (test_deploy.py does this in a full run)
            assert r.returncode == 0, r.out[-5000:]
        for h in hosts[1:]:
            if h.ssh(f"test -x {ENV_DIR}/bin/python", user="root", check=False).returncode == 0:
                continue
            t0 = time.monotonic()
            src = subprocess.Popen([*lab1.ssh_argv("root"), f"tar -C / -cf - {ENV_DIR.lstrip('/')}"], stdout=subprocess.PIPE)
            dst = subprocess.run([*h.ssh_argv("root"), "tar -C / -xf -"], stdin=src.stdout, capture_output=True, timeout=900)
            src.stdout.close()
            assert src.wait(timeout=60) == 0 and dst.returncode == 0, dst.stderr
            RESULTS[f"env_copy_{h.name}_s"] = round(time.monotonic() - t0, 1)
        r = deploy(specs["base"])
        (REPO / ".pytest_cache").mkdir(exist_ok=True)
        (REPO / ".pytest_cache" / "deploy-replicas.log").write_text(r.out)
        RESULTS["deploy_3_replicas_s"] = round(r.elapsed, 1)
        assert r.returncode == 0, r.out[-6000:]
        yield {"hosts": hosts, "specs": specs, "deploy": r}
    finally:
        for h in hosts[1:]:
            h.ssh("systemctl disable --now vllm.service vllm-fleet-api-firewall.service", user="root", check=False)
        lab1.ssh("systemctl disable --now vllm-fleet-api-firewall.service; rm -f /etc/systemd/system/vllm-fleet-api-firewall.service "
                 "/etc/vllm-fleet/api-firewall.nft; systemctl daemon-reload", user="root", check=False)
        STATE_FILE.unlink(missing_ok=True)
        (REPO / ".pytest_cache").mkdir(exist_ok=True)
        (REPO / ".pytest_cache" / "rollout-results.json").write_text(json.dumps(RESULTS, indent=2))
        print("\nrollout results:", json.dumps(RESULTS))
        back = deploy(SINGLE, servers=None)
        assert back.returncode == 0, back.out[-4000:]


@pytest.fixture()
def load(fleet):
    from vllm_fleet.loadgen import LoadGen

    # Continuous but bounded: 2 threads, at most 1 request a second in all. The lab's hosts share
    # the machine's 2 cores; with vLLM's auto-binding (every replica's worker on core 0, where a
    # serving worker spins 1 s after each request) a replica restart under 4 requests/s took
    # 430-445 s, under 1/s 213-526 s. lab-tiny-replicas.yaml now runs the workers unbound with one
    # OpenMP thread: 41-53 s per replica (docs/rollout.md).
    gen = LoadGen(f"http://{fleet['hosts'][0].address}", "tiny", KEY_FILE.read_text().strip(), concurrency=2,
                  max_tokens=16, rate=1, timeout=120)
    yield gen
    if not gen._stop.is_set():
        gen.stop()


def test_every_replica_serves_and_only_the_proxy_reaches_them(fleet):
    lab1, lab2, lab3 = fleet["hosts"]
    site = lab1.ssh(f"cat {SITE}", user="root").stdout
    assert "least_conn;" in site and " down" not in site
    for h in (lab2, lab3):
        assert f"server {h.address}:8000 max_fails=2 fail_timeout=10s;" in site
        # the proxy host reaches the replica; another replica and the control machine do not
        code = lab1.ssh(f"curl -s -o /dev/null -w '%{{http_code}}' --max-time 5 http://{h.address}:8000/health", check=False)
        assert code.stdout.strip() == "200", code
    probe = "timeout 5 bash -c '</dev/tcp/{}/8000' && echo open || echo closed"
    assert lab3.ssh(probe.format(lab2.address), check=False).stdout.strip() == "closed"
    r = subprocess.run(["bash", "-c", probe.format(lab3.address)], capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() == "closed"
    for h in (lab1, lab2, lab3):
        assert "--max-num-seqs 16" in cmdline(h), h.name


def test_second_deploy_changes_nothing(fleet):
    r = deploy(fleet["specs"]["base"])
    assert r.returncode == 0, r.out[-4000:]
    m = re.search(r"Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", r.out)
    assert m and m.group(2) == "-" and m.group(3) == "-", r.out[-5000:]
    RESULTS["noop_deploy_3_replicas_s"] = round(r.elapsed, 1)


def test_rollout_under_load_fails_no_request(fleet, load):
    hosts = fleet["hosts"]
    load.start()
    time.sleep(5)
    r = rollout(fleet["specs"]["new"])
    time.sleep(3)
    st = load.stop()
    RESULTS["rollout"] = {"seconds": round(r.elapsed, 1), "requests": st.as_dict()}
    (REPO / ".pytest_cache" / "rollout-ok.log").write_text(r.out)
    assert r.returncode == 0, r.out[-6000:]
    assert "batch 1/3 (lab1)" in r.out and "batch 3/3 (lab3)" in r.out
    assert st.failed == 0, st.summary()
    assert st.ok >= 30 and st.streamed >= 10, st.summary()
    print("\nload during the rollout:", st.summary())
    for h in hosts:
        assert "--max-num-seqs 12" in cmdline(h), h.name
    assert " down" not in hosts[0].ssh(f"cat {SITE}", user="root").stdout


def test_broken_update_stops_after_the_first_batch(fleet, load):
    lab1, lab2, lab3 = fleet["hosts"]
    load.start()
    time.sleep(3)
    r = rollout(fleet["specs"]["broken"])
    time.sleep(3)
    during = load.stats()
    (REPO / ".pytest_cache" / "rollout-broken.log").write_text(r.out)
    RESULTS["broken_rollout"] = {"seconds": round(r.elapsed, 1), "requests": during.as_dict()}
    assert r.returncode == 1, r.out[-6000:]
    assert "batch 1/3 (lab1) FAILED" in r.out and "lab1: left OUT of the nginx upstream" in r.out, r.out[-4000:]
    assert "batch 2/3" not in r.out
    site = lab1.ssh(f"cat {SITE}", user="root").stdout
    assert "server 127.0.0.1:8000 max_fails=2 fail_timeout=10s down;" in site
    assert f"server {lab2.address}:8000 max_fails=2 fail_timeout=10s;" in site
    for h in (lab2, lab3):  # untouched, still the good configuration
        line = cmdline(h)
        assert "--max-num-seqs 12" in line and "--no-such-vllm-flag" not in line, h.name
    assert during.failed == 0, during.summary()
    assert during.ok >= 5, during.summary()

    # the good spec again: lab1 (left out) first, then the others (nothing to change there);
    # without load: the rollout under load is proven above, this is about the way back in
    load.stop()
    r = rollout(fleet["specs"]["new"])
    (REPO / ".pytest_cache" / "rollout-restore.log").write_text(r.out)
    RESULTS["restore_rollout"] = {"seconds": round(r.elapsed, 1)}
    assert r.returncode == 0, r.out[-6000:]
    assert "batch 1/3 (lab1)" in r.out
    assert " down" not in lab1.ssh(f"cat {SITE}", user="root").stdout
    line = cmdline(lab1)
    assert "--max-num-seqs 12" in line and "--no-such-vllm-flag" not in line
