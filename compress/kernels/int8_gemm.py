"""int8 GEMMs in Triton: W8A8 (int8 x int8 -> int32) and W8A16 (int8 weight, float x).

Math:

* W8A8: ``y[m, n] = (sum_k x_q[m, k] * w_q[n, k]) * x_scales[m] * w_scales[n]``; the integer
  sum is exact in int32 for K < 2**17. ``x_q, x_scales`` come from the fused per-token
  quantization kernel below: ``s = max|x[m, :]| / 127`` (1 for an all-zero row),
  ``x_q = clamp(round_half_even(x / s), -127, 127)``, one pass over x per row.
* W8A16: ``W[n, k] = (w_q[n, k] - zeros[n, k // g]) * scales[n, k // g]``, fp32 accumulation.
  Per channel (``g == K``) the scale is applied once in the epilogue on the fp32 sum (the codes
  minus zero, |.| <= 255, are exact in fp16/bf16); grouped scales are applied per K tile.

Layout: ``x`` / ``x_q`` ``[M, K]``; ``w_q`` int8 ``[N, K]`` (``nn.Linear`` order); ``scales``
``[N, K / g]`` fp16/bf16/fp32; ``zeros`` int8 ``[N, K / g]`` or absent; ``x_scales`` fp32
``[M, 1]``; ``y`` ``[M, N]``. All contiguous and 16-byte aligned.

Constraints: grouped W8A16 needs ``K % g == 0`` and ``g % BLOCK_K == 0``; per channel and W8A8
take any K (the K loop is masked). int8 ``tl.dot`` needs BLOCK_K >= 32. M <= 16 takes the
split-K decode path of ``int4_gemm`` (fp32 atomics). This file holds two kernels, the GEMM and
the per-token quantizer it consumes; W8A8 with asymmetric or grouped weights is not supported.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
import triton.testing

from .errors import KernelConstraintError
from .int4_gemm import (
    FLOAT_DTYPES,
    _config,
    check_device,
    check_operand,
    is_decode,
    is_interpreted,
    launch,
    shared_memory_estimate,
    shared_memory_limit,
)

RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: (v + c) - c rounds |v| < 2**22 to even


def _configs(path: str = "gemm") -> list[triton.Config]:
    """Generic candidate configs for "gemm" (M > 16) or "decode"; the first is the interpreter's."""
    if path == "decode":
        return [
            _config(16, 64, 128, 4, 4, 3),
            _config(16, 32, 128, 8, 4, 3),
            _config(16, 128, 64, 2, 4, 4),
            _config(16, 64, 256, 2, 4, 3),
            _config(16, 128, 128, 1, 4, 4),
            _config(16, 64, 32, 4, 4, 4),
        ]
    return [
        _config(64, 64, 64, 1, 4, 4),
        _config(128, 128, 64, 1, 8, 3),
        _config(128, 256, 64, 1, 8, 4),
        _config(64, 128, 128, 1, 4, 4),
        _config(128, 64, 128, 1, 4, 4),
        _config(128, 128, 32, 1, 8, 4),
        _config(32, 64, 128, 1, 4, 4),
    ]


