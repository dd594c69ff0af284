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

from vllm_fleet.spec import checks
from vllm_fleet.roles.nvidia import GpuMismatch, RebootNeeded, UnsupportedHost, _reboot_needed, kernel_flavour, nvidia
from vllm_fleet.roles.nvidia.facts import (AptComponents, NvidiaGpus, NvSwitches, SecureBoot, driver_branch,
                                           parse_apt_components, parse_nvidia_smi, parse_pci_classes, parse_secure_boot)
from vllm_fleet.spec.load import load, resolve

REPO = Path(__file__).resolve().parents[2]
KEYRING = "cuda-keyring_1.1-1_all.deb"


def cuda_spec(gpu="rtx3090", count=1, vllm_version=None, **nvidia_overrides):
    """The RTX 3090 spec (vLLM 0.33.0: CUDA 13, driver branch 580 by default), resolved again
    with another vllm_version / install.nvidia values when given (the defaults follow them)."""
    spec = load(REPO / "deployments" / "rtx3090-qwen7b-awq-realtime.yaml")
    ins = spec.raw.setdefault("install", {})
    if vllm_version:
        ins["vllm_version"] = vllm_version
    ins["nvidia"] = {**(ins.get("nvidia") or {}), **nvidia_overrides}
    spec = copy.deepcopy(resolve(spec))
    spec["hardware"].update(gpu=gpu, gpus_per_node=count)
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
        NvSwitches: 0,
        SecureBoot: False,
        File: None,
        Directory: None,
        Which: harness.per_arg("command", {"curl": "/usr/bin/curl"}),
    }


H200 = "nvidia-smi/h200-1gpu-580.csv"
H100_570 = "nvidia-smi/h100-4gpu-570.csv"


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
    assert fact.command().get_raw_value().startswith(
        "nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader,nounits")
    assert fact.requires_command() == "nvidia-smi"  # absent -> pyinfra returns default()
    assert NvidiaGpus.default() == []


def test_parse_pci_bus_counts_nvswitches_only():
    # sysfs `vendor class` lines of an HGX H100 board: GPUs are 3D controllers (0x0302), the
    # NVSwitches NVIDIA bridges (0x0680); an Intel bridge and an NVIDIA audio function are not.
    lines = ["0x10de 0x030200"] * 8 + ["0x10de 0x068000"] * 4 + ["0x8086 0x068000", "0x10de 0x040300", ""]
    assert parse_pci_classes(lines) == 4
    assert parse_pci_classes(["0x10de 0x030200"]) == 0
    assert NvSwitches.default() == 0 and "/sys/bus/pci/devices" in NvSwitches().command().get_raw_value()


def test_parse_secure_boot_efivar():
    assert parse_secure_boot(["   6   0   0   0   1"]) is True
    assert parse_secure_boot(["   6   0   0   0   0"]) is False
    assert parse_secure_boot([]) is False  # no EFI / no variable


def test_kernel_flavour_for_the_headers_meta_package():
    assert kernel_flavour("6.1.0-27-amd64") == "amd64"
    assert kernel_flavour("6.1.0-27-cloud-amd64") == "cloud-amd64"
    assert kernel_flavour("6.8.0-49-generic") == "generic"
    assert kernel_flavour("6.8.0-1015-aws") == "aws"


def test_parse_apt_components_both_formats():
    lines = [
        "Types: deb", "URIs: http://mirror.invalid/debian", "Suites: bookworm bookworm-updates",
        "Components: main non-free-firmware", "", "Types: deb", "URIs: http://mirror.invalid/x",
        "Suites: nodistro", "Components: other", "",
        "deb [arch=amd64] http://mirror.invalid/debian bookworm contrib",
        "# deb http://mirror.invalid/debian bookworm non-free",
    ]
    assert parse_apt_components(lines, "bookworm") == {"main", "non-free-firmware", "contrib"}


# ------------------------------------------------------------------------ driver vs vLLM's CUDA

