"""vllm_fleet/roles/model: the three transfer paths through the commands they would send (scripted facts),
and the upload path for real with pyinfra's @local connector into a temporary directory,
checked with the system's own sha256sum."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from pyinfra.facts.files import Directory, File, FileContents, Md5File, Sha1File, Sha256File

from vllm_fleet.host.state import HostState, Query, Snapshot, state_command
from vllm_fleet.roles.model import ModelMissing, NoSpace, StateUnknown, install_model
from vllm_fleet.render.files import deployment_paths
from vllm_fleet.specs.load import load, resolve

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fleetutil import free_lines, pyinfra_local, require_vllm_venv, write_model_deploy  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TOKEN = "hf_" + "s3cr3t" * 5


def lab_spec(**model):
    spec = copy.deepcopy(resolve(load(REPO / "deployments" / "lab-tiny.yaml")))
    spec["model"].update(model)
    return spec


@pytest.fixture
def local_model(tmp_path):
    d = tmp_path / "tiny"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (d / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    (d / "model.safetensors").write_text("weights " * 100)  # text: the harness reads uploads as text
    (d / "sub" / "extra.txt").write_text("x")
    return d


def sha256sum_lines(d: Path) -> str:
    """The manifest as the system's sha256sum writes it (an independent reader)."""
    rels = sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())
    out = subprocess.run(["sha256sum", *rels], cwd=d, capture_output=True, text=True, check=True).stdout
    return out


def state(lines, free=None):
    """The HostState fact answering host_state.sh's ``lines`` (``end`` appended: a read that
    completed) and, with ``free`` (bytes: an int or ``f(path)``), a ``free`` line per path asked."""
    return {
        HostState: lambda query: Snapshot.parse([*lines, *(free_lines(query, free) if free is not None else []), "end"])
    }


BARE = {**state([]), File: None, Directory: None}  # a host without the model: nothing at model.path


T0 = "1764800000.1000000000"  # find's %T@ / %C@ of a file on the host (seconds.nanoseconds)


def tree_of(spec, local: Path, extra=(), times=None) -> dict:
    """``{relpath: (size, mtime, ctime)}`` of model.path on a host holding the upload of ``local``
    (and its manifest, and ``extra`` ``{relpath: bytes}``); ``times``: ``{relpath: (mtime, ctime)}``
    where they are not T0."""
    files_ = {p.relative_to(local).as_posix(): p.stat().st_size for p in local.rglob("*") if p.is_file()}
    files_["MANIFEST.sha256"] = len(sha256sum_lines(local).encode())
    files_.update({rel: len(data) for rel, data in dict(extra).items()})
    return {rel: (size, *(times or {}).get(rel, (T0, T0))) for rel, size in files_.items()}


def stamp_of(spec, manifest: str, tree: dict, complete: bool = True) -> str:
    """A stamp as the host writes it: the manifest's sha256 (of ``manifest``, sha256sum's lines)
    and host_state.sh's own ``tree`` lines, ``end`` last (None of the role's code)."""
    root = spec["model"]["path"]
    lines = [f"manifest\t{root}\t{hashlib.sha256(manifest.encode()).hexdigest()}", f"tree\t{root}\t."]
    lines += [f"tree\t{root}\t{size} {m} {c} {rel}" for rel, (size, m, c) in tree.items()]
    return "\n".join(lines + (["end"] if complete else [])) + "\n"


def stamp_path(spec) -> str:
    return f"{spec['install']['config_dir']}/model.stamp"


def remote_state(spec, local: Path, extra=(), free=None, stamp=None, times=None, shas=None):
    """A host where the upload already happened: the state read's lines (owner, mode, sha256,
    the files under model.path with size, mtime and ctime, ``extra``: ``{relpath: bytes}`` there
    besides, ``times``: see :func:`tree_of`, ``shas``: ``{relpath: sha256}`` the host's file
    hashes to instead: a copy corrupted in place), ``stamp``: the stamp's text (None: none there),
    and the facts pyinfra's own operations read where the snapshot differs (owner, mode, checksums)."""
    root, user = spec["model"]["path"], spec["server"]["user"]
    files_ = {f"{root}/{p.relative_to(local).as_posix()}": p.read_bytes() for p in local.rglob("*") if p.is_file()}
    files_[f"{root}/MANIFEST.sha256"] = sha256sum_lines(local).encode()
    files_.update({f"{root}/{rel}": data for rel, data in dict(extra).items()})
    sha1 = {
        k: "0" * 40 if k[len(root) + 1 :] in (shas or {}) else hashlib.sha1(v).hexdigest() for k, v in files_.items()
    }
    meta = {"mode": 644, "user": user, "group": user}
    dirs = {root: {"mode": 755, "user": user, "group": user}, f"{root}/sub": {"mode": 755, "user": user, "group": user}}
    lines = [f"stat\t{path}\tdirectory\t{user}\t{user}\t755\t4096" for path in dirs] + [f"tree\t{root}\t."]
    lines.append(f"read\t{stamp_path(spec)}\t" + (base64.b64encode(stamp.encode()).decode() if stamp else "-"))
    for path, data in files_.items():
        rel = path[len(root) + 1 :]
        mtime, ctime = (times or {}).get(rel, (T0, T0))
        sha = (shas or {}).get(rel) or hashlib.sha256(data).hexdigest()
        lines += [
            f"stat\t{path}\tregular file\t{user}\t{user}\t644\t{len(data)}",
            f"sha\t{path}\t{sha}",
            f"tree\t{root}\t{len(data)} {mtime} {ctime} {rel}",
        ]
    return {
        **state(lines, free),
        File: lambda path: meta if path in sha1 else None,
        Directory: lambda path: dirs.get(path),
        Sha1File: lambda path: sha1.get(path),
        Md5File: None,
        Sha256File: None,
    }


