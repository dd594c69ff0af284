"""The wheel holds every file of the package git tracks: a script, template or schema the roles
read at run time that is missing from package-data works from the checkout and fails for a user
who installed the wheel (issue 16's host_state.sh did: test_own_servers caught it on the lab)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_tracked_package_file_is_in_the_wheel(tmp_path):
    # built from a copy of the tracked files (the checkout's build/ keeps files of earlier builds)
    src = tmp_path / "src"
    tracked = subprocess.run(
        ["git", "ls-files", "vllm_fleet"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    for rel in [*tracked, "pyproject.toml", "README.md"]:
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel, follow_symlinks=True)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "out"), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp_path / "out").glob("vllm_fleet-*.whl")
    inside = set(zipfile.ZipFile(wheel).namelist())
    missing = [f for f in tracked if f not in inside and "__pycache__" not in f]
    assert not missing, f"not in the wheel (add them to [tool.setuptools.package-data] in pyproject.toml): {missing}"
