"""The fleet hub cache: a model repository's files at one revision, downloaded once per fleet on
the control machine, then sent to every host over the private network.

``model.transfer: hub`` with ``model.hub_fetch: fleet`` (the schema's default) uses it through
the model role (vllm_fleet/roles/model):

1. :func:`ensure` asks the hub for the revision's commit and file list (sizes, and sha256 for
   LFS files, the git blob id for the others), leaves out the ``model_hub_ignore`` patterns, and
   downloads each file into ``$VLLM_FLEET_HUB_CACHE`` (default ``$VLLM_FLEET_CACHE/hub``, that
   is /var/cache/vllm-fleet/hub), keyed by ``<repo>@<commit>`` (and the ignore patterns). It is
   filled the way the fleet wheelhouse is (:func:`vllm_fleet.fetch.wheelhouse.fill_once`: built in
   ``<key>.part`` and renamed when complete, under a lock that pyinfra's greenlets share), so
   concurrent hosts wait for one download; an interrupted fill resumes (a file is continued with
   an HTTP range, and a file is placed under its name only once its bytes are verified). Every
   file is checked against the hub's size and hash; a file that does not match is removed and
   the fill fails. With a commit as ``model.revision`` a complete cache answers without any
   network access.
2. The role then puts those files on each host as ``transfer: upload`` does (sha256 manifest,
   ``files.put`` only where the host's checksum differs, ``sha256sum -c`` as the service user).

Where the hub is: host data ``model_hub_env``'s ``HF_ENDPOINT`` (the deploy's own setting for
the hub download), else ``$HF_ENDPOINT``, else the hub's public address. ``huggingface_hub`` is
used when it can be imported on the control machine; otherwise the hub's HTTP API with
``requests`` (one request for the revision's file list, one per file).

Nothing here imports pyinfra (part of the core).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from urllib.parse import quote

from vllm_fleet.fetch import wheelhouse as wh

COMPLETE_MARKER = wh.COMPLETE_MARKER
#: huggingface_hub's own default, used when neither the host data nor $HF_ENDPOINT names one.
DEFAULT_ENDPOINT = "https://huggingface.co"
COMMIT = re.compile(r"[0-9a-f]{40}")
_CHUNK = 1 << 20
#: what is written to a download's .incomplete file at a time (lost, at most, when the link drops)
_NET_CHUNK = 1 << 16
_INCOMPLETE = ".incomplete"


class HubError(RuntimeError):
    """The fleet hub cache could not be filled (the message names the YAML path and the fix)."""


def cache_root() -> Path:
    """``$VLLM_FLEET_HUB_CACHE``, else ``$VLLM_FLEET_CACHE/hub`` (default /var/cache/vllm-fleet)."""
    if os.environ.get("VLLM_FLEET_HUB_CACHE"):
        return Path(os.environ["VLLM_FLEET_HUB_CACHE"])
    return Path(os.environ.get("VLLM_FLEET_CACHE", "/var/cache/vllm-fleet")) / "hub"


def endpoint(explicit: str | None = None) -> str:
    return (explicit or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def key(repo: str, commit: str, ignore: list[str]) -> str:
    """``<org>--<name>@<commit>``, plus a short hash of the ignore patterns when there are any
    (another set of patterns is another set of files)."""
    k = f"{repo.replace('/', '--')}@{commit}"
    if ignore:
        k += "-" + hashlib.sha256(json.dumps(sorted(ignore)).encode()).hexdigest()[:8]
    return k


def info(directory: Path) -> dict:
    """What :func:`ensure` recorded: repo, revision, commit, ``files`` {path: {size, sha256}},
    bytes, seconds, requests and bytes fetched from the hub by the fill."""
    return json.loads((Path(directory) / COMPLETE_MARKER).read_text())


def manifest(directory: Path) -> list[tuple[str, str]]:
    """``[(relative path, sha256)]`` of a complete cache directory, sorted (from its record:
    every file was hashed while it was verified, so nothing is read again)."""
    files = info(directory)["files"]
    return sorted((rel, f["sha256"]) for rel, f in files.items())


# ------------------------------------------------------------------------------------------------
# The two ways to talk to the hub: huggingface_hub when importable, else its HTTP API.


class _Http:
    """The hub's HTTP API with requests: ``GET /api/models/REPO/revision/REV?blobs=true`` (commit
    and files with sizes, LFS sha256 and blob ids), ``GET /REPO/resolve/COMMIT/FILE`` per file."""

    def __init__(self, ep: str, token: str | None):
        import requests

        self.requests, self.ep = requests, ep
        self.session = requests.Session()
        self.session.headers["User-Agent"] = "vllm-fleet"
        self.auth = {"Authorization": f"Bearer {token}"} if token else {}
        self.fetched = {"requests": 0, "bytes": 0}

    def _get(self, url: str, **kw):
        self.fetched["requests"] += 1
        try:
            return self.session.get(url, headers={**self.auth, **kw.pop("headers", {})}, timeout=(10, 60), **kw)
        except self.requests.RequestException as exc:
            raise _Unreachable(str(exc)) from None

    def info(self, repo: str, revision: str) -> tuple[str, list[dict]]:
        r = self._get(f"{self.ep}/api/models/{repo}/revision/{quote(revision, safe='')}", params={"blobs": "true"})
        if r.status_code != 200:
            raise _Refused(r.status_code, r.headers.get("X-Error-Code", ""), r.headers.get("X-Error-Message", ""))
        body = r.json()
        out = []
        for s in body.get("siblings") or []:
            lfs = s.get("lfs") or {}
            out.append(
                {
                    "name": s["rfilename"],
                    "size": lfs.get("size", s.get("size")),
                    "sha256": lfs.get("sha256"),
                    "blob": None if lfs else s.get("blobId"),
                }
            )
        return body["sha"], out

    def download(self, repo: str, commit: str, f: dict, part: Path) -> Path:
        tmp = part / (f["name"] + _INCOMPLETE)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        have = tmp.stat().st_size if tmp.exists() else 0
        if f["size"] is not None and have > f["size"]:
            tmp.unlink()
            have = 0
        headers = {"Range": f"bytes={have}-"} if have else {}
        if f["size"] is not None and have == f["size"]:
            return tmp
        url = f"{self.ep}/{repo}/resolve/{commit}/{quote(f['name'])}"
        with self._get(url, headers=headers, stream=True) as r:
            if r.status_code not in (200, 206):
                raise _Refused(r.status_code, r.headers.get("X-Error-Code", ""), r.headers.get("X-Error-Message", ""))
            try:
                with open(tmp, "ab" if r.status_code == 206 else "wb") as out:
                    for block in r.iter_content(_NET_CHUNK):
                        out.write(block)
                        self.fetched["bytes"] += len(block)
            except self.requests.RequestException as exc:
                raise _Unreachable(f"{f['name']}: {exc}") from None
        return tmp


class _Library:
    """huggingface_hub: ``HfApi.model_info(files_metadata=True)`` and ``hf_hub_download`` into the
    ``.part`` directory (it resumes from ``.part/.cache/huggingface``, removed before the rename)."""

    def __init__(self, ep: str, token: str | None):
        import huggingface_hub

        self.hf, self.ep, self.token = huggingface_hub, ep, token
        self.fetched = {"requests": 0, "bytes": 0}

    def _call(self, fn, *a, **kw):
        from huggingface_hub import errors

        self.fetched["requests"] += 1
        try:
            return fn(*a, **kw)
        except errors.LocalEntryNotFoundError as exc:  # what hf_hub_download raises when it cannot connect
            raise _Unreachable(str(exc).splitlines()[0]) from None
        except errors.GatedRepoError as exc:
            raise _Refused(403, "GatedRepo", str(exc)) from None
        except errors.RevisionNotFoundError as exc:
            raise _Refused(404, "RevisionNotFound", str(exc)) from None
        except errors.RepositoryNotFoundError as exc:
            raise _Refused(404, "RepoNotFound", str(exc)) from None
        except errors.HfHubHTTPError as exc:
            code = getattr(getattr(exc, "response", None), "status_code", 0) or 0
            raise _Refused(code, "", str(exc)) from None
        except Exception as exc:  # connection refused / DNS / offline mode / timeouts (httpx or requests)
            raise _Unreachable(f"{type(exc).__name__}: {exc}") from None

    def info(self, repo: str, revision: str) -> tuple[str, list[dict]]:
        api = self.hf.HfApi(endpoint=self.ep)
        mi = self._call(api.model_info, repo, revision=revision, files_metadata=True, token=self.token)
        out = []
        for s in mi.siblings or []:
            lfs = s.lfs
            out.append(
                {
                    "name": s.rfilename,
                    "size": lfs.size if lfs else s.size,
                    "sha256": lfs.sha256 if lfs else None,
                    "blob": None if lfs else s.blob_id,
                }
            )
        return mi.sha, out

    def download(self, repo: str, commit: str, f: dict, part: Path) -> Path:
        p = self._call(
            self.hf.hf_hub_download,
            repo,
            f["name"],
            revision=commit,
            local_dir=str(part),
            token=self.token,
            endpoint=self.ep,
        )
        self.fetched["bytes"] += f["size"] or 0
        return Path(p)


class _Refused(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"HTTP {status} {code} {message}".strip())
        self.status, self.code = status, code


class _Unreachable(Exception):
    pass


def _client(ep: str, token: str | None, use_library: bool | None):
    if use_library is None:
        try:
            import huggingface_hub  # noqa: F401

            use_library = True
        except ImportError:
            use_library = False
    return _Library(ep, token) if use_library else _Http(ep, token)


# ------------------------------------------------------------------------------------------------


def _hashes(path: Path) -> tuple[str, str]:
    """(sha256, git blob sha1) of a file, in one read."""
    sha, blob = hashlib.sha256(), hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_CHUNK), b""):
            sha.update(block)
            blob.update(block)
    return sha.hexdigest(), blob.hexdigest()


def _mismatch(path: Path, f: dict) -> tuple[str | None, str]:
    """(what does not match the hub's metadata or None, the file's sha256)."""
    size = path.stat().st_size
    if f["size"] is not None and size != f["size"]:
        return f"{size} bytes, the hub says {f['size']}", ""
    sha, blob = _hashes(path)
    if f["sha256"] and sha != f["sha256"]:
        return f"sha256 {sha[:12]}..., the hub says {f['sha256'][:12]}...", sha
    if f["blob"] and blob != f["blob"]:
        return f"git blob {blob[:12]}..., the hub says {f['blob'][:12]}...", sha
    return None, sha


def _message(exc: Exception, repo: str, revision: str, ep: str, token: str | None) -> str:
    fix_host = "or set model.hub_fetch: host to let every host download for itself"
    if isinstance(exc, _Unreachable):
        return (
            f"model.hub_fetch: fleet: the control machine cannot reach the hub at {ep} ({exc}). Fix: give this "
            f"machine hub access (HF_ENDPOINT for a mirror), {fix_host}; no host was changed"
        )
    code = getattr(exc, "code", "")
    status = getattr(exc, "status", 0)
    if code == "RevisionNotFound":
        return (
            f"model.revision {revision!r} does not exist in {repo} (the hub at {ep}): pin a branch, tag or commit "
            "the repo has (its commit history on the hub lists them); nothing was downloaded, no host was changed"
        )
    if code == "GatedRepo" or (code != "RepoNotFound" and status == 403):
        why = "" if token else " and model.hub_token is not set"
        return (
            f"model.source {repo!r} is gated{why}: accept its licence on the hub with an account, and set "
            "model.hub_token to that account's token; no host was changed"
        )
    if code in ("RepoNotFound", "") and status in (401, 404):
        return (
            f"model.source {repo!r} does not exist on the hub at {ep} or is private: check the id, or set "
            "model.hub_token; no host was changed"
        )
    return (
        f"model.hub_fetch: fleet: the hub at {ep} refused {repo}@{revision} ({exc}). Fix: check model.source and "
        f"model.revision, {fix_host}; no host was changed"
    )


def ensure(
    repo: str,
    revision: str,
    *,
    token: str | None = None,
    ignore: list[str] | tuple = (),
    endpoint_url: str | None = None,
    root: Path | None = None,
    log=None,
    use_library: bool | None = None,
) -> Path:
    """The complete cache directory of ``repo`` at ``revision`` without the ``ignore`` patterns
    (downloaded once; a commit revision already cached is answered without the network).
    Raises :class:`HubError` with a message for the user (the YAML path, the fix)."""
    root = root or cache_root()
    ignore = sorted(ignore)
    ep = endpoint(endpoint_url)
    # every host of a deploy calls this: the first resolves and fills, the others wait and reuse
    with wh.named_lock(f"hub:{root}:{ep}:{repo}@{revision}:{ignore}"):
        memo = (str(root), ep, repo, revision, tuple(ignore))
        if memo not in _resolved or not (_resolved[memo] / COMPLETE_MARKER).exists():
            _resolved[memo] = _ensure(repo, revision, token, ignore, ep, root, log, use_library)
        return _resolved[memo]


#: (root, endpoint, repo, revision, ignore) -> the complete directory, for this process
_resolved: dict[tuple, Path] = {}


def _ensure(repo, revision, token, ignore, ep, root, log, use_library) -> Path:
    if COMMIT.fullmatch(revision) and (root / key(repo, revision, ignore) / COMPLETE_MARKER).exists():
        return root / key(repo, revision, ignore)
    try:
        client = _client(ep, token, use_library)
        commit, files = client.info(repo, revision)
    except (_Refused, _Unreachable) as exc:
        raise HubError(_message(exc, repo, revision, ep, token)) from None
    wanted = [f for f in files if not any(fnmatch.fnmatch(f["name"], p) for p in ignore)]
    unsafe = [
        f["name"]
        for f in wanted
        if f["name"].startswith("/") or ".." in f["name"].split("/") or f["name"] in ("", COMPLETE_MARKER)
    ]
    if unsafe:  # a file name must stay inside the cache directory (and model.path on the hosts)
        raise HubError(
            f"model.source {repo!r}: the hub at {ep} lists file names outside the repository "
            f"({', '.join(map(repr, unsafe[:3]))}); nothing was downloaded, no host was changed"
        )
    k = key(repo, commit, ignore)

    def fill(part: Path) -> dict:
        part.mkdir(parents=True, exist_ok=True)
        total = sum(f["size"] or 0 for f in wanted)
        if log:
            log(
                f"fleet hub cache: downloading {repo}@{revision} ({len(wanted)} files, {total / 2**20:.1f} MiB) "
                f"into {root / k} (once per fleet)"
            )
        t0 = time.monotonic()
        record = {}
        with wh.Ticker(log, f"fleet hub cache: downloading {repo}", part, total):
            _fill_files(part, record)
        shutil.rmtree(part / ".cache", ignore_errors=True)  # huggingface_hub's resume state
        return {
            "repo": repo,
            "revision": revision,
            "commit": commit,
            "endpoint": ep,
            "ignore": ignore,
            "files": record,
            "bytes": sum(f["size"] for f in record.values()),
            "seconds": round(time.monotonic() - t0, 1),
            "fetched": dict(client.fetched),
        }

    def _fill_files(part: Path, record: dict) -> None:
        for f in wanted:
            final = part / f["name"]
            if final.is_file():  # a resumed fill: what an earlier one placed is checked again
                bad, sha = _mismatch(final, f)
                if not bad:
                    record[f["name"]] = {"size": final.stat().st_size, "sha256": sha}
                    continue
                final.unlink()
            try:
                got = client.download(repo, commit, f, part)
            except (_Refused, _Unreachable) as exc:
                raise HubError(_message(exc, repo, revision, ep, token)) from None
            bad, sha = _mismatch(got, f)
            if bad:
                got.unlink()
                raise HubError(
                    f"model.hub_fetch: fleet: {f['name']} of {repo}@{commit} did not match the hub's metadata ({bad}) "
                    "and was removed from the control machine's cache; no host was changed. Run the deploy again "
                    "(what was already verified is kept)"
                )
            if got != final:
                final.parent.mkdir(parents=True, exist_ok=True)
                os.replace(got, final)
            record[f["name"]] = {"size": final.stat().st_size, "sha256": sha}

    return wh.fill_once(root, k, fill)
