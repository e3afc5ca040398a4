"""Weight-quantization settings shared by the RTN, GPTQ and AWQ passes, and the per-layer
scheme they resolve to.

One place for what the passes used to borrow from each other: the allowed group sizes, the
scale dtypes, per-layer ``overrides`` (``LayerOverride``), the config fields every weight pass
shares (``WeightQuantConfig``) or every calibrated one adds (``CalibratedWeightConfig``), and
``scheme_for_layer``, which turns a config and one ``nn.Linear`` into the ``WeightScheme`` it gets
(or the reason it is skipped). Settings only: no tensor math, no module swaps.
"""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import field_validator
from torch import nn

from compress.core.matcher import check_pattern, matches
from compress.core.registry import DTYPES, PassConfig, StrictConfig
from compress.quant.linear import WeightScheme

log = logging.getLogger(__name__)

GROUP_SIZES = (32, 64, 128, 256)
BackendName = Literal["auto", "reference", "cpu", "triton"]


def check_group_size(value: int | None, field: str) -> int | None:
    """``value`` itself; ValueError naming ``field`` unless it is None or in ``GROUP_SIZES``."""
    if value is not None and value not in GROUP_SIZES:
        raise ValueError(f"{field}={value} is not supported; allowed values: {list(GROUP_SIZES)}")
    return value


class LayerOverride(StrictConfig):
    """A per-layer exception to the pass's scheme, e.g. keep the first and last ``down_proj`` at
    8 bits: ``{layers: "re:.*layers\\.(0|29)\\.mlp\\.down_proj$", n_bits: 8, group_size: channel}``.
    layers: exact module name or ``re:<regex>`` (matched from the start of the name, see
    ``compress.core.matches``); n_bits / group_size / symmetric: None inherits, group_size
    ``channel`` means one scale per output channel. The first matching override wins."""

    layers: str
    n_bits: Literal[4, 8] | None = None
    group_size: int | Literal["channel"] | None = None
    symmetric: bool | None = None  # per-layer zero points (false) or not (true)

    @field_validator("layers")
    @classmethod
    def _pattern(cls, value: str) -> str:
        return check_pattern(value)

    @field_validator("group_size")
    @classmethod
    def _group(cls, value: int | str | None) -> int | str | None:
        return value if value == "channel" else check_group_size(value, "group_size")  # type: ignore[arg-type]

    def matches(self, name: str) -> bool:
        return matches(name, None, self.layers)


class WeightQuantConfig(PassConfig):
    """Settings of every weight-quantization pass (RTN, GPTQ, AWQ)."""

    symmetric: bool = True  # false: per-group zero points (asymmetric)
    scale_dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    backend: BackendName = "auto"  # kernel backend of the produced QuantLinear modules
    overrides: tuple[LayerOverride, ...] = ()  # per-layer bits/group exceptions (first match)
    # Symmetric grid: "restricted" = amax / (2**(b-1) - 1), "full" = amax / ((2**b - 1) / 2), the
    # compressed-tensors / AutoGPTQ convention, "signed" = +-amax / 2**(b-1), llama.cpp's and
    # auto-round's (negative scales; see compress/quant/primitives.py).
    symmetric_grid: Literal["restricted", "full", "signed"] = "restricted"


class CalibratedWeightConfig(WeightQuantConfig):
    """The bits and groups of the calibrated quantization passes (GPTQ, AWQ)."""

    n_bits: Literal[4, 8] = 4
    group_size: int | None = 128  # None: one scale per output channel
    fallback_group_size: int | None = None

    @field_validator("group_size")
    @classmethod
    def _group(cls, value: int | None) -> int | None:
        return check_group_size(value, "group_size")

    @field_validator("fallback_group_size")
    @classmethod
    def _fallback(cls, value: int | None) -> int | None:
        return check_group_size(value, "fallback_group_size")


def scheme_for_layer(
    linear: nn.Linear, cfg: WeightQuantConfig, n_bits: int, name: str = ""
) -> WeightScheme | str:
    """The scheme for this layer (after per-layer ``overrides``), or the reason to skip it."""
    k = linear.in_features
    scale_dtype = DTYPES[cfg.scale_dtype]
    grid = cfg.symmetric_grid
    group_size = getattr(cfg, "group_size", None)
    fallback = getattr(cfg, "fallback_group_size", None)
    symmetric = cfg.symmetric
    override = next((o for o in cfg.overrides if o.matches(name)), None)
    if override is not None:
        n_bits = override.n_bits or n_bits
        symmetric = cfg.symmetric if override.symmetric is None else override.symmetric
        if override.group_size is not None:
            group_size = None if override.group_size == "channel" else override.group_size
            fallback = None
    if group_size is None:  # one scale per output channel
        return WeightScheme(n_bits, None, symmetric, scale_dtype, grid)
    groups = [g for g in (group_size, fallback) if g]
    for group in groups:
        if k % group == 0:
            return WeightScheme(n_bits, group, symmetric, scale_dtype, grid)
    return f"in_features {k} is not divisible by group_size {' or '.join(map(str, groups))}"


def warn_unused_overrides(cfg: WeightQuantConfig, names: list[str], where: str) -> None:
    """Log a WARNING for each override that matches none of the targeted layers ``names``: most
    often a ``re:`` pattern written to search (``re:layers\\.0``) where it matches from the start
    of the name (``re:.*layers\\.0``)."""
    for override in cfg.overrides:
        if not any(override.matches(name) for name in names):
            log.warning(
                "%s: override layers=%r matches none of the %d targeted layers (re: patterns "
                "match from the start of the module name: write re:.*<pattern>)",
                where, override.layers, len(names),
            )
