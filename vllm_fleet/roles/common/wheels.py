"""How a host reaches the wheels the control machine holds for it: a directory given in the spec
or host data (``install.wheelhouse``, ``vllm_find_links``), or the fleet wheelhouse
(:mod:`vllm_fleet.fetch.wheelhouse`) fetched over HTTP from host data ``vllm_wheel_serve_address``
and checked against its sha256 before use, else uploaded with ``files.sync``; and what the fleet wheelhouse must fit on
the host (its python3, C library and machine: :func:`target_query`, :func:`host_target`, from the one state
read). One place for the vllm and router roles.
"""

from __future__ import annotations

import hashlib
import json
from io import StringIO
from pathlib import Path
from typing import Any, Callable

from pyinfra import host
from pyinfra.api import FileUploadCommand, operation
from pyinfra.api.exceptions import DeployError
from pyinfra.operations import files

from vllm_fleet.fetch import treehash
from vllm_fleet.fetch import wheelhouse as wh
from vllm_fleet.host.programs import argv as cmd
from vllm_fleet.host.programs import python
from vllm_fleet.specs import localpath

from . import peers, progress
from .state import Query, role_state, unknown

SYSTEM_PYTHON = "python3"  # the host's python whose X.Y the fleet wheelhouse is downloaded for


def local_dir(path: str, what: str) -> str:
    """``path`` (``~`` expanded) when it is a directory on the control machine, else a DeployError naming ``what``."""
    p, why, fix = localpath.readable(path, "dir")
    if p is None:
        raise DeployError(f"{what}: {path[:200]!r} cannot be read on this machine: {why}" + (f"; {fix}" if fix else ""))
    return str(p)


def upload(name: str, src: str | Path, dest: str) -> str:
    """``files.sync`` of the control machine's ``src`` to ``dest`` on the host (extra files there
    removed), with its size for the progress lines; returns ``dest``."""
    progress.expect(files.sync(name=name, src=str(src), dest=dest, delete=True), progress.tree_size(src))
    return dest


def _peer_data(key: str) -> Any:
    value = host.data.get(key)
    return peers.DEFAULTS[key] if value is None else value


def reach_fleet_wheelhouse(directory: Path, dest: str, upload_name: str) -> tuple[str, list]:
    """Put the fleet wheelhouse ``directory`` (``wh.ensure``'s result) at ``dest`` on this host:
    ``(dest, commands to run first)``. With host data ``vllm_wheel_serve_address`` the control
    machine serves it over HTTP (``wh.serve``: that directory only, under a per-deploy token) and
    the commands fetch each wheel into ``dest``, keeping it only when its sha256 is the one the
    control machine sent over SSH (``scripts/fetch_files.py``, its list a root-only file removed
    after); else it is uploaded over SSH to ``dest`` (operation ``upload_name``) and there is
    nothing to run first. Either way the install reads ``dest`` with ``--no-index``.

    With host data ``wheels_peer_fetch`` (off by default) and ``private_address`` on two or more
    hosts of the inventory: host to host (:mod:`.peers`), the control machine's HTTP server (or
    SSH) the seed's source, and nothing to run first (the rounds put it in place before)."""
    address = host.data.get("vllm_wheel_serve_address")
    if str(_peer_data("wheels_peer_fetch")).lower() in ("true", "1", "yes"):
        urls = []
        if address:
            try:
                port, token = wh.serve(directory, address)
            except wh.WheelhouseError as exc:
                raise DeployError(str(exc)) from None
            urls = [f"http://{address}:{port}/{token}/"]
        files_ = treehash.wheel_manifest(directory)
        key = hashlib.sha256(json.dumps(files_, sort_keys=True).encode()).hexdigest()
        ops = peers.join(
            f"wheels:{dest}:{key}",
            f"the wheelhouse {dest}",
            Path(directory),
            dest,
            files_,
            sorted(files_),
            owner="root",
            mode="644",
            dir_mode="755",
            port=int(_peer_data("peer_port")),
            seconds=int(_peer_data("peer_max_seconds")),
            deployment=None,
            control_urls=urls,
            prune=True,
        )
        if ops is not None:
            return dest, []
    if not address:
        return upload(upload_name, directory, dest), []
    try:
        port, token = wh.serve(directory, address)
    except wh.WheelhouseError as exc:
        raise DeployError(str(exc)) from None
    listing = f"{dest}.fetch.json"
    files_ = treehash.wheel_manifest(directory)
    fetch_list(
        name=f"What to fetch into {dest} ({len(files_)} wheels, their sha256)",
        path=listing,
        content=json.dumps({"sources": [f"http://{address}:{port}/{token}/"], "files": files_}, sort_keys=True),
    )
    return dest, [python(SYSTEM_PYTHON, "fetch_files.py", listing, dest), cmd("rm", "-f", listing)]


@operation()
def fetch_list(path: str, content: str):
    """
    Put what a host fetches (``scripts/fetch_files.py``'s list: the wheel server's address with
    this deploy's token, each file's size and sha256) as a root-only file, over SSH. Put every time
    it is asked for: only an install asks, and the token is new with every deploy.

    + path: remote path (removed by the commands that read it)
    + content: the list, JSON

    **Example:**

    .. code:: python

        fetch_list(name="What to fetch", path="/opt/vllm-fleet/x/wheelhouse.fetch.json", content=text)
    """
    tmp = f"{path}.tmp-vllm-fleet"
    yield cmd("install", "-m", "600", "/dev/null", tmp)  # the mode before the content lands
    yield FileUploadCommand(StringIO(content), tmp)
    yield cmd("chmod", "600", tmp)
    yield cmd("mv", "-f", tmp, path)


def wheel_source(
    spec: dict[str, Any], dest: str, upload_name: str, fleet_directory: Callable[[], Path]
) -> tuple[str | None, list]:
    """Where a role's pip takes its wheels from, ``(wheelhouse, commands to run first)``:
    ``install.wheelhouse`` (a directory on the control machine) uploaded to ``dest``; else with
    ``install.wheels: fleet`` the fleet wheelhouse ``fleet_directory()`` (``wh.ensure``'s result
    for this host) put at ``dest`` as :func:`reach_fleet_wheelhouse` says (``upload_name``: its
    upload); else ``(None, [])``: the host's own index. One order for the vllm and router roles."""
    ins = spec["install"]
    if ins.get("wheelhouse"):
        return upload(f"Upload the wheelhouse to {dest}", local_dir(ins["wheelhouse"], "install.wheelhouse"), dest), []
    if ins["wheels"] == "fleet":
        return reach_fleet_wheelhouse(fleet_directory(), dest, upload_name)
    return None, []


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


__all__ = [
    "local_dir",
    "upload",
    "reach_fleet_wheelhouse",
    "wheel_source",
    "source_args",
    "fleet_wheels",
    "target_query",
    "host_target",
    "SYSTEM_PYTHON",
]
