"""Host to host transfers on the lab (issue 36 item 1; vllm_fleet.roles.common.peers): the model
role alone (tests/lab/fixtures/model_only.py) puts an uploaded model on the 3 lab hosts. Read
independently: the bridge's own tx counter (/sys/class/net/vfleet0/statistics/tx_bytes: every
byte the control machine sent to the hosts) for what crossed the control link, sha256sum and
systemctl over plain ssh on each host. A corrupted copy on a peer is refused by the host that
fetches from it (the real unit, the real fetch, across the bridge).

    VLLM_FLEET_KEEP_LAB=1 VLLM_FLEET_LAB_TEST_HOSTS=3 pytest -m lab tests/lab/test_peer_fetch.py
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
from pathlib import Path

import pytest
from labkit import REPO, bridge_tx, run

from vllm_fleet.host.programs import script
from vllm_fleet.roles.common.peers import RUN_DIR, Artifact, server_argv

pytestmark = pytest.mark.lab

PYINFRA = str(Path(sys.executable).parent / "pyinfra")
NAME = "peers-test"
ROOT = "/var/tmp/vf-peers-test/model"
CONFIG = f"/etc/vllm-fleet/{NAME}"
SIZES = {"shard-1.bin": 3_000_000, "shard-2.bin": 3_000_000, "sub/extra.bin": 1_000_000, "config.json": 2}


def _clean(hosts):
    for h in hosts:
        h.ssh(f"sudo rm -rf /var/tmp/vf-peers-test {CONFIG}; sudo systemctl stop 'vllm-fleet-peer-*' 2>/dev/null; true")


@pytest.fixture(scope="module")
def fleet(lab, lab_hosts, tmp_path_factory):
    hosts = lab_hosts[:3]
    if len(hosts) < 3:
        pytest.skip("needs 3 lab hosts (VLLM_FLEET_LAB_TEST_HOSTS=3)")
    tmp = tmp_path_factory.mktemp("peers")
    model = tmp / "model"
    for rel, size in SIZES.items():
        (model / rel).parent.mkdir(parents=True, exist_ok=True)
        (model / rel).write_bytes(b"{}" if rel == "config.json" else os.urandom(size))
    spec = tmp / "spec.yaml"
    spec.write_text(f"""name: {NAME}
