"""Split-K GEMV in Triton for decode (M <= 4): W4A16, W8A16 and W8A8 without tensor cores.

At M = 1 a GEMM tile of 16 rows wastes 15 of them and the weight read is the whole cost, so
these kernels are GEMVs in GemLite's style: program ``(pid_n, pid_k)`` owns ``BLOCK_N`` outputs
and the ``pid_k``-th of ``SPLIT_K`` slices of K. Each step loads a ``[BLOCK_K, BLOCK_N]`` weight
tile, dequantizes it in registers and reduces ``x[:, k] * w[k, n]`` over k with elementwise
products (no ``tl.dot``, which needs 16 rows). ``SPLIT_K == 1`` stores ``y`` directly (one
launch). ``SPLIT_K > 1`` is a two-stage reduce: every program stores its partial sums into
``partials [SPLIT_K, M, N]`` (fp32, int32 for W8A8, so the integer sum stays exact), and
``_split_k_reduce_kernel`` adds them, applies the W8A8 scales and the bias and casts. Two
launches, no zeroing (``torch.empty``: a free-list pop in the caching allocator, no kernel) and
no atomics, so results are deterministic run to run.

Math and operand layouts are those of ``int4_gemm`` (int4: ``w_packed`` int32 ``[N, K / 8]``,
zeros packed on dim 0) and ``int8_gemm`` (int8 ``w_q [N, K]``, ``x_q`` + ``x_scales [M, 1]``).
Every operand contiguous. The scale of a K tile is one per column: ``GROUP_SIZE % BLOCK_K == 0``,
or a single group (per channel), where K need not be a multiple of BLOCK_K (the tail is masked).
Configs: ``triton.Config`` with ``BLOCK_N``, ``BLOCK_K``, ``SPLIT_K`` (BLOCK_M is M rounded up
to a power of two). ``config=None`` takes the one tuned for this (kernel, shape, M bucket, dtype,
device) in this process (``tuned_config``), timing the candidates once on CUDA.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
import triton.testing

from .errors import KernelConstraintError
from .int4_gemm import FLOAT_DTYPES, check_device, check_operand, is_interpreted

GEMV_MAX_M = 4  # rows this path takes; more go to the tensor-core GEMM of int4_gemm/int8_gemm
REDUCE_BLOCK = 512  # outputs per program of the split-K reduce
# [BLOCK_M, BLOCK_K, BLOCK_N] products per thread, at most: the offline sm_90 build of int8 at
# 128 (BLOCK_N 128, BLOCK_K 128, 4 warps, M = 1) took 255 registers and a stack; at 64 none did
MAX_ELEMENTS_PER_THREAD = 64


def gemv_config(bn: int, bk: int, split_k: int, warps: int, stages: int) -> triton.Config:
    return triton.Config(
        {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split_k}, num_warps=warps, num_stages=stages
    )


def _configs() -> list[triton.Config]:
    """Candidates for every GEMV (the first that fits is the interpreter's default). Small
    warps and few stages: a program streams one weight slab, it has nothing to pipeline but
    the next slab. The 1-warp BLOCK_K 16 entries follow GemLite's H100 M=1 choice (one warp,
    one stage, a thin K slab, many programs)."""
    return [
        gemv_config(64, 64, 4, 2, 2),
        gemv_config(128, 32, 8, 2, 2),
        gemv_config(128, 64, 4, 4, 2),
        gemv_config(64, 128, 8, 4, 2),
        gemv_config(256, 32, 8, 4, 2),
        gemv_config(128, 16, 16, 1, 1),
        gemv_config(64, 32, 16, 1, 1),
        gemv_config(32, 128, 16, 2, 2),
        gemv_config(128, 128, 1, 4, 2),
        gemv_config(64, 64, 1, 2, 2),
        # for M = 3..4, whose [BLOCK_M, BLOCK_K, BLOCK_N] products are 4x those of M = 1
        gemv_config(32, 16, 8, 1, 1),
        gemv_config(64, 16, 8, 2, 2),
        gemv_config(128, 16, 8, 4, 2),
        gemv_config(64, 32, 4, 4, 2),
    ]


def valid_configs(configs, *, m: int, n: int, k: int, group_size: int, min_block_k: int):
    """The configs that can run this problem: BLOCK_K inside one group (or a single group),
    at least ``min_block_k`` (8: one int4 word), few enough products per thread; oversized tiles
    are dropped when a smaller one fits. A config with more splits than K tiles gets one split
    per tile (a short K, e.g. 64: otherwise no candidate would be left)."""
    block_m = triton.next_power_of_2(m)
    valid = [c for c in configs if c.kwargs["BLOCK_K"] >= min_block_k
             and (group_size == k or group_size % c.kwargs["BLOCK_K"] == 0)]  # fmt: skip
    valid = list({_key(c): c for c in map(functools.partial(_fit_splits, k=k), valid)}.values())
    ok = [c for c in valid if block_m * c.kwargs["BLOCK_K"] * c.kwargs["BLOCK_N"]
          <= MAX_ELEMENTS_PER_THREAD * 32 * c.num_warps]  # fmt: skip
    small = [c for c in ok if c.kwargs["BLOCK_N"] <= max(16, triton.next_power_of_2(n))]
    # the soft filters may empty the list: then the smallest valid tile (correct, just slow)
    smallest = sorted(valid, key=lambda c: c.kwargs["BLOCK_K"] * c.kwargs["BLOCK_N"])[:1]
    return small or ok or smallest


def _fit_splits(config: triton.Config, *, k: int) -> triton.Config:
    tiles = triton.cdiv(k, config.kwargs["BLOCK_K"])
    if config.kwargs["SPLIT_K"] <= tiles:
        return config
    return gemv_config(config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"], tiles,
                       config.num_warps, config.num_stages)  # fmt: skip


def _key(config: triton.Config) -> tuple:
    return (*sorted(config.kwargs.items()), config.num_warps, config.num_stages)


@triton.jit
def _int4_gemv_kernel(
    # pointers (zeros_ptr read only with HAS_ZEROS, bias_ptr only with HAS_BIAS)
    x_ptr, w_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr,
    # sizes
    M, N, K,
    # strides of the rows (x, out and partials are contiguous [M, K], [M, N], [SPLIT_K, M, N])
    stride_wn, stride_sn, stride_zn,
    # meta-parameters
    GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    # ---- tile mapping: BLOCK_N outputs, the pid_k-th slice of K tiles ---------------------
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt_start = pid_k * per_split
    kt_end = min(kt_start + per_split, k_tiles)

    # ---- pointer setup: columns past N wrap (loads in bounds, the store masks them) --------
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    safe_n = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    offs_kw = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4  # nibble i of a word sits at bits 4i..4i+3
    m_ok = offs_m < M
    x_ptrs = x_ptr + offs_m[:, None] * K + offs_k[None, :]  # [BM, BK]
    w_ptrs = w_ptr + safe_n[None, :] * stride_wn + offs_kw[:, None]  # [BK/8, BN]
    s_ptrs = scales_ptr + safe_n * stride_sn
    z_ptrs = zeros_ptr + (safe_n // 8) * stride_zn
    z_shift = (safe_n % 8) * 4

    # ---- K loop: unpack, subtract the zero point, reduce over k, then scale per group ------
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(kt_start, kt_end):
        k0 = kt * BLOCK_K
        k_ok = (k0 + offs_k) < K  # only a single-group K tail is ever masked
        a = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w_ok = (k0 // 8 + offs_kw) < K // 8
        words = tl.load(w_ptrs + k0 // 8, mask=w_ok[:, None], other=0)  # [BK/8, BN] int32
        # [BK/8, 8, BN] -> [BK, BN]: row 8j+i is nibble i of word j (& 0xF undoes the sign
        # extension of the arithmetic shift on the top nibble)
        q = (words[:, None, :] >> shifts[None, :, None]) & 0xF
        q = tl.reshape(q, (BLOCK_K, BLOCK_N))
        group = k0 // GROUP_SIZE  # the tile lies in one group (module docstring)
        if HAS_ZEROS:
            z = (tl.load(z_ptrs + group) >> z_shift) & 0xF  # zero + 8, [BN]
            w = (q - z[None, :]).to(tl.float32)
        else:
            w = (q - 8).to(tl.float32)
        s = tl.load(s_ptrs + group).to(tl.float32)  # [BN]
        # integer codes times x, summed in fp32, scaled once per tile: one multiply per
        # output instead of one per weight
        acc += tl.sum(a[:, :, None] * w[None, :, :], axis=1) * s[None, :]

    # ---- epilogue: store y (one split) or this split's partial sums ----------------------
    mask = m_ok[:, None] & (offs_n < N)[None, :]
    out_offs = offs_m[:, None] * N + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + safe_n).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + pid_k * M * N + out_offs, acc, mask=mask)


@triton.jit
def _int8_gemv_kernel(
    # pointers (x_scales_ptr read only with A_INT8, zeros_ptr with HAS_ZEROS, bias with HAS_BIAS)
    x_ptr, w_ptr, scales_ptr, zeros_ptr, x_scales_ptr, bias_ptr, out_ptr,
    # sizes
    M, N, K,
    # strides of the rows (zeros share the scales' [N, K / g] layout)
    stride_wn, stride_sn,
    # meta-parameters
    A_INT8: tl.constexpr, GROUPED: tl.constexpr, GROUP_SIZE: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    # ---- tile mapping (as in _int4_gemv_kernel) ------------------------------------------
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt_start = pid_k * per_split
    kt_end = min(kt_start + per_split, k_tiles)

    # ---- pointer setup -------------------------------------------------------------------
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    safe_n = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    x_ptrs = x_ptr + offs_m[:, None] * K + offs_k[None, :]  # [BM, BK]
    w_ptrs = w_ptr + safe_n[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
    s_ptrs = scales_ptr + safe_n * stride_sn
    z_ptrs = zeros_ptr + safe_n * stride_sn

    # ---- K loop: W8A8 sums exact int32 products; W8A16 fp32, scaled per group -------------
    if A_INT8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(kt_start, kt_end):
        k0 = kt * BLOCK_K
        k_ok = (k0 + offs_k) < K
        a = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0)
        w = tl.load(w_ptrs + k0, mask=k_ok[:, None], other=0)  # int8 [BK, BN]
        if A_INT8:
            acc += tl.sum(a.to(tl.int32)[:, :, None] * w.to(tl.int32)[None, :, :], axis=1)
        else:
            group = k0 // GROUP_SIZE  # one group per tile when GROUPED; 0 per channel
            wf = w.to(tl.float32)
            if HAS_ZEROS:
                wf = wf - tl.load(z_ptrs + group).to(tl.float32)[None, :]
            part = tl.sum(a.to(tl.float32)[:, :, None] * wf[None, :, :], axis=1)
            if GROUPED:
                part = part * tl.load(s_ptrs + group).to(tl.float32)[None, :]
            acc += part

    # ---- epilogue ------------------------------------------------------------------------
    mask = m_ok[:, None] & (offs_n < N)[None, :]
    out_offs = offs_m[:, None] * N + offs_n[None, :]
    if SPLIT_K == 1:
        if A_INT8:
            # (acc * x_scale) * w_scale: reference.int8_int8_gemm's order, bit for bit
            xs = tl.load(x_scales_ptr + offs_m, mask=m_ok, other=1.0)
            res = acc.to(tl.float32) * xs[:, None] * tl.load(s_ptrs).to(tl.float32)[None, :]
        elif GROUPED:
            res = acc
        else:
            res = acc * tl.load(s_ptrs).to(tl.float32)[None, :]
        if HAS_BIAS:
            res += tl.load(bias_ptr + safe_n).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, res.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        if not A_INT8 and not GROUPED:
            acc = acc * tl.load(s_ptrs).to(tl.float32)[None, :]
        tl.store(out_ptr + pid_k * M * N + out_offs, acc, mask=mask)


@triton.jit
def _split_k_reduce_kernel(
    partials_ptr, x_scales_ptr, w_scales_ptr, bias_ptr, out_ptr,  # pointers
    M, N,  # sizes
    SPLIT_K: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # out[m, n] = sum_s partials[s, m, n] (* x_scales[m] * w_scales[n]) (+ bias[n])
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=partials_ptr.dtype.element_ty)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(partials_ptr + s * M * N + offs, mask=ok, other=0)
    res = acc.to(tl.float32)
    if HAS_SCALES:
        res = res * tl.load(x_scales_ptr + offs // N, mask=ok, other=1.0)
        res = res * tl.load(w_scales_ptr + offs % N, mask=ok, other=1.0).to(tl.float32)
    if HAS_BIAS:
        res += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, res.to(out_ptr.dtype.element_ty), mask=ok)


# ---- tuned configs: one per (kernel, shape, M bucket, dtype, flags, device) per process ----
_TUNED: dict[tuple, triton.Config] = {}


def tuned_config(key: tuple, candidates: list[triton.Config], run) -> triton.Config:
    """The config for ``key``: the first candidate under the interpreter or while a CUDA graph
    is being captured (timing would break the capture; that choice is not kept), else the
    fastest by ``triton.testing.do_bench`` of ``run(config)``, timed once per process."""
    if key in _TUNED:
        return _TUNED[key]
    if len(candidates) == 1 or is_interpreted() or torch.cuda.is_current_stream_capturing():
        return candidates[0]
    times = [triton.testing.do_bench(lambda c=c: run(c), warmup=3, rep=10) for c in candidates]
    _TUNED[key] = candidates[min(range(len(times)), key=times.__getitem__)]
    return _TUNED[key]


def _problem_key(name: str, x: torch.Tensor, n: int, group_size: int, flags: dict) -> tuple:
    block_m = triton.next_power_of_2(x.shape[0])
    return (name, x.device, x.dtype, block_m, n, x.shape[1], group_size, *sorted(flags.items()))


def _check_rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or not 1 <= x.shape[0] <= GEMV_MAX_M:
        raise KernelConstraintError(
            f"{name} {tuple(x.shape)}: the GEMV takes 2-D input with 1..{GEMV_MAX_M} rows "
            "(use the GEMM in int4_gemm/int8_gemm for more)"
        )


def _check_bias(bias: torch.Tensor | None, n: int, device: torch.device) -> None:
    if bias is not None:
        check_operand("bias", bias, FLOAT_DTYPES, (n,), device)


def _run(kernel, pointers, sizes, flags, config, *, m, n, out_dtype, device, scales=None):
    """Launch ``kernel`` with ``config`` and, for split-K, the reduce; returns ``[M, N]``.
    ``scales`` = (x_scales, w_scales) makes the reduce apply W8A8's scales (int32 partials)."""
    split = config.kwargs["SPLIT_K"]
    out = torch.empty(m, n, dtype=out_dtype, device=device)
    partial_dtype = torch.int32 if scales is not None else torch.float32
    target = out if split == 1 else torch.empty(split, m, n, dtype=partial_dtype, device=device)
    grid = (triton.cdiv(n, config.kwargs["BLOCK_N"]), split)
    meta = dict(flags, BLOCK_M=triton.next_power_of_2(m), **config.kwargs)
    kernel[grid](*pointers, target, *sizes, **meta, num_warps=config.num_warps,
                 num_stages=config.num_stages)  # fmt: skip
    if split > 1:
        bias = pointers[-1] if flags["HAS_BIAS"] else target  # the last pointer before out
        x_scales, w_scales = scales if scales is not None else (target, target)
        _split_k_reduce_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
            target, x_scales, w_scales, bias, out, m, n, SPLIT_K=split,
            HAS_SCALES=scales is not None, HAS_BIAS=flags["HAS_BIAS"],
            BLOCK=REDUCE_BLOCK, num_warps=4,
        )  # fmt: skip
    return out


