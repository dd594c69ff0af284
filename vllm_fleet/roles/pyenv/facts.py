"""Facts for the pyenv role: an environment's Python version and the installed Miniforge."""

from __future__ import annotations

import re
from pyinfra.api import FactBase, StringCommand

from vllm_fleet.host.programs import argv

MINIFORGE_MARKER = ".vllm-fleet-miniforge-version"


def parse_python_version(lines: list[str]) -> str | None:
    """``3.12`` from a line ``python 3.12.7``; None when the env has no working python."""
    for line in lines:
        m = re.fullmatch(r"python ([0-9]+)\.([0-9]+)\.[0-9]+\S*", line.strip())
        if m:
            return f"{m.group(1)}.{m.group(2)}"
    return None


class EnvPython(FactBase):
    """``major.minor`` of ``{env}/bin/python`` (``host.get_fact(EnvPython, env=...)``), or None
    when the environment does not exist or its python does not run."""

    def command(self, env: str) -> StringCommand:
        python = f"{env.rstrip('/')}/bin/python"
        return StringCommand(argv("test", "-x", python), "&&",
                             argv(python, "-c", 'import platform; print("python", platform.python_version())'),
                             "2>/dev/null", "||", "true")

    @staticmethod
    def default() -> None:
        return None

    def process(self, output: list[str]) -> str | None:
        return parse_python_version(output)


def parse_miniforge(lines: list[str]) -> dict | None:
    """``{"conda": True, "version": "26.3.2-3" | None}`` from MiniforgeInstall output, or None."""
    conda = "conda=yes" in [line.strip() for line in lines]
    if not conda:
        return None
    version = None
    for line in lines:
        if line.startswith("version="):
            version = line.partition("=")[2].strip() or None
    return {"conda": True, "version": version}


class MiniforgeInstall(FactBase):
    """The Miniforge at ``root``: None when ``{root}/bin/conda`` is absent, else
    ``{"conda": True, "version": <the Miniforge version vllm-fleet recorded, or None>}``."""

    def command(self, root: str) -> StringCommand:
        root = root.rstrip("/")
        return argv("sh", "-c", 'if test -x "$1"; then echo conda=yes; echo version=$(cat "$2" 2>/dev/null); fi; true',
                    "miniforge", f"{root}/bin/conda", f"{root}/{MINIFORGE_MARKER}")

    @staticmethod
    def default() -> None:
        return None

    def process(self, output: list[str]) -> dict | None:
        return parse_miniforge(output)
