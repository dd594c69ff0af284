"""The whole flow of "Use it on your own servers", from a wheel installed in a fresh venv outside
the checkout, against lab1 as a user's own host (their inventory, no lab defaults):

    vllm-fleet init DIR                 -> a spec (edited for the CPU lab) + an inventory skeleton
    vllm-fleet deploy  -> serving       (curl through nginx)
    vllm-fleet diff    -> exit 0        (nothing would change)
    a spec change      -> diff exit 1, the changed line shown, the key never
    vllm-fleet deploy  -> the unit has the new flag (ssh systemctl show)
    vllm-fleet down    -> unit, env files, site gone (ssh, systemctl, nginx -t, curl); env and
                          weights kept; a second down changes nothing
    vllm-fleet diff    -> exit 1, every file to add

The deployment is lab-tiny's (same name, so the environment and weights an earlier lab test
installed on lab1 are reused; the pip cache is the lab's shared one). Time per step: printed and
in .pytest_cache/own-servers.json.
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

from labkit import REPO

pytestmark = pytest.mark.lab

TIMES: dict[str, float] = {}


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_FLEET_SPEC", "VIRTUAL_ENV")}
    env["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return env


@pytest.fixture(scope="module")
def tool(tmp_path_factory):
    """`vllm-fleet` of a wheel built from this checkout, installed in a new venv outside it."""
    t0 = time.monotonic()
    base = tmp_path_factory.mktemp("own-servers")
    wheels = base / "wheels"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(REPO)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = wheels.glob("vllm_fleet-*.whl")
    venv = base / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", str(venv)], check=True, timeout=300)
    r = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(wheel)], capture_output=True, text=True,
                       timeout=900, env=_clean_env())
    assert r.returncode == 0, r.stderr[-2000:]
    TIMES["wheel build + venv install"] = round(time.monotonic() - t0, 1)
    work = base / "infra"
    work.mkdir()
    yield {"bin": str(venv / "bin" / "vllm-fleet"), "work": work, "venv": venv}
    (REPO / ".pytest_cache").mkdir(exist_ok=True)
    (REPO / ".pytest_cache" / "own-servers.json").write_text(json.dumps(TIMES, indent=2))
    print("\nown-servers times (s):", TIMES)


def fleet(tool, *args: str, step: str | None = None, timeout: float = 1800) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    r = subprocess.run([tool["bin"], *args], cwd=tool["work"], capture_output=True, text=True, timeout=timeout,
                       env=_clean_env(), stdin=subprocess.DEVNULL)
    if step:
        TIMES[step] = round(time.monotonic() - t0, 1)
    r.out = r.stdout + r.stderr  # type: ignore[attr-defined]
    return r


def changed(out: str) -> str:
    m = re.search(r"Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", out)
    assert m, out[-3000:]
    return m.group(2)


def curl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["curl", "-s", "--max-time", "30", *args], capture_output=True, text=True, timeout=60)


def test_the_whole_flow_from_a_wheel(tool, lab_hosts):
    lab1 = lab_hosts[0]
    work = tool["work"]
    # the package is the wheel's, not this checkout's
    where = subprocess.run([str(tool["venv"] / "bin" / "python"), "-c", "import vllm_fleet; print(vllm_fleet.__file__)"],
                           capture_output=True, text=True, cwd=work, env=_clean_env()).stdout.strip()
    assert where.startswith(str(tool["venv"])), where

    # init, then the spec edited for the CPU lab (lab-tiny's values) and the inventory for lab1
    r = fleet(tool, "init", ".")
    assert r.returncode == 0, r.out
    spec_file = work / "deployment.yaml"
    head = spec_file.read_text().splitlines()[0]
    assert head.startswith("# yaml-language-server: $schema=file://" + str(tool["venv"]))
    spec = yaml.safe_load(spec_file.read_text())
    lab = yaml.safe_load((REPO / "deployments" / "lab-tiny.yaml").read_text())
    spec["name"] = "lab-tiny"
    spec["model"] = lab["model"]
    spec["engine"] = lab["engine"]
    spec["server"] = lab["server"]
    spec["proxy"] = lab["proxy"]
    spec["install"] = lab["install"]
    spec["hardware"] = lab["hardware"]

    def write_spec():
        spec_file.write_text(head + "\n" + yaml.safe_dump(spec, sort_keys=False))

    write_spec()
    assert fleet(tool, "validate", "deployment.yaml").returncode == 0
    sys.path.insert(0, str(REPO))
    from vllm_fleet.lab.inventory import lab_hosts as lab_inventory

    data = dict(dict(lab_inventory()[0])["lab1"])
    data.pop("lab_kind")  # a user's own host: no lab defaults
    text = (work / "inventory.py").read_text()
    text = text[:text.index("servers = [")] + f"servers = [('lab1', {{**{data!r}, **_CONNECT}})]\nproxy = ['lab1']\n"
    (work / "inventory.py").write_text(text.replace('"ssh_user": "ubuntu", ', ""))

    r = fleet(tool, "deploy", "inventory.py", "-y", step="deploy")
    assert r.returncode == 0, r.out[-4000:]
    key = Path(os.path.expanduser(lab["server"]["api_key"]["file"])).read_text().strip()
    models = curl("-H", f"Authorization: Bearer {key}", f"http://{lab1.address}/v1/models")
    assert json.loads(models.stdout)["data"][0]["id"] == "tiny"

    r = fleet(tool, "diff", "inventory.py", step="diff (no changes)")
    assert r.returncode == 0, r.out[-4000:]
    assert "nothing would change on 1 host(s)" in r.out

    spec["engine"]["max_num_seqs"] = 8
    write_spec()
    r = fleet(tool, "diff", "inventory.py", step="diff (a change)")
    assert r.returncode == 1, r.out[-4000:]
    assert re.search(r"^-ExecStart=.*--max-num-seqs 16", r.stdout, re.M) and re.search(r"^\+ExecStart=.*--max-num-seqs 8", r.stdout, re.M)
    assert key not in r.out

    r = fleet(tool, "deploy", "inventory.py", "-y", step="deploy (the change)")
    assert r.returncode == 0, r.out[-4000:]
    assert "--max-num-seqs 8" in lab1.ssh("systemctl show -p ExecStart --value vllm-lab-tiny-0.service").stdout

    r = fleet(tool, "down", "inventory.py", "-y", step="down")
    assert r.returncode == 0, r.out[-4000:]
    for path in ("/etc/systemd/system/vllm-lab-tiny-0.service", "/etc/vllm-fleet/lab-tiny", "/etc/nginx/conf.d/vllm-fleet-lab-tiny.conf",
                 "/etc/nginx/vllm-fleet/lab-tiny-auth.conf"):
        assert lab1.ssh(f"test -e {path}", user="root", check=False).returncode == 1, path
    assert lab1.ssh("systemctl is-active vllm-lab-tiny-0.service", user="root", check=False).stdout.strip() in ("inactive", "unknown")
    assert "vllm-lab-tiny-0.service" not in lab1.ssh("systemctl list-unit-files --no-legend 'vllm-lab-tiny-*'", user="root", check=False).stdout
    assert lab1.ssh("nginx -t", user="root", check=False).returncode == 0
    assert lab1.ssh("systemctl is-active nginx", user="root").stdout.strip() == "active"
    assert "vllm_fleet" not in lab1.ssh("nft list ruleset", user="root", check=False).stdout
    assert curl("-o", "/dev/null", "-w", "%{http_code}", "-H", f"Authorization: Bearer {key}",
                f"http://{lab1.address}/v1/models").stdout != "200"
    # environment and weights stay (no --purge)
    assert lab1.ssh("test -x /opt/vllm-fleet/lab-tiny/env/bin/python && test -d /var/lib/vllm-fleet/lab-tiny/model",
                    user="root", check=False).returncode == 0

    r = fleet(tool, "down", "inventory.py", "-y", step="down (again)")
    assert r.returncode == 0 and changed(r.out) == "-", r.out[-3000:]

    r = fleet(tool, "diff", "inventory.py", "--files-only", step="diff (after down)")
    assert r.returncode == 1, r.out[-3000:]
    assert "+ /etc/systemd/system/vllm-lab-tiny-0.service: new" in r.out and "+ /etc/nginx/conf.d/vllm-fleet-lab-tiny.conf: new" in r.out
    assert "+ /etc/vllm-fleet/lab-tiny/secrets.env: new (secret, content not shown)" in r.out and key not in r.out