def read_fact_names(run):
    return {name for name, _ in run.asked}


# ------------------------------------------------------------------------------------ upload

GIB = 1 << 30


def on_model_path(there: int, elsewhere: int = 100 * GIB):
    """``free`` for :func:`state`: ``there`` bytes on model.path's filesystem, ``elsewhere`` in the temp dir."""
    return lambda path: there if path.startswith("/var/lib") else elsewhere


def test_no_space_for_the_model_stops_before_any_operation(harness, local_model):
    spec = lab_spec(local_dir=str(local_model))
    size = sum(p.stat().st_size for p in local_model.rglob("*") if p.is_file())
    # exactly the 1 GiB margin free: the files do not fit with it to spare; the free bytes come
    # from the one state read (strict: no other fact is read before the stop)
    facts = {**BARE, **state([], free=on_model_path(GIB + size - 1))}
    with pytest.raises(
        NoSpace,
        match=r"host testhost: not enough disk space for model.path /var/lib/vllm-fleet/lab-tiny/model: "
        r"4 file\(s\) to upload.*model_keep_free_bytes.*no host was changed",
    ):
        harness.run(install_model, spec, deployment_paths(spec), facts=facts, strict=True)
    facts.update(state([], free=on_model_path(GIB + size)))
    run = harness.run(install_model, spec, deployment_paths(spec), facts=facts)
    assert run.changed  # fits with exactly the margin left
    assert "FreeBytes" not in read_fact_names(run), run.asked


def test_the_free_bytes_are_read_with_the_tree_in_one_read(harness, local_model):
    """state_query asks the free bytes at model.path and in the temp dir pyinfra uploads
    through (host data ``_temp_dir``) with the tree: the one read the deploy makes."""
    from vllm_fleet.roles.model import state_query

    spec = lab_spec(local_dir=str(local_model))
    root = spec["model"]["path"]
    run = harness.run(
        install_model,
        spec,
        deployment_paths(spec),
        facts=state([], free=on_model_path(100 * GIB)),
        data={"_temp_dir": "/scratch"},
    )
    query, full = [kw["query"] for name, kw in run.asked if name == "HostState"]
    assert query.free == (root, "/scratch") and query.tree == (root,) and query.read == (stamp_path(spec),)
    assert not query.sha  # the one read hashes nothing; no stamp here: the second read asks the hashes alone
    assert full == Query(sha=full.sha) and f"{root}/model.safetensors" in full.sha
    with pytest.raises(NoSpace, match="uploads each file through /scratch first"):
        harness.run(
            install_model,
            spec,
            deployment_paths(spec),
            facts=state([], free=on_model_path(100 * GIB, 10)),
            data={"_temp_dir": "/scratch"},
        )
    assert lab_spec(transfer="none")["model"]["transfer"] == "none"
    assert not state_query(lab_spec(transfer="none")).free  # no upload: no free bytes asked


def test_files_already_there_need_no_space_and_tmp_must_hold_the_largest(harness, local_model):
    spec = lab_spec(local_dir=str(local_model))
    full = converged(spec, local_model, free=0)  # a full disk: nothing to upload, so no check and no change
    small_tmp = remote_state(spec, local_model, free=on_model_path(10 * GIB, 10))
    assert not harness.run(install_model, spec, deployment_paths(spec), facts=full).changed
    (local_model / "model.safetensors").write_text("weights " * 200)  # larger: must go through /tmp
    with pytest.raises(NoSpace, match=r"uploads each file through /tmp first.*_temp_dir"):
        harness.run(install_model, spec, deployment_paths(spec), facts=small_tmp)


def test_df_with_no_figure_is_not_a_stop(harness, local_model):
    """host_state.sh prints ``free PATH -`` when df gave no figure: nothing to compare, the upload
    goes on (as before, when the free-space fact read nothing)."""
    spec = lab_spec(local_dir=str(local_model))
    assert harness.run(
        install_model, spec, deployment_paths(spec), facts={**BARE, **state([], free=lambda path: None)}
    ).changed


