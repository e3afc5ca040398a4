"""Where the architecture of a transformers causal LM is, per ``model_type``: the one place that
knows module names.

An ``Arch`` entry says where the decoder layers, embedding, final norm, lm_head and rotary tables
are; the names of the attention and MLP projections inside a decoder layer; which producer feeds
which linears (the AWQ and SmoothQuant scale-folding mappings) and the form of its norms; which
linears prune together; and whether the runtime runs it. Passes and the runtime take every name
from here (a test fails on an architecture name anywhere else), so a new family is one entry.

How each family's peculiarities are handled (scale folds:
``compress.quant.calibrated.migrate_scales``; pruning: ``compress.prune``):

* Llama, Qwen2 (q/k/v biases: divided with their rows), Mistral, Ministral, Ministral 3,
  Granite (embedding, attention, residual and logit multipliers: constants no fold or slice
  touches; Granite SWA adds attention sinks, ``Arch.attention_sinks``, sliced with the heads,
  and a RoPE base per layer), Qwen3 (q_norm/k_norm over
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
  block (Qwen3-MoE with its q/k norms; MiniMax-M2 with OLMoE's, Mixtral's checkpoint names
  and a sigmoid router whose correction bias is the block's buffer; Phi-3.5-MoE with
  LayerNorms and its router a Linear named gate in checkpoints). GLM-4-MoE (GLM-4.5/4.6)
  and dots.llm1 add a shared
  expert without a gate, sigmoid routing with a trained score-correction bias (a persistent
  buffer: ``compress.io.stream.materialize`` reads it as stored) and dense first layers;
  K-EXAONE (exaone_moe) dots.llm1's block with EXAONE 4's NoPE global layers;
  HunYuan-MoE (hunyuan_v1_moe) HunYuan dense's attention around a shared expert without a
  gate and a softmax router whose Linear sits inside the gate module (``Moe.router_linear``);
  GraniteMoE (granitemoe) Granite's multipliers around Mixtral's block name, its checkpoints
  storing the experts fused (``compress.io.names.checkpoints_store_experts_fused``);
  ERNIE-4.5-MoE the same shared expert, its selection bias a parameter under the router (stored
  beside it: ``compress.io.names.checkpoint_renamer`` applies transformers' renames to MoE
  names too). GPT-OSS holds its experts transposed (``gate_up [E, H, 2I]`` with gate and up
  columns alternating, ``down [E, I, H]``) with biases, through a clamped SwiGLU
  (``Moe.fused_layout``, ``Moe.glu``): every reader and writer of fused experts goes through
  ``expert_shape``, ``expert_weights``, ``expert_biases`` and ``fused_experts``, so the passes,
  the rotation and the export see one ``[out, in]`` weight per expert and projection; its
  checkpoints store the experts as the module holds them (released in MXFP4:
  ``compress.io.checkpoint`` dequantizes them as read), and its attention adds a learned sink
  logit per head to every softmax (``Arch.attention_sinks``). A layer an MoE config
  leaves dense (``Moe.dense``: mlp_only_layers, first_k_dense_replace, moe_layer_start_index)
  is described by ``layer_arch``: AWQ and SmoothQuant scale its MLP, the rotation turns it and
  the runtime runs it as a dense family's.
* DeepSeek-V3 (R1, Kimi K2, Moonlight), DeepSeek-V2 and GLM-4.7-Flash (glm4_moe_lite, whose
  dense layers are a per-layer list): GLM-4-MoE's experts around multi-head
  latent attention (``Arch.latent_attention``): the attention norm feeds q_a_proj (q_proj where
  the config has no ``q_lora_rank``: ``CONFIG_VARIANTS``, which ``arch_for`` applies) and
  kv_a_proj_with_mqa; q_b_proj and kv_b_proj (``Arch.inner_linears``) read their own latent
  norms, which absorb the AWQ/SmoothQuant scales; o_proj's inputs are a stated gap. The
  rotation turns the residual stream only, fp8 KV-cache scales are refused (the cache holds a
  latent); the runtime runs both (``compress.runtime.latent``: the latent in the cache, the
  expansion absorbed).

Checkpoints may store multi-token-prediction modules beside the causal LM (GLM-4.5/4.6,
DeepSeek-V3, ERNIE-4.5-MoE): ``mtp_tensors`` names them from the config; ``compress.io.wrapped``
carries them through as stored.

Multimodal checkpoints whose ``text_config`` names one of these (Gemma 3 4B+, Mistral 3, LLaVA;
Qwen2/2.5/3-VL through ``WRAPPED_TEXT_FAMILIES``) are compressed as that text model:
``WRAPPED_TEXT_LAYOUTS`` says where their shards store it, ``compress.io.wrapped`` does the rest.

Any other ``model_type`` is refused by ``arch_for`` with the pass and the model_type named.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from compress.arch.families import (
    ARCHS,
    CONFIG_VARIANTS,
    DEFAULT_IGNORE,
    LLAMA,
    MTP_LAYERS_KEY,
    MTP_MODULE_PREFIX,
    PER_LAYER_CONFIG_KEYS,
    PHI3,
    RUNTIME_SPECS,
    WRAPPED_TEXT_FAMILIES,
    WRAPPED_TEXT_LAYOUTS,
    WRAPPER_MODEL_PREFIX,
    WRAPPER_TREE,
)
from compress.arch.layout import (
    Arch,
    FusedPart,
    Mapping,
    Moe,
    NormForm,
    NormKind,
    PruneGroup,
    RuntimeSpec,
    ScaleGap,
)
from compress.core.errors import ConfigError

__all__ = [
    "ARCHS", "DEFAULT_IGNORE", "LLAMA", "PER_LAYER_CONFIG_KEYS", "PHI3", "RUNTIME_SPECS",
    "WRAPPED_TEXT_FAMILIES", "WRAPPED_TEXT_LAYOUTS", "WRAPPER_MODEL_PREFIX", "WRAPPER_TREE", "Arch",
    "FusedPart", "Mapping", "Moe", "NormForm", "NormKind", "PruneGroup", "RuntimeSpec", "ScaleGap",
    "arch_for", "check_paths", "decoder_layers", "dense_layer_settings", "dense_view",
    "expert_bias_names", "expert_biases", "expert_shape", "expert_weights", "float_only_modules",
    "fused_experts", "head_dim_of", "is_sparse", "layer_arch", "mapping_paths", "model_type",
    "mtp_tensors", "output_weight_key", "producer_rows", "routing_problem",
    "runtime_model_types", "set_embedding_scale", "sparse_layers",
]  # fmt: skip


def model_type(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def mtp_tensors(config: dict, names) -> tuple[str, ...]:
    """The stored tensor ``names`` of a supported family's checkpoint (``config``: its config.json)
    that belong to multi-token-prediction modules, not to the causal LM (``MTP_LAYERS_KEY``):
    the decoder layers numbered from ``num_hidden_layers`` on, as many as the config declares,
    and modules whose name has a component starting with ``mtp``. A tensor of a layer past
    those is none of them: the config does not match the shards, which the loaders refuse."""
    arch = ARCHS.get(config.get("model_type"))
    if arch is None:
        return ()
    depth, extra = config.get("num_hidden_layers"), config.get(MTP_LAYERS_KEY)
    if not (isinstance(depth, int) and isinstance(extra, int)):
        depth, extra = 0, 0

    def is_mtp(name: str) -> bool:
        index, _, rest = name.removeprefix(arch.layer_prefix).partition(".")
        if name.startswith(arch.layer_prefix) and rest and index.isdigit():
            return depth <= int(index) < depth + extra
        return any(part.startswith(MTP_MODULE_PREFIX) for part in name.split(".")[:-1])

    return tuple(n for n in names if is_mtp(n))


def arch_for(model: nn.Module, what: str) -> Arch:
    """The entry for ``model``'s ``model_type`` (the ``CONFIG_VARIANTS`` entry its config
    matches, if any), or a ConfigError naming ``what`` (the pass)."""
    kind = model_type(model)
    arch = ARCHS.get(kind)
    for key, value, variant in CONFIG_VARIANTS.get(kind, ()):
        if getattr(model.config, key, ...) == value:
            arch = variant
    if arch is None:
        raise ConfigError(
            f"{what}: model_type {kind!r} ({type(model).__name__}) is not supported; supported: "
            f"{', '.join(ARCHS)}. A new family is one entry in compress/arch/families.py (issue 17)"
        )
    return arch


def sparse_layers(model: nn.Module, arch: Arch) -> list[int]:
    """Indices of the decoder layers whose MLP is ``arch.moe``'s sparse block. Qwen2/3-MoE
    configs can make some layers dense (``mlp_only_layers``, ``decoder_sparse_step``): those
    hold a plain MLP of Linears, which the passes treat as any dense layer's."""
    if arch.moe is None:
        return []
    return [i for i, layer in enumerate(model.get_submodule(arch.layers)) if is_sparse(layer, arch)]


