"""Planner arithmetic, checked against hand computations and the measured / published numbers.

Hand computations use the config.json numbers written out here, not the code under test.
"""

import pytest

from vllm_fleet.specs import planner

from vllm_fleet.specs import load as spec
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

GIB = 1024**3


def resolved(name, **changes):
    r = spec.resolve(spec.load(REPO / "deployments" / name))
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        r[section][key] = value
    return r


# ---- Qwen2.5-7B by hand ----------------------------------------------------------------------
# hidden 3584, intermediate 18944, 28 layers, 28 heads x 128, 4 KV heads x 128, vocab 152064
# per layer: q 3584*3584 + k,v 2*3584*512 + o 3584*3584 = 29,360,128; MLP 3*3584*18944 = 203,685,888
QWEN_LINEAR = 28 * (29_360_128 + 203_685_888)  # 6,525,288,448
QWEN_OTHER = 28 * (2 * 3584 + 3584 + 2 * 512) + 3584  # norms + q/k/v biases per layer + final norm
QWEN_EMBED = 2 * 152_064 * 3584  # untied embedding + LM head
QWEN_KV_PER_TOKEN = 2 * 28 * 4 * 128 * 2  # 57,344 bytes in bf16 / fp16


def test_qwen7b_bf16_weights_and_kv_by_hand():
    p = planner.plan(
        resolved(
            "rtx3090-qwen7b-awq-realtime.yaml",
            model__source="Qwen/Qwen2.5-7B-Instruct",
            model__quantization=None,
            model__dtype="bfloat16",
        )
    )
    hand = (QWEN_LINEAR + QWEN_OTHER + QWEN_EMBED) * 2 / GIB  # 14.18 GiB
    assert p["weights_gib"] == pytest.approx(hand, abs=0.01)
    assert p["kv_bytes_per_token"] == QWEN_KV_PER_TOKEN == 57_344
    # measured: vLLM loaded 14.25 GiB for this model on an H200 (gpu-measurements note)
    assert p["weights_gib"] == pytest.approx(14.25, rel=0.02)


def test_qwen7b_awq_weights_by_hand():
    p = planner.plan(resolved("rtx3090-qwen7b-awq-realtime.yaml"))
    # int4 weights (0.5 B) + one fp16 scale (2 B) and one 4-bit zero (0.5 B) per 128 weights; rest fp16
    hand = (QWEN_LINEAR * (0.5 + 2.5 / 128) + (QWEN_OTHER + QWEN_EMBED) * 2) / GIB  # 5.19 GiB
    assert p["weights_gib"] == pytest.approx(hand, abs=0.01)
    # measured: 5.2 GiB (awq) / 5.29 GiB (awq_marlin) loaded on an H200
    assert p["weights_gib"] == pytest.approx(5.29, rel=0.03)


def test_llama8b_bf16_weights_match_measurement():
    p = planner.plan(
        resolved(
            "rtx3090-qwen7b-awq-realtime.yaml",
            model__source="meta-llama/Llama-3.1-8B-Instruct",
            model__quantization=None,
            model__dtype="bfloat16",
            hardware__gpu="h200",
        )
    )
    # 32 layers x (4096*4096*2 + 2*4096*1024 + 3*4096*14336) + 2 * 128256*4096, bf16
    hand = (32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 2 * 128_256 * 4096) * 2 / GIB
    assert p["weights_gib"] == pytest.approx(hand, rel=0.001)
    assert p["weights_gib"] == pytest.approx(14.99, rel=0.01)  # measured on the H200