def test_a_read_that_did_not_complete_counts_no_file_as_there_and_removes_none(harness, local_model):
    """The state read knew nothing (the host's answer had no ``end``): every file is put (pyinfra's
    own facts decide), no file is removed as stale, and no fact per file (FindFiles, FileSizes)
    or free-space fact stands in for the read. Its free bytes are not believed either (a cut
    read): the space check has no figure and does not stop the upload."""
    spec = lab_spec(local_dir=str(local_model))
    root = spec["model"]["path"]
    facts = remote_state(spec, local_model, extra={"model-00002-of-00002.safetensors": b"stale"})
    facts[HostState] = lambda query: Snapshot.parse([*free_lines(query, 0), "stat\t/x\t-"])  # cut off before `end`
    facts["FindFiles"] = [f"{root}/model-00002-of-00002.safetensors"]
    facts["FileSizes"] = {
        p.relative_to(local_model).as_posix(): p.stat().st_size for p in local_model.rglob("*") if p.is_file()
    }
    run = harness.run(install_model, spec, deployment_paths(spec), facts=facts)
    assert not run.has_op("Remove"), run
    assert not {"FindFiles", "FileSizes", "FreeBytes"} & read_fact_names(run), run.asked
    assert not run.uploads.keys() - {f"{root}/MANIFEST.sha256"}  # pyinfra's own facts: the files are there


def test_upload_fresh(harness, local_model):
    spec = lab_spec(local_dir=str(local_model))
    root, user = spec["model"]["path"], spec["server"]["user"]
    run = harness.run(install_model, spec, deployment_paths(spec), facts=BARE)
    assert run.uploads[f"{root}/MANIFEST.sha256"] == sha256sum_lines(local_model)
    for rel in ("config.json", "tokenizer.json", "model.safetensors", "sub/extra.txt"):
        assert run.uploads[f"{root}/{rel}"] == (local_model / rel).read_text()
    assert f"chown {user}:{user} {root}/model.safetensors" in run.commands
    assert f"chmod 644 {root}/model.safetensors" in run.commands
    # the manifest goes after every model file, the check after the manifest
    assert run.index(f"upload:{root}/MANIFEST.sha256") > run.index(f"upload:{root}/model.safetensors")
    # the tree listed (host_state.sh's own `tree` read) before the check, the stamp kept after it
    listing, check, keep = run.op("Verify the model").commands
    assert check.startswith(f"cd {root} && runuser -u {user} -- sha256sum --quiet --strict -c MANIFEST.sha256")
    stamp = stamp_path(spec)
    assert f"rm -f MANIFEST.sha256 {stamp}.tmp-vllm-fleet {stamp}" in check  # a failed check leaves no stamp
    assert listing.startswith(f"mkdir -p {spec['install']['config_dir']} && {{ printf 'manifest\\t%s\\t%s\\n' {root} ")
    assert f"host-state tree {root} ; }} > {stamp}.tmp-vllm-fleet" in listing
    assert keep == f"chmod 644 {stamp}.tmp-vllm-fleet && mv -f {stamp}.tmp-vllm-fleet {stamp}"


def converged(spec, local: Path, **kw):
    """A host holding the upload of ``local`` and the stamp of its verified copy."""
    return remote_state(spec, local, stamp=stamp_of(spec, sha256sum_lines(local), tree_of(spec, local)), **kw)


def hash_reads(run) -> list:
    """The state reads of ``run`` that asked a file's sha256 (the host reads the file whole)."""
    return [kw["query"] for name, kw in run.asked if name == "HostState" and kw["query"].sha]


def test_upload_second_deploy_no_changes(harness, local_model):
    """A converged host with its stamp: one state read, which hashes no file on the host."""
    spec = lab_spec(local_dir=str(local_model))
    run = harness.run(install_model, spec, deployment_paths(spec), facts=converged(spec, local_model), strict=True)
    assert not run.changed, run
    assert not run.has_op("Verify the model")
    assert read_fact_names(run) == {"HostState"} and len(run.asked) == 1, (
        run.asked
    )  # the one state read, no fact per file
    assert hash_reads(run) == [], run.asked


def test_a_copy_verified_before_stamps_is_hashed_once_and_stamped(harness, local_model):
    """No stamp (a host deployed by an older release): every file's sha256 is read in a second
    read, all are in place, so nothing is put and vLLM has nothing to restart for; the stamp is
    put (atomically, root 0644) from the first read's listing, taken before the hashes."""
    spec = lab_spec(local_dir=str(local_model))
    cfg = spec["install"]["config_dir"]
    facts = {**remote_state(spec, local_model), Directory: harness.per_arg("path", {cfg: {"mode": 750}})}
    run = harness.run(install_model, spec, deployment_paths(spec), facts=facts)
    assert [op.name.split(" | ")[-1] for op in run.ops if op.commands] == ["Stamp the verified model (model.stamp)"], (
        run
    )
    assert len(hash_reads(run)) == 1
    stamp = stamp_path(spec)
    want = stamp_of(spec, sha256sum_lines(local_model), tree_of(spec, local_model))
    assert sorted(run.uploads[stamp].splitlines()) == sorted(want.splitlines())
    assert run.op("Stamp the verified model").commands[1:] == [
        f"chown root:root {stamp}.tmp-vllm-fleet",
        f"chmod 644 {stamp}.tmp-vllm-fleet",
        f"mv -f {stamp}.tmp-vllm-fleet {stamp}",
    ]


