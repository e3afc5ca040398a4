"""Structured pruning passes (Minitron-style): attention heads, MLP channels, hidden channels and
whole decoder layers, producing a smaller *dense* model. Which linears prune together comes from
the model family's entry in ``compress.arch`` (Llama: q rows, k/v rows per KV head and o columns
per head; gate/up rows and down columns per MLP channel).

Importance follows Minitron (Muralidharan et al., 2024, "Compact Language Models via Pruning and
Knowledge Distillation"): activations on a calibration set, captured with hooks --
per-head L2 norm of the attention output before the output projection, mean |activation| at
the input of the down projection per MLP channel, mean |activation| after every RMSNorm per
hidden channel, and for depth the block influence of ShortGPT (Men et al., 2024): mean
``1 - cos(input, output)`` of each decoder layer. ``importance: magnitude`` is a weight-norm
baseline for comparison.

Every layer keeps the same number of units (chosen per layer by its own scores), so the result
is expressible by the ordinary config (``num_attention_heads``, ``num_key_value_heads``,
``intermediate_size``, ``hidden_size``, ``num_hidden_layers``) and loads with plain
``AutoModelForCausalLM.from_pretrained``. Targets: ``sparsity`` (fraction removed), an explicit
size, or ``target_params`` (a total parameter budget such as ``90M``). Not done: per-layer
widths (not loadable by transformers), pruning of quantized layers, families not in
``compress.arch``.

Per family (``compress.arch``): fused linears (Phi-3's ``[q; k; v]`` and ``[gate; up]``) lose
the same heads/channels in every part; q/k norms over one head (Qwen3, Gemma3) are untouched by
head pruning, OLMo2's over all heads lose the pruned heads' entries (its q/k RMS then runs over
the kept heads only, so a head-pruned OLMo2 is not exactly the head-masked model); post-norms
(Gemma, OLMo2) are sliced with the hidden size; Gemma's embedding factor ``sqrt(hidden_size)``
is reset to what a reload computes, with every post-norm scaled by the same ratio so that the
residual stream's scale, to which the pre-norms are invariant, is all that changes.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from typing import ClassVar, Literal

import torch
from pydantic import Field, field_validator, model_validator
from torch import nn
from tqdm.auto import tqdm

from compress.arch import Arch, arch_for, check_paths, decoder_layers, set_embedding_scale
from compress.core.errors import ConfigError
from compress.core.registry import CompressionState, PassConfig, PassReport, register_pass
from compress.quant.linear import QuantLinear

log = logging.getLogger(__name__)

Importance = Literal["activation", "magnitude"]


# ---- configs ------------------------------------------------------------------------------
def parse_param_count(value: int | float | str) -> int:
    """``90M``, ``1.5B``, ``120000`` -> an int number of parameters; ValueError otherwise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"target_params={value!r} is not a count; write e.g. 90M or 1.2B")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"target_params={value!r} is not a count; write e.g. 90M or 1.2B")
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMbB]?)\s*", value)
    if not match:
        raise ValueError(
            f"target_params={value!r} is not a count; write e.g. 90M, 1.2B or 90000000"
        )
    scale = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9}[match.group(2).lower()]
    return int(float(match.group(1)) * scale)


