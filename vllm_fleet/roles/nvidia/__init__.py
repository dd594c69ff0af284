"""The nvidia role: the pinned NVIDIA driver branch (DKMS) and CUDA toolkit on Debian 12 /
Ubuntu 22.04 / 24.04 GPU hosts, with the GPUs checked against the spec.

Deploy function
    ``nvidia(spec)``: ``spec`` is the resolved spec dict (``vllm_fleet.spec.load_and_check``).
    Reads ``install.accelerator``, ``install.nvidia.{driver_branch, cuda_version, source,
    open_kernel_modules}`` and ``hardware.{gpu, gpus_per_node}``; host data in
    ``defaults.DEFAULTS`` (``nvidia_reboot``, ``nvidia_reboot_timeout``, ...).

What it does, decided from facts while the plan is built
    - ``install.accelerator: cpu``: nothing.
    - The driver branch already loaded (nvidia-smi answers with ``<branch>.x``) and the toolkit
      installed (or not wanted): nothing but the GPU check.
    - Otherwise, source ``nvidia``: NVIDIA's CUDA apt repository via its keyring package
      (Debian also gets ``contrib``), the branch pinning package ``nvidia-driver-pinning-<branch>``,
      then ``nvidia-open`` (open kernel modules) or ``cuda-drivers``, and ``cuda-toolkit-X-Y``.
      Source ``distro``: Debian's ``nvidia-driver`` (+ ``nvidia-open-kernel-dkms`` or
      ``nvidia-kernel-dkms``, ``firmware-misc-nonfree``; contrib/non-free/non-free-firmware
      enabled; Debian 12 ships branch 535 only) or Ubuntu's ``nvidia-driver-<branch>[-server][-open]``,
      and ``nvidia-cuda-toolkit``.
    - A new driver: ``dkms`` + ``linux-headers-$(uname -r)`` first (the module is rebuilt for every
      later kernel), nouveau blacklisted in /etc/modprobe.d/blacklist-nouveau.conf
      (``update-initramfs -u`` only when that file changed), then a reboot (pyinfra's
      ``server.reboot``, which waits for the host) and a check that nvidia-smi reports the branch
      and the spec's GPUs. A reboot also happens when nouveau is loaded. No reboot when only the
      toolkit was missing.

Failures
    ``GpuMismatch`` (a ``DeployError``, raised while the plan is built, so no host is touched)
    names the host when its GPUs do not match ``hardware.gpu`` x ``hardware.gpus_per_node``;
    after a fresh install the same check runs on the host after the reboot and fails that host.
    ``UnsupportedHost`` for a distribution without a CUDA repository entry, or
    ``source: distro`` with a branch Debian does not ship.

Example (deploys/serve.py)::

    from vllm_fleet.spec import load_and_check
    from vllm_fleet.roles.nvidia import nvidia

    spec, _warnings = load_and_check("deployments/rtx3090-qwen7b-awq-realtime.yaml")
    nvidia(spec)
"""

from __future__ import annotations

import shlex
from io import StringIO

from pyinfra import host, logger
from pyinfra.api import deploy
from pyinfra.api.exceptions import DeployError
from pyinfra.facts.deb import DebPackages
from pyinfra.facts.server import KernelModules, KernelVersion, LinuxDistribution
from pyinfra.operations import apt, files, python, server

from . import defaults as d
from .defaults import DEFAULTS
from .facts import NVIDIA_SMI_COMMAND, AptComponents, NvidiaGpus, driver_branch
from .gpucheck import describe, gpu_mismatch

__all__ = ["nvidia", "GpuMismatch", "UnsupportedHost", "cuda_repo_dir", "DEFAULTS"]

NOUVEAU_BLACKLIST_TEXT = (
    "# Written by vllm-fleet (vllm_fleet/roles/nvidia): the NVIDIA driver needs nouveau unloaded.\n"
    "blacklist nouveau\n"
    "options nouveau modeset=0\n"
)


class GpuMismatch(DeployError):
    """The host's GPUs do not match the spec's hardware section (the message names the host)."""


class UnsupportedHost(DeployError):
    """A distribution or source/branch combination this role cannot install."""


