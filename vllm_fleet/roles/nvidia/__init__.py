"""The nvidia role: the pinned NVIDIA driver branch (DKMS) and CUDA toolkit on Debian 12 /
Ubuntu 22.04 / 24.04 GPU hosts, with the GPUs checked against the spec.

Deploy function
    ``nvidia(spec)``: ``spec`` is the resolved spec dict (``vllm_fleet.specs.load.load_and_check``).
    Reads ``install.accelerator``, ``install.nvidia.{driver_branch, cuda_version, source,
    open_kernel_modules}`` and ``hardware.{gpu, gpus_per_node}``; host data in
    ``defaults.DEFAULTS`` (``nvidia_reboot``, ``nvidia_reboot_timeout``, ...).

What it reads (``state_query``, in the deploy's one state read, vllm_fleet.roles.common.state;
the role called on its own reads it in one round trip): the ``/etc/*-release`` files (parsed by
pyinfra's LinuxDistribution parser), nvidia-smi's GPUs, the PCI devices in sysfs (NVSwitches),
/proc/sys/kernel/osrelease and /proc/modules, the Secure Boot EFI variable, apt's source files,
and whether the toolkit and a fabric manager are installed (dpkg). A read that did not complete
stops the host (``StateUnknown``) before anything is installed. After a reboot the GPU check
reads nvidia-smi again (the same state read, of the GPUs alone).

What it does, decided from that read while the plan is built
    - ``install.accelerator: cpu``: nothing.
    - ``driver_branch`` is a minimum (default: what the pinned vLLM's CUDA needs, see
      ``vllm_fleet.specs.defaults.VLLM_CUDA``): nvidia-smi answering with that branch or a newer one,
      the toolkit installed (or not wanted) and, on NVSwitch boards, the fabric manager present:
      nothing but the GPU check, no reboot.
    - Otherwise, before anything is installed: Secure Boot on (the EFI variable) without host
      data ``nvidia_secure_boot_mok`` stops the host (an unsigned DKMS module never loads).
    - Source ``nvidia``: NVIDIA's CUDA apt repository via its keyring package (Debian also gets
      ``contrib``), the branch pinning package ``nvidia-driver-pinning-<branch>``, then the
      driver with ``latest`` (an installed older branch is upgraded to the pinned one):
      compute-only packages by default (``nvidia_compute_only``; Debian ``nvidia-driver-cuda`` +
      the kernel module package, Ubuntu the compute libraries / DKMS module / utils), else
      ``nvidia-open`` / ``cuda-drivers``; and ``cuda-toolkit-X-Y``. Source ``distro``: Debian's
      packages (contrib/non-free/non-free-firmware enabled; Debian 12 ships branch 535 only, a
      higher minimum is refused) or Ubuntu's ``nvidia-headless-<branch>[-server][-open]``, and
      ``nvidia-cuda-toolkit``. ``nvidia-modprobe`` with every source (the vLLM unit's
      ``ExecStartPre=+nvidia-modprobe -c0 -u`` creates /dev/nvidia-uvm with it).
    - A new driver: ``dkms``, the running kernel's headers and the headers meta-package of its
      flavour (so DKMS builds for the next kernel), nouveau blacklisted (``update-initramfs -u``
      only when that file changed), nvidia-persistenced enabled with persistence mode; then a
      reboot (``server.reboot``, which waits) when no driver answered, nouveau was loaded, or the
      install changed something; then a check that nvidia-smi reports the branch (or newer) and
      the spec's GPUs. ``nvidia_reboot: false`` stops the host instead of rebooting, with a
      message (``RebootNeeded``). No reboot when only the toolkit was missing.
    - NVSwitch boards (NVIDIA bridges, class 0x0680, on the PCI bus): ``nvidia-fabricmanager`` of the
      running (or installed) branch, enabled.

Failures
    ``GpuMismatch`` (a ``DeployError``, raised while the plan is built, so no host is touched)
    names the host when its GPUs do not match ``hardware.gpu`` x ``hardware.gpus_per_node``;
    after a fresh install the same check runs on the host after the reboot and fails that host.
    ``UnsupportedHost`` for a distribution without a CUDA repository entry, ``source: distro``
    with a branch Debian does not ship, Debian's own packages on an NVSwitch board, or Secure
    Boot without an enrolled DKMS key. ``RebootNeeded`` (at execute time) with ``nvidia_reboot``
    off.

Example (deploys/serve.py)::

    from vllm_fleet.specs.load import load_and_check
    from vllm_fleet.roles.nvidia import nvidia

    spec, _warnings = load_and_check("deployments/rtx3090-qwen7b-awq-realtime.yaml")
    nvidia(spec)
"""

