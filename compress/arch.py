"""Where the architecture of a transformers causal LM is, per ``model_type``: the one place that
knows module names.

An ``Arch`` entry says where the decoder layers, embedding, final norm, lm_head and rotary tables
are; the names of the attention and MLP projections inside a decoder layer; which producer feeds
which linears (the AWQ and SmoothQuant scale-folding mappings) and the form of its norms
(``y = w * n(x)``, or Gemma's ``y = (1 + w) * n(x)``); which linears prune together; and whether
the runtime runs it. Passes and the runtime take every name from here (a test fails on an
architecture name anywhere else), so a new family is one entry.

Llama (SmolLM2) is the fully tested entry. Qwen2, Qwen3, Mistral and Granite share its module
names and ran every pass before this adapter existed, so they keep doing so; the runtime runs
them and Gemma 2/3 (``RUNTIME_SPECS``). Pass tests for them and the other families (Gemma,
Phi-3, OLMo2, MoE) are issue 17. Any other ``model_type`` is refused by ``arch_for`` with the
pass and the model_type named.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from torch import nn

from compress.errors import ConfigError

NormForm = Literal["w", "1+w"]  # y = w * n(x) (Llama RMSNorm), or y = (1 + w) * n(x) (Gemma)


@dataclass(frozen=True)
class Mapping:
    """The output of ``producer`` is the input of every ``consumers`` linear, so a per-channel
    scale can be divided out of the producer and multiplied into the consumers' columns. Paths
    are relative to one decoder layer; the producer is a norm or a Linear."""

    producer: str
    consumers: tuple[str, ...]


@dataclass(frozen=True)
class PruneGroup:
    """Linears (paths inside a decoder layer) that lose the same units together: output rows of
    ``rows`` and ``kv_rows``, input columns of ``cols``. For heads, ``rows`` are indexed by query
    head and ``kv_rows`` by KV head; elsewhere ``kv_rows`` is empty."""

    rows: tuple[str, ...]
    cols: tuple[str, ...]
    kv_rows: tuple[str, ...] = ()


@dataclass(frozen=True)
class Arch:
    """One family's layout. Model-level paths are from the ``*ForCausalLM`` module; layer-level
    paths are from one decoder layer."""

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
    attn_norm: str  # norm before attention
    mlp_norm: str  # norm before the MLP
    norm_form: NormForm
    awq_mappings: tuple[Mapping, ...]
    smoothquant_mappings: tuple[Mapping, ...]
    heads: PruneGroup
    mlp_channels: PruneGroup
    runtime: bool  # compress.runtime runs it (else the transformers fallback)

    @property
    def layer_prefix(self) -> str:
        """``model.layers.``: prefix of decoder layer module names (add the index and a dot)."""
        return self.layers + "."

    @property
    def layer_norms(self) -> tuple[str, ...]:
        return (self.attn_norm, self.mlp_norm)

    @property
    def hidden_readers(self) -> tuple[str, ...]:
        """Linears whose input columns are the residual (hidden) channels."""
        return self.heads.rows + self.heads.kv_rows + self.mlp_channels.rows

    @property
    def hidden_writers(self) -> tuple[str, ...]:
        """Linears whose output rows write to the residual stream."""
        return self.heads.cols + self.mlp_channels.cols


def _mapping(producer: str, *consumers: str) -> Mapping:
    return Mapping(producer, consumers)


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

ARCHS: dict[str, Arch] = {
    a.model_type: a
    for a in (
        LLAMA,
        # Same module names as Llama; they ran every pass before this table existed (issue 17's
        # survey). The runtime runs them with the per-family facts in RUNTIME_SPECS below
        # (Qwen2's biases, Qwen3's q/k norms, Mistral's window, Granite's multipliers).
        *(
            dataclasses.replace(LLAMA, model_type=t)
            for t in ("qwen2", "qwen3", "mistral", "granite")
        ),
    )
}

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
    """``head_dim`` of the attention module inside a decoder layer (0 if none has one)."""
    return next((int(m.head_dim) for m in layer.modules() if hasattr(m, "head_dim")), 0)


def output_weight_key(model: nn.Module) -> str | None:
    """State-dict key of the output head's weight (transformers' ``get_output_embeddings``, so
    it holds for any family), or None without one."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None:
        return None
    return next((f"{n}.weight" for n, m in model.named_modules() if m is head), None)


