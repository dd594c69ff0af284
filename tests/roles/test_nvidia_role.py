"""vllm_fleet/roles/nvidia, through the commands it would send (no GPU, no NVIDIA repository here).

Each case scripts the host as the one state read (host_state.sh's lines: the distribution from
real os-release files, nvidia-smi output from fixtures, the PCI bus, /proc, apt's sources, dpkg)
and checks the apt sources, package names, blacklist, initramfs and reboot a reviewer would look
for, or their absence. The script's kinds the role reads are run for real here with sh.
"""

from __future__ import annotations

import base64
import copy
import fnmatch
import os
import subprocess
from pathlib import Path

import pytest
from pyinfra.facts.deb import DebPackage, DebPackages
from pyinfra.facts.files import Directory, File
from pyinfra.facts.server import LinuxDistribution, Which

from vllm_fleet.specs import checks
from vllm_fleet.host.state import HostState, Query, Snapshot
from vllm_fleet.roles.common.state import StateUnknown
from vllm_fleet.roles.nvidia import (
    GpuMismatch,
    RebootNeeded,
    UnsupportedHost,
    _check_gpus_now,
    _reboot_needed,
    kernel_flavour,
    nvidia,
    state_query,
)
from vllm_fleet.roles.nvidia import defaults as d
from vllm_fleet.roles.nvidia.parse import (
    NVIDIA_SMI_QUERY,
    apt_source_lines,
    driver_branch,
    parse_apt_components,
    parse_nvidia_smi,
    parse_os_release,
    parse_pci_classes,
    secure_boot_on,
)
from vllm_fleet.render.files import deployment_paths
from vllm_fleet.specs.load import load, resolve

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


FIXTURES = Path(__file__).resolve().parent / "fixtures"
SCRIPT = REPO / "vllm_fleet" / "host" / "scripts" / "host_state.sh"


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def host_lines(
    query,
    *,
    os_release,
    kernel="6.1.0-27-amd64",
    nouveau=True,
    components=("main",),
    smi=None,
    nvswitches=0,
    debs=None,
    secure_boot=False,
):
    """host_state.sh's answer to ``query`` on a GPU host: ``os_release`` the text of its
    /etc/os-release, ``smi`` nvidia-smi's lines (None: no nvidia-smi), ``nvswitches`` NVIDIA
    bridges on the PCI bus (next to one GPU per smi line and an Intel bridge), ``debs``
    ``{installed package: version}`` (dpkg answers names and patterns asked), apt's sources.list
    one ``deb`` line of the release's codename with ``components``; then ``end``."""
    codename = next(
        (l.split("=", 1)[1].strip('"') for l in os_release.splitlines() if l.startswith("VERSION_CODENAME=")), ""
    )
    reads = {
        d.KERNEL_RELEASE: kernel + "\n",
        d.KERNEL_MODULES: "nouveau 2170880 0 - Live 0x0000000000000000\n" if nouveau else "",
        d.SECURE_BOOT_EFIVAR: "\x06\x00\x00\x00\x01" if secure_boot else None,
        d.APT_SOURCES_LIST: f"deb http://deb.debian.org/debian {codename} {' '.join(components)}\n",
    }
    lines = []
    for path in query.read:
        text = reads.get(path)
        lines.append(f"read\t{path}\t{'-' if text is None else _b64(text)}")
    for pattern in query.globs:
        lines.append(f"glob\t{pattern}\t.")
        if pattern == d.OS_RELEASE_GLOB:
            lines.append(f"glob\t{pattern}\t/etc/os-release\t{_b64(os_release)}")
    for fields in query.gpus:
        lines += (
            [f"gpus\t{fields}\t-"] if smi is None else [f"gpus\t{fields}\t.", *(f"gpus\t{fields}\t{l}" for l in smi)]
        )
    for sysfs in query.pci:
        devices = (
            ["0x8086 0x060400"]
            + ["0x10de 0x030200"] * len(parse_nvidia_smi(smi or []))
            + ["0x10de 0x068000"] * nvswitches
        )
        lines += [f"pci\t{sysfs}\t.", *(f"pci\t{sysfs}\t{dev}" for dev in devices)]
    for name, version in (debs or {}).items():
        if any(fnmatch.fnmatchcase(name, asked) for asked in query.debs):
            lines.append(f"deb\t{name}\tii \t{version}")
    return [*lines, "end"]


