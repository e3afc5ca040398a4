"""Small, deterministic models and tokenizers for tests and examples (no downloads).

``make_tiny_llama`` builds a random Llama from a config (2 layers, hidden 64, 4 heads, 2 KV
heads, vocab 320) with a fixed seed; ``make_tiny_model`` does the same for every dense family of
``compress.arch`` (same sizes, head_dim 16, each family's own features switched on: sliding
windows, Granite's multipliers); ``make_char_tokenizer`` builds a character-level tokenizer in
code. All are public so that downstream tests and the docs can use them.
"""

from __future__ import annotations

import torch

# The sizes every tiny model shares (the families add head_dim 16 and their own features).
TINY_SIZES = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def make_tiny_llama(seed: int = 0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(TINY_SIZES, tie_word_embeddings=True)
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings))
    return model.eval()


# model_type -> (config class, model class, family settings on top of the shared tiny sizes).
# Sliding windows of 8 tokens so that sequences of 16+ tokens exercise them; Granite's
# multipliers away from 1 so that a pass that ignored them would show.
_FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),  # = tiny_llama
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(
            embedding_multiplier=4.0,
            attention_multiplier=0.125,
            residual_multiplier=0.5,
            logits_scaling=2.0,
        ),
    ),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": 8}),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
}
TINY_MODEL_TYPES: tuple[str, ...] = tuple(_FAMILIES)


def make_tiny_model(model_type: str, seed: int = 0, **overrides):
    """A random ``*ForCausalLM`` of ``model_type`` (a key of ``TINY_MODEL_TYPES``; Gemma3 is
    its text model, ``gemma3_text``): 2 layers, hidden 64, intermediate 128, 4 heads of 16, 2 KV
    heads, vocab 320, in eval mode. ``overrides`` go to the config."""
    import transformers

    if model_type not in _FAMILIES:
        raise ValueError(
            f"make_tiny_model: unknown model_type {model_type!r}; known: {', '.join(_FAMILIES)}"
        )
    config_name, model_name, family = _FAMILIES[model_type]
    settings = dict(TINY_SIZES, head_dim=16)
    settings.update(family)
    settings.update(overrides)
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**settings)
    return getattr(transformers, model_name)(config).eval()


def make_char_tokenizer():
    """A character-level tokenizer built in code (no downloads): 3 specials + printable ASCII,
    newline and tab; vocab < 320 so it fits the tiny Llama. Unknown characters map to <unk>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in "\n\t" + "".join(chr(c) for c in range(32, 127)):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="</s>",
    )


def make_tiny_moe(model_type: str, seed: int = 0, **overrides):
    """A random sparse-MoE causal LM from its transformers 5 config: ``mixtral`` or
    ``qwen3_moe``; 2 layers, hidden 64, 4 heads (2 KV), 4 experts (intermediate 64), top-2,
    vocab 320. Experts are the fused 3-D parameters transformers 5 builds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(TINY_SIZES, head_dim=16, num_experts_per_tok=2, tie_word_embeddings=True)
    if model_type == "mixtral":
        settings.update(num_local_experts=4, intermediate_size=64)
    elif model_type == "qwen3_moe":
        settings.update(num_experts=4, moe_intermediate_size=64, intermediate_size=128,
                        norm_topk_prob=True, decoder_sparse_step=1)
    else:
        raise ValueError(f"make_tiny_moe: model_type {model_type!r} is not mixtral or qwen3_moe")
    settings.update(overrides)
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **settings)
    return AutoModelForCausalLM.from_config(config).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt`` from transformers' own ``generate`` (the reference
    the runtime is compared with; no stop token)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
            pad_token_id=2,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


_PLAIN_LOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM
ids = torch.tensor(json.loads(sys.argv[1]))
for ckpt in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.save(model(ids).logits, ckpt + ".plain.pt")
assert not any(m.split(".")[0] == "compress" for m in sys.modules), "plain transformers only"
"""


def plain_transformers_logits(folders: list, ids: list[list[int]], cwd) -> list[torch.Tensor]:
    """Logits of ``ids`` from each exported folder, loaded by plain transformers in one
    subprocess that never imports compress (asserted there; PYTHONPATH cleared). An
    AssertionError with the subprocess's stderr when it fails."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": ""}
    proc = subprocess.run(
        [sys.executable, "-c", _PLAIN_LOAD, json.dumps(ids), *map(str, folders)],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(f"{folder}.plain.pt") for folder in folders]
