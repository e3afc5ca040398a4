"""Plain-PyTorch definitions of every quantized op and packing format in compress.

These functions *define* the math; every fast path (native CPU kernels, Triton) is tested
against them. They are written to be read, not to be fast.

Weight layout (the compressed-tensors layout, so exported checkpoints need no conversion):

* ``w`` float weight ``[N, K]`` (out_features, in_features), as in ``nn.Linear``.
* ``w_q`` signed integer codes in int8: int4 codes lie in [-8, 7], int8 codes in [-128, 127].
* ``scales`` ``[N, K // group_size]`` float; per-output-channel is ``group_size == K``
  -> ``[N, 1]``.
* ``zeros`` signed zero points, same shape as ``scales`` (int8 holder) or ``None`` for symmetric.
* Dequantization: ``w = (w_q - zeros) * scales`` broadcast over each group of ``group_size``
  consecutive input channels.

int4 packing (compressed-tensors ``pack-quantized``, ``num_bits=4``)::

    int32 word j of a row holds codes 8j .. 8j+7, lowest nibble first, each code offset by +8
    so that it is unsigned:

    bits  31..28  27..24  ...  7..4   3..0
    code  8j+7    8j+6    ...  8j+1   8j      (each = w_q + 8, in 0..15)

    w_packed: int32 [N, ceil(K / 8)]   (padding nibbles are 0, as compressed-tensors writes them)

Asymmetric int4 zero points are packed the same way but along dim 0 (``[ceil(N / 8), K / g]``),
as compressed-tensors does.

int8 packing (compressed-tensors ``pack-quantized``, ``num_bits=8``: weight-only int8 as
llm-compressor writes it, which transformers reads for MoE experts and vLLM for W8A16)::

    int32 word j of a row holds codes 4j .. 4j+3, lowest byte first, each offset by +128

    w_packed: int32 [N, ceil(K / 4)]   (padding bytes are 0)

In memory the layers hold int8 codes as ``weight`` ``[N, K]`` (``int-quantized``'s layout);
``pack_int8`` / ``unpack_int8`` convert at export and load.
"""

from __future__ import annotations

import sys

import torch

_NIBBLE_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # shift of code i within its word
# elements per block where an op over a whole weight would make temporaries several times the
# weight (packing, RTN codes): 4M elements, 16 MB in fp32; row-independent ops, same result
ROW_BLOCK_ELEMENTS = 1 << 22