def gpu_host(harness, distro_name=None, os_release=None, debs=None, **host):
    """Scripted facts of a GPU host: the HostState read (``host_lines``; the distribution from
    tests/roles/fixtures/os-release/DISTRO_NAME, or ``os_release`` text), and the facts
    pyinfra's own operations read when they are created (apt.packages' DebPackages from the same
    ``debs``, files.download's File, ...)."""
    text = os_release if os_release is not None else (FIXTURES / "os-release" / distro_name).read_text()
    return {
        HostState: lambda query: Snapshot.parse(host_lines(query, os_release=text, debs=debs, **host)),
        DebPackages: {name: [version] for name, version in (debs or {}).items()},
        DebPackage: None,
        File: None,
        Directory: None,
        Which: harness.per_arg("command", {"curl": "/usr/bin/curl"}),
    }


def bare_facts(harness, distro_name, kernel="6.1.0-27-amd64", nouveau=True, components=("main",), **host):
    """A fresh GPU host: no NVIDIA driver (no nvidia-smi), nouveau loaded, only `main` enabled,
    nothing installed."""
    return gpu_host(harness, distro_name, kernel=kernel, nouveau=nouveau, components=components, **host)


def smi(harness, fixture):
    return harness.fixture_lines(fixture)


def facts_read(run):
    return [name for name, _ in run.asked]


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
    assert gpus == [
        {"index": 0, "name": "NVIDIA H200", "memory_mib": 143771, "driver_version": "580.159.04", "compute_cap": "9.0"}
    ]
    assert driver_branch(gpus) == "580"


def test_parse_four_gpus(harness):
    gpus = parse_nvidia_smi(harness.fixture_lines("nvidia-smi/h100-4gpu-570.csv"))
    assert [g["index"] for g in gpus] == [0, 1, 2, 3]
    assert {g["memory_mib"] for g in gpus} == {81559}
    assert driver_branch(gpus) == "570"


def test_parse_driver_not_loaded_means_no_gpus(harness):
    assert parse_nvidia_smi(harness.fixture_lines("nvidia-smi/driver-not-loaded.txt")) == []
    assert driver_branch([]) is None