def cuda_repo_dir(distro: dict, host_name: str) -> str:
    """``debian12/x86_64`` / ``ubuntu2204/x86_64`` / ``ubuntu2404/x86_64`` for a LinuxDistribution fact."""
    name, major, minor = distro.get("name"), distro.get("major"), distro.get("minor")
    for (d_name, d_major, d_minor), repo in d.CUDA_REPO_DIRS.items():
        if name == d_name and major == d_major and (d_minor is None or minor == d_minor):
            return repo
    supported = ", ".join(f"{n} {ma}" + (f".{mi:02d}" if mi is not None else "") for n, ma, mi in d.CUDA_REPO_DIRS)
    raise UnsupportedHost(
        f"host {host_name}: {name} {major}.{minor} is not supported by vllm_fleet/roles/nvidia (supported: {supported})"
    )


def _ensure_debian_components(codename: str, wanted: list[str]) -> None:
    """Add missing apt components to the Debian suites of the existing sources (both formats)."""
    present = host.get_fact(AptComponents, suite=codename)
    missing = [c for c in wanted if c not in present]
    if not missing:
        return
    suite = shlex.quote(codename)
    commands = []
    for comp in missing:
        add = f"/ {comp}( |$)/!s/$/ {comp}/"
        commands.append(
            f"for f in $(grep -lE '^Suites:.*\\b'{suite}'\\b' /etc/apt/sources.list.d/*.sources 2>/dev/null); "
            f"do sed -i -E '/^Components:/{{{add}}}' \"$f\"; done"
        )
        commands.append(
            "if [ -f /etc/apt/sources.list ]; then sed -i -E "
            f"'/^deb\\s+(\\[[^]]*\\]\\s+)?\\S+\\s+'{suite}'(-[a-z]+)?\\s/{{{add}}}' /etc/apt/sources.list; fi"
        )
    server.shell(name=f"Enable apt components {' '.join(missing)} for {codename}", commands=commands)


def _check_gpus_now(state, host, branch: str, hardware: dict) -> None:  # noqa: ARG001
    """Runs on the host after the reboot (pyinfra passes state, host): the branch is loaded and
    the GPUs match the spec."""
    gpus = host.get_fact(NvidiaGpus)
    loaded = driver_branch(gpus)
    if loaded != branch:
        raise GpuMismatch(
            f"host {host.name}: after installing driver branch {branch} and rebooting, "
            f"nvidia-smi reports {describe(gpus)} (driver branch {loaded}). "
            "Look at `dkms status` and `journalctl -b -k | grep -i nvidia` on the host."
        )
    problem = gpu_mismatch(gpus, hardware, host.name)
    if problem:
        raise GpuMismatch(problem)


