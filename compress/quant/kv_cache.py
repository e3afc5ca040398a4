"""fp8 KV-cache scales: the calibration pass ``quantize.kv_cache_fp8`` and the checkpoint form
vLLM reads.

An fp8 (e4m3fn) KV cache stores each key as ``k / k_scale`` and each value as ``v / v_scale``,
one scale pair per layer (per tensor). Scale 1.0, what vLLM uses for a checkpoint without
scales, saturates every key beyond +-448 and spends the format's range on nothing when keys
are small; a calibrated scale maps the largest key seen onto 448. The pass runs the calibration
sequences through each decoder layer and records the absolute maximum of the keys and values
the layer's attention caches: after RoPE and any key norm, exactly what a KV cache holds. It
asks the layer's own attention for them through a recording stand-in for transformers' cache
(``_KvRecorder.update``), so it needs no family-specific code: every family whose attention
writes to a cache works.

The scales live on each decoder layer's attention module as buffers ``k_scale`` and ``v_scale``
(``compress.quant.kv_scales``): the export writes them with the ``kv_cache_scheme`` that says
how to read them, and loading such a checkpoint puts the buffers back. The runtime's fp8 pages
(``compress/runtime/paged.py``) and vLLM's ``--kv-cache-dtype fp8`` both read them.

Weights are not changed: put the pass after the weight passes so the scales see the keys the
quantized model produces.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from pydantic import Field, field_validator
from torch import nn

from compress.arch import DEFAULT_IGNORE, arch_for
from compress.core.errors import ConfigError, RecipeError
from compress.core.registry import CompressionState, PassConfig, PassReport, register_pass
from compress.quant.calibrated import LayerInputs, OffloadMode, run_calibrated
from compress.quant.kv_scales import FP8_E4M3_MAX, KV_CACHE_SCHEME, set_kv_scales


class KvCacheFp8Config(PassConfig):
    """margin: the scale maps ``margin x`` the largest key (value) seen onto fp8's 448, so keys
    a little beyond the calibration's range still fit. ``targets`` and ``ignore`` do not apply:
    every decoder layer's attention gets a scale pair (vLLM reads one per layer)."""

    margin: float = Field(1.0, ge=1.0, le=16.0)
    offload: OffloadMode = "none"

    @field_validator("targets", "ignore")
    @classmethod
    def _no_selection(cls, value: tuple[str, ...], info) -> tuple[str, ...]:
        default = ("Linear",) if info.field_name == "targets" else DEFAULT_IGNORE
        if tuple(value) != tuple(default):
            raise ValueError(
                f"quantize.kv_cache_fp8 scales every decoder layer's cache; remove "
                f"`{info.field_name}` (vLLM reads one scale pair per layer)"
            )
        return value


class _KvRecorder:
    """Stands in for transformers' KV cache in one layer's forward: records max|k| and max|v|
    of what the attention would cache and hands them back unchanged (no cache kept)."""

    def __init__(self) -> None:
        self.amax = [0.0, 0.0]

    def update(self, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any):
        for i, x in enumerate((key, value)):
            top = float(x.detach().abs().amax())
            if not math.isfinite(top):
                raise ValueError("calibration keys or values contain NaN/Inf")
            self.amax[i] = max(self.amax[i], top)
        return key, value


def _cache_keyword(layer: nn.Module) -> str:
    """The name the decoder layer's forward takes the KV cache under: transformers >= 5.2x
    ``cache``, earlier ``past_key_values`` (4.56+) or ``past_key_value``; GPT-NeoX's
    ``layer_past``."""
    params = inspect.signature(layer.forward).parameters
    for key in ("cache", "past_key_values", "past_key_value", "layer_past"):
        if key in params:
            return key
    raise ValueError(f"{type(layer).__name__}.forward takes no KV cache argument")


def scale_for(amax: float, margin: float) -> float:
    """The per-tensor scale that maps ``margin x amax`` onto fp8 e4m3's largest value (an
    all-zero tensor keeps 1.0)."""
    return margin * amax / FP8_E4M3_MAX if amax > 0 else 1.0


@register_pass("quantize.kv_cache_fp8", KvCacheFp8Config, needs_calibration=True, layerwise=True)
def kv_cache_fp8(model: nn.Module, cfg: KvCacheFp8Config, state: CompressionState) -> PassReport:
    """Calibrate a per-layer fp8 scale for the keys and one for the values."""
    report = PassReport("quantize.kv_cache_fp8")
    arch = arch_for(model, "quantize.kv_cache_fp8")
    if arch.latent_attention:
        raise ConfigError(
            f"quantize.kv_cache_fp8: model_type {arch.model_type!r} uses multi-head latent "
            "attention, whose cache holds a compressed latent and a shared rotary key, not "
            "per-head keys and values; fp8 scales for that cache are not implemented. Remove "
            "this pass for this family")
    amax: dict[str, list[float]] = {}

    def process(index: int, layer: nn.Module, inputs: LayerInputs) -> None:
        recorder, key = _KvRecorder(), _cache_keyword(layer)
        for hidden, kwargs in zip(inputs.hidden, inputs.kwargs, strict=True):
            # the captured call may name the cache already (GPT-NeoX's layer_past=None)
            layer(hidden, **{**kwargs, key: recorder, "use_cache": True})
        name = f"{arch.layer_prefix}{index}.{arch.attention}"
        k_amax, v_amax = recorder.amax
        if k_amax == 0.0 and v_amax == 0.0:
            raise ValueError(f"{name}: the layer's attention cached no keys; it does not write "
                             "to transformers' cache, so fp8 KV scales cannot be calibrated")
        set_kv_scales(layer.get_submodule(arch.attention), scale_for(k_amax, cfg.margin),
                      scale_for(v_amax, cfg.margin))  # fmt: skip
        amax[name] = [k_amax, v_amax]
        report.changed.append(name)

    memory = run_calibrated(model, state, process, "quantize.kv_cache_fp8", offload=cfg.offload)
    report.metrics.update(memory)
    report.metrics["kv_amax"] = amax  # per layer: [max|k|, max|v|] seen
    report.metrics["kv_cache_scheme"] = dict(KV_CACHE_SCHEME)
    if not amax:
        raise RecipeError("quantize.kv_cache_fp8: the model has no decoder layers to scale")
    return report