from __future__ import annotations

from dataclasses import dataclass
from io import StringIO

from pyinfra import host, logger
from pyinfra.context import ctx_host
from pyinfra.api import deploy
from pyinfra.api.exceptions import DeployError
from pyinfra.operations import apt, files, python, server, systemd
from pyinfra.operations.util import any_changed

from . import defaults as d
from .defaults import DEFAULTS
from .gpucheck import describe, gpu_mismatch
from .parse import (
    NVIDIA_SMI_COMMAND,
    NVIDIA_SMI_QUERY,
    apt_source_lines,
    driver_branch,
    parse_apt_components,
    parse_nvidia_smi,
    parse_os_release,
    parse_pci_classes,
    secure_boot_on,
)
from vllm_fleet.host.programs import argv as cmd
from vllm_fleet.roles.common import role_data
from vllm_fleet.host.state import Query, Snapshot
from vllm_fleet.roles.common.state import StateUnknown, read_now, role_state, unknown
from vllm_fleet.specs.sections import reads

#: The spec sections this role reads (vllm_fleet.specs.sections); its README lists them.
SECTIONS = ("hardware", "install")


__all__ = [
    "nvidia",
    "state_query",
    "GpuMismatch",
    "UnsupportedHost",
    "RebootNeeded",
    "cuda_repo_dir",
    "kernel_flavour",
    "DEFAULTS",
]

NOUVEAU_BLACKLIST_TEXT = (
    "# Written by vllm-fleet (vllm_fleet/roles/nvidia): the NVIDIA driver needs nouveau unloaded.\n"
    "blacklist nouveau\n"
    "options nouveau modeset=0\n"
)


class GpuMismatch(DeployError):
    """The host's GPUs do not match the spec's hardware section (the message names the host)."""


class UnsupportedHost(DeployError):
    """A distribution or source/branch combination this role cannot install."""


class RebootNeeded(DeployError):
    """A new driver needs a reboot and host data ``nvidia_reboot`` is off (the message names the host)."""


def kernel_flavour(kernel: str) -> str:
    """The headers meta-package's flavour of a kernel release: ``amd64`` for ``6.1.0-27-amd64``,
    ``cloud-amd64`` for ``6.1.0-27-cloud-amd64``, ``generic`` for ``6.8.0-49-generic``."""
    parts = kernel.split("-")
    rest = [p for p in parts[1:] if not p.isdigit()]
    return "-".join(rest) or "generic"


def _branch_suffix(distro_name: str, branch: str) -> str:
    """``-580`` in NVIDIA's Ubuntu package names up to 580, nothing from 590 on (and on Debian)."""
    if distro_name == "Ubuntu" and int(branch) < d.UBUNTU_UNSUFFIXED_FROM:
        return f"-{branch}"
    return ""


def _fabricmanager_package(source: str, distro_name: str, branch: str, host_name: str) -> str:
    if source == "nvidia":
        return d.CUDA_REPO_FABRICMANAGER[distro_name].format(sfx=_branch_suffix(distro_name, branch))
    if distro_name == "Ubuntu":
        return d.UBUNTU_DISTRO_FABRICMANAGER.format(branch=branch)
    raise UnsupportedHost(
        f"host {host_name}: this board has NVSwitches (CUDA needs nvidia-fabricmanager there), and Debian's own "
        "packages have no fabric manager. Fix: install.nvidia.source: nvidia (NVIDIA's repository has it for every "
        "branch)."
    )


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


