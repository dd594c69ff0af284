"""A deterministic tiny Llama-shaped model for the CPU lab and CI (random weights, real files).

Shape: hidden 128, intermediate 256, 2 layers, 4 attention heads, 2 KV heads, head_dim 32
(vLLM's CPU attention accepts 32; 16 is rejected), a byte-level BPE tokenizer of 512 tokens
trained on generated text, a ChatML chat template, bfloat16 safetensors. The same seed gives the
same bytes in every file (the test builds twice and compares sha256 of each file).

torch/transformers/tokenizers live in the vLLM CPU venv, not in the main venv: :func:`build`
runs this file with that venv's python unless the current interpreter has them already. This
module imports only the standard library at the top so the main venv can import it.

    vllm-fleet tiny-model [--out DIR] [--seed N]
    python -m vllm_fleet.lab.tinymodel --out DIR     # same
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_OUT = "~/.cache/vllm-fleet/models/tiny-llama"

# The shape (documented in docs/vllm-cpu.md; the planner's catalogue may describe it too).
HIDDEN = 128
INTERMEDIATE = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32
VOCAB = 512
MAX_POSITIONS = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORDS = (
    "the a one every some model server token prompt answer question fleet host node gpu cpu "
    "cache memory batch request stream reply deploy spec engine proxy health metric latency "
    "is are was runs serves sends reads writes checks starts stops waits returns builds "
    "quickly slowly always never again today here there and or but so because when while "
    "hello world yes no please thanks what why how which who where small large tiny fast "
    "red green blue seven three ten hundred numbers letters words lines files 0 1 2 3 4 5 6 7 8 9"
).split()


def corpus(seed: int = 0, sentences: int = 600) -> list[str]:
    """Generated training text for the tokenizer (deterministic for a seed)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        end = rng.choice([".", "?", "!", ","])
        lines.append(" ".join(words).capitalize() + end)
    return lines


def _have_ml_stack() -> bool:
    return all(importlib.util.find_spec(m) for m in ("torch", "transformers", "tokenizers", "safetensors"))


def _build_here(out_dir: Path, seed: int) -> None:
    """Write the model into out_dir (must be empty or missing). Needs torch + transformers."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)

    # Tokenizer: byte-level BPE (every byte is representable, so no unknown tokens).
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    vocab = len(fast)
    eos = fast.convert_tokens_to_ids("<|im_end|>")
    pad = fast.convert_tokens_to_ids("<|endoftext|>")
    bos = fast.convert_tokens_to_ids("<|im_start|>")

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config)
    # Fill every tensor from one seeded generator in name order: independent of how a given
    # transformers version initialises (and of torch's global RNG).
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    model = model.to(torch.bfloat16)
    model.generation_config.do_sample = False
    model.save_pretrained(str(out_dir), safe_serialization=True)


def build(out_dir: str | os.PathLike = DEFAULT_OUT, seed: int = 0, python: str | None = None) -> Path:
    """Build the tiny model into out_dir (replaced atomically) and return its path.

    Runs in this interpreter when it has torch/transformers, else with ``python`` or the
    vLLM CPU venv's python (see :mod:`vllm_fleet.lab.vllmcpu`).
    """
    out = Path(out_dir).expanduser().resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if python is None and _have_ml_stack():
            _build_here(tmp, seed)
        else:
            if python is None:
                from vllm_fleet.lab import vllmcpu

                python = str(vllmcpu.require_python())
            env = dict(
                os.environ,
                HF_HUB_OFFLINE="1",
                TRANSFORMERS_VERBOSITY="error",
                TOKENIZERS_PARALLELISM="false",
                HF_HUB_DISABLE_PROGRESS_BARS="1",
            )
            # -I: the script's own folder (vllm_fleet/, which has a secrets.py) must not shadow the stdlib
            subprocess.run(
                [python, "-I", str(Path(__file__).resolve()), "--here", "--out", str(tmp), "--seed", str(seed)],
                check=True,
                env=env,
            )
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():  # safetensors writes 0600; the model is public data
            os.chmod(f, 0o644)
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def tiny_model_main(out: str | None = None, seed: int = 0) -> int:
    try:
        path = build(out or DEFAULT_OUT, seed=seed)
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"vllm-fleet tiny-model: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def add_cli(subparsers) -> None:
    """Register ``tiny-model [--out DIR] [--seed N]`` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "tiny-model",
        help="build the deterministic tiny Llama model for the CPU lab",
        description="Build a tiny random-weight Llama model (hidden 128, 2 layers) with a BPE "
        "tokenizer and chat template, identical bytes for the same seed. Uses the "
        "vLLM CPU venv (python -m vllm_fleet.lab.vllmcpu ensure).",
    )
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.set_defaults(func=lambda args: tiny_model_main(args.out, args.seed))


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tinymodel")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--here", action="store_true", help="build in this interpreter into --out as is (internal)")
    args = ap.parse_args(argv)
    if args.here:
        _build_here(Path(args.out), args.seed)
        return 0
    return tiny_model_main(args.out, args.seed)


if __name__ == "__main__":
    sys.exit(_main())