def _differs(spec, local: Path, how: str) -> tuple[str, dict]:
    """A stamp that no longer says the host's copy is the verified one, and what else the host holds."""
    tree, manifest, extra = tree_of(spec, local), sha256sum_lines(local), {}
    size, mtime, ctime = tree["model.safetensors"]
    if how == "size":
        tree["model.safetensors"] = (size + 1, mtime, ctime)
    elif how == "mtime":  # the owner of a file can set it back (touch -d): the ctime is then the one that moves
        tree["model.safetensors"] = (size, "1764800000.2000000000", ctime)
    elif how == "ctime":
        tree["model.safetensors"] = (size, mtime, "1764800000.2000000000")
    elif how == "added":  # a file there that the verified copy did not have
        extra = {"model-00002-of-00002.safetensors": b"stale"}
    elif how == "removed":  # the verified copy had a file the host no longer has
        tree["gone.safetensors"] = (5, mtime, ctime)
    elif how == "manifest":  # verified against another manifest
        manifest = manifest.replace("sub/extra.txt", "sub/other.txt")
    text = stamp_of(spec, manifest, tree, complete=how != "cut")
    if how == "root":
        text = text.replace(spec["model"]["path"], "/srv/other-model")
    return text, extra


@pytest.mark.parametrize("how", ["size", "mtime", "ctime", "added", "removed", "manifest", "cut", "root"])
def test_any_difference_from_the_stamp_brings_the_full_check(harness, local_model, how):
    """A file of another size, mtime or ctime, a file added or gone, another manifest, a stamp cut
    short or of another path: every file's sha256 is read and compared as without a stamp."""
    spec = lab_spec(local_dir=str(local_model))
    cfg = spec["install"]["config_dir"]
    text, extra = _differs(spec, local_model, how)
    root = spec["model"]["path"]
    facts = {
        **remote_state(spec, local_model, stamp=text, extra=extra),
        Directory: harness.per_arg("path", {cfg: {"mode": 750}}),
        FileContents: None,
    }
    run = harness.run(install_model, spec, deployment_paths(spec), facts=facts)
    assert len(hash_reads(run)) == 1, run.asked
    changed = [op.name.split(" | ")[-1] for op in run.ops if op.commands]
    if how == "added":  # the stale file goes and the check runs on the host (it writes the stamp)
        assert changed == [
            f"Remove {root}/model-00002-of-00002.safetensors (not in the manifest)",
            "Verify the model against MANIFEST.sha256 (as vllm)",
        ], run
    else:  # every file in place: a new stamp from the read, nothing put
        assert changed == ["Stamp the verified model (model.stamp)"], run


def test_verify_hashes_every_file_whatever_the_stamp_says(harness, local_model):
    """A copy corrupted where the stamp cannot see it (the bytes changed, not the size, mtime or
    ctime: a disk's bit rot): a plain deploy trusts the stamp; with model_verify (`deploy
    --verify`) the one state read hashes every file, and the corrupted one is put again."""
    spec = lab_spec(local_dir=str(local_model))
    facts = converged(spec, local_model, shas={"model.safetensors": "0" * 64})
    plain = harness.run(install_model, spec, deployment_paths(spec), facts=facts)
    assert not plain.changed and hash_reads(plain) == [], plain
    run = harness.run(install_model, spec, deployment_paths(spec), facts=facts, data={"model_verify": True})
    assert len(run.asked) >= 1 and run.asked[0][0] == "HostState" and run.asked[0][1]["query"].sha, run.asked
    assert len(hash_reads(run)) == 1  # the deploy's one read: no second round trip
    root = spec["model"]["path"]
    assert sorted(run.uploads) == [f"{root}/model.safetensors"], run
    assert run.has_op("Verify the model")


def test_upload_changed_file_only(harness, local_model):
    spec = lab_spec(local_dir=str(local_model))
    facts = remote_state(spec, local_model)
    (local_model / "config.json").write_text('{"architectures": ["Other"]}')
    run = harness.run(install_model, spec, deployment_paths(spec), facts=facts)
    uploaded = sorted(run.uploads)
    root = spec["model"]["path"]
    assert uploaded == [f"{root}/MANIFEST.sha256", f"{root}/config.json"]
    assert run.has_op("Verify the model")


