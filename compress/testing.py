"""Small, deterministic models and tokenizers for tests and examples (no downloads).

``make_tiny_llama`` builds a random Llama from a config (2 layers, hidden 64, 4 heads, 2 KV
heads, vocab 320) with a fixed seed; ``make_tiny_model`` does the same for every dense family of
``compress.arch`` (same sizes, head_dim 16, each family's own features switched on: sliding
windows, Granite's multipliers); ``make_char_tokenizer`` builds a character-level tokenizer in
code. All are public so that downstream tests and the docs can use them.

``make_synthetic_llama`` and ``write_synthetic_llama`` build Llamas of public models' shapes
(``LLAMA_SHAPES``: TinyLlama-1.1B, Llama-2-7B and 13B, Llama-3.1-70B) with random weights for
the benchmark scripts: speed and memory do not depend on the weights' values; quality does, so
these measure no quality.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Literal

import torch

from compress.arch import PER_LAYER_CONFIG_KEYS, WRAPPER_MODEL_PREFIX, WRAPPER_TREE

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
    "ministral": ("MinistralConfig", "MinistralForCausalLM",
                  {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}),
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM", {}),  # YaRN, llama_4 scaling
    "cwm": ("CwmConfig", "CwmForCausalLM",  # full layers first as released (layer 0 full)
            {"sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"]}),
    # a windowed layer with RoPE, a full one without (its layer_rope_theta 0); sinks (random)
    "granite_swa": ("GraniteSWAConfig", "GraniteSWAForCausalLM", dict(
        embedding_multiplier=4.0, attention_multiplier=0.125, residual_multiplier=0.5,
        logits_scaling=2.0, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        layer_rope_theta=[10000.0, 0.0])),
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
    "vaultgemma": ("VaultGemmaConfig", "VaultGemmaForCausalLM", {"sliding_window": 8}),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "olmo3": (
        "Olmo3Config",
        "Olmo3ForCausalLM",
        {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "exaone4": (
        "Exaone4Config",
        "Exaone4ForCausalLM",
        {"sliding_window": 8, "sliding_window_pattern": 2},
    ),
    # layer 1 without RoPE (SmolLM3 leaves every 4th out)
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layers": [1, 0]}),
    "seed_oss": (
        "SeedOssConfig",
        "SeedOssForCausalLM",
        {"attention_bias": True, "attention_out_bias": True},
    ),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {"use_bias": True}),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", {}),
    "helium": ("HeliumConfig", "HeliumForCausalLM", {}),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", {}),  # non-gated relu2 MLP
    # non-gated MLP, xIELU with learned scalars per layer; q/k norms; its own norm names
    "apertus": ("ApertusConfig", "ApertusForCausalLM", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 12e6, "factor": 8.0,
        "original_max_position_embeddings": 64, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0}}),  # its llama3 RoPE, scaled past 64 positions
    # LayerNorms with biases; Starcoder2's gelu MLP not gated, StableLM's partial RoPE
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"sliding_window": 8}),
    "jais2": ("Jais2Config", "Jais2ForCausalLM", {}),  # LayerNorms, biases, relu2 not gated
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {"use_qkv_bias": True}),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", {}),  # (1 + w) LayerNorms, relu2
    # parallel attention and MLP on one LayerNorm
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.5}),
    # ... with a sliding layer (RoPE) and a global one (no RoPE)
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {
        "logit_scale": 0.5, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"]}),
    "phi": ("PhiConfig", "PhiForCausalLM", {}),
    "opt": ("OPTConfig", "OPTForCausalLM", {"ffn_dim": 128, "word_embed_proj_dim": 64}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"rotary_pct": 0.25}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "glm": ("GlmConfig", "GlmForCausalLM", {}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {}),
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
    layers = settings["num_hidden_layers"]
    for key in PER_LAYER_CONFIG_KEYS:  # the family's per-layer pattern, repeated to the depth
        if key in family and key not in overrides:
            settings[key] = [family[key][i % len(family[key])] for i in range(layers)]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**settings)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # attention sinks start at 0: a path that dropped them would pass
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.normal_(0.0, 1.0)
    return model


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


TINY_MOE_TYPES: tuple[str, ...] = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "glm4_moe",
                                   "dots1", "ernie4_5_moe", "deepseek_v3", "deepseek_v2",
                                   "glm4_moe_lite", "minimax_m2", "phimoe", "exaone_moe",
                                   "hunyuan_v1_moe", "granitemoe", "solar_open", "gpt_oss")


def make_tiny_moe(model_type: str, seed: int = 0, **overrides):
    """A random sparse-MoE causal LM from its transformers 5 config, one of ``TINY_MOE_TYPES``;
    2 layers, hidden 64, 4 heads (2 KV), 4 experts (intermediate 64), top-2, vocab 320
    (Qwen2-MoE, GLM-4-MoE, dots.llm1: a shared expert of intermediate 64 too; OLMoE: q/k
    norms over all heads; GLM-4-MoE and dots.llm1 route by sigmoid scores and would make their
    first layers dense: ``first_k_dense_replace`` 0 here, an override sets it, as
    ``mlp_layer_types`` does for GLM-4.7-Flash's glm4_moe_lite).
    Experts are the fused 3-D parameters transformers 5 builds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(TINY_SIZES, head_dim=16, num_experts_per_tok=2, tie_word_embeddings=True)
    if model_type == "mixtral":
        settings.update(num_local_experts=4, intermediate_size=64)
    elif model_type == "minimax_m2":  # RoPE on half of each head, given as released
        settings.update(num_local_experts=4, intermediate_size=64, rotary_dim=8)
    elif model_type == "phimoe":  # default RoPE (the released longrope falls back), biases;
        # sparsemixer's eval weights jump where a score crosses 2 x router_jitter_noise (0.01
        # as released) below the best: at 0 each picked expert weighs 1, and a kernel's
        # rounding cannot flip this random model's outputs (it did at one position in twelve)
        settings.update(num_local_experts=4, intermediate_size=64, attention_bias=True,
                        router_jitter_noise=0.0,
                        lm_head_bias=True, rope_parameters={"rope_type": "default",
                                                            "rope_theta": 1e4})
    elif model_type == "olmoe":
        settings.update(num_experts=4, intermediate_size=64, norm_topk_prob=True)
    elif model_type in ("qwen3_moe", "qwen2_moe"):
        settings.update(num_experts=4, moe_intermediate_size=64, intermediate_size=128,
                        norm_topk_prob=True, decoder_sparse_step=1)
        if model_type == "qwen2_moe":  # a shared expert every token takes
            settings.update(shared_expert_intermediate_size=64, mlp_only_layers=[])
    elif model_type == "solar_open":  # GLM-4-MoE's block in every layer, Llama's attention
        settings.update(n_routed_experts=4, moe_intermediate_size=64, n_shared_experts=1,
                        n_group=1, topk_group=1, norm_topk_prob=True)
    elif model_type in ("glm4_moe", "dots1"):  # sigmoid routing, a shared expert (64 wide)
        settings.update(n_routed_experts=4, moe_intermediate_size=64, intermediate_size=128,
                        n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1,
                        norm_topk_prob=True)
    elif model_type in ("deepseek_v3", "deepseek_v2"):  # GLM-4-MoE's experts, MLA attention
        settings.update(n_routed_experts=4, moe_intermediate_size=64, intermediate_size=128,
                        n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1,
                        norm_topk_prob=True, q_lora_rank=64, kv_lora_rank=64,
                        qk_nope_head_dim=16, qk_rope_head_dim=16, head_dim=16, v_head_dim=16,
                        num_key_value_heads=TINY_SIZES["num_attention_heads"])
    elif model_type == "glm4_moe_lite":  # DeepSeek-V3's layout (released: layer 0 dense)
        settings.update(mlp_layer_types=["sparse"] * 2, n_routed_experts=4,
                        moe_intermediate_size=64, intermediate_size=128, n_shared_experts=1,
                        n_group=1, topk_group=1, norm_topk_prob=True, q_lora_rank=64,
                        kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                        num_key_value_heads=TINY_SIZES["num_attention_heads"])
    elif model_type == "exaone_moe":  # dots.llm1's block (released: layer 0 dense)
        settings.update(num_experts=4, moe_intermediate_size=64, intermediate_size=128,
                        num_shared_experts=1, mlp_layer_types=["sparse"] * 2, norm_topk_prob=True)
    elif model_type == "granitemoe":  # Granite's multipliers
        settings.update(num_local_experts=4, intermediate_size=64, embedding_multiplier=4.0,
                        attention_multiplier=0.125, residual_multiplier=0.5, logits_scaling=2.0)
    elif model_type == "gpt_oss":  # sinks, a sliding and a full layer, YaRN as released
        settings.update(num_local_experts=4, intermediate_size=64, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"],
                        max_position_embeddings=131072)
    elif model_type == "hunyuan_v1_moe":  # a shared expert as wide as the experts (64)
        settings.update(num_experts=4, moe_topk=2, intermediate_size=64)
    elif model_type == "ernie4_5_moe":  # a shared expert (64 wide), every layer sparse
        settings.update(moe_num_experts=4, moe_k=2, moe_intermediate_size=64,
                        intermediate_size=128, moe_num_shared_experts=1, moe_layer_start_index=0)
    else:
        raise ValueError(f"make_tiny_moe: model_type {model_type!r} is not one of {TINY_MOE_TYPES}")
    settings.update(overrides)
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **settings)
    model = AutoModelForCausalLM.from_config(config).eval()
    if model_type == "gpt_oss":  # initialized to zeros and ~0: a path that dropped them would pass
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("bias", "sinks")):
                    param.normal_(0.0, 1.0 if name.endswith("sinks") else 0.005)
    return model


