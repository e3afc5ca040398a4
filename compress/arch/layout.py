"""The shape of a family adapter entry (``compress.arch``): where a family's modules are, which
linears scale folds and prune groups take, its MoE layout and what the runtime needs
(``RuntimeSpec``). The entries themselves are in ``compress.arch.families``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
    # the Linear inside ``router`` that holds its weights, where the router is a module around
    # one (HunYuan-MoE's gate.wg: an nn.Linear a pass would otherwise target); "" where the
    # router holds its own weight
    router_linear: str = ""
    # (gate, up, down) of the gated MLP of Linears in the layers whose MLP is dense (Qwen2/3-MoE's
    # mlp_only_layers, GLM-4-MoE's and DeepSeek's first_k_dense_replace, ERNIE-4.5-MoE's
    # moe_layer_start_index): ``compress.arch.layer_arch`` describes those layers with it
    dense: tuple[str, str, str] = ("", "", "")
    # How the experts module holds its parameters: "rows" as above; "interleaved_columns"
    # (GPT-OSS): ``gate_up [E, H, 2I]`` whose columns alternate gate, up, and ``down [E, I, H]``,
    # read through ``compress.arch.expert_weights`` (every reader of the fused parameters is)
    fused_layout: Literal["rows", "interleaved_columns"] = "rows"
    # attributes of the experts module holding per-expert biases (``gate_up_bias [E, 2I]`` in
    # the layout's column order, ``down_bias [E, H]``); "" for none
    gate_up_bias: str = ""
    down_bias: str = ""
    # the gated unit between gate/up and down: "act": ``act(gate) * up`` with the module's
    # ``act``; "clamped_swiglu" (GPT-OSS): gate clamped above at the module's ``limit``, up to
    # +-limit, ``gate * sigmoid(alpha * gate) * (up + 1)`` with its ``alpha``
    glu: Literal["act", "clamped_swiglu"] = "act"

    @property
    def router_weights(self) -> str:
        """The path of the module that holds the router's weight (never quantized)."""
        return f"{self.router}.{self.router_linear}" if self.router_linear else self.router

    @property
    def shared_readers(self) -> tuple[str, ...]:
        """The shared expert's Linears that read the MLP norm's output (none without one)."""
        return tuple(p for p in (self.shared_gate, self.shared_up, self.shared_scalar_gate) if p)


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (DeepSeek-V2/V3) beyond ``Arch.q`` (the query's first
    projection), ``k`` (the KV latent and the shared rotary key), ``v`` (the latent's expansion
    into per-head keys and values) and ``o``: module paths in a decoder layer and the config
    attributes of its widths."""

    q_b: str  # the query's expansion after q_latent_norm ("": the query is one projection)
    q_latent_norm: str
    kv_latent_norm: str  # on the KV latent, before ``Arch.v``
    # config attributes: per head, the key channels without and with RoPE and the value
    # channels; the KV latent's width
    widths: tuple[str, str, str, str] = (
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")


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
    # config attribute with the KV heads per layer (GQA); None: every query head has its own
    # k and v (GPT-NeoX, OPT: a num_key_value_heads in their configs is not read)
    kv_heads_key: str | None = "num_key_value_heads"
    # learned absolute position embedding added to the token embedding (OPT), model-level path;
    # "" for none (then ``rotary`` rotates q/k, or nothing does where it is "" too)
    positions: str = ""
    # linears that neither read nor write the residual stream (MLA's up-projections from its
    # latents, q_b_proj and kv_b_proj): quantized as any linear, in ``linears``
    inner_linears: tuple[str, ...] = ()
    # multi-head latent attention (DeepSeek-V2/V3): the cache holds a compressed latent and a
    # shared rotary key, not per-head keys and values; values come out of kv_b_proj per head
    # interleaved with keys, so no fold or rotation reaches the value rows
    latent_attention: LatentAttention | None = None
    # a learned logit per query head that joins every softmax over the keys and takes its share
    # of the weight without a value (GPT-OSS's and Granite SWA's attention sinks): its path in
    # a decoder layer; the runtime adds it to its softmax, head pruning slices it with the heads
    attention_sinks: str = ""

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
        return tuple(dict.fromkeys(self.hidden_readers + self.inner_linears + self.hidden_writers))


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
    # the MLP's activation as a module of the layer, called as it is: one with learned
    # parameters of its own per layer (Apertus's xIELU), which no function by name computes;
    # "" where ``activation_key`` names a plain function (runtime.families.ACTIVATIONS)
    activation_module: str = ""
    embed_multiplier: str | None = None  # config attribute multiplying the embeddings
    residual_multiplier: str | None = None  # config attribute scaling each block's output
    logits_divisor: str | None = None  # config attribute dividing the logits
    attn_softcap: str | None = None  # config attribute: scores -> cap * tanh(scores / cap)
    final_softcap: str | None = None  # config attribute: logits -> cap * tanh(logits / cap)
    rope_per_layer_type: bool = False  # rotary module takes the layer type (own base per type)
    rope_layers: str | None = None  # config attribute: per layer, 1 rotates q/k, 0 does not
    # config attribute: per layer, its RoPE base (0: no RoPE); ``Arch.rotary`` then holds one
    # rotary module per base, each with its config (Granite SWA)
    rope_theta_layers: str | None = None
    # with a sliding window set, only the sliding layers rotate q/k (EXAONE 4's global: NoPE)
    rope_only_sliding: bool = False
    rope_interleaved: bool = False  # RoPE pairs are channels (2i, 2i + 1), not (i, i + r/2)
    # config attribute that, true (the default), makes the pairs interleaved (DeepSeek-V3's)
    rope_interleave_key: str | None = None
    qk_norm_after_rope: bool = False  # per-head q/k norms on the rotated q/k (HunYuan), not before
    # RoPE labelled "dynamic" with an ``alpha`` is NTK-alpha with static tables (HunYuan's
    # checkpoints; transformers gives it its own type), not length-dependent dynamic NTK
    dynamic_alpha_is_static: bool = False
    norm_eps_key: str = "rms_norm_eps"  # config attribute: every norm's epsilon
    logits_multiplier: str | None = None  # config attribute multiplying the logits
    # the rotary module's tables repeat each angle twice in a row ([f0, f0, f1, f1, ...],
    # Cohere) rather than cat(f, f)
    rope_table_interleaved: bool = False
    # config attribute that, true, makes the blocks parallel (GPT-NeoX's use_parallel_residual:
    # x + attn(n1(x)) + mlp(n2(x)), each block on its own norm of the same x)
    parallel_residual_key: str | None = None
    # the learned position embedding's row of position 0 (Arch.positions; OPT's offset 2)
    position_offset: int = 0
    # config attributes that must be true (else a variant the runtime does not run: OPT-350m's
    # norms after the blocks), and ones that must equal hidden_size (OPT's word_embed_proj_dim:
    # otherwise a projection into and out of the stack)
    required_flags: tuple[str, ...] = ()
    hidden_size_keys: tuple[str, ...] = ()
    # config attributes that, set, describe a variant the runtime does not run (then it falls
    # back to transformers): StableLM's parallel residual and per-head q/k LayerNorms
    unsupported_flags: tuple[str, ...] = ()
