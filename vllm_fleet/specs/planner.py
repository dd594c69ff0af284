"""Memory and KV-cache arithmetic for one deployment on one kind of GPU.

``plan(resolved)`` answers "does it fit, and how much KV cache is left" per GPU, the way vLLM
sizes its KV cache at start-up: it takes ``total GPU memory x gpu_memory_utilization``, subtracts
the weights it loaded and the non-KV memory it profiled, and cuts the rest into 16-token blocks.
The formula, the overhead allowance and how close it comes to the measured numbers are written
down in docs/planner.md.

Nothing here imports pyinfra or touches a host.
"""

from __future__ import annotations

import math
from typing import Any

from vllm_fleet.specs import catalog

GIB = 1024**3
BLOCK_TOKENS = 16  # vLLM's default KV block size on CUDA

# ---- overhead allowance (per GPU), see docs/planner.md ------------------------------------------
# Fixed part of vLLM's non-KV memory that the weights do not explain: memory outside PyTorch's
# allocator that grows during start-up (cuBLAS/cuDNN workspaces, allocator slack, torch.compile
# buffers). Calibrated with CUDA_GRAPHS_GIB so that the 000 article's two RTX 3090 data points
# (BF16: ~4.6 GB KV; AWQ: 15839 blocks) come out within 5 %.
RUNTIME_GIB = 1.0
# CUDA graph pools; vLLM >= 0.21 counts them when sizing the KV cache (gpu-measurements note).
# Not spent with enforce_eager.
CUDA_GRAPHS_GIB = 1.0
# NCCL and custom all-reduce buffers when a server spans more than one GPU (TP x PP > 1).
MULTI_GPU_GIB = 0.5
# Sampler working set per scheduled sequence and vocabulary entry, bytes: fp32 logits, fp32
# probabilities, sorted values (fp32) and sort indices (int64) for top-p/top-k, a temporary.
SAMPLER_BYTES_PER_VOCAB = 24
# vLLM's default token budget per step for the OpenAI server when max_num_batched_tokens is not
# set: 8192 on GPUs with >= 70 GiB that are not A100s, else 2048 (vLLM's EngineArgs defaults).
DEFAULT_BATCHED_TOKENS_BIG, DEFAULT_BATCHED_TOKENS = 8192, 2048

# ---- the CPU tier of the KV cache (engine.kv_offload), see docs/kv-offload.md -----------------
# What a host keeps beside every replica's CPU tier: the OS, sshd, nginx, the page cache the
# weights are read through.
HOST_RESERVE_GIB = 8.0
# Each vLLM replica's own host memory beside its tier: the API server and engine-core processes
# (Python, torch and the CUDA runtime's host side), its pinned staging buffers.
REPLICA_HOST_GIB = 4.0

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
_INT4_METHODS = ("awq", "awq_marlin", "gptq", "gptq_marlin")


def _act_dtype(resolved: dict[str, Any], facts: dict[str, Any]) -> str:
    d = resolved["model"]["dtype"]
    if d in ("auto", None):
        d = facts["torch_dtype"]
        if d == "float32":  # vLLM serves float32 checkpoints in 16 bits by default
            d = "bfloat16"
    return {"half": "float16", "float": "float32"}.get(d, d)


def effective_quant(resolved: dict[str, Any], facts: dict[str, Any]) -> dict[str, Any] | None:
    """The weight quantization that will be loaded: the checkpoint's own, else the spec's."""
    ckpt = facts.get("quant")
    if ckpt:
        return ckpt
    q = resolved["model"].get("quantization")
    if not q:
        return None
    if q == "fp8":
        return {"method": "fp8", "bits": 8, "group_size": None, "zero_point": False}
    if q == "bitsandbytes":  # in-flight 4-bit NF4, blocks of 64 with an fp32 absmax each
        return {"method": "bitsandbytes", "bits": 4, "group_size": 64, "zero_point": False}
    # awq/gptq on a checkpoint without a quantization config: vLLM refuses (a hardware check says
    # so); plan it as unquantized.
    return None