# Multimodal wrappers around a tiny text model (``compress.io.wrapped``): model_type -> (config
# class, model class, the text model_type, the vision config). The vision towers are tiny too
# (one layer, 28-pixel images of 14-pixel patches).
_TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2, image_size=28, patch_size=14)
_WRAPPERS: dict[str, tuple[str, str, str, dict]] = {
    "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration", "gemma3_text",
               dict(_TINY_VISION, model_type="siglip_vision_model")),
    "mistral3": ("Mistral3Config", "Mistral3ForConditionalGeneration", "mistral",
                 dict(_TINY_VISION, model_type="pixtral", head_dim=16)),
    "llava": ("LlavaConfig", "LlavaForConditionalGeneration", "llama",
              dict(_TINY_VISION, model_type="clip_vision_model", projection_dim=32)),
    # M-RoPE text models (sections over each head's rotary pairs) and merger-projected towers
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "qwen2",
                   dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                        patch_size=14, window_size=28, fullatt_block_indexes=[0])),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", "qwen3",
                 dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                      deepstack_visual_indexes=[0], num_position_embeddings=16)),
}
TINY_WRAPPER_TYPES: tuple[str, ...] = tuple(_WRAPPERS)


def write_tiny_multimodal(folder: str | Path, model_type: str = "gemma3", seed: int = 0, *,
                          tie_word_embeddings: bool = True, legacy_names: bool = False,
                          flat_config: bool = False, tokenizer=None, **text_overrides) -> Path:
    """A random multimodal checkpoint (one of ``TINY_WRAPPER_TYPES``) around
    ``make_tiny_model``'s text model of its family (``text_overrides`` go to its config), saved
    by transformers' ``save_pretrained`` in fp32 with ``tokenizer`` (None:
    ``make_char_tokenizer``). ``legacy_names``: the tensors renamed to transformers 5's module
    tree names (``model.language_model.*``, ``lm_head.*``, ``model.vision_tower.*``), as
    transformers 4.52-4.57 saved them (Qwen3-VL is saved so anyway). ``flat_config``: the text
    settings at config.json's top level, no ``text_config`` (Qwen2.5-VL as released; M-RoPE
    sections as ``rope_scaling``). Returns the folder."""
    import transformers
    from safetensors.torch import load_file, save_file

    from compress.io.wrapped import Wrapped, wrapped_text

    config_name, model_name, text_type, vision = _WRAPPERS[model_type]
    text = make_tiny_model(text_type, **text_overrides).config.to_dict()
    text.pop("architectures", None)
    vision = dict(vision)
    if "depth" in vision:  # Qwen-VL: M-RoPE sections over the head's rotary pairs
        pairs = text["head_dim"] // 2
        sections = [pairs // 4, (pairs - pairs // 4) // 2]
        text["rope_parameters"] = dict(text.get("rope_parameters") or {}, rope_type="default",
                                       mrope_section=[*sections, pairs - sum(sections)])
        text.pop("model_type")
        if model_type == "qwen3_vl":
            text["rope_parameters"]["mrope_interleaved"] = True
        vision["out_hidden_size"] = text["hidden_size"]
    config = getattr(transformers, config_name)(
        text_config=text, vision_config=vision, tie_word_embeddings=tie_word_embeddings,
        image_token_index=text["vocab_size"] - 1)
    if model_type == "gemma3":
        config.mm_tokens_per_image = 4
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    folder = Path(folder)
    model.save_pretrained(folder)
    (tokenizer or make_char_tokenizer()).save_pretrained(folder)
    if flat_config:
        import json

        stored = json.loads((folder / "config.json").read_text())
        text = stored.pop("text_config")
        rope = text.pop("rope_parameters", None) or {}
        for key, value in text.items():
            if key != "model_type":
                stored.setdefault(key, value)
        stored["rope_theta"] = rope.get("rope_theta", 10000.0)
        stored["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
        (folder / "config.json").write_text(json.dumps(stored, indent=2))
    if legacy_names:
        file = folder / "model.safetensors"
        tensors = load_file(file)
        renamed = {}
        wrapped = wrapped_text(folder)
        tree = Wrapped(folder, {}, WRAPPER_TREE, (), "")  # names as transformers 5's tree
        for name, tensor in tensors.items():
            text = wrapped.text_name(name)
            if text is not None:
                renamed[tree.stored(text)] = tensor
            else:  # the vision tower and projector, under the wrapper's own module
                renamed[name if name.startswith(WRAPPER_MODEL_PREFIX)
                        else WRAPPER_MODEL_PREFIX + name] = tensor
        save_file(renamed, file, metadata={"format": "pt"})
    return folder


# Tensors up to this many values are drawn whole (the weights earlier benchmarks measured);
# larger ones a slice at a time (a whole fp32 draw of GPT-OSS-120B's experts is 8.5 GB)
_WHOLE_RANDN = 1 << 30
# Public models' shapes; the vocab is theirs (32000), a benchmark may override it.
LLAMA_SHAPES = {
    "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, vocab_size=32000),  # TinyLlama
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, vocab_size=32000),  # Llama-2-7B
    "13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                num_attention_heads=40, num_key_value_heads=40, vocab_size=32000),  # Llama-2-13B
    # Llama-3.1-70B: 141 GB in bf16, more than this machine's disk; the benchmarks write a
    # few of its layers (``num_hidden_layers``), each as wide as the real one's
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, vocab_size=128256),
}  # fmt: skip
# Mixture-of-experts shapes for the streamed benchmarks (``write_synthetic_llama`` writes their
# experts one weight per expert, as the hub's checkpoints store them)
MOE_SHAPES = {
    # Qwen3-30B-A3B: 48 layers of 128 experts (768 wide), 8 per token; 61 GB in bf16
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], vocab_size=151936),
    # Mixtral-8x7B: 32 layers of 8 experts (14336 wide), 2 per token; 93 GB in bf16
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                         vocab_size=32000, rope_theta=1e6),
    # GPT-OSS-120B: 36 layers of 128 experts (2880 wide), 4 per token, sliding and full layers;
    # 117B parameters, 234 GB in bf16 (released in MXFP4: 65 GB); -20b: 24 layers of 32
    "gpt-oss-120b": dict(model_type="gpt_oss", hidden_size=2880, num_hidden_layers=36,
                         num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                         intermediate_size=2880, num_local_experts=128, num_experts_per_tok=4,
                         vocab_size=201088),
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                        vocab_size=201088),
}  # fmt: skip


