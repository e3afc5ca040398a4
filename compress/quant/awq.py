"""AWQ (Lin et al., 2023, "AWQ: Activation-aware Weight Quantization"): ``quantize.awq``.

Per decoder layer and per group of linears that read the same input, search a per-input-channel
scale ``s = mean|x|^a / mean|w~|^(1-a)`` (``duo_scaling``; ``w~`` is |w| normalised per
quantization group) over a grid of ``a`` in [0, 1), minimising the output error of the
quantized group ``|| X diag(1/s) Q(W diag(s))^T - X W^T ||^2``, then fold ``1/s`` into the
operation that produces the input, so the float model is unchanged:

* the attention norm -> q/k/v; the MLP norm -> gate/up (norm weight / s);
* v -> o (v rows / s). GQA-aware: with fewer KV heads, each v channel feeds ``heads / kv_heads``
  o input channels, so the search runs over the v channels and the scale is repeated per head
  group;
* up -> down.

Those are Llama's mappings; each family's are in ``compress.arch`` (``awq_mappings``), and the
fold (``compress.quant.calibrated.migrate_scales``) handles what differs:

* Gemma's ``(1 + w)`` norms: the effective weight is divided, ``w' = (1 + w) / s - 1``; its MLP
  reads ``pre_feedforward_layernorm`` (the ``post_*`` norms feed no linear and are left alone).
* Phi-3's fused linears: norm -> ``qkv_proj`` and norm -> ``gate_up_proj`` as one consumer
  each; v -> o divides only the v rows of ``qkv_proj``, up -> down only the up half of
  ``gate_up_proj`` (``compress.arch.producer_rows``). q/k are not clip-searched, so neither is
  the fused ``qkv_proj``.
* OLMo2: q/k/v and gate/up read the residual stream (its norms come after the blocks), so no
  scale can be folded for them: they are clip-searched and rounded unscaled, and the report
  lists them (``metrics["unscaled"]``, a WARNING). v -> o and up -> down are scaled.
* Qwen2's q/k/v biases are divided with their rows; Qwen3/Gemma3 per-head q/k norms come after
  the projections and are unaffected; Granite's multipliers are constants outside every fold.

``scale_layer`` is the search and fold alone (no rounding); the tests use it to check that the
float model's logits do not change.

The error is computed through the input second moment ``H = X^T X`` accumulated over *all*
calibration tokens (``tr(D H D^T)`` with ``D = Q(W s)/s - W``), which costs the same as a matmul
over K tokens and needs no token subsample. Optional clipping search (not for q/k, whose errors
are amplified by the softmax) shrinks each group's range by up to ``max_shrink`` to minimise the
group's own output error (cross-group terms of H ignored, as in the reference implementation).
The weights are then rounded to nearest with the searched scale/clip and stored as ordinary
int4/int8 ``QuantLinear`` group weights. Model families: those ``compress.arch`` lists.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from pydantic import Field
from torch import nn

from compress.arch import (
    Arch,
    Mapping,
    NormForm,
    arch_for,
    check_paths,
    head_dim_of,
    layer_arch,
    mapping_paths,
    producer_rows,
    with_clamped_values,
)
from compress.core.matcher import set_submodule
from compress.core.registry import (
    CompressionState,
    PassReport,
    raise_or_report_skips,
    register_pass,
)
from compress.quant import primitives as quant_primitives
from compress.quant.calibrated import (
    LayerInputs,
    OffloadMode,
    finish_quant_report,
    migrate_scales,
    plan_layers,
    run_calibrated,
    run_layer,
    warn_unscaled,
)
from compress.quant.coverage import report_coverage
from compress.quant.experts import plan_experts, rtn_layer_experts
from compress.quant.linear import QuantLinear, WeightScheme
from compress.quant.scheme import CalibratedWeightConfig

log = logging.getLogger(__name__)


class AwqConfig(CalibratedWeightConfig):
    """AWQ settings (plus ``symmetric``, ``scale_dtype``, ``backend``, ``overrides`` of RTN).

    n_grid: scale exponents tried (a = i / n_grid); clip_grid / max_shrink: clipping ratios
    tried, 1 - i / clip_grid down to 1 - max_shrink.
    """

    n_grid: int = Field(20, ge=1, le=100)
    duo_scaling: bool = True  # divide by mean|w|^(1-a) too (AutoAWQ/llm-compressor default)
    clip: bool = True
    clip_grid: int = Field(20, ge=1, le=100)
    max_shrink: float = Field(0.5, gt=0.0, lt=1.0)
    offload: OffloadMode = "none"


class _InputStats:
    """Per consumer group: ``H = X^T X`` (fp32, all tokens) and ``sum|x|`` of its input."""

    def __init__(self, layer: nn.Module, points: list[str]) -> None:
        self.h: dict[str, torch.Tensor] = {}
        self.abs_sum: dict[str, torch.Tensor] = {}
        self.count: dict[str, int] = dict.fromkeys(points, 0)
        self._handles = [
            layer.get_submodule(p).register_forward_hook(self._hook(p)) for p in points
        ]

    def _hook(self, point: str):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float32)  # [tokens, K]
            if not torch.isfinite(x).all():
                raise ValueError(f"{point}: calibration activations contain NaN/Inf")
            self.h[point] = self.h.get(point, 0) + x.T @ x
            self.abs_sum[point] = self.abs_sum.get(point, 0) + x.abs().sum(0)
            self.count[point] += x.shape[0]

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _fake_quant(w: torch.Tensor, scheme: WeightScheme) -> torch.Tensor:
    return quant_primitives.fake_quantize(
        w,
        n_bits=scheme.n_bits,
        group_size=scheme.resolved_group(w.shape[1]),
        symmetric=scheme.symmetric,
        grid=scheme.grid,
    )


# Columns of one block of D's Gram (``_output_error``): [block, K] floats at a time.
GRAM_BLOCK = 512


def _output_error(d: torch.Tensor, h: torch.Tensor) -> float:
    """``tr(D H D^T)``: squared output error over the calibration tokens for weight error D,
    as ``<D^T D, H>`` over the upper triangle (H and D^T D are symmetric), a block of rows of
    D^T D at a time: half the multiply-adds of ``((D @ H) * D).sum()``
    (``_output_error_reference``), which is most of the search's time at 7B widths
    (scripts/bench_calibrated_layer.py; docs/results.md section 6)."""
    k, total = d.shape[1], 0.0
    for b0 in range(0, k, GRAM_BLOCK):
        b1 = min(b0 + GRAM_BLOCK, k)
        weighted = (d[:, b0:b1].T @ d[:, b0:]).mul_(h[b0:b1, b0:])  # [block, K - b0]
        total += float(weighted[:, : b1 - b0].sum()) + 2.0 * float(weighted[:, b1 - b0:].sum())
    return total


def _output_error_reference(d: torch.Tensor, h: torch.Tensor) -> float:
    """``_output_error`` as one product (the definition: the tests and
    scripts/bench_calibrated_layer.py hold the blocked sum to it)."""
    return float(((d @ h) * d).sum())


def _w_mean(weights: list[torch.Tensor], schemes: list[WeightScheme]) -> torch.Tensor:
    """Mean over output rows of |w| normalised by its group's max: ``[K]``."""
    parts = []
    for w, scheme in zip(weights, schemes, strict=True):
        g = scheme.resolved_group(w.shape[1])
        grouped = w.abs().reshape(w.shape[0], -1, g)  # [N, K/g, g]
        parts.append((grouped / (grouped.amax(-1, keepdim=True) + 1e-6)).reshape(w.shape))
    return torch.cat(parts).mean(0)