class _PruneConfig(PassConfig):
    """Shared fields. Give exactly one target: sparsity (fraction of units removed, 0 < s < 1),
    the explicit size field of the pass, or target_params (total parameters after this pass)."""

    importance: Importance = "activation"
    sparsity: float | None = None
    target_params: int | None = None

    @field_validator("sparsity")
    @classmethod
    def _sparsity(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 < value < 1.0:
            raise ValueError(f"sparsity={value} must be in (0, 1): the fraction of units removed")
        return value

    @field_validator("target_params", mode="before")
    @classmethod
    def _params(cls, value: int | float | str | None) -> int | None:
        if value is None:
            return None
        count = parse_param_count(value)
        if count <= 0:
            raise ValueError(f"target_params={value!r} must be positive")
        return count

    @model_validator(mode="after")
    def _one_target(self):
        size_field = self.size_field
        given = [
            f for f in ("sparsity", size_field, "target_params") if getattr(self, f) is not None
        ]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of sparsity, {size_field}, target_params (got "
                f"{', '.join(given) or 'none'})"
            )
        return self

    # Name of the explicit-size field of each subclass (num_attention_heads, intermediate_size...).
    size_field: ClassVar[str] = ""


class AttentionHeadsConfig(_PruneConfig):
    """mode kv_groups: remove whole KV groups with their query heads; query_heads: remove the same
    number of query heads inside every KV group (KV heads stay). num_attention_heads: the
    query-head count to keep; it must be a multiple of the group size (kv_groups) or of the KV
    head count (query_heads)."""

    mode: Literal["kv_groups", "query_heads"] = "kv_groups"
    num_attention_heads: int | None = Field(None, ge=1)

    size_field: ClassVar[str] = "num_attention_heads"


class MlpChannelsConfig(_PruneConfig):
    """intermediate_size: channels kept per layer; multiple_of: round kept counts to this
    (e.g. 64 or 128 so int4 group sizes still divide the down projection's in_features)."""

    intermediate_size: int | None = Field(None, ge=1)
    multiple_of: int = Field(1, ge=1)

    size_field: ClassVar[str] = "intermediate_size"


class HiddenSizeConfig(_PruneConfig):
    """hidden_size: embedding/residual channels kept (head_dim is unchanged); multiple_of as for
    MLP channels (64 keeps int4 g64 possible on every projection)."""

    hidden_size: int | None = Field(None, ge=1)
    multiple_of: int = Field(1, ge=1)

    size_field: ClassVar[str] = "hidden_size"


class LayersConfig(_PruneConfig):
    """num_layers: decoder layers kept. Activation importance = block influence (ShortGPT);
    magnitude = Frobenius norm of the weights that write to the residual (attention output and
    MLP down projections)."""

    num_layers: int | None = Field(None, ge=1)

    size_field: ClassVar[str] = "num_layers"


# ---- model access -------------------------------------------------------------------------
def _layers(
    model: nn.Module, what: str, *, whole_layers: bool = False
) -> tuple[Arch, nn.ModuleList]:
    """The family's entry and decoder layers, checked to hold the float modules the prune passes
    rewrite, or a ConfigError naming the pass and what is missing. ``whole_layers``: the pass
    drops decoder layers and slices nothing (then MoE models are fine)."""
    arch = arch_for(model, what)
    layers = decoder_layers(model, what)
    if arch.moe is not None and not whole_layers:
        raise ConfigError(
            f"{what}: {arch.model_type} is a mixture-of-expert model; slicing its fused expert "
            "weights (one [E, 2I, H] tensor per layer) is not implemented, so this pass "
            "refuses it. prune.layers (whole decoder layers) works on it"
        )
    paths = arch.linears + arch.layer_norms + arch.qk_norms + (arch.attention,)
    check_paths(model, arch, paths, what)
    for name in arch.linears:
        if arch.moe is not None and name == arch.moe.fused:
            continue  # dropped whole with its layer
        module = layers[0].get_submodule(name)
        if type(module) is not nn.Linear:
            raise ConfigError(
                f"{what}: {name} is a {type(module).__name__}, not nn.Linear: prune before "
                "quantize (put prune.* passes first in the recipe)"
            )
    return arch, layers


def _sub(layer: nn.Module, names: tuple[str, ...]) -> list[nn.Module]:
    return [layer.get_submodule(n) for n in names]


def count_params(model: nn.Module) -> int:
    """Logical parameter count: float parameters (tied weights once) plus the weights that
    quantized layers hold as integer buffers (a QuantLinear of [N, K] counts N x K)."""
    quantized = sum(
        m.out_features * m.in_features for m in model.modules() if isinstance(m, QuantLinear)
    )
    return sum(p.numel() for p in model.parameters()) + quantized


def _slice_linear(linear: nn.Linear, *, out_idx=None, in_idx=None) -> None:
    """Keep rows ``out_idx`` and columns ``in_idx`` of a Linear, in place (same module object)."""
    w = linear.weight.data
    if out_idx is not None:
        w = w[out_idx]
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias.data[out_idx].clone())
        linear.out_features = len(out_idx)
    if in_idx is not None:
        w = w[:, in_idx]
        linear.in_features = len(in_idx)
    linear.weight = nn.Parameter(w.contiguous().clone())


