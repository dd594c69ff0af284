"""Parsers of the one env probe's lines (vllm_fleet/host/scripts/env_probe.py, run by the
HostState snapshot: vllm_fleet.roles.common.state): installed distribution versions and
site-packages files in the deployment's Python env. The vllm role reads them from that snapshot
(no fact of its own); the ray role parses its probe's lines with :func:`parse_probe`."""

from __future__ import annotations


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
