"""Every user-facing default of the nvidia role, in one place (documented in README.md).

Spec values (install.nvidia.driver_branch, cuda_version, source, open_kernel_modules,
hardware.gpu, gpus_per_node) come from the resolved spec; the values here are host data
(overridable per host or group, e.g. ``nvidia_reboot_timeout``) or fixed tables.
"""

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
CUDA_REPO_DRIVER = {True: "nvidia-open", False: "cuda-drivers"}  # keyed by open_kernel_modules
CUDA_REPO_TOOLKIT = "cuda-toolkit-{major}-{minor}"

# Distribution packages. Debian needs these apt components enabled for them.
DEBIAN_COMPONENTS = ["contrib", "non-free", "non-free-firmware"]
# NVIDIA's repository for Debian needs contrib (the CUDA installation guide enables it).
DEBIAN_CUDA_REPO_COMPONENTS = ["contrib"]
# The driver branch each Debian release ships (bookworm: 535). Another branch needs source: nvidia.
DEBIAN_DISTRO_BRANCH = {12: "535"}
DEBIAN_DISTRO_DRIVER = {True: ["nvidia-open-kernel-dkms", "nvidia-driver", "firmware-misc-nonfree"],
                        False: ["nvidia-kernel-dkms", "nvidia-driver", "firmware-misc-nonfree"]}
UBUNTU_DISTRO_DRIVER = "nvidia-driver-{branch}{server}{open}"  # e.g. nvidia-driver-570-server-open
DISTRO_TOOLKIT = "nvidia-cuda-toolkit"

# DKMS rebuilds the module for every new kernel; the headers of the running kernel are needed now.
DKMS_PACKAGES = ["dkms", "linux-headers-{kernel}"]

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
