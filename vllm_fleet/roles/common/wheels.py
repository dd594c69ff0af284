"""How a host reaches the wheels the control machine holds for it: a directory given in the spec
or host data (``install.wheelhouse``, ``vllm_find_links``), or the fleet wheelhouse
(:mod:`vllm_fleet.fetch.wheelhouse`) served over HTTP at host data ``vllm_wheel_serve_address``,
else uploaded with ``files.sync``; and what the fleet wheelhouse must fit on the host (its
python3, C library and machine: :func:`target_query`, :func:`host_target`, from the one state
read). One place for the vllm and router roles.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from pyinfra import host
from pyinfra.api.exceptions import DeployError
from pyinfra.operations import files

from vllm_fleet.fetch import wheelhouse as wh

from . import progress
from .state import Query, role_state, unknown

SYSTEM_PYTHON = "python3"  # the host's python whose X.Y the fleet wheelhouse is downloaded for


def local_dir(path: str, what: str) -> str:
    """``path`` (``~`` expanded) when it is a directory on the control machine, else a DeployError naming ``what``."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise DeployError(f"{what}: {p} is not a directory on this machine")
    return str(p)


def upload(name: str, src: str | Path, dest: str) -> str:
    """``files.sync`` of the control machine's ``src`` to ``dest`` on the host (extra files there
    removed), with its size for the progress lines; returns ``dest``."""
    progress.expect(files.sync(name=name, src=str(src), dest=dest, delete=True), progress.tree_size(src))
    return dest


def reach_fleet_wheelhouse(directory: Path, dest: str, upload_name: str) -> tuple[str, str | None]:
    """How this host reads the fleet wheelhouse ``directory`` (``wh.ensure``'s result): served
    over HTTP at host data ``vllm_wheel_serve_address``, ``(its URL, the address)`` (pip's
    trusted host); else uploaded to ``dest`` (operation ``upload_name``), ``(dest, None)``."""
    address = host.data.get("vllm_wheel_serve_address")
    if address:
        try:
            port = wh.serve(directory.parent, address)
        except wh.WheelhouseError as exc:
            raise DeployError(str(exc)) from None
        return f"http://{address}:{port}/{directory.name}/", address
    return upload(upload_name, directory, dest), None


def wheel_source(spec: dict[str, Any], dest: str, upload_name: str,
                 fleet_directory: Callable[[], Path]) -> tuple[str | None, str | None]:
    """Where a role's pip takes its wheels from, ``(wheelhouse, trusted host)``: ``install.wheelhouse``
    (a directory on the control machine) uploaded to ``dest``; else with ``install.wheels: fleet``
    the fleet wheelhouse ``fleet_directory()`` (``wh.ensure``'s result for this host) reached as
    :func:`reach_fleet_wheelhouse` says (``upload_name``: its upload to ``dest``); else
    ``(None, None)``: the host's own index. One order for the vllm and router roles."""
    ins = spec["install"]
    if ins.get("wheelhouse"):
        return upload(f"Upload the wheelhouse to {dest}", local_dir(ins["wheelhouse"], "install.wheelhouse"), dest), None
    if ins["wheels"] == "fleet":
        return reach_fleet_wheelhouse(fleet_directory(), dest, upload_name)
    return None, None


def fleet_wheels(spec: dict[str, Any]) -> bool:
    """True when the role's wheels come from the fleet wheelhouse (``install.wheels: fleet`` and
    no ``install.wheelhouse``, which wins: :func:`wheel_source`'s order)."""
    return spec["install"]["wheels"] == "fleet" and not spec["install"].get("wheelhouse")


def target_query(spec: dict[str, Any]) -> Query:
    """What :func:`host_target` reads, for the roles' ``state_query`` (so the deploy's one read
    asks it; the vllm and router roles ask the same, once): the host's target, when the wheels
    are the fleet's; else nothing."""
    return Query(targets=(SYSTEM_PYTHON,)) if fleet_wheels(spec) else Query()


def host_target() -> dict[str, str]:
    """``{"python": "3.11", "glibc": "2.36", "machine": "x86_64"}``: what the fleet wheelhouse
    must fit on this host, from the state read (``role_state``: the deploy's, or one read when
    the role runs on its own). A value the host did not report is absent (no python3: no
    ``python``). A read that did not complete: StateUnknown (nothing to download for)."""
    target = role_state(Query(targets=(SYSTEM_PYTHON,))).target(SYSTEM_PYTHON)
    if target is None:
        raise unknown("which Python, C library and machine the fleet wheelhouse must fit")
    return target


def source_args(spec: dict[str, Any], *, wheelhouse: str | None, find_links: str | None = None) -> list[str]:
    """pip's (and uv's) source flags: the wheelhouse alone (``--no-index``), else the index
    (``install.index_url``) plus extra find-links."""
    if wheelhouse:
        return ["--no-index", "--find-links", wheelhouse]
    argv = ["--index-url", spec["install"]["index_url"]] if spec["install"].get("index_url") else []
    return argv + (["--find-links", find_links] if find_links else [])


__all__ = ["local_dir", "upload", "reach_fleet_wheelhouse", "wheel_source", "source_args", "fleet_wheels",
           "target_query", "host_target", "SYSTEM_PYTHON"]