# ---- runtime facts per family ------------------------------------------------------------
# What compress.runtime needs beyond the module names above: the decoder-layer arithmetic that
# differs between families. Module paths are from one decoder layer; the other strings name
# attributes of the transformers config.
@dataclass(frozen=True)
class RuntimeSpec:
    """How one family's decoder computes, for the runtime (``compress/runtime.py``).

    Norms take ``Arch.norm_form``; every layer is pre-norm (``attn_norm``, ``mlp_norm``) with an
    optional post-norm of the block's output before the residual add (Gemma 2/3). Sliding-window
    layers come from the config (``sliding_window``, ``layer_types``), not from here.
    """

    query_norm: str | None = None  # RMSNorm over head_dim of each query head, before RoPE (Qwen3)
    key_norm: str | None = None  # the same for keys
    post_attn_norm: str | None = None  # norm of the attention output, before the residual add
    post_mlp_norm: str | None = None  # norm of the MLP output, before the residual add
    activation_key: str = "hidden_act"  # config attribute naming the gated MLP's activation
    embed_sqrt_hidden: bool = False  # embeddings times sqrt(hidden_size), in the model dtype
    embed_multiplier: str | None = None  # config attribute multiplying the embeddings
    residual_multiplier: str | None = None  # config attribute scaling each block's output
    logits_divisor: str | None = None  # config attribute dividing the logits
    attn_softcap: str | None = None  # config attribute: scores -> cap * tanh(scores / cap)
    final_softcap: str | None = None  # config attribute: logits -> cap * tanh(logits / cap)
    rope_per_layer_type: bool = False  # rotary module takes the layer type (own base per type)


_LLAMA_RT = RuntimeSpec()
_GEMMA2_RT = RuntimeSpec(
    post_attn_norm="post_attention_layernorm",
    post_mlp_norm="post_feedforward_layernorm",
    activation_key="hidden_activation",
    embed_sqrt_hidden=True,
    attn_softcap="attn_logit_softcapping",
    final_softcap="final_logit_softcapping",
)
RUNTIME_SPECS: dict[str, RuntimeSpec] = {
    "llama": _LLAMA_RT,
    "qwen2": _LLAMA_RT,  # q/k/v biases are the linears' own
    "mistral": _LLAMA_RT,  # sliding window from the config
    "qwen3": RuntimeSpec(query_norm="self_attn.q_norm", key_norm="self_attn.k_norm"),
    # attention_multiplier is the attention module's own scaling
    "granite": RuntimeSpec(
        embed_multiplier="embedding_multiplier",
        residual_multiplier="residual_multiplier",
        logits_divisor="logits_scaling",
    ),
    "gemma2": _GEMMA2_RT,
    "gemma3_text": dataclasses.replace(
        _GEMMA2_RT,
        query_norm="self_attn.q_norm",
        key_norm="self_attn.k_norm",
        rope_per_layer_type=True,
    ),
}

# Gemma 2/3 layouts for the runtime where no entry above names them yet. Their pre-attention norm
# is input_layernorm, the pre-MLP norm pre_feedforward_layernorm (post_attention_layernorm is the
# attention output's post-norm), both (1 + w). An entry defined above wins (setdefault).
for _t in ("gemma2", "gemma3_text"):
    _mlp_norm = "pre_feedforward_layernorm"
    ARCHS.setdefault(
        _t,
        dataclasses.replace(
            LLAMA,
            model_type=_t,
            mlp_norm=_mlp_norm,
            norm_form="1+w",
            awq_mappings=(
                LLAMA.awq_mappings[:2]
                + (_mapping(_mlp_norm, LLAMA.gate, LLAMA.up),)
                + LLAMA.awq_mappings[3:]
            ),
            smoothquant_mappings=(
                LLAMA.smoothquant_mappings[:1]
                + (_mapping(_mlp_norm, LLAMA.gate, LLAMA.up),)
                + LLAMA.smoothquant_mappings[2:]
            ),
        ),
    )