def test_realtime_3090_awq_kv_budget_by_hand():
    p = planner.plan(resolved("rtx3090-qwen7b-awq-realtime.yaml"))
    weights = (QWEN_LINEAR * (0.5 + 2.5 / 128) + (QWEN_OTHER + QWEN_EMBED) * 2) / GIB
    # allowance: runtime 1 + CUDA graphs 1 + activations 2048 tokens x (4*3584 + 3*18944) x 2 B
    #            + sampler 16 seqs x 152064 x 24 B
    overhead = 1 + 1 + 2048 * (4 * 3584 + 3 * 18944) * 2 / GIB + 16 * 152_064 * 24 / GIB
    kv = 23.70 * 0.90 - weights - overhead
    assert p["overhead_gib"] == pytest.approx(overhead, abs=0.01)
    assert p["kv_cache_gib"] == pytest.approx(kv, abs=0.01)
    assert p["kv_blocks"] == int(kv * GIB // (16 * 57_344))
    assert p["kv_tokens"] == p["kv_blocks"] * 16
    assert p["max_concurrent_seqs"] == p["kv_tokens"] // 4096
    assert p["fits"] is True
    # decode floor: every weight byte read once per token at 936 GB/s
    assert p["decode_floor_ms"] == pytest.approx(weights * GIB / 936e9 * 1e3, abs=0.01)


def test_article_000_sanity():
    """The 000 article, RTX 3090 at 0.90: BF16 weights ~14 GB leave ~4.6 GB of KV cache; AWQ
    leaves about 3x that; the AWQ case had 15839 blocks. Tolerances: 10 % (KV GiB), 5 % (blocks)."""
    bf16 = planner.plan(
        resolved(
            "rtx3090-qwen7b-awq-realtime.yaml",
            model__source="Qwen/Qwen2.5-7B-Instruct",
            model__quantization=None,
            model__dtype="bfloat16",
        )
    )
    awq = planner.plan(resolved("rtx3090-qwen7b-awq-realtime.yaml"))
    assert bf16["weights_gib"] == pytest.approx(14, rel=0.05)
    assert bf16["kv_cache_gib"] == pytest.approx(4.6, rel=0.10)
    assert 2.5 < awq["kv_cache_gib"] / bf16["kv_cache_gib"] < 3.5
    assert awq["kv_blocks"] == pytest.approx(15_839, rel=0.05)


def test_tensor_and_pipeline_split():
    p = planner.plan(resolved("2node-ray-pp2.yaml"))  # Llama-3.1-70B, TP 2 x PP 2
    # 80 layers / PP 2 = 40 per GPU; 8 KV heads / TP 2 = 4; bf16
    assert p["kv_bytes_per_token"] == 2 * 40 * 4 * 128 * 2 == 81_920
    assert p["kv_bytes_per_token_model"] == 2 * 80 * 8 * 128 * 2
    # whole model bf16: 70.55B params x 2 B = 131.4 GiB (the spec's comment says ~132 GiB)
    assert p["weights_total_gib"] == pytest.approx(131.4, abs=0.2)
    per_layer = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672
    hand = (40 * per_layer / 2 + 128_256 * 8192 / 2) * 2 / GIB  # 40 layers and the embedding, halved by TP
    assert p["weights_gib"] == pytest.approx(hand, rel=0.002)
    assert p["fits"]


def test_fp8_weights_and_kv_on_tp4():
    p = planner.plan(resolved("4xh100-qwen32b-tp4.yaml"))  # Qwen3-32B, fp8 weights, fp8 KV, TP 4
    assert p["kv_bytes_per_token"] == 2 * 64 * (8 // 4) * 128 * 1 == 32_768
    linear = 64 * (5120 * 8192 * 2 + 2 * 5120 * 1024 + 3 * 5120 * 25600)
    hand = (linear * 1 + 2 * 151_936 * 5120 * 2) / 4 / GIB  # fp8 linears; bf16 embedding + LM head
    assert p["weights_gib"] == pytest.approx(hand, rel=0.002)
    assert p["fits"]


def test_kv_heads_replicated_when_tp_exceeds_them():
    p = planner.plan(resolved("rtx3090-qwen7b-awq-realtime.yaml", parallel__tensor=8, hardware__gpus_per_node=8))
    assert p["kv_bytes_per_token"] == 2 * 28 * 1 * 128 * 2  # 4 KV heads over 8 GPUs: 1 head each


def test_enforce_eager_frees_the_graph_allowance():
    a = planner.plan(resolved("rtx3090-qwen7b-awq-realtime.yaml"))
    b = planner.plan(resolved("rtx3090-qwen7b-awq-realtime.yaml", engine__enforce_eager=True))
    assert b["kv_cache_gib"] - a["kv_cache_gib"] == pytest.approx(planner.CUDA_GRAPHS_GIB, abs=0.011)


def test_does_not_fit():
    p = planner.plan(
        resolved(
            "rtx3090-qwen7b-awq-realtime.yaml",
            model__source="meta-llama/Llama-3.1-70B-Instruct",
            model__quantization=None,
            model__dtype="bfloat16",
        )
    )
    assert p["fits"] is False and p["kv_cache_gib"] == 0 and p["kv_tokens"] == 0
    assert "exceed the budget" in " ".join(p["notes"])


def test_gpu_override_and_unknown_gpu():
    p = planner.plan(resolved("rtx3090-qwen7b-awq-realtime.yaml"), gpu="h200")
    assert p["gpu"] == "h200" and p["memory_gib"] == 139.8
    with pytest.raises(KeyError):
        planner.plan(resolved("rtx3090-qwen7b-awq-realtime.yaml"), gpu="gtx1080")


def test_cpu_reports_the_cpu_kv_cache(tmp_path):
    r = resolved("lab-tiny.yaml")
    r["model"]["local_dir"] = str(tmp_path)  # hermetic: the real tiny model may be built already
    p = planner.plan(r)
    assert p["gpu"] == "cpu" and p["kv_cache_gib"] == 1.0 and p["fits"] is None  # no config.json yet
    assert "plan skipped" in p["notes"][0]
    (tmp_path / "config.json").write_text(
        '{"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, '
        '"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, '
        '"vocab_size": 512, "max_position_embeddings": 2048}'
    )
    r["model"]["local_dir"] = str(tmp_path)
    p = planner.plan(r)
    assert p["kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 2  # 512 bytes
    assert p["kv_tokens"] == GIB // 512 // 16 * 16 and p["fits"] is True


def test_format_and_lists():
    text = planner.format_plan(planner.plan(resolved("rtx3090-qwen7b-awq-realtime.yaml")))
    assert "KV cache per GPU" in text and "57,344" in text and "fits" in text
    assert "Qwen/Qwen3-32B" in planner.list_models()
    assert "h100-80gb" in planner.list_gpus() and "3350 GB/s" in planner.list_gpus()


# ---- measured on an H200 with vLLM 0.20.2 (bench/results/, docs/gpu-proof.md) -----------------
# "GPU KV cache size: N tokens" and "Available KV cache memory: X GiB" as vLLM logged them at start
# for the specs in deployments/ (random weights of the real shape, realtime profile, CUDA graphs).
H200_MEASURED = {
    "h200-qwen7b-bf16.yaml": (2_062_144, 110.13),
    "h200-qwen7b-awq.yaml": (2_230_064, 119.10),
    "h200-qwen7b-bf16-tp2.yaml": (4_398_400, 117.45),  # tokens for the TP group; GiB per GPU
}


@pytest.mark.parametrize("name", sorted(H200_MEASURED))
def test_h200_kv_capacity_matches_vllm(name):
    tokens, gib = H200_MEASURED[name]
    p = planner.plan(resolved(name))
    assert p["kv_tokens"] == pytest.approx(tokens, rel=0.05)
    assert p["kv_cache_gib"] == pytest.approx(gib, rel=0.05)
    # the planner errs on the safe side: it never promises more KV cache than vLLM found
    assert p["kv_tokens"] <= tokens
