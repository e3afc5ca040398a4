"""A decoder layer's elementwise work in one C++ call each (``csrc/elementwise.cpp``, built with
the integer-dot kernels of ``cpu_q8``), for the runtime's eager steps on a CPU, and the torch
expressions they compute (``*_reference``: what the runtime runs elsewhere, and what the tests
hold the ops to).

- ``rms_norm``: ``w * x * rsqrt(mean(x^2) + eps)`` per row, written in the dtype the next
  matmul reads (fp32 or bf16);
- ``rope_qkv``: a q/k/v projection's output -> q, k, v per head, q and k optionally RMS-normed
  per head (Qwen3, Gemma 3), then rotated by rotate-half RoPE;
- ``silu_mul``: ``SiLU(gate) * up`` of a gate/up projection's output;
- ``add_rms_norm``: the residual add and the next norm in one pass;
- ``greedy_tokens``: each row's argmax with the finite check sampling needs;
- ``write_kv``: a step's keys and values into their slots of fp32 or bf16 KV pages;
- ``write_kv_int8``: the same into int8 pages (``quantize_int8``'s codes and scales).

Sums run in eight fp32 lanes and SiLU's exponential is a polynomial, so results are within
fp32 rounding of the references, not bit-equal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compress.kernels import cpu_q8


def unavailable_reason(device: torch.device) -> str | None:
    """Why the ops cannot run on ``device``, or None."""
    if device.type != "cpu":
        return f"the tensors are on {device.type}, the ops are CPU-only"
    return cpu_q8.unavailable_reason()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """x [..., C] fp32, w [C] fp32 -> the normed rows in ``dtype`` (fp32 or bf16)."""
    out = cpu_q8.ops().rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), w, eps, dtype)
    return out.view(x.shape)


def rms_norm_reference(x, w, eps, dtype):
    return (w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))).to(dtype)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C] fp32 (the residual stream), y [..., C] fp32 or bf16 -> (x + y in fp32, its
    rms_norm in ``dtype``)."""
    c = x.shape[-1]
    total, normed = cpu_q8.ops().add_rms_norm(x.reshape(-1, c).contiguous(),
                                              y.reshape(-1, c).contiguous(), w, eps, dtype)
    return total.view(x.shape), normed.view(x.shape)


def add_rms_norm_reference(x, y, w, eps, dtype):
    total = x + y.to(x.dtype)
    return total, rms_norm_reference(total, w, eps, dtype)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] fp32 -> int64 [R], each row's first maximal index; -1 for a row holding
    NaN or +-Inf."""
    return cpu_q8.ops().greedy_tokens(logits.contiguous())


def greedy_tokens_reference(logits):
    top, tokens = logits.max(-1)
    finite = torch.isfinite(logits).all(-1)
    return torch.where(finite, tokens, torch.full_like(tokens, -1))


def rope_qkv(qkv, cos, sin, heads, kv_heads, q_norm=None, k_norm=None, eps=1e-6):
    """qkv [R, (heads + 2 kv_heads) D] fp32 or bf16; cos, sin [R, D] -> q [R, heads, D], k and v
    [R, kv_heads, D] fp32 (q and k normed per head with ``q_norm`` / ``k_norm`` [D] when
    given, then rotated)."""
    q, k, v = cpu_q8.ops().rope_qkv(qkv.contiguous(), cos.contiguous(), sin.contiguous(), heads,
                                     kv_heads, q_norm, k_norm, eps)  # fmt: skip
    return q, k, v


def rope_qkv_reference(qkv, cos, sin, heads, kv_heads, q_norm=None, k_norm=None, eps=1e-6):
    r = qkv.shape[0]
    d = qkv.shape[1] // (heads + 2 * kv_heads)
    q, k, v = qkv.view(r, -1, d).split([heads, kv_heads, kv_heads], 1)
    if q_norm is not None:
        q, k = rms_norm_reference(q, q_norm, eps, q.dtype), rms_norm_reference(k, k_norm, eps,
                                                                               k.dtype)
    half = d // 2
    cos, sin = cos[:, None], sin[:, None]

    def rotate(x):
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    return rotate(q.to(cos.dtype)), rotate(k.to(cos.dtype)), v.to(cos.dtype).contiguous()


def silu_mul(gate_up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """gate_up [..., 2I] fp32 or bf16 (gate first) -> SiLU(gate) * up [..., I] in ``dtype``."""
    flat = gate_up.reshape(-1, gate_up.shape[-1]).contiguous()
    return cpu_q8.ops().silu_mul(flat, dtype).view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def silu_mul_reference(gate_up, dtype):
    gate, up = gate_up.chunk(2, -1)
    return (F.silu(gate) * up).to(dtype)


def write_kv(k_pool, v_pool, slots, k, v) -> None:
    """k, v [N, kv_heads, D] fp32 -> rows ``slots`` [N] of the pools [slots, kv_heads, D]
    (fp32 or bf16), in place."""
    cpu_q8.ops().write_kv(k_pool, v_pool, slots, k.contiguous(), v.contiguous())


def write_kv_reference(k_pool, v_pool, slots, k, v) -> None:
    k_pool.index_copy_(0, slots, k.to(k_pool.dtype))
    v_pool.index_copy_(0, slots, v.to(v_pool.dtype))


def write_kv_int8(k_pool, v_pool, k_scale, v_scale, slots, k, v) -> None:
    """k, v [N, kv_heads, D] fp32 -> rows ``slots`` [N] of int8 pools [slots, kv_heads, D] as
    ``quantize_int8`` codes, their scales into ``k_scale`` / ``v_scale`` [slots, kv_heads], in
    place: the same bytes as ``write_kv_int8_reference``."""
    cpu_q8.ops().write_kv_int8(k_pool, v_pool, k_scale, v_scale, slots, k.contiguous(),
                               v.contiguous())  # fmt: skip


def write_kv_int8_reference(k_pool, v_pool, k_scale, v_scale, slots, k, v) -> None:
    for pool, scales, x in ((k_pool, k_scale, k), (v_pool, v_scale, v)):
        codes, scale = quantize_int8(x)
        pool.index_copy_(0, slots, codes)
        scales.index_copy_(0, slots, scale)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> int8 codes [..., D] and fp32 scales [...] (symmetric, absmax / 127): the
    paged KV cache's int8 pages (``compress.runtime.paged``), any device."""
    x = x.float()
    scale = x.abs().amax(-1).clamp(min=1e-8) / 127.0
    codes = torch.round(x / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return codes, scale