def test_driver_branch_follows_the_pinned_vllm():
    assert cuda_spec()["install"]["nvidia"]["driver_branch"] == "580"           # vLLM 0.33.0: CUDA 13
    assert cuda_spec()["install"]["nvidia"]["cuda_version"] == "13.0"
    old = cuda_spec(vllm_version="0.19.1")["install"]["nvidia"]
    assert (old["driver_branch"], old["cuda_version"]) == ("570", "12.8")      # CUDA 12.8 wheels
    assert checks.spec_problems(cuda_spec()) == []


def test_validate_refuses_a_driver_older_than_vllms_cuda():
    problems = checks.spec_problems(cuda_spec(driver_branch="570"))
    assert [p.path for p in problems] == ["install.nvidia.driver_branch"]
    text = f"{problems[0].message} {problems[0].fix}"
    assert "570" in text and "0.33.0" in text and "CUDA 13.0" in text and 'driver_branch: "580"' in text
    # a newer branch than needed is fine (the branch is a minimum)
    assert checks.spec_problems(cuda_spec(driver_branch="590")) == []
    # a CUDA 13 toolkit also needs 580, whatever the vLLM
    assert [p.path for p in checks.spec_problems(cuda_spec(vllm_version="0.19.1", driver_branch="570", cuda_version="13.0"))] == ["install.nvidia.driver_branch"]


def test_validate_refuses_debians_535_for_a_cuda13_vllm():
    problems = checks.spec_problems(cuda_spec(source="distro", driver_branch="535"))
    assert [p.path for p in problems] == ["install.nvidia.driver_branch"]
    assert "535" in problems[0].message and "source: nvidia" in problems[0].fix


# ------------------------------------------------------------------------------- deploy cases

def test_cpu_accelerator_is_a_no_op(harness):
    spec = resolve(load(REPO / "deployments" / "lab-tiny.yaml"))
    run = harness.run(nvidia, spec, facts={}, strict=True)  # strict: not even a fact is read
    assert run.ops == [] and run.asked == []


def test_right_driver_installs_nothing_and_does_not_reboot(harness):
    spec = cuda_spec(gpu="h200")
    facts = {
        LinuxDistribution: harness.distro("ubuntu-24.04"),
        NvidiaGpus: parse_nvidia_smi(harness.fixture_lines(H200)),
        DebPackages: {"cuda-toolkit-13-0": ["13.0.2-1"]},
        NvSwitches: 0,
    }
    run = harness.run(nvidia, spec, facts=facts, host="h200-a", strict=True)
    assert not run.changed
    assert run.ops == []


def test_newer_compatible_driver_is_left_alone(harness):
    # The lent H200 machine: 580.159.04 loaded, a vLLM 0.19 spec asks for branch 570 at least.
    spec = cuda_spec(gpu="h200", vllm_version="0.19.1")
    facts = {
        LinuxDistribution: harness.distro("ubuntu-24.04"),
        NvidiaGpus: parse_nvidia_smi(harness.fixture_lines(H200)),
        NvSwitches: 0,
    }
    run = harness.run(nvidia, spec, facts=facts, host="h200-a", data={"nvidia_install_toolkit": False}, strict=True)
    assert run.ops == [] and not run.has_op("Reboot")
    assert ("SecureBoot", {}) not in run.asked  # nothing to install: not even asked