def linear_bytes_per_param(quant: dict[str, Any] | None, act_bytes: int) -> float:
    """Bytes per weight of a quantized linear layer, scales and zero points included."""
    if not quant:
        return float(act_bytes)
    method, bits, group = quant["method"], quant.get("bits") or 16, quant.get("group_size")
    if method == "fp8" or (method == "compressed-tensors" and bits == 8):
        return 1.0  # per-tensor / per-channel scales are negligible
    if method == "bitsandbytes":
        return bits / 8 + (4 / (group or 64) if bits == 4 else 0.0)
    if group and group > 0:
        # packed weights + one fp16 scale and one packed zero point per group and output column
        return bits / 8 + (2 + bits / 8) / group
    return bits / 8


def weight_params(facts: dict[str, Any], tensor: int = 1) -> dict[str, float]:
    """Parameter counts: per decoder layer (linear / other, for one TP rank) and the embeddings."""
    h, hd = facts["hidden"], facts["head_dim"]
    q_out = facts["heads"] * hd
    kv_per_rank = max(1, math.ceil(facts["kv_heads"] / tensor))  # replicated when TP > KV heads
    attn = (h * q_out + q_out * h) / tensor + 2 * h * kv_per_rank * hd
    if facts.get("experts"):
        mlp = facts["experts"] * 3 * h * facts["moe_intermediate"] / tensor + h * facts["experts"]
    else:
        mlp = 3 * h * facts["intermediate"] / tensor  # gated MLP: gate, up, down
    other = 2 * h  # the two RMSNorms
    if facts.get("attention_bias"):
        other += q_out / tensor + 2 * kv_per_rank * hd
    if facts.get("qk_norm"):
        other += 2 * hd
    embed = facts["vocab"] * h / tensor
    return {
        "layer_linear": attn + mlp,
        "layer_other": other,
        "embed": embed,
        "lm_head": 0.0 if facts["tie_embeddings"] else embed,
        "final_norm": h,
    }


def total_params(facts: dict[str, Any]) -> float:
    p = weight_params(facts, 1)
    return facts["layers"] * (p["layer_linear"] + p["layer_other"]) + p["embed"] + p["lm_head"] + p["final_norm"]


def weights_bytes(
    facts: dict[str, Any], quant: dict[str, Any] | None, act_bytes: int, tensor: int = 1, pipeline: int = 1
) -> float:
    """Weight bytes on the fullest GPU: ceil(layers / PP) layers, split by TP, plus the
    embedding (first stage) and the LM head (last stage; with PP = 1 both are on every GPU).
    Embeddings and LM head stay unquantized (AWQ/GPTQ/FP8 checkpoints keep them in 16 bits)."""
    p = weight_params(facts, tensor)
    layers = math.ceil(facts["layers"] / pipeline)
    lin = layers * p["layer_linear"] * linear_bytes_per_param(quant, act_bytes)
    other = layers * p["layer_other"] * act_bytes
    if pipeline == 1:
        ends = (p["embed"] + p["lm_head"] + p["final_norm"]) * act_bytes
    else:  # a tied LM head is a copy of the embedding on the last stage
        ends = (p["embed"] + p["final_norm"]) * act_bytes
    return lin + other + ends


def kv_bytes_per_token(facts: dict[str, Any], kv_bytes: int, tensor: int = 1, pipeline: int = 1) -> int:
    """2 (K and V) x layers x KV heads x head_dim x bytes, for one GPU: layers / PP, KV heads / TP
    (at least 1: heads are replicated when TP > KV heads)."""
    layers = math.ceil(facts["layers"] / pipeline)
    kv_heads = max(1, math.ceil(facts["kv_heads"] / tensor))
    return 2 * layers * kv_heads * facts["head_dim"] * kv_bytes


def kv_dtype_bytes(kv_cache_dtype: str, act_bytes: int) -> int:
    if kv_cache_dtype.startswith("fp8") or kv_cache_dtype == "int8":
        return 1
    return act_bytes


