"""The model role: the weights at ``model.path`` on every server host, in one of three ways.

Deploy function
    ``install_model(spec, where, hub_token=None)``: ``spec`` is the resolved spec dict
    (``vllm_fleet.specs.load.load_and_check``); ``where`` where the deployment's files live (the
    layout's vllm_fleet.render.parts.Paths: the env's ``python`` for ``hub_fetch: host``);
    ``hub_token`` the token's value (read on the control machine from ``model.hub_token``), or
    None. Reads ``model.{transfer, hub_fetch, local_dir,
    source, revision, path}``, ``server.user``, ``install.{prefix, config_dir}``; host data in
    ``defaults.DEFAULTS``. Returns the operations whose change must restart vLLM.

``model.transfer``
    - ``upload``: ``model.local_dir`` on the control machine -> ``model.path``. Every file's
      sha256 is computed locally into ``MANIFEST.sha256`` (sha256sum format; each file read once:
      :mod:`vllm_fleet.fetch.treehash` keeps the hashes across deploys, off the gevent loop).
      A host whose stamp (``{install.config_dir}/model.stamp``, root's) records this manifest
      and the files under model.path with the size, mtime and ctime they have now is converged
      from its state read alone: no file is hashed there (host data ``model_verify``, ``deploy
      --verify``, hashes them all anyway). Otherwise every file's sha256 is read, and each file is put
      with ``files.put`` (which uploads only files whose checksum differs), owned by
      ``server.user``, mode 644 (dirs 755); files on the host that are not in the manifest are
      removed (a stale shard would be loaded by vLLM); the manifest goes last. Before any of
      that (plan time): the files still to upload must fit on ``model.path``'s filesystem with
      ``model_keep_free_bytes`` to spare, and the largest in pyinfra's temp directory (both
      free figures from the state read; ``NoSpace`` names the host, the sizes and the fix). Only when
      something changed: ``sha256sum --strict -c MANIFEST.sha256`` runs on the host as the
      service user (so it also proves the files are readable by it); on a mismatch the manifest
      and the stamp are removed and the host fails, else the tree as the host listed it just
      before the check becomes the new stamp. (Whether anything changes is known while the plan
      is built, from the same facts ``files.put`` uses: a converged host gets no operation; one
      whose files all match by sha256 but whose stamp is missing or stale gets only a new stamp.)
    - ``hub`` with ``model.hub_fetch: fleet`` (the schema's default): the control machine
      downloads ``source`` at ``revision`` once per fleet into its hub cache
      (:mod:`vllm_fleet.fetch.hubcache`: keyed by repo@commit, ``model_hub_ignore`` left out, every
      file checked against the hub's size and hash; the token stays there), then the files go
      to the host exactly as for ``upload`` (manifest, ``files.put``, ``sha256sum -c``), after
      which ``model.path/.vllm-fleet-hub`` is written. Skipped, with no hub access, when that
      marker already says ``<source>@<revision>``. A fill that fails raises ``DeployError``
      while the plan is built (no host is changed).
    - ``hub`` with ``model.hub_fetch: host``:
      ``huggingface_hub.snapshot_download(source, revision=..., local_dir=model.path)``
      with the env's python (vLLM brings huggingface_hub), leaving out ``model_hub_ignore``
      (``original/*``, ``*.pth``: Llama repositories' consolidated checkpoints, which vLLM never
      loads, about as large again as the safetensors). Before it downloads anything it compares
      the repository's file sizes (what is already there counts) with the free space at
      ``model.path`` less ``model_keep_free_bytes``, and stops naming both when they do not fit. The token, when given,
      is written to ``{config_dir}/hub-token`` (root:root 0600, never shown) and only its path is on the
      command line. Skipped when ``model.path/.vllm-fleet-hub`` already says
      ``<source>@<revision>``. Then the tree is chowned to the service user.
    - ``none``: the weights must already be at ``model.path``: a plan-time check that
      ``model.path/config.json`` exists; ``ModelMissing`` (names the host) otherwise.

What is on the host (the files under model.path, the free bytes there and in the temp directory)
comes from one state read (``state_query``; ``role_state``: the deploy's snapshot, or one read
when the role runs on its own), never a fact per file. When that read did not complete the role
is conservative: no file is counted as there (each is put, pyinfra's ``files.put`` deciding from
its own facts), no file is removed as stale, the hub download runs (it resumes and verifies), and
``none`` stops with ``StateUnknown`` (not ``ModelMissing``: nothing says the model is absent).
The free bytes are then not known either, so the space check cannot stop the upload (as when df
gives no figure).

Example (deploys/serve.py)::

    from vllm_fleet.roles.model import install_model

    model_changed = install_model(spec=spec, where=ctx.layout.paths[spec["name"]], hub_token=ctx.secrets["hub_token"])
"""