def _ensure_debian_components(h: "_Host", codename: str, wanted: list[str]) -> None:
    """Add missing apt components to the Debian suites of the existing sources (both formats)."""
    present = parse_apt_components(h.apt_sources, codename)
    missing = [c for c in wanted if c not in present]
    if not missing:
        return
    commands = []
    for comp in missing:
        add = f"/ {comp}( |$)/!s/$/ {comp}/"
        commands.append(
            cmd(
                "sh",
                "-c",
                'for f in $(grep -lE "^Suites:.*\\b$1\\b" /etc/apt/sources.list.d/*.sources 2>/dev/null); '
                'do sed -i -E "/^Components:/{$2}" "$f"; done',
                "apt-components",
                codename,
                add,
            )
        )
        commands.append(
            cmd(
                "sh",
                "-c",
                'if [ -f /etc/apt/sources.list ]; then sed -i -E '
                '"/^deb\\s+(\\[[^]]*\\]\\s+)?\\S+\\s+$1(-[a-z]+)?\\s/{$2}" /etc/apt/sources.list; fi',
                "apt-components",
                codename,
                add,
            )
        )
    server.shell(name=f"Enable apt components {' '.join(missing)} for {codename}", commands=commands)


def _check_gpus_now(state, host, branch: str, hardware: dict) -> None:  # noqa: ARG001
    """Runs on the host after the reboot (pyinfra passes state, host): the branch is loaded and
    the GPUs match the spec."""
    snap = read_now(GPUS_QUERY, on=host)  # the GPUs now, after the reboot (not the plan's read)
    known, lines = snap.nvidia_smi(NVIDIA_SMI_QUERY)
    if not known:
        raise StateUnknown(
            f"host {host.name}: after installing driver branch {branch} and rebooting, the read of "
            "nvidia-smi's GPUs did not complete, so the driver and GPUs were not checked. Check that the "
            "host is reachable and that its sudo works, then run the deploy again."
        )
    gpus = parse_nvidia_smi(lines or [])
    loaded = driver_branch(gpus)
    if loaded is None or int(loaded) < int(branch):
        raise GpuMismatch(
            f"host {host.name}: after installing driver branch {branch} and rebooting, "
            f"nvidia-smi reports {describe(gpus)} (driver branch {loaded}). "
            "Look at `dkms status` and `journalctl -b -k | grep -i nvidia` on the host."
        )
    problem = gpu_mismatch(gpus, hardware, host.name)
    if problem:
        raise GpuMismatch(problem)


def _reboot_needed(state, host, branch: str) -> None:  # noqa: ARG001
    """Runs on the host when a reboot is needed and ``nvidia_reboot`` is off: stop this host."""
    raise RebootNeeded(
        f"host {host.name}: NVIDIA driver branch {branch} is installed but not loaded, and host data nvidia_reboot "
        f"is false. Fix: reboot {host.name}, then deploy again (or set nvidia_reboot: true to let the deploy reboot "
        "it)."
    )


GPUS_QUERY = Query(gpus=(NVIDIA_SMI_QUERY,))


