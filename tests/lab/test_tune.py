"""`vllm-fleet tune` end to end on the lab: two replicas behind nginx, one swept while the other serves.

The fleet: deployments/lab-tiny-replicas.yaml on lab1 and lab2 (VLLM_FLEET_LAB_SERVERS), nginx on
lab1, named `lab-tiny` as in test_rollout.py (lab1 keeps test_deploy.py's env and model; lab2
gets lab1's installed env copied with tar when it has none). The tune sweeps lab2 over
max_num_seqs 4/8/16 x prefix caching on/off (6 points, each a restart) plus gpu_memory_utilization
0.90/0.95, which the CPU build does not use: those 6 points have the same command line and must be
skipped with that reason. Kept short for CI: enforce-eager restarts, 32-token prompts, 16 output
tokens, at most 2 probes per point.

Checked with independent readers: while the tune runs a load generator (vllm_fleet.serving.loadgen)
through nginx sees zero failed requests; afterwards nginx's site on lab1 has no `down` (ssh cat),
lab2's running vLLM has its own command line again (/proc/PID/cmdline over ssh) and takes requests
through the proxy again (its own /metrics counter grows); report.html and overlay.yaml exist, the
overlay's settings are the winner's, and `vllm-fleet validate` accepts the merged spec.
Before the tune, `vllm-fleet bench` runs on lab2 through nginx and direct at concurrency 1 and 2.

Replicas are instances of issue 14's layout: one per host here (vllm-lab-tiny-0.service, port
8000); the tune takes instance lab2:0 out of the upstream (VLLM_FLEET_UPSTREAM_DOWN=lab2:0) and
restarts that unit only.

A long proof (~8 min of the lab): `make test` skips it unless VLLM_FLEET_LAB_TUNE=1
(docs/tuning.md says how to run it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from labkit import REPO, LabHost, copy_tree, run

pytestmark = [
    pytest.mark.lab,
    pytest.mark.skipif(
        os.environ.get("VLLM_FLEET_LAB_TUNE") != "1",
        reason="a long proof (~8 min of the lab): set VLLM_FLEET_LAB_TUNE=1 to run it (docs/tuning.md)",
    ),
]

BASE = REPO / "deployments" / "lab-tiny-replicas.yaml"
SINGLE = REPO / "deployments" / "lab-tiny.yaml"
PYINFRA = str(Path(sys.executable).parent / "pyinfra")
ENV_DIR = "/opt/vllm-fleet/lab-tiny/env"
SITE = "/etc/nginx/conf.d/vllm-fleet-lab-tiny.conf"
KEY_FILE = Path(os.path.expanduser("~/.config/vllm-fleet/lab-tiny.key"))
SERVERS = "lab1,lab2"
UNIT = "vllm-lab-tiny-0.service"  # instance 0 of deployment lab-tiny on each host (vllm_fleet.render.layout.unit_name)
INSTANCE = "lab2:0"
GRID = "max_num_seqs=4,8,16;enable_prefix_caching=true,false;gpu_memory_utilization=0.9,0.95"
TARGET = "ttft_p99_ms=5000,tpot_p99_ms=500"
RESULTS: dict[str, object] = {}


def deploy(spec: Path, servers: str | None = SERVERS) -> subprocess.CompletedProcess:
    env = {"VLLM_FLEET_SPEC": str(spec)}
    if servers:
        env["VLLM_FLEET_LAB_SERVERS"] = servers
    return run([PYINFRA, "-y", "inventory/lab.py", "deploys/serve.py"], env)


def cmdline(host: LabHost) -> str:
    return host.ssh(
        f"pid=$(systemctl show -p MainPID --value {UNIT}); "
        "[ \"$pid\" != 0 ] && tr '\\0' ' ' < /proc/$pid/cmdline || true",
        user="root",
    ).stdout


def served(host: LabHost) -> float:
    """Requests lab's vLLM finished (its own /metrics, read on the host)."""
    text = host.ssh("curl -s --max-time 5 http://127.0.0.1:8000/metrics", user="root").stdout
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:request_success_total")
    )


