"""Each hardware check fires on a spec that breaks its rule and stays quiet on one that does not.

Specs start from deployments/*.yaml (loaded and resolved as the CLI does) and change one thing.
"""

import json

import pytest

from vllm_fleet.specs import hwchecks

from vllm_fleet.specs import load as spec
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEPLOYMENTS = sorted((REPO / "deployments").glob("*.yaml"))


def load(name, raw_changes=None, **changes):
    s = spec.load(REPO / "deployments" / name)
    for dotted, value in (raw_changes or {}).items():
        section, key = dotted.split("__")
        if value is None:
            s.raw.setdefault(section, {}).pop(key, None)
        else:
            s.raw.setdefault(section, {})[key] = value
    r = spec.resolve(s)
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        r[section][key] = value
    hwchecks.apply_model_facts(r)
    return r, s


def problems(name, raw_changes=None, **changes):
    r, s = load(name, raw_changes, **changes)
    return hwchecks.hardware_problems(r, s)


def at(ps, path, severity=None):
    return [p for p in ps if p.path == path and (severity is None or p.severity == severity)]


RT = "rtx3090-qwen7b-awq-realtime.yaml"


@pytest.mark.parametrize("path", DEPLOYMENTS, ids=lambda p: p.name)
def test_examples_have_no_hardware_errors(path):
    r, s = load(path.name)
    errors = [p for p in hwchecks.hardware_problems(r, s) if p.severity == "error"]
    assert errors == [], [p.format() for p in errors]


def test_every_problem_has_a_fix_and_a_line():
    ps = problems(RT, engine__kv_cache_dtype="fp8", model__dtype="bfloat16", model__quantization="awq")
    assert len(ps) >= 3 and all(p.fix for p in ps)
    assert at(ps, "model.dtype")[0].line == 9  # `dtype: float16` in the file


def test_tp_must_divide_attention_heads():
    ps = problems(RT, parallel__tensor=3, hardware__gpus_per_node=3)  # 28 heads
    err = at(ps, "parallel.tensor", "error")
    assert err and "28 attention heads" in err[0].message and "1, 2, 4, 7, 14" in err[0].fix
    assert not at(problems(RT, parallel__tensor=2, hardware__gpus_per_node=2), "parallel.tensor")


def test_tp_must_suit_kv_heads():
    ps = problems(RT, parallel__tensor=7, hardware__gpus_per_node=7)  # 28 % 7 == 0, but 4 KV heads
    assert "4 KV heads" in at(ps, "parallel.tensor", "error")[0].message
    assert not at(problems(RT, parallel__tensor=4, hardware__gpus_per_node=4), "parallel.tensor")


def test_gpu_count_must_match_parallelism():
    ps = problems("4xh100-qwen32b-tp4.yaml", parallel__tensor=2)
    err = at(ps, "parallel.tensor", "error")
    assert err and "= 2 GPUs" in err[0].message and "= 4" in err[0].message
    assert err[0].line == 21  # `tensor: 4` in the file
    assert not at(problems("2node-ray-pp2.yaml"), "parallel.tensor", "error")  # 2 x 2 = 2 per node x 2 nodes


def test_fp8_kv_cache_refused_on_ampere_only():
    err = at(problems(RT, engine__kv_cache_dtype="fp8"), "engine.kv_cache_dtype", "error")
    assert err and "8.9" in err[0].message and "RTX 3090" in err[0].message
    assert not at(problems(RT, engine__kv_cache_dtype="fp8", hardware__gpu="rtx4090"), "engine.kv_cache_dtype")
    assert at(problems("4xh100-qwen32b-tp4.yaml", hardware__gpu="a100-80gb"), "engine.kv_cache_dtype", "error")


def test_fp8_weights_refused_on_ampere():
    r = dict(model__source="Qwen/Qwen2.5-7B-Instruct", model__quantization="fp8", model__dtype="bfloat16")
    w = at(problems(RT, **r), "model.quantization")
    assert w and w[0].severity == "error" and "8.9" in w[0].message and "awq_marlin" in w[0].fix
    assert not at(problems(RT, hardware__gpu="rtx4090", **r), "model.quantization")