@reads(*SECTIONS)
def state_query(spec: dict) -> Query:
    """What the nvidia role decides from (vllm_fleet.roles.common.state), for the deploy's one
    read (roles.service.server_stack_query asks it): nothing with ``install.accelerator: cpu``;
    else the ``/etc/*-release`` files (the distribution), nvidia-smi's GPUs, the PCI devices
    (NVSwitches), the running kernel's release and modules (nouveau), the Secure Boot EFI
    variable, apt's source files (Debian's components), and whether the toolkit and a fabric
    manager (any branch: ``nvidia-fabricmanager*``) are installed.

    **Example:**

    .. code:: python

        load_host_state(state_query(spec) | other_role.state_query(spec))
    """
    if spec["install"]["accelerator"] != "cuda":
        return Query()
    fabric = _wanted("nvidia_fabricmanager")
    return GPUS_QUERY | Query(
        globs=(d.OS_RELEASE_GLOB, *d.APT_SOURCE_GLOBS),
        read=(d.KERNEL_RELEASE, d.KERNEL_MODULES, d.SECURE_BOOT_EFIVAR, d.APT_SOURCES_LIST),
        pci=(d.PCI_DEVICES,) if fabric else (),
        debs=((_toolkit(spec),) if _wanted("nvidia_install_toolkit") else ())
        + ((d.FABRICMANAGER_PATTERN,) if fabric else ()),
    )


def _wanted(key: str) -> bool:
    """Host data ``key`` (else the role's default) when a host is being deployed; the default
    outside one (a query built for a test or a listing)."""
    return bool(role_data(key, DEFAULTS) if ctx_host.isset() else DEFAULTS[key])


def _toolkit(spec: dict) -> str:
    nv = spec["install"]["nvidia"]
    if nv["source"] == "nvidia":
        major, minor = nv["cuda_version"].split(".")
        return d.CUDA_REPO_TOOLKIT.format(major=major, minor=minor)
    return d.DISTRO_TOOLKIT


@dataclass
class _Host:
    """What the nvidia role decides from: the spec's NVIDIA settings and the host's state (one
    read, :func:`state_query`; decided in this order by _read_host)."""

    branch: str  # the oldest driver branch accepted
    source: str  # install.nvidia.source: nvidia (NVIDIA's repository) or distro
    open_modules: bool
    compute_only: bool
    distro: dict
    repo_dir: str
    gpus: list
    loaded: str | None  # the driver branch loaded now (None: no driver answers)
    driver_ok: bool
    toolkit: str
    want_toolkit: bool
    toolkit_ok: bool
    nvswitches: int
    fabricmanager: str | None
    fabricmanager_ok: bool
    kernel: str  # the running kernel's release
    modules: set  # the kernel modules loaded now
    secure_boot: bool
    apt_sources: list  # apt's source files' lines (parse_apt_components)

    @property
    def is_debian(self) -> bool:
        return self.distro["name"] == "Debian"


@deploy("NVIDIA driver and CUDA", data_defaults=DEFAULTS)
@reads(*SECTIONS)
def nvidia(spec: dict) -> None:
    """The NVIDIA driver (and toolkit, fabric manager) a CUDA spec needs on this host, in four
    steps (sources, driver, toolkit + fabric manager, reboot + check); nothing when the branch or
    a newer one is loaded and the rest is present (the module's docstring says the rules)."""
    ins = spec["install"]
    if ins["accelerator"] != "cuda":
        host.noop("install.accelerator is not cuda: no NVIDIA driver")
        return
    h = _read_host(spec)
    if h.driver_ok and h.toolkit_ok and h.fabricmanager_ok:
        host.noop(
            f"NVIDIA driver branch {h.loaded} loaded ({describe(h.gpus)}; {h.branch} or newer wanted); toolkit present"
            + (f"; {h.fabricmanager} present" if h.fabricmanager else "")
        )
        return
    _refuse_unsigned_module(h)
    _package_sources(h)
    driver_changes = [] if h.driver_ok else _install_driver(h)
    driver_changes += _toolkit_and_fabricmanager(h)
    _reboot_and_verify(h, driver_changes, spec["hardware"])