def test_debian12_bare_host_nvidia_repository(harness):
    run = harness.run(nvidia, cuda_spec(), facts=bare_facts(harness, "debian-12"), host="gpu1")
    cmds = "\n".join(run.commands)

    # NVIDIA's repository for Debian 12 through its keyring package, contrib enabled first
    assert f"compute/cuda/repos/debian12/x86_64/{KEYRING}" in cmds
    assert run.index("contrib") < run.index(KEYRING)
    assert run.index(f"dpkg --force-confdef --force-confold -i /var/cache/vllm-fleet/{KEYRING}") < run.index("apt-get update")
    # DKMS + headers of the running kernel and the flavour's meta-package, pinning before the
    # driver, the compute-only set (no desktop stack), the toolkit of vLLM 0.33's CUDA 13.0
    assert apt_installs(run) == ["dkms", "linux-headers-6.1.0-27-amd64", "linux-headers-amd64", "nvidia-driver-pinning-580",
                                 "nvidia-driver-cuda", "nvidia-kernel-open-dkms", "nvidia-persistenced", "nvidia-modprobe",
                                 "cuda-toolkit-13-0"]
    assert "nvidia-open" not in apt_installs(run) and "cuda-drivers" not in apt_installs(run)
    assert run.index("apt-get update") < run.index("install --no-install-recommends dkms")
    # nouveau blacklisted, initramfs rebuilt only when the file changed
    assert "blacklist nouveau" in run.uploads["/etc/modprobe.d/blacklist-nouveau.conf"].splitlines()
    assert run.op("initramfs").commands == ["update-initramfs -u"] and run.op("initramfs").conditional
    # persistence mode on, the daemon enabled
    override = run.uploads["/etc/systemd/system/nvidia-persistenced.service.d/vllm-fleet.conf"]
    assert "--persistence-mode" in override and "ExecStart=\n" in override
    assert any("systemctl enable nvidia-persistenced" in c for c in run.op("persistenced enabled").commands)
    # then reboot (pyinfra's reboot-and-wait; unconditional: no driver answered), then nvidia-smi
    # and the GPU check
    reboot = run.op("Reboot")
    assert "python:wait_and_reconnect" in reboot.commands and not reboot.conditional
    assert run.index("reboot") > run.index("install nvidia-driver-cuda")
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
    assert apt_installs(run) == ["dkms", f"linux-headers-{kernel}", "linux-headers-generic", "nvidia-driver-pinning-580",
                                 "libnvidia-compute-580", "nvidia-dkms-580-open", "nvidia-utils-580",
                                 "nvidia-compute-utils-580", "nvidia-modprobe", "cuda-toolkit-13-0"]
    assert run.has_op("Reboot")


def test_ubuntu_590_packages_have_no_branch_suffix(harness):
    run = harness.run(nvidia, cuda_spec(driver_branch="590"), facts=bare_facts(harness, "ubuntu-24.04"))
    assert ["nvidia-driver-pinning-590", "libnvidia-compute", "nvidia-dkms-open", "nvidia-utils"] == apt_installs(run)[3:7]


def test_full_driver_when_compute_only_is_off(harness):
    run = harness.run(nvidia, cuda_spec(), facts=bare_facts(harness, "ubuntu-24.04"), data={"nvidia_compute_only": False})
    assert "nvidia-open" in apt_installs(run)


def test_ubuntu2404_keyring_download_is_checksummed(harness):
    run = harness.run(nvidia, cuda_spec(), facts=bare_facts(harness, "ubuntu-24.04"))
    download = run.op("keyring package")
    assert any("d2a6b11c096396d868758b86dab1823b25e14d70333f1dfa74da5ddaf6a06dba" in c for c in download.commands)


def test_proprietary_modules(harness):
    run = harness.run(nvidia, cuda_spec(open_kernel_modules=False), facts=bare_facts(harness, "ubuntu-24.04"))
    assert "nvidia-dkms-580" in apt_installs(run) and "nvidia-dkms-580-open" not in apt_installs(run)
    full = harness.run(nvidia, cuda_spec(open_kernel_modules=False), facts=bare_facts(harness, "ubuntu-24.04"),
                       data={"nvidia_compute_only": False})
    assert "cuda-drivers" in apt_installs(full) and "nvidia-open" not in apt_installs(full)


