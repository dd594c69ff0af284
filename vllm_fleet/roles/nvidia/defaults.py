"""Every user-facing default of the nvidia role, in one place (documented in README.md).

Spec values (install.nvidia.driver_branch, cuda_version, source, open_kernel_modules,
hardware.gpu, gpus_per_node) come from the resolved spec; the values here are host data
(overridable per host or group, e.g. ``nvidia_reboot_timeout``) or fixed tables.
"""

from vllm_fleet.render.layout import SYSTEMD_DIR

# Host data defaults (``@deploy(data_defaults=DEFAULTS)``): override in inventory/group_data.
DEFAULTS = {
    # Reboot after a new driver or a nouveau blacklist: pyinfra's server.reboot arguments.
    "nvidia_reboot": True,  # False: never reboot; the role then stops with a message instead
    "nvidia_reboot_delay": 10,
    "nvidia_reboot_timeout": 900,
    # Install the CUDA toolkit (cuda-toolkit-X-Y, or the distro's nvidia-cuda-toolkit).
    "nvidia_install_toolkit": True,
    # Ubuntu distro packages: the -server flavour (headless datacenter branch) or the desktop one.
    "nvidia_ubuntu_server_flavour": True,
    # Where downloaded .deb files are kept (the keyring package).
    "nvidia_download_dir": "/var/cache/vllm-fleet",
    # Compute-only driver packages (no X/desktop stack) where the source offers them; False
    # installs the full driver (nvidia-open / cuda-drivers, Debian's nvidia-driver).
    "nvidia_compute_only": True,
    # NVSwitch boards: install and enable nvidia-fabricmanager of the driver's branch (detected
    # from the PCI bus; False never installs it).
    "nvidia_fabricmanager": True,
    # Secure Boot on: the DKMS-built module must be signed with a key enrolled in the firmware
    # (DKMS signs with its MOK, /var/lib/dkms/mok.key). True says that key is enrolled; False
    # (default) stops before anything is installed.
    "nvidia_secure_boot_mok": False,
}

# NVIDIA's CUDA network repository: one directory per distribution release and architecture.
CUDA_REPO_BASE = "https://developer.download.nvidia.com/compute/cuda/repos"
CUDA_KEYRING_DEB = "cuda-keyring_1.1-1_all.deb"
# (LinuxDistribution name, major, minor) -> repository directory
CUDA_REPO_DIRS = {
    ("Debian", 12, None): "debian12/x86_64",
    ("Ubuntu", 22, 4): "ubuntu2204/x86_64",
    ("Ubuntu", 24, 4): "ubuntu2404/x86_64",
}
# Published checksums of the keyring package (from each repository's Packages index); a
# directory without one is fetched over TLS only.
CUDA_KEYRING_SHA256 = {
    "ubuntu2404/x86_64": "d2a6b11c096396d868758b86dab1823b25e14d70333f1dfa74da5ddaf6a06dba",
}

# Packages from NVIDIA's repository. The pinning package locks apt to one driver branch
# (NVIDIA's "version locking" packages for Debian and Ubuntu); it is installed before the driver.
CUDA_REPO_PINNING = "nvidia-driver-pinning-{branch}"
# The full driver (desktop stack included), keyed by open_kernel_modules.
CUDA_REPO_DRIVER = {True: ["nvidia-open"], False: ["cuda-drivers"]}
# Compute-only (headless) sets, NVIDIA's driver installation guide ("compute-only system"):
# Debian: nvidia-driver-cuda + the kernel module package; Ubuntu: the compute libraries, the DKMS
# module, nvidia-smi (utils) and nvidia-persistenced (compute-utils). Ubuntu's packages carry the
# branch in their names up to 580 and drop it from 590 on (NVIDIA's "Ubuntu 590 and later
# packages" rename); the pinning package picks the branch either way.
CUDA_REPO_COMPUTE = {
    "Debian": {
        True: ["nvidia-driver-cuda", "nvidia-kernel-open-dkms", "nvidia-persistenced", "nvidia-modprobe"],
        False: ["nvidia-driver-cuda", "nvidia-kernel-dkms", "nvidia-persistenced", "nvidia-modprobe"],
    },
    "Ubuntu": {
        True: [
            "libnvidia-compute{sfx}",
            "nvidia-dkms{sfx}-open",
            "nvidia-utils{sfx}",
            "nvidia-compute-utils{sfx}",
            "nvidia-modprobe",
        ],
        False: [
            "libnvidia-compute{sfx}",
            "nvidia-dkms{sfx}",
            "nvidia-utils{sfx}",
            "nvidia-compute-utils{sfx}",
            "nvidia-modprobe",
        ],
    },
}
UBUNTU_UNSUFFIXED_FROM = 590  # branch from which NVIDIA's Ubuntu packages have no -<branch> suffix
CUDA_REPO_TOOLKIT = "cuda-toolkit-{major}-{minor}"
# NVSwitch systems: the fabric manager of the same branch (NVIDIA repo: named like the driver
# packages of that distribution; the pinning package keeps it on the branch).
CUDA_REPO_FABRICMANAGER = {"Debian": "nvidia-fabricmanager", "Ubuntu": "nvidia-fabricmanager{sfx}"}
UBUNTU_DISTRO_FABRICMANAGER = "nvidia-fabricmanager-{branch}"
# nvidia-persistenced with persistence mode on (NVIDIA's own Ansible role ships this override:
# packaged units start it with --no-persistence-mode on some distributions).
PERSISTENCED_OVERRIDE = f"{SYSTEMD_DIR}/nvidia-persistenced.service.d/vllm-fleet.conf"
PERSISTENCED_OVERRIDE_TEXT = (
    "# Written by vllm-fleet (vllm_fleet/roles/nvidia): keep the GPUs initialised between CUDA programs.\n"
    "[Service]\n"
    "ExecStart=\n"
    "ExecStart=/usr/bin/nvidia-persistenced --user root --persistence-mode --verbose\n"
)