def _read_host(spec: dict) -> _Host:
    """The spec's NVIDIA settings and the host's state (the deploy's one read, or one read of
    :func:`state_query` when the role runs on its own): distribution, GPUs (a GPU that differs
    from the spec's hardware stops here), the loaded branch, NVSwitches, installed packages. A
    read that did not complete: StateUnknown (a guessed "no driver" would install one and reboot)."""
    ins, hw = spec["install"], spec["hardware"]
    nv = ins["nvidia"]
    branch = str(nv["driver_branch"])
    source = nv["source"]
    compute_only = bool(host.data.get("nvidia_compute_only"))
    snap = role_state(state_query(spec))
    if not snap.known:
        raise unknown(
            "what the host runs (its distribution, GPUs, NVIDIA driver)",
            changed="nothing was changed on this host: a driver installed on a guess would reboot it",
        )
    distro = parse_os_release(snap.matching(d.OS_RELEASE_GLOB) or {})
    repo_dir = cuda_repo_dir(distro, host.name)
    gpus = parse_nvidia_smi(snap.nvidia_smi(NVIDIA_SMI_QUERY)[1] or [])
    if gpus:
        problem = gpu_mismatch(gpus, hw, host.name)
        if problem:
            raise GpuMismatch(problem)
    loaded = driver_branch(gpus)
    # A minimum: the branch or a newer one loaded is left alone (no install, no reboot).
    driver_ok = loaded is not None and int(loaded) >= int(branch)
    if not driver_ok and source == "distro" and distro["name"] == "Debian":
        _check_debian_ships(spec, distro, branch)
    toolkit = _toolkit(spec)
    want_toolkit = bool(host.data.get("nvidia_install_toolkit"))
    # NVSwitch boards need the fabric manager of the branch that runs (the loaded one when it is
    # kept, else the one installed now).
    nvswitches = (
        parse_pci_classes(snap.pci_devices(d.PCI_DEVICES) or []) if host.data.get("nvidia_fabricmanager") else 0
    )
    fabricmanager = (
        _fabricmanager_package(source, distro["name"], loaded if driver_ok else branch, host.name)
        if nvswitches
        else None
    )
    return _Host(
        branch=branch,
        source=source,
        open_modules=bool(nv["open_kernel_modules"]),
        compute_only=compute_only,
        distro=distro,
        repo_dir=repo_dir,
        gpus=gpus,
        loaded=loaded,
        driver_ok=driver_ok,
        toolkit=toolkit,
        want_toolkit=want_toolkit,
        toolkit_ok=not want_toolkit or snap.debs_installed([toolkit]),
        nvswitches=nvswitches,
        fabricmanager=fabricmanager,
        fabricmanager_ok=fabricmanager is None or snap.debs_installed([fabricmanager]),
        **_kernel_and_sources(snap),
    )


def _kernel_and_sources(snap: Snapshot) -> dict:
    """The running kernel's release and modules, Secure Boot, apt's source files' lines."""
    modules = snap.content(d.KERNEL_MODULES)[1] or ""
    sources = [snap.content(d.APT_SOURCES_LIST)[1]]
    for pattern in d.APT_SOURCE_GLOBS:
        sources += list((snap.matching(pattern) or {}).values())
    return {
        "kernel": (snap.content(d.KERNEL_RELEASE)[1] or "").strip(),
        "modules": {line.split(" ", 1)[0] for line in modules.splitlines() if line.strip()},
        "secure_boot": secure_boot_on(snap.content(d.SECURE_BOOT_EFIVAR)[1]),
        "apt_sources": apt_source_lines(sources),
    }


def _check_debian_ships(spec: dict, distro: dict, branch: str) -> None:
    """``source: distro`` on Debian: its release must ship ``branch`` or a newer one."""
    ins = spec["install"]
    nv = ins["nvidia"]
    shipped = d.DEBIAN_DISTRO_BRANCH.get(distro["major"])
    if shipped is None or int(shipped) < int(branch):
        raise UnsupportedHost(
            f"host {host.name}: Debian {distro['major']} ships NVIDIA driver branch {shipped}, the spec needs "
            f"{branch} or newer (install.nvidia.driver_branch; vLLM {ins['vllm_version']} needs "
            f"{nv.get('min_driver_branch', branch)}). Fix: install.nvidia.source: nvidia (NVIDIA's repository)"
            + (f", or install.nvidia.driver_branch: \"{shipped}\" with a vLLM that runs on it." if shipped else ".")
        )