def _launch(kernel, name, pointers, sizes, flags, config, *, x, n, group_size, min_block_k,
            out_dtype, scales=None):  # fmt: skip
    """Pick (or check) the config, then ``_run``; ``pointers`` are the kernel's before out."""
    m, k = x.shape
    run = functools.partial(_run, kernel, pointers, sizes, flags, m=m, n=n, out_dtype=out_dtype,
                            device=x.device, scales=scales)  # fmt: skip
    if config is None:
        key = _problem_key(name, x, n, group_size, flags)
        config = _TUNED.get(key)  # the hot path: one dict lookup once tuned
        if config is None:
            valid = valid_configs(_configs(), m=m, n=n, k=k, group_size=group_size,
                                  min_block_k=min_block_k)  # fmt: skip
            config = tuned_config(key, valid, run)
    else:
        bk = config.kwargs["BLOCK_K"]
        if bk < min_block_k or (group_size != k and group_size % bk):
            raise KernelConstraintError(
                f"GEMV config BLOCK_K={bk} must be >= {min_block_k} and divide "
                f"group_size={group_size} (K={k})"
            )
    return run(config)


def int4_gemv_triton(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    *,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """W4A16 ``x [M, K] @ W.T (+ bias) -> [M, N]`` in x's dtype for M <= ``GEMV_MAX_M``;
    operands as in ``int4_gemm.int4_gemm_triton``, ``bias [N]`` float or None. ``config``: one
    ``triton.Config`` (``gemv_config``) runs as given; None takes ``tuned_config``'s."""
    check_device(x)
    _check_rows(x, "x")
    m, k = x.shape
    n = w_packed.shape[0]
    if group_size <= 0 or k % group_size or k % 8 or (group_size != k and group_size % 8):
        raise KernelConstraintError(
            f"int4 GEMV x {tuple(x.shape)}: K={k} must be a multiple of 8 and of group_size="
            f"{group_size}, itself a multiple of 8 (or equal to K)"
        )
    check_operand("x", x, FLOAT_DTYPES, (m, k), x.device)
    check_operand("w_packed", w_packed, (torch.int32,), (n, k // 8), x.device)
    check_operand("scales", scales, FLOAT_DTYPES, (n, k // group_size), x.device)
    if zeros is not None:
        check_operand("zeros", zeros, (torch.int32,), ((n + 7) // 8, k // group_size), x.device)
    _check_bias(bias, n, x.device)
    flags = {"GROUP_SIZE": group_size, "HAS_ZEROS": zeros is not None, "HAS_BIAS": bias is not None}
    pointers = (x, w_packed, scales, w_packed if zeros is None else zeros,
                scales if bias is None else bias)  # fmt: skip
    sizes = (m, n, k, w_packed.stride(0), scales.stride(0), 0 if zeros is None else zeros.stride(0))
    return _launch(_int4_gemv_kernel, "int4", pointers, sizes, flags, config, x=x, n=n,
                   group_size=group_size, min_block_k=8, out_dtype=x.dtype)  # fmt: skip


def int8_gemv_triton(
    x: torch.Tensor,
    w_q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """W8A16 ``x [M, K] @ ((w_q - zeros) * scales).T (+ bias) -> [M, N]`` in x's dtype, M <=
    ``GEMV_MAX_M``; operands as in ``int8_gemm.int8_weight_gemm_triton``."""
    check_device(x)
    _check_rows(x, "x")
    (m, k), n, n_groups = x.shape, w_q.shape[0], scales.shape[1] if scales.dim() == 2 else 0
    if n_groups == 0 or k % n_groups:
        raise KernelConstraintError(
            f"int8 GEMV x {tuple(x.shape)}, scales {tuple(scales.shape)}: K={k} must split "
            f"into {n_groups} equal groups"
        )
    group_size = k // n_groups
    check_operand("x", x, FLOAT_DTYPES, (m, k), x.device)
    check_operand("w_q", w_q, (torch.int8,), (n, k), x.device)
    check_operand("scales", scales, FLOAT_DTYPES, (n, n_groups), x.device)
    if zeros is not None:
        check_operand("zeros", zeros, (torch.int8,), (n, n_groups), x.device)
    _check_bias(bias, n, x.device)
    flags = {"A_INT8": False, "GROUPED": n_groups > 1, "GROUP_SIZE": group_size,
             "HAS_ZEROS": zeros is not None, "HAS_BIAS": bias is not None}  # fmt: skip
    pointers = (x, w_q, scales, scales if zeros is None else zeros, scales,
                scales if bias is None else bias)  # fmt: skip
    sizes = (m, n, k, w_q.stride(0), scales.stride(0))
    return _launch(_int8_gemv_kernel, "int8", pointers, sizes, flags, config, x=x, n=n,
                   group_size=group_size, min_block_k=16, out_dtype=x.dtype)  # fmt: skip


def int8_int8_gemv_triton(
    x_q: torch.Tensor,
    x_scales: torch.Tensor,
    w_q: torch.Tensor,
    w_scales: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """W8A8 ``(x_q @ w_q.T) * x_scales * w_scales.T (+ bias) -> [M, N]`` in ``out_dtype``, M <=
    ``GEMV_MAX_M``; operands as in ``int8_gemm.int8_int8_gemm_triton``. Without bias it equals
    ``reference.int8_int8_gemm`` rounded to ``out_dtype`` bit for bit."""
    check_device(x_q)
    _check_rows(x_q, "x_q")
    (m, k), n = x_q.shape, w_q.shape[0]
    check_operand("x_q", x_q, (torch.int8,), (m, k), x_q.device)
    check_operand("x_scales", x_scales, (torch.float32,), (m, 1), x_q.device)
    check_operand("w_q", w_q, (torch.int8,), (n, k), x_q.device)
    check_operand("w_scales", w_scales, FLOAT_DTYPES, (n, 1), x_q.device)
    _check_bias(bias, n, x_q.device)
    flags = {"A_INT8": True, "GROUPED": False, "GROUP_SIZE": k, "HAS_ZEROS": False,
             "HAS_BIAS": bias is not None}  # fmt: skip
    pointers = (x_q, w_q, w_scales, w_scales, x_scales, w_scales if bias is None else bias)
    sizes = (m, n, k, w_q.stride(0), w_scales.stride(0))
    return _launch(_int8_gemv_kernel, "w8a8", pointers, sizes, flags, config, x=x_q, n=n,
                   group_size=k, min_block_k=16, out_dtype=out_dtype,
                   scales=(x_scales, w_scales))  # fmt: skip