from __future__ import annotations

import hashlib
import json
from io import StringIO
from pathlib import Path
from typing import Any

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.api.exceptions import DeployError
from pyinfra.operations import files, server

from vllm_fleet.host.programs import argv as cmd
from vllm_fleet.host.programs import chain, group, python, to_file, to_stderr
from vllm_fleet.render.parts import Paths
from vllm_fleet.roles.common import atomic_put, directory, peers, progress, role_data, secret_file
from vllm_fleet.host.state import Query, Snapshot, state_command
from vllm_fleet.roles.common.state import Converged, StateUnknown, role_state, unknown
from vllm_fleet.specs.sections import reads

from . import defaults as d
from .defaults import DEFAULTS

#: The spec sections this role reads (vllm_fleet.specs.sections); its README lists them.
SECTIONS = ("name", "install", "model", "server")

__all__ = ["install_model", "local_manifest", "manifest_text", "ModelMissing", "NoSpace", "StateUnknown", "DEFAULTS"]


class ModelMissing(DeployError):
    """``transfer: none`` and the host has no model at ``model.path`` (the message names the host)."""


class NoSpace(DeployError):
    """``transfer: upload`` and the host has not enough free space for the files it still lacks
    (at ``model.path``, or in the temp directory pyinfra uploads through); names host, bytes, fix."""


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _temp_dir() -> str:
    """The directory pyinfra uploads each file through on this host (its ``_temp_dir`` data, else /tmp)."""
    return host.data.get("_temp_dir") or "/tmp"


def _check_space(spec: dict, local: Path, entries: list[tuple[str, str]], snap: Snapshot) -> None:
    """Plan-time: the files that will be (re)written must fit, with ``model_keep_free_bytes`` to
    spare, before any operation exists (a full disk half-way through leaves a broken model). The
    files there and the free bytes (at model.path and in the temp dir) come from the state read
    (``_tree_query``); a read that did not complete counts no file as there, and with no free
    figure (that read, or a df that printed none) that filesystem is not checked."""
    root = spec["model"]["path"].rstrip("/")
    have = snap.files_under(root) or {}
    todo = [(rel, (local / rel).stat().st_size) for rel, _ in entries]
    todo = [(rel, size) for rel, size in todo if have.get(rel) != size]
    if not todo:
        return
    need = sum(size for _, size in todo) - sum(have.get(rel, 0) for rel, _ in todo)
    keep = int(host.data.get("model_keep_free_bytes") or 0)
    _, free = snap.free(root)
    if free is not None and free - max(need, 0) < keep:
        raise NoSpace(
            f"host {host.name}: not enough disk space for model.path {root}: {len(todo)} file(s) to upload, "
            f"{_gib(max(need, 0))} more than is there now, {_gib(free)} free, and model_keep_free_bytes asks "
            f"{_gib(keep)} to stay free. Fix: free space on that filesystem, point model.path at a larger one, "
            "or lower model_keep_free_bytes; no host was changed"
        )
    temp_dir = _temp_dir()
    largest = max(size for _, size in todo)
    _, tmp_free = snap.free(temp_dir)
    if tmp_free is not None and tmp_free < largest:
        raise NoSpace(
            f"host {host.name}: pyinfra uploads each file through {temp_dir} first, and the largest model file "
            f"({_gib(largest)}) does not fit there ({_gib(tmp_free)} free). Fix: free space in {temp_dir} or set "
            "the host's _temp_dir data to a directory on a larger filesystem; no host was changed"
        )


def local_manifest(local_dir: str | Path) -> list[tuple[str, str]]:
    """``[(relative posix path, sha256)]`` of every file under local_dir, sorted (the manifest
    itself and the hub marker excluded). Each file is read once for its content: the control
    machine's hash cache (vllm_fleet.fetch.treehash, kept across deploy processes, keyed by
    path, size, mtime, ctime and inode) answers for the others, and the hashing runs off the
    gevent loop, one tree at a time."""
    from pyinfra import logger

    from vllm_fleet.fetch.treehash import hash_tree

    root = Path(local_dir).expanduser()
    if not root.is_dir():
        raise DeployError(
            f"model.source: {root} is not a directory on this machine (for the lab: `vllm-fleet tiny-model`)"
        )
    shas = hash_tree(root, log=logger.info)
    return sorted((rel, sha) for rel, sha in shas.items() if rel not in (d.MANIFEST, d.HUB_MARKER))