def default_batched_tokens(g: dict[str, Any]) -> int:
    total = g.get("cuda_total_gib") or 0
    return DEFAULT_BATCHED_TOKENS_BIG if total >= 70 and not g["name"].startswith("a100") else DEFAULT_BATCHED_TOKENS


def overhead(
    facts: dict[str, Any], resolved: dict[str, Any], g: dict[str, Any], act_bytes: int, tensor: int, pipeline: int
) -> dict[str, float]:
    """The non-KV, non-weight memory allowance per GPU, in GiB, by part."""
    e = resolved["engine"]
    tokens = e.get("max_num_batched_tokens") or default_batched_tokens(g)
    if not e["enable_chunked_prefill"]:
        tokens = max(tokens, resolved["model"]["max_model_len"])
    inter = facts["intermediate"]
    # one layer's live tensors at the peak: residual + normed input + attention output + q/k/v
    # (~4 x hidden) and the MLP's gate/up output and activation (3 x intermediate / TP)
    act = tokens * (4 * facts["hidden"] + 3 * inter / tensor) * act_bytes
    sampler = e["max_num_seqs"] * facts["vocab"] * SAMPLER_BYTES_PER_VOCAB
    parts = {
        "runtime": RUNTIME_GIB,
        "cuda_graphs": 0.0 if e.get("enforce_eager") else CUDA_GRAPHS_GIB,
        "multi_gpu": MULTI_GPU_GIB if tensor * pipeline > 1 else 0.0,
        "activations": act / GIB,
        "sampler": sampler / GIB,
        "batched_tokens": tokens,
    }
    return parts


def replicas_per_gpu(resolved: dict[str, Any]) -> int:
    """How many vLLMs share each GPU group (replicas.per_gpu)."""
    return int(resolved["replicas"]["per_gpu"])


def replica_gpu_utilization(resolved: dict[str, Any]) -> float:
    """``--gpu-memory-utilization`` of one vLLM: engine.gpu_memory_utilization split between the
    replicas.per_gpu replicas sharing its GPUs (vLLM reads it as a share of the whole GPU)."""
    util = float(resolved["engine"]["gpu_memory_utilization"])
    n = replicas_per_gpu(resolved)
    return util if n == 1 else round(util / n, 4)


def shares_fit_one_gpu(shares: list[float]) -> bool:
    """Whether vLLMs with these --gpu-memory-utilization shares fit on one GPU together: each
    takes its share of the whole GPU at start, so they sum to at most 1 (the layout's check of one
    deploy, and the clash check against deployments already on a host)."""
    return sum(shares) <= 1.0 + 1e-9


