"""A minimal Debian 12 (what a fresh machine or a cloud image may be) can run the set-up commands:
it lacks python3-venv (ensurepip), git and even make, so `make host-deps` must install them.

- always (cheap): the Makefile's host packages name what a minimal Debian 12 lacks;
- opt-in, VLLM_FLEET_MINBASE=1 (minutes: a Debian root and `make host-deps` in it): inside a root
  built as the lab builds its own (mmdebstrap --variant=minbase bookworm, the tarball cached
  under /var/cache/vllm-fleet/minbase/), `apt-get install make`, then `make host-deps venv` in a
  copy of this checkout (a chroot in its own mount namespace), and the venv's `vllm-fleet
  --version` runs. Needs root and mmdebstrap (make host-deps on the control machine).
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("VLLM_FLEET_CACHE", "/var/cache/vllm-fleet")) / "minbase"


def host_packages() -> list[str]:
    text = (REPO / "Makefile").read_text()
    m = re.search(r"^HOST_PACKAGES := (.*)$", text, re.M)
    assert m, "Makefile: no HOST_PACKAGES line"
    return m.group(1).split()


def test_host_packages_cover_what_a_minimal_debian_lacks():
    pkgs = host_packages()
    # python3-venv: `python3 -m venv` (make venv); git: a fresh clone, pip's VCS installs;
    # make: this Makefile (a bootstrap says `apt-get install make` first); curl: the lab, the docs.
    for p in ("python3", "python3-venv", "make", "git", "curl", "ca-certificates"):
        assert p in pkgs, f"Makefile HOST_PACKAGES lacks {p}"
    assert "$(PYTHON) -m venv $(VENV)" in (REPO / "Makefile").read_text()


def _minbase_tarball() -> Path:
    """mmdebstrap --variant=minbase bookworm with this machine's apt sources (as lab/rootfs.sh)."""
    sources = next(
        (
            f
            for f in ("/etc/apt/sources.list.d/debian.sources", "/etc/apt/sources.list")
            if Path(f).is_file() and "bookworm" in Path(f).read_text()
        ),
        None,
    )
    assert sources, "no Debian bookworm apt sources on this machine"
    key = hashlib.sha256(Path(sources).read_bytes() + b"minbase-1").hexdigest()[:12]
    tarball = CACHE / f"minbase-bookworm-{key}.tar.zst"
    if not tarball.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        part = tarball.with_name(
            tarball.name.replace(".tar.zst", ".part.tar.zst")
        )  # mmdebstrap: format from the suffix
        r = subprocess.run(
            ["mmdebstrap", "--quiet", "--variant=minbase", "bookworm", str(part), sources],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        os.replace(part, tarball)
    return tarball


@pytest.mark.skipif(
    os.environ.get("VLLM_FLEET_MINBASE") != "1",
    reason="minutes of apt and pip in a Debian root: set VLLM_FLEET_MINBASE=1 to run it",
)
def test_make_host_deps_venv_in_a_minimal_debian_12(tmp_path):
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("mmdebstrap"):
        pytest.fail("needs root, unshare and mmdebstrap (make host-deps)", pytrace=False)
    root = tmp_path / "root"
    root.mkdir()
    subprocess.run(["tar", "--zstd", "-xf", str(_minbase_tarball()), "-C", str(root)], check=True, timeout=300)
    # what a minimal Debian 12 lacks, before: the claim this test rests on
    assert not (root / "usr/lib/python3.11/ensurepip").exists() and not (root / "usr/bin/make").exists()
    src = root / "src"
    src.mkdir()
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for f in filter(None, files):
        p = REPO / f.decode()
        if p.is_file():
            (src / f.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, src / f.decode())
    # a chroot in its own mount namespace (nothing leaks to this machine): /proc, /dev, /sys, the
    # resolver and this machine's pip index settings (directories bound read-only), as a user's would be
    mounts = [
        "mount -t proc proc R/proc",
        "mount --rbind /dev R/dev",
        "mount -t sysfs sys R/sys",
        "cp -L /etc/resolv.conf R/etc/",
    ]
    for d in ("/opt/wheels", "/opt/pypi", "/opt/pypi-more", "/etc/xdg/pip"):
        if Path(d).exists():
            mounts += [f"mkdir -p R{d}", f"mount --bind {d} R{d}", f"mount -o remount,bind,ro R{d}"]
    pip_env = {k: v for k, v in os.environ.items() if k.startswith("PIP_") or k.lower().endswith("_proxy")}
    cert = pip_env.get("PIP_CERT")
    if cert and Path(cert).is_file():  # this machine's CA bundle (its index may sit behind a proxy with its own CA)
        mounts += ["touch R/run/host-ca.crt", f"mount --bind {cert} R/run/host-ca.crt"]
        pip_env["PIP_CERT"] = "/run/host-ca.crt"
    env = [
        "env",
        "-i",
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME=/root",
        "LANG=C.UTF-8",
        *(f"{k}={v}" for k, v in pip_env.items()),
    ]
    script = (
        "set -e; export DEBIAN_FRONTEND=noninteractive; apt-get update -qq; apt-get install -y -qq make >/dev/null; "
        "cd /src && make host-deps venv && .venv/bin/vllm-fleet --version"
    )
    inner = (
        " && ".join(m.replace("R/", f"{root}/") for m in mounts)
        + " && exec chroot "
        + str(root)
        + " "
        + " ".join(shlex.quote(a) for a in [*env, "bash", "-c", script])
    )
    r = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", inner],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "vllm-fleet " in r.stdout