def stamp_path(spec: dict) -> str:
    """Where the stamp of the host's verified copy is (``{install.config_dir}/model.stamp``):
    root's directory, beside the deployment's other records, so the service user, who owns
    every file of model.path, cannot write it."""
    return f"{spec['install']['config_dir'].rstrip('/')}/{d.STAMP}"


def _verify_asked() -> bool:
    return bool(role_data("model_verify", DEFAULTS))


def _tree_query(root: str, entries: list[tuple[str, str]], stamp: str | None = None, full: bool = True) -> Query:
    """The tree ``entries`` would make at ``root``: every file, directory and the manifest
    (stat), the files there with their size, mtime and ctime (tree), the stamp (read), the free
    bytes at ``root`` and in the temp directory uploads go through (free: the space check), and
    with ``full`` the sha256 of every file (the host reads them all)."""
    files_ = [f"{root}/{rel}" for rel, _ in entries] + [f"{root}/{d.MANIFEST}"]
    dirs = [root] + [f"{root}/{sub}" for sub in sorted({str(Path(rel).parent) for rel, _ in entries} - {"."})]
    return Query(
        stat=tuple(dirs + files_),
        sha=tuple(files_) if full else (),
        tree=(root,),
        read=(stamp,) if stamp else (),
        free=(root, _temp_dir()),
    )


@reads(*SECTIONS)
def state_query(spec: dict) -> Query:
    """What install_model compares against (vllm_fleet.roles.common.state): for ``upload`` every
    file, directory and the manifest at model.path (stat; the files there with size, mtime and
    ctime), the stamp of the last verified copy, the free bytes there and in the temp
    directory, and, only with host data ``model_verify`` (``deploy --verify``), the sha256 of
    every file; for ``hub`` the marker; for ``none`` config.json."""
    m = spec["model"]
    root = m["path"].rstrip("/")
    if m["transfer"] == "upload":
        local = Path(m["local_dir"]).expanduser()
        if not local.is_dir():
            return Query()
        return _tree_query(root, local_manifest(local), stamp_path(spec), full=_verify_asked())
    if m["transfer"] == "hub":
        return Query(read=(f"{root}/{d.HUB_MARKER}",))
    return Query(stat=(f"{root}/config.json",))


def manifest_text(entries: list[tuple[str, str]]) -> str:
    return "".join(f"{sha}  {rel}\n" for rel, sha in entries)


def stamp_text(root: str, manifest_sha: str, tree: dict[str, tuple[int, str, str]]) -> str:
    """The stamp: a ``manifest ROOT SHA256`` line, then host_state.sh's own lines for ``tree
    ROOT`` (what the host's command writes at verification: :func:`_stamp_commands`), ``end``."""
    rows = [f"tree\t{root}\t{size} {mtime} {ctime} {rel}" for rel, (size, mtime, ctime) in sorted(tree.items())]
    return "\n".join([f"manifest\t{root}\t{manifest_sha}", f"tree\t{root}\t.", *rows, "end"]) + "\n"


def read_stamp(text: str | None, root: str) -> tuple[str, dict[str, tuple[int, str, str]]] | None:
    """``(manifest sha256, {rel: (size, mtime, ctime)})`` a stamp's text records for ``root``, or
    None (no stamp, another root, or not complete: no ``end``)."""
    if not text:
        return None
    lines = text.splitlines()
    snap = Snapshot.parse(lines)
    snap.query = Query(tree=(root,))
    tree = snap.tree(root)
    shas = [ln.split("\t")[2] for ln in lines if ln.count("\t") == 2 and ln.split("\t")[:2] == ["manifest", root]]
    return (shas[0], tree) if snap.known and tree is not None and len(shas) == 1 else None


