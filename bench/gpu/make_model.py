#!/usr/bin/env python3
"""Write a real model's config.json and a tokenizer of its vocabulary size into a directory, for
vLLM's ``--load-format dummy`` (random weights of the real shape: memory and speed are real, the
text is not). No weights are written; nothing is downloaded.

    python3 bench/gpu/make_model.py qwen2.5-7b-instruct /var/lib/vllm-fleet/NAME/model

The shape comes from vllm_fleet/specs/catalog/models.json (the planner's catalogue); the Qwen2 fields
the catalogue does not carry (rope_theta, rms_norm_eps, sliding window, special token ids) are
Qwen2.5-Instruct's published config.json values.

Tokenizer (in ``DIR/tokenizer``, passed as ``--tokenizer``: beside a qwen2 config.json,
transformers 5 would load it as a Qwen2Tokenizer and drop every word): a word-level vocabulary of
exactly ``vocab_size`` entries (``w0``, ``w1``, ..., Qwen's ``<|endoftext|>`` 151643, ``<|im_start|>`` 151644,
``<|im_end|>`` 151645 at their real ids, ``[UNK]`` 151646) and a ChatML chat template. Ids 1000.. are the words
`vllm-fleet bench --multi-turn` writes (vllm_fleet.serving.words.WORDS) and the chat roles, so its prompts are
distinct token sequences (as ``[UNK]`` every conversation would be the same prefix, and the
prefix cache would hit across conversations whatever the routing). Every id the model can sample decodes to a
word, and a random token prompt decodes and re-encodes to the same ids (so `vllm bench serve`'s
random prompts have the requested length). Needs ``tokenizers`` and ``transformers`` (the GPU
image has both).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
WORDS_AT = 1000  # first id of the multi-turn bench's words
SPECIALS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>", 151646: "[UNK]"}
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QWEN2 = {
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "model_type": "qwen2",
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "use_cache": True,
    "use_sliding_window": False,
}


def config_for(name: str) -> dict:
    cat = json.loads((ROOT / "vllm_fleet/specs/catalog/models.json").read_text())["models"]
    f = next(m for m in cat if name.lower() in (m["name"], m["id"].lower()))
    if f["architecture"] != "Qwen2ForCausalLM":
        raise SystemExit(f"{name}: only Qwen2 shapes are written by this script")
    cfg = dict(QWEN2)
    cfg.update(
        {
            "architectures": [f["architecture"]],
            "hidden_size": f["hidden_size"],
            "intermediate_size": f["intermediate_size"],
            "num_hidden_layers": f["num_hidden_layers"],
            "max_window_layers": f["num_hidden_layers"],
            "num_attention_heads": f["num_attention_heads"],
            "num_key_value_heads": f["num_key_value_heads"],
            "max_position_embeddings": f["max_position_embeddings"],
            "vocab_size": f["vocab_size"],
            "tie_word_embeddings": f["tie_word_embeddings"],
            "torch_dtype": f["torch_dtype"],
        }
    )
    q = f.get("quantization_config")
    if q:
        cfg["quantization_config"] = {**q, "modules_to_not_convert": None}
    return cfg


def write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from vllm_fleet.serving.words import WORDS

    words = list(dict.fromkeys([*WORDS, "system", "user", "assistant"]))
    named = {WORDS_AT + k: w for k, w in enumerate(words)}
    vocab = {SPECIALS.get(i) or named.get(i) or f"w{i}": i for i in range(vocab_size)}
    assert len(vocab) == vocab_size, "a word of the bench collides with a generated entry"
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="[UNK]",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=32768,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out / "tokenizer"))


def main(name: str, out: str) -> int:
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    cfg = config_for(name)
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (d / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 151643, "eos_token_id": [151645, 151643]}) + "\n"
    )
    write_tokenizer(d, cfg["vocab_size"])
    print(f"{d}: config.json ({name}), {d}/tokenizer of {cfg['vocab_size']} entries")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