def test_upload_removes_stale_files(harness, local_model):
    spec = lab_spec(local_dir=str(local_model))
    root = spec["model"]["path"]
    facts = remote_state(spec, local_model, extra={"model-00002-of-00002.safetensors": b"stale"})
    run = harness.run(install_model, spec, deployment_paths(spec), facts=facts)
    assert run.op("Remove").commands == [f"rm -f {root}/model-00002-of-00002.safetensors"]
    assert "FindFiles" not in read_fact_names(run), run.asked  # the files there: from the state read


def test_upload_missing_local_dir(harness, tmp_path):
    from pyinfra.api.exceptions import DeployError

    spec = lab_spec(local_dir=str(tmp_path / "nope"))
    with pytest.raises(DeployError, match="vllm-fleet tiny-model"):
        harness.run(install_model, spec, deployment_paths(spec), facts={})


# --------------------------------------------------------------------------------------- hub


def hub_spec(**model):
    """``hub_fetch: host``: every host downloads for itself (the fleet cache: test_model_hub_fleet.py)."""
    return lab_spec(
        **{
            "transfer": "hub",
            "source": "Qwen/Qwen2.5-7B-Instruct-AWQ",
            "revision": "a" * 40,
            "local_dir": None,
            "hub_fetch": "host",
            **model,
        }
    )


def marker(spec, text=None):
    """The state read of model.path's hub marker: ``text`` (None: no marker)."""
    b64 = base64.b64encode(text.encode()).decode() if text is not None else "-"
    return state([f"read\t{spec['model']['path']}/.vllm-fleet-hub\t{b64}"])


def test_hub_download_token_never_on_the_command_line(harness):
    spec = hub_spec()
    token_path = f"{spec['install']['config_dir']}/hub-token"
    run = harness.run(install_model, spec, deployment_paths(spec), hub_token=TOKEN, facts={**marker(spec), File: None})
    assert all(TOKEN not in c for c in run.commands), "the token must never be in a command"
    assert any(TOKEN in text for path, text in run.uploads.items() if path.startswith(token_path))
    assert f"chmod 600 {token_path}.tmp-vllm-fleet" in run.commands or any(
        c.startswith("install -m 600 /dev/null") for c in run.commands
    )
    dl = next(c for c in run.commands if "snapshot_download" in c)
    argv = shlex.split(dl)
    py = argv.index(f"{spec['install']['prefix']}/env/bin/python")
    assert "HF_HUB_OFFLINE=0" in argv[:py]
    assert argv[py + 3 :] == [
        "Qwen/Qwen2.5-7B-Instruct-AWQ",
        "a" * 40,
        spec["model"]["path"],
        ".vllm-fleet-hub",
        '["original/*", "*.pth"]',
        str(1 << 30),
        token_path,
    ]
    user = spec["server"]["user"]
    assert f"chown -R {user}:{user} {spec['model']['path']}" in run.commands


def _hub_script(harness, spec, token_file="", data=None):
    """The download command's python argv (script and arguments) as the role would send it."""
    run = harness.run(install_model, spec, deployment_paths(spec), facts=marker(spec), data=data)
    argv = shlex.split(next(c for c in run.commands if "snapshot_download" in c))
    args = argv[argv.index(f"{spec['install']['prefix']}/env/bin/python") + 1 :]
    args[-1] = token_file
    return args