def read_for_real(query: Query, path_env: str | None = None) -> Snapshot:
    """host_state.sh run here by sh, as the HostState fact runs it on a host."""
    env = {**os.environ, **({"PATH": path_env} if path_env else {})}
    r = subprocess.run(
        ["/bin/sh", "-c", HostState().command(query).get_raw_value()],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "end", r.stderr
    snap = Snapshot.parse(r.stdout.splitlines())
    snap.query = query
    return snap


def test_gpus_kind_runs_nvidia_smi_for_real(harness, tmp_path):
    """The `gpus` kind: nvidia-smi asked for the fields in CSV, its lines kept as printed (the
    parser gets nvidia-smi's stdout as printed); no nvidia-smi: `-`, no GPU."""
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(
        "#!/bin/sh\n"
        f'[ "$*" = "--query-gpu={NVIDIA_SMI_QUERY} --format=csv,noheader,nounits" ] || exit 9\n'
        f"cat {FIXTURES / 'nvidia-smi' / 'h100-4gpu-570.csv'}\n"
    )
    fake.chmod(0o755)
    q = Query(gpus=(NVIDIA_SMI_QUERY,))
    known, lines = read_for_real(q, path_env=f"{fake.parent}:{os.environ['PATH']}").nvidia_smi(NVIDIA_SMI_QUERY)
    assert known and lines == harness.fixture_lines("nvidia-smi/h100-4gpu-570.csv")
    assert driver_branch(parse_nvidia_smi(lines)) == "570"
    # the driver not loaded: nvidia-smi's message (stdout, exit 9), no GPU
    fake.write_text(f"#!/bin/sh\ncat {FIXTURES / 'nvidia-smi' / 'driver-not-loaded.txt'}\nexit 9\n")
    known, lines = read_for_real(q, path_env=f"{fake.parent}:{os.environ['PATH']}").nvidia_smi(NVIDIA_SMI_QUERY)
    assert known and lines and parse_nvidia_smi(lines) == []
    fake.unlink()  # this machine has no nvidia-smi of its own
    assert read_for_real(q, path_env=f"{fake.parent}:{os.environ['PATH']}").nvidia_smi(NVIDIA_SMI_QUERY) == (True, None)
    assert Snapshot().nvidia_smi(NVIDIA_SMI_QUERY) == (False, None)  # not read: not known


def test_parse_pci_bus_counts_nvswitches_only(tmp_path):
    # sysfs `vendor class` lines of an HGX H100 board: GPUs are 3D controllers (0x0302), the
    # NVSwitches NVIDIA bridges (0x0680); an Intel bridge and an NVIDIA audio function are not.
    lines = ["0x10de 0x030200"] * 8 + ["0x10de 0x068000"] * 4 + ["0x8086 0x068000", "0x10de 0x040300", ""]
    assert parse_pci_classes(lines) == 4
    assert parse_pci_classes(["0x10de 0x030200"]) == 0
    # the `pci` kind for real, on a tree laid out as /sys/bus/pci/devices (a device without a
    # class file is skipped)
    for i, line in enumerate(lines[:14]):
        vendor, cls = line.split()
        dev = tmp_path / f"0000:{i:02x}:00.0"
        dev.mkdir()
        (dev / "vendor").write_text(vendor + "\n")
        (dev / "class").write_text(cls + "\n")
    (tmp_path / "0000:ff:00.0").mkdir()
    (tmp_path / "0000:ff:00.0" / "vendor").write_text("0x10de\n")
    devices = read_for_real(Query(pci=(str(tmp_path),))).pci_devices(str(tmp_path))
    assert sorted(devices) == sorted(lines[:14]) and parse_pci_classes(devices) == 4
    assert read_for_real(Query(pci=(str(tmp_path / "none"),))).pci_devices(str(tmp_path / "none")) == []
    assert state_query(cuda_spec()).pci == ("/sys/bus/pci/devices",)


def test_secure_boot_from_the_efivar_read_for_real(tmp_path):
    efivar = tmp_path / "SecureBoot-8be4df61-93ca-11d2-aa0d-e0a5c5a8d5b0"
    for value, on in ((b"\x06\x00\x00\x00\x01", True), (b"\x07\x00\x00\x00\x00", False)):
        efivar.write_bytes(value)
        assert secure_boot_on(read_for_real(Query(read=(str(efivar),))).content(str(efivar))[1]) is on
    efivar.unlink()
    assert (
        secure_boot_on(read_for_real(Query(read=(str(efivar),))).content(str(efivar))[1]) is False
    )  # no EFI / no variable


def test_distribution_and_kernel_read_as_pyinfras_facts_give_them():
    """The state read's /etc/*-release files through pyinfra's own parser equal the
    LinuxDistribution fact (its command run here), and /proc/sys/kernel/osrelease is uname -r."""
    snap = read_for_real(state_query(cuda_spec()))
    fact = subprocess.run(["sh", "-c", LinuxDistribution().command()], capture_output=True, text=True, timeout=30)
    expected = LinuxDistribution().process(fact.stdout.splitlines())
    assert expected["name"] and parse_os_release(snap.matching(d.OS_RELEASE_GLOB)) == expected
    assert snap.content(d.KERNEL_RELEASE)[1].strip() == os.uname().release


def test_apt_components_from_the_source_files_read_for_real(tmp_path):
    (tmp_path / "sources.list").write_text(
        "deb [arch=amd64] http://mirror.invalid/debian bookworm contrib\n"
        "# deb http://mirror.invalid/debian bookworm non-free\n"
    )
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "a.sources").write_text(
        "Types: deb\nURIs: http://mirror.invalid/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main non-free-firmware\n\nTypes: deb\nURIs: http://mirror.invalid/x\n"
        "Suites: nodistro\nComponents: other\n"
    )
    (tmp_path / "sources.list.d" / "b.list").write_text("deb http://mirror.invalid/debian bookworm-backports non-free")
    listd = tmp_path / "sources.list.d"
    q = Query(read=(str(tmp_path / "sources.list"),), globs=(f"{listd}/*.list", f"{listd}/*.sources"))
    snap = read_for_real(q)
    texts = [
        snap.content(str(tmp_path / "sources.list"))[1],
        *snap.matching(f"{listd}/*.list").values(),
        *snap.matching(f"{listd}/*.sources").values(),
    ]
    assert len(texts) == 3
    assert parse_apt_components(apt_source_lines(texts), "bookworm") == {"main", "non-free-firmware", "contrib"}


def test_kernel_flavour_for_the_headers_meta_package():
    assert kernel_flavour("6.1.0-27-amd64") == "amd64"
    assert kernel_flavour("6.1.0-27-cloud-amd64") == "cloud-amd64"
    assert kernel_flavour("6.8.0-49-generic") == "generic"
    assert kernel_flavour("6.8.0-1015-aws") == "aws"


