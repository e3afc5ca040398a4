"""PyTorch's native CPU int4/int8 weight-only kernels, behind our packed layout.

torch ships ``_weight_int4pack_mm_for_cpu`` (w = (q - 8) * scale + zero with q in 0..15) and
``_weight_int8pack_mm`` (symmetric per-channel int8). Both want bf16 activations: fp32
activations fall onto paths 3-70x slower on AVX2 CPUs (see ../shared/notes/CPU_FACTS.md), so
the wrappers cast activations to bf16 and the result back.

Our layout stores signed codes and signed zero points, ``w = (w_q - zeros) * scales``.
With q = w_q + 8 that is ``(q - 8) * scales - zeros * scales``, so torch's ``zero`` is
``-zeros * scales``. The repack happens once per layer (``prepack_int4``), at load or on the
first forward, never per call.

Alignment: ``_weight_int8pack_mm`` dies with SIGSEGV on AVX-512 CPUs when its weight (inputs of
4+ rows) or its activations start at an address that is not a multiple of 16 bytes (measured
on torch 2.13: offsets 8/24/40 mod 64 crash, 0/16/32 do not). safetensors aligns tensors only
to 8 bytes, so every operand handed to a native kernel goes through ``aligned`` first: weights
once at prepare time, activations per call (a pointer check; a copy only when misaligned).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cpuinfo, reference

INT4_GROUP_SIZES = (32, 64, 128, 256)
ALIGNMENT = 64  # bytes: a cache line, and more than any native kernel here asks for


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it is contiguous and starts on an ``ALIGNMENT``-byte boundary, else a
    contiguous copy that does (the same values, dtype and shape)."""
    if t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0:
        return t
    nbytes = t.numel() * t.element_size()
    buffer = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, device=t.device)
    start = -buffer.data_ptr() % ALIGNMENT
    out = buffer[start : start + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


@dataclass(frozen=True)
class Int4CpuWeight:
    """A layer's int4 weight repacked for ``torch._weight_int4pack_mm_for_cpu``."""

    packed: torch.Tensor  # uint8 [N, K/2], torch's private tiling
    scale_and_zero: torch.Tensor  # bf16 [K/g, N, 2]
    group_size: int
    n: int


def int4_unsupported_reason(n: int, k: int, group_size: int) -> str | None:
    """Why the native int4 CPU kernel cannot take this shape, or None if it can."""
    if group_size not in INT4_GROUP_SIZES:
        return f"group_size {group_size} not in {INT4_GROUP_SIZES}"
    if k % group_size:
        return f"K={k} not divisible by group_size {group_size}"
    if n % 16:
        return f"N={n} not divisible by 16"
    return None


def int8_unsupported_reason(n: int, k: int, group_size: int, symmetric: bool) -> str | None:
    """Why ``torch._weight_int8pack_mm`` cannot take this layer, or None if it can."""
    if not symmetric:
        return "native int8 CPU kernel is symmetric-only"
    if group_size != k:
        return "native int8 CPU kernel takes per-channel scales only"
    return None


def prepack_int4(
    w_packed: torch.Tensor,
    scales: torch.Tensor,
    zeros_packed: torch.Tensor | None,
    *,
    group_size: int,
    k: int,
) -> Int4CpuWeight:
    """Convert our packed int4 weight to the native kernel's layout (one-time cost)."""
    n = w_packed.shape[0]
    reason = int4_unsupported_reason(n, k, group_size)
    if reason is not None:
        raise ValueError(f"native CPU int4 kernel cannot take this layer: {reason}")
    codes, scales32, zeros = reference.int4_unsigned_parts(w_packed, scales, zeros_packed, k)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 2)
    zero = -zeros * scales32  # the kernel computes w = (codes - 8) * scale + zero
    # [N, K/g] x2 -> [K/g, N, 2]
    scale_and_zero = torch.stack([scales32.t(), zero.t()], dim=-1).contiguous()
    return Int4CpuWeight(
        aligned(packed), aligned(scale_and_zero.to(torch.bfloat16)), group_size, n
    )


def int4_mm(x: torch.Tensor, weight: Int4CpuWeight) -> torch.Tensor:
    """``x [..., K] @ W.T`` with the native kernel; bf16 inside, x's dtype outside."""
    x2 = aligned(x.reshape(-1, x.shape[-1]).to(torch.bfloat16))
    y = torch._weight_int4pack_mm_for_cpu(
        x2, weight.packed, weight.group_size, weight.scale_and_zero
    )
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.n)


def int8_mm(x: torch.Tensor, w_q: torch.Tensor, scales_bf16: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ (w_q * scales).T`` for symmetric per-channel int8 (``scales_bf16 [N]``).
    ``w_q`` and ``scales_bf16`` must already be ``aligned`` (prepare time); x is aligned here."""
    if w_q.data_ptr() % ALIGNMENT or scales_bf16.data_ptr() % ALIGNMENT:
        raise ValueError("int8_mm: pass the weight and scales through cpu_native.aligned first")
    x2 = aligned(x.reshape(-1, x.shape[-1]).to(torch.bfloat16))
    y = torch._weight_int8pack_mm(x2, w_q, scales_bf16)
    return y.to(x.dtype).reshape(*x.shape[:-1], w_q.shape[0])


def int_mm_available() -> bool:
    """``torch._int_mm`` exists (CPU support since torch 2.2)."""
    return hasattr(torch, "_int_mm")


# oneDNN's ISA cap names (ONEDNN_MAX_CPU_ISA) whose int8 kernels have VNNI dot products, and the
# CPU flag each needs. Below them (SSE41, AVX, AVX2, AVX512_CORE) oneDNN multiplies int8 pairs
# with vpmaddubsw, whose int16 pair sums saturate.
_ONEDNN_VNNI_CAPS = {
    "AVX2_VNNI": "avx_vnni", "AVX2_VNNI_2": "avx_vnni",
    "AVX512_CORE_VNNI": "avx512_vnni", "AVX512_CORE_BF16": "avx512_vnni",
    "AVX512_CORE_FP16": "avx512_vnni", "AVX10_1_512": "avx512_vnni",
    "AVX512_CORE_AMX": "avx512_vnni", "AVX10_1_512_AMX": "avx512_vnni",
    "AVX512_CORE_AMX_FP16": "avx512_vnni", "AVX10_1_512_AMX_FP16": "avx512_vnni",
}  # fmt: skip


def int_mm_inexact_reason(flags: frozenset[str], onednn_cap: str | None) -> str | None:
    """Why ``torch._int_mm`` on this CPU would not return the exact int32 products, or None.
    It runs on oneDNN, whose int8 kernels are exact only with VNNI/AMX dot products: without
    them int16 pair sums saturate (measured: a [1, 96] x [96, 40] product off by up to 18,000
    with ``ONEDNN_MAX_CPU_ISA=AVX2`` on an AVX512-VNNI Xeon). ``onednn_cap``: that variable."""
    if not cpuinfo.has_vnni(flags):
        return "the CPU reports no int8 dot products (VNNI/AMX)"
    cap = (onednn_cap or "").strip().upper()
    if cap in ("", "ALL", "DEFAULT"):
        return None
    if _ONEDNN_VNNI_CAPS.get(cap) in flags:
        return None
    return f"ONEDNN_MAX_CPU_ISA={cap} keeps oneDNN off this CPU's int8 dot products"
