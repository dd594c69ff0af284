#!/usr/bin/env python3
"""Build the offline wheel set for the GPU proof and cut it into parts the device tool can carry.

    .venv/bin/python bench/gpu/build_parts.py [--resolve-only]

1. Resolve ``vllm==VLLM`` + ``pyinfra==PYINFRA`` for CPython 3.12 / manylinux x86_64 with pip's
   own resolver, *as if* the GPU image's packages were installed: every line of
   ``device-freeze.txt`` (``pip list --format=freeze`` read there) becomes a metadata-only stub
   wheel in a scratch find-links folder and a ``==`` constraint, so pip keeps what the image has
   (torch 2.11.0+cu130, triton, transformers, ...) and reports only what is missing.
2. Writes the missing set to ``wheels.txt`` (name==version, one a line, with its size), minus
   ``LEAVE_OUT`` (see below), and downloads those wheels (``--no-deps``) to
   ``PARTS/wheelhouse/``.
3. ``LEAVE_OUT`` packages are hard requirements of vllm but are not needed for dense bf16/AWQ
   models on Hopper and too big for the carry budget: they get metadata-only stand-ins in the
   wheelhouse (name, version, no files) so ``pip install --no-index --find-links`` with dependency
   resolution (the vllm role's command) succeeds. An air-gapped fleet carries the real wheels.
4. tar of the wheelhouse, split into 60 MiB parts ``PARTS/part-NN`` + ``PARTS/SHA256SUMS``.

PARTS is ``.gpu-parts/`` at the repository root (git-ignored). Nothing here touches the GPU
machine; bench/gpu/device.sh unpacks the parts there.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PARTS = ROOT / ".gpu-parts"
VLLM = "0.20.2"
PYINFRA = "3.10.0"
# vllm-router (proxy.routing.policy: cache_aware, issue 23) goes into its own venv on the proxy host,
# where the image's packages are not: its whole closure is carried (real wheels, not the image's).
ROUTER = "0.1.17"
# a device call carries the working tree too (5.5 MiB tracked) within its 64 MiB
PART_BYTES = 52 * 2**20
PLATFORMS = [
    "manylinux_2_35_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
]
# Required by vllm's metadata but unused for dense bf16 / AWQ models on an H200, and large:
# stood in for by metadata-only wheels (see the module docstring).
LEAVE_OUT = {
    "flashinfer-cubin",  # prebuilt kernels, ~96 % for Blackwell (gpu-measurements note)
    "tilelang",
    "z3-solver",
    "quack-kernels",
    "cuda-python",
    "nvidia-cutlass-dsl",
    "nvidia-cutlass-dsl-libs-base",
    "nvidia-cutlass-dsl-libs-core",
    "nvidia-cutlass-dsl-libs-cu12",
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def stub_wheel(folder: Path, name: str, version: str, requires: list[str] = ()) -> Path:
    """A metadata-only wheel: installs a dist-info and nothing else."""
    dist = re.sub(r"[-_.]+", "_", name)
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    di = f"{dist}-{version}.dist-info"
    files = {
        f"{di}/METADATA": "Metadata-Version: 2.1\nName: %s\nVersion: %s\n%s"
        % (name, version, "".join(f"Requires-Dist: {r}\n" for r in requires)),
        f"{di}/WHEEL": "Wheel-Version: 1.0\nGenerator: vllm-fleet-stub\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    with zipfile.ZipFile(path, "w") as z:
        for rel, text in files.items():
            data = text.encode()
            z.writestr(rel, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{rel},sha256={digest},{len(data)}")
        record.append(f"{di}/RECORD,,")
        z.writestr(f"{di}/RECORD", "\n".join(record) + "\n")
    return path


# pip evaluates environment markers (`; python_version > "3.11"`) with the interpreter it runs
# under, not --python-version: resolve with a 3.12 when there is one. Under 3.11 vllm's
# `setuptools<81; python_version > "3.11"` was missed and the install on the GPU machine (setuptools
# 81 there) failed until setuptools 80.10.2 was added to the wheelhouse.
def _python312() -> str:
    import glob

    for cand in [
        shutil.which("python3.12"),
        *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12"))),
    ]:
        if cand and subprocess.run([cand, "-m", "pip", "--version"], capture_output=True).returncode == 0:
            return cand
    print("warning: no python3.12 with pip here: markers are evaluated for this Python", file=sys.stderr)
    return sys.executable


PIP_PYTHON = _python312()


def pip(*args: str, capture: bool = False) -> subprocess.CompletedProcess:
    cmd = [PIP_PYTHON, "-m", "pip", *args]
    print("+", " ".join(cmd[:12]), "...", flush=True)
    if capture:
        return subprocess.run(cmd, text=True, capture_output=True)
    return subprocess.run(cmd, check=True)


def platform_args() -> list[str]:
    out = [
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "--abi",
        "cp312",
        "--abi",
        "abi3",
        "--abi",
        "none",
    ]
    for p in PLATFORMS:
        out += ["--platform", p]
    return out


def resolve(
    report: Path,
    target: Path,
    constraints: Path,
    pinned: dict[str, str],
    args: list[str],
    replaced: Callable[[str, str], None] = lambda n, v: None,
    tries: int = 40,
) -> bool:
    """pip's resolver (``--dry-run --report``) for ``args`` with ``pinned`` as ``==`` constraints;
    a pin that a requirement contradicts is dropped (``replaced`` is told) and pip asked again.
    False when pip fails for another reason (its output is shown) or the pins never settle."""
    for _ in range(tries):
        constraints.write_text("".join(f"{n}=={v}\n" for n, v in sorted(pinned.items())))
        r = pip(
            "install",
            "--dry-run",
            "--ignore-installed",
            "--report",
            str(report),
            "--target",
            str(target),
            *platform_args(),
            "-c",
            str(constraints),
            *args,
            capture=True,
        )
        if r.returncode == 0:
            return True
        clash = re.findall(r"The user requested \(constraint\) ([A-Za-z0-9_.-]+)==", r.stdout + r.stderr)
        if not clash:
            sys.stderr.write(r.stdout[-3000:] + r.stderr[-3000:])
            return False
        for n in clash:
            replaced(n, pinned.pop(norm(n), "?"))
    return False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--resolve-only", action="store_true")
    args = ap.parse_args()
    work = PARTS / "work"
    stubs = work / "device-stubs"
    shutil.rmtree(work, ignore_errors=True)
    stubs.mkdir(parents=True)
    device = {}
    for line in (HERE / "device-freeze.txt").read_text().splitlines():
        if "==" in line:
            n, v = line.strip().split("==", 1)
            device[norm(n)] = v
            stub_wheel(stubs, n, v)
    constraints = work / "device-constraints.txt"
    report = work / "report.json"
    # The image's versions are kept unless vllm/pyinfra pin another one (numba, say): then that
    # constraint is dropped and the pinned version joins the wheel set (pip replaces it there).
    pinned = dict(device)
    stubs_args = ["--find-links", str(stubs)]
    if not resolve(
        report,
        work / "tgt",
        constraints,
        pinned,
        [*stubs_args, f"vllm=={VLLM}", f"pyinfra=={PYINFRA}"],
        lambda n, v: print(f"image's {n}=={v} conflicts: replaced", flush=True),
    ):
        return 1
    items = json.loads(report.read_text())["install"]
    missing = []
    for it in items:
        md = it["metadata"]
        n, v = norm(md["name"]), md["version"]
        if device.get(n) == v:
            continue
        missing.append((n, v, it["download_info"]["url"]))
    lines = []
    for n, v, url in sorted(missing):
        note = (
            "stand-in (LEAVE_OUT)" if n in LEAVE_OUT else (f"replaces the image's {device[n]}" if n in device else "")
        )
        lines.append(f"{n}=={v}" + (f"    # {note}" if note else ""))
    (HERE / "wheels.txt").write_text(
        f"# vllm=={VLLM} + pyinfra=={PYINFRA} on the GPU image (bench/gpu/device-freeze.txt), built by build_parts.py\n"
        + "\n".join(lines)
        + "\n"
    )
    print(
        f"{len(missing)} packages missing on the device ({sum(1 for m in missing if m[0] in LEAVE_OUT)} stood in for)"
    )
    # vllm-router for a fresh venv: its closure without the image's stubs, the versions the image or
    # the vLLM set already has where the router accepts them (one wheel serves both)
    have = {**device, **{n: v for n, v, _ in missing}}
    router_report = work / "router-report.json"
    have.pop("vllm-router", None)
    if not resolve(router_report, work / "rtgt", constraints, have, [f"vllm-router=={ROUTER}"]):
        return 1
    in_set = {(n, v) for n, v, _ in missing}
    router_only = sorted(
        {
            (norm(it["metadata"]["name"]), it["metadata"]["version"])
            for it in json.loads(router_report.read_text())["install"]
        }
        - in_set
    )
    with (HERE / "wheels.txt").open("a") as f:
        f.write(
            f"# vllm-router=={ROUTER}'s venv on the proxy host (not the image's env): these besides the set above\n"
        )
        f.write("".join(f"{n}=={v}    # router venv\n" for n, v in router_only))
    print(f"vllm-router=={ROUTER}: {len(router_only)} more wheels for its own venv")
    if args.resolve_only:
        return 0
    wh = PARTS / "wheelhouse"
    shutil.rmtree(wh, ignore_errors=True)
    wh.mkdir(parents=True)
    real = [f"{n}=={v}" for n, v, _ in missing if n not in LEAVE_OUT]
    pip("download", "--no-deps", *platform_args(), "-d", str(wh), *real, *(f"{n}=={v}" for n, v in router_only))
    for n, v, _ in missing:
        if n in LEAVE_OUT:
            stub_wheel(wh, n, v)
    total = sum(p.stat().st_size for p in wh.iterdir())
    print(f"wheelhouse: {len(list(wh.iterdir()))} files, {total / 2**20:.1f} MiB")
    tar = PARTS / "wheelhouse.tar"
    with tarfile.open(tar, "w") as t:
        t.add(wh, arcname="wheelhouse")
    for old in PARTS.glob("part-*"):
        old.unlink()
    sums = []
    with tar.open("rb") as f:
        i = 0
        while chunk := f.read(PART_BYTES):
            p = PARTS / f"part-{i:02d}"
            p.write_bytes(chunk)
            sums.append(f"{hashlib.sha256(chunk).hexdigest()}  {p.name}")
            i += 1
    sums.append(f"{hashlib.sha256(tar.read_bytes()).hexdigest()}  wheelhouse.tar")
    (PARTS / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    tar.unlink()
    print(f"{i} parts of <= {PART_BYTES >> 20} MiB in {PARTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
