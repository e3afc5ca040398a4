"""Small, deterministic models and tokenizers for tests and examples (no downloads).

``make_tiny_llama`` builds a random Llama from a config (2 layers, hidden 64, 4 heads, 2 KV
heads, vocab 320) with a fixed seed; ``make_char_tokenizer`` builds a character-level tokenizer
in code. Both are public so that downstream tests and the docs can use them.
"""

from __future__ import annotations

import torch


def make_tiny_llama(seed: int = 0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings))
    return model.eval()


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

    settings = dict(
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        num_experts_per_tok=2,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
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
