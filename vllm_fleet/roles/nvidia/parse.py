"""What the nvidia role reads of a host, from the one state read (vllm_fleet.roles.common.state):
the GPUs and driver nvidia-smi reports, the distribution, the NVSwitches on the PCI bus, Secure
Boot and Debian's apt components.

Plain functions of the lines and texts host_state.sh prints (``parse_nvidia_smi``,
``parse_os_release``, ``parse_pci_classes``, ``secure_boot_on``, ``parse_apt_components``), so
tests feed them raw output; the role's ``state_query`` says what is read.
"""

from __future__ import annotations

import re
from typing import TypedDict

from pyinfra.facts.server import LinuxDistribution

NVIDIA_SMI_QUERY = "name,memory.total,driver_version,compute_cap"
NVIDIA_SMI_COMMAND = f"nvidia-smi --query-gpu={NVIDIA_SMI_QUERY} --format=csv,noheader,nounits"


class Gpu(TypedDict):
    index: int
    name: str
    memory_mib: int
    driver_version: str
    compute_cap: str


def parse_nvidia_smi(lines: list[str]) -> list[Gpu]:
    """Parse ``nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap
    --format=csv,noheader,nounits`` output, one GPU per line (``NVIDIA H200, 143771, 580.159.04, 9.0``).

    Lines that are not four comma-separated fields with a numeric memory (nvidia-smi's
    "couldn't communicate with the NVIDIA driver" message, "No devices were found", blank lines)
    are skipped: no parsable line means no usable GPU.
    """
    gpus: list[Gpu] = []
    for line in lines:
        # GPU names never contain commas; split from the right anyway so they could.
        parts = [p.strip() for p in line.rsplit(",", 3)]
        if len(parts) != 4:
            continue
        name, memory, driver, cap = parts
        if not memory.isdigit() or not re.fullmatch(r"[0-9]+(\.[0-9]+)+", driver):
            continue
        gpus.append(
            {"index": len(gpus), "name": name, "memory_mib": int(memory), "driver_version": driver, "compute_cap": cap}
        )
    return gpus


def driver_branch(gpus: list[Gpu]) -> str | None:
    """The driver branch (``580`` for ``580.159.04``) all GPUs report, or None without GPUs."""
    branches = {g["driver_version"].split(".")[0] for g in gpus}
    if len(branches) == 1:
        return branches.pop()
    return None


def parse_os_release(files: dict[str, str | None]) -> dict:
    """pyinfra's LinuxDistribution fact value (``{"name": "Ubuntu", "major": 24, "minor": 4,
    "release_meta": {...}}``) from the ``/etc/*-release`` files' texts (``{path: text}``, as the
    state read's ``globs`` gives them), parsed by pyinfra's own parser: the same value the fact
    gives for the same files."""
    lines: list[str] = []
    for path, text in sorted(files.items()):
        if text is not None:
            lines += [path, *text.splitlines(), "---"]
    return LinuxDistribution().process(lines)


def parse_apt_components(lines: list[str], suite: str) -> set[str]:
    """Components enabled for ``suite`` (e.g. ``bookworm``) in apt sources.

    Reads one-line (``deb URI suite comp...``) and deb822 (``Suites:`` / ``Components:``)
    stanzas, the files' lines one after another with a blank line after each file.
    """
    components: set[str] = set()
    stanza: dict[str, str] = {}

    def flush() -> None:
        if stanza.get("types", "deb").split() and "deb" in stanza.get("types", "deb").split():
            if suite in stanza.get("suites", "").split() and stanza.get("enabled", "yes") != "no":
                components.update(stanza.get("components", "").split())
        stanza.clear()

    for raw in lines + [""]:
        line = raw.strip()
        if not line:
            flush()
            continue
        if line.startswith("#"):
            continue
        if line.startswith("deb "):
            words = re.sub(r"\[[^]]*\]", " ", line).split()
            # deb URI SUITE COMPONENT...
            if len(words) >= 4 and words[2] == suite:
                components.update(words[3:])
            continue
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("types", "suites", "components", "enabled"):
            stanza[key.strip().lower()] = value.strip()
    return components


def apt_source_lines(texts: list[str | None]) -> list[str]:
    """The lines of apt's source files (``None``: absent), a blank line after each file, for
    :func:`parse_apt_components`."""
    lines: list[str] = []
    for text in texts:
        if text is not None:
            lines += [*text.splitlines(), ""]
    return lines


def parse_pci_classes(lines: list[str]) -> int:
    """NVSwitches among ``<vendor> <class>`` lines (one PCI device a line, from sysfs): NVIDIA's
    vendor id 0x10de with PCI class 0x0680xx ("Bridge: other", as lspci shows an NVSwitch).
    GPUs are 0x0300xx / 0x0302xx."""
    count = 0
    for line in lines:
        words = line.split()
        if len(words) == 2 and words[0].lower() == "0x10de" and words[1].lower().startswith("0x0680"):
            count += 1
    return count


def secure_boot_on(efivar: str | None) -> bool:
    """The SecureBoot EFI variable's content (4 attribute bytes, then the value; None: no EFI or
    no variable): on when the value is 1."""
    return bool(efivar) and efivar[-1] == "\x01"