def test_parse_apt_components_both_formats():
    lines = [
        "Types: deb",
        "URIs: http://mirror.invalid/debian",
        "Suites: bookworm bookworm-updates",
        "Components: main non-free-firmware",
        "",
        "Types: deb",
        "URIs: http://mirror.invalid/x",
        "Suites: nodistro",
        "Components: other",
        "",
        "deb [arch=amd64] http://mirror.invalid/debian bookworm contrib",
        "# deb http://mirror.invalid/debian bookworm non-free",
    ]
    assert parse_apt_components(lines, "bookworm") == {"main", "non-free-firmware", "contrib"}


# ------------------------------------------------------------------------ driver vs vLLM's CUDA


def test_driver_branch_follows_the_pinned_vllm():
    assert cuda_spec()["install"]["nvidia"]["driver_branch"] == "580"  # vLLM 0.33.0: CUDA 13
    assert cuda_spec()["install"]["nvidia"]["cuda_version"] == "13.0"
    old = cuda_spec(vllm_version="0.19.1")["install"]["nvidia"]
    assert (old["driver_branch"], old["cuda_version"]) == ("570", "12.8")  # CUDA 12.8 wheels
    assert checks.spec_problems(cuda_spec()) == []


def test_validate_refuses_a_driver_older_than_vllms_cuda():
    problems = checks.spec_problems(cuda_spec(driver_branch="570"))
    assert [p.path for p in problems] == ["install.nvidia.driver_branch"]
    text = f"{problems[0].message} {problems[0].fix}"
    assert "570" in text and "0.33.0" in text and "CUDA 13.0" in text and 'driver_branch: "580"' in text
    # a newer branch than needed is fine (the branch is a minimum)
    assert checks.spec_problems(cuda_spec(driver_branch="590")) == []
    # a CUDA 13 toolkit also needs 580, whatever the vLLM
    assert [
        p.path for p in checks.spec_problems(cuda_spec(vllm_version="0.19.1", driver_branch="570", cuda_version="13.0"))
    ] == ["install.nvidia.driver_branch"]


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
    facts = gpu_host(
        harness, "ubuntu-24.04", nouveau=False, smi=smi(harness, H200), debs={"cuda-toolkit-13-0": "13.0.2-1"}
    )
    run = harness.run(nvidia, spec, facts=facts, host="h200-a", strict=True)
    assert not run.changed
    assert run.ops == []
    assert facts_read(run) == ["HostState"]  # one read: the role's state_query, no fact of its own


def test_newer_compatible_driver_is_left_alone(harness):
    # The lent H200 machine: 580.159.04 loaded, a vLLM 0.19 spec asks for branch 570 at least.
    spec = cuda_spec(gpu="h200", vllm_version="0.19.1")
    facts = gpu_host(harness, "ubuntu-24.04", nouveau=False, smi=smi(harness, H200), secure_boot=True)
    run = harness.run(nvidia, spec, facts=facts, host="h200-a", data={"nvidia_install_toolkit": False}, strict=True)
    assert run.ops == [] and not run.has_op("Reboot")  # Secure Boot on does not matter: nothing to install
    assert facts_read(run) == ["HostState"]


def test_debian12_bare_host_nvidia_repository(harness):
    run = harness.run(nvidia, cuda_spec(), facts=bare_facts(harness, "debian-12"), host="gpu1")
    cmds = "\n".join(run.commands)

    # NVIDIA's repository for Debian 12 through its keyring package, contrib enabled first
    assert f"compute/cuda/repos/debian12/x86_64/{KEYRING}" in cmds
    assert run.index("contrib") < run.index(KEYRING)
    assert run.index(f"dpkg --force-confdef --force-confold -i /var/cache/vllm-fleet/{KEYRING}") < run.index(
        "apt-get update"
    )
    # DKMS + headers of the running kernel and the flavour's meta-package, pinning before the
    # driver, the compute-only set (no desktop stack), the toolkit of vLLM 0.33's CUDA 13.0
    assert apt_installs(run) == [
        "dkms",
        "linux-headers-6.1.0-27-amd64",
        "linux-headers-amd64",
        "nvidia-driver-pinning-580",
        "nvidia-driver-cuda",
        "nvidia-kernel-open-dkms",
        "nvidia-persistenced",
        "nvidia-modprobe",
        "cuda-toolkit-13-0",
    ]
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


