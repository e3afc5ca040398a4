"""Round-to-nearest weight quantization passes: ``quantize.int8_rtn`` and ``quantize.int4_rtn``.

Each targeted ``nn.Linear`` becomes a ``QuantLinear`` whose scales come from the min/max of
each group (see ``quant_primitives``). RTN needs no data; it is the baseline the calibrated
passes (GPTQ, AWQ) must beat. Layers whose in_features the group size does not divide are
reported by name (or use ``fallback_group_size``), and ``strict: true`` turns skips into errors.
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
from compress.quant.linear import QuantLinear, WeightScheme, bits_per_weight
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
) -> PassReport:
    """Swap every targeted Linear for a QuantLinear built by ``make(linear, scheme, backend=)``."""
    report = PassReport(name)
    plan: list[tuple[str, nn.Linear, WeightScheme]] = []
    targeted = [(n, m) for n, m in target_modules(model, cfg) if isinstance(m, nn.Linear)]
    warn_unused_overrides(cfg, [n for n, _ in targeted], name)
    for layer_name, module in targeted:
        scheme = scheme_for_layer(module, cfg, n_bits, layer_name)
        if isinstance(scheme, str):
            report.skipped[layer_name] = scheme
        else:
            plan.append((layer_name, module, scheme))
    raise_or_report_skips(cfg, report, name)  # before any work: strict fails with nothing changed
    bytes_before = bytes_after = 0
    err_num = err_den = 0.0
    schemes: dict[str, int] = {}
    for layer_name, linear, scheme in plan:
        quant = make(linear, scheme, backend=cfg.backend)
        w = linear.weight.detach().to(torch.float32)
        err_num += float((quant.dequantized_weight() - w).pow(2).sum())
        err_den += float(w.pow(2).sum())
        bytes_before += w.numel() * linear.weight.element_size()
        bytes_after += quant.weight_bytes()
        set_submodule(model, layer_name, quant)
        report.changed.append(layer_name)
        schemes[scheme.describe()] = schemes.get(scheme.describe(), 0) + 1
    report.metrics.update(
        layers=len(plan),
        schemes=schemes,
        weight_bytes_before=bytes_before,
        weight_bytes_after=bytes_after,
        relative_weight_error=(err_num / err_den) ** 0.5 if err_den else 0.0,
        bits_per_weight=bits_per_weight(model, [n for n, _, _ in plan]),
    )
    return report


@register_pass("quantize.int4_rtn", Int4RtnConfig)
def int4_rtn(model: nn.Module, cfg: Int4RtnConfig, state: CompressionState) -> PassReport:
    return quantize_linears(model, cfg, 4, "quantize.int4_rtn")


@register_pass("quantize.int8_rtn", Int8RtnConfig)
def int8_rtn(model: nn.Module, cfg: Int8RtnConfig, state: CompressionState) -> PassReport:
    return quantize_linears(model, cfg, 8, "quantize.int8_rtn")
