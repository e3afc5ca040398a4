"""SmoothQuant (Xiao et al., 2022) + W8A8: ``quantize.smoothquant``.

Activations of LLMs have a few outlier channels that make per-token int8 activations lossy.
SmoothQuant moves that difficulty into the weights: per input channel j,
``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)``; the producer of the input is divided by s
(a norm's weight, or the rows of the up projection for the down projection) and the consumers'
columns are multiplied by it, so the float model is unchanged. The mappings are the model
family's (``compress.arch``; Llama: attention norm -> q/k/v, MLP norm -> gate/up, and up -> down
with ``smooth_down``, the mapping whose producer is a Linear). The folds per family are those of
AWQ (``compress.quant.awq``): Gemma's ``(1 + w)`` norms, Phi-3's fused producers (the up half of
``gate_up_proj``); OLMo2's q/k/v and gate/up have no producer and are W8A8 unsmoothed, listed
in the report's ``unscaled`` metric with a WARNING. The pass then turns every
targeted Linear into a ``W8A8Linear`` (one pass, no separate W8A8 pass to order): int8 symmetric
per-output-channel weights and dynamic symmetric per-token int8 activations; the layer, its
backends and its export format are in ``compress.quant.linear``. Only ``nn.Linear`` can become W8A8;
anything else targeted is reported (or an error under ``strict``).
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from compress.arch import (
    Arch,
    Mapping,
    arch_for,
    check_paths,
    layer_arch,
    mapping_paths,
    producer_rows,
    with_clamped_values,
)
from compress.core.matcher import set_submodule, target_modules
from compress.core.registry import (
    DTYPES,
    CompressionState,
    PassConfig,
    PassReport,
    raise_or_report_skips,
    register_pass,
)
from compress.quant.calibrated import (
    LayerInputs,
    OffloadMode,
    finish_quant_report,
    migrate_scales,
    run_calibrated,
    run_layer,
    warn_unscaled,
)
from compress.quant.coverage import report_coverage
from compress.quant.experts import refuse_targeted_experts
from compress.quant.linear import w8a8_from_linear

log = logging.getLogger(__name__)


class SmoothquantConfig(PassConfig):
    """alpha: migration strength (0 = none, 1 = all into weights); smooth_down: also migrate
    the down projection's input into the up projection; smooth: false gives plain W8A8."""

    alpha: float = Field(0.5, ge=0.0, le=1.0)
    smooth: bool = True
    smooth_down: bool = True
    scale_dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    backend: Literal["auto", "reference", "float_exact", "cpu", "triton"] = "auto"
    offload: OffloadMode = "none"