def kv_offload_tokens(gib: float, per_tok_gpu: int, tensor: int, pipeline: int) -> int:
    """Tokens a replica's CPU tier of ``gib`` GiB holds: the tier is the replica's whole (vLLM
    splits it between its ranks), a token takes its KV bytes on every GPU of the replica."""
    return int(gib * GIB // (per_tok_gpu * tensor * pipeline))


def host_memory(mem_total_bytes: int, tiers: list[tuple[str, float | str | None]]) -> dict[str, Any]:
    """Whether the CPU tiers of every vLLM replica on one host fit in its RAM.

    ``tiers``: one ``(unit, GiB)`` per replica on the host, every deployment's (None: no tier;
    ``"auto"``: what is left, split evenly between the ``auto`` replicas). The host keeps
    :data:`HOST_RESERVE_GIB` plus :data:`REPLICA_HOST_GIB` per replica. Returns ``total_gib``,
    ``reserve_gib``, ``fixed_gib`` (the numbered tiers), ``left_gib`` (after reserve and the
    numbered tiers), ``auto_gib`` (each ``auto`` replica's whole GiB, None without one) and ``fits``.
    """
    total = mem_total_bytes / GIB
    reserve = HOST_RESERVE_GIB + REPLICA_HOST_GIB * len(tiers)
    fixed = sum(float(g) for _, g in tiers if g not in (None, "auto"))
    autos = [u for u, g in tiers if g == "auto"]
    left = total - reserve - fixed
    auto_each = math.floor(left / len(autos)) if autos else None
    fits = left >= 0 and (auto_each is None or auto_each >= 1)
    return {
        "total_gib": round(total, 2),
        "reserve_gib": reserve,
        "fixed_gib": round(fixed, 2),
        "left_gib": round(left, 2),
        "auto_gib": auto_each,
        "replicas": len(tiers),
        "fits": fits,
    }


def _plan_gpu(resolved: dict[str, Any], gpu: str | None) -> dict[str, Any]:
    """The catalogue entry of the GPU planned for: ``gpu``, else hardware.gpu (cpu for the CPU build)."""
    gname = gpu or resolved["hardware"].get("gpu") or ("cpu" if resolved["install"]["accelerator"] == "cpu" else None)
    if not gname:
        raise ValueError("no GPU named: set hardware.gpu or pass --gpu (see `vllm-fleet plan --list-gpus`)")
    try:
        return catalog.gpu(gname)
    except KeyError:
        raise KeyError(f"unknown GPU {gname!r}; known: {', '.join(catalog.gpu_names())}") from None


def _plan_settings(resolved: dict[str, Any], g: dict[str, Any], how: str, gpus_per_node: int | None) -> dict[str, Any]:
    """The plan's first keys: what is planned (GPU, model, parallelism, the engine's limits)."""
    m, e, par, hw = resolved["model"], resolved["engine"], resolved["parallel"], resolved["hardware"]
    return {
        "gpu": g["name"],
        "gpu_label": g["label"],
        "model": m["source"],
        "model_facts": how,
        "tensor": par["tensor"],
        "pipeline": par["pipeline"],
        "data": par["data"],
        "gpus_per_node": gpus_per_node or hw["gpus_per_node"],
        "nodes": par["nodes"],
        "max_model_len": m["max_model_len"],
        "max_num_seqs": e["max_num_seqs"],
        "gpu_memory_utilization": e["gpu_memory_utilization"],
        "kv_cache_dtype": e["kv_cache_dtype"],
        "replicas_per_gpu": replicas_per_gpu(resolved),
        "block_tokens": BLOCK_TOKENS,
        "notes": [],
    }


def _plan_skipped(out: dict[str, Any], resolved: dict[str, Any], cpu: bool, how: str) -> dict[str, Any]:
    """Without model facts: every figure unknown (the CPU build's KV cache is still its setting)."""
    e = resolved["engine"]
    out.update(
        kv_offload_gib=None if cpu or not e["kv_offload"]["size_gib"] else e["kv_offload"]["size_gib"],
        kv_offload_tokens=None,
    )
    out.update(
        weights_gib=None,
        overhead_gib=None,
        kv_bytes_per_token=None,
        kv_bytes_per_token_model=None,
        kv_tokens=None,
        kv_blocks=None,
        max_concurrent_seqs=None,
        fits=None,
        decode_floor_ms=None,
        kv_cache_gib=float(e["cpu_kv_cache_gib"]) if cpu else None,
    )
    out["notes"].append(
        f"plan skipped: no model facts ({how}); set model.architecture to a catalogue name "
        f"(vllm-fleet plan --list-models) or make config.json readable"
    )
    return out


def _cpu_kv_bytes(out: dict[str, Any], resolved: dict[str, Any]) -> float:
    """The CPU build's KV cache: its own setting, in host memory."""
    out.update(memory_gib=None, budget_gib=None, overhead_gib=None, overhead_parts=None, decode_floor_ms=None)
    out["notes"].append(
        "CPU build: the KV cache is engine.cpu_kv_cache_gib GiB of host memory (VLLM_CPU_KVCACHE_SPACE); weights and "
        "activations live in host memory beside it"
    )
    return float(resolved["engine"]["cpu_kv_cache_gib"]) * GIB


def _gpu_kv_bytes(
    out: dict[str, Any],
    resolved: dict[str, Any],
    facts: dict[str, Any],
    g: dict[str, Any],
    act_bytes: int,
    w_gpu: float,
) -> float:
    """The KV cache on one GPU: its share of the memory (the utilization, split between the
    replicas.per_gpu vLLMs sharing it, as render.command passes --gpu-memory-utilization) less
    the weights and the overhead."""
    tp, pp = out["tensor"], out["pipeline"]
    parts = overhead(facts, resolved, g, act_bytes, tp, pp)
    ov = sum(v for k, v in parts.items() if k != "batched_tokens")
    share = replica_gpu_utilization(resolved)
    out["gpu_memory_utilization_per_replica"] = share
    budget = g["cuda_total_gib"] * share
    kv_gib = budget - w_gpu / GIB - ov
    out.update(
        memory_gib=g["cuda_total_gib"],
        budget_gib=round(budget, 2),
        overhead_gib=round(ov, 2),
        overhead_parts={k: (round(v, 2) if k != "batched_tokens" else v) for k, v in parts.items()},
        # each decode step reads every weight once: bytes on one GPU / its bandwidth
        decode_floor_ms=round(w_gpu / (g["bandwidth_gbs"] * 1e9) * 1e3 * pp, 2),
    )
    if kv_gib <= 0:
        out["notes"].append(
            f"weights {w_gpu / GIB:.2f} GiB + overhead {ov:.2f} GiB exceed the budget {budget:.2f} GiB "
            f"({g['cuda_total_gib']} GiB x {share})"
        )
    return max(0.0, kv_gib) * GIB


def _kv_capacity(out: dict[str, Any], resolved: dict[str, Any], kv_bytes: float, per_tok: int) -> None:
    """The KV cache in 16-token blocks, how many full sequences fit, and whether one does."""
    m, e, notes = resolved["model"], resolved["engine"], out["notes"]
    blocks = int(kv_bytes // (BLOCK_TOKENS * per_tok))
    tokens = blocks * BLOCK_TOKENS
    out.update(
        kv_cache_gib=round(kv_bytes / GIB, 2),
        kv_blocks=blocks,
        kv_tokens=tokens,
        max_concurrent_seqs=tokens // m["max_model_len"],
        max_concurrency=round(tokens / m["max_model_len"], 2),
    )
    out["fits"] = tokens >= m["max_model_len"]
    if 0 < tokens < m["max_model_len"]:
        notes.append(
            f"the KV cache holds {tokens} tokens, less than one sequence of max_model_len {m['max_model_len']}: vLLM "
            "refuses to start"
        )
    if out["fits"] and out["max_concurrent_seqs"] < e["max_num_seqs"]:
        notes.append(
            f"only {out['max_concurrent_seqs']} sequences of the full {m['max_model_len']} tokens fit at once "
            f"(max_num_seqs {e['max_num_seqs']}): long requests beyond that queue or are preempted"
        )


def _kv_offload(out: dict[str, Any], resolved: dict[str, Any], per_tok: int, cpu: bool) -> None:
    """The CPU tier per replica (engine.kv_offload): GiB and tokens, and what the host needs for it."""
    size = resolved["engine"]["kv_offload"]["size_gib"]
    out["kv_offload_gib"] = None if cpu or not size else size
    out["kv_offload_tokens"] = None
    if out["kv_offload_gib"] is None:
        return
    n = int(resolved["replicas"]["per_host"])
    if size == "auto":
        out["notes"].append(
            f"KV offload `auto`: each replica's CPU tier is what the host's RAM has left after the reserve "
            f"({HOST_RESERVE_GIB:g} GiB + {REPLICA_HOST_GIB:g} GiB per replica) and the other replicas' tiers, "
            "read at deploy"
        )
        return
    out["kv_offload_tokens"] = kv_offload_tokens(float(size), per_tok, out["tensor"], out["pipeline"])
    need = HOST_RESERVE_GIB + n * (REPLICA_HOST_GIB + float(size))
    out["kv_offload_host_gib"] = need
    out["notes"].append(
        f"KV offload: {n} replica(s) per host x ({float(size):g} GiB tier + {REPLICA_HOST_GIB:g} GiB) + "
        f"{HOST_RESERVE_GIB:g} GiB reserve = {need:g} GiB of host RAM needed (checked against each host's RAM at "
        "deploy)"
    )


def plan(
    resolved: dict[str, Any],
    gpu: str | None = None,
    gpus_per_node: int | None = None,
    facts: tuple[dict[str, Any] | None, str] | None = None,
) -> dict[str, Any]:
    """The memory plan per GPU for a resolved spec. Raises KeyError for an unknown GPU name.
    ``facts``: the model's ``(facts, how)`` when the caller has read them (catalog.facts_for).

    Keys: gpu, model, tensor, pipeline, data, weights_gib, overhead_gib, kv_cache_gib,
    kv_bytes_per_token (per GPU), kv_bytes_per_token_model (all layers and heads), kv_tokens,
    kv_blocks, max_concurrent_seqs (of full max_model_len), fits (True/False, None when the model
    is unknown), decode_floor_ms (weights bytes / bandwidth), notes.
    """
    g = _plan_gpu(resolved, gpu)
    facts, how = facts if facts is not None else catalog.facts_for(resolved)
    out = _plan_settings(resolved, g, how, gpus_per_node)
    tp, pp = out["tensor"], out["pipeline"]
    cpu = g["name"] == "cpu"
    if facts is None:
        return _plan_skipped(out, resolved, cpu, how)

    act_dtype = _act_dtype(resolved, facts)
    act_bytes = _DTYPE_BYTES.get(act_dtype, 2)
    quant = effective_quant(resolved, facts)
    kvb = kv_dtype_bytes(out["kv_cache_dtype"], act_bytes)
    w_gpu = weights_bytes(facts, quant, act_bytes, tp, pp)
    per_tok = kv_bytes_per_token(facts, kvb, tp, pp)
    out.update(
        dtype=act_dtype,
        quantization=resolved["model"].get("quantization") or (quant or {}).get("method"),
        params_b=round(total_params(facts) / 1e9, 2),
        weights_gib=round(w_gpu / GIB, 2),
        weights_total_gib=round(weights_bytes(facts, quant, act_bytes, 1, 1) / GIB, 2),
        kv_bytes_per_token=per_tok,
        kv_bytes_per_token_model=kv_bytes_per_token(facts, kvb, 1, 1),
        model_context=facts["context"],
    )
    kv_bytes = _cpu_kv_bytes(out, resolved) if cpu else _gpu_kv_bytes(out, resolved, facts, g, act_bytes, w_gpu)
    _kv_capacity(out, resolved, kv_bytes, per_tok)
    _kv_offload(out, resolved, per_tok, cpu)
    if facts.get("experts"):
        out["notes"].append("mixture-of-experts model: weights and activations are rough estimates")
    if quant and quant["method"] == "bitsandbytes":
        out["notes"].append("bitsandbytes weights are an estimate (4-bit NF4, 64-value blocks)")
    return out


# ---------------------------------------------------------------------------------------------
# text


def format_plan(p: dict[str, Any]) -> str:
    """A readable table of a plan, for the CLI."""

    def gib(v: Any) -> str:
        return "-" if v is None else f"{v:.2f} GiB"

    par = f"TP {p['tensor']} x PP {p['pipeline']}" + (f" x DP {p['data']}" if p["data"] > 1 else "")
    rows = [
        (
            "model",
            f"{p['model']}"
            + (
                f"  ({p.get('params_b')}B params, {p.get('dtype')}"
                + (f", {p['quantization']}" if p.get("quantization") else "")
                + ")"
                if p.get("params_b")
                else ""
            ),
        ),
        ("facts from", p.get("model_facts", "-")),
        ("GPU", f"{p['gpu']} ({p['gpu_label']})" + (f": {p['memory_gib']} GiB visible" if p.get("memory_gib") else "")),
        ("parallelism", par),
    ]
    if p.get("budget_gib") is not None:
        n = p.get("replicas_per_gpu", 1)
        if n > 1:
            rows.append(
                (
                    "replicas per GPU",
                    f"{n}: each vLLM {p['memory_gib']} GiB x {p['gpu_memory_utilization']} / {n} = "
                    f"{p['budget_gib']:.2f} GiB (weights + overhead + KV below); together {p['budget_gib'] * n:.2f} "
                    f"GiB of {p['memory_gib']} GiB",
                )
            )
        else:
            rows.append(
                ("budget per GPU", f"{p['memory_gib']} GiB x {p['gpu_memory_utilization']} = {p['budget_gib']:.2f} GiB")
            )
    unit = "replica" if p.get("replicas_per_gpu", 1) > 1 else "GPU"
    rows.append(
        (
            f"weights per {unit}",
            gib(p.get("weights_gib"))
            + (
                f"  (whole model {p['weights_total_gib']:.2f} GiB)"
                if p.get("weights_total_gib") is not None and (p["tensor"] * p["pipeline"] > 1)
                else ""
            ),
        )
    )
    if p.get("overhead_parts"):
        op = p["overhead_parts"]
        rows.append(
            (
                "overhead allowance",
                f"{gib(p['overhead_gib'])}  (runtime {op['runtime']}, CUDA graphs {op['cuda_graphs']}, "
                f"multi-GPU {op['multi_gpu']}, activations {op['activations']} @ {op['batched_tokens']} tokens, "
                f"sampler {op['sampler']})",
            )
        )
    rows.append((f"KV cache per {unit}", gib(p.get("kv_cache_gib"))))
    if p.get("kv_offload_gib") is not None:
        tier = (
            "auto (sized per host at deploy)"
            if p["kv_offload_gib"] == "auto"
            else f"{float(p['kv_offload_gib']):.2f} GiB"
        )
        if p.get("kv_offload_tokens") is not None:
            tier += f" = {p['kv_offload_tokens']:,} tokens"
        rows.append(("CPU KV tier / replica", tier + " in host RAM (engine.kv_offload)"))
    if p.get("kv_bytes_per_token") is not None:
        rows.append(
            (
                "KV bytes / token",
                f"{p['kv_bytes_per_token']:,} per GPU ({p['kv_bytes_per_token_model']:,} for the whole model, "
                f"{p['kv_cache_dtype']})",
            )
        )
        rows.append(("KV capacity", f"{p['kv_tokens']:,} tokens = {p['kv_blocks']:,} blocks of {p['block_tokens']}"))
        rows.append(
            (
                "full-length seqs",
                f"{p['max_concurrent_seqs']} x {p['max_model_len']} tokens at once (max_num_seqs {p['max_num_seqs']})",
            )
        )
    if p.get("decode_floor_ms") is not None:
        rows.append(
            ("decode floor", f"{p['decode_floor_ms']} ms / output token (weights read once per step at full bandwidth)")
        )
    fits = p.get("fits")
    rows.append(("fits", "unknown" if fits is None else "yes" if fits else "NO"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines += [f"note: {n}" for n in p.get("notes", [])]
    return "\n".join(lines)


def list_models() -> str:
    rows = [("hub id", "name", "layers", "hidden", "heads/kv", "context", "quant", "params")]
    for f in catalog.models():
        q = f["quant"]
        rows.append(
            (
                f["id"],
                f["name"],
                str(f["layers"]),
                str(f["hidden"]),
                f"{f['heads']}/{f['kv_heads']}",
                str(f["context"]),
                f"{q['method']} w{q['bits']} g{q['group_size']}" if q else "-",
                f"{f['params_b']}B",
            )
        )
    return _table(rows) + "\nUse a hub id as model.source, or a name as model.architecture for a local or renamed copy."


def list_gpus() -> str:
    rows = [("name", "GPU", "GiB (CUDA)", "compute cap.", "bandwidth")]
    for g in catalog.gpus():
        if g["name"] == "cpu":
            rows.append(("cpu", g["label"], "engine.cpu_kv_cache_gib", "-", "-"))
            continue
        rows.append(
            (
                g["name"],
                g["label"],
                f"{g['cuda_total_gib']}",
                f"{g['compute_capability']}",
                f"{g['bandwidth_gbs']} GB/s",
            )
        )
    return _table(rows)


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
