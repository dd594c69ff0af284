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



def require_vllm_venv():
    """The vLLM CPU venv's python; skip (or fail under VLLM_FLEET_REQUIRE_VLLM) when not built."""
    import pytest

    from vllm_fleet import vllmcpu

    if not vllmcpu.is_built():
        msg = (f"vLLM CPU venv not built at {vllmcpu.venv_dir()} "
               "(python -m vllm_fleet.vllmcpu ensure)")
        if os.environ.get("VLLM_FLEET_REQUIRE_VLLM"):
            pytest.fail(msg + " and VLLM_FLEET_REQUIRE_VLLM is set")
        pytest.skip(msg)
    return vllmcpu.venv_python()
