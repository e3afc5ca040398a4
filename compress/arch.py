"""Where the architecture of a transformers causal LM is, per ``model_type``: the one place that
knows module names.

An ``Arch`` entry says where the decoder layers, embedding, final norm, lm_head and rotary tables
are; the names of the attention and MLP projections inside a decoder layer; which producer feeds
which linears (the AWQ and SmoothQuant scale-folding mappings) and the form of its norms; which
linears prune together; and whether the runtime runs it. Passes and the runtime take every name
from here (a test fails on an architecture name anywhere else), so a new family is one entry.

How each family's peculiarities are handled (scale folds:
``compress.quant.calibrated.migrate_scales``; pruning: ``compress.prune``):

* Llama, Qwen2 (q/k/v biases: divided with their rows), Mistral, Granite (embedding, attention,
  residual and logit multipliers: constants no fold or slice touches), Qwen3 (q_norm/k_norm over
  one head's ``head_dim``: after the projections, shared by all heads, so neither the folds nor
  head pruning touch them).
* Gemma2/Gemma3 text: ``(1 + w)`` RMSNorms (``norm_form="1+w"``): dividing the effective weight
  by s gives ``w' = (1 + w) / s - 1``. The MLP reads ``pre_feedforward_layernorm``; the
  ``post_*`` norms sit on a block's output before the residual add (``post_norms``), feed no
  linear, and are sliced with the hidden size. The embedding is multiplied by
  ``sqrt(hidden_size)`` (``embed_scaling``): hidden-size pruning sets the new factor and
  multiplies every post-norm by the same ratio, which scales the whole residual stream, to which
  the pre-norms and the final norm are invariant. Soft-capping and sliding windows are config
  constants.
* Phi-3: fused ``qkv_proj`` (rows ``[q; k; v]``) and ``gate_up_proj`` (rows ``[gate; up]``). The
  entry's q/k/v (gate/up) name the fused linear; ``Mapping.part`` selects the rows that feed a
  consumer (v -> o uses the v rows, up -> down the up half; ``producer_rows``), and
  ``PruneGroup.fused`` slices heads/channels in every part consistently.
* OLMo2: norms *after* attention and MLP (``post_norms``), none before: q/k/v and gate/up read
  the residual stream itself, so no operation can absorb a scale for them. Those mappings are
  absent and listed in ``scale_gaps``; AWQ and SmoothQuant report them (the linears are still
  quantized, unscaled). q_norm/k_norm span all heads (``qk_norm_span="heads"``): head pruning
  slices them with the q/k rows.
* OLMo3 (OLMo2's layout) and EXAONE 4 (the same post-norms, q/k norms over one head).
* Gemma (1): Gemma's ``(1 + w)`` norms and scaled embedding in Llama's layout. Hidden-size
  pruning refuses it: no post-norm can compensate the new embedding factor.
* SmolLM3 (layers without RoPE: ``no_rope_layers``, kept per layer when layers are dropped,
  ``PER_LAYER_CONFIG_KEYS``), Seed-OSS, ERNIE 4.5 and HunYuan dense: Llama's names and data
  flow (biases and q/k norms where the config has them).
* GLM and GLM-4: separate q/k/v, Phi-3's fused ``gate_up_proj``; GLM-4 adds post-norms.
* Mixtral and Qwen3-MoE (``Arch.moe``): quantized and exported with every expert
  (tests/quant/test_moe.py); prune.layers drops their layers, the passes that would slice
  the fused experts refuse them; the runtime runs its attention around the family's own sparse
  block (Qwen3-MoE with its q/k norms).

Any other ``model_type`` is refused by ``arch_for`` with the pass and the model_type named.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from compress.core.errors import ConfigError

NormForm = Literal["w", "1+w"]  # y = w * n(x) (Llama RMSNorm), or y = (1 + w) * n(x) (Gemma)
# "rms": n(x) = x / rms(x) (RMSNorm); "layer": n(x) = (x - mean) / std, plus a bias where the
# norm has one (LayerNorm: StableLM, Starcoder2). A scale folds into both (weight and bias
# divided); a rotation commutes with neither mean nor bias (rotate.hadamard refuses them).
NormKind = Literal["rms", "layer"]
# Rows of a fused producer that feed a mapping's consumers: "" all of it; "v": the v rows of a
# fused [q; k; v] linear; "up": the up rows of a fused [gate; up] linear.
FusedPart = Literal["", "v", "up"]


@dataclass(frozen=True)
class Mapping:
    """The output of ``producer`` (its ``part`` rows if fused) is the input of every
    ``consumers`` linear, so a per-channel scale can be divided out of the producer and multiplied
    into the consumers' columns. Paths are relative to one decoder layer; the producer is a norm
    or a Linear."""

    producer: str
    consumers: tuple[str, ...]
    part: FusedPart = ""


@dataclass(frozen=True)
class ScaleGap:
    """Consumers whose input no operation can absorb a scale for (``reason`` says why): the scale
    passes quantize them unscaled and report it."""

    consumers: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class PruneGroup:
    """Linears (paths inside a decoder layer) that lose the same units together: output rows of
    ``rows`` and ``kv_rows``, input columns of ``cols``. For heads, ``rows`` are indexed by query
    head and ``kv_rows`` by KV head; elsewhere ``kv_rows`` is empty. ``fused`` linears stack
    their parts' rows (heads: ``[q; k; v]``; MLP channels: ``[gate; up]``) and lose the same
    units in every part."""

    rows: tuple[str, ...]
    cols: tuple[str, ...]
    kv_rows: tuple[str, ...] = ()
    fused: tuple[str, ...] = ()


@dataclass(frozen=True)
class Moe:
    """A sparse mixture-of-experts MLP (transformers 5 layout). Paths are from one decoder
    layer. ``fused`` (the experts module) holds the 3-D parameters ``gate_up [E, 2I, H]``
    (gate rows first, then up rows) and ``down [E, H, I]`` and is called
    ``experts(x [T, H], top_k_index [T, k], top_k_weights [T, k])``; ``router`` picks the
    experts and is never quantized. Checkpoints (the compressed-tensors export, vLLM, the hub)
    store one Linear per expert and projection:
    ``<checkpoint_block>.experts.<e>.<gate|up|down name>.weight``."""

    block: str  # the sparse MoE block (its name in the transformers 5 module tree)
    fused: str  # the fused experts module
    router: str
    gate_up: str  # attribute of the experts module
    down: str
    act: str  # the experts module's activation (applied to gate)
    checkpoint_block: str  # the block's name in checkpoints
    checkpoint_projections: tuple[str, str, str]  # (gate, up, down) per-expert Linear names
    # A shared expert every token takes (Qwen2-MoE): a dense gated MLP of nn.Linears, its output
    # times sigmoid(shared_scalar_gate(x)), a [1, H] Linear kept in float as the router is
    shared_gate: str = ""
    shared_up: str = ""
    shared_down: str = ""
    shared_scalar_gate: str = ""

    @property
    def shared_readers(self) -> tuple[str, ...]:
        """The shared expert's Linears that read the MLP norm's output (none without one)."""
        return tuple(p for p in (self.shared_gate, self.shared_up, self.shared_scalar_gate) if p)


@dataclass(frozen=True)
class Arch:
    """One family's layout. Model-level paths are from the ``*ForCausalLM`` module; layer-level
    paths are from one decoder layer. With fused projections q/k/v (gate/up) name the fused
    linear."""

    model_type: str
    layers: str  # the decoder nn.ModuleList
    embed: str
    final_norm: str
    lm_head: str
    rotary: str  # module returning (cos, sin) for positions: the runtime's tables
    attention: str  # the attention module (head_dim, scaling, layer_idx)
    q: str
    k: str
    v: str
    o: str
    gate: str
    up: str
    down: str
    attn_norm: str | None  # norm before attention (None: there is none, OLMo2)
    mlp_norm: str | None  # norm before the MLP
    norm_form: NormForm
    awq_mappings: tuple[Mapping, ...]
    smoothquant_mappings: tuple[Mapping, ...]
    heads: PruneGroup
    mlp_channels: PruneGroup
    runtime: bool  # compress.runtime.engine runs it (else the transformers fallback)
    moe: Moe | None = None  # the MLP is a sparse mixture of experts (then gate/up/down are "")
    post_norms: tuple[str, ...] = ()  # hidden-size norms on a block's output (Gemma, OLMo2)
    qk_norms: tuple[str, ...] = ()  # norms on the q and k projections' outputs
    # "head": their weight is [head_dim], shared by the heads; "heads": [H * D] and [KVH * D]
    qk_norm_span: Literal["head", "heads"] = "head"
    scale_gaps: tuple[ScaleGap, ...] = ()  # consumers no fold can reach, with the reason
    embed_scaling: Literal["none", "sqrt_hidden"] = "none"  # embedding output x sqrt(hidden)
    norm_kind: NormKind = "rms"  # every hidden-size norm's (the final one's too)
    # attention and MLP both read attn_norm's output and add to the residual together (Phi,
    # Cohere): mlp_norm is None, and the MLP's input mappings start at attn_norm
    parallel: bool = False
    mlp_width_key: str = "intermediate_size"  # config attribute: the dense MLP's width
    # (config attribute, value, what it means): a variant whose data flow the mappings and prune
    # groups do not describe (OPT-350m's norms after the blocks); the passes that fold or slice
    # along them (check_paths) refuse it
    variants: tuple[tuple[str, object, str], ...] = ()
    # the fused qkv linear's rows are per head ([q_h; k_h; v_h] for each head h, GPT-NeoX), not
    # [q; k; v]: no v-rows fold, and prune.attention_heads refuses it
    qkv_per_head: bool = False

    @property
    def layer_prefix(self) -> str:
        """``model.layers.``: prefix of decoder layer module names (add the index and a dot)."""
        return self.layers + "."

    @property
    def layer_norms(self) -> tuple[str, ...]:
        """Every hidden-size norm of a decoder layer (before and after the blocks)."""
        pre = tuple(n for n in (self.attn_norm, self.mlp_norm) if n is not None)
        return pre + self.post_norms

    @property
    def hidden_readers(self) -> tuple[str, ...]:
        """Linears whose input columns are the residual (hidden) channels."""
        h, m = self.heads, self.mlp_channels
        return h.rows + h.kv_rows + h.fused + m.rows + m.fused

    @property
    def hidden_writers(self) -> tuple[str, ...]:
        """Linears whose output rows write to the residual stream."""
        return self.heads.cols + self.mlp_channels.cols

    @property
    def linears(self) -> tuple[str, ...]:
        """Every Linear of a decoder layer, once."""
        return tuple(dict.fromkeys(self.hidden_readers + self.hidden_writers))


def _mapping(producer: str, *consumers: str, part: FusedPart = "") -> Mapping:
    return Mapping(producer, consumers, part)


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
    awq_mappings=(
        _mapping("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        _mapping("self_attn.v_proj", "self_attn.o_proj"),
        _mapping("post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj"),
        _mapping("mlp.up_proj", "mlp.down_proj"),
    ),
    smoothquant_mappings=(
        _mapping("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        _mapping("post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj"),
        _mapping("mlp.up_proj", "mlp.down_proj"),
    ),
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

# Qwen2 (q/k/v biases), Mistral and Granite: Llama's module names and data flow.
QWEN2, MISTRAL, GRANITE = (
    dataclasses.replace(LLAMA, model_type=t) for t in ("qwen2", "mistral", "granite")
)
QWEN3 = dataclasses.replace(LLAMA, model_type="qwen3", qk_norms=_QK_NORMS)

# Gemma2: (1 + w) norms; attention -> post_attention_layernorm -> residual,
# pre_feedforward_layernorm -> MLP -> post_feedforward_layernorm -> residual.
GEMMA2 = dataclasses.replace(
    LLAMA,
    model_type="gemma2",
    mlp_norm="pre_feedforward_layernorm",
    norm_form="1+w",
    awq_mappings=(
        _mapping("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        _mapping("self_attn.v_proj", "self_attn.o_proj"),
        _mapping("pre_feedforward_layernorm", "mlp.gate_proj", "mlp.up_proj"),
        _mapping("mlp.up_proj", "mlp.down_proj"),
    ),
    smoothquant_mappings=(
        _mapping("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        _mapping("pre_feedforward_layernorm", "mlp.gate_proj", "mlp.up_proj"),
        _mapping("mlp.up_proj", "mlp.down_proj"),
    ),
    post_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
    embed_scaling="sqrt_hidden",
)
GEMMA3_TEXT = dataclasses.replace(GEMMA2, model_type="gemma3_text", qk_norms=_QK_NORMS)

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
        ScaleGap(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), _RESIDUAL_INPUT),
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
STABLELM = dataclasses.replace(LLAMA, model_type="stablelm", norm_kind="layer")
# Nemotron: LayerNorms with biases applied as (1 + w) (LayerNorm1P), a relu2 MLP not gated,
# partial RoPE.
NEMOTRON = _not_gated(
    LLAMA, "nemotron", "mlp.up_proj", "mlp.down_proj", norm_kind="layer", norm_form="1+w"
)

# OPT (the GPTQ/SmoothQuant papers' family, vLLM's test model): LayerNorms with biases, learned
# absolute positions (no rotary module: the runtime falls back to transformers), q/k/v and
# out_proj, a relu MLP not gated of fc1/fc2 directly in the layer.
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
            _mapping("self_attn_layer_norm", *LLAMA.awq_mappings[0].consumers),
            _mapping("self_attn.v_proj", "self_attn.out_proj"),
        ),
        smoothquant_mappings=(_mapping("self_attn_layer_norm", *LLAMA.awq_mappings[0].consumers),),
        heads=dataclasses.replace(LLAMA.heads, cols=("self_attn.out_proj",)),
    ),
    "opt",
    "fc1",
    "fc2",
    norm_kind="layer",
    runtime=False,
    mlp_width_key="ffn_dim",
    variants=(("do_layer_norm_before", False, "its LayerNorms come after the blocks"),),
)

# GPT-NeoX (Pythia): LayerNorms with biases, a fused query_key_value whose rows are per head,
# a gelu MLP not gated, partial RoPE, attention and MLP on their own norms (in parallel where
# use_parallel_residual); its checkpoints name the head embed_out (transformers renames it
# lm_head on load, so a streamed job refuses them and runs in memory). Passes only: the runtime
# falls back.
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
    runtime=False,
    qkv_per_head=True,
)

# Parallel blocks (Arch.parallel): x + attn(n(x)) + mlp(n(x)), one LayerNorm. Cohere: Llama's
# names, a LayerNorm without bias, interleaved RoPE, logits scaled. Phi (phi-1/1.5/2): q/k/v
# and dense with biases, a gelu MLP not gated (fc1 -> fc2), partial RoPE, a head with a bias.
_PARALLEL_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
COHERE = dataclasses.replace(
    LLAMA,
    model_type="cohere",
    mlp_norm=None,
    parallel=True,
    norm_kind="layer",
    awq_mappings=(
        _mapping("input_layernorm", *_PARALLEL_QKV, "mlp.gate_proj", "mlp.up_proj"),
        _mapping("self_attn.v_proj", "self_attn.o_proj"),
        _mapping("mlp.up_proj", "mlp.down_proj"),
    ),
    smoothquant_mappings=(
        _mapping("input_layernorm", *_PARALLEL_QKV, "mlp.gate_proj", "mlp.up_proj"),
        _mapping("mlp.up_proj", "mlp.down_proj"),
    ),
)
PHI = dataclasses.replace(
    _not_gated(LLAMA, "phi", "mlp.fc1", "mlp.fc2"),
    final_norm="model.final_layernorm",
    o="self_attn.dense",
    mlp_norm=None,
    parallel=True,
    norm_kind="layer",
    awq_mappings=(
        _mapping("input_layernorm", *_PARALLEL_QKV, "mlp.fc1"),
        _mapping("self_attn.v_proj", "self_attn.dense"),
    ),
    smoothquant_mappings=(_mapping("input_layernorm", *_PARALLEL_QKV, "mlp.fc1"),),
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
        GRANITE,
        GEMMA2,
        GEMMA3_TEXT,
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
        STARCODER2,
        STABLELM,
        NEMOTRON,
        COHERE,
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
    )
}

# Config attributes holding one entry per decoder layer: a pass that drops layers keeps the
# kept layers' entries (else a reload would give a kept layer a dropped one's type).
PER_LAYER_CONFIG_KEYS: tuple[str, ...] = ("layer_types", "no_rope_layers")

# The default ``ignore`` of every pass config: the output head is never compressed by default.
DEFAULT_IGNORE: tuple[str, ...] = (LLAMA.lm_head,)


def model_type(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def arch_for(model: nn.Module, what: str) -> Arch:
    """The entry for ``model``'s ``model_type``, or a ConfigError naming ``what`` (the pass)."""
    kind = model_type(model)
    arch = ARCHS.get(kind)
    if arch is None:
        raise ConfigError(
            f"{what}: model_type {kind!r} ({type(model).__name__}) is not supported; supported: "
            f"{', '.join(ARCHS)}. A new family is one entry in compress/arch.py (issue 17)"
        )
    return arch


