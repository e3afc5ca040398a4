"""Fused MoE experts for the weight-quantization passes: which expert modules a pass config
targets (``target_experts``: experts are an MLP's linears in fused 3-D form, transformers 5's
``[E, 2I, H]`` / ``[E, H, I]`` parameters, so a pass targeting ``Linear`` targets them), their
per-expert schemes (``plan_experts``) and their RTN (``rtn_experts``, ``rtn_layer_experts``)
into a ``QuantExperts``. Shared by RTN, GPTQ (which falls back to it for experts the router sends
too few calibration tokens) and AWQ (which has no scale search for routed experts).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch
from torch import nn

from compress.arch import (
    ARCHS,
    Moe,
    arch_for,
    expert_biases,
    expert_shape,
    expert_weights,
    model_type,
    sparse_layers,
)
from compress.core.errors import ConfigError
from compress.core.matcher import matches, set_submodule
from compress.core.registry import PassConfig, PassReport
from compress.quant.linear import (
    QuantExperts,
    WeightScheme,
    expert_activation,
    routed_experts_forward,
)
from compress.quant.scheme import WeightQuantConfig, scheme_for_layer


def target_experts(model: nn.Module, cfg: PassConfig) -> list[tuple[str, nn.Module]]:
    """The float fused-experts modules of an MoE model (``compress.arch.Moe``) that ``cfg``
    targets, in layer order. Experts are the MLP's linear layers in fused form, so a pass
    that targets ``Linear`` targets them too; otherwise a target must name them (exact name,
    class name or ``re:``). ``ignore`` applies to the experts module's name."""
    arch = ARCHS.get(model_type(model))
    if arch is None or arch.moe is None:
        return []
    found = []
    for index in sparse_layers(model, arch):
        name = f"{arch.layer_prefix}{index}.{arch.moe.fused}"
        module = model.get_submodule(name)
        if isinstance(module, QuantExperts) or any(matches(name, module, p) for p in cfg.ignore):
            continue
        if "Linear" in cfg.targets or any(matches(name, module, p) for p in cfg.targets):
            found.append((name, module))
    return found



def override_names(model: nn.Module, cfg: PassConfig) -> list[str]:
    """The names per-layer ``overrides`` match for the targeted experts modules (``plan_experts``:
    ``<experts>.<gate_up>`` and ``<experts>.<down>``)."""
    found = target_experts(model, cfg)
    if not found:
        return []
    moe = _moe(model, "overrides")
    return [f"{name}.{param}" for name, _ in found for param in (moe.gate_up, moe.down)]


ExpertPlan = dict[str, tuple[nn.Module, tuple[WeightScheme, WeightScheme]]]


def plan_experts(model: nn.Module, cfg: WeightQuantConfig, n_bits: int, report: PassReport
                 ) -> ExpertPlan:
    """Targeted fused-experts modules -> (module, (gate/up scheme, down scheme)); one whose
    group size divides neither input width is a reported skip (``scheme_for_layer``; per-layer
    ``overrides`` match ``<experts>.<gate_up>`` and ``<experts>.<down>``)."""
    found = target_experts(model, cfg)
    if not found:
        return {}
    moe = _moe(model, report.name)
    plan: ExpertPlan = {}
    for name, module in found:
        _, hidden, inter = expert_shape(module, moe)
        pair = []
        for param, width in ((moe.gate_up, hidden), (moe.down, inter)):
            probe = nn.Linear(width, 1, bias=False, device="meta")  # scheme_for_layer reads K
            pair.append(scheme_for_layer(probe, cfg, n_bits, f"{name}.{param}"))
        params = (moe.gate_up, moe.down)
        reasons = [f"{p}: {s}" for p, s in zip(params, pair, strict=True) if isinstance(s, str)]
        if reasons:
            report.skipped[name] = "; ".join(reasons)
        else:
            plan[name] = (module, (pair[0], pair[1]))  # type: ignore[assignment]
    return plan


def rtn_layer_experts(
    model: nn.Module, plan: dict, prefix: str, why: str, backend: str
) -> dict[str, str]:
    """RTN of the experts modules of ``plan`` (``plan_experts``) under ``prefix``, one decoder
    layer's, for a pass that has no method of its own for experts (AWQ: its scale search needs
    a producer that feeds one linear group; routed experts have none), called in its per-layer
    step: the layer is resident there when streamed, and the next layers calibrate on its
    quantized output, as after GPTQ. Returns ``{experts module: "<why> -> RTN"}``: the pass
    lists them in ``report.changed`` after its linears' ``finish_quant_report``."""
    done = {}
    for name, (module, pair) in plan.items():
        if name.startswith(prefix):
            rtn_experts(model, name, module, pair, backend)
            done[name] = f"{why} -> RTN"
    return done


def _moe(model: nn.Module, what: str) -> Moe:
    moe = arch_for(model, what).moe
    assert moe is not None, "target_experts finds nothing outside MoE families"
    return moe


def rtn_experts(
    model: nn.Module,
    name: str,
    module: nn.Module,
    schemes: tuple[WeightScheme, WeightScheme],
    backend: str,
) -> tuple[QuantExperts, float, float]:
    """Swap the fused experts at ``name`` for their RTN ``QuantExperts``; returns it and the
    squared weight error and squared weight norm (for ``relative_weight_error``)."""
    moe = _moe(model, "RTN of MoE layers")
    quant = QuantExperts.from_fused(module, moe, schemes, backend=backend)
    # one expert's projection at a time: whole dequantized copies and their differences were
    # ~4x the experts' fp32 weights (measured: a Qwen3-30B-A3B layer, 604M expert weights,
    # peaked at 13.4 GB streamed)
    num, den = 0.0, 0.0
    for e in range(quant.num_experts):
        weights = expert_weights(module, moe, e)
        for layer, w in zip(quant.projections(e), weights, strict=True):
            w = w.detach().float()
            num += float((layer.dequantized_weight() - w).pow(2).sum())
            den += float(w.pow(2).sum())
    replace_experts(model, name, module, quant)
    return quant, num, den