def test_changed_branch_really_installs_it(harness):
    """570 loaded with its packages installed, the spec needs 580: the pinning package moves and
    the installed driver packages are upgraded (apt-get install of the installed names, which
    the new pin resolves to 580), then the reboot, only if that changed something."""
    facts = bare_facts(harness, "debian-12", nouveau=False)
    facts[NvidiaGpus] = parse_nvidia_smi(harness.fixture_lines(H100_570))
    facts[DebPackages] = {n: ["570.195.03-1"] for n in ("nvidia-driver-cuda", "nvidia-kernel-open-dkms",
                                                        "nvidia-persistenced", "nvidia-modprobe")}
    facts[DebPackages]["nvidia-driver-pinning-570"] = ["570.195.03-1"]
    run = harness.run(nvidia, cuda_spec(gpu="h100-80gb", count=4), facts=facts, host="node3")
    assert "nvidia-driver-pinning-580" in apt_installs(run)
    driver = run.op("NVIDIA driver 580")
    assert driver.commands and "nvidia-driver-cuda" in driver.commands[0] and "nvidia-kernel-open-dkms" in driver.commands[0]
    reboot = run.op("Reboot")
    assert reboot.conditional  # _if: only when the driver install changed something
    assert run.commands[-1] == "python:_check_gpus_now"


def test_distro_source_ubuntu(harness):
    spec = cuda_spec(source="distro")
    run = harness.run(nvidia, spec, facts=bare_facts(harness, "ubuntu-22.04", kernel="5.15.0-125-generic"))
    cmds = "\n".join(run.commands)
    assert "compute/cuda/repos" not in cmds and "nvidia-driver-pinning" not in cmds
    assert apt_installs(run) == ["dkms", "linux-headers-5.15.0-125-generic", "linux-headers-generic",
                                 "nvidia-headless-580-server-open", "nvidia-utils-580-server", "nvidia-modprobe",
                                 "nvidia-cuda-toolkit"]
    assert run.has_op("Reboot")


def test_distro_source_debian_needs_its_branch(harness):
    with pytest.raises(UnsupportedHost, match=r"host gpu7: Debian 12 ships NVIDIA driver branch 535, the spec needs 580") as err:
        harness.run(nvidia, cuda_spec(source="distro"), facts=bare_facts(harness, "debian-12"), host="gpu7")
    assert "vLLM 0.33.0 needs 580" in str(err.value) and "source: nvidia" in str(err.value)


def test_distro_source_debian_535(harness):
    spec = cuda_spec(source="distro", driver_branch="535", vllm_version="0.19.1", cuda_version="12.2")
    run = harness.run(nvidia, spec, facts=bare_facts(harness, "debian-12"))
    components = run.op("apt components")
    assert "contrib non-free non-free-firmware" in components.name
    assert "compute/cuda/repos" not in "\n".join(run.commands)
    assert apt_installs(run) == ["dkms", "linux-headers-6.1.0-27-amd64", "linux-headers-amd64", "nvidia-open-kernel-dkms",
                                 "libcuda1", "nvidia-smi", "nvidia-persistenced", "nvidia-modprobe", "firmware-misc-nonfree",
                                 "nvidia-cuda-toolkit"]
    assert run.index("non-free-firmware") < run.index("apt-get update")


def test_components_already_enabled_are_not_touched(harness):
    facts = bare_facts(harness, "debian-12", components=("main", "contrib"))
    run = harness.run(nvidia, cuda_spec(), facts=facts)
    assert not run.has_op("apt components")


def test_driver_present_toolkit_missing_no_reboot(harness):
    spec = cuda_spec(gpu="h200")
    facts = bare_facts(harness, "ubuntu-24.04", nouveau=False)
    facts[NvidiaGpus] = parse_nvidia_smi(harness.fixture_lines(H200))
    run = harness.run(nvidia, spec, facts=facts)
    assert apt_installs(run) == ["cuda-toolkit-13-0"]
    assert not run.has_op("Reboot") and not run.has_op("nouveau") and not run.has_op("persistenced")