def is_sparse(layer: nn.Module, arch: Arch) -> bool:
    """Whether the decoder ``layer`` holds ``arch.moe``'s experts module."""
    if arch.moe is None:
        return False
    try:
        layer.get_submodule(arch.moe.fused)
    except AttributeError:
        return False
    return True


@functools.cache
def dense_view(arch: Arch) -> Arch:
    """``arch`` (an MoE family's entry) for its layers with a dense MLP: the same attention and
    its mappings, ``arch.moe.dense``'s gated MLP with Llama's MLP mappings (the MLP norm feeds
    gate and up, up feeds down) and prune group; no experts, no shared expert."""
    gate, up, down = arch.moe.dense
    shared = {arch.moe.shared_gate, arch.moe.shared_up, arch.moe.shared_down} - {""}
    mlp_in, up_down = Mapping(arch.mlp_norm, (gate, up)), Mapping(up, (down,))

    def attention_only(mappings: tuple[Mapping, ...]) -> tuple[Mapping, ...]:
        return tuple(m for m in mappings if not {m.producer, *m.consumers} & shared)

    return dataclasses.replace(
        arch,
        gate=gate, up=up, down=down,
        awq_mappings=attention_only(arch.awq_mappings) + (mlp_in, up_down),
        smoothquant_mappings=attention_only(arch.smoothquant_mappings) + (mlp_in, up_down),
        mlp_channels=PruneGroup(rows=(gate, up), cols=(down,)),
        scale_gaps=tuple(g for g in arch.scale_gaps if not set(g.consumers) & shared),
        moe=None,
    )


