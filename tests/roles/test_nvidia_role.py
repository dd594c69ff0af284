"""vllm_fleet/roles/nvidia, through the commands it would send (no GPU, no NVIDIA repository here).

Each case scripts the host's facts (distro from real os-release files, nvidia-smi output from
fixtures) and checks the apt sources, package names, blacklist, initramfs and reboot a reviewer
would look for, or their absence.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from pyinfra.facts.deb import DebPackage, DebPackages
from pyinfra.facts.files import Directory, File
from pyinfra.facts.server import KernelModules, KernelVersion, LinuxDistribution, Which

from vllm_fleet.roles.nvidia import GpuMismatch, UnsupportedHost, nvidia
from vllm_fleet.roles.nvidia.facts import AptComponents, NvidiaGpus, driver_branch, parse_apt_components, parse_nvidia_smi
from vllm_fleet.spec import load, resolve

REPO = Path(__file__).resolve().parents[2]
KEYRING = "cuda-keyring_1.1-1_all.deb"


def cuda_spec(gpu="rtx3090", count=1, **nvidia_overrides):
    spec = resolve(load(REPO / "deployments" / "rtx3090-qwen7b-awq-realtime.yaml"))
    spec = copy.deepcopy(spec)
    spec["hardware"].update(gpu=gpu, gpus_per_node=count)
    spec["install"]["nvidia"].update(nvidia_overrides)
    return spec


def bare_facts(harness, distro_name, kernel="6.1.0-27-amd64", nouveau=True, components=("main",)):
    """A fresh GPU host: no NVIDIA driver, nouveau loaded, only `main` enabled, nothing installed."""
    return {
        LinuxDistribution: harness.distro(distro_name),
        NvidiaGpus: [],
        DebPackages: {},
        DebPackage: None,
        KernelVersion: kernel,
        KernelModules: {"nouveau": {"size": "1", "instances": 1, "state": "Live"}} if nouveau else {},
        AptComponents: set(components),
        File: None,
        Directory: None,
        Which: harness.per_arg("command", {"curl": "/usr/bin/curl"}),
    }


def apt_installs(run):
    """Package names of every `apt-get install` command, in order."""
    names = []
    for command in run.commands:
        if "apt-get" in command and " install " in command and not command.rstrip().endswith("install -f"):
            names += [w for w in command.split(" install ", 1)[1].split() if not w.startswith("-")]
    return names


# ----------------------------------------------------------------------------------- parsers

def test_parse_real_h200_output(harness):
    gpus = parse_nvidia_smi(harness.fixture_lines("nvidia-smi/h200-1gpu-580.csv"))
    assert gpus == [{"index": 0, "name": "NVIDIA H200", "memory_mib": 143771,
                     "driver_version": "580.159.04", "compute_cap": "9.0"}]
    assert driver_branch(gpus) == "580"


def test_parse_four_gpus(harness):
    gpus = parse_nvidia_smi(harness.fixture_lines("nvidia-smi/h100-4gpu-570.csv"))
    assert [g["index"] for g in gpus] == [0, 1, 2, 3]
    assert {g["memory_mib"] for g in gpus} == {81559}
    assert driver_branch(gpus) == "570"


def test_parse_driver_not_loaded_means_no_gpus(harness):
    assert parse_nvidia_smi(harness.fixture_lines("nvidia-smi/driver-not-loaded.txt")) == []
    assert driver_branch([]) is None


def test_fact_command_and_missing_nvidia_smi():
    fact = NvidiaGpus()
    assert fact.command().startswith(
        "nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader,nounits")
    assert fact.requires_command() == "nvidia-smi"  # absent -> pyinfra returns default()
    assert NvidiaGpus.default() == []


def test_parse_apt_components_both_formats():
    lines = [
        "Types: deb", "URIs: http://mirror.invalid/debian", "Suites: bookworm bookworm-updates",
        "Components: main non-free-firmware", "", "Types: deb", "URIs: http://mirror.invalid/x",
        "Suites: nodistro", "Components: other", "",
        "deb [arch=amd64] http://mirror.invalid/debian bookworm contrib",
        "# deb http://mirror.invalid/debian bookworm non-free",
    ]
    assert parse_apt_components(lines, "bookworm") == {"main", "non-free-firmware", "contrib"}


# ------------------------------------------------------------------------------- deploy cases

def test_cpu_accelerator_is_a_no_op(harness):
    spec = resolve(load(REPO / "deployments" / "lab-tiny.yaml"))
    run = harness.run(nvidia, spec, facts={}, strict=True)  # strict: not even a fact is read
    assert run.ops == [] and run.asked == []


def test_right_driver_installs_nothing_and_does_not_reboot(harness):
    spec = cuda_spec(gpu="h200", driver_branch="580")
    facts = {
        LinuxDistribution: harness.distro("ubuntu-24.04"),
        NvidiaGpus: parse_nvidia_smi(harness.fixture_lines("nvidia-smi/h200-1gpu-580.csv")),
        DebPackages: {"cuda-toolkit-12-8": ["12.8.1-1"]},
    }
    run = harness.run(nvidia, spec, facts=facts, host="h200-a", strict=True)
    assert not run.changed
    assert run.ops == []


def test_debian12_bare_host_nvidia_repository(harness):
    run = harness.run(nvidia, cuda_spec(), facts=bare_facts(harness, "debian-12"), host="gpu1")
    cmds = "\n".join(run.commands)

    # NVIDIA's repository for Debian 12 through its keyring package, contrib enabled first
    assert f"compute/cuda/repos/debian12/x86_64/{KEYRING}" in cmds
    assert run.index("contrib") < run.index(KEYRING)
    assert run.index(f"dpkg --force-confdef --force-confold -i /var/cache/vllm-fleet/{KEYRING}") < run.index("apt-get update")
    # DKMS + headers of the running kernel, pinning before the driver, open modules, toolkit
    assert apt_installs(run) == ["dkms", "linux-headers-6.1.0-27-amd64", "nvidia-driver-pinning-570",
                                 "nvidia-open", "cuda-toolkit-12-8"]
    assert run.index("apt-get update") < run.index("install --no-install-recommends dkms")
    # nouveau blacklisted, initramfs rebuilt only when the file changed
    assert "blacklist nouveau" in run.uploads["/etc/modprobe.d/blacklist-nouveau.conf"].splitlines()
    assert run.op("initramfs").commands == ["update-initramfs -u"] and run.op("initramfs").conditional
    # then reboot (pyinfra's reboot-and-wait), then nvidia-smi and the GPU check
    reboot = run.op("Reboot")
    assert "python:wait_and_reconnect" in reboot.commands
    assert run.index("reboot") > run.index("install nvidia-open")
    assert run.commands[-2].startswith("nvidia-smi --query-gpu=")
    assert run.commands[-1] == "python:_check_gpus_now"


@pytest.mark.parametrize("distro_name, repo, kernel", [
    ("ubuntu-22.04", "ubuntu2204/x86_64", "5.15.0-125-generic"),
    ("ubuntu-24.04", "ubuntu2404/x86_64", "6.8.0-49-generic"),
])
def test_ubuntu_bare_host_nvidia_repository(harness, distro_name, repo, kernel):
    run = harness.run(nvidia, cuda_spec(), facts=bare_facts(harness, distro_name, kernel=kernel), host="gpu2")
    cmds = "\n".join(run.commands)
    assert f"compute/cuda/repos/{repo}/{KEYRING}" in cmds
    assert "contrib" not in cmds  # Ubuntu: no Debian components
    assert apt_installs(run) == ["dkms", f"linux-headers-{kernel}", "nvidia-driver-pinning-570",
                                 "nvidia-open", "cuda-toolkit-12-8"]
    assert run.has_op("Reboot")


def test_ubuntu2404_keyring_download_is_checksummed(harness):
    run = harness.run(nvidia, cuda_spec(), facts=bare_facts(harness, "ubuntu-24.04"))
    download = run.op("keyring package")
    assert any("d2a6b11c096396d868758b86dab1823b25e14d70333f1dfa74da5ddaf6a06dba" in c for c in download.commands)


def test_proprietary_modules_use_cuda_drivers(harness):
    run = harness.run(nvidia, cuda_spec(open_kernel_modules=False), facts=bare_facts(harness, "ubuntu-24.04"))
    assert "cuda-drivers" in apt_installs(run) and "nvidia-open" not in apt_installs(run)


def test_distro_source_ubuntu(harness):
    spec = cuda_spec(source="distro")
    run = harness.run(nvidia, spec, facts=bare_facts(harness, "ubuntu-22.04", kernel="5.15.0-125-generic"))
    cmds = "\n".join(run.commands)
    assert "compute/cuda/repos" not in cmds and "nvidia-driver-pinning" not in cmds
    assert apt_installs(run) == ["dkms", "linux-headers-5.15.0-125-generic", "nvidia-driver-570-server-open",
                                 "nvidia-cuda-toolkit"]
    assert run.has_op("Reboot")


def test_distro_source_debian_needs_its_branch(harness):
    with pytest.raises(UnsupportedHost, match=r"host gpu7: Debian 12 ships NVIDIA driver branch 535"):
        harness.run(nvidia, cuda_spec(source="distro"), facts=bare_facts(harness, "debian-12"), host="gpu7")


def test_distro_source_debian_535(harness):
    spec = cuda_spec(source="distro", driver_branch="535")
    run = harness.run(nvidia, spec, facts=bare_facts(harness, "debian-12"))
    components = run.op("apt components")
    assert "contrib non-free non-free-firmware" in components.name
    assert "compute/cuda/repos" not in "\n".join(run.commands)
    assert apt_installs(run) == ["dkms", "linux-headers-6.1.0-27-amd64", "nvidia-open-kernel-dkms",
                                 "nvidia-driver", "firmware-misc-nonfree", "nvidia-cuda-toolkit"]
    assert run.index("non-free-firmware") < run.index("apt-get update")


def test_components_already_enabled_are_not_touched(harness):
    facts = bare_facts(harness, "debian-12", components=("main", "contrib"))
    run = harness.run(nvidia, cuda_spec(), facts=facts)
    assert not run.has_op("apt components")


def test_driver_present_toolkit_missing_no_reboot(harness):
    spec = cuda_spec(gpu="h200", driver_branch="580")
    facts = bare_facts(harness, "ubuntu-24.04", nouveau=False)
    facts[NvidiaGpus] = parse_nvidia_smi(harness.fixture_lines("nvidia-smi/h200-1gpu-580.csv"))
    run = harness.run(nvidia, spec, facts=facts)
    assert apt_installs(run) == ["cuda-toolkit-12-8"]
    assert not run.has_op("Reboot") and not run.has_op("nouveau")


def test_wrong_gpu_model_fails_naming_the_host(harness):
    facts = bare_facts(harness, "ubuntu-24.04")
    facts[NvidiaGpus] = parse_nvidia_smi(harness.fixture_lines("nvidia-smi/h200-1gpu-580.csv"))
    with pytest.raises(GpuMismatch) as err:
        harness.run(nvidia, cuda_spec(gpu="rtx3090"), facts=facts, host="gpu-b17")
    message = str(err.value)
    assert "host gpu-b17" in message and "rtx3090" in message and "NVIDIA H200 (143771 MiB)" in message


def test_too_few_gpus_fails(harness):
    facts = bare_facts(harness, "ubuntu-24.04")
    facts[NvidiaGpus] = parse_nvidia_smi(harness.fixture_lines("nvidia-smi/h100-4gpu-570.csv"))
    with pytest.raises(GpuMismatch, match="host node3: the spec asks for 8 x h100-80gb"):
        harness.run(nvidia, cuda_spec(gpu="h100-80gb", count=8), facts=facts, host="node3")
    facts[DebPackages] = {"cuda-toolkit-12-8": ["12.8.1-1"]}
    ok = harness.run(nvidia, cuda_spec(gpu="h100-80gb", count=4), facts=facts, host="node3")
    assert not ok.changed


def test_unsupported_distro(harness):
    facts = {LinuxDistribution: {"name": "Ubuntu", "major": 20, "minor": 4, "release_meta": {}}}
    with pytest.raises(UnsupportedHost, match="host old1: Ubuntu 20.4 is not supported"):
        harness.run(nvidia, cuda_spec(), facts=facts, host="old1")


def test_no_reboot_when_disabled(harness):
    run = harness.run(nvidia, cuda_spec(), facts=bare_facts(harness, "debian-12"), data={"nvidia_reboot": False})
    assert not run.has_op("Reboot") and not run.has_op("GPUs match")
