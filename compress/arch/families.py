"""Every family's entry (``Arch``) and runtime facts (``RuntimeSpec``), by ``model_type``: the one
place that names a family's modules (a test fails on an architecture name anywhere else in the
package). How each family's peculiarities are handled is in ``compress.arch``'s docstring.
"""

from __future__ import annotations

import dataclasses

from compress.arch.layout import (
    Arch,
    FusedPart,
    LatentAttention,
    Mapping,
    Moe,
    PruneGroup,
    RuntimeSpec,
    ScaleGap,
)


def _mapping(producer: str, *consumers: str, part: FusedPart = "") -> Mapping:
    return Mapping(producer, consumers, part)


_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")  # read the attention norm


def _gated_mappings(mlp_norm: str) -> tuple[tuple[Mapping, ...], tuple[Mapping, ...]]:
    """(AWQ, SmoothQuant) mappings of Llama's layout whose gated MLP reads ``mlp_norm``."""
    qkv, mlp_in = _mapping("input_layernorm", *_QKV), _mapping(mlp_norm, "mlp.gate_proj",
                                                               "mlp.up_proj")
    up_down = _mapping("mlp.up_proj", "mlp.down_proj")
    return (qkv, _mapping("self_attn.v_proj", "self_attn.o_proj"), mlp_in, up_down), (
        qkv, mlp_in, up_down)


_LLAMA_AWQ, _LLAMA_SMOOTHQUANT = _gated_mappings("post_attention_layernorm")
_GEMMA2_AWQ, _GEMMA2_SMOOTHQUANT = _gated_mappings("pre_feedforward_layernorm")

LLAMA = Arch(
    model_type="llama",
    layers="model.layers",
    embed="model.embed_tokens",
    final_norm="model.norm",
    lm_head="lm_head",
    rotary="model.rotary_emb",
    attention="self_attn",
    q="self_attn.q_proj",
    k="self_attn.k_proj",
    v="self_attn.v_proj",
    o="self_attn.o_proj",
    gate="mlp.gate_proj",
    up="mlp.up_proj",
    down="mlp.down_proj",
    attn_norm="input_layernorm",
    mlp_norm="post_attention_layernorm",
    norm_form="w",
    awq_mappings=_LLAMA_AWQ,
    smoothquant_mappings=_LLAMA_SMOOTHQUANT,
    heads=PruneGroup(
        rows=("self_attn.q_proj",),
        kv_rows=("self_attn.k_proj", "self_attn.v_proj"),
        cols=("self_attn.o_proj",),
    ),
    mlp_channels=PruneGroup(rows=("mlp.gate_proj", "mlp.up_proj"), cols=("mlp.down_proj",)),
    runtime=True,
)


def _moe_arch(model_type: str, moe: Moe) -> Arch:
    """Llama attention (same names) with ``moe`` as the MLP: the MLP has no dense projections,
    so no MLP mappings (AWQ/SmoothQuant smooth the attention inputs only). Pruning does not
    slice experts: the experts module stands in the MLP prune group, and the slicing prune
    passes refuse MoE models (prune.layers drops whole layers). The runtime runs the
    attention itself and the family's own sparse block (router + experts) as the MLP."""
    shared, gaps = (), ()
    if moe.shared_up:  # up -> down folds inside the shared expert; its inputs cannot be scaled
        shared = (_mapping(moe.shared_up, moe.shared_down),)
        reason = (
            "the MLP norm feeds the router and the routed experts too: a scale folded into it "
            "would change them, so the shared expert's gate/up inputs are not scaled"
        )
        gaps = (ScaleGap((moe.shared_gate, moe.shared_up), reason),)
    return dataclasses.replace(
        LLAMA,
        model_type=model_type,
        gate="",
        up="",
        down="",
        awq_mappings=LLAMA.awq_mappings[:2] + shared,
        smoothquant_mappings=LLAMA.smoothquant_mappings[:1] + shared,
        mlp_channels=PruneGroup(
            rows=(moe.fused, *moe.shared_readers),
            cols=(moe.fused, *((moe.shared_down,) if moe.shared_down else ())),
        ),
        scale_gaps=gaps,
        runtime=True,
        moe=moe,
    )