def synthetic_config(shape: str, **overrides):
    """The transformers config of ``LLAMA_SHAPES[shape]`` or ``MOE_SHAPES[shape]``, untied, bf16,
    with ``overrides``."""
    from transformers import AutoConfig

    settings = dict(LLAMA_SHAPES.get(shape) or MOE_SHAPES[shape], tie_word_embeddings=False,
                    torch_dtype="bfloat16")
    settings.update(overrides)
    return AutoConfig.for_model(settings.pop("model_type", "llama"), **settings)


def make_synthetic_llama(shape: str, seed: int = 0, **overrides):
    """A random ``LlamaForCausalLM`` of ``LLAMA_SHAPES[shape]`` in memory, fp32, in eval mode:
    transformers' own init (normal(0, 0.02) linears and embeddings, norms ones) after
    ``torch.manual_seed(seed)``. ``overrides`` go to the config. It holds the whole model in
    fp32 (1.1B: 4.4 GB); ``write_synthetic_llama`` writes larger ones tensor by tensor."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(LLAMA_SHAPES[shape])
    settings.update(overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**settings)).eval()


def write_synthetic_llama(
    folder: str | Path,
    shape: str,
    *,
    init: Literal["stream", "transformers"] = "stream",
    tokenizer=None,
    seed: int = 0,
    shard_size: str | None = None,
    **overrides,
) -> Path:
    """A random-weight bf16 checkpoint of ``LLAMA_SHAPES[shape]`` or (``init="stream"`` only)
    ``MOE_SHAPES[shape]`` (``synthetic_config``; ``overrides`` go to the config) in ``folder``,
    with ``tokenizer`` (None: ``make_char_tokenizer``, inside every
    vocabulary). Kept when ``folder/config.json`` exists: it is written to ``folder.part`` and
    renamed when complete, so a stopped run leaves no half checkpoint to reuse.

    ``init="stream"``: normal(0, 0.02) from one generator seeded ``seed``, tensor by tensor in
    checkpoint order (norms ones), appended to shards of ``shard_size`` (None: 2GB); memory stays
    at one tensor, so 7B and 13B fit. ``init="transformers"``: ``make_synthetic_llama``'s weights
    cast to bf16, saved by ``save_pretrained`` (``shard_size`` None: its default shards); the whole
    model is in memory. The two give different weights for one seed: a benchmark keeps the one
    its earlier results were measured on."""
    from compress.io.names import checkpoint_renamer, split_float_experts
    from compress.io.stream import ShardWriter, expected_tensors, meta_skeleton

    if init not in ("stream", "transformers"):
        raise ValueError(f"init={init!r}: expected 'stream' or 'transformers'")
    folder = Path(folder)
    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if init == "transformers":
        model = make_synthetic_llama(shape, seed, **overrides).to(torch.bfloat16)
        sharding = {} if shard_size is None else {"max_shard_size": shard_size}
        model.save_pretrained(tmp, **sharding)
    else:
        synthetic_config(shape, **overrides).save_pretrained(tmp)
        writer = ShardWriter(tmp, shard_size or "2GB")
        generator = torch.Generator().manual_seed(seed)
        skeleton = meta_skeleton(tmp)
        rename = checkpoint_renamer(skeleton)
        for key, meta in expected_tensors(skeleton).items():
            if meta.dim() == 1:  # norms: ones, as trained models keep them near
                tensor = torch.ones(meta.shape, dtype=torch.bfloat16)
            elif meta.numel() > _WHOLE_RANDN:  # GPT-OSS-120B's fused experts (2.1G values):
                # drawn a slice at a time, 4 bytes each at most once
                tensor = torch.empty(meta.shape, dtype=torch.bfloat16)
                for part in tensor:
                    part.copy_(torch.randn(part.shape, generator=generator) * 0.02)
            else:
                tensor = (torch.randn(meta.shape, generator=generator) * 0.02).to(torch.bfloat16)
            tensors = {key: tensor}
            split_float_experts(skeleton, tensors)  # fused experts: one weight per expert
            for name, part in tensors.items():
                writer.add(rename(name), part)
            del tensor, tensors
        writer.finish()
    (tokenizer or make_char_tokenizer()).save_pretrained(tmp)
    os.replace(tmp, folder)
    return folder


def add_mtp_modules(folder: str | Path, seed: int = 7) -> dict[str, torch.Tensor]:
    """Multi-token-prediction modules beside a saved checkpoint's causal LM, random bf16, as
    released checkpoints store them, in a shard of their own (the index written or extended):
    with ``num_nextn_predict_layers`` in config.json (GLM-4.5, DeepSeek-V3), that many decoder
    layers after the last (the last layer's tensors, plus ``eh_proj``, ``enorm``, ``hnorm`` and
    ``shared_head.norm``); without it (ERNIE-4.5-MoE), ``model.mtp_block.0`` (the last layer's
    tensors) with ``mtp_emb_norm.0``, ``mtp_hidden_norm.0`` and ``mtp_linear_proj.0``. Returns
    the tensors added, by stored name."""
    import json

    from safetensors.torch import save_file

    from compress.arch import ARCHS
    from compress.io.checkpoint import CheckpointReader

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    reader = CheckpointReader(folder)
    prefix = ARCHS[config["model_type"]].layer_prefix
    last = f"{prefix}{config['num_hidden_layers'] - 1}."
    hidden = config["hidden_size"]
    shapes = {n.removeprefix(last): tuple(reader.shape(n)) for n in reader.names()
              if n.startswith(last)}
    extra = {"enorm.weight": (hidden,), "hnorm.weight": (hidden,),
             "shared_head.norm.weight": (hidden,), "eh_proj.weight": (hidden, 2 * hidden)}
    count = config.get("num_nextn_predict_layers")
    if count:
        first = config["num_hidden_layers"]
        wanted = {f"{prefix}{first + i}.{n}": shape
                  for i in range(count) for n, shape in {**shapes, **extra}.items()}
    else:
        wanted = {f"model.mtp_block.0.{n}": shape for n, shape in shapes.items()}
        wanted |= {"model.mtp_emb_norm.0.weight": (hidden,),
                   "model.mtp_hidden_norm.0.weight": (hidden,),
                   "model.mtp_linear_proj.0.weight": (hidden, 2 * hidden)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {n: torch.randn(shape, generator=generator).to(torch.bfloat16)
               for n, shape in wanted.items()}
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        (folder / "model.safetensors").rename(folder / "model-00001.safetensors")
        weight_map = {n: "model-00001.safetensors" for n in reader.names()}
    save_file(tensors, folder / "model-mtp.safetensors", metadata={"format": "pt"})
    weight_map |= {n: "model-mtp.safetensors" for n in tensors}
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt`` from transformers' own ``generate`` (the reference
    the runtime is compared with; no stop token)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
            pad_token_id=2,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def assert_greedy_agrees(model, prompt: list[int], got: list[int], tol: float) -> None:
    """``got`` is transformers' greedy continuation of ``prompt`` (as long as ``got``), or agrees
    with it up to a near tie: a step where the reference's top two logits (after the shared
    tokens) lie within ``tol`` and ``got`` took the runner-up, which another kernel's rounding
    (bf16 activations) may pick; the tokens after a flipped tie differ."""
    want = hf_greedy(model, prompt, len(got))
    if got == want:
        return
    i = next(k for k, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + want[:i]])).logits[0, -1].double()
    top = logits.topk(2)
    margin = float(top.values[0] - top.values[1])
    assert margin <= tol and got[i] == int(top.indices[1]), (
        f"greedy tokens differ at {i}: {got} != {want}; the reference's top-2 margin there is "
        f"{margin:.4g} (a near tie is <= {tol})")


_PLAIN_LOAD = """
import json, sys, torch
import transformers
ids = torch.tensor(json.loads(sys.argv[1]))
for ckpt in sys.argv[2:]:
    multimodal = "vision_config" in json.load(open(ckpt + "/config.json"))
    auto = (transformers.AutoModelForImageTextToText if multimodal
            else transformers.AutoModelForCausalLM)
    model, info = auto.from_pretrained(ckpt, dtype=torch.float32, output_loading_info=True)
    if multimodal:  # every stored tensor placed: a vision linear taken as quantized would not be
        assert not (info["missing_keys"] or info["unexpected_keys"]), info
    with torch.no_grad():
        torch.save(model.eval()(input_ids=ids).logits, ckpt + ".plain.pt")
assert not any(m.split(".")[0] == "compress" for m in sys.modules), "plain transformers only"
"""


def plain_transformers_logits(folders: list, ids: list[list[int]], cwd) -> list[torch.Tensor]:
    """Logits of ``ids`` from each exported folder, loaded by plain transformers in one
    subprocess that never imports compress (asserted there; PYTHONPATH cleared); a multimodal
    export as its wrapper (``AutoModelForImageTextToText``, text only), every stored tensor
    placed. An AssertionError with the subprocess's stderr when it fails."""
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