def _stamp_says_converged(
    snap: Snapshot, root: str, stamp: str, manifest_sha: str, entries: list[tuple[str, str]], user: str, fmode: Any
) -> bool:
    """Whether the host's copy is the verified one the stamp records, from the state read
    alone (no file hashed): the stamp names this manifest, the files under model.path are
    exactly the manifest's and the manifest itself, each with the size, mtime and ctime it
    had when it was verified, and each is a regular file of the service user with the mode."""
    _, text = snap.content(stamp)
    recorded, now = read_stamp(text, root), snap.tree(root)
    if recorded is None or now is None or recorded != (manifest_sha, now):
        return False
    want = {rel for rel, _ in entries} | {d.MANIFEST}
    return set(now) == want and all(snap.regular_file(f"{root}/{rel}", user, user, fmode) for rel in want)


def _stamp_commands(root: str, stamp: str, manifest_sha: str) -> tuple[Any, Any, Any]:
    """The host's own stamp, around the check: (make the config directory if missing, list the
    tree to ``STAMP.tmp-vllm-fleet`` before the check, rename it over the stamp after it). The
    listing is host_state.sh's ``tree`` (the state read's own lines), so any write after it
    shows as another mtime or ctime on the next deploy."""
    tmp = f"{stamp}.tmp-vllm-fleet"
    parent = str(Path(stamp).parent)
    made = cmd("mkdir", "-p", parent)  # there after the deploy's pyenv role; an own deploy may lack it
    listing = to_file(
        group(cmd("printf", "manifest\\t%s\\t%s\\n", root, manifest_sha), state_command(Query(tree=(root,)))), tmp
    )
    keep = chain(cmd("chmod", "644", tmp), cmd("mv", "-f", tmp, stamp))
    return chain(made, listing), tmp, keep


def _upload(spec: dict, snap: Snapshot) -> list:
    local = Path(spec["model"]["local_dir"]).expanduser()
    return _put_tree(spec, local, local_manifest(local), snap)