model: {{source: {model}, path: {ROOT}, served_name: tiny, dtype: bfloat16, max_model_len: 512}}
server: {{user: daemon}}
proxy: {{auth: none}}
install: {{accelerator: cpu, vllm_version: 0.32.0, env_manager: venv, prefix: /var/tmp/vf-peers-test/opt}}
hardware: {{gpu: cpu}}
""")
    _clean(hosts)
    yield {
        "hosts": hosts,
        "model": model,
        "spec": spec,
        "shas": {rel: hashlib.sha256((model / rel).read_bytes()).hexdigest() for rel in SIZES},
    }
    _clean(hosts)


def _deploy(fleet):
    env = {"VF_MODEL_ONLY_SPEC": str(fleet["spec"]), "VLLM_FLEET_LAB_SERVERS": ",".join(h.name for h in fleet["hosts"])}
    before = bridge_tx()
    r = run([PYINFRA, "-y", "inventory/lab.py", str(REPO / "tests/lab/fixtures/model_only.py")], env=env, timeout=600)
    r.control_bytes = bridge_tx() - before  # type: ignore[attr-defined]
    return r


def _sums(h) -> dict[str, str]:
    """sha256sum of every file under ROOT on ``h`` (the manifest left out); {} when there is none."""
    out = h.ssh(
        f"cd {ROOT} 2>/dev/null || exit 0; sudo find . -type f ! -name MANIFEST.sha256 -printf '%P\\n' | sort | "
        "sudo xargs -r sha256sum"
    ).stdout
    return {line.split()[1]: line.split()[0] for line in out.splitlines()}


def test_the_model_crosses_the_control_link_once_and_the_hosts_fill_each_other(fleet):
    size = sum(SIZES.values())
    r = _deploy(fleet)
    assert r.returncode == 0, r.out[-3000:]
    names = [h.name for h in fleet["hosts"]]
    # the plan said it: one host from the control machine, the others from the hosts that hold it
    assert f"round 0: {names[0]} <- the control machine" in r.out, r.out[-3000:]
    assert f"round 1: {names[1]} <- {names[0]}" in r.out
    assert f"round 2: {names[2]} <- {names[0]}, {names[1]}" in r.out
    # the bridge's own counter: the model once (plus pyinfra's SSH), not three times, and not less
    # (a counter that read nothing would pass the upper bound alone)
    assert size <= r.control_bytes <= 1.25 * size, (r.control_bytes, size)
    for h in fleet["hosts"]:
        assert _sums(h) == fleet["shas"], h.name  # every file, every host: sha256sum over ssh
        owners = h.ssh(f"sudo stat -c '%U %a' {ROOT}/shard-1.bin {ROOT}/sub/extra.bin {ROOT}/sub").stdout.split("\n")
        assert owners[:3] == ["daemon 644", "daemon 644", "daemon 755"], (h.name, owners)
        # the peer servers are gone, and the lists that held the token
        units = h.ssh("systemctl list-units --all --no-legend 'vllm-fleet-peer-*'").stdout.strip()
        assert units == "", (h.name, units)
        assert h.ssh(f"sudo find {RUN_DIR} -type f").stdout.strip() == "", h.name
    # a second deploy: nothing transferred, no round, no peer server
    again = _deploy(fleet)
    assert again.returncode == 0 and "peer round" not in again.out and "round 0:" not in again.out, again.out[-2000:]
    assert again.control_bytes < 0.1 * size, again.control_bytes
    # lab1 staged earlier (its stamp): the only source; nothing from the control machine, its
    # server started (and stopped) by lab2, the first host that needs the model
    for h in fleet["hosts"][1:]:
        h.ssh(f"sudo rm -rf {ROOT} {CONFIG}")
    staged = _deploy(fleet)
    assert staged.returncode == 0, staged.out[-3000:]
    assert "2 host(s) to fill, 1 holding a verified copy" in staged.out, staged.out[-3000:]
    assert (
        f"round 1: {names[1]} <- {names[0]}" in staged.out
        and f"round 2: {names[2]} <- {names[0]}, {names[1]}" in staged.out
    )
    assert "the control machine" not in staged.out, staged.out[-3000:]  # no seed, no fallback
    assert staged.control_bytes < 0.25 * size, staged.control_bytes
    for h in fleet["hosts"]:
        assert _sums(h) == fleet["shas"], h.name
        assert h.ssh("systemctl list-units --all --no-legend 'vllm-fleet-peer-*'").stdout.strip() == "", h.name


def test_a_corrupted_copy_on_a_peer_is_refused(fleet):
    """lab1 serves a copy with one byte changed (same size), lab3 a good one, both through the
    product's own transient unit (peers.server_argv: DynamicUser, the directory bound read-only);
    lab2 fetches through the product's fetch (scripts/fetch_files.py): lab1's copy is refused and
    lab3's kept; with lab1 alone the fetch fails naming the file and why, keeping nothing."""
    h1, h2, h3 = fleet["hosts"]
    if _sums(h1) != fleet["shas"]:  # run alone (-k): the model first
        assert _deploy(fleet).returncode == 0
    files = {rel: [SIZES[rel], sha] for rel, sha in fleet["shas"].items()}
    art = Artifact(
        key="lab-test:corrupt",
        what="test",
        local=fleet["model"],
        root=ROOT,
        files=files,
        owner="daemon",
        mode="644",
        dir_mode="755",
        port=8471,
        seconds=120,
    )
    # one byte flipped on lab1, its size kept (what a bad disk or a tampering peer gives)
    h1.ssh(f"printf '\\377' | sudo dd of={ROOT}/shard-1.bin bs=1 seek=4096 count=1 conv=notrunc status=none")
    listing = shlex.quote(json.dumps({"token": art.token, "files": files}))
    try:
        for h in (h1, h3):
            h.ssh(
                f"sudo install -d -m 700 {RUN_DIR} && echo {listing} | sudo tee {RUN_DIR}/{art.unit}.serve.json "
                f">/dev/null && sudo chmod 600 {RUN_DIR}/{art.unit}.serve.json"
            )
            h.ssh("sudo " + shlex.join([str(a) for a in server_argv(art, h.address)]))
            # the unit runs as a dynamic user, not root
            user = h.ssh(f"sleep 0.5; ps -o user= -p $(systemctl show -P MainPID {art.unit}.service)").stdout.strip()
            assert user and user != "root", (h.name, user)
        # without the token: nothing
        code = h2.ssh(
            f"curl -s -o /dev/null -w '%{{http_code}}' http://{h1.address}:8471/shard-1.bin", check=False
        ).stdout
        assert code == "404", code
        h2.ssh(f"sudo rm -f {ROOT}/shard-1.bin")

        def fetch(sources):
            body = shlex.quote(
                json.dumps(
                    {
                        "sources": [f"http://{a}:8471/{art.token}/" for a in sources],
                        "files": files,
                        "prune": False,
                        "owner": "daemon",
                        "mode": "644",
                    }
                )
            )
            return h2.ssh(
                f"echo {body} | sudo tee /root/vf-peers-test.json >/dev/null && "
                f"sudo python3 -c {shlex.quote(script('fetch_files.py'))} /root/vf-peers-test.json {ROOT}",
                check=False,
            )

        bad = fetch([h1.address])
        assert bad.returncode == 1, bad.stdout + bad.stderr
        assert f"shard-1.bin: no source gave a verified copy ({h1.address}:8471: sha256" in bad.stderr, bad.stderr
        assert h2.ssh(f"sudo ls {ROOT}").stdout.split().count("shard-1.bin") == 0  # nothing of it kept
        good = fetch([h1.address, h3.address])
        assert good.returncode == 0, good.stderr
        assert f"then a verified copy from {h3.address}:8471" in good.stderr, good.stderr
        assert _sums(h2) == fleet["shas"]
    finally:
        for h in (h1, h3):
            h.ssh(f"sudo systemctl stop {art.unit}.service; sudo rm -f {RUN_DIR}/{art.unit}.serve.json", check=False)
        h2.ssh("sudo rm -f /root/vf-peers-test.json", check=False)