def test_plain_awq_needs_float16_and_warns_about_marlin():
    ps = problems(RT, model__quantization="awq", model__dtype="bfloat16")
    assert at(ps, "model.dtype", "error")
    assert "awq_marlin" in at(ps, "model.quantization", "warning")[0].fix
    ok = problems(RT)  # awq_marlin + float16
    assert not at(ok, "model.dtype") and not at(ok, "model.quantization")


def test_int8_kv_cache_warns():
    w = at(problems(RT, engine__kv_cache_dtype="int8"), "engine.kv_cache_dtype", "warning")
    assert w and "65.5" in w[0].message


def test_speculative_on_small_single_gpu_model_warns():
    spec_cfg = {"method": "ngram", "num_speculative_tokens": 4}
    w = at(problems(RT, engine__speculative=spec_cfg), "engine.speculative", "warning")
    assert w and "x25" in w[0].message
    assert not at(problems("2node-ray-pp2.yaml", engine__speculative=spec_cfg), "engine.speculative")


def test_max_model_len_beyond_context_is_an_error():
    err = at(problems(RT, model__max_model_len=65536), "model.max_model_len", "error")
    assert err and "32768" in err[0].message
    assert not at(problems(RT, model__max_model_len=32768), "model.max_model_len")


def test_profile_max_model_len_is_capped_silently(tmp_path):
    cfg = {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # lab-tiny without an explicit max_model_len: the profile's 4096 exceeds the model's 2048
    r, s = load("lab-tiny.yaml", {"model__source": str(tmp_path), "model__max_model_len": None})
    assert r["model"]["max_model_len"] == 2048
    assert not at(hwchecks.hardware_problems(r, s), "model.max_model_len")
    # written explicitly, it is reported instead
    r, s = load("lab-tiny.yaml", {"model__source": str(tmp_path), "model__max_model_len": 4096})
    assert r["model"]["max_model_len"] == 4096
    assert at(hwchecks.hardware_problems(r, s), "model.max_model_len", "error")


def test_not_fitting_is_an_error_with_numbers_and_fix_order():
    ps = problems(
        RT, model__source="meta-llama/Llama-3.1-70B-Instruct", model__quantization=None, model__dtype="bfloat16"
    )
    err = at(ps, "model.quantization", "error")
    assert err and "does not fit on rtx3090" in err[0].message and "21.33 GiB" in err[0].message
    assert "awq_marlin" in err[0].fix and "max_model_len" in err[0].fix
    err = at(problems(RT, engine__gpu_memory_utilization=0.3), "engine.gpu_memory_utilization", "error")
    assert err and "7.11 GiB" in err[0].message
    assert not at(problems(RT, engine__gpu_memory_utilization=0.5), "engine.gpu_memory_utilization")


def test_the_model_facts_are_read_once_for_the_checks_and_the_plan(monkeypatch):
    """hardware_problems reads the model's facts once; the memory plan gets them (no second read)."""
    r, s = load(RT, engine__gpu_memory_utilization=0.3)
    reads = []
    real = hwchecks.catalog.facts_for
    monkeypatch.setattr(hwchecks.catalog, "facts_for", lambda resolved: reads.append(1) or real(resolved))
    assert at(hwchecks.hardware_problems(r, s), "engine.gpu_memory_utilization", "error")  # the plan ran
    assert len(reads) == 1


def test_unknown_gpu_suggests_a_name():
    err = at(problems(RT, hardware__gpu="rtx-3090"), "hardware.gpu", "error")
    assert err and "did you mean `rtx3090`" in err[0].fix


def test_unknown_model_warns_plan_skipped_and_architecture_fixes_it():
    w = at(problems(RT, model__source="someone/finetuned-qwen"), "model.source", "warning")
    assert w and "plan skipped" in w[0].message and "architecture" in w[0].fix
    ps = problems(RT, model__source="someone/finetuned-qwen", model__architecture="qwen2.5-7b-instruct-awq")
    assert not [p for p in ps if "plan skipped" in p.message]


def test_quantization_must_match_the_checkpoint():
    err = at(
        problems(RT, model__source="Qwen/Qwen2.5-7B-Instruct"), "model.quantization", "error"
    )  # awq_marlin on bf16
    assert err and "no quantization_config" in err[0].message
    err = at(problems(RT, model__quantization="gptq_marlin"), "model.quantization", "error")  # AWQ checkpoint
    assert err and "awq-quantized" in err[0].message
