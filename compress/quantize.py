"""Round-to-nearest weight quantization passes: ``quantize.int8_rtn`` and ``quantize.int4_rtn``.

Each targeted ``nn.Linear`` becomes a ``QuantLinear`` whose scales come from the min/max of
each group (see ``quant_primitives``). RTN needs no data; it is the baseline the calibrated
passes (GPTQ, AWQ) must beat. Layers whose in_features the group size does not divide are
reported by name (or use ``fallback_group_size``), and ``strict: true`` turns skips into errors.
"""

from __future__ import annotations

import re
from typing import Literal

import torch
from pydantic import field_validator
from torch import nn

from compress.core import (
    CompressionState,
    PassConfig,
    PassReport,
    StrictConfig,
    check_pattern,
    raise_or_report_skips,
    register_pass,
    set_submodule,
    target_modules,
)
from compress.modules import QuantLinear, WeightScheme

GROUP_SIZES = (32, 64, 128, 256)
SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
BackendName = Literal["auto", "reference", "cpu", "triton"]


def _check_group(value: int | None, field: str) -> int | None:
    if value is not None and value not in GROUP_SIZES:
        raise ValueError(f"{field}={value} is not supported; allowed values: {list(GROUP_SIZES)}")
    return value


class LayerOverride(StrictConfig):
    """A per-layer exception to the pass's scheme, e.g. keep the first and last ``down_proj`` at
    8 bits: ``{layers: "re:layers\\.(0|29)\\.mlp\\.down_proj", n_bits: 8, group_size: channel}``.
    layers: exact module name or ``re:<regex>`` (searched); n_bits / group_size: None inherits,
    group_size ``channel`` means one scale per output channel. The first matching override wins."""

    layers: str
    n_bits: Literal[4, 8] | None = None
    group_size: int | Literal["channel"] | None = None

    @field_validator("layers")
    @classmethod
    def _pattern(cls, value: str) -> str:
        return check_pattern(value)

    @field_validator("group_size")
    @classmethod
    def _group(cls, value: int | str | None) -> int | str | None:
        return value if value == "channel" else _check_group(value, "group_size")  # type: ignore[arg-type]

    def matches(self, name: str) -> bool:
        if self.layers.startswith("re:"):
            return re.search(self.layers[3:], name) is not None
        return self.layers == name


class _RtnConfig(PassConfig):
    symmetric: bool = True  # false: per-group zero points (asymmetric)
    scale_dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    backend: BackendName = "auto"  # kernel backend of the produced QuantLinear modules
    overrides: tuple[LayerOverride, ...] = ()  # per-layer bits/group exceptions (first match)
    # Symmetric grid: "restricted" = amax / (2**(b-1) - 1), "full" = amax / ((2**b - 1) / 2), the
    # compressed-tensors / AutoGPTQ convention (see compress/quant_primitives.py).
    symmetric_grid: Literal["restricted", "full"] = "restricted"


class Int4RtnConfig(_RtnConfig):
    """int4 group-wise RTN. group_size: input channels per scale; fallback_group_size: used for
    layers whose in_features group_size does not divide (e.g. 64 for hidden 576 when 128)."""

    group_size: int = 128
    fallback_group_size: int | None = None

    @field_validator("group_size")
    @classmethod
    def _group(cls, value: int) -> int:
        return _check_group(value, "group_size")  # type: ignore[return-value]

    @field_validator("fallback_group_size")
    @classmethod
    def _fallback(cls, value: int | None) -> int | None:
        return _check_group(value, "fallback_group_size")


class Int8RtnConfig(_RtnConfig):
    """int8 RTN; per-output-channel scales unless group_size is set."""

    group_size: int | None = None

    @field_validator("group_size")
    @classmethod
    def _group(cls, value: int | None) -> int | None:
        return _check_group(value, "group_size")


def scheme_for_layer(
    linear: nn.Linear, cfg: _RtnConfig, n_bits: int, name: str = ""
) -> WeightScheme | str:
    """The scheme for this layer (after per-layer ``overrides``), or the reason to skip it."""
    k = linear.in_features
    scale_dtype = SCALE_DTYPES[cfg.scale_dtype]
    full_range = cfg.symmetric_grid == "full"
    group_size = getattr(cfg, "group_size", None)
    fallback = getattr(cfg, "fallback_group_size", None)
    override = next((o for o in cfg.overrides if o.matches(name)), None)
    if override is not None:
        n_bits = override.n_bits or n_bits
        if override.group_size is not None:
            group_size = None if override.group_size == "channel" else override.group_size
            fallback = None
    if group_size is None:  # one scale per output channel
        return WeightScheme(n_bits, None, cfg.symmetric, scale_dtype, full_range)
    groups = [g for g in (group_size, fallback) if g]
    for group in groups:
        if k % group == 0:
            return WeightScheme(n_bits, group, cfg.symmetric, scale_dtype, full_range)
    return f"in_features {k} is not divisible by group_size {' or '.join(map(str, groups))}"


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
    for layer_name, module in target_modules(model, cfg):
        if not isinstance(module, nn.Linear):
            continue
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


def bits_per_weight(model: nn.Module, names: list[str]) -> float | None:
    """Average stored bits per weight (codes + scales + zero points) over the named
    QuantLinear layers: the mixed-precision summary when overrides give layers other schemes."""
    bits = numel = 0
    for name in names:
        module = model.get_submodule(name)
        if isinstance(module, QuantLinear):
            bits += 8 * module.weight_bytes()
            numel += module.in_features * module.out_features
    return bits / numel if numel else None


@register_pass("quantize.int4_rtn", Int4RtnConfig)
def int4_rtn(model: nn.Module, cfg: Int4RtnConfig, state: CompressionState) -> PassReport:
    return quantize_linears(model, cfg, 4, "quantize.int4_rtn")


@register_pass("quantize.int8_rtn", Int8RtnConfig)
def int8_rtn(model: nn.Module, cfg: Int8RtnConfig, state: CompressionState) -> PassReport:
    return quantize_linears(model, cfg, 8, "quantize.int8_rtn")
