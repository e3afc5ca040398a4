"""int8 KV cache: quantize keys/values per token and per head, usable in ``generate``.

Functions (reusable by any runtime, e.g. a static-cache decode loop):
``quantize_kv(x)`` turns ``x [B, H, T, D]`` into int8 codes plus one fp32 scale per
(batch, head, token) (``axis="token"``, symmetric absmax over D) or per (batch, head, channel)
over the tokens given (``axis="channel"``, for a fixed prefix); ``dequantize_kv`` inverts it.
Per-token scales make the cache appendable: each new token is quantized on its own, nothing
already stored is ever re-quantized.

``Int8KVCache`` is a transformers ``Cache`` (one ``Int8KVLayer`` per decoder layer) that stores
int8 codes + scales and hands attention the dequantized keys/values. Supported where
transformers' dynamic cache is: decoder-only models using ``past_key_values`` with full attention
(Llama, Qwen2, Mistral without sliding window) in ``generate(..., past_key_values=Int8KVCache())``
or a manual forward loop, batch >= 1, greedy/sampling. Not supported: beam search reordering,
sliding-window layers, static-cache/compiled decoding (use the functions there). Memory per
token per layer is ``2 * H_kv * (D + 4)`` bytes instead of ``2 * H_kv * D * elem_size``; the
attention itself still runs in the model's float dtype (this saves memory, not FLOPs).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from transformers.cache_utils import Cache, DynamicLayer

Axis = Literal["token", "channel"]


def quantize_kv(x: torch.Tensor, axis: Axis = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """``x [B, H, T, D]`` -> ``(codes int8 [B, H, T, D], scales fp32)``; scales are
    ``[B, H, T, 1]`` for ``axis="token"``, ``[B, H, 1, D]`` for ``axis="channel"``."""
    if x.dim() != 4:
        raise ValueError(f"expected keys/values [B, H, T, D], got shape {tuple(x.shape)}")
    dim = -1 if axis == "token" else -2
    amax = x.detach().abs().amax(dim=dim, keepdim=True).to(torch.float32)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    codes = torch.clamp(torch.round(x.to(torch.float32) / scales), -127, 127).to(torch.int8)
    return codes, scales


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``quantize_kv`` (codes * scales, broadcast) in ``dtype``."""
    return (codes.to(torch.float32) * scales).to(dtype)


def kv_bytes_per_token(
    num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> dict[str, int]:
    """Bytes of keys+values per token for the whole model: float vs int8 with per-token scales."""
    float_bytes = 2 * num_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    int8_bytes = 2 * num_layers * kv_heads * (head_dim + 4)  # int8 codes + one fp32 scale
    return {"float": float_bytes, "int8": int8_bytes, "saved": float_bytes - int8_bytes}


class Int8KVLayer(DynamicLayer):
    """One decoder layer's cache: int8 codes and per-token scales, appended per step."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.dtype = key_states.dtype
        self.k_codes = self.v_codes = self.k_scales = self.v_scales = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        k_codes, k_scales = quantize_kv(key_states)
        v_codes, v_scales = quantize_kv(value_states)
        if self.k_codes is None:
            self.k_codes, self.k_scales, self.v_codes, self.v_scales = (
                k_codes,
                k_scales,
                v_codes,
                v_scales,
            )
        else:  # [B, H, T, D]: append along T
            self.k_codes = torch.cat([self.k_codes, k_codes], dim=-2)
            self.k_scales = torch.cat([self.k_scales, k_scales], dim=-2)
            self.v_codes = torch.cat([self.v_codes, v_codes], dim=-2)
            self.v_scales = torch.cat([self.v_scales, v_scales], dim=-2)
        # `keys`/`values` stay empty: only the int8 form is kept between steps
        return (
            dequantize_kv(self.k_codes, self.k_scales, self.dtype),
            dequantize_kv(self.v_codes, self.v_scales, self.dtype),
        )

    def get_seq_length(self) -> int:
        return 0 if not self.is_initialized or self.k_codes is None else self.k_codes.shape[-2]

    def reset(self) -> None:
        self.k_codes = self.v_codes = self.k_scales = self.v_scales = None
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if tokens_to_remove == 0 or self.k_codes is None:
            return
        keep = slice(None, tokens_to_remove)
        self.k_codes, self.k_scales = self.k_codes[..., keep, :], self.k_scales[..., keep, :]
        self.v_codes, self.v_scales = self.v_codes[..., keep, :], self.v_scales[..., keep, :]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.k_codes is not None:
            for name in ("k_codes", "k_scales", "v_codes", "v_scales"):
                setattr(self, name, getattr(self, name).repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.k_codes is not None:
            for name in ("k_codes", "k_scales", "v_codes", "v_scales"):
                setattr(self, name, getattr(self, name)[indices, ...])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("Int8KVCache does not support beam search; use num_beams=1")

    def stored_bytes(self) -> int:
        if self.k_codes is None:
            return 0
        tensors = (self.k_codes, self.k_scales, self.v_codes, self.v_scales)
        return sum(t.numel() * t.element_size() for t in tensors)


class Int8KVCache(Cache):
    """``generate(ids, past_key_values=Int8KVCache())``: keys/values stored as int8 per token."""

    def __init__(self) -> None:
        super().__init__(layer_class_to_replicate=Int8KVLayer)

    def stored_bytes(self) -> int:
        """Bytes held by the cache now (codes + scales over every layer)."""
        return sum(layer.stored_bytes() for layer in self.layers if isinstance(layer, Int8KVLayer))