@deploy("NVIDIA driver and CUDA", data_defaults=DEFAULTS)
def nvidia(spec: dict) -> None:
    ins, hw = spec["install"], spec["hardware"]
    nv = ins["nvidia"]
    if ins["accelerator"] != "cuda":
        host.noop("install.accelerator is not cuda: no NVIDIA driver")
        return

    branch = str(nv["driver_branch"])
    source = nv["source"]
    open_modules = bool(nv["open_kernel_modules"])
    distro = host.get_fact(LinuxDistribution)
    repo_dir = cuda_repo_dir(distro, host.name)
    is_debian = distro["name"] == "Debian"

    if source == "distro" and is_debian and d.DEBIAN_DISTRO_BRANCH.get(distro["major"]) != branch:
        raise UnsupportedHost(
            f"host {host.name}: Debian {distro['major']} ships NVIDIA driver branch "
            f"{d.DEBIAN_DISTRO_BRANCH.get(distro['major'])}, the spec asks for {branch}. "
            "Fix: install.nvidia.source: nvidia (NVIDIA's repository), or "
            f"install.nvidia.driver_branch: \"{d.DEBIAN_DISTRO_BRANCH.get(distro['major'])}\"."
        )

    gpus = host.get_fact(NvidiaGpus)
    if gpus:
        problem = gpu_mismatch(gpus, hw, host.name)
        if problem:
            raise GpuMismatch(problem)
    driver_ok = driver_branch(gpus) == branch

    if source == "nvidia":
        major, minor = nv["cuda_version"].split(".")
        toolkit = d.CUDA_REPO_TOOLKIT.format(major=major, minor=minor)
    else:
        toolkit = d.DISTRO_TOOLKIT
    want_toolkit = bool(host.data.get("nvidia_install_toolkit"))
    toolkit_ok = not want_toolkit or toolkit in host.get_fact(DebPackages)

    if driver_ok and toolkit_ok:
        host.noop(f"NVIDIA driver branch {branch} loaded ({describe(gpus)}); toolkit present")
        return

    codename = distro["release_meta"].get("VERSION_CODENAME", "")

    # 1. Package sources.
    if source == "nvidia":
        if is_debian:
            _ensure_debian_components(codename, d.DEBIAN_CUDA_REPO_COMPONENTS)
        download_dir = host.data.get("nvidia_download_dir")
        keyring_path = f"{download_dir}/{d.CUDA_KEYRING_DEB}"
        files.directory(name="Download directory", path=download_dir, mode="0755")
        files.download(
            name=f"Download NVIDIA's CUDA repository keyring package ({repo_dir})",
            src=f"{d.CUDA_REPO_BASE}/{repo_dir}/{d.CUDA_KEYRING_DEB}",
            dest=keyring_path,
            sha256sum=d.CUDA_KEYRING_SHA256.get(repo_dir),
        )
        apt.deb(name="Install the CUDA repository keyring", src=keyring_path)
    elif is_debian:
        _ensure_debian_components(codename, d.DEBIAN_COMPONENTS)
    apt.update(name="Update apt package lists")

    # 2. Driver: DKMS + headers, nouveau blacklist, pinned driver packages.
    if not driver_ok:
        kernel = host.get_fact(KernelVersion)
        apt.packages(
            name="DKMS and headers of the running kernel",
            packages=[p.format(kernel=kernel) for p in d.DKMS_PACKAGES],
            no_recommends=True,
        )
        blacklist = files.put(
            name="Blacklist nouveau",
            src=StringIO(NOUVEAU_BLACKLIST_TEXT),
            dest=d.NOUVEAU_BLACKLIST,
            mode="0644",
        )
        server.shell(
            name="Rebuild the initramfs without nouveau",
            commands=["update-initramfs -u"],
            _if=blacklist.did_change,
        )
        if source == "nvidia":
            apt.packages(
                name=f"Pin apt to NVIDIA driver branch {branch}",
                packages=[d.CUDA_REPO_PINNING.format(branch=branch)],
            )
            driver_packages = [d.CUDA_REPO_DRIVER[open_modules]]
        elif is_debian:
            driver_packages = list(d.DEBIAN_DISTRO_DRIVER[open_modules])
        else:
            flavour = "-server" if host.data.get("nvidia_ubuntu_server_flavour") else ""
            driver_packages = [
                d.UBUNTU_DISTRO_DRIVER.format(branch=branch, server=flavour, open="-open" if open_modules else "")
            ]
        apt.packages(name=f"NVIDIA driver {branch} ({'open' if open_modules else 'proprietary'} kernel modules)",
                     packages=driver_packages)

    # 3. Toolkit.
    if want_toolkit and not toolkit_ok:
        apt.packages(name=f"CUDA toolkit ({toolkit})", packages=[toolkit], no_recommends=True)

    # 4. Reboot into the new driver (or away from nouveau), then verify on the host.
    nouveau_loaded = "nouveau" in host.get_fact(KernelModules)
    if driver_ok and not nouveau_loaded:
        return
    if not host.data.get("nvidia_reboot"):
        logger.warning(f"{host.name}: NVIDIA driver installed; reboot the host (nvidia_reboot is off)")
        return
    server.reboot(
        name="Reboot into the NVIDIA driver",
        delay=host.data.get("nvidia_reboot_delay"),
        reboot_timeout=host.data.get("nvidia_reboot_timeout"),
    )
    server.shell(name="nvidia-smi answers", commands=[NVIDIA_SMI_COMMAND])
    python.call(name="GPUs match the spec", function=_check_gpus_now, branch=branch, hardware=dict(hw))
