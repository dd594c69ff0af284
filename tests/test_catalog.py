"""The catalogues: lookups, and the shapes checked against the publishers' parameter counts."""

import json

import pytest

from vllm_fleet.specs import catalog

from vllm_fleet.specs import planner


def test_lookup_by_hub_id_is_case_insensitive():
    a = catalog.model("Qwen/Qwen2.5-7B-Instruct")
    b = catalog.model("qwen/qwen2.5-7b-instruct")
    assert a is not None and a == b
    assert (a["layers"], a["hidden"], a["heads"], a["kv_heads"], a["head_dim"]) == (28, 3584, 28, 4, 128)


def test_lookup_by_catalogue_name_and_unknown():
    assert catalog.model("qwen3-32b")["id"] == "Qwen/Qwen3-32B"
    assert catalog.model("Qwen/Qwen2.5-7B-Instruct-AWQ")["quant"] == {
        "method": "awq",
        "bits": 4,
        "group_size": 128,
        "zero_point": True,
    }
    assert catalog.model("no-such/model") is None


def test_required_models_are_present():
    ids = {m["id"] for m in catalog.models()}
    for want in (
        "Qwen/Qwen2.5-7B-Instruct",
        "Qwen/Qwen2.5-7B-Instruct-AWQ",
        "meta-llama/Llama-3.1-8B-Instruct",
        "meta-llama/Llama-3.1-70B-Instruct",
        "meta-llama/Llama-3.1-405B-Instruct",
        "Qwen/Qwen3-32B",
    ):
        assert want in ids


@pytest.mark.parametrize("facts", catalog.models(), ids=lambda f: f["id"])
def test_shape_reproduces_the_published_parameter_count(facts):
    # params_b is the publisher's number (model card); the shape must add up to it within 1 %.
    assert facts["params_b"] and facts["source"]
    assert planner.total_params(facts) / 1e9 == pytest.approx(facts["params_b"], rel=0.01)


def test_gpus():
    assert set(catalog.gpu_names()) >= {
        "rtx3090",
        "rtx4090",
        "a100-40gb",
        "a100-80gb",
        "l40s",
        "h100-80gb",
        "h200",
        "cpu",
    }
    g = catalog.gpu("RTX3090")
    assert (g["compute_capability"], g["bandwidth_gbs"]) == (8.6, 936)  # the 000 article: sm_86, 936 GB/s
    for g in catalog.gpus():
        if g["name"] != "cpu":
            # CUDA reports a little less than the marketed number (GB or GiB alike), never more
            assert 0.9 * g["memory_gb"] < g["cuda_total_gib"] < g["memory_gb"]
            assert g["source"]
    with pytest.raises(KeyError):
        catalog.gpu("rtx-3090")


def test_facts_from_a_local_config_json(tmp_path):
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    f = catalog.read_config_dir(tmp_path)
    assert (f["layers"], f["kv_heads"], f["head_dim"], f["context"], f["quant"]) == (2, 2, 32, 2048, None)
    assert catalog.read_config_dir(tmp_path / "missing") is None


def test_facts_for_prefers_the_uploaded_config_then_architecture(tmp_path):
    resolved = {"model": {"source": str(tmp_path), "transfer": "upload", "local_dir": str(tmp_path / "nope")}}
    facts, how = catalog.facts_for(resolved)
    assert facts is None and "no readable config.json" in how
    resolved["model"]["architecture"] = "Llama-3.1-8B-Instruct"
    facts, how = catalog.facts_for(resolved)
    assert facts["id"] == "meta-llama/Llama-3.1-8B-Instruct" and "model.architecture" in how
