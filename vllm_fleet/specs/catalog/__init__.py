"""Model and GPU catalogues: the facts the planner and the hardware checks need.

``models.json`` holds, per model, the fields of its ``config.json`` that memory arithmetic needs
(layers, hidden size, attention and KV heads, head_dim, intermediate size, vocabulary, context,
tied embeddings, quantization config) and where each number came from. ``gpus.json`` holds, per
GPU, the memory CUDA reports (what vLLM's ``gpu_memory_utilization`` multiplies), the compute
capability and the memory bandwidth, with sources.

Lookup API (all case-insensitive):

- :func:`gpu` / :func:`gpu_names` / :func:`gpus`
- :func:`model` (by hub id such as ``Qwen/Qwen2.5-7B-Instruct`` or catalogue name such as
  ``qwen2.5-7b-instruct``) / :func:`models`
- :func:`from_config` (normalise a ``config.json`` mapping) / :func:`read_config_dir`
- :func:`facts_for` (the facts for a resolved spec: local ``config.json`` of an uploaded model
  first, then ``model.architecture``, then ``model.source`` as a hub id)

Nothing here imports pyinfra or touches a host.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent


@lru_cache(maxsize=1)
def _gpus() -> dict[str, dict[str, Any]]:
    data = json.loads((_HERE / "gpus.json").read_text())
    return {g["name"]: g for g in data["gpus"]}


@lru_cache(maxsize=1)
def _models() -> list[dict[str, Any]]:
    return json.loads((_HERE / "models.json").read_text())["models"]


def gpu_names() -> list[str]:
    return list(_gpus())


def gpus() -> list[dict[str, Any]]:
    return [dict(g) for g in _gpus().values()]


def gpu(name: str) -> dict[str, Any]:
    """The GPU entry named ``name`` (case-insensitive); KeyError if unknown."""
    key = (name or "").strip().lower()
    table = _gpus()
    if key not in table:
        raise KeyError(name)
    return dict(table[key])


def models() -> list[dict[str, Any]]:
    return [from_config(m, source=f"catalogue: {m['id']}", catalogue_entry=m) for m in _models()]


def model_names() -> list[str]:
    return [m["id"] for m in _models()] + [m["name"] for m in _models()]


def model(name: str) -> dict[str, Any] | None:
    """Normalised facts for a catalogue model, by hub id or catalogue name; None if unknown."""
    key = (name or "").strip().rstrip("/").lower()
    for m in _models():
        if key in (m["id"].lower(), m["name"].lower()):
            return from_config(m, source=f"catalogue: {m['id']}", catalogue_entry=m)
    return None


# ---------------------------------------------------------------------------------------------
# config.json -> normalised facts

_DTYPE_NAMES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}


def _quant(cfg: dict[str, Any]) -> dict[str, Any] | None:
    q = cfg.get("quantization_config")
    if not isinstance(q, dict):
        return None
    method = str(q.get("quant_method") or "").lower() or None
    bits = q.get("bits", q.get("w_bit"))
    group = q.get("group_size", q.get("q_group_size"))
    if method == "compressed-tensors":
        groups = q.get("config_groups") or {}
        for grp in groups.values():
            w = (grp or {}).get("weights") or {}
            bits = bits or w.get("num_bits")
            group = group or w.get("group_size")
            break
    if method == "fp8":
        bits = bits or 8
    if method == "bitsandbytes":
        bits = 4 if q.get("load_in_4bit") else 8 if q.get("load_in_8bit") else bits
    return {
        "method": method,
        "bits": int(bits) if bits else None,
        "group_size": int(group) if group not in (None, "") else None,
        "zero_point": bool(q.get("zero_point", not q.get("sym", True))),
    }


def from_config(cfg: dict[str, Any], source: str, catalogue_entry: dict[str, Any] | None = None) -> dict[str, Any]:
    """Normalise a Hugging Face ``config.json`` mapping (or a catalogue entry) into planner facts.

    Raises ValueError when a field the arithmetic needs is missing.
    """
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else None
    c = {**cfg, **text} if text else cfg
    missing = [
        k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size") if c.get(k) in (None, 0)
    ]
    if missing:
        raise ValueError(f"config lacks {', '.join(missing)}")
    heads = int(c["num_attention_heads"])
    hidden = int(c["hidden_size"])
    head_dim = int(c.get("head_dim") or hidden // heads)
    experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
    arch = (c.get("architectures") or [None])[0] if isinstance(c.get("architectures"), list) else c.get("architecture")
    dtype = _DTYPE_NAMES.get(str(c.get("torch_dtype") or c.get("dtype") or "bfloat16").lower(), "bfloat16")
    facts = {
        "id": (catalogue_entry or {}).get("id"),
        "name": (catalogue_entry or {}).get("name"),
        "architecture": arch,
        "layers": int(c["num_hidden_layers"]),
        "hidden": hidden,
        "heads": heads,
        "kv_heads": int(c.get("num_key_value_heads") or heads),
        "head_dim": head_dim,
        "intermediate": int(c.get("intermediate_size") or 4 * hidden),
        "vocab": int(c["vocab_size"]),
        "context": int(c["max_position_embeddings"]) if c.get("max_position_embeddings") else None,
        "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
        "attention_bias": bool(c.get("attention_bias", str(c.get("model_type", "")).startswith("qwen2"))),
        "qk_norm": bool(c.get("qk_norm", str(c.get("model_type", "")) in ("qwen3", "qwen3_moe"))),
        "torch_dtype": dtype,
        "quant": _quant(c),
        "experts": experts,
        "moe_intermediate": int(c.get("moe_intermediate_size") or c.get("intermediate_size") or 0) if experts else 0,
        "params_b": (catalogue_entry or {}).get("params_b"),
        "source": source,
    }
    return facts


def read_config_dir(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Facts from ``DIR/config.json``; None when the file is not there or not a usable config."""
    path = Path(os.path.expanduser(str(directory))) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    try:
        return from_config(cfg, source=f"config.json: {path}")
    except (ValueError, TypeError):
        return None


def facts_for(resolved: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """(facts, how they were found) for a resolved spec; facts is None with the reason otherwise.

    Order: the uploaded model's own ``config.json`` (it is the checkpoint that will be served),
    then ``model.architecture``, then ``model.source`` as a catalogue hub id.
    """
    m = resolved["model"]
    tried = []
    local = m.get("local_dir") or (
        m["source"] if m.get("transfer") == "none" and m["source"].startswith(("/", "~")) else None
    )
    if local:
        facts = read_config_dir(local)
        if facts:
            return facts, facts["source"]
        tried.append(f"no readable config.json in {local}")
    arch = m.get("architecture")
    if arch:
        facts = model(arch)
        if facts:
            return facts, f"model.architecture {arch!r} -> {facts['source']}"
        tried.append(f"model.architecture {arch!r} is not in the catalogue")
    facts = model(m["source"])
    if facts:
        return facts, facts["source"]
    if not local:
        tried.append(f"{m['source']!r} is not in the catalogue")
    return None, "; ".join(tried)