def sparse_layers(model: nn.Module, arch: Arch) -> list[int]:
    """Indices of the decoder layers whose MLP is ``arch.moe``'s sparse block. Qwen2/3-MoE
    configs can make some layers dense (``mlp_only_layers``, ``decoder_sparse_step``): those
    hold a plain MLP of Linears, which the passes treat as any dense layer's."""
    if arch.moe is None:
        return []
    found = []
    for index, layer in enumerate(model.get_submodule(arch.layers)):
        try:
            layer.get_submodule(arch.moe.fused)
        except AttributeError:
            continue
        found.append(index)
    return found


def float_only_modules(model: nn.Module) -> set[str]:
    """Module names no quantization pass targets: the MoE routers and the shared experts' [1, H]
    scalar gates (they pick and weigh experts; quantizing them changes the routing)."""
    arch = ARCHS.get(model_type(model))
    if arch is None or arch.moe is None:
        return set()
    paths = [p for p in (arch.moe.router, arch.moe.shared_scalar_gate) if p]
    return {f"{arch.layer_prefix}{i}.{p}" for i in sparse_layers(model, arch) for p in paths}


def runtime_model_types() -> tuple[str, ...]:
    return tuple(t for t, a in ARCHS.items() if a.runtime)


def decoder_layers(model: nn.Module, what: str = "compress") -> nn.ModuleList:
    """The decoder stack (non-empty) of ``model``, or a ConfigError naming ``what``."""
    arch = arch_for(model, what)
    try:
        layers = model.get_submodule(arch.layers)
    except AttributeError:
        layers = None
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ConfigError(
            f"{what}: {type(model).__name__} (model_type {arch.model_type!r}) has no non-empty "
            f"{arch.layers} decoder stack"
        )
    return layers