def with_clamped_values(arch: Arch, config) -> Arch:
    """``arch`` for a model whose ``config`` clamps q, k and v (OLMo's and OLMoE's
    ``clip_qkv``): the clamp sits between the value projection and the output projection, so a
    scale folded from one into the other, or a rotation of the value heads, would change the
    model. The v -> o mappings become scale gaps (quantized unscaled, said so); a config
    without the clamp gets ``arch`` itself."""
    clip = getattr(config, "clip_qkv", None)
    if not clip:
        return arch
    reason = (f"clip_qkv={clip} clamps {arch.v}'s outputs before {arch.o}: a scale folded "
              "across the clamp would change the model; not scaled")

    def split(mappings: tuple[Mapping, ...]) -> tuple[tuple[Mapping, ...], tuple[ScaleGap, ...]]:
        kept = tuple(m for m in mappings if m.producer != arch.v)
        return kept, tuple(ScaleGap(m.consumers, reason) for m in mappings if m.producer == arch.v)

    awq, awq_gaps = split(arch.awq_mappings)
    smooth, smooth_gaps = split(arch.smoothquant_mappings)
    gaps = tuple(dict.fromkeys(arch.scale_gaps + awq_gaps + smooth_gaps))
    return dataclasses.replace(arch, awq_mappings=awq, smoothquant_mappings=smooth,
                               scale_gaps=gaps)


def layer_arch(arch: Arch, layer: nn.Module) -> Arch:
    """The entry that describes the decoder ``layer``: ``arch`` itself, or for an MoE family's
    layer with a dense MLP (``sparse_layers`` leaves it out) its ``dense_view``."""
    if arch.moe is None or is_sparse(layer, arch):
        return arch
    return dense_view(arch)


