"""Where the architecture of a transformers causal LM is, per ``model_type``: the one place that
knows module names.

An ``Arch`` entry says where the decoder layers, embedding, final norm, lm_head and rotary tables
are; the names of the attention and MLP projections inside a decoder layer; which producer feeds
which linears (the AWQ and SmoothQuant scale-folding mappings) and the form of its norms
(``y = w * n(x)``, or Gemma's ``y = (1 + w) * n(x)``); which linears prune together; and whether
the runtime runs it. Passes and the runtime take every name from here (a test fails on an
architecture name anywhere else), so a new family is one entry.

Llama (SmolLM2) is the fully tested entry. Mixtral and Qwen3-MoE (``Arch.moe``) are quantized
and exported with every expert (tests/quant/test_moe.py); pruning refuses them. Qwen2, Qwen3,
Mistral and Granite share Llama's module names and ran every pass before this adapter existed,
so they keep doing so (runtime: fallback); their own tests and the other families (Gemma,
Phi-3, OLMo2) are issue 17. Any other
``model_type`` is refused by ``arch_for`` with the pass and the model_type named.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from torch import nn

from compress.core.errors import ConfigError

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
    runtime: bool  # compress.runtime.engine runs it (else the transformers fallback)
    moe: Moe | None = None  # the MLP is a sparse mixture of experts (then gate/up/down are "")

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

def _moe_arch(model_type: str, moe: Moe) -> Arch:
    """Llama attention (same names) with ``moe`` as the MLP: the MLP has no dense projections,
    so no MLP mappings (AWQ/SmoothQuant smooth the attention inputs only). Pruning does not
    know experts yet: the experts module stands in the MLP prune group so that the prune
    passes' nn.Linear check refuses the model instead of leaving the experts unpruned."""
    return dataclasses.replace(
        LLAMA,
        model_type=model_type,
        gate="",
        up="",
        down="",
        awq_mappings=LLAMA.awq_mappings[:2],
        smoothquant_mappings=LLAMA.smoothquant_mappings[:1],
        mlp_channels=PruneGroup(rows=(moe.fused,), cols=(moe.fused,)),
        runtime=False,
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
    dataclasses.replace(_MOE, checkpoint_block="block_sparse_moe",
                        checkpoint_projections=("w1", "w3", "w2")),
)
QWEN3_MOE = _moe_arch("qwen3_moe", _MOE)

ARCHS: dict[str, Arch] = {
    a.model_type: a
    for a in (
        LLAMA,
        # Same module names as Llama; they ran every pass before this table existed (issue 17's
        # survey). Not run by the runtime: Qwen3's q/k norms and Granite's multipliers are not
        # in it, and no runtime test covers Qwen2/Mistral yet.
        *(
            dataclasses.replace(LLAMA, model_type=t, runtime=False)
            for t in ("qwen2", "qwen3", "mistral", "granite")
        ),
        MIXTRAL,
        QWEN3_MOE,
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
