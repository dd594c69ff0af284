"""What a person reads when a run is cut short or cannot ask (issue 24): Ctrl-C during a pyinfra
run, `deploy`/`down` without -y and without a terminal, and the closing summary of a deploy.

pyinfra runs for real against @local (a `sleep` as the long step): the SIGINT goes to the process
group (a terminal's Ctrl-C), to the pyinfra child alone, and to the parent alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_fleet_commands import ONE_HOST, _args, _inventory, _spec
from vllm_fleet.commands import deploy as deploycmd

REPO = Path(__file__).resolve().parents[1]
RUNNER = """
import sys
from vllm_fleet.host.pyinfra_run import run
sys.exit(
    run(["pyinfra", "@local", "exec", "-y", "--", "sleep", "30"], "vllm-fleet deploy", "vllm-fleet deploy inv.py -y")
)
"""


def _start(tmp_path: Path, code: str) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / "out.txt"
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        stdout=out.open("w"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while "Starting operation" not in out.read_text():  # the long step runs
        assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
        time.sleep(0.2)
    time.sleep(0.5)
    return proc, out


@pytest.mark.parametrize("to", ["group", "child", "parent"])
def test_ctrl_c_exits_130_with_one_line_and_no_traceback(tmp_path, to):
    proc, out = _start(tmp_path, RUNNER)
    if to == "group":
        os.killpg(proc.pid, signal.SIGINT)
    elif to == "parent":
        os.kill(proc.pid, signal.SIGINT)
    else:
        child = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert child, out.read_text()
        os.kill(int(child[0]), signal.SIGINT)
    rc = proc.wait(timeout=60)
    text = out.read_text()
    assert rc == 130, text
    assert "Traceback" not in text and "LoopExit" not in text and "Exiting upon user request" not in text, text
    lines = [ln for ln in text.splitlines() if "interrupted" in ln]
    assert lines == [lines[0]] and lines[0].startswith("vllm-fleet deploy: interrupted (Ctrl-C)"), text
    assert "may still run there" in lines[0] and "`vllm-fleet deploy inv.py -y`" in lines[0]


def test_bare_pyinfra_of_a_packaged_deploy_exits_130(tmp_path):
    """The deploy file installs the handler when pyinfra loads it (a bare `pyinfra INV deploys/serve.py`)."""
    deploy = tmp_path / "slow.py"
    deploy.write_text(
        "from pyinfra.operations import server\nfrom vllm_fleet.host.pyinfra_run import install_sigint\n"
        "install_sigint()\nserver.shell(name='slow', commands=['sleep 30'])\n"
    )
    pyinfra = str(Path(sys.executable).parent / "pyinfra")
    proc, out = _start(tmp_path, f"import os; os.execv({pyinfra!r}, [{pyinfra!r}, '-y', '@local', {str(deploy)!r}])")
    os.killpg(proc.pid, signal.SIGINT)
    rc = proc.wait(timeout=60)
    text = out.read_text()
    assert rc == 130 and "Traceback" not in text and "pyinfra: interrupted (Ctrl-C)" in text, text


def test_deploy_and_down_without_a_terminal_refuse_before_any_host(tmp_path):
    spec = _spec(tmp_path)
    inv = _inventory(tmp_path, ONE_HOST)
    vf = str(Path(sys.executable).parent / "vllm-fleet")
    for verb in ("deploy", "down"):
        r = subprocess.run(
            [vf, verb, str(inv), "--spec", str(spec)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=120,
        )
        assert r.returncode == 2, r.stderr
        assert (
            f"vllm-fleet {verb}: no terminal to confirm: add -y" in r.stderr and "Traceback" not in r.stderr + r.stdout
        )
        assert "Press enter" not in r.stderr + r.stdout
    assert not (tmp_path / "pyinfra-debug.log").exists()
    assert not (tmp_path / "keys").exists()  # nothing generated either


def test_closing_summary_names_endpoint_client_files_and_key_file_never_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    spec = _spec(tmp_path)
    inv = _inventory(tmp_path, ONE_HOST)
    deployments, _ = deploycmd.plan(str(inv), str(spec))
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "lab-tiny.key").write_text("sk-secret-value\n")
    lines = deploycmd.closing_summary(deployments)
    text = "\n".join(lines)
    env = tmp_path / "home" / ".config" / "vllm-fleet" / "lab-tiny" / "openai.env"
    assert env.is_file() and "OPENAI_BASE_URL=http://192.0.2.10/v1" in env.read_text()
    assert "endpoint:  http://192.0.2.10/v1" in text
    assert "~/.config/vllm-fleet/lab-tiny/openai.env" in text
    assert str(tmp_path / "keys" / "lab-tiny.key") in text and "sk-secret-value" not in text
    try_it = next(ln for ln in lines if "try it:" in ln).split("try it:", 1)[1].strip()
    assert try_it.startswith("curl -s -H \"Authorization: Bearer $(cat ") and try_it.endswith(
        "http://192.0.2.10/v1/models"
    )
