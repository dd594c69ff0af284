import os
import shutil
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
DEPLOYMENTS = sorted((REPO / "deployments").glob("*.yaml"))


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the installed `vllm-fleet` console script as a user would (a separate process)."""
    exe = shutil.which("vllm-fleet", path=os.path.dirname(sys.executable)) or shutil.which("vllm-fleet")
    cmd = [exe, *args] if exe else [sys.executable, "-m", "vllm_fleet", *args]
    return subprocess.run(cmd, cwd=cwd or REPO, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=120)