@pytest.mark.parametrize(
    "distro_name, repo, kernel",
    [
        ("ubuntu-22.04", "ubuntu2204/x86_64", "5.15.0-125-generic"),
        ("ubuntu-24.04", "ubuntu2404/x86_64", "6.8.0-49-generic"),
    ],
)
def test_ubuntu_bare_host_nvidia_repository(harness, distro_name, repo, kernel):
    run = harness.run(nvidia, cuda_spec(), facts=bare_facts(harness, distro_name, kernel=kernel), host="gpu2")
    cmds = "\n".join(run.commands)
    assert f"compute/cuda/repos/{repo}/{KEYRING}" in cmds
    assert "contrib" not in cmds  # Ubuntu: no Debian components
    assert apt_installs(run) == [
        "dkms",
        f"linux-headers-{kernel}",
        "linux-headers-generic",
        "nvidia-driver-pinning-580",
        "libnvidia-compute-580",
        "nvidia-dkms-580-open",
        "nvidia-utils-580",
        "nvidia-compute-utils-580",
        "nvidia-modprobe",
        "cuda-toolkit-13-0",
    ]
    assert run.has_op("Reboot")


def test_ubuntu_590_packages_have_no_branch_suffix(harness):
    run = harness.run(nvidia, cuda_spec(driver_branch="590"), facts=bare_facts(harness, "ubuntu-24.04"))
    assert ["nvidia-driver-pinning-590", "libnvidia-compute", "nvidia-dkms-open", "nvidia-utils"] == apt_installs(run)[
        3:7
    ]


def test_full_driver_when_compute_only_is_off(harness):
    run = harness.run(
        nvidia, cuda_spec(), facts=bare_facts(harness, "ubuntu-24.04"), data={"nvidia_compute_only": False}
    )
    assert "nvidia-open" in apt_installs(run)


def test_ubuntu2404_keyring_download_is_checksummed(harness):
    run = harness.run(nvidia, cuda_spec(), facts=bare_facts(harness, "ubuntu-24.04"))
    download = run.op("keyring package")
    assert any("d2a6b11c096396d868758b86dab1823b25e14d70333f1dfa74da5ddaf6a06dba" in c for c in download.commands)


def test_proprietary_modules(harness):
    run = harness.run(nvidia, cuda_spec(open_kernel_modules=False), facts=bare_facts(harness, "ubuntu-24.04"))
    assert "nvidia-dkms-580" in apt_installs(run) and "nvidia-dkms-580-open" not in apt_installs(run)
    full = harness.run(
        nvidia,
        cuda_spec(open_kernel_modules=False),
        facts=bare_facts(harness, "ubuntu-24.04"),
        data={"nvidia_compute_only": False},
    )
    assert "cuda-drivers" in apt_installs(full) and "nvidia-open" not in apt_installs(full)


def test_changed_branch_really_installs_it(harness):
    """570 loaded with its packages installed, the spec needs 580: the pinning package moves and
    the installed driver packages are upgraded (apt-get install of the installed names, which
    the new pin resolves to 580), then the reboot, only if that changed something."""
    installed = {
        n: "570.195.03-1"
        for n in (
            "nvidia-driver-cuda",
            "nvidia-kernel-open-dkms",
            "nvidia-persistenced",
            "nvidia-modprobe",
            "nvidia-driver-pinning-570",
        )
    }
    facts = bare_facts(harness, "debian-12", nouveau=False, smi=smi(harness, H100_570), debs=installed)
    run = harness.run(nvidia, cuda_spec(gpu="h100-80gb", count=4), facts=facts, host="node3")
    assert "nvidia-driver-pinning-580" in apt_installs(run)
    driver = run.op("NVIDIA driver 580")
    assert (
        driver.commands
        and "nvidia-driver-cuda" in driver.commands[0]
        and "nvidia-kernel-open-dkms" in driver.commands[0]
    )
    reboot = run.op("Reboot")
    assert reboot.conditional  # _if: only when the driver install changed something
    assert run.commands[-1] == "python:_check_gpus_now"


def test_distro_source_ubuntu(harness):
    spec = cuda_spec(source="distro")
    run = harness.run(nvidia, spec, facts=bare_facts(harness, "ubuntu-22.04", kernel="5.15.0-125-generic"))
    cmds = "\n".join(run.commands)
    assert "compute/cuda/repos" not in cmds and "nvidia-driver-pinning" not in cmds
    assert apt_installs(run) == [
        "dkms",
        "linux-headers-5.15.0-125-generic",
        "linux-headers-generic",
        "nvidia-headless-580-server-open",
        "nvidia-utils-580-server",
        "nvidia-modprobe",
        "nvidia-cuda-toolkit",
    ]
    assert run.has_op("Reboot")