def _put_tree(
    spec: dict, local: Path, entries: list[tuple[str, str]], snap: Snapshot, marker: str | None = None
) -> list:
    """Put the files ``entries`` (``[(relative path, sha256)]``) of the control machine's
    directory ``local`` at model.path as ``upload`` does, compared against ``snap`` (a read of
    ``_tree_query``). ``marker`` (the fleet hub cache's ``<source>@<revision>``): the hub marker
    is written after the verification, which then always runs (a stale marker is removed first,
    with the other files not in the manifest). A read that did not complete removes nothing.

    Without ``marker``: when the stamp (:func:`stamp_path`) says the host holds the verified
    copy (:func:`_stamp_says_converged`) and ``model_verify`` is off, every file is converged
    with no hash read; otherwise the sha256 of every file is read (one more round trip, unless
    the deploy's read asked it: ``--verify``) and compared as before. A check that passes
    leaves a new stamp: written by the host around the check when something was put, or, when
    the full read found everything in place but the stamp missing or stale, put from that
    read's listing (taken before its hashes)."""
    m, user = spec["model"], spec["server"]["user"]
    root = m["path"].rstrip("/")
    fmode, dmode = host.data.get("model_file_mode"), host.data.get("model_dir_mode")
    text = manifest_text(entries)
    manifest_sha = hashlib.sha256(text.encode()).hexdigest()
    stamp = stamp_path(spec)
    stamp_ok = not marker and _stamp_says_converged(snap, root, stamp, manifest_sha, entries, user, fmode)
    trusted = stamp_ok and not _verify_asked()
    if not trusted:  # the full check: every file's sha256 (already read with --verify)
        snap = role_state(_tree_query(root, entries, None if marker else stamp))
    _check_space(spec, local, entries, snap)

    ops = [directory(name=f"Model directory {root}", path=root, user=user, group=user, mode=dmode)]
    subdirs = sorted({str(Path(rel).parent) for rel, _ in entries} - {"."})
    for sub in subdirs:
        ops.append(
            directory(name=f"Model directory {root}/{sub}", path=f"{root}/{sub}", user=user, group=user, mode=dmode)
        )
    wanted = {f"{root}/{rel}" for rel, _ in entries} | {f"{root}/{d.MANIFEST}"}
    there = {f"{root}/{rel}" for rel in snap.files_under(root) or {}}  # unknown: none (nothing removed on a guess)
    for stale in sorted(there - wanted):
        ops.append(files.file(name=f"Remove {stale} (not in the manifest)", path=stale, present=False))
    lacks = [rel for rel, sha in entries if not (trusted or snap.file_ok(f"{root}/{rel}", sha, user, user, fmode))]
    # host to host where the fleet's private network allows (vllm_fleet.roles.common.peers): the
    # control machine sends each file once; None: this host takes no part, the files go as before
    by_peers = peers.join(
        f"model:{root}:{manifest_sha}",
        f"the model of {spec['name']}",
        local,
        root,
        {rel: [(local / rel).stat().st_size, sha] for rel, sha in entries},
        lacks,
        owner=user,
        mode=str(fmode or "644"),
        dir_mode=str(dmode or "755"),
        port=int(role_data("peer_port", DEFAULTS)),
        seconds=int(role_data("peer_max_seconds", DEFAULTS)),
        deployment=spec["name"],
    )
    for rel, sha in entries:
        if rel not in lacks:
            ops.append(Converged(rel))
        elif by_peers is None:
            ops.append(
                progress.expect(
                    files.put(
                        name=f"Model file {rel}",
                        src=str(local / rel),
                        dest=f"{root}/{rel}",
                        user=user,
                        group=user,
                        mode=fmode,
                        add_deploy_dir=False,
                    ),
                    (local / rel).stat().st_size,
                )
            )
    ops.extend(by_peers or [])
    if trusted or snap.file_ok(f"{root}/{d.MANIFEST}", manifest_sha, user, user, fmode):
        ops.append(Converged(d.MANIFEST))
    else:
        ops.append(
            files.put(
                name=f"Model manifest {d.MANIFEST}",
                src=StringIO(text),
                dest=f"{root}/{d.MANIFEST}",
                user=user,
                group=user,
                mode=fmode,
            )
        )
    # the fleet hub path decides from its marker and always checks: it keeps no stamp
    before, tmp, keep = _stamp_commands(root, stamp, manifest_sha) if not marker else (None, None, None)
    if by_peers:
        # the files came through the peer rounds (roles.common.peers): scripts/fetch_files.py
        # checked every one against the manifest's sha256 as it wrote it (and re-read those
        # already there), so reading them all again would hash the model twice on every host
        # (sha256sum is slower than that hashing, and the 2 lab cores ran 32 hosts' checks). Left
        # to prove: the service user can read them all (find fails on any it cannot).
        reads = cmd(
            "runuser", "-u", user, "--", "find", ".", "-type", "f", "!", "-readable", "-exec", "false", "{}", "+"
        )
        verify = f"Verify the model (every file checked against {d.MANIFEST} by the peer fetch; readable as {user})"
    else:
        reads = cmd("runuser", "-u", user, "--", "sha256sum", "--quiet", "--strict", "-c", d.MANIFEST)
        verify = f"Verify the model against {d.MANIFEST} (as {user})"
    check = chain(
        chain(cmd("cd", root), reads),
        group(
            cmd("rm", "-f", d.MANIFEST, *([tmp, stamp] if tmp else [])),
            to_stderr(cmd("echo", "model upload: checksum mismatch on the host")),
            cmd("exit", "1"),
        ),
        op="||",
    )
    commands = [before, check, keep] if before else [check]
    if marker:
        mark = f"{root}/{d.HUB_MARKER}"
        commands += [to_file(cmd("printf", "%s\\n", marker), mark), cmd("chown", f"{user}:{user}", mark)]
    # Decided while the plan is built (will_change runs each operation's checks now), not with
    # _if: a converged host then has no operation at all, and a `--dry --json` plan shows none
    # (an _if-guarded operation is always listed as a conditional change there).
    if marker or any(op.will_change for op in ops):
        server.shell(
            name=verify + (f" and mark it {marker}" if marker else ""),
            commands=commands,
        )
    elif not marker and not stamp_ok and snap.known and snap.tree(root) is not None:
        # every file checked by its sha256 and in place, the stamp missing or stale (a copy
        # verified before stamps, a file touched but not changed, --verify): record what was read
        directory(name=f"Directory of {stamp}", path=str(Path(stamp).parent))
        atomic_put(
            name=f"Stamp the verified model ({d.STAMP})",
            dest=stamp,
            content=stamp_text(root, manifest_sha, snap.tree(root) or {}),
            mode="644",
        )
    return ops