# transformers 5 names both families' MoE modules alike; their checkpoints differ (Mixtral's
# w1/w2/w3 under block_sparse_moe, which transformers renames and fuses on load).
_MOE = Moe(
    block="mlp",
    fused="mlp.experts",
    router="mlp.gate",
    gate_up="gate_up_proj",
    down="down_proj",
    act="act_fn",
    checkpoint_block="mlp",
    checkpoint_projections=("gate_proj", "up_proj", "down_proj"),
    dense=("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
)
MIXTRAL = _moe_arch(
    "mixtral",
    dataclasses.replace(
        _MOE, checkpoint_block="block_sparse_moe", checkpoint_projections=("w1", "w3", "w2")
    ),
)
_QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
QWEN3_MOE = dataclasses.replace(_moe_arch("qwen3_moe", _MOE), qk_norms=_QK_NORMS)
# OLMoE: Qwen3-MoE's layout with OLMo2's q/k norms over all heads.
OLMOE = dataclasses.replace(_moe_arch("olmoe", _MOE), qk_norms=_QK_NORMS, qk_norm_span="heads")
# Phi-3.5-MoE (phimoe): Mixtral's checkpoint names (the router stored as gate, a module named
# router), LayerNorms with biases, q/k/v/o biases, a sparsemixer router (the block's own).
PHIMOE = dataclasses.replace(
    _moe_arch("phimoe", dataclasses.replace(MIXTRAL.moe, router="mlp.router")), norm_kind="layer")
# MiniMax-M2 (M2.1): OLMoE's q/k norms over all heads, Mixtral's checkpoint names, a sigmoid
# router whose score-correction bias is a buffer of the block, partial RoPE (rotary_dim).
MINIMAX_M2 = dataclasses.replace(
    _moe_arch("minimax_m2", MIXTRAL.moe), qk_norms=_QK_NORMS, qk_norm_span="heads")
# Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen3-MoE's routed experts without q/k norms, q/k/v
# biases, and a shared expert.
QWEN2_MOE = _moe_arch(
    "qwen2_moe",
    dataclasses.replace(
        _MOE,
        shared_gate="mlp.shared_expert.gate_proj",
        shared_up="mlp.shared_expert.up_proj",
        shared_down="mlp.shared_expert.down_proj",
        shared_scalar_gate="mlp.shared_expert_gate",
    ),
)
# GLM-4.5/4.6 (GLM-4-MoE) and dots.llm1: Qwen3-MoE's routed experts under a sigmoid router with
# a score-correction bias (the router's own buffer), a shared expert summed in without a gate,
# and the first layers dense (first_k_dense_replace: plain MLPs of Linears, as Qwen2-MoE's
# mlp_only_layers); q/k/v biases (GLM). dots.llm1 normalizes q and k over one head always;
# GLM-4-MoE only with use_qk_norm, which the runtime leaves to transformers.
_SHARED_EXPERTS = dataclasses.replace(
    _MOE,
    shared_gate="mlp.shared_experts.gate_proj",
    shared_up="mlp.shared_experts.up_proj",
    shared_down="mlp.shared_experts.down_proj",
)
GLM4_MOE = _moe_arch("glm4_moe", _SHARED_EXPERTS)
# Solar Open (Upstage's 100B MoE): GLM-4-MoE's sparse block (sigmoid router with a correction
# bias, a shared expert) in every layer, around Llama's attention (no biases, RoPE over the
# whole head, no q/k norms).
SOLAR_OPEN = _moe_arch("solar_open", _SHARED_EXPERTS)
# ERNIE-4.5-MoE (21B-A3B, 300B-A47B): the same experts and shared expert under a softmax router
# whose selection bias is a parameter beside it (renamed in checkpoints: transformers' own
# renames, which checkpoint_renamer applies), ERNIE's interleaved RoPE (RuntimeSpec).
ERNIE4_5_MOE = _moe_arch("ernie4_5_moe", _SHARED_EXPERTS)
DOTS1 = dataclasses.replace(_moe_arch("dots1", _SHARED_EXPERTS), qk_norms=_QK_NORMS)
# K-EXAONE (exaone_moe): dots.llm1's block (its correction bias stored beside the router, renamed
# by transformers), q/k norms over one head, EXAONE 4's global layers without RoPE (RuntimeSpec),
# dense layers per mlp_layer_types.
EXAONE_MOE = dataclasses.replace(_moe_arch("exaone_moe", _SHARED_EXPERTS), qk_norms=_QK_NORMS)

# GraniteMoE (Granite 3.0/3.1 1B-A400M, 3B-A800M): Granite's multipliers (RuntimeSpec) around
# Mixtral's block name with the router a module of its own; checkpoints store each layer's
# experts fused (input_linear [E, 2I, H], output_linear [E, H, I]: transformers' renames).
GRANITEMOE = _moe_arch(
    "granitemoe",
    dataclasses.replace(_MOE, block="block_sparse_moe", fused="block_sparse_moe.experts",
                        router="block_sparse_moe.router", checkpoint_block="block_sparse_moe",
                        dense=("", "", "")),
)

# GPT-OSS (OpenAI's 20B/120B): Llama's attention names with biases on q/k/v/o and a learned
# sink logit per head (Arch.attention_sinks), sliding and full layers, YaRN; a router with
# a bias (softmax over its top k) and experts held transposed, gate and up columns interleaved,
# with biases, through a clamped SwiGLU (Moe.fused_layout, Moe.glu). Its checkpoints store the
# experts fused as the module holds them (released as MXFP4 blocks: compress.io.stream).
GPT_OSS = dataclasses.replace(_moe_arch(
    "gpt_oss",
    dataclasses.replace(_MOE, router="mlp.router", act="", dense=("", "", ""),
                        fused_layout="interleaved_columns", gate_up_bias="gate_up_proj_bias",
                        down_bias="down_proj_bias", glu="clamped_swiglu"),
), attention_sinks="self_attn.sinks")

# DeepSeek-V3/R1, Kimi K2 and Moonlight (deepseek_v3), DeepSeek-V2 (deepseek_v2): GLM-4-MoE's
# experts, shared expert and dense first layers (V3's router: sigmoid scores and a correction
# bias; V2's: softmax) around multi-head latent attention (MLA). The residual stream is read by
# q_a_proj (q_proj where the config has no q_lora_rank: DeepSeek-V2-Lite, Moonlight) and
# kv_a_proj_with_mqa (the KV latent and the shared rotary key), each after the attention norm;
# q_b_proj and kv_b_proj expand the latents after their own norms (q_a_layernorm,
# kv_a_layernorm: AWQ/SmoothQuant fold scales there); o_proj writes back. The runtime leaves MLA
# to transformers.
_MLA = "self_attn."
_MLA_GAP = ScaleGap(
    (_MLA + "o_proj",),
    "o_proj reads the values kv_b_proj expands from the latent, interleaved per head with the "
    "keys: no per-channel scale folds into that layout",
)


def _mla_arch(model_type: str, q_lora: bool) -> Arch:
    base = _moe_arch(model_type, _SHARED_EXPERTS)
    q = _MLA + ("q_a_proj" if q_lora else "q_proj")
    kv, kv_b, o = _MLA + "kv_a_proj_with_mqa", _MLA + "kv_b_proj", _MLA + "o_proj"
    latent = (_mapping(_MLA + "q_a_layernorm", _MLA + "q_b_proj"),) if q_lora else ()
    latent += (_mapping(_MLA + "kv_a_layernorm", kv_b),)
    shared = base.awq_mappings[2:]
    inputs = _mapping("input_layernorm", q, kv)
    return dataclasses.replace(
        base,
        q=q, k=kv, v=kv_b, o=o,
        awq_mappings=(inputs, *latent, *shared),
        smoothquant_mappings=(inputs, *latent, *base.smoothquant_mappings[1:]),
        heads=PruneGroup(rows=(q,), kv_rows=(kv,), cols=(o,)),
        inner_linears=((_MLA + "q_b_proj",) if q_lora else ()) + (kv_b,),
        scale_gaps=(*base.scale_gaps, _MLA_GAP),
        runtime=True,
        latent_attention=LatentAttention(
            q_b=_MLA + "q_b_proj" if q_lora else "",
            q_latent_norm=_MLA + "q_a_layernorm" if q_lora else "",
            kv_latent_norm=_MLA + "kv_a_layernorm"),
    )


# GLM-4.7-Flash (glm4_moe_lite): DeepSeek-V3's modules and data flow; which layers are dense is
# a per-layer list (mlp_layer_types: PER_LAYER_CONFIG_KEYS), the first by default.
_LATENT_TYPES = ("deepseek_v3", "deepseek_v2", "glm4_moe_lite")
DEEPSEEK_V3, DEEPSEEK_V2, GLM4_MOE_LITE = (_mla_arch(t, q_lora=True) for t in _LATENT_TYPES)
# Entries for configs whose modules differ from their family's (model_type -> (config
# attribute, value, entry)): ``arch_for`` picks the entry by the model's config.
CONFIG_VARIANTS: dict[str, tuple[tuple[str, object, Arch], ...]] = {
    t: (("q_lora_rank", None, _mla_arch(t, q_lora=False)),) for t in _LATENT_TYPES
}

# Qwen2 (q/k/v biases), Mistral and Granite: Llama's module names and data flow.
QWEN2, MISTRAL, GRANITE = (
    dataclasses.replace(LLAMA, model_type=t) for t in ("qwen2", "mistral", "granite")
)
# Granite SWA (Granite 4.x's attention-sink variant): Granite's multipliers, a learned sink
# logit per head, sliding and full layers, and a RoPE base per layer (0: none), each base its
# own rotary module under ``rotary`` (RuntimeSpec.rope_theta_layers)
GRANITE_SWA = dataclasses.replace(GRANITE, model_type="granite_swa", rotary="model.rotary_embs",
                                  attention_sinks="self_attn.sinks")
# Ministral (8B: sliding and full layers by layer_types) and Ministral 3 (the text model of
# Mistral 3's 3B-14B releases: YaRN RoPE, queries scaled by position past the original context,
# llama_4_scaling_beta): Llama's names and data flow.
MINISTRAL, MINISTRAL3 = (dataclasses.replace(LLAMA, model_type=t)
                         for t in ("ministral", "ministral3"))
# CWM (Meta's Code World Model, 32B): Llama's names and data flow, sliding and full layers by
# layer_types (every fourth full as released).
CWM = dataclasses.replace(LLAMA, model_type="cwm")
QWEN3 = dataclasses.replace(LLAMA, model_type="qwen3", qk_norms=_QK_NORMS)

# Gemma2: (1 + w) norms; attention -> post_attention_layernorm -> residual,
# pre_feedforward_layernorm -> MLP -> post_feedforward_layernorm -> residual.
GEMMA2 = dataclasses.replace(
    LLAMA,
    model_type="gemma2",
    mlp_norm="pre_feedforward_layernorm",
    norm_form="1+w",
    awq_mappings=_GEMMA2_AWQ,
    smoothquant_mappings=_GEMMA2_SMOOTHQUANT,
    post_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
    embed_scaling="sqrt_hidden",
)
GEMMA3_TEXT = dataclasses.replace(GEMMA2, model_type="gemma3_text", qk_norms=_QK_NORMS)
# VaultGemma (Google's differentially private 1B): Gemma 2 without the post-norms.
VAULTGEMMA = dataclasses.replace(GEMMA2, model_type="vaultgemma", post_norms=())

PHI3 = dataclasses.replace(
    LLAMA,
    model_type="phi3",
    q="self_attn.qkv_proj",
    k="self_attn.qkv_proj",
    v="self_attn.qkv_proj",
    gate="mlp.gate_up_proj",
    up="mlp.gate_up_proj",
    awq_mappings=(
        _mapping("input_layernorm", "self_attn.qkv_proj"),
        _mapping("self_attn.qkv_proj", "self_attn.o_proj", part="v"),
        _mapping("post_attention_layernorm", "mlp.gate_up_proj"),
        _mapping("mlp.gate_up_proj", "mlp.down_proj", part="up"),
    ),
    smoothquant_mappings=(
        _mapping("input_layernorm", "self_attn.qkv_proj"),
        _mapping("post_attention_layernorm", "mlp.gate_up_proj"),
        _mapping("mlp.gate_up_proj", "mlp.down_proj", part="up"),
    ),
    heads=PruneGroup(rows=(), cols=("self_attn.o_proj",), fused=("self_attn.qkv_proj",)),
    mlp_channels=PruneGroup(rows=(), cols=("mlp.down_proj",), fused=("mlp.gate_up_proj",)),
)

_RESIDUAL_INPUT = (
    "the family has no norm before attention/MLP (its norms come after them), so these read the "
    "residual stream directly and no operation can absorb a per-channel scale"
)
OLMO2 = dataclasses.replace(
    LLAMA,
    model_type="olmo2",
    attn_norm=None,
    mlp_norm=None,
    awq_mappings=(
        _mapping("self_attn.v_proj", "self_attn.o_proj"),
        _mapping("mlp.up_proj", "mlp.down_proj"),
    ),
    smoothquant_mappings=(_mapping("mlp.up_proj", "mlp.down_proj"),),
    post_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
    qk_norms=_QK_NORMS,
    qk_norm_span="heads",
    scale_gaps=(
        ScaleGap(_QKV, _RESIDUAL_INPUT),
        ScaleGap(("mlp.gate_proj", "mlp.up_proj"), _RESIDUAL_INPUT),
    ),
)

# OLMo3: OLMo2's layout and norms (its sliding windows are config constants). EXAONE 4: the
# same post-norm layout, with q/k norms over one head's head_dim.
OLMO3 = dataclasses.replace(OLMO2, model_type="olmo3")
EXAONE4 = dataclasses.replace(OLMO2, model_type="exaone4", qk_norm_span="head")

# Llama's module names and data flow: SmolLM3 (some layers without RoPE: ``no_rope_layers``),
# Seed-OSS (q/k/v and o biases), ERNIE 4.5 (biases; interleaved RoPE pairs: its RuntimeSpec),
# Helium (interleaved RoPE pairs),
# HunYuan dense (q/k norms over one head, named query/key_layernorm, applied after RoPE: its
# RuntimeSpec).
SMOLLM3, SEED_OSS, ERNIE4_5, HELIUM = (
    dataclasses.replace(LLAMA, model_type=t)
    for t in ("smollm3", "seed_oss", "ernie4_5", "helium")
)
HUNYUAN_V1_DENSE = dataclasses.replace(
    LLAMA,
    model_type="hunyuan_v1_dense",
    qk_norms=("self_attn.query_layernorm", "self_attn.key_layernorm"),
)
# HunYuan-MoE (Hunyuan-A13B): HunYuan dense's attention around Qwen2-MoE's routed experts (a
# softmax router, its Linear ``wg`` inside the gate module, kept in float32 by the family) and a
# shared expert named shared_mlp, summed in without a gate.
HUNYUAN_V1_MOE = dataclasses.replace(
    _moe_arch(
        "hunyuan_v1_moe",
        dataclasses.replace(
            _MOE,
            router_linear="wg",
            shared_gate="mlp.shared_mlp.gate_proj",
            shared_up="mlp.shared_mlp.up_proj",
            shared_down="mlp.shared_mlp.down_proj",
        ),
    ),
    qk_norms=HUNYUAN_V1_DENSE.qk_norms,
)

def _not_gated(base: Arch, model_type: str, up: str, down: str, **changes) -> Arch:
    """``base``'s attention with a non-gated MLP ``down(act(up(x)))``: down's input is a
    nonlinear function of up's output, so no scale folds from up into down (a stated gap)."""
    reason = (
        f"the MLP is not gated: {down} reads act({up}(x)), and a per-channel scale does not pass "
        "through the activation"
    )
    return dataclasses.replace(
        base,
        model_type=model_type,
        gate="",
        up=up,
        down=down,
        awq_mappings=base.awq_mappings[:2] + (_mapping(base.mlp_norm, up),),
        smoothquant_mappings=base.smoothquant_mappings[:1] + (_mapping(base.mlp_norm, up),),
        mlp_channels=PruneGroup(rows=(up,), cols=(down,)),
        scale_gaps=(ScaleGap((down,), reason),),
        **changes,
    )


# Arcee (AFM): Llama's layout, relu2 MLP not gated. Starcoder2: LayerNorms with biases, biases on
# every linear, a gelu MLP not gated (c_fc -> c_proj). StableLM: LayerNorms, Llama's gated MLP,
# partial RoPE (its config's partial_rotary_factor).
ARCEE = _not_gated(LLAMA, "arcee", "mlp.up_proj", "mlp.down_proj")
STARCODER2 = _not_gated(LLAMA, "starcoder2", "mlp.c_fc", "mlp.c_proj", norm_kind="layer")
# Jais 2 (Inception, 8B-70B): Llama's names around LayerNorms with biases, biases on every
# linear, a relu2 MLP not gated (Nemotron's).
JAIS2 = _not_gated(LLAMA, "jais2", "mlp.up_proj", "mlp.down_proj", norm_kind="layer")
# Apertus (Swiss AI, 8B and 70B): Llama's attention with q/k norms over one head, its norms named
# attention_layernorm / feedforward_layernorm, a non-gated MLP whose activation (xIELU) holds
# learned scalars per layer (RuntimeSpec.activation_module).
_APERTUS_INPUTS = _mapping("attention_layernorm", *_QKV)
APERTUS = _not_gated(
    dataclasses.replace(
        LLAMA,
        attn_norm="attention_layernorm",
        mlp_norm="feedforward_layernorm",
        awq_mappings=(_APERTUS_INPUTS, LLAMA.awq_mappings[1]),
        smoothquant_mappings=(_APERTUS_INPUTS,),
    ),
    "apertus", "mlp.up_proj", "mlp.down_proj", qk_norms=_QK_NORMS,
)
STABLELM = dataclasses.replace(LLAMA, model_type="stablelm", norm_kind="layer")
# Nemotron: LayerNorms with biases applied as (1 + w) (LayerNorm1P), a relu2 MLP not gated,
# partial RoPE.
NEMOTRON = _not_gated(
    LLAMA, "nemotron", "mlp.up_proj", "mlp.down_proj", norm_kind="layer", norm_form="1+w"
)

# OPT (the GPTQ/SmoothQuant papers' family, vLLM's test model): LayerNorms with biases, learned
# absolute positions added to the embedding (no rotary module), q/k/v and out_proj, a relu MLP
# not gated of fc1/fc2 directly in the layer, no GQA.
OPT = _not_gated(
    dataclasses.replace(
        LLAMA,
        layers="model.decoder.layers",
        embed="model.decoder.embed_tokens",
        final_norm="model.decoder.final_layer_norm",
        rotary="",
        o="self_attn.out_proj",
        attn_norm="self_attn_layer_norm",
        mlp_norm="final_layer_norm",
        awq_mappings=(
            _mapping("self_attn_layer_norm", *_QKV),
            _mapping("self_attn.v_proj", "self_attn.out_proj"),
        ),
        smoothquant_mappings=(_mapping("self_attn_layer_norm", *_QKV),),
        heads=dataclasses.replace(LLAMA.heads, cols=("self_attn.out_proj",)),
    ),
    "opt",
    "fc1",
    "fc2",
    norm_kind="layer",
    runtime=True,
    mlp_width_key="ffn_dim",
    kv_heads_key=None,
    positions="model.decoder.embed_positions",
    variants=(("do_layer_norm_before", False, "its LayerNorms come after the blocks"),
              ("layer_norm_elementwise_affine", False,
               "its LayerNorms have no weight a scale could fold into")),
)

# GPT-NeoX (Pythia): LayerNorms with biases, a fused query_key_value whose rows are per head,
# a gelu MLP not gated, partial RoPE, attention and MLP on their own norms (in parallel where
# use_parallel_residual); its checkpoints name the head embed_out (transformers renames it
# lm_head on load, so a streamed job refuses them and runs in memory). The runtime splits the
# fused output per head (Arch.qkv_per_head: every head has its own k and v, no GQA).
_PER_HEAD_QKV = (
    "query_key_value's v rows are interleaved with q and k per head, so no scale folds from "
    "them into attention.dense"
)
GPT_NEOX = dataclasses.replace(
    LLAMA,
    model_type="gpt_neox",
    layers="gpt_neox.layers",
    embed="gpt_neox.embed_in",
    final_norm="gpt_neox.final_layer_norm",
    rotary="gpt_neox.rotary_emb",
    attention="attention",
    q="attention.query_key_value",
    k="attention.query_key_value",
    v="attention.query_key_value",
    o="attention.dense",
    gate="",
    up="mlp.dense_h_to_4h",
    down="mlp.dense_4h_to_h",
    norm_kind="layer",
    awq_mappings=(
        _mapping("input_layernorm", "attention.query_key_value"),
        _mapping("post_attention_layernorm", "mlp.dense_h_to_4h"),
    ),
    smoothquant_mappings=(
        _mapping("input_layernorm", "attention.query_key_value"),
        _mapping("post_attention_layernorm", "mlp.dense_h_to_4h"),
    ),
    heads=PruneGroup(rows=(), cols=("attention.dense",), fused=("attention.query_key_value",)),
    mlp_channels=PruneGroup(rows=("mlp.dense_h_to_4h",), cols=("mlp.dense_4h_to_h",)),
    scale_gaps=(
        ScaleGap(("attention.dense",), _PER_HEAD_QKV),
        ScaleGap(("mlp.dense_4h_to_h",), "the MLP is not gated: dense_4h_to_h reads "
                 "act(dense_h_to_4h(x)), and a per-channel scale does not pass the activation"),
    ),
    runtime=True,
    qkv_per_head=True,
    kv_heads_key=None,
)

# Parallel blocks (Arch.parallel): x + attn(n(x)) + mlp(n(x)), one LayerNorm. Cohere: Llama's
# names, a LayerNorm without bias, interleaved RoPE, logits scaled. Phi (phi-1/1.5/2): q/k/v
# and dense with biases, a gelu MLP not gated (fc1 -> fc2), partial RoPE, a head with a bias.
COHERE = dataclasses.replace(
    LLAMA,
    model_type="cohere",
    mlp_norm=None,
    parallel=True,
    norm_kind="layer",
    awq_mappings=(
        _mapping("input_layernorm", *_QKV, "mlp.gate_proj", "mlp.up_proj"),
        _mapping("self_attn.v_proj", "self_attn.o_proj"),
        _mapping("mlp.up_proj", "mlp.down_proj"),
    ),
    smoothquant_mappings=(
        _mapping("input_layernorm", *_QKV, "mlp.gate_proj", "mlp.up_proj"),
        _mapping("mlp.up_proj", "mlp.down_proj"),
    ),
)
# Cohere 2 (Command R7B, Command A): Cohere's layers, sliding-window layers with RoPE and
# global layers without it (config layer_types; RuntimeSpec.rope_only_sliding)
COHERE2 = dataclasses.replace(COHERE, model_type="cohere2")
PHI = dataclasses.replace(
    _not_gated(LLAMA, "phi", "mlp.fc1", "mlp.fc2"),
    final_norm="model.final_layernorm",
    o="self_attn.dense",
    mlp_norm=None,
    parallel=True,
    norm_kind="layer",
    awq_mappings=(
        _mapping("input_layernorm", *_QKV, "mlp.fc1"),
        _mapping("self_attn.v_proj", "self_attn.dense"),
    ),
    smoothquant_mappings=(_mapping("input_layernorm", *_QKV, "mlp.fc1"),),
    heads=dataclasses.replace(LLAMA.heads, cols=("self_attn.dense",)),
)

# Gemma (1): Gemma2's (1 + w) norms and scaled embedding, Llama's layout (no post-norms).
GEMMA = dataclasses.replace(
    GEMMA2,
    model_type="gemma",
    mlp_norm=LLAMA.mlp_norm,
    awq_mappings=LLAMA.awq_mappings,
    smoothquant_mappings=LLAMA.smoothquant_mappings,
    post_norms=(),
)

# GLM (glm-4-9b) and GLM-4: separate q/k/v (biases), a fused gate_up_proj (rows [gate; up]) as
# Phi-3's; GLM-4 adds post-norms on both blocks' outputs (post_self_attn/post_mlp_layernorm)
# before the residual add. Partial, interleaved RoPE (their RuntimeSpecs).
GLM = dataclasses.replace(
    LLAMA,
    model_type="glm",
    gate=PHI3.gate,
    up=PHI3.up,
    awq_mappings=LLAMA.awq_mappings[:2] + PHI3.awq_mappings[2:],
    smoothquant_mappings=LLAMA.smoothquant_mappings[:1] + PHI3.smoothquant_mappings[1:],
    mlp_channels=PHI3.mlp_channels,
)
GLM4 = dataclasses.replace(
    GLM,
    model_type="glm4",
    post_norms=("post_self_attn_layernorm", "post_mlp_layernorm"),
)

ARCHS: dict[str, Arch] = {
    a.model_type: a
    for a in (
        LLAMA,
        QWEN2,
        QWEN3,
        MISTRAL,
        MINISTRAL,
        MINISTRAL3,
        CWM,
        GRANITE,
        GRANITE_SWA,
        GEMMA2,
        GEMMA3_TEXT,
        VAULTGEMMA,
        PHI3,
        OLMO2,
        OLMO3,
        EXAONE4,
        SMOLLM3,
        SEED_OSS,
        ERNIE4_5,
        HUNYUAN_V1_DENSE,
        HELIUM,
        ARCEE,
        APERTUS,
        JAIS2,
        STARCODER2,
        STABLELM,
        NEMOTRON,
        COHERE,
        COHERE2,
        PHI,
        OPT,
        GPT_NEOX,
        GEMMA,
        GLM,
        GLM4,
        MIXTRAL,
        QWEN3_MOE,
        QWEN2_MOE,
        OLMOE,
        GLM4_MOE,
        SOLAR_OPEN,
        DOTS1,
        ERNIE4_5_MOE,
        DEEPSEEK_V3,
        DEEPSEEK_V2,
        GLM4_MOE_LITE,
        MINIMAX_M2,
        PHIMOE,
        EXAONE_MOE,
        HUNYUAN_V1_MOE,
        GRANITEMOE,
        GPT_OSS,
    )
}

# Multimodal checkpoints (Gemma 3 4B+, Mistral 3, LLaVA, Qwen2/2.5/3-VL: a ``text_config``
# naming a family above, a vision tower and a projector) whose text causal LM is compressed
# (``compress.io.wrapped``). Each layout maps the text model's tree prefixes to the prefixes its
# tensors are stored under, tried in order: save_pretrained writes the first for Gemma 3,
# Mistral 3 and LLaVA (transformers 4 and 5 alike); checkpoints saved by transformers 4.52-4.57
# (and Qwen3-VL's) hold the second, the 5.x module tree's names, which are also what
# transformers 5 matches a quantization_config's names against (``WRAPPER_TREE``); Qwen2-VL and
# Qwen2.5-VL store the text model under its own names (the third, tried only for the text
# models of ``WRAPPED_TEXT_FAMILIES``: another wrapper over such names is a text-only
# checkpoint under a wrong config) beside ``visual.*``. A tensor
# under none of the chosen layout's prefixes (the vision tower, the projector) is copied as
# stored.
WRAPPED_TEXT_LAYOUTS: tuple[tuple[tuple[str, str], ...], ...] = (
    (("model.", "language_model.model."), ("lm_head.", "language_model.lm_head.")),
    (("model.", "model.language_model."), ("lm_head.", "lm_head.")),
    (("model.", "model."), ("lm_head.", "lm_head.")),
)
# Text models of multimodal checkpoints that compute as an entry's family on text: M-RoPE
# (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) rotates a text token by the same position in each of its
# sections, which is 1-D RoPE (``compress.io.wrapped.text_config_of`` drops the sections).
WRAPPED_TEXT_FAMILIES: dict[str, str] = {
    "qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3"}
WRAPPER_TREE: tuple[tuple[str, str], ...] = WRAPPED_TEXT_LAYOUTS[1]
# the wrapper's own module prefix above its parts in transformers 5 (``model.vision_tower``),
# absent in stored names of the first layout and in vLLM's tree
WRAPPER_MODEL_PREFIX = "model."

# Multi-token-prediction (MTP) modules that some checkpoints store beside the causal LM, for
# speculative decoding: GLM-4.5/4.6 (and DeepSeek-V3) store whole decoder layers after the last,
# ``num_nextn_predict_layers`` of them; ERNIE-4.5-MoE stores ``mtp_*`` modules (``mtp_block``,
# ``mtp_emb_norm``...). transformers does not build them (its model classes list them as
# unexpected names to ignore) and vLLM reads them only for its MTP speculative decoding. Their
# tensors are carried through a job as stored (``compress.io.wrapped``).
MTP_LAYERS_KEY = "num_nextn_predict_layers"
MTP_MODULE_PREFIX = "mtp"  # a module name component starting with it is an MTP module

# Config attributes holding one entry per decoder layer: a pass that drops layers keeps the
# kept layers' entries (else a reload would give a kept layer a dropped one's type).
PER_LAYER_CONFIG_KEYS: tuple[str, ...] = ("layer_types", "no_rope_layers", "mlp_layer_types",
                                          "layer_rope_theta")

# The default ``ignore`` of every pass config: the output head is never compressed by default.
DEFAULT_IGNORE: tuple[str, ...] = (LLAMA.lm_head,)


_LLAMA_RT = RuntimeSpec()
# attention_multiplier is the attention module's own scaling
_GRANITE_RT = RuntimeSpec(
    embed_multiplier="embedding_multiplier",
    residual_multiplier="residual_multiplier",
    logits_divisor="logits_scaling",
)
_COHERE_RT = RuntimeSpec(
    norm_eps_key="layer_norm_eps",
    logits_multiplier="logit_scale",
    rope_interleaved=True,
    rope_table_interleaved=True,
    unsupported_flags=("use_qk_norm",),
)
_GEMMA2_RT = RuntimeSpec(
    activation_key="hidden_activation",
    attn_softcap="attn_logit_softcapping",
    final_softcap="final_logit_softcapping",
)
RUNTIME_SPECS: dict[str, RuntimeSpec] = {
    "llama": _LLAMA_RT,
    "qwen2": _LLAMA_RT,  # q/k/v biases are the linears' own
    "mistral": _LLAMA_RT,  # sliding window from the config
    "ministral": _LLAMA_RT,  # sliding and full layers (layer_types)
    "cwm": _LLAMA_RT,  # sliding and full layers (layer_types)
    "ministral3": _LLAMA_RT,  # YaRN tables; llama_4_scaling_beta falls back (runtime.families)
    "qwen3": _LLAMA_RT,  # q/k norms: Arch.qk_norms
    "granite": _GRANITE_RT,
    "granite_swa": dataclasses.replace(_GRANITE_RT, rope_theta_layers="layer_rope_theta"),
    "smollm3": RuntimeSpec(rope_layers="no_rope_layers"),  # NoPE every 4th layer
    "seed_oss": _LLAMA_RT,  # q/k/v and o biases are the linears' own
    # q/k norms after RoPE; NTK-alpha RoPE labelled "dynamic"
    "hunyuan_v1_dense": RuntimeSpec(qk_norm_after_rope=True, dynamic_alpha_is_static=True),
    "gemma": RuntimeSpec(activation_key="hidden_act"),  # (1 + w) norms, scaled embedding
    # the fused qkv_proj / gate_up_proj are the runtime's stacked calls; Phi-4-mini rotates
    # 3/4 of each head (partial_rotary_factor, from the config)
    "phi3": _LLAMA_RT,
    "ernie4_5": RuntimeSpec(rope_interleaved=True),
    "helium": RuntimeSpec(rope_interleaved=True),
    "arcee": _LLAMA_RT,  # the non-gated MLP: Arch.gate is "" (relu2: families.ACTIVATIONS)
    "apertus": RuntimeSpec(activation_module="mlp.act_fn"),  # xIELU: learned, per layer
    # LayerNorms (Arch.norm_kind); StableLM's partial RoPE from its config
    "starcoder2": RuntimeSpec(norm_eps_key="norm_epsilon"),
    "jais2": RuntimeSpec(norm_eps_key="layer_norm_eps"),
    # parallel blocks (Arch.parallel), LayerNorms; per-head q/k LayerNorms fall back
    "cohere": _COHERE_RT,
    # Cohere's arithmetic; its global layers (no sliding window) do not rotate q/k
    "cohere2": dataclasses.replace(_COHERE_RT, rope_only_sliding=True),
    "phi": RuntimeSpec(norm_eps_key="layer_norm_eps", unsupported_flags=("qk_layernorm",)),
    "nemotron": RuntimeSpec(norm_eps_key="norm_eps"),  # (1 + w) LayerNorms: Arch
    "stablelm": RuntimeSpec(
        norm_eps_key="layer_norm_eps", unsupported_flags=("use_parallel_residual", "qk_layernorm")
    ),
    # interleaved RoPE over half of each head; GLM-4 adds post-norms (Arch)
    "glm": RuntimeSpec(rope_interleaved=True),
    "glm4": RuntimeSpec(rope_interleaved=True),
    # no norms before the blocks, post-norms after them (Arch); OLMo2/3's q/k norms over all
    # heads, EXAONE 4's over one
    "olmo2": _LLAMA_RT,
    "olmo3": RuntimeSpec(rope_per_layer_type=True),
    "exaone4": RuntimeSpec(rope_only_sliding=True),
    "gemma2": _GEMMA2_RT,
    "vaultgemma": _GEMMA2_RT,
    "gemma3_text": dataclasses.replace(_GEMMA2_RT, rope_per_layer_type=True),
    # attention as Llama (Qwen3-MoE: q/k norms); the MLP is the family's own sparse block
    "mixtral": _LLAMA_RT,
    "qwen3_moe": _LLAMA_RT,
    "qwen2_moe": _LLAMA_RT,  # the shared expert is inside the sparse block
    "olmoe": RuntimeSpec(unsupported_flags=("clip_qkv",)),  # q/k norms over all heads: Arch
    "minimax_m2": _LLAMA_RT,  # OLMoE's q/k norms; partial RoPE (rotary_dim) from the config
    # LayerNorms (Arch.norm_kind) with rms_norm_eps; its released longrope falls back
    "phimoe": _LLAMA_RT,
    # partial RoPE (half of each head, rotated as halves) from the config; the dense first
    # layers run as a dense family's (compress.arch.layer_arch)
    "glm4_moe": RuntimeSpec(unsupported_flags=("use_qk_norm",)),
    "dots1": _LLAMA_RT,
    "solar_open": _LLAMA_RT,  # Llama's attention around GLM-4-MoE's block
    "exaone_moe": RuntimeSpec(rope_only_sliding=True),  # EXAONE 4's NoPE global layers
    "hunyuan_v1_moe": RuntimeSpec(qk_norm_after_rope=True, dynamic_alpha_is_static=True),
    "granitemoe": _GRANITE_RT,
    "gpt_oss": _LLAMA_RT,  # sinks (Arch.attention_sinks); YaRN over half-width tables
    "ernie4_5_moe": RuntimeSpec(rope_interleaved=True),
    # latent attention (Arch.latent_attention: compress.runtime.latent); the MoE block as GLM's
    "deepseek_v3": RuntimeSpec(rope_interleave_key="rope_interleave"),
    "glm4_moe_lite": RuntimeSpec(rope_interleave_key="rope_interleave"),
    # interleaved pairs always; its rotary module's complex angles are the tables (rope_tables)
    "deepseek_v2": RuntimeSpec(rope_interleaved=True),
    # per-head fused qkv (Arch.qkv_per_head), partial RoPE from the config, LayerNorms
    "gpt_neox": RuntimeSpec(norm_eps_key="layer_norm_eps",
                            parallel_residual_key="use_parallel_residual"),
    # learned positions (Arch.positions) from row 2; OPT-350m's norms after the blocks and its
    # projection in and out of a narrower embedding fall back
    "opt": RuntimeSpec(
        activation_key="activation_function",
        norm_eps_key="layer_norm_eps",
        position_offset=2,
        required_flags=("do_layer_norm_before", "layer_norm_elementwise_affine"),
        hidden_size_keys=("word_embed_proj_dim",),
    ),
}