# Distribution packages. Debian needs these apt components enabled for them.
DEBIAN_COMPONENTS = ["contrib", "non-free", "non-free-firmware"]
# NVIDIA's repository for Debian needs contrib (the CUDA installation guide enables it).
DEBIAN_CUDA_REPO_COMPONENTS = ["contrib"]
# The driver branch each Debian release ships (bookworm: 535). Another branch needs source: nvidia.
DEBIAN_DISTRO_BRANCH = {12: "535"}
DEBIAN_DISTRO_DRIVER = {
    True: ["nvidia-open-kernel-dkms", "nvidia-driver", "firmware-misc-nonfree"],
    False: ["nvidia-kernel-dkms", "nvidia-driver", "firmware-misc-nonfree"],
}
# Debian's compute-only set: the CUDA library, nvidia-smi, the persistence daemon, no X driver.
DEBIAN_DISTRO_COMPUTE = {
    True: [
        "nvidia-open-kernel-dkms",
        "libcuda1",
        "nvidia-smi",
        "nvidia-persistenced",
        "nvidia-modprobe",
        "firmware-misc-nonfree",
    ],
    False: [
        "nvidia-kernel-dkms",
        "libcuda1",
        "nvidia-smi",
        "nvidia-persistenced",
        "nvidia-modprobe",
        "firmware-misc-nonfree",
    ],
}
UBUNTU_DISTRO_DRIVER = "nvidia-driver-{branch}{server}{open}"  # e.g. nvidia-driver-570-server-open
# Ubuntu's headless set (NVIDIA's Ansible role for Canonical's packages): no X driver.
UBUNTU_DISTRO_COMPUTE = ["nvidia-headless-{branch}{server}{open}", "nvidia-utils-{branch}{server}", "nvidia-modprobe"]
DISTRO_TOOLKIT = "nvidia-cuda-toolkit"

# DKMS rebuilds the module for every new kernel: the headers of the running kernel now, and the
# distribution's headers meta-package of its flavour (linux-headers-amd64, -cloud-amd64,
# -generic, -aws, ...) so the next kernel's headers come with it.
DKMS_PACKAGES = ["dkms", "linux-headers-{kernel}", "linux-headers-{flavour}"]

# Secure Boot state from the EFI variable (last byte 1 = on); absent without EFI.
SECURE_BOOT_EFIVAR = "/sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-e0a5c5a8d5b0"

# What the state read asks (roles/nvidia state_query): the files pyinfra's LinuxDistribution fact
# reads, the running kernel's release (uname -r) and modules, apt's source files (one-line and
# deb822), the PCI bus, and the fabric manager of any branch (its name carries the branch on Ubuntu).
OS_RELEASE_GLOB = "/etc/*-release"
KERNEL_RELEASE = "/proc/sys/kernel/osrelease"
KERNEL_MODULES = "/proc/modules"
APT_SOURCES_LIST = "/etc/apt/sources.list"
APT_SOURCE_GLOBS = ("/etc/apt/sources.list.d/*.list", "/etc/apt/sources.list.d/*.sources")
PCI_DEVICES = "/sys/bus/pci/devices"
FABRICMANAGER_PATTERN = "nvidia-fabricmanager*"

NOUVEAU_BLACKLIST = "/etc/modprobe.d/blacklist-nouveau.conf"

# How nvidia-smi names the catalogue GPUs, and their memory (GiB as nvidia-smi reports MiB/1024).
# A detected GPU matches when its name contains the substring and its memory is within
# GPU_MEMORY_TOLERANCE of the figure (boards differ by a few hundred MiB of reserved memory).
GPU_MATCH = {
    "rtx3090": ("RTX 3090", 24),
    "rtx4090": ("RTX 4090", 24),
    "a100-40gb": ("A100", 40),
    "a100-80gb": ("A100", 80),
    "l40s": ("L40S", 48),
    "h100-80gb": ("H100", 80),
    "h200": ("H200", 141),
}
GPU_MEMORY_TOLERANCE = 0.10