def _refuse_unsigned_module(h: _Host) -> None:
    """Secure Boot with an unsigned DKMS module: the driver would install and never load."""
    if not h.driver_ok and h.secure_boot and not host.data.get("nvidia_secure_boot_mok"):
        raise UnsupportedHost(
            f"host {host.name}: UEFI Secure Boot is on, and the NVIDIA kernel module DKMS builds is not signed with a "
            "key the firmware trusts, so it would never load. Nothing was installed. Fix: turn Secure Boot off in the "
            "firmware, or enroll DKMS's signing key (mokutil --import /var/lib/dkms/mok.pub, confirm at the next boot) "
            "and set host data nvidia_secure_boot_mok: true."
        )


def _package_sources(h: _Host) -> None:
    """1. Package sources: NVIDIA's CUDA repository (its keyring package, Debian's components it
    needs) or the distribution's (Debian: contrib, non-free...), then apt's lists."""
    codename = h.distro["release_meta"].get("VERSION_CODENAME", "")
    if h.source == "nvidia":
        if h.is_debian:
            _ensure_debian_components(h, codename, d.DEBIAN_CUDA_REPO_COMPONENTS)
        download_dir = host.data.get("nvidia_download_dir")
        keyring_path = f"{download_dir}/{d.CUDA_KEYRING_DEB}"
        files.directory(name="Download directory", path=download_dir, mode="0755")
        files.download(
            name=f"Download NVIDIA's CUDA repository keyring package ({h.repo_dir})",
            src=f"{d.CUDA_REPO_BASE}/{h.repo_dir}/{d.CUDA_KEYRING_DEB}",
            dest=keyring_path,
            sha256sum=d.CUDA_KEYRING_SHA256.get(h.repo_dir),
        )
        apt.deb(name="Install the CUDA repository keyring", src=keyring_path)
    elif h.is_debian:
        _ensure_debian_components(h, codename, d.DEBIAN_COMPONENTS)
    apt.update(name="Update apt package lists")


def _install_driver(h: _Host) -> list:
    """2. Driver: DKMS + headers, nouveau blacklist, the branch's driver packages, persistence
    mode. Returns the operations whose change needs a reboot."""
    kernel = h.kernel
    if not kernel:
        raise StateUnknown(
            f"host {host.name}: {d.KERNEL_RELEASE} gave no kernel release, so the headers DKMS needs are not "
            "known (nothing was changed on this host). Check the host's /proc, then run the deploy again."
        )
    apt.packages(
        name="DKMS and kernel headers (running kernel + meta-package)",
        packages=[p.format(kernel=kernel, flavour=kernel_flavour(kernel)) for p in d.DKMS_PACKAGES],
        no_recommends=True,
    )
    blacklist = files.put(
        name="Blacklist nouveau", src=StringIO(NOUVEAU_BLACKLIST_TEXT), dest=d.NOUVEAU_BLACKLIST, mode="0644"
    )
    changes = [blacklist]
    server.shell(
        name="Rebuild the initramfs without nouveau", commands=["update-initramfs -u"], _if=blacklist.did_change
    )
    if h.source == "nvidia":
        # The pinning package first (NVIDIA: "install the pinning package prior to the
        # driver"), then the driver with latest=True: an installed older branch is upgraded
        # to the pinned one, not left in place (apt.packages would see it present).
        changes.append(
            apt.packages(
                name=f"Pin apt to NVIDIA driver branch {h.branch}",
                packages=[d.CUDA_REPO_PINNING.format(branch=h.branch)],
            )
        )
    changes.append(
        apt.packages(
            name=f"NVIDIA driver {h.branch} ({'open' if h.open_modules else 'proprietary'} kernel modules, "
            f"{'compute only' if h.compute_only else 'full'})",
            packages=_driver_packages(h),
            latest=True,
        )
    )
    # Persistence mode (NVIDIA's Ansible role does the same): the GPUs stay initialised.
    files.put(
        name="nvidia-persistenced with persistence mode",
        src=StringIO(d.PERSISTENCED_OVERRIDE_TEXT),
        dest=d.PERSISTENCED_OVERRIDE,
        mode="0644",
    )
    systemd.service(name="nvidia-persistenced enabled", service="nvidia-persistenced", enabled=True, daemon_reload=True)
    return changes