@pytest.fixture(scope="module")
def fleet(three_hosts, tmp_path_factory):
    hosts = three_hosts[:2]
    lab1, lab2 = hosts
    tmp = tmp_path_factory.mktemp("tune")
    subnet = lab1.address.rsplit(".", 1)[0] + ".0/24"
    spec = yaml.safe_load(BASE.read_text())
    spec["name"] = "lab-tiny"  # lab1's env, model and site from test_deploy.py (as test_rollout.py)
    spec["server"]["api_key"] = {"file": str(KEY_FILE), "generate": True}
    spec["proxy"]["metrics_allow"] = ["127.0.0.1", subnet]
    spec["rollout"]["health_timeout"] = 900
    spec_path = tmp / "fleet.yaml"
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    try:
        if lab1.ssh(f"test -x {ENV_DIR}/bin/python", user="root", check=False).returncode != 0:
            r = deploy(SINGLE, servers=None)
            assert r.returncode == 0, r.out[-5000:]
        if lab2.ssh(f"test -x {ENV_DIR}/bin/python", user="root", check=False).returncode != 0:
            RESULTS["env_copy_s"] = copy_tree(lab1, lab2, ENV_DIR)
        r = deploy(spec_path)
        RESULTS["deploy_2_replicas_s"] = round(r.elapsed, 1)
        assert r.returncode == 0, r.out[-6000:]
        yield {"hosts": hosts, "spec": spec_path, "tmp": tmp}
    finally:
        lab2.ssh(
            f"systemctl disable --now {UNIT} vllm-fleet-api-firewall.service; "
            f"rm -f /etc/systemd/system/{UNIT} /etc/systemd/system/vllm-fleet-api-firewall.service; "
            "systemctl daemon-reload",
            user="root",
            check=False,
        )
        lab1.ssh(
            "systemctl disable --now vllm-fleet-api-firewall.service; rm -f "
            "/etc/systemd/system/vllm-fleet-api-firewall.service /etc/vllm-fleet/api-firewall.nft; systemctl "
            "daemon-reload",
            user="root",
            check=False,
        )
        (REPO / ".pytest_cache").mkdir(exist_ok=True)
        (REPO / ".pytest_cache" / "tune-results.json").write_text(json.dumps(RESULTS, indent=2))
        print("\ntune results:", json.dumps(RESULTS))
        back = deploy(SINGLE, servers=None)
        assert back.returncode == 0, back.out[-4000:]


def test_bench_through_the_proxy_and_direct(fleet):
    import hashlib

    out = fleet["tmp"] / "bench"
    r = run(
        [
            sys.executable,
            "-m",
            "vllm_fleet",
            "bench",
            "inventory/lab.py",
            "--spec",
            str(fleet["spec"]),
            "--host",
            INSTANCE,
            "--concurrency",
            "1,2",
            "--input-len",
            "32",
            "--output-len",
            "16",
            "--min-prompts",
            "4",
            "--prompts-per-level",
            "2",
            "--warmups",
            "1",
            "--out",
            str(out),
        ],
        {"VLLM_FLEET_LAB_SERVERS": SERVERS},
        timeout=900,
    )
    RESULTS["bench_s"] = round(r.elapsed, 1)
    print(r.out[-3000:])
    assert r.returncode == 0, r.out[-4000:]
    data = json.loads((out / "bench.json").read_text())
    assert data["spec_sha256"] == hashlib.sha256(fleet["spec"].read_bytes()).hexdigest()
    assert data["host_info"]["vllm_version"].startswith("vllm") and not data["host_info"]["gpus"]
    assert "no GPU" in data["host_info"]["accelerator_note"]
    assert (
        data["targets"]["proxy"] == f"http://{fleet['hosts'][0].address}:80"
        and data["targets"]["direct"] == "http://127.0.0.1:8000"
    )
    assert data["replica"] == INSTANCE and data["unit"] == UNIT
    runs = {(x["target"], x["concurrency"]): x["result"] for x in data["runs"]}
    assert set(runs) == {("proxy", 1), ("proxy", 2), ("direct", 1), ("direct", 2)}
    for res in runs.values():
        assert res["completed"] == 4 and res["failed"] == 0 and res["p99_tpot_ms"] > 0 and res["output_throughput"] > 0
    assert "c=2" in r.stdout and "proxy" in r.stdout
    html = (out / "report.html").read_text()
    assert html.count("<svg") == 4 and "no GPU" in html


