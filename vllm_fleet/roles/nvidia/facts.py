"""Facts for the nvidia role: the GPUs and driver nvidia-smi reports, and Debian's apt components.

The parsers are plain functions (``parse_nvidia_smi``, ``parse_apt_components``) so tests feed them
raw command output; the ``FactBase`` classes only add the command pyinfra runs on the host.
"""

from __future__ import annotations

import re
from typing import TypedDict

from pyinfra.api import FactBase, QuoteString, StringCommand

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
        gpus.append({"index": len(gpus), "name": name, "memory_mib": int(memory),
                     "driver_version": driver, "compute_cap": cap})
    return gpus


def driver_branch(gpus: list[Gpu]) -> str | None:
    """The driver branch (``580`` for ``580.159.04``) all GPUs report, or None without GPUs."""
    branches = {g["driver_version"].split(".")[0] for g in gpus}
    if len(branches) == 1:
        return branches.pop()
    return None


class NvidiaGpus(FactBase[list]):
    """The GPUs the loaded NVIDIA driver sees: a list of ``Gpu`` dicts.

    Empty when nvidia-smi is absent (pyinfra then returns the default without running the
    command), when the driver is not loaded, or when no GPU is found.
    """

    def command(self) -> StringCommand:
        # nvidia-smi exits non-zero when the driver is not loaded; that state is "no GPUs".
        return StringCommand(NVIDIA_SMI_COMMAND, "2>/dev/null", "||", "true")

    def requires_command(self) -> str:
        return "nvidia-smi"

    @staticmethod
    def default() -> list:
        return []

    def process(self, output: list[str]) -> list[Gpu]:
        return parse_nvidia_smi(output)


def parse_apt_components(lines: list[str], suite: str) -> set[str]:
    """Components enabled for ``suite`` (e.g. ``bookworm``) in apt sources.

    Reads one-line (``deb URI suite comp...``) and deb822 (``Suites:`` / ``Components:``)
    stanzas, as printed by :class:`AptComponents` (stanzas separated by blank lines).
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


class AptComponents(FactBase[set]):
    """Components enabled for one suite (``host.get_fact(AptComponents, suite="bookworm")``) in
    /etc/apt/sources.list and sources.list.d (one-line .list and deb822 .sources files)."""

    _suite = ""

    def command(self, suite: str) -> StringCommand:
        # pyinfra calls command() and process() on the same instance: keep the suite for process.
        self._suite = suite
        return StringCommand("sh", "-c", QuoteString(
            "for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list "
            '/etc/apt/sources.list.d/*.sources; do [ -f "$f" ] && cat "$f" && echo; done; true'))

    @staticmethod
    def default() -> set:
        return set()

    def process(self, output: list[str]) -> set[str]:
        return parse_apt_components(output, self._suite)


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


class NvSwitches(FactBase[int]):
    """How many NVIDIA NVSwitch devices the PCI bus has (HGX/DGX A100, H100, H200 boards: CUDA
    needs nvidia-fabricmanager there). Read from sysfs, so it works before any driver is installed."""

    def command(self) -> StringCommand:
        return StringCommand("sh", "-c", QuoteString('for d in /sys/bus/pci/devices/*; do [ -r "$d/class" ] && '
                                                     'echo "$(cat "$d/vendor") $(cat "$d/class")"; done 2>/dev/null; true'))

    @staticmethod
    def default() -> int:
        return 0

    def process(self, output: list[str]) -> int:
        return parse_pci_classes(output)


def parse_secure_boot(lines: list[str]) -> bool:
    """``od -An -tu1`` of the SecureBoot EFI variable: 4 attribute bytes then the value; 1 = on."""
    values = " ".join(lines).split()
    return bool(values) and values[-1] == "1"


class SecureBoot(FactBase[bool]):
    """Whether UEFI Secure Boot is on (False without EFI or without the variable)."""

    def command(self) -> StringCommand:
        from .defaults import SECURE_BOOT_EFIVAR

        return StringCommand("od", "-An", "-tu1", QuoteString(SECURE_BOOT_EFIVAR), "2>/dev/null", "||", "true")

    @staticmethod
    def default() -> bool:
        return False

    def process(self, output: list[str]) -> bool:
        return parse_secure_boot(output)