def _hub_fleet(spec: dict, hub_token: str | None, revision: str, want: str) -> list:
    """``hub_fetch: fleet``: the control machine's hub cache (filled once, vllm_fleet.fetch.hubcache),
    then the files put on this host as ``upload`` does, and the marker written after the check."""
    from pyinfra import logger

    from vllm_fleet.fetch import hubcache

    m = spec["model"]
    try:
        directory = hubcache.ensure(
            m["source"],
            revision,
            token=hub_token,
            ignore=list(host.data.get("model_hub_ignore") or []),
            endpoint_url=(host.data.get("model_hub_env") or {}).get("HF_ENDPOINT"),
            log=logger.info,
        )
    except hubcache.HubError as exc:
        raise DeployError(str(exc)) from None
    entries = hubcache.manifest(directory)
    # the files there: the deploy's read asked only the marker; the cache's tree, read once now
    snap = role_state(_tree_query(m["path"].rstrip("/"), entries, full=True))
    return _put_tree(spec, directory, entries, snap, marker=want)


def _hub(spec: dict, where: Paths, hub_token: str | None, snap: Snapshot) -> list:
    m, ins, user = spec["model"], spec["install"], spec["server"]["user"]
    root = m["path"].rstrip("/")
    revision = m.get("revision") or "main"
    want = f"{m['source']}@{revision}"
    token_path = ""
    ops = []
    if hub_token and m["hub_fetch"] == "host":  # fleet: the token stays on the control machine
        token_path = f"{ins['config_dir'].rstrip('/')}/{d.HUB_TOKEN_FILE}"
        ops.append(secret_file(name="Hub token (0600 root)", path=token_path, content=hub_token + "\n"))
    _, text = snap.content(f"{root}/{d.HUB_MARKER}")  # unknown: download (the script resumes and verifies)
    have = text.splitlines() if text else None
    if have and have[0].strip() == want:
        host.noop(f"model {want} already at {root}")
        return []
    if m["hub_fetch"] == "fleet":
        return _hub_fleet(spec, hub_token, revision, want)
    env = {
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        **(host.data.get("model_hub_env") or {}),
    }
    download = cmd(
        "env",
        *(f"{k}={v}" for k, v in sorted(env.items())),
        python(
            where["python"],
            "hub_download.py",
            m["source"],
            revision,
            root,
            d.HUB_MARKER,
            json.dumps(list(host.data.get("model_hub_ignore") or [])),
            str(int(host.data.get("model_keep_free_bytes") or 0)),
            token_path,
        ),
    )
    op = server.shell(
        name=f"Download {want} from the hub into {root}",
        commands=[
            cmd("mkdir", "-p", root),
            download,
            cmd("chown", "-R", f"{user}:{user}", root),
            cmd("chmod", "-R", "u+rwX,go+rX", root),
        ],
    )
    return [op]


def _none(spec: dict, snap: Snapshot) -> list:
    root = spec["model"]["path"].rstrip("/")
    known, present = snap.path(f"{root}/config.json")
    if not known:
        raise unknown(f"whether {root}/config.json exists (model.transfer is none)")
    if not present:
        raise ModelMissing(
            f"host {host.name}: model.transfer is none but {root}/config.json does not exist. "
            f"Put the weights at {root} on this host, or set model.transfer: upload (with "
            "model.source a local directory) or hub (with model.source a hub id and model.revision)."
        )
    host.noop(f"model present at {root} (transfer: none)")
    return []


@deploy("Model weights", data_defaults=DEFAULTS)
@reads(*SECTIONS)
def install_model(spec: dict[str, Any], where: Paths, hub_token: str | None = None) -> list:
    """
    Put the model's weights at ``model.path`` (upload with checksums, hub download, or check).

    + spec: the resolved deployment spec
    + where: where the deployment's files live (the layout's: ``ctx.layout.paths[name]``,
      vllm_fleet.render.parts.Paths): ``hub_fetch: host`` downloads with the env's ``python``
    + hub_token: the hub token's value for gated models (written 0600, never on a command line)

    Returns the operations whose change must restart vLLM.

    **Example:**

    .. code:: python

        model_changed = install_model(spec=spec, where=where, hub_token=None)
    """
    transfer = spec["model"]["transfer"]
    if transfer not in ("upload", "hub", "none"):
        raise DeployError(f"model.transfer: {transfer!r} is not resolved (expected upload, hub or none)")
    query = state_query(spec)
    # the deploy's snapshot (it asked this), or one read of it when the role runs on its own;
    # an upload without its local directory has nothing to read (_upload says what is missing)
    snap = role_state(query) if query else Snapshot()
    if transfer == "upload":
        return _upload(spec, snap)
    if transfer == "hub":
        return _hub(spec, where, hub_token, snap)
    return _none(spec, snap)