def _expand(s: torch.Tensor, tie: int, head_dim: int) -> torch.Tensor:
    """KV-channel scales ``[KVH * D]`` -> per-head channels ``[KVH * tie * D]`` (head h reads
    KV head h // tie, as in transformers' ``repeat_kv``)."""
    if tie == 1:
        return s
    kv = s.reshape(-1, 1, head_dim)  # [KVH, 1, D]
    return kv.expand(-1, tie, -1).reshape(-1)  # [KVH * tie * D]


def _tied_mean(v: torch.Tensor, tie: int, head_dim: int) -> torch.Tensor:
    """Inverse of ``_expand``: average the ``tie`` channels that share one KV channel."""
    return v if tie == 1 else v.reshape(-1, tie, head_dim).mean(1).reshape(-1)


def search_scale(
    weights: list[torch.Tensor],
    schemes: list[WeightScheme],
    h: torch.Tensor,
    x_mean: torch.Tensor,
    cfg: AwqConfig,
    *,
    tie: int = 1,
    head_dim: int = 1,
) -> tuple[torch.Tensor, float, float]:
    """Best scale for the consumers ``weights`` (each ``[N_i, K]``) -> (scale over the
    producer's channels ``[K / tie]``, error of plain RTN, best error). With GQA ``tie`` query
    heads share a KV head, so their o_proj input channels must share the scale."""
    w_all = torch.cat(weights)  # [N, K]
    x_c = _tied_mean(x_mean, tie, head_dim)
    w_c = _tied_mean(_w_mean(weights, schemes), tie, head_dim)

    def error(s_c: torch.Tensor) -> float:
        s = _expand(s_c, tie, head_dim)
        q = torch.cat([_fake_quant(w * s, sc) for w, sc in zip(weights, schemes, strict=True)]) / s
        return _output_error(q - w_all, h)

    best = torch.ones_like(x_c)
    base_err = best_err = error(best)
    for i in range(cfg.n_grid):
        alpha = i / cfg.n_grid
        s = x_c.pow(alpha) / w_c.pow(1 - alpha) if cfg.duo_scaling else x_c.pow(alpha)
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()  # keep the scales centred around 1
        err = error(s)
        if err < best_err:
            best, best_err = s, err
    return best, base_err, best_err