class _MaxHooks:
    """Running per-channel max|x| of each hooked module's input."""

    def __init__(self, layer: nn.Module, points: list[str]) -> None:
        self.amax: dict[str, torch.Tensor] = {}
        self._handles = [
            layer.get_submodule(p).register_forward_hook(self._hook(p)) for p in points
        ]

    def _hook(self, point: str):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            if not torch.isfinite(x).all():
                raise ValueError(f"{point}: calibration activations contain NaN/Inf")
            amax = x.abs().amax(0).to(torch.float32)
            self.amax[point] = torch.maximum(self.amax[point], amax) if point in self.amax else amax

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@torch.no_grad()
def smooth_scales(x_amax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """SmoothQuant scale per input channel ``[K]`` for consumers ``weights`` (each ``[N_i, K]``)."""
    w_amax = torch.cat([w.abs() for w in weights]).amax(0).to(torch.float32)
    s = x_amax.clamp(min=1e-5).pow(alpha) / w_amax.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


def _layer_mappings(
    layer: nn.Module,
    arch: Arch,
    mine: set[str],
    cfg: SmoothquantConfig,
    prefix: str,
    notes: dict[str, float | str],
) -> list[Mapping]:
    """The family's mappings to smooth in one layer (``mine``: its targeted linears); partly
    targeted mappings and the family's scale gaps are noted (they are W8A8 without a scale)."""
    if not cfg.smooth:
        return []
    mappings = []
    for m in arch.smoothquant_mappings:
        if not cfg.smooth_down and isinstance(layer.get_submodule(m.producer), nn.Linear):
            continue  # the up -> down mapping, the one whose producer is a Linear
        present = [c for c in m.consumers if c in mine]
        if present and len(present) != len(m.consumers):
            notes[prefix + m.producer] = f"not all of {m.consumers} are targeted; not smoothed"
        elif present:
            mappings.append(m)
    for gap in arch.scale_gaps:
        present = [prefix + c for c in gap.consumers if c in mine]
        if present:
            notes[", ".join(present)] = gap.reason
    return mappings


@torch.no_grad()
def smooth_layer(
    layer: nn.Module,
    arch: Arch,
    mine: set[str],
    inputs: LayerInputs,
    cfg: SmoothquantConfig,
    *,
    prefix: str = "",
    notes: dict[str, float | str] | None = None,
) -> None:
    """SmoothQuant's scales for one decoder layer, folded into the family's producers without any
    rounding (the float layer's function is unchanged). ``mine``: the layer's targeted linears
    (paths inside it). ``notes`` gets ``max(s) / min(s)`` per producer, or why a group was left
    unsmoothed."""
    notes = {} if notes is None else notes
    arch = layer_arch(arch, layer)  # an MoE model's dense layer: its own mappings
    mappings = _layer_mappings(layer, arch, mine, cfg, prefix, notes)
    hooks = _MaxHooks(layer, list(dict.fromkeys(m.consumers[0] for m in mappings)))
    try:
        run_layer(layer, inputs, keep=False)
    finally:
        hooks.remove()
    for m in mappings:
        lins = [layer.get_submodule(c) for c in m.consumers]
        s = smooth_scales(hooks.amax[m.consumers[0]], [lin.weight for lin in lins], cfg.alpha)
        migrate_scales(
            layer.get_submodule(m.producer),
            lins,
            s,
            s,
            norm_form=arch.norm_form,
            rows=producer_rows(layer, m),
        )
        notes[prefix + m.producer + (f"[{m.part}]" if m.part else "")] = float(s.max() / s.min())


@register_pass("quantize.smoothquant", SmoothquantConfig, needs_calibration=True, layerwise=True)
def smoothquant(model: nn.Module, cfg: SmoothquantConfig, state: CompressionState) -> PassReport:
    """Smooth (per layer, on the already-W8A8 previous layers' outputs), then W8A8 every target."""
    report = PassReport("quantize.smoothquant")
    arch = with_clamped_values(arch_for(model, "quantize.smoothquant"), model.config)
    refuse_targeted_experts(
        model, cfg, "quantize.smoothquant", "W8A8 has no kernel for routed expert weights"
    )
    check_paths(model, arch, mapping_paths(arch.smoothquant_mappings), "quantize.smoothquant")
    plan = []
    for name, module in target_modules(model, cfg):
        if type(module) is nn.Linear:
            plan.append(name)
        elif isinstance(module, nn.Module) and hasattr(module, "weight"):
            report.skipped[name] = f"{type(module).__name__} cannot run W8A8 (only nn.Linear can)"
    raise_or_report_skips(cfg, report, "quantize.smoothquant")
    scale_dtype = DTYPES[cfg.scale_dtype]
    notes: dict[str, float | str] = {}

    def process(index: int, layer: nn.Module, inputs: LayerInputs) -> None:
        prefix = f"{arch.layer_prefix}{index}."
        mine = {n[len(prefix) :] for n in plan if n.startswith(prefix)}
        smooth_layer(layer, arch, mine, inputs, cfg, prefix=prefix, notes=notes)
        for name in [n for n in plan if n.startswith(prefix)]:
            # exact int8 x int8 on every backend, so calibration may use the fast one
            set_submodule(
                model, name, w8a8_from_linear(model.get_submodule(name), scale_dtype, cfg.backend)
            )
            report.changed.append(name)

    memory = run_calibrated(model, state, process, "quantize.smoothquant", offload=cfg.offload)
    for name in plan:
        if name not in report.changed:  # outside the decoder stack (e.g. a targeted lm_head)
            set_submodule(
                model, name, w8a8_from_linear(model.get_submodule(name), scale_dtype, cfg.backend)
            )
            report.changed.append(name)
    finish_quant_report(model, report, cfg.backend, memory)
    spread = {k: v for k, v in notes.items() if isinstance(v, float)}
    report.metrics["scale_spread_max_over_min"] = spread
    warn_unscaled(report, notes, arch)
    report_coverage(model, cfg, report)  # MoE experts are left float: named, strict refuses
    return report
