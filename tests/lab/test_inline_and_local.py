"""The inventories pyinfra takes inline, for real (issue 38):

1. From the control machine, `lab@10.10.0.12` (lab2) given inline, its login as --data: deploy,
   status (exit 0, one row, healthy), diff (exit 0), a short bench, down; checked with plain ssh,
   systemctl and curl.
2. Inside lab1, vllm-fleet installed from a wheel into a fresh venv there (the wheels built here,
   no index on the host), reading lab1 through `@local` (a child process, no SSH): status (exit 0,
   healthy), diff (exit 0: the state read of lab1 itself and pyinfra's dry run there find lab1 as the
   control machine's deploy left it), a short bench, and down (unit, site gone).
   lab1 then gets lab-tiny back from the control machine, as the other lab tests expect.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time

import pytest

from labkit import REPO, copy_tree, run

pytestmark = pytest.mark.lab

SPEC = REPO / "deployments" / "lab-tiny.yaml"
UNIT = "vllm-lab-tiny-0.service"
ENV_DIR = "/opt/vllm-fleet/lab-tiny/env"
BENCH = [
    "--concurrency",
    "1",
    "--prompts-per-level",
    "1",
    "--min-prompts",
    "2",
    "--warmups",
    "0",
    "--input-len",
    "16",
    "--output-len",
    "8",
]
TIMES: dict[str, float] = {}


def _lab_data(name: str) -> dict:
    sys.path.insert(0, str(REPO))
    from vllm_fleet.lab.inventory import lab_hosts

    return dict(dict(lab_hosts()[0])[name])


def _fleet(*args: str, timeout: float = 1800):
    r = run([sys.executable, "-m", "vllm_fleet", *args], timeout=timeout)
    TIMES[" ".join(args[:2])] = round(r.elapsed, 1)
    return r


def test_an_inline_user_at_host_from_the_control_machine(lab_hosts, tmp_path):
    lab1, lab2 = lab_hosts[:2]
    data = _lab_data(lab2.name)
    inv = f"{data['ssh_user']}@{lab2.address}"  # lab@10.10.0.12: the login in the name, the rest as --data
    keys = (
        "_sudo",
        "ssh_key",
        "ssh_known_hosts_file",
        "ssh_strict_host_key_checking",
        "private_address",
        "pip_cache_dir",
        "vllm_find_links",
        "vllm_wheel_serve_address",
    )
    given = [a for k in keys for a in ("--data", f"{k}={data[k]}")]
    if lab2.ssh(f"test -x {ENV_DIR}/bin/python", user="root", check=False).returncode != 0:
        TIMES["env copy lab1 -> lab2"] = copy_tree(lab1, lab2, ENV_DIR)
    try:
        r = _fleet("deploy", inv, "--spec", str(SPEC), *given, "-y")
        assert r.returncode == 0, r.out[-5000:]
        assert lab2.ssh(f"systemctl is-active {UNIT}", user="root").stdout.strip() == "active"

        r = _fleet("status", inv, "--spec", str(SPEC), *given)
        rows = [ln for ln in r.stdout.splitlines()[1:] if ln.strip()]
        assert r.returncode == 0 and len(rows) == 1, r.out
        assert rows[0].split()[:2] == [f"{inv}:0", lab2.address] and " ok " in rows[0], rows

        r = _fleet("diff", inv, "--spec", str(SPEC), *given)
        assert r.returncode == 0 and "nothing would change on 1 host(s)" in r.out, r.out[-4000:]

        r = _fleet("bench", inv, "--spec", str(SPEC), *given, *BENCH, "--out", str(tmp_path / "bench"))
        assert r.returncode == 0, r.out[-4000:]
        runs = json.loads((tmp_path / "bench" / "bench.json").read_text())["runs"]
        assert runs and all(x["result"]["completed"] >= 2 and not x["result"].get("failed") for x in runs), runs

        r = _fleet("down", inv, "--spec", str(SPEC), *given, "-y")
        assert r.returncode == 0, r.out[-4000:]
        assert lab2.ssh(f"test -e /etc/systemd/system/{UNIT}", user="root", check=False).returncode == 1
        assert lab2.ssh("test -e /etc/nginx/conf.d/vllm-fleet-lab-tiny.conf", user="root", check=False).returncode == 1
        assert lab2.ssh("nginx -t", user="root", check=False).returncode == 0
        r = _fleet("status", inv, "--spec", str(SPEC), *given)
        assert r.returncode == 1 and "down (no unit)" in r.stdout, r.out
    finally:
        lab2.ssh(
            f"systemctl disable --now {UNIT}; rm -f /etc/systemd/system/{UNIT} "
            "/etc/nginx/conf.d/vllm-fleet-lab-tiny.conf; systemctl daemon-reload; systemctl reload nginx",
            user="root",
            check=False,
        )
        print("\ninline times (s):", TIMES)


def _in_lab1(lab1, line: str, timeout: float = 900) -> subprocess.CompletedProcess:
    r = lab1.ssh(f"cd /root && {line}", user="root", check=False, timeout=timeout)
    r.out = r.stdout + r.stderr  # type: ignore[attr-defined]
    return r


def test_at_local_inside_a_lab_host_from_a_wheel(lab_hosts, tmp_path):
    lab1 = lab_hosts[0]
    t0 = time.monotonic()
    wheels = tmp_path / "wheels"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "-w", str(wheels), str(REPO)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    # the spec, the tiny model and the API key where the spec names them (~ is /root there)
    spec = yaml_with_bind(tmp_path / "lab-tiny.yaml")
    tar = subprocess.Popen(["tar", "-C", str(tmp_path), "-cf", "-", "wheels", "lab-tiny.yaml"], stdout=subprocess.PIPE)
    into = subprocess.run(
        [
            *lab1.ssh_argv("root"),
            "rm -rf /opt/vf38 && mkdir -p /opt/vf38 && tar -C /opt/vf38 -xf - && "
            "python3 -m venv /opt/vf38/venv && /opt/vf38/venv/bin/pip install -q --no-index --find-links "
            "/opt/vf38/wheels vllm-fleet",
        ],
        stdin=tar.stdout,
        capture_output=True,
        text=True,
        timeout=900,
    )
    tar.stdout.close()
    assert tar.wait(60) == 0 and into.returncode == 0, into.stderr[-3000:]
    import os

    home = os.path.expanduser("~")
    tar = subprocess.Popen(
        ["tar", "-C", home, "-cf", "-", ".cache/vllm-fleet/models/tiny-llama", ".config/vllm-fleet/lab-tiny.key"],
        stdout=subprocess.PIPE,
    )
    into = subprocess.run(
        [*lab1.ssh_argv("root"), "tar -C /root -xf -"], stdin=tar.stdout, capture_output=True, timeout=300
    )
    tar.stdout.close()
    assert tar.wait(60) == 0 and into.returncode == 0, into.stderr
    TIMES["wheels + install in lab1"] = round(time.monotonic() - t0, 1)
    fleet = "/opt/vf38/venv/bin/vllm-fleet"
    assert _in_lab1(
        lab1, f"/opt/vf38/venv/bin/python -c 'import vllm_fleet; print(vllm_fleet.__file__)'"
    ).stdout.startswith("/opt/vf38/venv/")
    data = _lab_data(lab1.name)
    given = " ".join(
        f"--data {k}={shlex.quote(str(data[k]))}" for k in ("private_address", "pip_cache_dir", "vllm_find_links")
    )
    at = f"@local --spec {spec} {given}"
    try:
        # lab-tiny on lab1 as the control machine deploys it (a no-op when the lab is as it should be)
        r = run([sys.executable, "-m", "vllm_fleet", "deploy", "inventory/lab.py", "--limit", "lab1", "-y"])
        assert r.returncode == 0, r.out[-4000:]

        r = _in_lab1(lab1, f"{fleet} status {at}")
        rows = [ln for ln in r.stdout.splitlines()[1:] if ln.strip()]
        assert r.returncode == 0 and len(rows) == 1 and rows[0].startswith("@local:0 ") and " ok " in rows[0], r.out
        assert "Traceback" not in r.out and "child watchers" not in r.out

        r = _in_lab1(lab1, f"{fleet} diff {at}")
        # lab1 read through @local: every file as the control machine's deploy left it, and
        # pyinfra's own dry run there (diff's operations part) has nothing to do either
        assert r.returncode == 0 and "nothing would change on 1 host(s)" in r.out, r.out[-4000:]
        assert "Could not connect" not in r.out and "cannot read" not in r.out, r.out[-4000:]

        r = _in_lab1(lab1, f"{fleet} bench {at} {' '.join(BENCH)} --out /opt/vf38/bench")
        assert r.returncode == 0, r.out[-4000:]
        runs = json.loads(lab1.ssh("cat /opt/vf38/bench/bench.json", user="root").stdout)["runs"]
        assert runs and all(x["result"]["completed"] >= 2 and not x["result"].get("failed") for x in runs), runs

        r = _in_lab1(lab1, f"{fleet} down {at} -y")
        assert r.returncode == 0, r.out[-4000:]
        assert lab1.ssh(f"test -e /etc/systemd/system/{UNIT}", user="root", check=False).returncode == 1
        assert lab1.ssh("test -e /etc/nginx/conf.d/vllm-fleet-lab-tiny.conf", user="root", check=False).returncode == 1
        assert lab1.ssh("systemctl is-active nginx", user="root").stdout.strip() == "active"  # nginx itself stays
        assert lab1.ssh("nginx -t", user="root", check=False).returncode == 0
        r = _in_lab1(lab1, f"{fleet} status {at}")
        assert r.returncode == 1 and "down (no unit)" in r.stdout, r.out
    finally:
        lab1.ssh("rm -rf /opt/vf38", user="root", check=False)
        back = run([sys.executable, "-m", "vllm_fleet", "deploy", "inventory/lab.py", "--limit", "lab1", "-y"])
        assert back.returncode == 0, back.out[-4000:]
        print("\n@local times (s):", TIMES)


def yaml_with_bind(path):
    """lab-tiny with proxy.bind 0.0.0.0 (nginx's `listen 80`, as the control machine renders lab1):
    @local would bind loopback otherwise, and lab1 serves the lab's network."""
    import yaml

    spec = yaml.safe_load(SPEC.read_text())
    spec["proxy"]["bind"] = "0.0.0.0"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return "/opt/vf38/lab-tiny.yaml"