def search_clip(
    w: torch.Tensor, scheme: WeightScheme, h: torch.Tensor, cfg: AwqConfig
) -> torch.Tensor:
    """``w`` clipped per (row, group) to the shrink ratio with the lowest group output error."""
    n, k = w.shape
    g = scheme.resolved_group(k)
    blocks = torch.stack([h[j : j + g, j : j + g] for j in range(0, k, g)])  # [K/g, g, g]
    grouped = w.reshape(n, k // g, g)
    wmax, wmin = grouped.amax(-1, keepdim=True), grouped.amin(-1, keepdim=True)
    best = torch.full((n, k // g, 1), float("inf"), device=w.device)
    best_ratio = torch.ones(n, k // g, 1, device=w.device)
    for i in range(int(cfg.max_shrink * cfg.clip_grid) + 1):
        ratio = 1 - i / cfg.clip_grid
        clipped = torch.minimum(torch.maximum(grouped, wmin * ratio), wmax * ratio).reshape(n, k)
        d = (_fake_quant(clipped, scheme) - w).reshape(n, k // g, g)  # [N, G, g]
        err = torch.einsum("ngi,gij,ngj->ng", d, blocks, d).unsqueeze(-1)
        better = err < best
        best = torch.where(better, err, best)
        best_ratio = torch.where(better, torch.full_like(best_ratio, ratio), best_ratio)
    return torch.minimum(torch.maximum(grouped, wmin * best_ratio), wmax * best_ratio).reshape(n, k)


@torch.no_grad()
def _scale_group(
    layer: nn.Module,
    producer: str,
    consumers: list[str],
    stats: _InputStats,
    schemes: list[WeightScheme],
    cfg: AwqConfig,
    *,
    norm_form: NormForm = "w",
    rows: slice | None = None,
) -> dict[str, float] | str:
    """Search and fold the scale of one group; returns metrics or the reason it was skipped.
    ``norm_form``: how a norm producer applies its weight (``compress.arch.Arch.norm_form``);
    ``rows``: the rows of a fused Linear producer that feed the consumers
    (``compress.arch.producer_rows``)."""
    point = consumers[0]
    h, x_mean = stats.h[point], stats.abs_sum[point] / max(stats.count[point], 1)
    lins = [layer.get_submodule(c) for c in consumers]
    prev = layer.get_submodule(producer)
    width = prev.weight.shape[0] if rows is None else rows.stop - rows.start
    tie = lins[0].in_features // width
    head_dim = head_dim_of(layer)
    if tie * width != lins[0].in_features or (tie > 1 and not head_dim):
        return f"{producer} has {width} outputs, {point} {lins[0].in_features} inputs"
    weights = [lin.weight.detach().float() for lin in lins]
    s_prev, base, best = search_scale(
        weights, schemes, h, x_mean, cfg, tie=tie, head_dim=max(head_dim, 1)
    )
    s = _expand(s_prev, tie, max(head_dim, 1))  # [K] over the consumers' inputs
    migrate_scales(prev, lins, s_prev, s, norm_form=norm_form, rows=rows)
    # The consumers now see x / s: transform their statistics the same way.
    stats.h[point] = h / torch.outer(s, s)
    stats.abs_sum[point] = stats.abs_sum[point] / s
    return {"rtn_error": base, "awq_error": best, "scale_spread": float(s.max() / s.min())}


def _layer_groups(
    arch: Arch, mine: dict[str, WeightScheme], prefix: str, notes: dict[str, Any]
) -> tuple[list[Mapping], list[tuple[str, ...]]]:
    """(mappings of one layer to scale, consumer groups to quantize unscaled): a mapping whose
    consumers are only partly targeted is not scaled (it would break the equivalence), and the
    family's scale gaps have no producer; both are noted in ``notes``."""
    mappings, unscaled = [], []
    for m in arch.awq_mappings:
        present = [c for c in m.consumers if c in mine]
        if present and len(present) != len(m.consumers):
            notes[prefix + m.producer] = f"not all of {m.consumers} are targeted; not scaled"
            unscaled.append(tuple(present))
        elif present:
            mappings.append(m)
    for gap in arch.scale_gaps:
        present = tuple(c for c in gap.consumers if c in mine)
        if present:
            notes[", ".join(prefix + c for c in present)] = gap.reason
            unscaled.append(present)
    return mappings, unscaled


def scale_layer(
    layer: nn.Module,
    arch: Arch,
    mine: dict[str, WeightScheme],
    inputs: LayerInputs,
    cfg: AwqConfig,
    *,
    prefix: str = "",
    notes: dict[str, dict[str, float] | str] | None = None,
) -> dict[str, torch.Tensor]:
    """AWQ's scale search and fold for one decoder layer, without rounding (the float layer's
    function is unchanged). ``mine``: targeted linears of the layer (paths inside it) -> scheme.
    Returns each consumer's input second moment ``H [K, K]`` as the consumer sees it after the
    fold (for the clipping search); per-group metrics and notes go to ``notes``."""
    notes = {} if notes is None else notes
    arch = layer_arch(arch, layer)  # an MoE model's dense layer: its own mappings
    mappings, unscaled = _layer_groups(arch, mine, prefix, notes)
    points = [m.consumers[0] for m in mappings] + [g[0] for g in unscaled]
    stats = _InputStats(layer, list(dict.fromkeys(points)))
    try:
        run_layer(layer, inputs, keep=False)
    finally:
        stats.remove()
    for m in mappings:
        notes[prefix + m.producer + (f"[{m.part}]" if m.part else "")] = _scale_group(
            layer,
            m.producer,
            list(m.consumers),
            stats,
            [mine[c] for c in m.consumers],
            cfg,
            norm_form=arch.norm_form,
            rows=producer_rows(layer, m),
        )
    groups = [m.consumers for m in mappings] + unscaled
    return {c: stats.h[g[0]] for g in groups for c in g}


@register_pass("quantize.awq", AwqConfig, needs_calibration=True, layerwise=True)
def awq(model: nn.Module, cfg: AwqConfig, state: CompressionState) -> PassReport:
    """Scale (and clip) then round every targeted decoder Linear, one decoder layer at a time."""
    report = PassReport("quantize.awq")
    arch = with_clamped_values(arch_for(model, "quantize.awq"), model.config)
    check_paths(model, arch, mapping_paths(arch.awq_mappings), "quantize.awq")
    # q and k: no clipping search, their errors are amplified by the softmax (with a fused
    # qkv_proj the whole fused linear, since its q and k rows are in it)
    no_clip = (arch.q, arch.k)
    plan = plan_layers(model, cfg, cfg.n_bits, report)
    experts = plan_experts(model, cfg, cfg.n_bits, report)
    raise_or_report_skips(cfg, report, "quantize.awq")  # before any work
    per_group: dict[str, dict[str, float] | str] = {}
    # routed experts have no producer feeding one linear group, so no scale search: RTN, said so
    per_expert: dict[str, str] = {}

    def process(index: int, layer: nn.Module, inputs: LayerInputs) -> None:
        prefix = f"{arch.layer_prefix}{index}."
        mine = {n[len(prefix) :]: s for n, s in plan.items() if n.startswith(prefix)}
        h_of = scale_layer(layer, arch, mine, inputs, cfg, prefix=prefix, notes=per_group)
        for sub, scheme in mine.items():
            linear = layer.get_submodule(sub)
            if cfg.clip and sub in h_of and sub not in no_clip:
                linear.weight.data = search_clip(
                    linear.weight.detach().float(), scheme, h_of[sub], cfg
                ).to(linear.weight.dtype)
            quant = QuantLinear.from_linear(linear, scheme, backend="reference")
            set_submodule(model, prefix + sub, quant)
            report.changed.append(prefix + sub)
        per_expert.update(rtn_layer_experts(model, experts, prefix, "AWQ: no scale "
                                            "search for a routed expert", cfg.backend))

    # the experts are only run and rounded: streamed, they stay bf16 (one expert widened at once)
    memory = run_calibrated(model, state, process, "quantize.awq", offload=cfg.offload,
                            narrow="routed")
    finish_quant_report(model, report, cfg.backend, memory)
    report.metrics["per_group"] = per_group
    report.metrics["per_expert"] = per_expert
    report.changed += list(per_expert)
    report_coverage(model, cfg, report)
    warn_unscaled(report, per_group, arch)
    return report
