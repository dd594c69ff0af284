"""roles.common.op_per: an operation per path on every host, not per loop turn. pyinfra run for
real (CLI, `--dry --json`) on two @fake hosts whose loops differ, as `down` on a proxy host (an
nginx site to remove) and a server host (none) do: without op_per pyinfra merges and repeats
names; with it, one row per path, the same path on both hosts in one row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DEPLOY = """
from pyinfra import host
from pyinfra.operations import files
from vllm_fleet.roles.common import op_per
paths = ["/x/site.conf", "/x/unit.service"] if host.name.endswith("proxy") else ["/x/unit.service"]
for p in paths:
    if KEYED:
        with op_per(p):
            files.file(name=f"Remove {p}", path=p, present=False)
    else:
        files.file(name=f"Remove {p}", path=p, present=False)
"""


def plan(tmp_path: Path, keyed: bool) -> list[list[str]]:
    deploy = tmp_path / "loop.py"
    deploy.write_text(f"KEYED = {keyed}\n" + DEPLOY)
    pyinfra = str(Path(sys.executable).parent / "pyinfra")
    r = subprocess.run(
        [pyinfra, "@fake/proxy,@fake/server", str(deploy), "--dry", "--json", "-y"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout[r.stdout.find("{") :])
    return [sorted(op["names"]) for op in doc["plan"]]


@pytest.mark.parametrize("keyed", [False, True])
def test_one_row_per_path_on_hosts_with_different_lists(tmp_path, keyed):
    rows = plan(tmp_path, keyed)
    if not keyed:  # what pyinfra does by itself: the first turn of both hosts is one op
        assert rows == [["Remove /x/site.conf", "Remove /x/unit.service"], ["Remove /x/unit.service"]]
    else:
        assert sorted(rows) == [["Remove /x/site.conf"], ["Remove /x/unit.service"]]
