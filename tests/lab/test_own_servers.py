"""The whole flow of "Use it on your own servers", from a wheel installed in a fresh venv outside
the checkout, against lab1 as a user's own host (their inventory, no lab defaults):

    vllm-fleet init DIR                 -> a spec (edited for the CPU lab) + an inventory skeleton
    vllm-fleet deploy (no -y, no TTY)   -> refused before any host, exit 2
    vllm-fleet deploy  -> serving       (curl through nginx); the closing summary's endpoint, client
                                        files, key file (never the key) and its command, run
    ...the change's deploy              -> progress lines of the health wait (plain, no control codes)
    a second deployment on lab-tiny's ports -> refused before any upload, nginx files unchanged
    ...on its own ports, Ctrl-C (SIGINT to the process group) during its wheelhouse upload, after
       the upload's progress lines (bytes of total, rate) -> exit 130, one line, no traceback;
       `down --purge` of it
    a site nginx rejects (a hand-made default server on the new port) -> exit 4 (its only host failed: nothing done),
    the previous site
                                        back, nginx -t passes, still serving
    vllm-fleet diff    -> exit 0        (nothing would change)
    a spec change      -> diff exit 1, the changed line shown, the key never
    vllm-fleet deploy  -> the unit has the new flag (ssh systemctl show)
    vllm-fleet down    -> unit, env files, site gone (ssh, systemctl, nginx -t, curl); env and
                          weights kept; a second down changes nothing
    vllm-fleet diff    -> exit 1, every file to add
    deploy, then down  -> the host as before the deploy: files, units, nft tables, listening
                          ports (labkit.footprint: find, sha256sum, systemctl, nft, ss)

The deployment is lab-tiny's (same name, so the environment and weights an earlier lab test
installed on lab1 are reused; the pip cache is the lab's shared one). Time per step: printed and
in .pytest_cache/own-servers.json.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from labkit import REPO, footprint, footprint_diff

pytestmark = pytest.mark.lab

TIMES: dict[str, float] = {}


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_FLEET_SPEC", "VIRTUAL_ENV")}
    env["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    env["VLLM_FLEET_PROGRESS_INTERVAL"] = "1"  # progress lines every second (10 s by default)
    return env


PROGRESS_UPLOAD = re.compile(
    r"^\s+\[lab1\] (?:[^|\n]+\| )*Upload the wheelhouse to /opt/vllm-fleet/own-b/wheelhouse: "
    r"[\d.]+ (?:kB|MB|GB|bytes) of [\d.]+ (?:kB|MB|GB) \([\d.]+ (?:kB|MB|GB|bytes)/s\), \d+ s$",
    re.M,
)
PROGRESS_WAIT = re.compile(
    r"^\s+\[lab1\] (?:[^|\n]+\| )*Wait for vllm-lab-tiny-0\.service[^\n]*: \d+ s, waiting for the unit to answer$", re.M
)


@pytest.fixture(scope="module")
def tool(tmp_path_factory):
    """`vllm-fleet` of a wheel built from this checkout, installed in a new venv outside it."""
    t0 = time.monotonic()
    base = tmp_path_factory.mktemp("own-servers")
    wheels = base / "wheels"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(REPO)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = wheels.glob("vllm_fleet-*.whl")
    venv = base / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", str(venv)], check=True, timeout=300)
    r = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", str(wheel)],
        capture_output=True,
        text=True,
        timeout=900,
        env=_clean_env(),
    )
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
    r = subprocess.run(
        [tool["bin"], *args],
        cwd=tool["work"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_clean_env(),
        stdin=subprocess.DEVNULL,
    )
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
    where = subprocess.run(
        [str(tool["venv"] / "bin" / "python"), "-c", "import vllm_fleet; print(vllm_fleet.__file__)"],
        capture_output=True,
        text=True,
        cwd=work,
        env=_clean_env(),
    ).stdout.strip()
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
    text = text[: text.index("servers = [")] + f"servers = [('lab1', {{**{data!r}, **_CONNECT}})]\nproxy = ['lab1']\n"
    (work / "inventory.py").write_text(text.replace('"ssh_user": "ubuntu", ', ""))

    # lab1 is shared by the lab tests: another deployment one left running on lab-tiny's ports would
    # (rightly) be refused as a clash below; stop it as the other tests' teardowns do
    lab1.ssh(
        "for u in $(cd /etc/systemd/system && ls vllm-*.service 2>/dev/null | grep -v "
        "'^vllm-lab-tiny-[0-9]*\\.service$'); do systemctl disable --now $u; done; "
        "for f in /etc/nginx/conf.d/vllm-fleet-*.conf; do [ -e \"$f\" ] && [ \"$f\" != "
        "/etc/nginx/conf.d/vllm-fleet-lab-tiny.conf ] && rm -f \"$f\"; done; systemctl reload nginx 2>/dev/null; true",
        user="root",
        check=False,
    )

    # without -y and without a terminal: refused before any host, no traceback, no debug log here
    r = fleet(tool, "deploy", "inventory.py", step="deploy without -y, no terminal")
    assert r.returncode == 2 and "vllm-fleet deploy: no terminal to confirm: add -y" in r.stderr, r.out[-3000:]
    assert "Traceback" not in r.out and "Press enter" not in r.out and not (work / "pyinfra-debug.log").exists()

    r = fleet(tool, "deploy", "inventory.py", "-y", step="deploy")
    assert r.returncode == 0, r.out[-4000:]
    key = Path(os.path.expanduser(lab["server"]["api_key"]["file"])).read_text().strip()
    models = curl("-H", f"Authorization: Bearer {key}", f"http://{lab1.address}/v1/models")
    assert json.loads(models.stdout)["data"][0]["id"] == "tiny"
    # the closing summary: where it serves, the client files, where the key is (never the key), a command to try
    assert f"  endpoint:  http://{lab1.address}/v1" in r.stdout, r.stdout[-2000:]
    assert (
        "~/.config/vllm-fleet/lab-tiny/openai.json" in r.stdout
        and "~/.config/vllm-fleet/lab-tiny/openai.env" in r.stdout
    )
    assert lab["server"]["api_key"]["file"] in r.stdout and key not in r.out
    assert (
        json.loads(Path(os.path.expanduser("~/.config/vllm-fleet/lab-tiny/openai.json")).read_text())["base_url"]
        == f"http://{lab1.address}/v1"
    )
    try_it = next(ln for ln in r.stdout.splitlines() if "try it:" in ln).split("try it:", 1)[1].strip()
    tried = subprocess.run(["bash", "-c", try_it], capture_output=True, text=True, timeout=60)
    assert json.loads(tried.stdout)["data"][0]["id"] == "tiny", (try_it, tried.stdout, tried.stderr)
    assert "\x1b" not in r.out  # no control codes without a terminal

    r = fleet(tool, "diff", "inventory.py", step="diff (no changes)")
    assert r.returncode == 0, r.out[-4000:]
    assert "nothing would change on 1 host(s)" in r.out

    spec["engine"]["max_num_seqs"] = 8
    write_spec()
    r = fleet(tool, "diff", "inventory.py", step="diff (a change)")
    assert r.returncode == 1, r.out[-4000:]
    assert re.search(r"^-ExecStart=.*--max-num-seqs 16", r.stdout, re.M) and re.search(
        r"^\+ExecStart=.*--max-num-seqs 8", r.stdout, re.M
    )
    assert key not in r.out

    r = fleet(tool, "deploy", "inventory.py", "-y", step="deploy (the change)")
    assert r.returncode == 0, r.out[-4000:]
    assert "--max-num-seqs 8" in lab1.ssh("systemctl show -p ExecStart --value vllm-lab-tiny-0.service").stdout
    # the restart's health wait said what it waits for while it waited (plain lines)
    assert len(PROGRESS_WAIT.findall(r.stdout + r.stderr)) >= 2, r.out[-4000:]

    other_deployment_steps(tool, lab1, spec, key)
    nginx_rollback_step(tool, lab1, spec, write_spec, key)

    r = fleet(tool, "down", "inventory.py", "-y", step="down")
    assert r.returncode == 0, r.out[-4000:]
    for path in (
        "/etc/systemd/system/vllm-lab-tiny-0.service",
        "/etc/vllm-fleet/lab-tiny",
        "/etc/nginx/conf.d/vllm-fleet-lab-tiny.conf",
        "/etc/nginx/vllm-fleet/lab-tiny-auth.conf",
    ):
        assert lab1.ssh(f"test -e {path}", user="root", check=False).returncode == 1, path
    assert lab1.ssh("systemctl is-active vllm-lab-tiny-0.service", user="root", check=False).stdout.strip() in (
        "inactive",
        "unknown",
    )
    assert (
        "vllm-lab-tiny-0.service"
        not in lab1.ssh("systemctl list-unit-files --no-legend 'vllm-lab-tiny-*'", user="root", check=False).stdout
    )
    assert lab1.ssh("nginx -t", user="root", check=False).returncode == 0
    assert lab1.ssh("systemctl is-active nginx", user="root").stdout.strip() == "active"
    assert "vllm_fleet" not in lab1.ssh("nft list ruleset", user="root", check=False).stdout
    assert (
        curl(
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-H",
            f"Authorization: Bearer {key}",
            f"http://{lab1.address}/v1/models",
        ).stdout
        != "200"
    )
    # no unit left "not-found failed" (the host would be "degraded"), no install-time wheels in the prefix
    assert not lab1.ssh(
        "systemctl list-units --all --no-legend 'vllm-lab-tiny-[0-9]*.service'", user="root", check=False
    ).stdout.strip()
    for sub in ("wheelhouse", "find-links", "uv-cache"):
        assert lab1.ssh(f"test -e /opt/vllm-fleet/lab-tiny/{sub}", user="root", check=False).returncode == 1, sub
    # environment and weights stay (no --purge)
    assert (
        lab1.ssh(
            "test -x /opt/vllm-fleet/lab-tiny/env/bin/python && test -d /var/lib/vllm-fleet/lab-tiny/model",
            user="root",
            check=False,
        ).returncode
        == 0
    )

    r = fleet(tool, "down", "inventory.py", "-y", step="down (again)")
    assert r.returncode == 0 and changed(r.out) == "-", r.out[-3000:]

    r = fleet(tool, "diff", "inventory.py", "--files-only", step="diff (after down)")
    assert r.returncode == 1, r.out[-3000:]
    assert (
        "+ /etc/systemd/system/vllm-lab-tiny-0.service: new" in r.out
        and "+ /etc/nginx/conf.d/vllm-fleet-lab-tiny.conf: new" in r.out
    )
    assert "+ /etc/vllm-fleet/lab-tiny/secrets.env: new (secret, content not shown)" in r.out and key not in r.out

    # (issue 22) `down` leaves the host as the deploy found it: deploy again onto this state (the
    # environment and weights in place, nothing else), then down, and compare what plain readers see
    before = footprint(lab1)
    r = fleet(tool, "deploy", "inventory.py", "-y", step="deploy (onto the state down left)")
    assert r.returncode == 0, r.out[-4000:]
    assert (
        json.loads(curl("-H", f"Authorization: Bearer {key}", f"http://{lab1.address}/v1/models").stdout)["data"][0][
            "id"
        ]
        == "tiny"
    )
    assert footprint_diff(before, footprint(lab1)), "the deploy changed nothing the footprint sees: it cannot tell"
    r = fleet(tool, "down", "inventory.py", "-y", step="down (back to the state before)")
    assert r.returncode == 0, r.out[-4000:]
    left = footprint_diff(before, footprint(lab1))
    assert not left, "\n".join(left)


def other_deployment_steps(tool, lab1, spec, key):
    """A second deployment (own-b) on lab1 from the same inventory, as another team would put it:
    on lab-tiny's ports it is refused before any upload; on its own ports, Ctrl-C during its
    wheelhouse upload (after the progress lines) exits 130 with one line and no traceback."""
    from vllm_fleet.lab import vllmcpu

    work = tool["work"]
    b = {**spec, "name": "own-b"}
    (work / "own-b.yaml").write_text(yaml.safe_dump(b, sort_keys=False))
    nginx_before = lab1.ssh("sha256sum /etc/nginx/conf.d/*.conf", user="root").stdout
    r = fleet(tool, "deploy", "inventory.py", "--spec", "own-b.yaml", "-y", step="deploy: a clash refused")
    assert r.returncode == 4, r.out[-3000:]
    assert "host lab1: another vllm-fleet deployment already on this host is in the way" in r.out, r.out[-3000:]
    assert "port 8000 (vllm-own-b-0.service) is taken by deployment 'lab-tiny' (vllm-lab-tiny-0.service)" in r.out
    assert (
        "nginx port 80: both are the default server (/etc/nginx/conf.d/vllm-fleet-lab-tiny.conf of deployment "
        "'lab-tiny')" in r.out
    )
    assert "Upload" not in r.out and "Traceback" not in r.out
    assert (
        lab1.ssh(
            "test -e /opt/vllm-fleet/own-b || test -e /etc/systemd/system/vllm-own-b-0.service",
            user="root",
            check=False,
        ).returncode
        == 1
    )
    assert lab1.ssh("sha256sum /etc/nginx/conf.d/*.conf", user="root").stdout == nginx_before

    # own ports, and a wheelhouse of its own to upload (the CPU build's wheels, ~180 MB): Ctrl-C mid-upload
    b["server"] = {**b["server"], "port": 8100}
    b["proxy"] = {**b["proxy"], "listen": 8081}
    b["install"] = {**b["install"], "wheelhouse": str(vllmcpu.find_links_dir())}
    (work / "own-b.yaml").write_text(yaml.safe_dump(b, sort_keys=False))
    t0 = time.monotonic()
    out_path = work / "own-b-deploy.log"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            [tool["bin"], "deploy", "inventory.py", "--spec", "own-b.yaml", "-y"],
            cwd=work,
            env=_clean_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            while not PROGRESS_UPLOAD.findall(out_path.read_text()):
                assert proc.poll() is None, out_path.read_text()[-4000:]
                assert time.monotonic() - t0 < 600, out_path.read_text()[-4000:]
                time.sleep(0.3)
            os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole process group
            rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    text = out_path.read_text()
    TIMES["deploy: Ctrl-C mid-upload"] = round(time.monotonic() - t0, 1)
    assert rc == 130, text[-4000:]
    assert "Traceback" not in text and "LoopExit" not in text and "Exiting upon user request" not in text, text[-4000:]
    said = [ln for ln in text.splitlines() if "interrupted" in ln]
    assert len(said) == 1 and said[0].startswith("vllm-fleet deploy: interrupted (Ctrl-C): "), text[-3000:]
    assert "may still run there" in said[0] and "`vllm-fleet deploy inventory.py --spec own-b.yaml -y`" in said[0]
    assert "\x1b" not in text  # plain lines without a terminal

    r = fleet(tool, "down", "inventory.py", "--spec", "own-b.yaml", "-y", "--purge", step="down own-b --purge")
    assert r.returncode == 0, r.out[-3000:]
    assert lab1.ssh("test -e /opt/vllm-fleet/own-b", user="root", check=False).returncode == 1
    assert (
        json.loads(curl("-H", f"Authorization: Bearer {key}", f"http://{lab1.address}/v1/models").stdout)["data"][0][
            "id"
        ]
        == "tiny"
    )


def nginx_rollback_step(tool, lab1, spec, write_spec, key):
    """A site nginx rejects (a hand-made default server on the new proxy.listen port): the deploy
    fails, the previous site is back, `nginx -t` passes and the service still answers on port 80."""
    site = "/etc/nginx/conf.d/vllm-fleet-lab-tiny.conf"
    before = lab1.ssh(f"sha256sum {site}", user="root").stdout
    lab1.ssh(
        "printf 'server {\\n    listen 8082 default_server;\\n    return 204;\\n}\\n' > "
        "/etc/nginx/conf.d/zz-hand-made.conf && nginx -t",
        user="root",
    )
    try:
        spec["proxy"]["listen"] = 8082
        write_spec()
        r = fleet(tool, "deploy", "inventory.py", "-y", step="deploy: a site nginx rejects")
        assert r.returncode == 4, r.out[-3000:]
        assert "a duplicate default server for 0.0.0.0:8082" in r.out, r.out[-3000:]
        assert "its previous nginx files are back and nginx was not reloaded" in r.out
        assert lab1.ssh("nginx -t", user="root", check=False).returncode == 0
        assert lab1.ssh(f"sha256sum {site}", user="root").stdout == before
        assert (
            json.loads(curl("-H", f"Authorization: Bearer {key}", f"http://{lab1.address}/v1/models").stdout)["data"][
                0
            ]["id"]
            == "tiny"
        )
    finally:
        lab1.ssh("rm -f /etc/nginx/conf.d/zz-hand-made.conf", user="root")
        spec["proxy"]["listen"] = 80
        write_spec()
