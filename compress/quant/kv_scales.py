"""fp8 KV-cache scales on a model and in a checkpoint (no pass: read by the export, the loader
and the runtime; the calibration pass is ``compress.quant.kv_cache``).

Each decoder layer's attention module holds buffers ``k_scale`` and ``v_scale`` (fp32 ``[1]``),
so the state dict carries them under the names vLLM and llm-compressor use
(``model.layers.N.self_attn.k_scale``); a checkpoint's ``quantization_config`` says how to read
them with ``kv_cache_scheme`` (``KV_CACHE_SCHEME``: 8-bit float, per tensor, static,
symmetric). An fp8 e4m3fn cache stores ``k / k_scale`` and ``v / v_scale``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from compress.arch import arch_for, decoder_layers

FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
# compressed-tensors QuantizationArgs of the cache, as llm-compressor writes them
KV_CACHE_SCHEME: dict[str, Any] = {
    "num_bits": 8,
    "type": "float",
    "strategy": "tensor",
    "dynamic": False,
    "symmetric": True,
    "group_size": None,
    "block_structure": None,
    "actorder": None,
    "observer": "minmax",
    "observer_kwargs": {},
}
SCALE_NAMES = ("k_scale", "v_scale")


def attention_modules(model: nn.Module, what: str) -> list[nn.Module]:
    """The attention module of each decoder layer, in order."""
    arch = arch_for(model, what)
    return [layer.get_submodule(arch.attention) for layer in decoder_layers(model, what)]


def set_kv_scales(attention: nn.Module, k_scale: float, v_scale: float) -> None:
    """Store a layer's scale pair as its attention's ``k_scale`` / ``v_scale`` buffers."""
    for name, value in zip(SCALE_NAMES, (k_scale, v_scale), strict=True):
        tensor = torch.tensor([float(value)], dtype=torch.float32)
        if name in attention._buffers:
            attention._buffers[name] = tensor
        else:
            attention.register_buffer(name, tensor)


def add_kv_scale_buffers(model: nn.Module) -> None:
    """Empty (meta) ``k_scale`` / ``v_scale`` buffers on every layer's attention, for a load
    that then reads them from a checkpoint whose config has a ``kv_cache_scheme``."""
    for attention in attention_modules(model, "loading fp8 KV-cache scales"):
        for name in SCALE_NAMES:
            if name not in attention._buffers:
                attention.register_buffer(name, torch.empty(1, device="meta"))


def kv_cache_scales(model: nn.Module) -> list[tuple[float, float]] | None:
    """Each layer's (k_scale, v_scale) when every layer has them (a calibrated or loaded
    model), else None."""
    pairs = []
    for attention in attention_modules(model, "fp8 KV-cache scales"):
        scales = [attention._buffers.get(name) for name in SCALE_NAMES]
        if any(s is None or s.device.type == "meta" for s in scales):
            return None
        pairs.append((float(scales[0].reshape(-1)[0]), float(scales[1].reshape(-1)[0])))
    return pairs


def has_kv_scales(model: nn.Module) -> bool:
    """Whether any layer's attention holds fp8 KV scale buffers (loaded or on meta)."""
    return any(
        name.rsplit(".", 1)[-1] in SCALE_NAMES for name, _ in model.named_buffers()
    )