def test_tune_sweeps_one_replica_while_the_other_serves(fleet):
    from vllm_fleet.serving.loadgen import LoadGen

    lab1, lab2 = fleet["hosts"]
    out = fleet["tmp"] / "out"
    before = cmdline(lab2)
    assert "--max-num-seqs 16" in before and "--enable-prefix-caching" in before, before
    gen = LoadGen(
        f"http://{lab1.address}",
        "tiny",
        KEY_FILE.read_text().strip(),
        concurrency=2,
        max_tokens=16,
        rate=1,
        timeout=120,
    )
    gen.start()
    try:
        r = run(
            [
                sys.executable,
                "-m",
                "vllm_fleet",
                "tune",
                "inventory/lab.py",
                "--spec",
                str(fleet["spec"]),
                "--host",
                INSTANCE,
                "--target",
                TARGET,
                "--grid",
                GRID,
                "--out",
                str(out),
                "--input-len",
                "32",
                "--output-len",
                "16",
                "--max-probes",
                "2",
                "--min-prompts",
                "4",
                "--prompts-per-stream",
                "2",
            ],
            {"VLLM_FLEET_LAB_SERVERS": SERVERS},
            timeout=1500,
        )
    finally:
        time.sleep(2)
        st = gen.stop()
    (REPO / ".pytest_cache").mkdir(exist_ok=True)
    (REPO / ".pytest_cache" / "tune.log").write_text(r.out)
    if out.is_dir():  # kept after pytest prunes its temp dirs: the report, tune.json, the overlay
        shutil.copytree(out, REPO / ".pytest_cache" / "tune-out", dirs_exist_ok=True)
    RESULTS["tune_s"] = round(r.elapsed, 1)
    RESULTS["load"] = st.as_dict()
    print(r.out[-6000:])
    assert r.returncode == 0, r.out[-6000:]
    assert st.failed == 0, st.summary()
    assert st.ok >= 20, st.summary()
    assert f"{INSTANCE}: out of the upstream" in r.out and f"{INSTANCE}: back in the upstream" in r.out, r.out[-3000:]

    state = json.loads((out / "tune.json").read_text())
    measured = [p for p in state["points"] if p["status"] == "measured"]
    skipped = [p for p in state["points"] if p["status"] == "skipped"]
    RESULTS["points"] = [
        {
            "id": p["id"],
            "settings": p["settings"],
            "status": p["status"],
            "best_load": p.get("best_load"),
            "tok_s": (p.get("best") or {}).get("output_throughput"),
            "times": p.get("times"),
        }
        for p in state["points"]
    ]
    assert len(measured) >= 6, [p["status"] for p in state["points"]]
    assert len(skipped) == 6 and all("same vLLM command line" in p["reason"] for p in skipped), skipped
    for p in measured:  # p00 is what lab2 runs already: no restart for it
        t = p["times"]
        assert (t["restart_s"] > 0 or p["id"] == "p00") and t["warmup_s"] > 0 and t["search_s"] > 0, p
    assert state["winner"], state.get("closest")
    # the tune's results file has every point, one JSON line each (what --resume reads)
    rows = [json.loads(line) for line in (out / "tune.jsonl").read_text().splitlines() if line.strip()]
    assert rows[0]["kind"] == "header" and len([x for x in rows if x["kind"] == "point"]) == 12

    # lab2 back: its own command line, in the upstream, taking requests through the proxy
    after = cmdline(lab2)
    assert "--max-num-seqs 16" in after and "--enable-prefix-caching" in after, after
    assert " down" not in lab1.ssh(f"cat {SITE}", user="root").stdout
    n0 = served(lab2)
    with LoadGen(f"http://{lab1.address}", "tiny", KEY_FILE.read_text().strip(), concurrency=4, max_tokens=4) as g:
        time.sleep(6)
    assert g.stats().failed == 0
    assert served(lab2) > n0, "lab2 got no request through the proxy after the tune"

    # the report and the overlay
    html = (out / "report.html").read_text()
    assert "Pareto front" in html and "<svg" in html and state["winner"]["id"] in html
    overlay = yaml.safe_load((out / "overlay.yaml").read_text())
    win = state["winner"]["settings"]
    assert overlay["engine"]["max_num_seqs"] == win["max_num_seqs"]
    assert overlay["engine"]["enable_prefix_caching"] == win["enable_prefix_caching"]
    assert re.search(r"# evidence: concurrency \d+ meets it", (out / "overlay.yaml").read_text())
    v = run([sys.executable, "-m", "vllm_fleet", "validate", str(out / "tuned-spec.yaml")])
    assert v.returncode == 0, v.out