def _driver_packages(h: _Host) -> list[str]:
    """The branch's driver packages for the source, distribution, kernel modules (open or
    proprietary) and compute-only or full driver."""
    if h.source == "nvidia":
        if h.compute_only:
            sfx = _branch_suffix(h.distro["name"], h.branch)
            return [p.format(sfx=sfx) for p in d.CUDA_REPO_COMPUTE[h.distro["name"]][h.open_modules]]
        return list(d.CUDA_REPO_DRIVER[h.open_modules])
    if h.is_debian:
        return list((d.DEBIAN_DISTRO_COMPUTE if h.compute_only else d.DEBIAN_DISTRO_DRIVER)[h.open_modules])
    flavour = "-server" if host.data.get("nvidia_ubuntu_server_flavour") else ""
    names = d.UBUNTU_DISTRO_COMPUTE if h.compute_only else [d.UBUNTU_DISTRO_DRIVER]
    return [n.format(branch=h.branch, server=flavour, open="-open" if h.open_modules else "") for n in names]


def _toolkit_and_fabricmanager(h: _Host) -> list:
    """3. Toolkit (host data ``nvidia_install_toolkit``), fabric manager (NVSwitch boards).
    Returns the fabric manager's install (a reboot trigger), when there is one."""
    if h.want_toolkit and not h.toolkit_ok:
        apt.packages(name=f"CUDA toolkit ({h.toolkit})", packages=[h.toolkit], no_recommends=True)
    if not h.fabricmanager:
        return []
    fm = apt.packages(
        name=f"NVSwitch fabric manager ({h.fabricmanager}, {h.nvswitches} NVSwitches)",
        packages=[h.fabricmanager],
        latest=not h.driver_ok,
    )
    systemd.service(
        name="nvidia-fabricmanager running and enabled",
        service="nvidia-fabricmanager",
        running=h.driver_ok,
        enabled=True,
    )
    return [fm]


def _reboot_and_verify(h: _Host, driver_changes: list, hw: dict) -> None:
    """4. Reboot into the new driver (or away from nouveau), then verify on the host. Without a
    driver answering (or with nouveau loaded) always; with an older branch loaded only when the
    install changed something (otherwise the check below names what is loaded)."""
    nouveau_loaded = "nouveau" in h.modules
    if h.driver_ok and not nouveau_loaded:
        return
    condition = None if (h.loaded is None or nouveau_loaded) else any_changed(*driver_changes)
    if not host.data.get("nvidia_reboot"):
        python.call(
            name="Stop: the new driver loads only after a restart, which this host data forbids",
            function=_reboot_needed,
            branch=h.branch,
            _if=condition,
        )
        return
    server.reboot(
        name="Reboot into the NVIDIA driver",
        delay=host.data.get("nvidia_reboot_delay"),
        reboot_timeout=host.data.get("nvidia_reboot_timeout"),
        _if=condition,
    )
    server.shell(name="nvidia-smi answers", commands=[NVIDIA_SMI_COMMAND], _if=condition)
    # Always: after a reboot it reads the new driver; without one (an older branch loaded and the
    # install changed nothing) it stops the host naming the branch that is still loaded.
    python.call(name="GPUs match the spec", function=_check_gpus_now, branch=h.branch, hardware=dict(hw))