def head_dim_of(layer: nn.Module) -> int:
    """``head_dim`` of the attention module inside a decoder layer (GPT-NeoX: ``head_size``;
    0 if none has one)."""
    for module in layer.modules():
        for name in ("head_dim", "head_size"):
            if isinstance(getattr(module, name, None), int):
                return int(getattr(module, name))
    return 0


def output_weight_key(model: nn.Module) -> str | None:
    """State-dict key of the output head's weight (transformers' ``get_output_embeddings``, so
    it holds for any family), or None without one."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None:
        return None
    return next((f"{n}.weight" for n, m in model.named_modules() if m is head), None)


def producer_rows(layer: nn.Module, mapping: Mapping) -> slice | None:
    """Rows of ``mapping.producer`` that feed its consumers (None: all of them), from the shapes
    of one decoder layer: a fused ``[q; k; v]`` has ``o.in_features`` q rows and equal k and v
    parts; a fused ``[gate; up]`` has two halves of ``down.in_features`` rows."""
    if not mapping.part:
        return None
    n_out = layer.get_submodule(mapping.producer).weight.shape[0]
    n_in = layer.get_submodule(mapping.consumers[0]).weight.shape[1]
    width = (n_out - n_in) // 2 if mapping.part == "v" else n_in  # kv rows, or I
    if width <= 0 or (mapping.part == "up" and n_out != 2 * n_in):
        raise ConfigError(
            f"{mapping.producer} has {n_out} rows, which do not split into a {mapping.part!r} "
            f"part feeding {mapping.consumers[0]} ({n_in} inputs): the compress/arch.py entry "
            "does not match this model"
        )
    return slice(n_out - width, n_out)


def check_paths(model: nn.Module, arch: Arch, paths: tuple[str, ...], what: str) -> None:
    """ConfigError naming ``what``, the model_type and every path of ``paths`` (inside a decoder
    layer) that layer 0 lacks: the entry and the model disagree, found before any work."""
    for key, value, meaning in arch.variants:
        if getattr(model.config, key, None) == value:
            raise ConfigError(
                f"{what}: model_type {arch.model_type!r} with {key}={value!r}: {meaning}, a "
                "variant the compress/arch.py entry does not describe, so this pass refuses it "
                "(quantize.gptq and the RTN passes do not depend on it)"
            )
    layer = decoder_layers(model, what)[0]
    missing = []
    for path in dict.fromkeys(paths):
        try:
            layer.get_submodule(path)
        except AttributeError:
            missing.append(path)
    if missing:
        raise ConfigError(
            f"{what}: model_type {arch.model_type!r} ({type(model).__name__}): the decoder layer "
            f"has no {', '.join(missing)}, which the compress/arch.py entry names; the checkpoint "
            "is a variant the entry does not describe (fix the entry or the model)"
        )


def mapping_paths(mappings: tuple[Mapping, ...]) -> tuple[str, ...]:
    return tuple(p for m in mappings for p in (m.producer, *m.consumers))


@torch.no_grad()
def set_embedding_scale(model: nn.Module, arch: Arch) -> float:
    """For ``embed_scaling="sqrt_hidden"`` (Gemma): set the embedding's factor to
    ``sqrt(config.hidden_size)``, what ``from_pretrained`` builds from the config, and return
    new / old factor (1.0 for other families). The factor is a non-persistent buffer, so a
    changed hidden size must update it here or the in-memory model and its reload disagree."""
    if arch.embed_scaling == "none":
        return 1.0
    embed = model.get_submodule(arch.embed)
    old, new = float(embed.embed_scale), float(model.config.hidden_size) ** 0.5
    embed.embed_scale.fill_(new)
    embed.scalar_embed_scale = new
    return new / old


# ---- runtime facts per family ------------------------------------------------------------
# What compress.runtime needs beyond the module names above: the decoder-layer arithmetic that
# differs between families. Module paths are from one decoder layer; the other strings name
# attributes of the transformers config.
@dataclass(frozen=True)
class RuntimeSpec:
    """How one family's decoder computes, for the runtime (``compress.runtime.engine``), beyond its
    ``Arch`` (which has the norms: ``norm_form``, ``qk_norms``, ``post_norms``, and
    ``embed_scaling``). Sliding-window layers come from the config (``sliding_window``,
    ``layer_types``), not from here.
    """

    activation_key: str = "hidden_act"  # config attribute naming the gated MLP's activation
    embed_multiplier: str | None = None  # config attribute multiplying the embeddings
    residual_multiplier: str | None = None  # config attribute scaling each block's output
    logits_divisor: str | None = None  # config attribute dividing the logits
    attn_softcap: str | None = None  # config attribute: scores -> cap * tanh(scores / cap)
    final_softcap: str | None = None  # config attribute: logits -> cap * tanh(logits / cap)
    rope_per_layer_type: bool = False  # rotary module takes the layer type (own base per type)
    rope_layers: str | None = None  # config attribute: per layer, 1 rotates q/k, 0 does not
    # with a sliding window set, only the sliding layers rotate q/k (EXAONE 4's global: NoPE)
    rope_only_sliding: bool = False
    rope_interleaved: bool = False  # RoPE pairs are channels (2i, 2i + 1), not (i, i + r/2)
    qk_norm_after_rope: bool = False  # per-head q/k norms on the rotated q/k (HunYuan), not before
    # RoPE labelled "dynamic" with an ``alpha`` is NTK-alpha with static tables (HunYuan's
    # checkpoints; transformers gives it its own type), not length-dependent dynamic NTK
    dynamic_alpha_is_static: bool = False
    norm_eps_key: str = "rms_norm_eps"  # config attribute: every norm's epsilon
    logits_multiplier: str | None = None  # config attribute multiplying the logits
    # the rotary module's tables repeat each angle twice in a row ([f0, f0, f1, f1, ...],
    # Cohere) rather than cat(f, f)
    rope_table_interleaved: bool = False
    # config attributes that, set, describe a variant the runtime does not run (then it falls
    # back to transformers): StableLM's parallel residual and per-head q/k LayerNorms
    unsupported_flags: tuple[str, ...] = ()


_LLAMA_RT = RuntimeSpec()
_GEMMA2_RT = RuntimeSpec(
    activation_key="hidden_activation",
    attn_softcap="attn_logit_softcapping",
    final_softcap="final_logit_softcapping",
)
RUNTIME_SPECS: dict[str, RuntimeSpec] = {
    "llama": _LLAMA_RT,
    "qwen2": _LLAMA_RT,  # q/k/v biases are the linears' own
    "mistral": _LLAMA_RT,  # sliding window from the config
    "qwen3": _LLAMA_RT,  # q/k norms: Arch.qk_norms
    # attention_multiplier is the attention module's own scaling
    "granite": RuntimeSpec(
        embed_multiplier="embedding_multiplier",
        residual_multiplier="residual_multiplier",
        logits_divisor="logits_scaling",
    ),
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
    # LayerNorms (Arch.norm_kind); StableLM's partial RoPE from its config
    "starcoder2": RuntimeSpec(norm_eps_key="norm_epsilon"),
    # parallel blocks (Arch.parallel), LayerNorms; per-head q/k LayerNorms fall back
    "cohere": RuntimeSpec(
        norm_eps_key="layer_norm_eps",
        logits_multiplier="logit_scale",
        rope_interleaved=True,
        rope_table_interleaved=True,
        unsupported_flags=("use_qk_norm",),
    ),
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
    "gemma3_text": dataclasses.replace(_GEMMA2_RT, rope_per_layer_type=True),
    # attention as Llama (Qwen3-MoE: q/k norms); the MLP is the family's own sparse block
    "mixtral": _LLAMA_RT,
    "qwen3_moe": _LLAMA_RT,
    "qwen2_moe": _LLAMA_RT,  # the shared expert is inside the sparse block
    "olmoe": RuntimeSpec(unsupported_flags=("clip_qkv",)),  # q/k norms over all heads: Arch
}