def pack_int4(w_q: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Pack int4 codes (int8 tensor, values in [-8, 7]) into int32 words along ``dim`` (0 or 1).

    Returns int32 ``[N, ceil(K/8)]`` for dim=1, ``[ceil(N/8), K]`` for dim=0.
    """
    if w_q.dtype != torch.int8 or w_q.dim() != 2:
        raise TypeError(f"pack_int4 expects a 2-D int8 tensor, got {w_q.dtype} {tuple(w_q.shape)}")
    if dim == 0:
        return pack_int4(w_q.t(), dim=1).t().contiguous()
    if w_q.numel() and (int(w_q.min()) < -8 or int(w_q.max()) > 7):
        raise ValueError("pack_int4: codes must lie in [-8, 7]")
    n, k = w_q.shape
    k_padded = (k + 7) // 8 * 8
    out = torch.empty(n, k_padded // 8, dtype=torch.int32, device=w_q.device)
    # Rows in blocks: the temporaries take 16 bytes per code (int32 and int64 copies), 1.1 GB
    # for one 13824 x 5120 linear at once; a block bounds them (rows are packed independently).
    rows = max(1, ROW_BLOCK_ELEMENTS // max(k_padded, 1))
    for r0 in range(0, n, rows):
        codes = w_q[r0 : r0 + rows].to(torch.int32) + 8  # [rows, K] in 0..15
        if k_padded != k:
            codes = torch.nn.functional.pad(codes, (0, k_padded - k), value=0)
        codes = codes.view(codes.shape[0], k_padded // 8, 8)  # [rows, K/8, 8]
        shifted = codes << _NIBBLE_SHIFTS.to(codes.device)
        # The 8 nibbles occupy disjoint bits, so a sum is an OR; int64 avoids sign overflow
        # of the top nibble, then we reinterpret the low 32 bits as int32.
        words = shifted.to(torch.int64).sum(dim=-1)
        out[r0 : r0 + rows] = torch.where(words >= 2**31, words - 2**32, words)
    return out


def _words_along_rows(w_packed: torch.Tensor, size: int, dim: int, per_word: int,
                      name: str) -> torch.Tensor:
    """``w_packed`` (int32 words of ``per_word`` codes each, packed along ``dim``) checked, with
    the packed dimension last (transposed for dim 0)."""
    if w_packed.dtype != torch.int32 or w_packed.dim() != 2:
        raise TypeError(
            f"{name} expects a 2-D int32 tensor, got {w_packed.dtype} {tuple(w_packed.shape)}"
        )
    words = w_packed.t() if dim == 0 else w_packed
    if words.shape[1] * per_word < size:
        raise ValueError(f"{name}: {words.shape[1]} words cannot hold {size} codes")
    return words


def unpack_int4(w_packed: torch.Tensor, size: int, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int32 words -> int8 codes in [-8, 7].

    ``size`` is the unpacked length along ``dim`` (K for weights, N for zero points).
    """
    words = _words_along_rows(w_packed, size, dim, 8, "unpack_int4")
    nibbles = (words.unsqueeze(-1) >> _NIBBLE_SHIFTS.to(words.device)) & 0xF  # [N, K/8, 8]
    codes = (nibbles.reshape(words.shape[0], -1)[:, :size] - 8).to(torch.int8)
    return (codes.t() if dim == 0 else codes).contiguous()


def pack_int8(w_q: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Pack int8 codes into int32 words along ``dim`` (0 or 1), four a word, lowest byte first,
    each offset by +128: int32 ``[N, ceil(K/4)]`` for dim=1, ``[ceil(N/4), K]`` for dim=0."""
    if w_q.dtype != torch.int8 or w_q.dim() != 2:
        raise TypeError(f"pack_int8 expects a 2-D int8 tensor, got {w_q.dtype} {tuple(w_q.shape)}")
    if dim == 0:
        return pack_int8(w_q.t(), dim=1).t().contiguous()
    n, k = w_q.shape
    out = torch.zeros(n, (k + 3) // 4, dtype=torch.int32, device=w_q.device)
    words = out.view(torch.uint8).view(n, -1)  # the words' bytes, lowest first
    step = max(1, ROW_BLOCK_ELEMENTS // max(k, 1))  # int16 temporaries in row blocks
    for r0 in range(0, n, step):
        words[r0 : r0 + step, :k] = (w_q[r0 : r0 + step].to(torch.int16) + 128).to(torch.uint8)
    if sys.byteorder == "big":  # the word's lowest byte is its last in memory there
        out = out.view(torch.uint8).view(n, -1, 4).flip(-1).reshape(n, -1).view(torch.int32)
    return out


def unpack_int8(w_packed: torch.Tensor, size: int, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`pack_int8`: int32 words -> int8 codes; ``size`` is the unpacked length
    along ``dim``."""
    words = _words_along_rows(w_packed, size, dim, 4, "unpack_int8").contiguous()
    data = words.view(torch.uint8).view(words.shape[0], -1, 4)
    if sys.byteorder == "big":
        data = data.flip(-1)
    codes = (data.reshape(words.shape[0], -1)[:, :size].to(torch.int16) - 128).to(torch.int8)
    return (codes.t() if dim == 0 else codes).contiguous()


def dequantize(
    w_q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(w_q - zeros) * scales`` per group of ``group_size`` input channels -> ``[N, K]``."""
    n, k = w_q.shape
    if k % group_size or scales.shape != (n, k // group_size):
        raise ValueError(
            f"dequantize: w_q {tuple(w_q.shape)}, scales {tuple(scales.shape)} and "
            f"group_size {group_size} do not fit (need scales [N, K // group_size])"
        )
    codes = w_q.to(torch.float32).view(n, k // group_size, group_size)
    if zeros is not None:
        codes = codes - zeros.to(torch.float32).unsqueeze(-1)
    w = codes * scales.to(torch.float32).unsqueeze(-1)
    return w.view(n, k).to(dtype)


def int4_weight(
    w_packed: torch.Tensor,
    scales: torch.Tensor,
    zeros_packed: torch.Tensor | None,
    group_size: int,
    k: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantized ``[N, K]`` weight from the packed int4 layout (zero points packed on dim 0)."""
    n = w_packed.shape[0]
    zeros = None if zeros_packed is None else unpack_int4(zeros_packed, n, dim=0)
    return dequantize(unpack_int4(w_packed, k), scales, zeros, group_size, dtype)


def int4_unsigned_parts(
    w_packed: torch.Tensor, scales: torch.Tensor, zeros_packed: torch.Tensor | None, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed int4 weight -> (codes ``w_q + 8`` int32 ``[N, K]`` in 0..15, fp32 scales, fp32
    zero points, 0 when symmetric): the form the CPU kernels repack from, so that
    ``w = (codes - 8 - zeros) * scales``."""
    codes = unpack_int4(w_packed, k).to(torch.int32) + 8
    return (codes, *int4_float_parts(scales, zeros_packed, w_packed.shape[0]))


def int4_float_parts(
    scales: torch.Tensor, zeros_packed: torch.Tensor | None, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 scales and fp32 zero points (0 when symmetric) of ``int4_unsigned_parts``."""
    scales32 = scales.to(torch.float32)
    if zeros_packed is None:
        return scales32, torch.zeros_like(scales32)
    return scales32, unpack_int4(zeros_packed, n, dim=0).to(torch.float32)


def int4_bytes(w_packed: torch.Tensor, k: int) -> torch.Tensor | None:
    """The packed codes as bytes, ``uint8 [N, K/2]``, a view of ``w_packed``: byte j of a row
    holds code 2j in its low nibble and code 2j+1 in its high nibble (each ``w_q + 8``), which
    is the word layout above read in memory order on a little-endian machine. None where that
    view does not exist (K not a multiple of 8, padded words, a big-endian machine); callers
    then unpack with ``unpack_int4``. The CPU repacks (``cpu_native``, ``cpu_q8``) move these
    bytes' nibbles instead of widening every code to int32."""
    if k % 8 or w_packed.shape[1] * 8 != k or sys.byteorder != "little":
        return None
    return w_packed.contiguous().view(torch.uint8)


def merge_nibbles(
    a: torch.Tensor, b: torch.Tensor, low_out: torch.Tensor, high_out: torch.Tensor
) -> None:
    """Pair the nibbles of two uint8 tensors of equal shape: ``low_out = a.low | b.low << 4``
    and ``high_out = a.high | b.high << 4`` (written into the given, possibly strided, views).
    Both CPU repacks are this step on differently chosen ``a``/``b`` bytes."""
    torch.bitwise_and(a, 0x0F, out=low_out)
    low_out |= b << 4  # uint8: the shift drops b's high nibble
    torch.bitwise_right_shift(a, 4, out=high_out)
    high_out |= b & 0xF0


def int4_gemm(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    scales: torch.Tensor,
    zeros_packed: torch.Tensor | None,
    *,
    group_size: int,
    k: int,
) -> torch.Tensor:
    """W4A16 GEMM: ``x [M, K] @ W.T -> [M, N]``, fp32 accumulation, output in x's dtype."""
    w = int4_weight(w_packed, scales, zeros_packed, group_size, k)
    return (x.to(torch.float32) @ w.t()).to(x.dtype)


def int8_weight_gemm(
    x: torch.Tensor, w_q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None
) -> torch.Tensor:
    """W8A16 GEMM with per-channel (``scales [N, 1]``) or grouped int8 weights -> ``[M, N]``."""
    group_size = w_q.shape[1] // scales.shape[1]
    w = dequantize(w_q, scales, zeros, group_size)
    return (x.to(torch.float32) @ w.t()).to(x.dtype)


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric per-row int8 quantization: ``x [M, K] -> (x_q int8 [M, K], s [M, 1])``.

    ``s = max|x_row| / 127``; an all-zero row gets scale 1 so that it stays exactly zero.
    """
    x32 = x.to(torch.float32)
    amax = x32.abs().amax(dim=-1, keepdim=True)
    x_scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    x_q = torch.clamp(torch.round(x32 / x_scales), -127, 127).to(torch.int8)
    return x_q, x_scales


def int8_int8_gemm(
    x_q: torch.Tensor, x_scales: torch.Tensor, w_q: torch.Tensor, w_scales: torch.Tensor
) -> torch.Tensor:
    """W8A8 GEMM: ``(x_q @ w_q.T) * x_scales * w_scales.T`` in fp32 -> ``[M, N]`` float32.

    ``x_q`` int8 ``[M, K]``, ``x_scales [M, 1]``, ``w_q`` int8 ``[N, K]``, ``w_scales [N, 1]``.
    The integer product is exact in int64 here (int32 on real kernels; K < 2**17 keeps it exact).
    """
    acc = x_q.to(torch.int64) @ w_q.to(torch.int64).t()  # [M, N]
    return acc.to(torch.float32) * x_scales.to(torch.float32) * w_scales.to(torch.float32).t()
