"""GPTQ's column walk in Triton: one launch per group of columns instead of ~13 per column.

GPTQ quantizes a block of columns one at a time: round column i, spread its error onto the
block's later columns through row i of the inverse-Hessian factor (``w -= err x hinv[i]``), go
on. In torch (``compress.quant.gptq._walk_block``, the reference) every column is a dozen tiny
kernels; on a GPU that is launch-bound (the 1.1B shape has ~394k columns: ~13 launches each).
But every row of ``w`` walks independently: only ``hinv`` is shared. So one program owns
``BLOCK_R`` rows and the whole block width in registers and walks the columns in a loop: one
launch per call.

A call walks columns ``start <= i < stop`` of a block ``w [N, width]`` (fp32, updated in place:
later columns receive the error, as the reference leaves them), with the block's factor
``hinv [width, width]`` (upper triangular), per-column group indices ``groups [width]`` into
``scales`` / ``zeros [N, n_groups]`` and original column indices ``cols [width]`` into
``codes [N, K]``; it writes ``err [N, width]`` (the scaled errors the lazy update of the
columns after the block needs) and adds the OBS loss to ``losses [N]``. The arithmetic is the
reference's: IEEE division (``div_rn``), round half to even, no FMA contraction
(``enable_fp_fusion=False``); the reference's own ``addr_`` may contract on some backends, so
codes can differ in rare ties (tests/kernels/test_gptq_walk.py bounds it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .int4_gemm import is_interpreted

BLOCK_R = 16  # rows per program: many programs for one block, few registers each
MAX_WIDTH = 256  # the block held in registers: BLOCK_R x 256 fp32 is 16 KB per program
RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: (v + c) - c rounds |v| < 2**22 to even


def unsupported_reason(w: torch.Tensor, width: int) -> str | None:
    """Why the kernel cannot walk this block here, or None."""
    if width > MAX_WIDTH:
        return f"a block of {width} columns is wider than the kernel's {MAX_WIDTH}"
    if w.device.type == "cuda":
        return None if not is_interpreted() else "TRITON_INTERPRET=1 is set"
    if w.device.type == "cpu" and is_interpreted():
        return None
    return f"device {w.device} (the kernel runs on CUDA, or on CPU in the interpreter)"


@triton.jit
def _gptq_walk_kernel(
    w_ptr, hinv_ptr, scales_ptr, zeros_ptr, codes_ptr, err_ptr, losses_ptr, cols_ptr,
    groups_ptr,  # pointers (zeros_ptr read only with HAS_ZEROS)
    N, WIDTH, START, STOP,  # sizes and the columns to walk
    stride_wn, stride_hn, stride_hk, stride_sn, stride_zn, stride_cn, stride_en,  # strides
    QMIN: tl.constexpr, QMAX: tl.constexpr, HAS_ZEROS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_W)
    tile_ok = row_ok[:, None] & (cols < WIDTH)[None, :]
    w = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :], mask=tile_ok, other=0.0)
    loss = tl.load(losses_ptr + rows, mask=row_ok, other=0.0)
    for i in range(START, STOP):
        wi = tl.sum(tl.where(cols[None, :] == i, w, 0.0), axis=1)  # column i of the tile
        g = tl.load(groups_ptr + i)
        col = tl.load(cols_ptr + i)
        s = tl.load(scales_ptr + rows * stride_sn + g, mask=row_ok, other=1.0)
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + rows * stride_zn + g, mask=row_ok, other=0).to(tl.float32)
        else:
            z = tl.zeros((BLOCK_R,), dtype=tl.float32)
        # round(w / s) + z, clamped; |w / s| >= 2**22 clamps whatever the rounding
        q = (tl.div_rn(wi, s) + RNE_MAGIC) - RNE_MAGIC
        q = tl.minimum(tl.maximum(q + z, QMIN), QMAX)
        tl.store(codes_ptr + rows * stride_cn + col, q.to(tl.int8), mask=row_ok)
        d = tl.load(hinv_ptr + i * stride_hn + i * stride_hk)
        err = tl.div_rn(wi - (q - z) * s, d)
        loss += err * err
        h_ok = (cols >= i) & (cols < WIDTH)
        h = tl.load(hinv_ptr + i * stride_hn + cols * stride_hk, mask=h_ok, other=0.0)
        w = w - err[:, None] * h[None, :]
        tl.store(err_ptr + rows * stride_en + i, err, mask=row_ok)
    tl.store(w_ptr + rows[:, None] * stride_wn + cols[None, :], w, mask=tile_ok)
    tl.store(losses_ptr + rows, loss, mask=row_ok)


def gptq_walk_triton(
    w: torch.Tensor, hinv: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
    codes: torch.Tensor, err: torch.Tensor, losses: torch.Tensor, cols: torch.Tensor,
    groups: torch.Tensor, start: int, stop: int, *, qmin: int, qmax: int,
) -> None:
    """Walk columns ``start..stop-1`` of the block ``w [N, width]`` in place (module docstring).
    ``w``, ``err``, ``codes`` with unit column stride (views of wider tensors are fine; ``hinv``
    any strides);
    ``cols``/``groups`` int32 ``[width]`` on ``w``'s device."""
    n, width = w.shape
    reason = unsupported_reason(w, width)
    if reason is not None:
        raise ValueError(f"gptq_walk_triton: {reason}")
    for name, t in (("w", w), ("err", err), ("codes", codes)):
        if t.stride(1) != 1:
            raise ValueError(f"gptq_walk_triton: {name} needs unit column stride")
    if scales.stride(1) != 1 or (zeros is not None and zeros.stride(1) != 1):
        raise ValueError("gptq_walk_triton: scales and zeros need unit column stride")
    if not 0 <= start <= stop <= width:
        raise ValueError(f"gptq_walk_triton: columns {start}..{stop} outside 0..{width}")
    grid = (triton.cdiv(n, BLOCK_R),)
    zeros_arg = zeros if zeros is not None else scales
    _gptq_walk_kernel[grid](
        w, hinv, scales, zeros_arg, codes, err, losses, cols, groups,
        n, width, start, stop,
        w.stride(0), hinv.stride(0), hinv.stride(1), scales.stride(0), zeros_arg.stride(0),
        codes.stride(0),
        err.stride(0),
        QMIN=qmin, QMAX=qmax, HAS_ZEROS=zeros is not None,
        BLOCK_R=BLOCK_R, BLOCK_W=triton.next_power_of_2(width),
        **({} if is_interpreted() else {"enable_fp_fusion": False}),
    )  # fmt: skip