def _slice_norm(norm: nn.Module, idx: torch.Tensor) -> None:
    norm.weight = nn.Parameter(norm.weight.data[idx].clone())


def _fused_rows(parts: list[int], idx: list[torch.Tensor]) -> torch.Tensor:
    """Rows to keep of a fused linear whose rows stack parts of ``parts[i]`` rows each
    (``[q; k; v]`` or ``[gate; up]``), keeping rows ``idx[i]`` of part i."""
    offsets = [0, *torch.tensor(parts).cumsum(0).tolist()[:-1]]
    return torch.cat([off + i for off, i in zip(offsets, idx, strict=True)])


def _calibrate(model: nn.Module, state: CompressionState, hooks: list, what: str) -> None:
    """Run the calibration batches through the model with the given (module, hook) pairs."""
    if state.calibration_batches is None:
        raise ConfigError(
            f"{what} with importance: activation needs calibration data: add a `calibration:` "
            "section to the recipe, or set importance: magnitude"
        )
    handles = []
    try:
        for module, fn, kind in hooks:
            if kind == "pre":
                handles.append(module.register_forward_pre_hook(fn, with_kwargs=True))
            else:
                handles.append(module.register_forward_hook(fn, with_kwargs=True))
        device = next(model.parameters()).device
        with torch.no_grad():
            batches = state.calibration_batches()
            desc = f"{what}: calibration forwards"
            for batch in tqdm(batches, desc=desc, disable=not state.progress):
                model(batch.to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()


def _hidden_in(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _resolve_keep(
    cfg: _PruneConfig,
    current: int,
    allowed: list[int],
    params_after: Callable[[int], int],
    what: str,
) -> int:
    """How many units to keep, from whichever target the config gives."""
    size = getattr(cfg, cfg.size_field)
    if size is not None:
        if size not in allowed and size != current:
            shown = ", ".join(map(str, allowed[:20])) + (" ..." if len(allowed) > 20 else "")
            raise ConfigError(
                f"{what}: {cfg.size_field}={size} is not expressible (currently {current}); "
                f"allowed values: {shown}"
            )
        return size
    if cfg.sparsity is not None:
        want = current * (1 - cfg.sparsity)
        return min(allowed, key=lambda k: (abs(k - want), -k))
    fits = [k for k in allowed if params_after(k) <= cfg.target_params]
    if not fits:
        smallest = min(allowed)
        raise ConfigError(
            f"{what}: target_params={cfg.target_params:,} is below what this structure allows: "
            f"the smallest {what} ({cfg.size_field}={smallest}) leaves "
            f"{params_after(smallest):,} parameters. Raise target_params or add another "
            "prune.* pass."
        )
    return max(fits)


def _multiples(current: int, multiple_of: int, what: str) -> list[int]:
    allowed = list(range(multiple_of, current, multiple_of))
    if not allowed:
        raise ConfigError(
            f"{what}: multiple_of={multiple_of} leaves nothing to prune below {current}"
        )
    return allowed


def _finish(model: nn.Module, report: PassReport, params_before: int) -> PassReport:
    """Check the pruned model against a fresh model built from its config, then report."""
    with torch.device("meta"):
        fresh = type(model)(model.config)
    expected = {k: tuple(v.shape) for k, v in fresh.state_dict().items()}
    actual = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    diff = set(expected.items()) ^ set(actual.items())
    assert not diff, f"pruned model disagrees with its config: {sorted(diff)[:10]}"
    report.metrics.update(params_before=params_before, params_after=count_params(model))
    log.info(
        "%s: %s -> %s parameters",
        report.name,
        f"{params_before:,}",
        f"{report.metrics['params_after']:,}",
    )
    return report


# ---- attention heads ----------------------------------------------------------------------
def _head_scores(model, arch, layers, cfg, state, n_heads, head_dim) -> list[torch.Tensor]:
    """[n_heads] importance per layer: magnitude of the per-query-head rows and columns, or the
    norm of each head's output at the input of the output projection."""
    (o_name,) = arch.heads.cols
    if cfg.importance == "magnitude":
        scores = []
        for layer in layers:
            # q rows: the q projection, or the first H * D rows of a fused [q; k; v]
            q_w = layer.get_submodule((arch.heads.rows + arch.heads.fused)[0]).weight
            q_w, o_w = q_w[: n_heads * head_dim], layer.get_submodule(o_name).weight
            q = q_w.detach().view(n_heads, head_dim, -1).pow(2).sum((1, 2))
            o = o_w.detach().view(-1, n_heads, head_dim).pow(2).sum((0, 2))
            scores.append((q + o).sqrt())
        return scores
    sums = [torch.zeros(n_heads, dtype=torch.float64) for _ in layers]

    def hook_for(i):
        def hook(module, args, kwargs):
            x = _hidden_in(args, kwargs).detach().float()  # [B, T, H*D]
            x = x.view(*x.shape[:-1], n_heads, head_dim)  # -> [B, T, H, D]
            sums[i] += x.norm(dim=-1).mean(dim=(0, 1)).double().cpu()

        return hook

    hooks = [(layer.get_submodule(o_name), hook_for(i), "pre") for i, layer in enumerate(layers)]
    _calibrate(model, state, hooks, "prune.attention_heads")
    return sums


def _slice_heads(
    layer: nn.Module,
    arch: Arch,
    q_rows: torch.Tensor,
    kv_rows: torch.Tensor,
    *,
    q_dim: int,
    kv_dim: int,
) -> None:
    """Keep q rows ``q_rows`` (of ``q_dim`` = H * D) and k/v rows ``kv_rows`` (of ``kv_dim``) in
    every part of the layer's attention, and the attention module's head counts in step."""
    for lin in _sub(layer, arch.heads.rows):
        _slice_linear(lin, out_idx=q_rows)
    for lin in _sub(layer, arch.heads.kv_rows):
        _slice_linear(lin, out_idx=kv_rows)
    for lin in _sub(layer, arch.heads.fused):  # [q; k; v]
        _slice_linear(lin, out_idx=_fused_rows([q_dim, kv_dim, kv_dim], [q_rows, kv_rows, kv_rows]))
    for lin in _sub(layer, arch.heads.cols):
        _slice_linear(lin, in_idx=q_rows)
    if arch.qk_norm_span == "heads":  # OLMo2: q_norm over all H * D, k_norm over KVH * D
        q_norm, k_norm = _sub(layer, arch.qk_norms)
        _slice_norm(q_norm, q_rows)
        _slice_norm(k_norm, kv_rows)
    # per-head q/k norms ([head_dim], Qwen3, Gemma3) are shared by the heads: unchanged
    attention = layer.get_submodule(arch.attention)
    head_dim = attention.head_dim
    attention.num_key_value_groups = len(q_rows) // len(kv_rows)
    if hasattr(attention, "num_key_value_heads"):  # Phi-3 splits its fused output with it
        attention.num_key_value_heads = len(kv_rows) // head_dim


@register_pass("prune.attention_heads", AttentionHeadsConfig)
def prune_attention_heads(
    model: nn.Module, cfg: AttentionHeadsConfig, state: CompressionState
) -> PassReport:
    arch, layers = _layers(model, "prune.attention_heads")
    config = model.config
    n_heads, n_kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = layers[0].get_submodule(arch.attention).head_dim
    group = n_heads // n_kv
    hidden, n_layers = config.hidden_size, len(layers)
    before = count_params(model)
    per_q = 2 * hidden * head_dim * n_layers  # q rows + o columns of one query head, all layers
    if cfg.mode == "kv_groups":
        allowed = [g * group for g in range(1, n_kv)]

        def params_after(k):
            return before - (n_heads - k) * per_q - (n_kv - k // group) * per_q
    else:
        allowed = [m * n_kv for m in range(1, group)]

        def params_after(k):
            return before - (n_heads - k) * per_q

    # transformers' LlamaConfig rejects hidden_size % num_attention_heads != 0 even with an
    # explicit head_dim, so only such head counts give a loadable checkpoint.
    allowed = [k for k in allowed if hidden % k == 0]
    if not allowed:
        raise ConfigError(
            f"prune.attention_heads: mode {cfg.mode} cannot prune {n_heads} heads / {n_kv} KV "
            f"heads (group size {group}, hidden {hidden}); try the other mode (kv_groups or "
            "query_heads)"
        )
    keep = _resolve_keep(cfg, n_heads, allowed, params_after, "prune.attention_heads")
    report = PassReport(
        "prune.attention_heads", metrics={"importance": cfg.importance, "mode": cfg.mode}
    )
    if keep == n_heads:
        return _finish(model, report, before)
    scores = _head_scores(model, arch, layers, cfg, state, n_heads, head_dim)
    for i, layer in enumerate(layers):
        by_group = scores[i].view(n_kv, group)  # query heads h = g * group + j share KV head g
        if cfg.mode == "kv_groups":
            kv_keep = by_group.sum(1).topk(keep // group).indices.sort().values
            q_keep = (kv_keep[:, None] * group + torch.arange(group)).flatten()
        else:
            kv_keep = torch.arange(n_kv)
            within = by_group.topk(keep // n_kv, dim=1).indices.sort(dim=1).values
            q_keep = (torch.arange(n_kv)[:, None] * group + within).flatten()
        q_rows = (q_keep[:, None] * head_dim + torch.arange(head_dim)).flatten()
        kv_rows = (kv_keep[:, None] * head_dim + torch.arange(head_dim)).flatten()
        _slice_heads(layer, arch, q_rows, kv_rows, q_dim=n_heads * head_dim, kv_dim=n_kv * head_dim)
        report.changed.append(f"{arch.layer_prefix}{i}.{arch.attention}")
    config.head_dim = head_dim  # explicit, so hidden_size // num_attention_heads is never used
    config.num_attention_heads = keep
    config.num_key_value_heads = keep // group if cfg.mode == "kv_groups" else n_kv
    report.metrics.update(
        heads_before=n_heads, heads_after=keep, kv_heads_after=config.num_key_value_heads
    )
    return _finish(model, report, before)


# ---- MLP channels -------------------------------------------------------------------------
def _channel_scores(model, arch, layers, cfg, state) -> list[torch.Tensor]:
    group = arch.mlp_channels
    (down,) = group.cols
    if cfg.importance == "magnitude":
        scores = []
        for layer in layers:
            rows = [lin.weight.detach().pow(2).sum(1) for lin in _sub(layer, group.rows)]
            # a fused [gate; up]: the two halves' rows of one channel add up
            rows += [
                lin.weight.detach().pow(2).sum(1).view(2, -1).sum(0)
                for lin in _sub(layer, group.fused)
            ]
            cols = [lin.weight.detach().pow(2).sum(0) for lin in _sub(layer, group.cols)]
            scores.append(sum(rows + cols).sqrt())
        return scores
    sums = [
        torch.zeros(layer.get_submodule(down).in_features, dtype=torch.float64) for layer in layers
    ]

    def hook_for(i):
        def hook(module, args, kwargs):
            x = _hidden_in(args, kwargs).detach().float()  # [B, T, I]
            sums[i] += x.abs().mean(dim=(0, 1)).double().cpu()

        return hook

    hooks = [(layer.get_submodule(down), hook_for(i), "pre") for i, layer in enumerate(layers)]
    _calibrate(model, state, hooks, "prune.mlp_channels")
    return sums


@register_pass("prune.mlp_channels", MlpChannelsConfig)
def prune_mlp_channels(
    model: nn.Module, cfg: MlpChannelsConfig, state: CompressionState
) -> PassReport:
    arch, layers = _layers(model, "prune.mlp_channels")
    current, hidden = model.config.intermediate_size, model.config.hidden_size
    before = count_params(model)
    allowed = _multiples(current, cfg.multiple_of, "prune.mlp_channels")
    keep = _resolve_keep(
        cfg,
        current,
        allowed,
        lambda k: before - (current - k) * 3 * hidden * len(layers),
        "prune.mlp_channels",
    )
    report = PassReport("prune.mlp_channels", metrics={"importance": cfg.importance})
    if keep == current:
        return _finish(model, report, before)
    scores = _channel_scores(model, arch, layers, cfg, state)
    for i, layer in enumerate(layers):
        idx = scores[i].topk(keep).indices.sort().values
        for lin in _sub(layer, arch.mlp_channels.rows):
            _slice_linear(lin, out_idx=idx)
        for lin in _sub(layer, arch.mlp_channels.fused):  # [gate; up]
            _slice_linear(lin, out_idx=_fused_rows([current, current], [idx, idx]))
        for lin in _sub(layer, arch.mlp_channels.cols):
            _slice_linear(lin, in_idx=idx)
        mlp = arch.mlp_channels.cols[0].rpartition(".")[0]  # the MLP module holding them
        report.changed.append(f"{arch.layer_prefix}{i}.{mlp}")
    model.config.intermediate_size = keep
    report.metrics.update(intermediate_before=current, intermediate_after=keep)
    return _finish(model, report, before)


# ---- hidden channels ----------------------------------------------------------------------
def _norms(model: nn.Module, arch: Arch, layers: nn.ModuleList) -> list[nn.Module]:
    out = [m for layer in layers for m in _sub(layer, arch.layer_norms)]
    return out + [model.get_submodule(arch.final_norm)]


def _hidden_scores(model, arch, layers, cfg, state) -> torch.Tensor:
    embed = model.get_input_embeddings().weight.detach()
    if cfg.importance == "magnitude":
        total = embed.pow(2).sum(0)
        for layer in layers:
            for lin in _sub(layer, arch.hidden_readers):
                total = total + lin.weight.detach().pow(2).sum(0)
            for lin in _sub(layer, arch.hidden_writers):
                total = total + lin.weight.detach().pow(2).sum(1)
        return total.sqrt()
    total = torch.zeros(embed.shape[1], dtype=torch.float64)

    def hook(module, args, kwargs, output):
        nonlocal total
        total += output.detach().float().abs().mean(dim=(0, 1)).double().cpu()  # [B, T, H] -> [H]

    _calibrate(
        model, state, [(n, hook, "post") for n in _norms(model, arch, layers)], "prune.hidden_size"
    )
    return total


@torch.no_grad()
def _scale_post_norms(layers: nn.ModuleList, arch: Arch, ratio: float) -> None:
    """Multiply every post-norm's output by ``ratio``. With the embedding factor changed by the
    same ratio, the whole residual stream is scaled by it (in Gemma every block writes through a
    post-norm), and the pre-norms and the final norm are invariant to that scale (up to eps), so
    the pruned model keeps its function with the factor a reload computes from hidden_size."""
    for norm in (n for layer in layers for n in _sub(layer, arch.post_norms)):
        if arch.norm_form == "1+w":
            norm.weight.copy_((1 + norm.weight.float()) * ratio - 1)
        else:
            norm.weight.mul_(ratio)


@register_pass("prune.hidden_size", HiddenSizeConfig)
def prune_hidden_size(
    model: nn.Module, cfg: HiddenSizeConfig, state: CompressionState
) -> PassReport:
    arch, layers = _layers(model, "prune.hidden_size")
    if arch.embed_scaling != "none" and len(arch.post_norms) != 2:
        raise ConfigError(
            f"prune.hidden_size: model_type {arch.model_type!r} scales its embedding by "
            "sqrt(hidden_size) but not every block writes through a post-norm, so the changed "
            "factor cannot be compensated; prune heads, MLP channels or layers instead"
        )
    config = model.config
    current = config.hidden_size
    before = count_params(model)
    # parameters per hidden channel in one layer: its norms, and one column of every reader and
    # one row of every writer
    per_layer = (
        len(arch.layer_norms)
        + sum(lin.out_features for lin in _sub(layers[0], arch.hidden_readers))
        + sum(lin.in_features for lin in _sub(layers[0], arch.hidden_writers))
    )
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    vocab = config.vocab_size
    per_channel = per_layer * len(layers) + 1 + vocab * (1 if tied else 2)
    # hidden_size must stay a multiple of num_attention_heads (LlamaConfig's validation).
    step = math.lcm(cfg.multiple_of, config.num_attention_heads)
    allowed = _multiples(current, step, "prune.hidden_size")
    keep = _resolve_keep(
        cfg, current, allowed, lambda k: before - (current - k) * per_channel, "prune.hidden_size"
    )
    report = PassReport("prune.hidden_size", metrics={"importance": cfg.importance})
    if keep == current:
        return _finish(model, report, before)
    idx = _hidden_scores(model, arch, layers, cfg, state).topk(keep).indices.sort().values
    embed = model.get_input_embeddings()
    embed.weight = nn.Parameter(embed.weight.data[:, idx].contiguous().clone())
    embed.embedding_dim = keep
    head = model.get_output_embeddings()
    if tied:
        head.weight = embed.weight  # keep the tie: one Parameter object
    else:
        _slice_linear(head, in_idx=idx)
    head.in_features = keep
    for norm in _norms(model, arch, layers):
        _slice_norm(norm, idx)
    for layer in layers:
        for lin in _sub(layer, arch.hidden_readers):
            _slice_linear(lin, in_idx=idx)
        for lin in _sub(layer, arch.hidden_writers):
            _slice_linear(lin, out_idx=idx)
    # attention width is independent of the residual width now
    config.head_dim = layers[0].get_submodule(arch.attention).head_dim
    config.hidden_size = keep
    ratio = set_embedding_scale(model, arch)  # Gemma: sqrt(hidden_size), what a reload builds
    if ratio != 1.0:
        _scale_post_norms(layers, arch, ratio)
        report.metrics["embedding_scale_ratio"] = ratio
    report.changed.append("all hidden-size tensors")
    report.metrics.update(hidden_before=current, hidden_after=keep)
    return _finish(model, report, before)


# ---- layers -------------------------------------------------------------------------------
def layer_scores(
    model: nn.Module, layers: nn.ModuleList, cfg: LayersConfig, state: CompressionState
) -> torch.Tensor:
    """[n_layers] importance; low = the layer changes its input least (safest to drop)."""
    if cfg.importance == "magnitude":
        writers = arch_for(model, "prune.layers").hidden_writers
        return torch.stack(
            [
                sum(lin.weight.detach().pow(2).sum() for lin in _sub(layer, writers)).sqrt()
                for layer in layers
            ]
        ).double()
    sums = torch.zeros(len(layers), dtype=torch.float64)

    def hook_for(i):
        def hook(module, args, kwargs, output):
            x = _hidden_in(args, kwargs).detach().float()
            y = (output[0] if isinstance(output, tuple) else output).detach().float()
            cos = nn.functional.cosine_similarity(x, y, dim=-1)  # [B, T]
            sums[i] += float((1 - cos).mean())

        return hook

    hooks = [(layer, hook_for(i), "post") for i, layer in enumerate(layers)]
    _calibrate(model, state, hooks, "prune.layers")
    return sums


@register_pass("prune.layers", LayersConfig)
def prune_layers(model: nn.Module, cfg: LayersConfig, state: CompressionState) -> PassReport:
    arch, blocks = _layers(model, "prune.layers", whole_layers=True)
    current = len(blocks)
    before = count_params(model)
    per_layer = sum(p.numel() for p in blocks[0].parameters())
    keep = _resolve_keep(
        cfg,
        current,
        list(range(1, current)),
        lambda k: before - (current - k) * per_layer,
        "prune.layers",
    )
    report = PassReport("prune.layers", metrics={"importance": cfg.importance})
    if keep == current:
        return _finish(model, report, before)
    scores = layer_scores(model, blocks, cfg, state)
    kept = scores.topk(keep).indices.sort().values.tolist()
    removed = [i for i in range(current) if i not in kept]
    new_blocks = [blocks[i] for i in kept]
    for new_idx, block in enumerate(new_blocks):
        block.get_submodule(arch.attention).layer_idx = new_idx  # KV-cache slot
    parent, _, child = arch.layers.rpartition(".")
    setattr(model.get_submodule(parent), child, nn.ModuleList(new_blocks))
    config = model.config
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in kept]
    config.num_hidden_layers = keep
    report.changed.extend(f"{arch.layer_prefix}{i}" for i in removed)
    report.metrics.update(
        layers_before=current,
        layers_after=keep,
        removed_layers=removed,
        scores=[round(float(s), 6) for s in scores],
    )
    return _finish(model, report, before)