def test_distro_source_debian_needs_its_branch(harness):
    with pytest.raises(
        UnsupportedHost, match=r"host gpu7: Debian 12 ships NVIDIA driver branch 535, the spec needs 580"
    ) as err:
        harness.run(nvidia, cuda_spec(source="distro"), facts=bare_facts(harness, "debian-12"), host="gpu7")
    assert "vLLM 0.33.0 needs 580" in str(err.value) and "source: nvidia" in str(err.value)


def test_distro_source_debian_535(harness):
    spec = cuda_spec(source="distro", driver_branch="535", vllm_version="0.19.1", cuda_version="12.2")
    run = harness.run(nvidia, spec, facts=bare_facts(harness, "debian-12"))
    components = run.op("apt components")
    assert "contrib non-free non-free-firmware" in components.name
    assert "compute/cuda/repos" not in "\n".join(run.commands)
    assert apt_installs(run) == [
        "dkms",
        "linux-headers-6.1.0-27-amd64",
        "linux-headers-amd64",
        "nvidia-open-kernel-dkms",
        "libcuda1",
        "nvidia-smi",
        "nvidia-persistenced",
        "nvidia-modprobe",
        "firmware-misc-nonfree",
        "nvidia-cuda-toolkit",
    ]
    assert run.index("non-free-firmware") < run.index("apt-get update")


def test_components_already_enabled_are_not_touched(harness):
    facts = bare_facts(harness, "debian-12", components=("main", "contrib"))
    run = harness.run(nvidia, cuda_spec(), facts=facts)
    assert not run.has_op("apt components")


def test_driver_present_toolkit_missing_no_reboot(harness):
    spec = cuda_spec(gpu="h200")
    facts = bare_facts(harness, "ubuntu-24.04", nouveau=False, smi=smi(harness, H200))
    run = harness.run(nvidia, spec, facts=facts)
    assert apt_installs(run) == ["cuda-toolkit-13-0"]
    assert not run.has_op("Reboot") and not run.has_op("nouveau") and not run.has_op("persistenced")


def test_nvswitch_board_gets_the_fabric_manager_of_the_loaded_branch(harness):
    spec = cuda_spec(gpu="h200", count=1)
    host = dict(nouveau=False, smi=smi(harness, H200), nvswitches=4)
    facts = bare_facts(harness, "ubuntu-24.04", debs={"cuda-toolkit-13-0": "13.0.2-1"}, **host)
    run = harness.run(nvidia, spec, facts=facts)
    assert apt_installs(run) == ["nvidia-fabricmanager-580"]
    fm = run.op("nvidia-fabricmanager running and enabled")
    assert any("systemctl start nvidia-fabricmanager" in c for c in fm.commands)
    assert any("systemctl enable nvidia-fabricmanager" in c for c in fm.commands)
    assert not run.has_op("Reboot")
    # present: nothing more (dpkg answers the pattern the read asks with the branch's name)
    facts = bare_facts(
        harness,
        "ubuntu-24.04",
        debs={"cuda-toolkit-13-0": "13.0.2-1", "nvidia-fabricmanager-580": "580.159.04-1"},
        **host,
    )
    assert harness.run(nvidia, spec, facts=facts).ops == []
    # another branch's fabric manager is not this one's
    facts = bare_facts(
        harness,
        "ubuntu-24.04",
        debs={"cuda-toolkit-13-0": "13.0.2-1", "nvidia-fabricmanager-570": "570.195.03-1"},
        **host,
    )
    assert apt_installs(harness.run(nvidia, spec, facts=facts)) == ["nvidia-fabricmanager-580"]


def test_nvswitch_with_debians_own_packages_is_refused(harness):
    facts = bare_facts(harness, "debian-12", nvswitches=6)
    spec = cuda_spec(source="distro", driver_branch="535", vllm_version="0.19.1", cuda_version="12.2")
    with pytest.raises(UnsupportedHost, match="host gpu9: this board has NVSwitches.*source: nvidia"):
        harness.run(nvidia, spec, facts=facts, host="gpu9")