def _prune_configs(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """As ``int4_gemm._prune_configs``: hard group constraint first, then smem/split/size."""
    args = {**named_args, **kwargs}
    m, n, k, group = args["M"], args["N"], args["K"], args["GROUP_SIZE"]
    x = args["x_ptr"]
    limit = shared_memory_limit(x.device.index if x.device.type == "cuda" else None)
    grouped = args["GROUPED"]
    valid = [c for c in configs if not grouped or group % c.kwargs["BLOCK_K"] == 0]
    if not args["ATOMIC_OUT"]:  # split-K partials can only be added, never stored
        valid = [c for c in valid if c.kwargs["SPLIT_K"] == 1]
    fits = [c for c in valid if shared_memory_estimate(c, x.element_size(), 1) <= limit]
    fits = [c for c in fits if c.kwargs["SPLIT_K"] <= triton.cdiv(k, c.kwargs["BLOCK_K"])]
    bm_cap, bn_cap = max(16, triton.next_power_of_2(m)), max(16, triton.next_power_of_2(n))
    small = [c for c in fits if c.kwargs["BLOCK_M"] <= bm_cap and c.kwargs["BLOCK_N"] <= bn_cap]
    return small or fits[:1] or valid[-1:]


@triton.jit
def _int8_gemm_kernel(
    # pointers (x_scales_ptr is read only for A_INT8, zeros_ptr only for HAS_ZEROS)
    x_ptr, w_ptr, scales_ptr, zeros_ptr, x_scales_ptr, out_ptr,
    # sizes (m_bucket: next power of two of M, only read by the autotune key)
    M, N, K, m_bucket,
    # strides
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, stride_om, stride_on,
    # meta-parameters
    A_INT8: tl.constexpr, GROUPED: tl.constexpr, GROUP_SIZE: tl.constexpr,
    HAS_ZEROS: tl.constexpr, ATOMIC_OUT: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # ---- tile mapping (GROUP_M swizzle for L2 reuse, as in int4_gemm) ------------------
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_id = pid // (GROUP_M * num_pid_n)
    first_m = group_id * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_rows)
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_rows

    # ---- pointer setup: rows/cols past M/N wrap (the store masks them); K is masked ----
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BM, BK]
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BK, BN]
    s_ptrs = scales_ptr + offs_n * stride_sn
    z_ptrs = zeros_ptr + offs_n * stride_sn  # zeros share the scales' [N, K / g] layout

    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt_start = pid_k * per_split
    kt_end = min(kt_start + per_split, k_tiles)

    # ---- K loop -------------------------------------------------------------------------
    if A_INT8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(kt_start, kt_end):
        k0 = kt * BLOCK_K
        k_ok = (k0 + offs_k) < K
        a = tl.load(x_ptrs + k0 * stride_xk, mask=k_ok[None, :], other=0)
        w = tl.load(w_ptrs + k0 * stride_wk, mask=k_ok[:, None], other=0)  # int8 [BK, BN]
        if A_INT8:
            # exact integer products; out_dtype is required for int dots on triton 3.6
            acc = tl.dot(a, w, acc, out_dtype=tl.int32)
        else:
            group = k0 // GROUP_SIZE  # one group per tile when GROUPED (GROUP_SIZE % BLOCK_K == 0)
            wf = w.to(tl.float32)
            if HAS_ZEROS:
                wf = wf - tl.load(z_ptrs + group * stride_sg).to(tl.float32)[None, :]
            if GROUPED:
                wf = wf * tl.load(s_ptrs + group * stride_sg).to(tl.float32)[None, :]
            b = wf.to(x_ptr.dtype.element_ty)
            if DOT_FP32:
                # fp32 activations, or bf16 under the interpreter (its bf16 dot is garbage)
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)

    # ---- epilogue: per-token x per-channel scales (W8A8), per-channel scale (W8A16) -----
    if A_INT8:
        xs = tl.load(x_scales_ptr + offs_m)  # fp32 [BM], x_scales is [M, 1] contiguous
        res = acc.to(tl.float32) * xs[:, None] * tl.load(s_ptrs).to(tl.float32)[None, :]
    elif GROUPED:
        res = acc
    else:
        res = acc * tl.load(s_ptrs).to(tl.float32)[None, :]
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if ATOMIC_OUT:
        tl.atomic_add(out_ptrs, res, mask=mask)
    else:
        tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_per_token_kernel(
    x_ptr, x_q_ptr, x_scales_ptr,  # pointers
    K, stride_xm, stride_qm,  # size, strides
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    # one program per row: pass 1 finds max|x|, pass 2 rounds and stores (x is read twice,
    # from L2 the second time for rows up to a few MB)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        v = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
    row_max = tl.max(amax, axis=0)
    # div_rn: the GPU's default fp32 division is approximate and would move ties
    scale = tl.where(row_max > 0, tl.div_rn(row_max, 127.0), 1.0)
    tl.store(x_scales_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs < K
        v = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k_ok, other=0.0).to(tl.float32)
        r = (tl.div_rn(v, scale) + RNE_MAGIC) - RNE_MAGIC  # round half to even, like torch
        r = tl.minimum(tl.maximum(r, -127.0), 127.0)
        tl.store(x_q_ptr + row * stride_qm + k0 + offs, r.to(tl.int8), mask=k_ok)


def autotune(configs: list[triton.Config]):
    """The GEMM kernel autotuned over ``configs`` (see ``int4_gemm.autotune``)."""
    return triton.autotune(
        configs=configs,
        key=["m_bucket", "N", "K", "A_INT8", "GROUPED", "GROUP_SIZE", "HAS_ZEROS", "ATOMIC_OUT"],
        prune_configs_by={"early_config_prune": _prune_configs},
        reset_to_zero=["out_ptr"],
        # 20 ms per config instead of 100: a new (M bucket, N, K) key must not stall serving
        do_bench=functools.partial(triton.testing.do_bench, warmup=5, rep=20),
    )(_int8_gemm_kernel)


_int8_gemm_autotuned = autotune(_configs("gemm"))
_int8_gemm_decode_autotuned = autotune(_configs("decode"))


@functools.cache
def _autotuned(configs: tuple[triton.Config, ...]):
    """One autotuner per config list (see ``int4_gemm._autotuned``)."""
    if configs == tuple(_int8_gemm_autotuned.configs):
        return _int8_gemm_autotuned
    if configs == tuple(_int8_gemm_decode_autotuned.configs):
        return _int8_gemm_decode_autotuned
    return autotune(list(configs))


def quantize_per_token_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` float -> ``(x_q int8 [M, K], x_scales fp32 [M, 1])``, bit-exact with
    ``reference.quantize_per_token_int8`` (same fp32 division and rounding)."""
    check_device(x)
    if x.dim() != 2:
        raise KernelConstraintError(f"x {tuple(x.shape)}: need a 2-D [M, K] tensor")
    check_operand("x", x, FLOAT_DTYPES, x.shape, x.device)
    m, k = x.shape
    x_q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    x_scales = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m and k:
        config = quantize_config(k)
        _quantize_per_token_kernel[(m,)](
            x, x_q, x_scales, k, x.stride(0), x_q.stride(0), **config.kwargs,
            num_warps=config.num_warps,
        )  # fmt: skip
    return x_q, x_scales


def quantize_config(k: int) -> triton.Config:
    """The per-token quantizer's meta-parameters for rows of ``k`` elements (one row per
    program; 2048 elements per step keep the registers per thread low at 8 warps)."""
    block_k = min(triton.next_power_of_2(k), 2048)
    return triton.Config({"BLOCK_K": block_k}, num_warps=4 if block_k <= 1024 else 8)


def int8_int8_gemm_triton(
    x_q: torch.Tensor,
    x_scales: torch.Tensor,
    w_q: torch.Tensor,
    w_scales: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    config: triton.Config | Sequence[triton.Config] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """W8A8: ``x_q [M, K]`` int8, ``x_scales [M, 1]`` fp32, ``w_q [N, K]`` int8, ``w_scales
    [N, 1]`` -> ``[M, N]`` in ``out_dtype``; matches ``reference.int8_int8_gemm``.

    ``config`` and ``out`` as in ``int4_gemm.int4_gemm_triton``."""
    check_device(x_q)
    if x_q.dim() != 2 or w_q.dim() != 2:
        raise KernelConstraintError(f"x_q {tuple(x_q.shape)}, w_q {tuple(w_q.shape)}: need 2-D")
    (m, k), n = x_q.shape, w_q.shape[0]
    check_operand("x_q", x_q, (torch.int8,), (m, k), x_q.device)
    check_operand("x_scales", x_scales, (torch.float32,), (m, 1), x_q.device)
    check_operand("w_q", w_q, (torch.int8,), (n, k), x_q.device)
    check_operand("w_scales", w_scales, FLOAT_DTYPES, (n, 1), x_q.device)
    return _launch(x_q, w_q, w_scales, None, x_scales, a_int8=True, group_size=k,
                   out_dtype=out_dtype, config=config, out=out)  # fmt: skip


def int8_weight_gemm_triton(
    x: torch.Tensor,
    w_q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None = None,
    *,
    config: triton.Config | Sequence[triton.Config] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """W8A16: ``x [M, K]`` float, ``w_q [N, K]`` int8, ``scales [N, K / g]``, ``zeros`` int8
    ``[N, K / g]`` or None -> ``[M, N]`` in x's dtype; matches ``reference.int8_weight_gemm``."""
    check_device(x)
    if x.dim() != 2 or w_q.dim() != 2 or scales.dim() != 2:
        raise KernelConstraintError(f"x {tuple(x.shape)}, w_q {tuple(w_q.shape)}, scales "
                                    f"{tuple(scales.shape)}: need 2-D tensors")  # fmt: skip
    (m, k), n, n_groups = x.shape, w_q.shape[0], scales.shape[1]
    if n_groups == 0 or k % n_groups or (n_groups > 1 and (k // n_groups) % 32):
        raise KernelConstraintError(
            f"x {tuple(x.shape)}, scales {tuple(scales.shape)}: K={k} must split into "
            f"{n_groups} groups of a multiple of 32 (or use per-channel scales [N, 1])"
        )
    check_operand("x", x, FLOAT_DTYPES, (m, k), x.device)
    check_operand("w_q", w_q, (torch.int8,), (n, k), x.device)
    check_operand("scales", scales, FLOAT_DTYPES, (n, n_groups), x.device)
    if zeros is not None:
        check_operand("zeros", zeros, (torch.int8,), (n, n_groups), x.device)
    return _launch(x, w_q, scales, zeros, None, a_int8=False, group_size=k // n_groups,
                   out_dtype=x.dtype, config=config, out=out)  # fmt: skip


def _launch(x, w_q, scales, zeros, x_scales, *, a_int8, group_size, out_dtype, config, out):
    """Allocate and launch for both launchers above (their checks already ran)."""
    (m, k), n = x.shape, w_q.shape[0]
    grouped = group_size != k
    if out is not None:
        check_operand("out", out, (out_dtype,), (m, n), x.device)
    if isinstance(config, triton.Config) and grouped and group_size % config.kwargs["BLOCK_K"]:
        raise KernelConstraintError(
            f"config BLOCK_K={config.kwargs['BLOCK_K']} does not divide group_size={group_size}"
        )
    if m == 0 or n == 0:
        return torch.zeros(m, n, dtype=out_dtype, device=x.device) if out is None else out
    decode = is_decode(m)
    atomic = decode or (isinstance(config, triton.Config) and config.kwargs["SPLIT_K"] > 1)
    if atomic:
        y = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    else:
        y = torch.empty(m, n, dtype=out_dtype, device=x.device) if out is None else out
    args = (x, w_q, scales, scales if zeros is None else zeros,
            scales if x_scales is None else x_scales, y, m, n, k, triton.next_power_of_2(m),
            x.stride(0), x.stride(1), w_q.stride(0), w_q.stride(1),
            scales.stride(0), scales.stride(1), y.stride(0), y.stride(1))  # fmt: skip
    flags = {
        "A_INT8": a_int8,
        "GROUPED": grouped,
        "GROUP_SIZE": group_size,
        "HAS_ZEROS": zeros is not None,
        "ATOMIC_OUT": atomic,
        "DOT_FP32": x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and is_interpreted()),
    }
    if config is None:
        config = _configs("decode" if decode else "gemm")
    return launch(_int8_gemm_kernel, _autotuned, _prune_configs, config, args, flags,
                  x=x, y=y, out=out, out_dtype=out_dtype)  # fmt: skip
