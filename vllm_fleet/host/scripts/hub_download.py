"""Runs on a host with the deployment's Python (huggingface_hub): download a model repository
from the hub into model.path, check free space first and every file after, then write the marker.

    python hub_download.py REPO REVISION DEST MARKER IGNORE_JSON KEEP_FREE_BYTES TOKEN_FILE
"""

import fnmatch, hashlib, json, os, pathlib, shutil, sys

repo, revision, dest, marker, ignore_json, keep, token_file = sys.argv[1:8]
token = pathlib.Path(token_file).read_text().strip() if token_file else None
ignore = json.loads(ignore_json)
from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError


def fail(msg):
    print("model download: " + msg, file=sys.stderr)
    sys.exit(3)


def size_of(f):
    lfs = getattr(f, "lfs", None)
    return getattr(lfs, "size", None) or f.size


try:
    info = HfApi().model_info(repo, revision=revision, files_metadata=True, token=token)
    # What vLLM never loads (Llama repositories' original/ consolidated.*.pth) is not downloaded.
    wanted = [f for f in info.siblings or [] if not any(fnmatch.fnmatch(f.rfilename, p) for p in ignore)]
    # Free space first, against the repository's own file sizes (what is already there counts).
    need = 0
    for f in wanted:
        p, size = pathlib.Path(dest, f.rfilename), size_of(f) or 0
        need += max(size - (p.stat().st_size if p.is_file() else 0), 0)
    pathlib.Path(dest).mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dest).free
    if free - need < int(keep):
        gib = lambda n: f"{n / 2**30:.2f} GiB"
        fail(
            f"not enough disk space at {dest}: {repo}@{revision} needs {gib(need)} more, {gib(free)} are free and "
            f"model_keep_free_bytes asks {gib(int(keep))} to stay free. Fix: free space there, point model.path at a "
            "larger filesystem, or lower model_keep_free_bytes; nothing was downloaded"
        )
    # resumes what an interrupted run left (local_dir/.cache/huggingface/download)
    snapshot_download(repo_id=repo, revision=revision, local_dir=dest, token=token, ignore_patterns=ignore or None)
except RevisionNotFoundError:
    fail(
        f"model.revision {revision!r} does not exist in {repo}: pin a branch, tag or commit the repo has "
        "(its commit history on the hub lists them); nothing was marked as downloaded"
    )
except GatedRepoError:
    fail(f"{repo} is gated: accept its licence on the hub with the account whose token is model.hub_token")
except RepositoryNotFoundError:
    fail(f"model.source {repo!r} does not exist on the hub or is private: check the id, or set model.hub_token")
# Verified before use: every file's size, and sha256 where the hub gives one (LFS files).
bad = []
for f in wanted:
    p = pathlib.Path(dest, f.rfilename)
    lfs = getattr(f, "lfs", None)
    size = size_of(f)
    if not p.is_file() or (size is not None and p.stat().st_size != size):
        bad.append(f.rfilename)
    elif lfs is not None and getattr(lfs, "sha256", None):
        h = hashlib.sha256()
        with open(p, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        if h.hexdigest() != lfs.sha256:
            bad.append(f.rfilename)
for rel in bad:
    pathlib.Path(dest, rel).unlink(missing_ok=True)
if bad:
    fail(
        f"{len(bad)} file(s) did not match the hub's size/sha256 and were removed ({', '.join(bad[:5])}): run the "
        "deploy again"
    )
pathlib.Path(dest, marker).write_text(f"{repo}@{revision}\n")