def test_secure_boot_stops_before_anything_is_installed(harness):
    facts = bare_facts(harness, "ubuntu-24.04", secure_boot=True)
    with pytest.raises(UnsupportedHost, match="host sb1: UEFI Secure Boot is on") as err:
        harness.run(nvidia, cuda_spec(), facts=facts, host="sb1")
    assert "Nothing was installed" in str(err.value) and "nvidia_secure_boot_mok" in str(err.value)
    ok = harness.run(nvidia, cuda_spec(), facts=facts, data={"nvidia_secure_boot_mok": True})
    assert "nvidia-dkms-580-open" in apt_installs(ok)


def test_wrong_gpu_model_fails_naming_the_host(harness):
    facts = bare_facts(harness, "ubuntu-24.04", smi=smi(harness, H200))
    with pytest.raises(GpuMismatch) as err:
        harness.run(nvidia, cuda_spec(gpu="rtx3090"), facts=facts, host="gpu-b17")
    message = str(err.value)
    assert "host gpu-b17" in message and "rtx3090" in message and "NVIDIA H200 (143771 MiB)" in message


def test_too_few_gpus_fails(harness):
    facts = bare_facts(harness, "ubuntu-24.04", smi=smi(harness, H100_570))
    spec_old = dict(vllm_version="0.19.1")  # CUDA 12.8: the 570 driver of the fixture is enough
    with pytest.raises(GpuMismatch, match="host node3: the spec asks for 8 x h100-80gb"):
        harness.run(nvidia, cuda_spec(gpu="h100-80gb", count=8, **spec_old), facts=facts, host="node3")
    facts = bare_facts(harness, "ubuntu-24.04", smi=smi(harness, H100_570), debs={"cuda-toolkit-12-8": "12.8.1-1"})
    ok = harness.run(nvidia, cuda_spec(gpu="h100-80gb", count=4, **spec_old), facts=facts, host="node3")
    assert not ok.changed


def test_unsupported_distro(harness):
    facts = gpu_host(harness, os_release='NAME="Ubuntu"\nVERSION_ID="20.04"\nID=ubuntu\nVERSION_CODENAME=focal\n')
    with pytest.raises(UnsupportedHost, match="host old1: Ubuntu 20.4 is not supported"):
        harness.run(nvidia, cuda_spec(), facts=facts, host="old1")


def test_no_reboot_when_disabled_stops_with_a_message(harness):
    run = harness.run(nvidia, cuda_spec(), facts=bare_facts(harness, "debian-12"), data={"nvidia_reboot": False})
    assert not run.has_op("Reboot into") and not run.has_op("GPUs match")
    stop = run.op("Stop: the new driver")
    assert stop.commands == ["python:_reboot_needed"]
    host = type("H", (), {"name": "gpu4"})()
    with pytest.raises(
        RebootNeeded, match="host gpu4: NVIDIA driver branch 580 is installed but not loaded.*reboot gpu4"
    ):
        _reboot_needed(None, host, branch="580")


# --------------------------------------------------------------------- the one state read


def test_an_unfinished_read_stops_the_host_before_anything(harness):
    """No `end` (the read was cut): nothing is believed, so no "no driver here" guess that would
    install a driver and reboot the host; the message names the host."""
    facts = bare_facts(harness, "debian-12")
    facts[HostState] = lambda query: Snapshot.parse(
        host_lines(query, os_release=(FIXTURES / "os-release" / "debian-12").read_text())[:-1]
    )
    with pytest.raises(StateUnknown, match="host gpu5: the read of this host's state did not complete") as err:
        harness.run(nvidia, cuda_spec(), facts=facts, host="gpu5")
    assert "nothing was changed" in str(err.value)


def test_the_serve_deploys_one_read_holds_what_the_role_needs(harness):
    """roles.service.server_stack_query (what deploys/serve.py and the rollout read in one round
    trip) asks everything the nvidia role reads: on a converged H200 host the role adds no
    command, so a no-op deploy stays at its one state read. A CPU spec asks none of it."""
    from pyinfra.api import deploy

    from vllm_fleet.roles.common.state import load_host_state
    from vllm_fleet.roles.service import server_stack_query

    spec = cuda_spec(gpu="h200")
    assert state_query(spec) and not (state_query(spec) - server_stack_query(spec, deployment_paths(spec)))
    cpu = resolve(load(REPO / "deployments" / "lab-tiny.yaml"))
    stack = server_stack_query(cpu, deployment_paths(cpu))
    assert not state_query(cpu) and not stack.gpus and not stack.pci

    @deploy("serve's read, then the role")
    def serve_like(spec):
        load_host_state(server_stack_query(spec, deployment_paths(spec)))
        nvidia(spec=spec)

    facts = gpu_host(
        harness, "ubuntu-24.04", nouveau=False, smi=smi(harness, H200), debs={"cuda-toolkit-13-0": "13.0.2-1"}
    )
    run = harness.run(serve_like, spec, facts=facts, strict=True)
    assert run.ops == [] and facts_read(run) == ["HostState"]