def test_nvswitch_board_gets_the_fabric_manager_of_the_loaded_branch(harness):
    spec = cuda_spec(gpu="h200", count=1)
    facts = bare_facts(harness, "ubuntu-24.04", nouveau=False)
    facts[NvidiaGpus] = parse_nvidia_smi(harness.fixture_lines(H200))
    facts[NvSwitches] = 4
    facts[DebPackages] = {"cuda-toolkit-13-0": ["13.0.2-1"]}
    run = harness.run(nvidia, spec, facts=facts)
    assert apt_installs(run) == ["nvidia-fabricmanager-580"]
    fm = run.op("nvidia-fabricmanager running and enabled")
    assert any("systemctl start nvidia-fabricmanager" in c for c in fm.commands)
    assert any("systemctl enable nvidia-fabricmanager" in c for c in fm.commands)
    assert not run.has_op("Reboot")
    # present: nothing more
    facts[DebPackages]["nvidia-fabricmanager-580"] = ["580.159.04-1"]
    assert harness.run(nvidia, spec, facts=facts).ops == []


def test_nvswitch_with_debians_own_packages_is_refused(harness):
    facts = bare_facts(harness, "debian-12")
    facts[NvSwitches] = 6
    spec = cuda_spec(source="distro", driver_branch="535", vllm_version="0.19.1", cuda_version="12.2")
    with pytest.raises(UnsupportedHost, match="host gpu9: this board has NVSwitches.*source: nvidia"):
        harness.run(nvidia, spec, facts=facts, host="gpu9")


def test_secure_boot_stops_before_anything_is_installed(harness):
    facts = bare_facts(harness, "ubuntu-24.04")
    facts[SecureBoot] = True
    with pytest.raises(UnsupportedHost, match="host sb1: UEFI Secure Boot is on") as err:
        harness.run(nvidia, cuda_spec(), facts=facts, host="sb1")
    assert "Nothing was installed" in str(err.value) and "nvidia_secure_boot_mok" in str(err.value)
    ok = harness.run(nvidia, cuda_spec(), facts=facts, data={"nvidia_secure_boot_mok": True})
    assert "nvidia-dkms-580-open" in apt_installs(ok)


def test_wrong_gpu_model_fails_naming_the_host(harness):
    facts = bare_facts(harness, "ubuntu-24.04")
    facts[NvidiaGpus] = parse_nvidia_smi(harness.fixture_lines(H200))
    with pytest.raises(GpuMismatch) as err:
        harness.run(nvidia, cuda_spec(gpu="rtx3090"), facts=facts, host="gpu-b17")
    message = str(err.value)
    assert "host gpu-b17" in message and "rtx3090" in message and "NVIDIA H200 (143771 MiB)" in message


def test_too_few_gpus_fails(harness):
    facts = bare_facts(harness, "ubuntu-24.04")
    facts[NvidiaGpus] = parse_nvidia_smi(harness.fixture_lines(H100_570))
    spec_old = dict(vllm_version="0.19.1")  # CUDA 12.8: the 570 driver of the fixture is enough
    with pytest.raises(GpuMismatch, match="host node3: the spec asks for 8 x h100-80gb"):
        harness.run(nvidia, cuda_spec(gpu="h100-80gb", count=8, **spec_old), facts=facts, host="node3")
    facts[DebPackages] = {"cuda-toolkit-12-8": ["12.8.1-1"]}
    ok = harness.run(nvidia, cuda_spec(gpu="h100-80gb", count=4, **spec_old), facts=facts, host="node3")
    assert not ok.changed


def test_unsupported_distro(harness):
    facts = {LinuxDistribution: {"name": "Ubuntu", "major": 20, "minor": 4, "release_meta": {}}}
    with pytest.raises(UnsupportedHost, match="host old1: Ubuntu 20.4 is not supported"):
        harness.run(nvidia, cuda_spec(), facts=facts, host="old1")


def test_no_reboot_when_disabled_stops_with_a_message(harness):
    run = harness.run(nvidia, cuda_spec(), facts=bare_facts(harness, "debian-12"), data={"nvidia_reboot": False})
    assert not run.has_op("Reboot into") and not run.has_op("GPUs match")
    stop = run.op("Stop: the new driver")
    assert stop.commands == ["python:_reboot_needed"]
    host = type("H", (), {"name": "gpu4"})()
    with pytest.raises(RebootNeeded, match="host gpu4: NVIDIA driver branch 580 is installed but not loaded.*reboot gpu4"):
        _reboot_needed(None, host, branch="580")