def replace_experts(model: nn.Module, name: str, fused: nn.Module, quant: nn.Module) -> None:
    """Put ``quant`` at ``name`` in place of the float ``fused`` experts, and free those: a
    pass's plan still holds them (``plan_experts``), so each streamed layer's float experts
    stayed in memory until the pass ended (two GPT-OSS-120B layers' were 12.7 GB in bf16,
    and every layer of a deep model adds its own)."""
    set_submodule(model, name, quant)
    fused.to("meta")




def refuse_targeted_experts(model: nn.Module, cfg: PassConfig, what: str, why: str) -> None:
    """A ConfigError, before any work, when ``cfg`` targets fused experts that the pass ``what``
    cannot quantize (``why``): it would leave most of an MoE decoder float. The message gives
    the ``ignore`` entry that quantizes the rest and leaves the experts float on purpose."""
    found = target_experts(model, cfg)
    if not found:
        return
    moe = _moe(model, what)
    raise ConfigError(
        f"{what}: {len(found)} fused expert modules are targeted ({found[0][0]}, ...) and {why}. "
        f"To quantize everything else and keep them float on purpose, add "
        f"'re:.*{re.escape(moe.fused)}$' to `ignore`; or use quantize.gptq / quantize.int4_rtn "
        "/ quantize.int8_rtn, which quantize every expert"
    )


class ExpertProjection(nn.Linear):
    """One expert's projection as an ``nn.Linear`` whose weight (and bias) are views of the
    fused parameters, computed in its input's dtype from a contiguous copy made per call: a
    streamed layer's bf16 experts are widened one projection at a time (a whole fused module
    widened at once was 12.7 GB for a GPT-OSS-120B layer), and float32 experts held in either
    layout give the same copy, so both compute the same bits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.weight.stride(0) < self.weight.stride(1):  # held [in, out] (GPT-OSS)
            # copied as held, rows of the [in, out] view in order: gathering it into [out, in]
            # strode across the fused tensor and took twice the forward's time
            y = x @ self.weight.T.to(x.dtype).contiguous()
            return y if bias is None else y + bias
        return nn.functional.linear(x, self.weight.to(x.dtype).contiguous(), bias)


class FloatExpertsView(nn.Module):
    """A float fused-experts module (``compress.arch.Moe``) as one ``ExpertProjection`` per
    expert and projection, named as ``QuantExperts`` names them, whose weights are views of the
    fused parameters (no copy), computing the same (``routed_experts_forward``) one expert at a
    time. ``compress tune`` measures each expert's linears through it (hooks see only
    ``nn.Linear`` calls, and the fused module computes with slices of its parameters); the
    calibrated passes run a layer's experts through it (``viewed_experts``)."""

    def __init__(self, module: nn.Module, moe: Moe) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = expert_shape(module, moe)
        self.names, self.activation = moe.checkpoint_projections, expert_activation(module, moe)
        for e in range(self.num_experts):
            weights = expert_weights(module, moe, e)
            biases = expert_biases(module, moe, e) or (None,) * 3
            linears = {}
            for name, weight, bias in zip(self.names, weights, biases, strict=True):
                linear = ExpertProjection(weight.shape[1], weight.shape[0], bias=bias is not None,
                                          device="meta")
                linear.weight = nn.Parameter(weight.detach(), requires_grad=False)  # a view
                if bias is not None:
                    linear.bias = nn.Parameter(bias.detach(), requires_grad=False)
                linears[name] = linear
            self.add_module(str(e), nn.ModuleDict(linears))

    def projections(self, e: int) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        block = self.get_submodule(str(e))
        return tuple(block[n] for n in self.names)  # type: ignore[return-value]

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return routed_experts_forward(self, hidden, top_k_index, top_k_weights)


@contextlib.contextmanager
def viewed_experts(model: nn.Module, names: list[str]) -> Iterator[None]:
    """Within: each float fused-experts module ``names`` of ``model`` is its
    ``FloatExpertsView``. On exit, a view still in place gives way to its fused module again
    (one that a pass replaced meanwhile, by its ``QuantExperts``, stays replaced)."""
    moe = _moe(model, "the per-expert view") if names else None
    views = {}
    try:
        for name in names:
            fused = model.get_submodule(name)
            views[name] = (FloatExpertsView(fused, moe), fused)
            set_submodule(model, name, views[name][0])
        yield
    finally:
        for name, (view, fused) in views.items():
            if model.get_submodule(name) is view:
                set_submodule(model, name, fused)


def float_experts_in(model: nn.Module, prefix: str) -> list[str]:
    """The float fused-experts modules of ``model`` under ``prefix`` (one decoder layer's)."""
    arch = ARCHS.get(model_type(model))
    if arch is None or arch.moe is None:
        return []
    names = [f"{arch.layer_prefix}{i}.{arch.moe.fused}" for i in sparse_layers(model, arch)]
    return [n for n in names if n.startswith(prefix)
            and not isinstance(model.get_submodule(n), QuantExperts)]