def test_the_read_asks_the_toolkit_and_nvswitches_only_when_the_role_would_install_them(harness):
    """Host data nvidia_install_toolkit / nvidia_fabricmanager false: the state read asks neither
    the toolkit's package nor the PCI devices, and the converged role still adds no command."""
    from pyinfra.api import deploy

    from vllm_fleet.roles.common.state import load_host_state

    spec = cuda_spec(gpu="h200")
    asked = []

    @deploy("serve's read, then the role")
    def serve_like(spec):
        q = state_query(spec)
        asked.append(q)
        load_host_state(q)
        nvidia(spec=spec)

    facts = gpu_host(harness, "ubuntu-24.04", nouveau=False, smi=smi(harness, H200), debs={})
    run = harness.run(
        serve_like,
        spec,
        facts=facts,
        strict=True,
        data={"nvidia_install_toolkit": False, "nvidia_fabricmanager": False},
    )
    assert run.ops == [] and facts_read(run) == ["HostState"]
    (q,) = asked
    assert not q.pci and not [p for p in q.debs if "toolkit" in p or "fabricmanager" in p], q.debs
    assert state_query(spec).pci and [p for p in state_query(spec).debs if "toolkit" in p]  # the defaults: both asked


class _Host:
    """The host a python.call function is given, answering its HostState read with ``lines``."""

    name = "gpu6"

    def __init__(self, lines):
        self.lines, self.asked = lines, []

    def get_fact(self, cls, query):
        self.asked.append((cls.__name__, query))
        return Snapshot.parse(self.lines)


def test_the_check_after_the_reboot_reads_the_gpus_again(harness):
    """_check_gpus_now (run on the host after the reboot) reads nvidia-smi then, not the plan's
    state: the branch loaded and the GPUs passes; the old branch still loaded, no GPU or a
    read that did not complete stops the host naming it."""
    h200 = [f"gpus\t{NVIDIA_SMI_QUERY}\t.", *(f"gpus\t{NVIDIA_SMI_QUERY}\t{l}" for l in smi(harness, H200))]
    hw = {"gpu": "h200", "gpus_per_node": 1}
    host = _Host([*h200, "end"])
    _check_gpus_now(None, host, branch="580", hardware=hw)
    assert host.asked == [("HostState", Query(gpus=(NVIDIA_SMI_QUERY,)))]
    with pytest.raises(GpuMismatch, match="host gpu6: after installing driver branch 590 and rebooting.*branch 580"):
        _check_gpus_now(None, _Host([*h200, "end"]), branch="590", hardware=hw)
    with pytest.raises(GpuMismatch, match="reports no GPU"):
        _check_gpus_now(None, _Host([f"gpus\t{NVIDIA_SMI_QUERY}\t-", "end"]), branch="580", hardware=hw)
    with pytest.raises(StateUnknown, match="host gpu6: .*did not complete"):
        _check_gpus_now(None, _Host(h200), branch="580", hardware=hw)
    with pytest.raises(GpuMismatch, match="the spec asks for 2 x h200"):
        _check_gpus_now(None, _Host([*h200, "end"]), branch="580", hardware={"gpu": "h200", "gpus_per_node": 2})


def test_a_held_driver_and_toolkit_are_installed(harness):
    """apt-mark hold on the toolkit (dpkg's `hi`): present, as pyinfra's DebPackages says; no apt."""
    os_release = (FIXTURES / "os-release" / "ubuntu-24.04").read_text()
    facts = gpu_host(
        harness, "ubuntu-24.04", nouveau=False, smi=smi(harness, H200), debs={"cuda-toolkit-13-0": "13.0.2-1"}
    )
    facts[HostState] = lambda query: Snapshot.parse(
        [
            l.replace("\tii \t", "\thi \t")
            for l in host_lines(
                query,
                os_release=os_release,
                nouveau=False,
                smi=smi(harness, H200),
                debs={"cuda-toolkit-13-0": "13.0.2-1"},
            )
        ]
    )
    assert harness.run(nvidia, cuda_spec(gpu="h200"), facts=facts).ops == []
