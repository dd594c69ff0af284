"""Replicas and deployments from one per-host layout, and rolling updates under load, on the lab.

The fleet (issue 14's lab proof): deployments/lab-tiny-replicas.yaml with two replicas on lab1
(host data replicas_per_host: 2, units vllm-lab-tiny-0/-1.service on ports 8000/8001, each bound
to its own core) and one on lab2, nginx on lab1 in front of all three, deployed with
deploys/serve.py from an inventory built from the lab's hosts. The spec is named `lab-tiny` so
that lab1 keeps the env, model and nginx site test_deploy.py left (the same paths), and lab2 gets
lab1's installed env copied over ssh (`tar`, the same path) instead of a 3 GB pip install.

(d) Before that deploy lab1 runs what the previous release deployed: one `vllm.service`
    (tests/lab/fixtures/legacy-vllm.service, that release's rendered unit) on port 8000. The
    deploy must stop, disable and remove it (no port clash, no leftover unit).
(a) Requests through nginx reach all three instances: each one's own /metrics counter
    (vllm:request_success_total, read on its host with curl) moves; the two on lab1 run with
    their own VLLM_CPU_OMP_THREADS_BIND (read from their processes' environment).
(c) `vllm-fleet rollout` in instance batches (lab1:0, lab1:1, lab2:0) under a bounded load:
    no failed request, every instance's running vLLM has the new flag. A broken update stops
    after its first batch with that instance (only) out of the upstream.
(b) Two deployments on lab1 behind its one nginx: lab-tiny (port 80) and lab-tiny-b (served
    name tiny-b, port 8081, the same env), each passing the deploy's smoke tests and answering
    with its own model through nginx. This deploy also puts lab1 back to lab-tiny alone on
    loopback (as later lab tests expect); lab-tiny-b and lab2's instance are removed at the end.

This module replaces the earlier three-hosts-one-replica-each rollout test (same lab time budget:
one multi-replica deploy, one rollout under load, one broken rollout and its repair).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from labkit import REPO, LabHost, copy_tree, run
from test_deploy import changed_ops, curl, grand_total

pytestmark = pytest.mark.lab

BASE = REPO / "deployments" / "lab-tiny-replicas.yaml"
SINGLE = REPO / "deployments" / "lab-tiny.yaml"
LEGACY_UNIT = Path(__file__).resolve().parent / "fixtures" / "legacy-vllm.service"
PYINFRA = str(Path(sys.executable).parent / "pyinfra")
ENV_DIR = "/opt/vllm-fleet/lab-tiny/env"
SITE = "/etc/nginx/conf.d/vllm-fleet-lab-tiny.conf"
KEY_FILE = Path(os.path.expanduser("~/.config/vllm-fleet/lab-tiny.key"))
KEY_B = Path(os.path.expanduser("~/.config/vllm-fleet/lab-tiny-b.key"))
STATE_FILE = Path(os.path.expanduser("~/.cache/vllm-fleet/rollout/lab-tiny.json"))
RESULTS: dict[str, object] = {}
UNIT0, UNIT1 = "vllm-lab-tiny-0.service", "vllm-lab-tiny-1.service"


def inventory(tmp: Path, name: str, body: str) -> Path:
    """An inventory from the lab's hosts (the same host data inventory/lab.py gives)."""
    f = tmp / name
    f.write_text(
        f"import sys\nsys.path.insert(0, {str(REPO)!r})\n"
        "from vllm_fleet.lab.inventory import lab_hosts\n"
        "_hosts, _ = lab_hosts()\n_by = {n: d for n, d in _hosts}\n" + body
    )
    return f


def deploy(inv: Path | str, *specs: Path) -> subprocess.CompletedProcess:
    return run(
        [PYINFRA, "-y", str(inv), "deploys/serve.py"], {"VLLM_FLEET_SPEC": os.pathsep.join(str(s) for s in specs)}
    )


def rollout(inv: Path, spec: Path) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "vllm_fleet", "rollout", str(inv), "--spec", str(spec)])


def main_pid(host: LabHost, unit: str) -> str:
    return host.ssh(f"systemctl show -p MainPID --value {unit}", user="root").stdout.strip()


