"""How a host reaches the wheels the control machine holds for it: a directory given in the spec
or host data (``install.wheelhouse``, ``vllm_find_links``), or the fleet wheelhouse
(:mod:`vllm_fleet.fetch.wheelhouse`) served over HTTP at host data ``vllm_wheel_serve_address``,
else uploaded with ``files.sync``. One place for the vllm and router roles.
"""

from __future__ import annotations

from pathlib import Path

from pyinfra import host
from pyinfra.api.exceptions import DeployError
from pyinfra.operations import files

from vllm_fleet.fetch import wheelhouse as wh

from . import progress


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


__all__ = ["local_dir", "upload", "reach_fleet_wheelhouse"]