def dense_layer_settings(config, sparse: list[bool]) -> dict[str, object]:
    """Settings of an MoE family's ``config`` that make it build the layers ``sparse`` flags as
    sparse and the others dense, for a config whose layers were dropped (``prune.layers``):
    Qwen2/3-MoE's dense indices (mlp_only_layers, every layer a candidate), DeepSeek's,
    GLM-4-MoE's and dots.llm1's count of dense first layers, ERNIE-4.5-MoE's range of sparse
    ones. A per-layer list (glm4_moe_lite's mlp_layer_types) is a ``PER_LAYER_CONFIG_KEYS``
    entry instead. The caller checks the result: a pattern a family's keys cannot express (a
    dense layer after a sparse one under first_k_dense_replace) builds other layers."""
    count = len(sparse)
    sparse_at = [i for i, s in enumerate(sparse) if s]
    settings: dict[str, object] = {}
    if hasattr(config, "mlp_only_layers"):
        settings.update(mlp_only_layers=[i for i in range(count) if not sparse[i]],
                        decoder_sparse_step=1)
    if hasattr(config, "first_k_dense_replace"):
        settings["first_k_dense_replace"] = sparse_at[0] if sparse_at else count
        if hasattr(config, "moe_layer_freq"):
            settings["moe_layer_freq"] = 1
    if hasattr(config, "moe_layer_start_index"):
        settings.update(moe_layer_start_index=sparse_at[0] if sparse_at else count,
                        moe_layer_end_index=sparse_at[-1] if sparse_at else count - 1,
                        moe_layer_interval=1)
    return settings


def routing_problem(model: nn.Module) -> str | None:
    """What is wrong with an MoE model's routing settings, or None: each router must pick at
    least one and at most all of its experts (transformers builds either model and fails, or
    computes an MLP of zeros, only at the first forward)."""
    arch = ARCHS.get(model_type(model))
    layers = sparse_layers(model, arch) if arch is not None else []
    for index in layers:  # per layer: HunYuan-MoE's moe_topk may be a list
        router = model.get_submodule(arch.layers)[index].get_submodule(arch.moe.router)
        picked, count = getattr(router, "top_k", None), getattr(router, "num_experts", None)
        if isinstance(picked, int) and isinstance(count, int) and not 1 <= picked <= count:
            return (f"each token is routed to {picked} of {count} experts; the number per "
                    f"token must be 1 to {count} (layer {index})")
    return None


def float_only_modules(model: nn.Module) -> set[str]:
    """Module names no quantization pass targets: the MoE routers and the shared experts' [1, H]
    scalar gates (they pick and weigh experts; quantizing them changes the routing)."""
    arch = ARCHS.get(model_type(model))
    if arch is None or arch.moe is None:
        return set()
    paths = [p for p in (arch.moe.router_weights, arch.moe.shared_scalar_gate) if p]
    return {f"{arch.layer_prefix}{i}.{p}" for i in sparse_layers(model, arch) for p in paths}


def expert_shape(experts: nn.Module, moe: Moe) -> tuple[int, int, int]:
    """(experts, hidden, intermediate) of a float fused experts module of ``moe``'s layout."""
    count, rows, cols = getattr(experts, moe.down).shape
    return (count, rows, cols) if moe.fused_layout == "rows" else (count, cols, rows)