def cmdline(host: LabHost, unit: str) -> str:
    """The running vLLM's command line (its main process), or '' when it is not running."""
    return host.ssh(
        f"pid=$(systemctl show -p MainPID --value {unit}); "
        "[ \"$pid\" != 0 ] && tr '\\0' ' ' < /proc/$pid/cmdline || true",
        user="root",
    ).stdout


def proc_env(host: LabHost, unit: str) -> dict[str, str]:
    out = host.ssh(f"tr '\\0' '\\n' < /proc/$(systemctl show -p MainPID --value {unit})/environ", user="root").stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def served(host: LabHost, port: int) -> float:
    """Successful requests vLLM on host:port has served (its own /metrics, read on the host)."""
    text = host.ssh(f"curl -s --max-time 10 http://127.0.0.1:{port}/metrics", user="root").stdout
    return sum(float(m.group(1)) for m in re.finditer(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


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


def wait_health(host: LabHost, port: int, deadline: float = 600) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline:
        code = host.ssh(
            f"curl -s -o /dev/null -w '%{{http_code}}' --max-time 5 http://127.0.0.1:{port}/health", check=False
        )
        if code.stdout.strip() == "200":
            return
        time.sleep(3)
    raise AssertionError(f"{host.name}:{port} not healthy after {deadline} s")


@pytest.fixture(scope="module")
def fleet(lab_hosts, tmp_path_factory):
    lab1, lab2 = lab_hosts[:2]
    tmp = tmp_path_factory.mktemp("replicas")
    subnet = lab1.address.rsplit(".", 1)[0] + ".0/24"  # the lab's own subnet (a dev lab may differ)
    specs = {
        "base": write_spec(tmp / "base.yaml", subnet),
        "new": write_spec(tmp / "new.yaml", subnet, max_num_seqs=12),
        "broken": write_spec(tmp / "broken.yaml", subnet, max_num_seqs=12, extra_args=["--no-such-vllm-flag"]),
    }
    inv = inventory(
        tmp,
        "fleet.py",
        "servers = [('lab1', {**_by['lab1'], 'replicas_per_host': 2}), ('lab2', _by['lab2'])]\n"
        "proxy = [('lab1', _by['lab1'])]\n",
    )
    lab1_only = inventory(tmp, "lab1.py", "servers = [('lab1', _by['lab1'])]\nproxy = servers\n")
    STATE_FILE.unlink(missing_ok=True)
    try:
        # lab1 alone first: a no-op after test_deploy.py, and it puts back the config files the
        # legacy unit below reads (test_own_servers.py's `down` removes them but keeps the env)
        r = deploy(lab1_only, SINGLE)
        assert r.returncode == 0, r.out[-5000:]
        # (d) what the previous release left on lab1: one vllm.service serving port 8000
        t0 = time.monotonic()
        lab1.ssh(
            "for u in $(cd /etc/systemd/system && ls vllm-lab-tiny-*.service 2>/dev/null); do "
            "systemctl disable --now $u; rm -f /etc/systemd/system/$u; done",
            user="root",
        )
        subprocess.run(
            [*lab1.ssh_argv("root"), "cat > /etc/systemd/system/vllm.service"],
            input=LEGACY_UNIT.read_text(),
            text=True,
            check=True,
            timeout=60,
        )
        lab1.ssh("systemctl daemon-reload && systemctl enable --now vllm.service", user="root")
        wait_health(lab1, 8000)
        RESULTS["legacy_unit_up_s"] = round(time.monotonic() - t0, 1)
        if lab2.ssh(f"test -x {ENV_DIR}/bin/python", user="root", check=False).returncode != 0:
            RESULTS["env_copy_lab2_s"] = copy_tree(lab1, lab2, ENV_DIR)
        r = deploy(inv, specs["base"])
        (REPO / ".pytest_cache").mkdir(exist_ok=True)
        (REPO / ".pytest_cache" / "deploy-replicas.log").write_text(r.out)
        RESULTS["deploy_2+1_replicas_s"] = round(r.elapsed, 1)
        assert r.returncode == 0, r.out[-6000:]
        yield {"lab1": lab1, "lab2": lab2, "specs": specs, "inv": inv, "lab1_only": lab1_only, "deploy": r, "tmp": tmp}
    finally:
        lab2.ssh(
            "systemctl disable --now vllm-lab-tiny-0.service vllm-fleet-api-firewall.service; "
            "rm -f /etc/systemd/system/vllm-lab-tiny-0.service /etc/systemd/system/vllm-fleet-api-firewall.service; "
            "systemctl daemon-reload",
            user="root",
            check=False,
        )
        lab1.ssh(
            "systemctl disable --now vllm-lab-tiny-b-0.service vllm-fleet-api-firewall.service; "
            "rm -f /etc/systemd/system/vllm-lab-tiny-b-0.service /etc/systemd/system/vllm-fleet-api-firewall.service "
            "/etc/vllm-fleet/api-firewall.nft /etc/nginx/conf.d/vllm-fleet-lab-tiny-b.conf; "
            "systemctl daemon-reload; systemctl reload nginx",
            user="root",
            check=False,
        )
        STATE_FILE.unlink(missing_ok=True)
        (REPO / ".pytest_cache").mkdir(exist_ok=True)
        (REPO / ".pytest_cache" / "rollout-results.json").write_text(json.dumps(RESULTS, indent=2))
        print("\nreplicas/rollout results:", json.dumps(RESULTS))
        if not (
            lab1.ssh(f"systemctl is-active {UNIT0}", user="root", check=False).stdout.strip() == "active"
            and "--host 127.0.0.1" in cmdline(lab1, UNIT0)
        ):
            back = deploy(lab1_only, SINGLE)  # lab-tiny alone on lab1, as later lab tests expect
            assert back.returncode == 0, back.out[-4000:]


@pytest.fixture()
def load(fleet):
    from vllm_fleet.serving.loadgen import LoadGen

    # Continuous but bounded: 2 threads, at most 1 request a second in all (the lab's hosts share
    # the machine's 2 cores; docs/rollout.md).
    gen = LoadGen(
        f"http://{fleet['lab1'].address}",
        "tiny",
        KEY_FILE.read_text().strip(),
        concurrency=2,
        max_tokens=16,
        rate=1,
        timeout=120,
    )
    yield gen
    if not gen._stop.is_set():
        gen.stop()


def test_the_old_single_unit_is_gone(fleet):
    """(d) upgraded in place: no vllm.service file, not active, not enabled; the new units serve."""
    lab1 = fleet["lab1"]
    assert "Stop and disable vllm.service" in fleet["deploy"].out
    assert lab1.ssh("test -e /etc/systemd/system/vllm.service", user="root", check=False).returncode != 0
    assert lab1.ssh("systemctl is-active vllm.service", user="root", check=False).stdout.strip() != "active"
    assert lab1.ssh("systemctl list-unit-files vllm.service --no-legend", user="root", check=False).stdout.strip() == ""
    for unit in (UNIT0, UNIT1):
        assert lab1.ssh(f"systemctl is-active {unit}", user="root").stdout.strip() == "active"
        assert lab1.ssh(f"systemctl is-enabled {unit}", user="root").stdout.strip() == "enabled"


def test_requests_reach_every_instance_each_on_its_own_cores(fleet):
    """(a) nginx balances over lab1:8000, lab1:8001 and lab2:8000; each one's counter moves."""
    lab1, lab2 = fleet["lab1"], fleet["lab2"]
    site = lab1.ssh(f"cat {SITE}", user="root").stdout
    ups = [line.strip() for line in site.splitlines() if re.match(r"\s+server \S+:\d+ ", line)]
    assert ups == [
        "server 127.0.0.1:8000 max_fails=2 fail_timeout=10s;",
        "server 127.0.0.1:8001 max_fails=2 fail_timeout=10s;",
        f"server {lab2.address}:8000 max_fails=2 fail_timeout=10s;",
    ], site
    binds = [proc_env(lab1, u).get("VLLM_CPU_OMP_THREADS_BIND") for u in (UNIT0, UNIT1)]
    assert binds == ["0", "1"], binds  # one core each (the lab hosts have 2)
    targets = [(lab1, 8000), (lab1, 8001), (lab2, 8000)]
    before = [served(h, p) for h, p in targets]
    key = KEY_FILE.read_text().strip()
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    codes = []
    for _ in range(12):
        r = subprocess.run(
            [
                "curl",
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--max-time",
                "120",
                "-H",
                f"Authorization: Bearer {key}",
                "-H",
                "Content-Type: application/json",
                "-d",
                body,
                f"http://{lab1.address}/v1/chat/completions",
            ],
            capture_output=True,
            text=True,
            timeout=150,
        )
        codes.append(r.stdout.strip())
    after = [served(h, p) for h, p in targets]
    RESULTS["requests_per_instance"] = [a - b for a, b in zip(after, before)]
    assert codes == ["200"] * 12, codes
    assert all(a > b for a, b in zip(after, before)), (before, after)


def test_second_deploy_changes_nothing(fleet):
    r = deploy(fleet["inv"], fleet["specs"]["base"])
    assert r.returncode == 0, r.out[-4000:]
    total = grand_total(r.out)
    assert total["changed"] == "-" and total["error"] == "-", (changed_ops(r.out), total)
    RESULTS["noop_deploy_s"] = round(r.elapsed, 1)


def test_a_host_that_fails_while_planned_fails_alone_and_its_retry_line_converges_it(fleet):
    """(issue 36, item 4) lab2's user loses its sudo (the sudoers file moved aside, as root): the
    deploy's preflight fails lab2 alone, lab1 converges; exit 3 ("some hosts failed"), the summary
    names lab2 and why, and its retry line, run as printed once sudo is back, contacts lab2 only
    and converges it. Read with OpenSSH (systemctl, sudo) and curl through nginx."""
    lab1, lab2 = fleet["lab1"], fleet["lab2"]
    pids = {(h.name, u): main_pid(h, u) for h, u in ((lab1, UNIT0), (lab1, UNIT1), (lab2, UNIT0))}
    lab2.ssh("mv /etc/sudoers.d/lab /root/sudoers-lab.off", user="root")
    try:
        assert lab2.ssh("sudo -n true", check=False).returncode != 0  # the fault is real
        r = run(
            [
                sys.executable,
                "-m",
                "vllm_fleet",
                "deploy",
                str(fleet["inv"]),
                "--spec",
                str(fleet["specs"]["base"]),
                "-y",
            ]
        )
    finally:
        lab2.ssh("mv /root/sudoers-lab.off /etc/sudoers.d/lab", user="root", check=False)
    RESULTS["one_host_failed_deploy_s"] = round(r.elapsed, 1)
    assert r.returncode == 3, r.out[-5000:]
    assert re.search(r"failed: +lab2: host lab2: user lab cannot run sudo without a password", r.out), r.out[-5000:]
    assert re.search(r"converged: +lab1$", r.out, re.M), r.out[-3000:]
    retry = re.search(r"retry only those: (.*)$", r.out, re.M).group(1)
    argv = shlex.split(retry)
    assert argv == [
        "vllm-fleet",
        "deploy",
        str(fleet["inv"]),
        "--spec",
        str(fleet["specs"]["base"]),
        "--limit",
        "lab2",
        "-y",
    ]
    assert lab2.ssh("sudo -n true", check=False).returncode == 0
    again = run([sys.executable, "-m", "vllm_fleet", *argv[1:]])
    RESULTS["retry_line_deploy_s"] = round(again.elapsed, 1)
    assert again.returncode == 0, again.out[-5000:]
    assert (
        re.search(r"1 host\(s\): 0 failed, 0 changed, 1 converged", again.out) and "converged:     lab2" in again.out
    ), again.out[-3000:]
    assert "[lab1]" not in again.out and "[lab2] Connected" in again.out  # pyinfra's --limit: lab2 only
    # nothing restarted anywhere; every replica answers through nginx
    assert {k: main_pid(lab1 if k[0] == "lab1" else lab2, k[1]) for k in pids} == pids
    codes = [
        curl("-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "10", f"http://{lab1.address}/health").stdout
        for _ in range(6)
    ]
    assert codes == ["200"] * 6, codes


def test_status_has_one_row_per_instance(fleet):
    r = run(
        [
            sys.executable,
            "-m",
            "vllm_fleet",
            "status",
            str(fleet["inv"]),
            "--spec",
            str(fleet["specs"]["base"]),
            "--json",
        ]
    )
    assert r.returncode == 0, r.out[-3000:]
    rows = json.loads(r.stdout)
    assert [(x["instance"], x["unit"], x["health"]) for x in rows] == [
        ("lab1:0", "active", "ok"),
        ("lab1:1", "active", "ok"),
        ("lab2:0", "active", "ok"),
    ]


def test_session_routing_keeps_a_conversation_on_one_replica(fleet):
    """(issue 23) proxy.routing.policy session on the 3 replicas: a deploy of the proxy part only
    (no vLLM restarted); chats that send one X-Session-Id all reach one replica, chats without it
    are spread over several (least_conn). Each replica's own request counter is the reader."""
    lab1, lab2 = fleet["lab1"], fleet["lab2"]
    spec = yaml.safe_load(fleet["specs"]["base"].read_text())
    spec["proxy"].pop("balance", None)
    spec["proxy"]["routing"] = {"policy": "session"}
    path = fleet["tmp"] / "session.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    pids = [main_pid(lab1, UNIT0), main_pid(lab1, UNIT1), main_pid(lab2, UNIT0)]
    r = deploy(fleet["inv"], path)
    RESULTS["session_routing_deploy_s"] = round(r.elapsed, 1)
    assert r.returncode == 0, r.out[-6000:]
    assert "hash $http_x_session_id consistent" in lab1.ssh(f"cat {SITE}", user="root").stdout
    assert [main_pid(lab1, UNIT0), main_pid(lab1, UNIT1), main_pid(lab2, UNIT0)] == pids
    targets = [(lab1, 8000), (lab1, 8001), (lab2, 8000)]
    key = KEY_FILE.read_text().strip()
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})

    def moved_by(headers: list[list[str]]) -> list[float]:
        before = [served(h, p) for h, p in targets]
        for extra in headers:
            out = subprocess.run(
                [
                    "curl",
                    "-s",
                    "-o",
                    "/dev/null",
                    "-w",
                    "%{http_code}",
                    "--max-time",
                    "120",
                    "-H",
                    f"Authorization: Bearer {key}",
                    "-H",
                    "Content-Type: application/json",
                    *extra,
                    "-d",
                    body,
                    f"http://{lab1.address}/v1/chat/completions",
                ],
                capture_output=True,
                text=True,
                timeout=150,
            ).stdout.strip()
            assert out == "200", out
        return [a - b for a, b in zip([served(h, p) for h, p in targets], before)]

    one = moved_by([["-H", "X-Session-Id: conversation-7"]] * 6)
    RESULTS["session_one_conversation"] = one
    assert sorted(one) == [0, 0, 6], one
    spread = moved_by([[]] * 6)
    RESULTS["session_no_header"] = spread
    assert sum(spread) == 6 and sum(1 for x in spread if x) >= 2, spread


def nginx_sites(host: LabHost) -> str:
    """The server blocks nginx runs with on the host (`nginx -T`: every file it loaded)."""
    return host.ssh("nginx -T 2>/dev/null | grep -E '^# configuration file|^\\s*listen ' || true", user="root").stdout


def test_moving_the_proxy_removes_its_site_from_the_old_host(fleet):
    """(issue 22) The proxy moved from lab1 to lab2, then back: each deploy puts the site on the
    new proxy host and removes it (site, auth include) from the old one, nginx there validated
    and reloaded; the vLLM units are not restarted (a proxy-only change). Read with nginx -T, ls,
    systemctl and curl through the new proxy."""
    lab1, lab2 = fleet["lab1"], fleet["lab2"]
    auth = "/etc/nginx/vllm-fleet/lab-tiny-auth.conf"
    pids = [main_pid(lab1, UNIT0), main_pid(lab1, UNIT1), main_pid(lab2, UNIT0)]
    moved = inventory(
        fleet["tmp"],
        "proxy-on-lab2.py",
        "servers = [('lab1', {**_by['lab1'], 'replicas_per_host': 2}), ('lab2', _by['lab2'])]\n"
        "proxy = [('lab2', _by['lab2'])]\n",
    )
    key = KEY_FILE.read_text().strip()
    for new, old, inv in ((lab2, lab1, moved), (lab1, lab2, fleet["inv"])):
        r = deploy(inv, fleet["specs"]["base"])
        RESULTS.setdefault("proxy_moved_s", []).append(round(r.elapsed, 1))
        assert r.returncode == 0, r.out[-6000:]
        assert SITE not in nginx_sites(old) and SITE in nginx_sites(new), (nginx_sites(old), nginx_sites(new))
        assert old.ssh(f"ls {SITE} {auth}", user="root", check=False).returncode != 0  # both gone
        assert old.ssh("nginx -t && systemctl is-active nginx", user="root", check=False).returncode == 0
        out = subprocess.run(
            ["curl", "-s", "--max-time", "60", "-H", f"Authorization: Bearer {key}", f"http://{new.address}/v1/models"],
            capture_output=True,
            text=True,
            timeout=90,
        ).stdout
        assert [m["id"] for m in json.loads(out)["data"]] == ["tiny"], out
    assert [main_pid(lab1, UNIT0), main_pid(lab1, UNIT1), main_pid(lab2, UNIT0)] == pids  # no vLLM restarted


def test_rollout_in_instance_batches_under_load_fails_no_request(fleet, load):
    """(c) never more than one instance out; zero failed requests; the new flag everywhere."""
    lab1, lab2 = fleet["lab1"], fleet["lab2"]
    load.start()
    time.sleep(5)
    r = rollout(fleet["inv"], fleet["specs"]["new"])
    time.sleep(3)
    st = load.stop()
    RESULTS["rollout"] = {"seconds": round(r.elapsed, 1), "requests": st.as_dict()}
    (REPO / ".pytest_cache" / "rollout-ok.log").write_text(r.out)
    assert r.returncode == 0, r.out[-6000:]
    assert "batch 1/3 (lab1:0)" in r.out and "batch 2/3 (lab1:1)" in r.out and "batch 3/3 (lab2:0)" in r.out, r.out[
        -3000:
    ]
    assert st.failed == 0, st.summary()
    assert st.ok >= 20 and st.streamed >= 5, st.summary()
    print("\nload during the rollout:", st.summary())
    for h, unit in ((lab1, UNIT0), (lab1, UNIT1), (lab2, UNIT0)):
        assert "--max-num-seqs 12" in cmdline(h, unit), (h.name, unit)
    assert " down" not in lab1.ssh(f"cat {SITE}", user="root").stdout


def test_broken_update_stops_after_the_first_batch(fleet):
    lab1, lab2 = fleet["lab1"], fleet["lab2"]
    pid1 = main_pid(lab1, UNIT1)
    r = rollout(fleet["inv"], fleet["specs"]["broken"])
    (REPO / ".pytest_cache" / "rollout-broken.log").write_text(r.out)
    RESULTS["broken_rollout_s"] = round(r.elapsed, 1)
    assert r.returncode == 4, r.out[-6000:]  # nothing updated (1 is a bad spec, nothing changed)
    assert "batch 1/3 (lab1:0) FAILED" in r.out and "lab1:0: left OUT of the nginx upstream" in r.out, r.out[-4000:]
    assert re.search(r"failed: +lab1:0: drain, update, check failed: .*", r.out), r.out[-3000:]
    assert re.search(r"not attempted: lab1:1, lab2:0 \(the rollout stopped", r.out), r.out[-3000:]
    assert re.search(
        r"retry only those: vllm-fleet rollout \S+ --spec \S+ --max-fail 0 --limit lab1 --limit lab2$", r.out, re.M
    ), r.out[-3000:]
    assert "batch 2/3" not in r.out
    site = lab1.ssh(f"cat {SITE}", user="root").stdout
    assert "server 127.0.0.1:8000 max_fails=2 fail_timeout=10s down;" in site
    assert "server 127.0.0.1:8001 max_fails=2 fail_timeout=10s;" in site  # the same host's other instance stays in
    assert main_pid(lab1, UNIT1) == pid1  # and was not restarted
    for h, unit in ((lab1, UNIT1), (lab2, UNIT0)):
        line = cmdline(h, unit)
        assert "--max-num-seqs 12" in line and "--no-such-vllm-flag" not in line, (h.name, unit)
    r = rollout(fleet["inv"], fleet["specs"]["new"])  # the fix: lab1:0 first, then nothing to change
    (REPO / ".pytest_cache" / "rollout-restore.log").write_text(r.out)
    RESULTS["restore_rollout_s"] = round(r.elapsed, 1)
    assert r.returncode == 0, r.out[-6000:]
    assert "batch 1/3 (lab1:0)" in r.out
    assert " down" not in lab1.ssh(f"cat {SITE}", user="root").stdout


def test_two_deployments_on_one_host_behind_one_nginx(fleet):
    """(b) lab-tiny (port 80) and lab-tiny-b (port 8081) on lab1, each smoke-tested by the deploy."""
    lab1 = fleet["lab1"]
    b = yaml.safe_load(SINGLE.read_text())
    b.update(name="lab-tiny-b", description="a second deployment beside lab-tiny on the same host")
    b["model"]["served_name"] = "tiny-b"
    b["server"].update(port=8100, api_key={"file": str(KEY_B), "generate": True})
    b["proxy"]["listen"] = 8081
    b["install"]["prefix"] = "/opt/vllm-fleet/lab-tiny"  # the same env (one vLLM install on the host)
    spec_b = fleet["tmp"] / "b.yaml"
    spec_b.write_text(yaml.safe_dump(b, sort_keys=False))
    r = deploy(fleet["lab1_only"], SINGLE, spec_b)
    (REPO / ".pytest_cache" / "deploy-two-deployments.log").write_text(r.out)
    RESULTS["deploy_two_deployments_s"] = round(r.elapsed, 1)
    assert r.returncode == 0, r.out[-6000:]
    assert r.out.count("PASS  chat") >= 2, r.out[-4000:]  # the smoke tests of each deployment
    # lab-tiny back to one replica on loopback: the second unit of the rollout fleet is removed
    assert lab1.ssh(f"test -e /etc/systemd/system/{UNIT1}", user="root", check=False).returncode != 0
    assert "--host 127.0.0.1 --port 8000" in cmdline(lab1, UNIT0)
    for port, model, key in ((80, "tiny", KEY_FILE), (8081, "tiny-b", KEY_B)):
        out = subprocess.run(
            [
                "curl",
                "-s",
                "--max-time",
                "30",
                "-H",
                f"Authorization: Bearer {key.read_text().strip()}",
                f"http://{lab1.address}:{port}/v1/models",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert [m["id"] for m in json.loads(out)["data"]] == [model], out
    assert lab1.ssh("nginx -t", user="root", check=False).returncode == 0


def test_a_host_dropped_from_the_deployment_loses_its_part(fleet):
    """(issue 22) lab2 is still in the inventory but no longer a server of lab-tiny (the deploys
    above were of lab1 alone, so lab2 kept the fleet's replica): the deploy stops, disables and
    removes its unit, its configuration and its API firewall (the nftables table too); the
    environment stays, as after `down`. lab-tiny-b on lab1 is not this deploy's and stays.
    A second deploy changes nothing."""
    lab1, lab2 = fleet["lab1"], fleet["lab2"]
    assert (
        lab2.ssh(f"test -e /etc/systemd/system/{UNIT0}", user="root", check=False).returncode == 0
    )  # left by the fleet
    inv = inventory(
        fleet["tmp"],
        "lab1-and-spare.py",
        "servers = [('lab1', _by['lab1'])]\nproxy = servers\nspare = [('lab2', _by['lab2'])]\n",
    )
    r = deploy(inv, SINGLE)
    RESULTS["host_dropped_s"] = round(r.elapsed, 1)
    assert r.returncode == 0, r.out[-6000:]
    assert (
        lab2.ssh(
            "systemctl list-units --all --no-legend 'vllm-lab-tiny*' vllm-fleet-api-firewall.service", user="root"
        ).stdout.strip()
        == ""
    )
    assert (
        lab2.ssh(
            "ls /etc/systemd/system/vllm-lab-tiny-0.service /etc/systemd/system/vllm-fleet-api-firewall.service "
            "/etc/vllm-fleet/api-firewall.nft /etc/vllm-fleet/lab-tiny/vllm.env /etc/vllm-fleet/lab-tiny/replica-0.env",
            user="root",
            check=False,
        ).stdout.strip()
        == ""
    )
    assert lab2.ssh("nft list table inet vllm_fleet_api", user="root", check=False).returncode != 0
    assert lab2.ssh(f"test -x {ENV_DIR}/bin/python", user="root", check=False).returncode == 0  # the environment stays
    assert lab1.ssh("systemctl is-active vllm-lab-tiny-b-0.service", user="root").stdout.strip() == "active"
    again = deploy(inv, SINGLE)
    total = grand_total(again.out)
    assert again.returncode == 0 and total["changed"] == "-" and total["error"] == "-", (changed_ops(again.out), total)
