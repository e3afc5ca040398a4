"""PyTorch's native CPU int4/int8 weight-only kernels, behind our packed layout.

torch ships ``_weight_int4pack_mm_for_cpu`` (w = (q - 8) * scale + zero with q in 0..15) and
``_weight_int8pack_mm`` (symmetric per-channel int8). Both want bf16 activations: fp32
activations fall onto paths 3-70x slower on AVX2 CPUs (see ../shared/notes/CPU_FACTS.md), so
the wrappers cast activations to bf16 and the result back.

Our layout stores signed codes and signed zero points, ``w = (w_q - zeros) * scales``.
With q = w_q + 8 that is ``(q - 8) * scales - zeros * scales``, so torch's ``zero`` is
``-zeros * scales``. The repack happens once per layer (``prepack_int4``), at load or on the
first forward, never per call; it moves our packed bytes' nibbles into torch's layout (found
once per process, ``int4_layout_block``) rather than widening every code to int32, in
cache-sized steps on the calling thread (``STEP_BYTES``).

Alignment: ``_weight_int8pack_mm`` dies with SIGSEGV on AVX-512 CPUs when its weight (inputs of
4+ rows) or its activations start at an address that is not a multiple of 16 bytes (measured
on torch 2.13: offsets 8/24/40 mod 64 crash, 0/16/32 do not). safetensors aligns tensors only
to 8 bytes, so every operand handed to a native kernel goes through ``aligned`` first: weights
once at prepare time, activations per call (a pointer check; a copy only when misaligned).
"""

from __future__ import annotations

import functools
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
    if k % 16:  # measured on torch 2.13, AVX-512: K = 8, 40, 120, 136 garbage at 1 row,
        # every K not a multiple of 16 from 8 to 264 SIGSEGV at 4 rows
        return f"K={k} not divisible by 16 (torch's int8 kernel then reads past its rows)"
    return None


# Packed bytes per step of the repack: a step's input and output stay in L2, and each of its ops
# (at most 16K int64 elements) is under torch's parallel grain (32768 elements), so it runs on
# the calling thread. Why: on a shared 2-core machine every 2-thread region waited for its
# descheduled second thread, about 5 ms an op (measured, 1.1B W4 shape under load: 9.2 ns a
# weight with whole-layer ops on 2 threads, 1.1 on 1 thread).
STEP_BYTES = 1 << 17


def prepack_int4(
    w_packed: torch.Tensor,
    scales: torch.Tensor,
    zeros_packed: torch.Tensor | None,
    *,
    group_size: int,
    k: int,
) -> Int4CpuWeight:
    """Convert our packed int4 weight to the native kernel's layout (one-time cost).

    Where the layout's row block is known (``int4_layout_block``) and divides N, the nibbles of
    our packed bytes are moved there directly (``_blocked_int4_layout``: word operations and one
    transposing copy per cache-sized step); elsewhere torch's own repack runs on the unpacked
    int32 codes (``prepack_int4_reference``: about 20 bytes of temporaries a weight and a
    strided int32 read per code; measured 9.5 ns a weight against 1.1 here, a 7B-shaped model
    prepared in 69 s against 8.6 on a 2-core EPYC). Both give the same bytes."""
    n = w_packed.shape[0]
    reason = int4_unsupported_reason(n, k, group_size)
    if reason is not None:
        raise ValueError(f"native CPU int4 kernel cannot take this layer: {reason}")
    block = int4_layout_block()
    data = reference.int4_bytes(w_packed, k)
    if block is None or n % block or data is None:
        return prepack_int4_reference(w_packed, scales, zeros_packed, group_size=group_size, k=k)
    if data.data_ptr() % 8:  # the steps read the bytes as int64 words
        data = data.clone()
    zeros = None if zeros_packed is None else reference.int4_float_parts(scales, zeros_packed, n)[1]
    packed, scale_and_zero = _blocked_int4_layout(data, block, scales, zeros)
    return Int4CpuWeight(aligned(packed), aligned(scale_and_zero), group_size, n)


def prepack_int4_reference(
    w_packed: torch.Tensor,
    scales: torch.Tensor,
    zeros_packed: torch.Tensor | None,
    *,
    group_size: int,
    k: int,
) -> Int4CpuWeight:
    """``prepack_int4`` through torch's repack (``_convert_weight_to_int4pack_for_cpu``) of the
    int32 codes: the definition of the layout, and the path for shapes the fast one skips."""
    codes, scales32, zeros = reference.int4_unsigned_parts(w_packed, scales, zeros_packed, k)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 2)
    zero = -zeros * scales32  # the kernel computes w = (codes - 8) * scale + zero
    # [N, K/g] x2 -> [K/g, N, 2]
    scale_and_zero = torch.stack([scales32.t(), zero.t()], dim=-1).contiguous()
    n = scales32.shape[0]
    return Int4CpuWeight(aligned(packed), aligned(scale_and_zero.to(torch.bfloat16)), group_size, n)