def _run_hub_script(args, hub, tmp_path):
    """Run the role's download script with the vLLM CPU venv's python (the huggingface_hub the
    hosts get with vLLM) against the stand-in hub."""
    py = require_vllm_venv()
    env = {
        **os.environ,
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_ETAG_TIMEOUT": "5",
        "HF_HUB_DOWNLOAD_TIMEOUT": "5",
    }
    return subprocess.run([py, *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def hub(tmp_path):
    sys.path.insert(0, str(REPO / "tests"))
    from hubstandin import StandInHub

    made = []

    def make(**kw):
        made.append(StandInHub("Qwen/Qwen2.5-7B-Instruct-AWQ", "a" * 40, HUB_FILES, **kw))
        return made[-1]

    yield make
    for h in made:
        h.close()


HUB_FILES = {
    "config.json": b'{"architectures": ["Qwen2ForCausalLM"]}',
    "model.safetensors": bytes(range(256)) * 2000,
    # as in Llama repositories: what vLLM never loads (not downloaded)
    "original/consolidated.00.pth": b"\0" * 4096,
    "original/params.json": b"{}",
}
WANTED = {k: v for k, v in HUB_FILES.items() if not k.startswith("original/")}


def _sha(p: Path) -> str:
    return subprocess.run(["sha256sum", str(p)], capture_output=True, text=True, check=True).stdout.split()[0]


@pytest.mark.vllm  # the vLLM CPU venv's huggingface_hub
def test_hub_download_with_the_token_file_writes_the_marker(harness, hub, tmp_path):
    """The real huggingface_hub against the stand-in: the token comes from the file (sent as a
    Bearer header), the files land at model.path intact, and the marker names repo@revision."""
    spec = hub_spec(path=str(tmp_path / "model"))
    token_file = tmp_path / "hub-token"
    token_file.write_text(TOKEN + "\n")
    h = hub()
    r = _run_hub_script(_hub_script(harness, spec, str(token_file)), h, tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    for name, data in WANTED.items():
        assert _sha(tmp_path / "model" / name) == hashlib.sha256(data).hexdigest()
    assert not (tmp_path / "model" / "original").exists()  # original/* and *.pth are skipped
    assert (tmp_path / "model" / ".vllm-fleet-hub").read_text() == f"Qwen/Qwen2.5-7B-Instruct-AWQ@{'a' * 40}\n"
    assert {auth for _, _, auth in h.requests} == {f"Bearer {TOKEN}"}
    assert TOKEN not in " ".join(_hub_script(harness, spec, str(token_file)))


@pytest.mark.vllm  # the vLLM CPU venv's huggingface_hub
def test_hub_download_stops_before_anything_when_the_disk_is_too_small(harness, hub, tmp_path):
    """The repository's file sizes (from the hub, before any download) against the free space at
    model.path less model_keep_free_bytes: a clear stop, nothing downloaded, no marker."""
    spec = hub_spec(path=str(tmp_path / "model"))
    import shutil as _sh

    free = _sh.disk_usage(tmp_path).free
    args = _hub_script(
        harness, spec, data={"model_keep_free_bytes": free + (64 << 30)}
    )  # cannot fit, however free space moves
    r = _run_hub_script(args, hub(), tmp_path)
    assert r.returncode == 3, (r.returncode, r.stderr[-2000:])
    assert "model download: not enough disk space at" in r.stderr and "model_keep_free_bytes" in r.stderr, r.stderr[
        -2000:
    ]
    assert "nothing was downloaded" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "model" / "model.safetensors").exists()
    assert not (tmp_path / "model" / ".vllm-fleet-hub").exists()


def test_hub_ignore_patterns_are_on_the_command_line(harness):
    args = _hub_script(harness, hub_spec())
    assert json.loads(args[-3]) == ["original/*", "*.pth"] and args[-2] == str(1 << 30)


@pytest.mark.vllm  # the vLLM CPU venv's huggingface_hub
def test_hub_revision_that_does_not_exist_is_named_with_a_fix(harness, hub, tmp_path):
    spec = hub_spec(path=str(tmp_path / "model"), revision="no-such-revision")
    r = _run_hub_script(_hub_script(harness, spec), hub(), tmp_path)
    assert r.returncode == 3, (r.returncode, r.stderr[-2000:])
    assert (
        "model download: model.revision 'no-such-revision' does not exist in Qwen/Qwen2.5-7B-Instruct-AWQ: "
        "pin a branch, tag or commit"
    ) in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "model" / ".vllm-fleet-hub").exists()


@pytest.mark.vllm  # the vLLM CPU venv's huggingface_hub
def test_hub_interrupted_download_is_resumed_and_verified(harness, hub, tmp_path):
    """The connection drops half-way through the weights on every try of a first run (which
    fails: no marker, so the next deploy downloads again); the second run completes the file and
    the marker is written only then, over intact bytes."""
    spec = hub_spec(path=str(tmp_path / "model"))
    args = _hub_script(harness, spec)
    h = hub(cut={"model.safetensors": 50})
    first = _run_hub_script(args, h, tmp_path)
    assert first.returncode != 0, first.stderr[-2000:]
    assert not (tmp_path / "model" / ".vllm-fleet-hub").exists()
    h.cut.clear()
    second = _run_hub_script(args, h, tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    assert _sha(tmp_path / "model" / "model.safetensors") == hashlib.sha256(HUB_FILES["model.safetensors"]).hexdigest()
    assert (tmp_path / "model" / ".vllm-fleet-hub").exists()


@pytest.mark.vllm  # the vLLM CPU venv's huggingface_hub
def test_hub_corrupted_file_is_removed_and_not_marked(harness, hub, tmp_path):
    """Bytes that do not match the hub's sha256 are never marked as downloaded: the file is
    removed, the command fails saying so, and the next run fetches it again."""
    spec = hub_spec(path=str(tmp_path / "model"))
    args = _hub_script(harness, spec)
    h = hub(corrupt={"model.safetensors": 1})
    first = _run_hub_script(args, h, tmp_path)
    assert (
        first.returncode == 3
        and "did not match the hub's size/sha256 and were removed (model.safetensors)" in first.stderr
    ), first.stderr[-2000:]
    assert not (tmp_path / "model" / "model.safetensors").exists()
    assert not (tmp_path / "model" / ".vllm-fleet-hub").exists()
    second = _run_hub_script(args, h, tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    assert _sha(tmp_path / "model" / "model.safetensors") == hashlib.sha256(HUB_FILES["model.safetensors"]).hexdigest()


def test_hub_skipped_when_marker_matches(harness):
    spec = hub_spec()
    run = harness.run(
        install_model,
        spec,
        deployment_paths(spec),
        facts=marker(spec, f"Qwen/Qwen2.5-7B-Instruct-AWQ@{'a' * 40}\n"),
        strict=True,
    )
    assert not run.changed
    assert run.asked == [("HostState", {"query": Query(read=(f"{spec['model']['path']}/.vllm-fleet-hub",))})]


def test_hub_new_revision_downloads_again(harness):
    spec = hub_spec()
    run = harness.run(
        install_model,
        spec,
        deployment_paths(spec),
        facts=marker(spec, "Qwen/Qwen2.5-7B-Instruct-AWQ@" + "b" * 40 + "\n"),
    )
    assert any("snapshot_download" in c for c in run.commands)


def test_hub_downloads_when_the_read_did_not_complete(harness):
    """No marker known (the read was cut off): the download runs (it resumes and verifies what
    is there); no FileContents fact stands in for the read."""
    spec = hub_spec()
    run = harness.run(
        install_model, spec, deployment_paths(spec), facts={FileContents: [f"Qwen/Qwen2.5-7B-Instruct-AWQ@{'a' * 40}"]}
    )
    assert any("snapshot_download" in c for c in run.commands)
    assert "FileContents" not in read_fact_names(run), run.asked


# -------------------------------------------------------------------------------------- none


def test_none_present(harness):
    spec = lab_spec(transfer="none")
    config = f"{spec['model']['path']}/config.json"
    run = harness.run(
        install_model,
        spec,
        deployment_paths(spec),
        facts=state([f"stat\t{config}\tregular file\tvllm\tvllm\t644\t42"]),
        strict=True,
    )
    assert not run.changed
    assert run.asked == [("HostState", {"query": Query(stat=(config,))})]


def test_none_missing_names_the_host(harness):
    spec = lab_spec(transfer="none")
    config = f"{spec['model']['path']}/config.json"
    with pytest.raises(ModelMissing, match=r"host gpu7: .*/config.json does not exist"):
        harness.run(install_model, spec, deployment_paths(spec), facts=state([f"stat\t{config}\t-"]), host="gpu7")


def test_none_on_a_read_that_did_not_complete_is_not_a_missing_model(harness):
    """The read was cut off: not ModelMissing (nothing says the weights are absent) but its own
    error naming the host and how to retry; no File fact stands in for the read."""
    spec = lab_spec(transfer="none")
    with pytest.raises(StateUnknown, match=r"host gpu7: .*did not complete.*run the deploy again") as err:
        harness.run(install_model, spec, deployment_paths(spec), facts={File: {"mode": 644}}, host="gpu7")
    assert not isinstance(err.value, ModelMissing)


# --------------------------------------------------------------- upload for real with @local


def test_upload_for_real_with_local_connector(tmp_path):
    local = tmp_path / "local-model"
    (local / "sub").mkdir(parents=True)
    (local / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (local / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (local / "sub" / "t.json").write_text("{}")
    dest = tmp_path / "host" / "model"
    spec = lab_spec(local_dir=str(local), path=str(dest))
    spec["server"]["user"] = "root"  # a user this machine has
    spec["install"]["config_dir"] = str(tmp_path / "host" / "etc")  # the stamp's directory (made by the role)
    stamp = tmp_path / "host" / "etc" / "model.stamp"
    write_model_deploy(tmp_path, spec)

    first = pyinfra_local(tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    check = subprocess.run(["sha256sum", "--strict", "-c", "MANIFEST.sha256"], cwd=dest, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count(": OK") == 3
    assert (dest / "MANIFEST.sha256").read_text() == sha256sum_lines(local)
    assert oct((dest / "model.safetensors").stat().st_mode)[-3:] == "644"

    # a corrupted weight file and a stale shard on the host are both repaired
    (dest / "model.safetensors").write_bytes(b"corrupt")
    (dest / "model-00002-of-00002.safetensors").write_bytes(b"stale")
    second = pyinfra_local(tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert (dest / "model.safetensors").read_bytes() == (local / "model.safetensors").read_bytes()
    assert not (dest / "model-00002-of-00002.safetensors").exists()
    assert_stamp_matches(stamp, dest)

    # a no-op: the one state read asks no file's sha256 (pyinfra's -vv shows what it ran)
    noop = pyinfra_local(tmp_path, "-vv")
    assert noop.returncode == 0, noop.stderr[-3000:]
    reads = [
        ln.split("host-state", 1)[1] for ln in (noop.stdout + noop.stderr).splitlines() if "host-state stat " in ln
    ]
    assert len(reads) == 1 and f" tree {dest} " in reads[0] and " sha " not in reads[0], reads
    assert_stamp_matches(stamp, dest)

    # bytes changed where the stamp cannot see it (a disk's bit rot: same size, mtime and ctime;
    # here: the stamp listed again after the write): a plain deploy trusts the stamp, --verify
    # (host data model_verify) hashes every file and puts the bad one again
    good = (local / "model.safetensors").read_bytes()
    (dest / "model.safetensors").write_bytes(bytes(255 - b for b in good))
    listing = subprocess.run(
        ["sh", "-c", state_command(Query(tree=(str(dest),))).get_raw_value()],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    stamp.write_text(stamp.read_text().splitlines()[0] + "\n" + listing)
    dry = pyinfra_local(tmp_path, "--dry", "--json", yes=False)
    assert [
        op for op in json.loads(dry.stdout)["plan"] if op["hosts_with_change"]
    ] == []  # trusted: the limit of a stamp
    verify = pyinfra_local(tmp_path, "--data", "model_verify=true")
    assert verify.returncode == 0, verify.stdout[-3000:] + verify.stderr[-3000:]
    assert (dest / "model.safetensors").read_bytes() == good
    assert_stamp_matches(stamp, dest)

    # converged: the plan of a third deploy changes nothing
    dry = pyinfra_local(tmp_path, "--dry", "--json", yes=False)
    assert dry.returncode == 0, dry.stderr[-3000:]
    plan = json.loads(dry.stdout)["plan"]
    changing = [
        op["name"].split(" | ")[-1] for op in plan if op["hosts_with_change"] or op["hosts_with_conditional_change"]
    ]
    assert changing == []
    # the same plan sees a change when there is one
    (dest / "config.json").write_text("{}")
    dry = pyinfra_local(tmp_path, "--dry", "--json", yes=False)
    changing = [
        op["name"].split(" | ")[-1]
        for op in json.loads(dry.stdout)["plan"]
        if op["hosts_with_change"] or op["hosts_with_conditional_change"]
    ]
    assert changing == ["Model file config.json", "Verify the model against MANIFEST.sha256 (as root)"]


def assert_stamp_matches(stamp: Path, dest: Path) -> None:
    """The stamp on the host, read with os.stat and hashlib (not the role's code): root's, 0644,
    the sha256 of the MANIFEST.sha256 at ``dest``, and every file there with the size, mtime
    and ctime os.stat reads now, and no other."""
    st = stamp.stat()
    assert (st.st_uid, oct(st.st_mode)[-3:]) == (0, "644")
    lines = stamp.read_text().splitlines()
    assert lines[0] == f"manifest\t{dest}\t{hashlib.sha256((dest / 'MANIFEST.sha256').read_bytes()).hexdigest()}"
    assert lines[1] == f"tree\t{dest}\t." and lines[-1] == "end"
    seen = {}
    for line in lines[2:-1]:
        kind, root, value = line.split("\t")
        size, mtime, ctime, rel = value.split(" ", 3)
        assert (kind, root) == ("tree", str(dest))
        seen[rel] = (int(size), _ns(mtime), _ns(ctime))
    there = {p.relative_to(dest).as_posix(): p.stat() for p in dest.rglob("*") if p.is_file()}
    assert seen == {rel: (s.st_size, s.st_mtime_ns, s.st_ctime_ns) for rel, s in there.items()}


def _ns(text: str) -> int:
    sec, _, frac = text.partition(".")
    return int(sec) * 10**9 + int((frac + "0" * 9)[:9])


def test_files_that_came_host_to_host_are_not_hashed_twice(harness, local_model, monkeypatch):
    """(issue 36, item 3) A host filled by the peer rounds (roles.common.peers: fetch_files.py
    checked every file against the manifest's sha256 as it wrote it) is not read again with
    ``sha256sum -c``: the check proves only that the service user can read every file (find
    fails on one it cannot), with the same stamp around it; a host the files reach by SFTP keeps
    ``sha256sum -c`` (test_upload_fresh)."""
    from pyinfra.operations import server

    from vllm_fleet.roles.common import peers

    joined = []

    def by_peers(key, what, local, root, files, lacks, **kw):  # the peer rounds' operations
        joined.append(sorted(lacks))
        return [server.shell(name="peer round (stand-in)", commands=["true"])]

    monkeypatch.setattr(peers, "join", by_peers)
    spec = lab_spec(local_dir=str(local_model))
    root, user = spec["model"]["path"], spec["server"]["user"]
    run = harness.run(install_model, spec, deployment_paths(spec), facts=BARE)
    assert joined == [["config.json", "model.safetensors", "sub/extra.txt", "tokenizer.json"]]
    assert not {f"{root}/{rel}" for rel in joined[0]} & run.uploads.keys()  # none by SFTP
    listing, check, keep = run.op("Verify the model").commands
    assert "sha256sum" not in check
    assert check.startswith(f"cd {root} && runuser -u {user} -- find . -type f '!' -readable -exec false '{{}}' +")
    stamp = stamp_path(spec)
    assert f"rm -f MANIFEST.sha256 {stamp}.tmp-vllm-fleet {stamp}" in check  # a failed check leaves no stamp
    assert keep == f"chmod 644 {stamp}.tmp-vllm-fleet && mv -f {stamp}.tmp-vllm-fleet {stamp}"
