"""Round-to-nearest weight quantization passes: ``quantize.int8_rtn`` and ``quantize.int4_rtn``.

Each targeted ``nn.Linear`` becomes a ``QuantLinear`` whose scales come from the min/max of
each group (see ``quant_primitives``). RTN needs no data; it is the baseline the calibrated
passes (GPTQ, AWQ) must beat. Layers whose in_features the group size does not divide are
reported by name (or use ``fallback_group_size``), and ``strict: true`` turns skips into errors.

Mixture-of-experts models (``compress.arch.Moe``): every expert is quantized too. transformers
5 keeps the experts as fused 3-D parameters, not ``nn.Linear``; the targeted experts module
becomes a ``QuantExperts`` (per expert, group-wise gate/up/down ``QuantLinear``). The router is
never quantized. The report counts every weight matrix of the model (``quantized_share``,
``bits_per_weight``, ``weight_bytes_*``: ``compress.quant.coverage.report_coverage``).
"""

from __future__ import annotations

import torch
from pydantic import field_validator
from torch import nn

from compress.core.matcher import set_submodule, target_modules
from compress.core.registry import (
    CompressionState,
    PassReport,
    raise_or_report_skips,
    register_pass,
)
from compress.kernels import reference
from compress.quant.coverage import report_coverage
from compress.quant.experts import override_names, plan_experts, rtn_experts
from compress.quant.linear import QuantLinear, WeightScheme, quantization_coverage
from compress.quant.scheme import (
    WeightQuantConfig,
    check_group_size,
    scheme_for_layer,
    warn_unused_overrides,
)


class Int4RtnConfig(WeightQuantConfig):
    """int4 group-wise RTN. group_size: input channels per scale; fallback_group_size: used for
    layers whose in_features group_size does not divide (e.g. 64 for hidden 576 when 128)."""

    group_size: int = 128
    fallback_group_size: int | None = None

    @field_validator("group_size")
    @classmethod
    def _group(cls, value: int) -> int:
        return check_group_size(value, "group_size")  # type: ignore[return-value]

    @field_validator("fallback_group_size")
    @classmethod
    def _fallback(cls, value: int | None) -> int | None:
        return check_group_size(value, "fallback_group_size")


class Int8RtnConfig(WeightQuantConfig):
    """int8 RTN; per-output-channel scales unless group_size is set."""

    group_size: int | None = None

    @field_validator("group_size")
    @classmethod
    def _group(cls, value: int | None) -> int | None:
        return check_group_size(value, "group_size")


def quantize_linears(
    model: nn.Module,
    cfg: Int4RtnConfig | Int8RtnConfig,
    n_bits: int,
    name: str,
    make: callable = QuantLinear.from_linear,  # type: ignore[valid-type]
    stream=None,
) -> PassReport:
    """Swap every targeted Linear for a QuantLinear built by ``make(linear, scheme, backend=)``
    and every targeted fused-experts module for a ``QuantExperts`` (RTN).

    ``stream`` (``compress.io.stream.StreamedModel``): the model is a meta skeleton; each
    decoder layer with targets is read, quantized and handed back in turn, and a target
    outside the stack (the output head) is read and stays resident once quantized."""
    report = PassReport(name)
    plan: list[tuple[str, nn.Linear, WeightScheme]] = []
    targeted = [(n, m) for n, m in target_modules(model, cfg) if isinstance(m, nn.Linear)]
    warn_unused_overrides(cfg, [n for n, _ in targeted] + override_names(model, cfg), name)
    for layer_name, module in targeted:
        scheme = scheme_for_layer(module, cfg, n_bits, layer_name)
        if isinstance(scheme, str):
            report.skipped[layer_name] = scheme
        else:
            plan.append((layer_name, module, scheme))
    experts = plan_experts(model, cfg, n_bits, report)
    raise_or_report_skips(cfg, report, name)  # before any work: strict fails with nothing changed
    bytes_before = quantization_coverage(model)["weight_bytes"]
    err_num = err_den = 0.0
    schemes: dict[str, int] = {}
    # linears and fused experts in one list: streamed, each layer is read and finished once
    work = [(*item, None) for item in plan]
    work += [(n, module, None, pair) for n, (module, pair) in experts.items()]
    # streamed, a layer's fused experts stay as stored (bf16: a GPT-OSS-120B layer's are 6.4 GB,
    # 12.7 in float32); RTN widens one expert's projection at a time, to the same codes
    items = work if stream is None else stream.each_linear(work, narrow=set(experts))
    for layer_name, module, scheme, pair in items:
        if pair is not None:  # a fused experts module
            quant, num, den = rtn_experts(model, layer_name, module, pair, cfg.backend)
            err_num, err_den = err_num + num, err_den + den
            report.changed.append(layer_name)
            for expert_scheme, count in zip(pair, (2, 1), strict=True):  # gate, up; down
                key = expert_scheme.describe()
                schemes[key] = schemes.get(key, 0) + count * quant.num_experts
            continue
        quant = make(module, scheme, backend=cfg.backend)
        num, den = _squared_error(quant, module.weight.detach())
        err_num, err_den = err_num + num, err_den + den
        set_submodule(model, layer_name, quant)
        report.changed.append(layer_name)
        schemes[scheme.describe()] = schemes.get(scheme.describe(), 0) + 1
    report.metrics.update(
        layers=len(plan),
        expert_modules=len(experts),
        schemes=schemes,
        weight_bytes_before=bytes_before,
        relative_weight_error=(err_num / err_den) ** 0.5 if err_den else 0.0,
    )
    report_coverage(model, cfg, report)
    return report


def _squared_error(quant: QuantLinear, weight: torch.Tensor) -> tuple[float, float]:
    """``(sum (dequantized - w)^2, sum w^2)`` over row blocks: the whole dequantized fp32 copy
    and its difference would be ~3x the weight at once (1 GB for a 13B-sized linear)."""
    w_q, zeros = quant.codes()
    group = quant.group_size
    rows = max(1, reference.ROW_BLOCK_ELEMENTS // max(weight.shape[1], 1))
    num = den = 0.0
    for r0 in range(0, weight.shape[0], rows):
        w = weight[r0 : r0 + rows].to(torch.float32)
        block_zeros = None if zeros is None else zeros[r0 : r0 + rows]
        dq = reference.dequantize(w_q[r0 : r0 + rows], quant.weight_scale[r0 : r0 + rows],
                                  block_zeros, group, torch.float32)
        num += float((dq - w).pow(2).sum())
        den += float(w.pow(2).sum())
    return num, den


@register_pass("quantize.int4_rtn", Int4RtnConfig, layerwise=True)
def int4_rtn(model: nn.Module, cfg: Int4RtnConfig, state: CompressionState) -> PassReport:
    return quantize_linears(model, cfg, 4, "quantize.int4_rtn", stream=state.stream)


@register_pass("quantize.int8_rtn", Int8RtnConfig, layerwise=True)
def int8_rtn(model: nn.Module, cfg: Int8RtnConfig, state: CompressionState) -> PassReport:
    return quantize_linears(model, cfg, 8, "quantize.int8_rtn", stream=state.stream)