@functools.cache
def int4_layout_block() -> int | None:
    """Rows per block of torch's int4 CPU layout in this process, or None when it is not one
    that ``_blocked_int4_layout`` writes. The layout depends on the ISA ATen dispatches to (64
    rows at AVX-512, 32 at AVX2, another at the default level) and is private to torch, so it is
    found once by comparing with torch's own repack of a small random weight, never assumed."""
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=generator)
    want = torch._convert_weight_to_int4pack_for_cpu(codes, 2)
    data = reference.int4_bytes(reference.pack_int4((codes - 8).to(torch.int8)), 64)
    if data is None:
        return None
    scales = torch.ones(128, 1, dtype=torch.float16)
    for block in (64, 32):
        if torch.equal(_blocked_int4_layout(data, block, scales, None)[0], want):
            return block
    return None


_LOW = 0x0F0F0F0F0F0F0F0F  # the low nibble of every byte of an int64 word
_HIGH = -0x0F0F0F0F0F0F0F10  # 0xF0F0F0F0F0F0F0F0 as a signed int64: every high nibble


def _blocked_int4_layout(
    data: torch.Tensor, block: int, scales: torch.Tensor, zeros: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our packed bytes ``uint8 [N, K/2]`` (``reference.int4_bytes``), scales ``[N, K/g]`` and
    fp32 zero points (None: symmetric) -> torch's int4 CPU layout, ``uint8 [N, K/2]`` holding,
    per block of ``block`` rows, for each column k in order, ``block/2`` bytes: byte r = code
    (row r, k) | code (row r + block/2, k) << 4; and ``scale_and_zero`` bf16 ``[K/g, N, 2]``.

    Per block of rows, in steps of ``STEP_BYTES``: the nibbles of rows r and r + block/2 are
    paired in place order (even columns from the low nibbles, odd from the high: the pairing of
    ``reference.merge_nibbles``, on int64 words, 8 bytes an element), then the step's [block,
    cols] byte matrix, rows (parity, r), is transposed to [cols, block], rows (column pair,
    parity, r): the layout. A 2-D transposing copy, which torch does in tiles (a batched 3-D one
    element by element: measured 2.4x slower on an [11008, 2048] weight)."""
    n, half_k = data.shape
    half = block // 2
    cols = min(half_k, STEP_BYTES // block)  # bytes of each row per step, a multiple of 8
    rows = data.view(n // block, 2, half, half_k)  # [blocks, first/second half rows, r, K/2]
    packed = torch.empty(n // block, half_k, block, dtype=torch.uint8)
    scale_and_zero = torch.empty(scales.shape[1], n, 2, dtype=torch.bfloat16)
    buffer = torch.empty(3 * half * cols, dtype=torch.uint8)  # the step's pairs and a temporary
    for i in range(n // block):
        for j0 in range(0, half_k, cols):
            w = min(cols, half_k - j0)
            pairs = buffer[: 2 * half * w].view(2, half, w)
            temp = buffer[2 * half * w : 3 * half * w].view(torch.int64)
            a, b = (rows[i, h, :, j0 : j0 + w].view(torch.int64) for h in (0, 1))
            low, high = pairs[0].view(torch.int64), pairs[1].view(torch.int64)
            torch.bitwise_and(a, _LOW, out=low)  # even columns: a.low | b.low << 4
            low |= torch.bitwise_left_shift(b, 4, out=temp.view_as(b)).bitwise_and_(_HIGH)
            torch.bitwise_right_shift(a, 4, out=high).bitwise_and_(_LOW)  # odd: a.high | b.high
            high |= torch.bitwise_and(b, _HIGH, out=temp.view_as(b))
            packed[i, j0 : j0 + w].copy_(pairs.view(block, w).t())
        r0, r1 = i * block, (i + 1) * block
        s = scales[r0:r1].float()  # [block, K/g]
        zero = s * -0.0 if zeros is None else -zeros[r0:r1] * s  # w = (code - 8) * scale + zero
        scale_and_zero[:, r0:r1, 0].copy_(s.t())
        scale_and_zero[:, r0:r1, 1].copy_(zero.t())
    return packed.view(n, half_k), scale_and_zero


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