def expert_weights(experts: nn.Module, moe: Moe, e: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert ``e``'s (gate ``[I, H]``, up ``[I, H]``, down ``[H, I]``) weights, ``[out, in]``
    as an ``nn.Linear`` holds them: views of the fused parameters (no copy) in either layout
    (``Moe.fused_layout``; GPT-OSS's are strided: its gate and up columns alternate)."""
    gate_up, down = getattr(experts, moe.gate_up)[e], getattr(experts, moe.down)[e]
    if moe.fused_layout == "rows":
        inter = gate_up.shape[0] // 2
        return gate_up[:inter], gate_up[inter:], down
    return gate_up[:, 0::2].T, gate_up[:, 1::2].T, down.T


def expert_biases(experts: nn.Module, moe: Moe, e: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Expert ``e``'s (gate ``[I]``, up ``[I]``, down ``[H]``) biases (views), or None where the
    family's experts have none (``Moe.gate_up_bias``)."""
    if not moe.gate_up_bias:
        return None
    gate_up, down = getattr(experts, moe.gate_up_bias)[e], getattr(experts, moe.down_bias)[e]
    if moe.fused_layout == "rows":
        inter = gate_up.shape[0] // 2
        return gate_up[:inter], gate_up[inter:], down
    return gate_up[0::2], gate_up[1::2], down


def expert_bias_names(model: nn.Module) -> set[str]:
    """Parameter names of the fused experts' biases (GPT-OSS's ``[E, 2I]`` and ``[E, H]``: a
    vector per expert in a 2-D parameter, not a weight matrix)."""
    arch = ARCHS.get(model_type(model))
    if arch is None or arch.moe is None or not arch.moe.gate_up_bias:
        return set()
    return {f"{arch.layer_prefix}{i}.{arch.moe.fused}.{attr}" for i in sparse_layers(model, arch)
            for attr in (arch.moe.gate_up_bias, arch.moe.down_bias)}


def fused_experts(moe: Moe, weights: list, biases: list | None = None) -> dict[str, torch.Tensor]:
    """The experts module's parameters (attribute -> tensor) in ``moe``'s layout from each
    expert's (gate, up, down) weights (``expert_weights``' form) and, where the family has
    them, biases (``expert_biases``' form): the inverse of those two."""
    if moe.fused_layout == "rows":
        out = {moe.gate_up: torch.stack([torch.cat([g, u]) for g, u, _ in weights]),
               moe.down: torch.stack([d for _, _, d in weights])}
    else:  # [H, I] gate and up columns -> [H, I, 2] -> [H, 2I]: g0 u0 g1 u1 ...
        out = {moe.gate_up: torch.stack([torch.stack([g.T, u.T], -1).flatten(-2)
                                         for g, u, _ in weights]),
               moe.down: torch.stack([d.T for _, _, d in weights])}
    if biases is not None and moe.gate_up_bias:
        join = torch.cat if moe.fused_layout == "rows" else (
            lambda pair: torch.stack(pair, -1).flatten(-2))
        out[moe.gate_up_bias] = torch.stack([join([g, u]) for g, u, _ in biases])
        out[moe.down_bias] = torch.stack([d for _, _, d in biases])
    return {name: tensor.contiguous() for name, tensor in out.items()}


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
        count = getattr(getattr(model, "config", None), "num_hidden_layers", None)
        raise ConfigError(
            f"{what}: {type(model).__name__} (model_type {arch.model_type!r}) has no non-empty "
            f"{arch.layers} decoder stack" + (
                f" (its config says num_hidden_layers: {count}; set it to the number of layers "
                "the checkpoint stores)" if count == 0 else "")
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
            f"part feeding {mapping.consumers[0]} ({n_in} inputs): the compress.arch entry "
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
                "variant the compress.arch entry does not describe, so this pass refuses it "
                "(quantize.gptq and the RTN passes do not depend on it)"
            )
    # an MoE model's paths are checked on a sparse layer (Qwen2/3-MoE configs may make layer 0
    # dense: mlp_only_layers), the dense MLP's (layer_arch) on a dense layer if there is one
    layers = decoder_layers(model, what)
    sparse = sparse_layers(model, arch)
    checks = [(layers[(sparse or [0])[0]], paths)]
    dense = [layer for i, layer in enumerate(layers) if i not in sparse]
    if arch.moe is not None and dense:
        checks.append((dense[0], arch.moe.dense))
    missing = []
    for layer, wanted in checks:
        for path in dict.fromkeys(wanted):
            try:
                layer.get_submodule(path)
            except AttributeError:
                missing.append(path)
    if missing:
        raise ConfigError(
            f"{what}: model_type {arch.model_type!r} ({type(model).__name__}): the decoder layer "
            f"has no {', '.join(missing)}, which the compress.arch entry names; the checkpoint "
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
