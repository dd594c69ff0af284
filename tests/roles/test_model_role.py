"""roles/model: the three transfer paths through the commands they would send (scripted facts),
and the upload path for real with pyinfra's @local connector into a temporary directory,
checked with the system's own sha256sum."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from pyinfra.facts.files import Directory, File, FileContents, FindFiles, Md5File, Sha1File, Sha256File

from roles.model import ModelMissing, install_model
from vllm_fleet.spec import load, resolve

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


def remote_state(spec, local: Path):
    """Facts of a host where the upload already happened (owner, mode, checksums)."""
    root, user = spec["model"]["path"], spec["server"]["user"]
    files_ = {f"{root}/{p.relative_to(local).as_posix()}": p for p in local.rglob("*") if p.is_file()}
    manifest = sha256sum_lines(local).encode()
    sha1 = {k: hashlib.sha1(v.read_bytes()).hexdigest() for k, v in files_.items()}
    sha1[f"{root}/MANIFEST.sha256"] = hashlib.sha1(manifest).hexdigest()
    meta = {"mode": 644, "user": user, "group": user}
    dirs = {root: {"mode": 755, "user": user, "group": user}, f"{root}/sub": {"mode": 755, "user": user, "group": user}}
    return {
        File: lambda path: meta if path in sha1 else None,
        Directory: lambda path: dirs.get(path),
        Sha1File: lambda path: sha1.get(path),
        Md5File: None, Sha256File: None,
        FindFiles: sorted(sha1),
    }


# ------------------------------------------------------------------------------------ upload

def test_upload_fresh(harness, local_model):
    spec = lab_spec(local_dir=str(local_model))
    root, user = spec["model"]["path"], spec["server"]["user"]
    run = harness.run(install_model, spec, facts={File: None, Directory: None, FindFiles: []})
    assert run.uploads[f"{root}/MANIFEST.sha256"] == sha256sum_lines(local_model)
    for rel in ("config.json", "tokenizer.json", "model.safetensors", "sub/extra.txt"):
        assert run.uploads[f"{root}/{rel}"] == (local_model / rel).read_text()
    assert f"chown {user}:{user} {root}/model.safetensors" in run.commands
    assert f"chmod 644 {root}/model.safetensors" in run.commands
    # the manifest goes after every model file, the check after the manifest
    assert run.index(f"upload:{root}/MANIFEST.sha256") > run.index(f"upload:{root}/model.safetensors")
    verify = run.op("Verify the model")
    assert verify.commands[0].startswith(f"cd {root} && runuser -u {user} -- sha256sum --quiet --strict -c MANIFEST.sha256")
    assert "rm -f MANIFEST.sha256" in verify.commands[0]


def test_upload_second_deploy_no_changes(harness, local_model):
    spec = lab_spec(local_dir=str(local_model))
    run = harness.run(install_model, spec, facts=remote_state(spec, local_model), strict=True)
    assert not run.changed, run
    assert not run.has_op("Verify the model")


def test_upload_changed_file_only(harness, local_model):
    spec = lab_spec(local_dir=str(local_model))
    facts = remote_state(spec, local_model)
    (local_model / "config.json").write_text('{"architectures": ["Other"]}')
    run = harness.run(install_model, spec, facts=facts)
    uploaded = sorted(run.uploads)
    root = spec["model"]["path"]
    assert uploaded == [f"{root}/MANIFEST.sha256", f"{root}/config.json"]
    assert run.has_op("Verify the model")


def test_upload_removes_stale_files(harness, local_model):
    spec = lab_spec(local_dir=str(local_model))
    root = spec["model"]["path"]
    facts = remote_state(spec, local_model)
    stale = f"{root}/model-00002-of-00002.safetensors"
    facts[FindFiles] = facts[FindFiles] + [stale]
    known = facts[File]
    facts[File] = lambda path: {"mode": 644, "user": "vllm", "group": "vllm"} if path == stale else known(path=path)
    run = harness.run(install_model, spec, facts=facts)
    assert run.op("Remove").commands == [f"rm -f {root}/model-00002-of-00002.safetensors"]


def test_upload_missing_local_dir(harness, tmp_path):
    from pyinfra.api.exceptions import DeployError

    with pytest.raises(DeployError, match="vllm-fleet tiny-model"):
        harness.run(install_model, lab_spec(local_dir=str(tmp_path / "nope")), facts={})


# --------------------------------------------------------------------------------------- hub

def hub_spec(**model):
    return lab_spec(transfer="hub", source="Qwen/Qwen2.5-7B-Instruct-AWQ", revision="a" * 40,
                    local_dir=None, **model)


def test_hub_download_token_never_on_the_command_line(harness):
    spec = hub_spec()
    token_path = f"{spec['install']['config_dir']}/hub-token"
    run = harness.run(install_model, spec, hub_token=TOKEN, facts={FileContents: None, File: None})
    assert all(TOKEN not in c for c in run.commands), "the token must never be in a command"
    assert any(TOKEN in text for path, text in run.uploads.items() if path.startswith(token_path))
    assert f"chmod 600 {token_path}.tmp-vllm-fleet" in run.commands or \
        any(c.startswith("install -m 600 /dev/null") for c in run.commands)
    dl = next(c for c in run.commands if "snapshot_download" in c)
    argv = shlex.split(dl)
    py = argv.index(f"{spec['install']['prefix']}/env/bin/python")
    assert "HF_HUB_OFFLINE=0" in argv[:py]
    assert argv[py + 3:] == ["Qwen/Qwen2.5-7B-Instruct-AWQ", "a" * 40, spec["model"]["path"],
                             ".vllm-fleet-hub", token_path]
    user = spec["server"]["user"]
    assert f"chown -R {user}:{user} {spec['model']['path']}" in run.commands


def test_hub_download_script_reads_the_token_file(harness, tmp_path):
    """Run the download command's python with a stub huggingface_hub: it gets the token from the
    file, the pinned revision, and writes the marker."""
    spec = hub_spec(path=str(tmp_path / "model"))
    spec["install"]["prefix"] = str(tmp_path / "prefix")
    run = harness.run(install_model, spec, facts={FileContents: None})
    argv = shlex.split(next(c for c in run.commands if "snapshot_download" in c))
    py = argv.index(f"{spec['install']['prefix']}/env/bin/python")
    stub = tmp_path / "stub" / "huggingface_hub"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(
        "import json, os\n"
        "def snapshot_download(**kw):\n"
        "    os.makedirs(kw['local_dir'], exist_ok=True)\n"
        "    open(os.path.join(kw['local_dir'], 'call.json'), 'w').write(json.dumps(kw))\n")
    token_file = tmp_path / "hub-token"
    token_file.write_text(TOKEN + "\n")
    args = argv[py + 1:]
    args[-1] = str(token_file)
    env = dict(os.environ, PYTHONPATH=str(stub.parent))
    subprocess.run([sys.executable, *args], check=True, env=env)
    call = json.loads((tmp_path / "model" / "call.json").read_text())
    assert call == {"repo_id": "Qwen/Qwen2.5-7B-Instruct-AWQ", "revision": "a" * 40,
                    "local_dir": str(tmp_path / "model"), "token": TOKEN}
    assert (tmp_path / "model" / ".vllm-fleet-hub").read_text() == f"Qwen/Qwen2.5-7B-Instruct-AWQ@{'a' * 40}\n"


def test_hub_skipped_when_marker_matches(harness):
    spec = hub_spec()
    run = harness.run(install_model, spec, facts={FileContents: [f"Qwen/Qwen2.5-7B-Instruct-AWQ@{'a' * 40}"]},
                      strict=True)
    assert not run.changed


def test_hub_new_revision_downloads_again(harness):
    spec = hub_spec()
    run = harness.run(install_model, spec, facts={FileContents: ["Qwen/Qwen2.5-7B-Instruct-AWQ@" + "b" * 40]})
    assert any("snapshot_download" in c for c in run.commands)


# -------------------------------------------------------------------------------------- none

def test_none_present(harness):
    spec = lab_spec(transfer="none")
    run = harness.run(install_model, spec, facts={File: {"mode": 644}}, strict=True)
    assert not run.changed
    assert run.asked == [("File", {"path": f"{spec['model']['path']}/config.json"})]


def test_none_missing_names_the_host(harness):
    with pytest.raises(ModelMissing, match=r"host gpu7: .*/config.json does not exist"):
        harness.run(install_model, lab_spec(transfer="none"), facts={File: None}, host="gpu7")


# --------------------------------------------------------------- upload for real with @local

DEPLOY = """
import json, sys
sys.path.insert(0, {repo!r})
from roles.model import install_model
install_model(spec=json.load(open({spec!r})))
"""


def _pyinfra(tmp_path, *extra, yes=True):
    # -y also turns pyinfra's change detection off (a --dry --json plan then shows no change
    # whatever the state), so the plan is asked for without it
    exe = Path(sys.executable).parent / "pyinfra"
    return subprocess.run([str(exe), *(["-y"] if yes else []), *extra, "@local", str(tmp_path / "deploy.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_upload_for_real_with_local_connector(tmp_path):
    local = tmp_path / "local-model"
    (local / "sub").mkdir(parents=True)
    (local / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (local / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (local / "sub" / "t.json").write_text("{}")
    dest = tmp_path / "host" / "model"
    spec = lab_spec(local_dir=str(local), path=str(dest))
    spec["server"]["user"] = "root"  # a user this machine has
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "deploy.py").write_text(DEPLOY.format(repo=str(REPO), spec=str(tmp_path / "spec.json")))

    first = _pyinfra(tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    check = subprocess.run(["sha256sum", "--strict", "-c", "MANIFEST.sha256"], cwd=dest,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count(": OK") == 3
    assert (dest / "MANIFEST.sha256").read_text() == sha256sum_lines(local)
    assert oct((dest / "model.safetensors").stat().st_mode)[-3:] == "644"

    # a corrupted weight file and a stale shard on the host are both repaired
    (dest / "model.safetensors").write_bytes(b"corrupt")
    (dest / "model-00002-of-00002.safetensors").write_bytes(b"stale")
    second = _pyinfra(tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert (dest / "model.safetensors").read_bytes() == (local / "model.safetensors").read_bytes()
    assert not (dest / "model-00002-of-00002.safetensors").exists()

    # converged: the plan of a third deploy changes nothing
    dry = _pyinfra(tmp_path, "--dry", "--json", yes=False)
    assert dry.returncode == 0, dry.stderr[-3000:]
    plan = json.loads(dry.stdout)["plan"]
    changing = [op["name"].split(" | ")[-1] for op in plan
                if op["hosts_with_change"] or op["hosts_with_conditional_change"]]
    assert changing == []
    # the same plan sees a change when there is one
    (dest / "config.json").write_text("{}")
    dry = _pyinfra(tmp_path, "--dry", "--json", yes=False)
    changing = [op["name"].split(" | ")[-1] for op in json.loads(dry.stdout)["plan"]
                if op["hosts_with_change"] or op["hosts_with_conditional_change"]]
    assert changing == ["Model file config.json", f"Verify the model against MANIFEST.sha256 (as root)"]
