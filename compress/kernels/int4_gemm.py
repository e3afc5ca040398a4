"""W4A16 GEMM in Triton: ``y = x @ W.T`` with int4 weights in the compressed-tensors layout.

Math: ``W[n, k] = (w_q[n, k] - zeros[n, k // g]) * scales[n, k // g]``, accumulated in fp32,
``y`` in x's dtype. The weight is dequantized tile by tile in registers and fed to ``tl.dot``;
it never exists in memory as floats.

Layout of every operand (see ``reference.pack_int4`` for the nibble diagram):

* ``x``        fp16 / bf16 / fp32 ``[M, K]``, row-major;
* ``w_packed`` int32 ``[N, K / 8]``: word j of row n holds codes 8j..8j+7, lowest nibble first,
  each stored as ``code + 8``;
* ``scales``   fp16 / bf16 / fp32 ``[N, K / g]``;
* ``zeros``    optional int32 ``[ceil(N / 8), K / g]``, packed the same way along N (dim 0);
* ``y``        ``[M, N]`` in x's dtype.

Constraints: ``K % GROUP_SIZE == 0``, ``GROUP_SIZE % BLOCK_K == 0`` (so every K tile lies in one
group and the K loop needs no mask), ``BLOCK_K >= 16`` (the smallest ``tl.dot`` K), hence
``group_size % 16 == 0``. All tensors contiguous and 16-byte aligned.

Two paths share the kernel. Prefill (M > 16) tiles M x N and stores directly. Decode
(M <= 16) uses BLOCK_M = 16 and split-K: SPLIT_K programs per output tile each reduce a slice of
K and add into an fp32 buffer with atomics, so that M = 1 still gives the GPU hundreds of
programs. It does not do act-order (g_idx) GPTQ checkpoints or fp8 activations.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
import triton.testing

from .errors import KernelConstraintError

DECODE_MAX_M = 16  # M up to this takes the split-K decode path
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
H100_SHARED_MEMORY = 232448  # bytes per block (opt-in) on sm_90; used when no driver is present


def _config(bm: int, bn: int, bk: int, split_k: int, warps: int, stages: int) -> triton.Config:
    meta = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split_k, "GROUP_M": 8}
    return triton.Config(meta, num_warps=warps, num_stages=stages)


def _configs(path: str = "gemm") -> list[triton.Config]:
    """Generic candidate configs (sm_80+) for ``path`` "gemm" (prefill) or "decode" (M <= 16).

    The first entry of each list is the default under the interpreter. BLOCK_K 32 entries exist
    for group_size 32; per-GPU lists live in ``configs/*.json`` (``triton_ops.load_tuned_configs``).
    """
    if path == "decode":
        return [
            _config(16, 64, 64, 4, 4, 3),
            _config(16, 32, 128, 8, 4, 3),
            _config(16, 64, 128, 2, 4, 4),
            _config(16, 128, 64, 1, 4, 4),
            _config(16, 64, 32, 4, 4, 4),
            _config(16, 128, 128, 4, 8, 3),
            _config(16, 32, 16, 2, 4, 4),
        ]
    return [
        _config(64, 64, 64, 1, 4, 4),
        _config(128, 128, 64, 1, 8, 3),
        _config(128, 256, 64, 1, 8, 3),
        _config(64, 128, 128, 1, 4, 3),
        _config(128, 64, 64, 1, 4, 4),
        _config(64, 64, 32, 1, 4, 5),
        _config(128, 128, 32, 1, 8, 4),
        _config(32, 64, 128, 1, 4, 4),
        _config(64, 64, 16, 1, 4, 4),
    ]


def shared_memory_estimate(config: triton.Config, x_bytes: int, b_bytes: float) -> int:
    """Bytes of shared memory a config's pipelined A and B tiles take (a lower bound).

    ``b_bytes`` is the weight bytes per element as loaded (0.5 for packed int4). The dequantized
    B operand is staged once more in the dot's dtype; the compile test checks the real number.
    """
    m = config.kwargs
    a = m["BLOCK_M"] * m["BLOCK_K"] * x_bytes
    b = int(m["BLOCK_K"] * m["BLOCK_N"] * b_bytes)
    return config.num_stages * (a + b) + m["BLOCK_K"] * m["BLOCK_N"] * x_bytes


@functools.cache
def shared_memory_limit(device_index: int | None) -> int:
    """Opt-in shared memory per block of a CUDA device; the sm_90 value without a driver."""
    if device_index is None or not torch.cuda.is_available():
        return H100_SHARED_MEMORY
    props = triton.runtime.driver.active.utils.get_device_properties(device_index)
    return int(props["max_shared_mem"])


def _prune_configs(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Drop configs whose BLOCK_K does not divide the group, whose tiles dwarf the problem,
    whose split-K exceeds the K tiles, or whose tiles do not fit in shared memory."""
    args = {**named_args, **kwargs}
    m, n, k, group = args["M"], args["N"], args["K"], args["GROUP_SIZE"]
    x = args["x_ptr"]
    limit = shared_memory_limit(x.device.index if x.device.type == "cuda" else None)
    valid = [c for c in configs if group % c.kwargs["BLOCK_K"] == 0]  # hard constraint
    if not args["ATOMIC_OUT"]:  # split-K partials can only be added, never stored
        valid = [c for c in valid if c.kwargs["SPLIT_K"] == 1]
    fits = [c for c in valid if shared_memory_estimate(c, x.element_size(), 0.5) <= limit]
    fits = [c for c in fits if c.kwargs["SPLIT_K"] <= k // c.kwargs["BLOCK_K"]]
    # Tiles larger than the padded problem only waste work
    bm_cap, bn_cap = max(16, triton.next_power_of_2(m)), max(16, triton.next_power_of_2(n))
    small = [c for c in fits if c.kwargs["BLOCK_M"] <= bm_cap and c.kwargs["BLOCK_N"] <= bn_cap]
    # The soft filters may empty the list; an oversized but valid config still computes right
    return small or fits[:1] or valid[-1:]


@triton.jit
def _int4_gemm_kernel(
    # pointers
    x_ptr, w_ptr, scales_ptr, zeros_ptr, out_ptr,
    # sizes (m_bucket: next power of two of M, only read by the autotune key)
    M, N, K, m_bucket,
    # strides
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, stride_zn, stride_zg,
    stride_om, stride_on,
    # meta-parameters
    GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, ATOMIC_OUT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # ---- tile mapping: GROUP_M rows of tiles share their weight columns in L2 ----------
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_id = pid // (GROUP_M * num_pid_n)
    first_m = group_id * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_rows)
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_rows

    # ---- pointer setup: rows/cols past M/N wrap around (loads stay in bounds, the store
    # masks them), so the K loop needs no masks at all -----------------------------------
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    offs_kw = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4  # nibble i of a word sits at bits 4i..4i+3
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_kw[:, None] * stride_wk  # [BK/8, BN]
    s_ptrs = scales_ptr + offs_n * stride_sn
    z_ptrs = zeros_ptr + (offs_n // 8) * stride_zn
    z_shift = (offs_n % 8) * 4

    # split-K: program pid_k reduces K tiles [kt_start, kt_end)
    k_tiles = K // BLOCK_K
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt_start = pid_k * per_split
    kt_end = min(kt_start + per_split, k_tiles)

    # ---- K loop: unpack nibbles, dequantize in fp32, dot with fp32 accumulation --------
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(kt_start, kt_end):
        k0 = kt * BLOCK_K
        a = tl.load(x_ptrs + k0 * stride_xk)  # [BM, BK]
        words = tl.load(w_ptrs + (k0 // 8) * stride_wk)  # [BK/8, BN] int32
        # [BK/8, 8, BN] -> [BK, BN]: row 8j+i is nibble i of word j; & 0xF undoes the
        # sign extension of the arithmetic shift on the top nibble
        q = (words[:, None, :] >> shifts[None, :, None]) & 0xF
        q = tl.reshape(q, (BLOCK_K, BLOCK_N))
        group = k0 // GROUP_SIZE  # the whole tile is in one group (GROUP_SIZE % BLOCK_K == 0)
        s = tl.load(s_ptrs + group * stride_sg).to(tl.float32)  # [BN]
        if HAS_ZEROS:
            z = (tl.load(z_ptrs + group * stride_zg) >> z_shift) & 0xF  # zero + 8, [BN]
            w = (q - z[None, :]).to(tl.float32) * s[None, :]
        else:
            w = (q - 8).to(tl.float32) * s[None, :]
        # Round the weight to x's dtype first, so the products are the ones the GPU makes
        b = w.to(x_ptr.dtype.element_ty)
        if DOT_FP32:
            # fp32 activations, or bf16 under the interpreter (its bf16 dot is garbage)
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)

    # ---- epilogue: store in x's dtype, or add the split-K partial into the fp32 buffer ---
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if ATOMIC_OUT:
        tl.atomic_add(out_ptrs, acc, mask=mask)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def autotune(configs: list[triton.Config]):
    """The kernel autotuned over ``configs``, keyed on the M bucket, N, K and the group."""
    return triton.autotune(
        configs=configs,
        key=["m_bucket", "N", "K", "GROUP_SIZE", "HAS_ZEROS", "ATOMIC_OUT"],
        prune_configs_by={"early_config_prune": _prune_configs},
        # split-K programs add into the output: every timing run must start from zeros
        reset_to_zero=["out_ptr"],
        # 20 ms per config instead of 100: a new (M bucket, N, K) key must not stall serving
        do_bench=functools.partial(triton.testing.do_bench, warmup=5, rep=20),
    )(_int4_gemm_kernel)


_int4_gemm_autotuned = autotune(_configs("gemm"))
_int4_gemm_decode_autotuned = autotune(_configs("decode"))


@functools.cache
def _autotuned(configs: tuple[triton.Config, ...]):
    """One autotuner per config list, so its timing cache survives across calls."""
    if configs == tuple(_int4_gemm_autotuned.configs):
        return _int4_gemm_autotuned
    if configs == tuple(_int4_gemm_decode_autotuned.configs):
        return _int4_gemm_decode_autotuned
    return autotune(list(configs))


def is_interpreted() -> bool:
    """Whether the kernels were built by the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_int4_gemm_kernel, triton.runtime.JITFunction)


def check_operand(name, t, dtypes, shape, device) -> None:
    """Raise ``KernelConstraintError`` unless ``t`` has one of ``dtypes``, ``shape`` and is a
    contiguous, 16-byte aligned tensor on ``device``."""
    where = f"{name} {t.dtype} {tuple(t.shape)}"
    if t.dtype not in dtypes:
        raise KernelConstraintError(f"{where}: dtype must be one of {dtypes}")
    if tuple(t.shape) != tuple(shape):
        raise KernelConstraintError(f"{where}: expected shape {tuple(shape)}")
    if t.device != device:
        raise KernelConstraintError(f"{where}: on {t.device}, x is on {device}")
    if not t.is_contiguous():
        raise KernelConstraintError(f"{where}: must be contiguous (call .contiguous())")
    if t.data_ptr() % 16:
        raise KernelConstraintError(f"{where}: data pointer is not 16-byte aligned")


def check_device(x: torch.Tensor) -> None:
    if x.device.type != "cuda" and not (is_interpreted() and x.device.type == "cpu"):
        raise KernelConstraintError(
            f"x {tuple(x.shape)} is on {x.device}: the Triton kernels need CUDA tensors, or CPU "
            "tensors with TRITON_INTERPRET=1 set before compress.kernels.int4_gemm is imported"
        )


def group_reason(k: int, group_size: int) -> str | None:
    """Why no config can take this K and group size, or None."""
    if group_size <= 0 or k % group_size:
        return f"K={k} is not divisible by group_size={group_size}"
    if group_size % 16:
        return f"group_size={group_size} is not a multiple of 16 (the smallest BLOCK_K)"
    return None


def is_decode(m: int) -> bool:
    return m <= DECODE_MAX_M


def int4_gemm_triton(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    *,
    group_size: int,
    config: triton.Config | Sequence[triton.Config] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W.T -> [M, N]`` in x's dtype, W the packed int4 weight (module docstring).

    ``config``: one ``triton.Config`` runs the raw kernel with those meta-parameters (tests,
    debugging); a sequence (a list from ``triton_ops.load_tuned_configs``) is autotuned over;
    None autotunes ``_configs()`` of the decode (M <= 16) or prefill path. Under the interpreter
    a list is never autotuned: its first entry that fits is used. ``out`` (``[M, N]``, x's
    dtype) is written in place if given.
    """
    # ---- constraints ----
    check_device(x)
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise KernelConstraintError(
            f"x {x.dtype} {tuple(x.shape)}: need a 2-D tensor, dtype must be one of {FLOAT_DTYPES}"
        )
    m, k = x.shape
    n = w_packed.shape[0]
    reason = group_reason(k, group_size)
    if reason:
        raise KernelConstraintError(
            f"int4 GEMM x {tuple(x.shape)}, w_packed {tuple(w_packed.shape)}: {reason}"
        )
    check_operand("x", x, FLOAT_DTYPES, (m, k), x.device)
    check_operand("w_packed", w_packed, (torch.int32,), (n, k // 8), x.device)
    check_operand("scales", scales, FLOAT_DTYPES, (n, k // group_size), x.device)
    if zeros is not None:
        check_operand("zeros", zeros, (torch.int32,), ((n + 7) // 8, k // group_size), x.device)
    if out is not None:
        check_operand("out", out, (x.dtype,), (m, n), x.device)
    if isinstance(config, triton.Config) and group_size % config.kwargs["BLOCK_K"]:
        raise KernelConstraintError(
            f"config BLOCK_K={config.kwargs['BLOCK_K']} does not divide group_size={group_size}"
        )
    if m == 0 or n == 0:
        return torch.zeros(m, n, dtype=x.dtype, device=x.device) if out is None else out

    # ---- allocate ----
    decode = is_decode(m)
    atomic = decode or (isinstance(config, triton.Config) and config.kwargs["SPLIT_K"] > 1)
    if atomic:
        y = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    else:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out

    # ---- launch ----
    args = (x, w_packed, scales, w_packed if zeros is None else zeros, y,
            m, n, k, triton.next_power_of_2(m),
            x.stride(0), x.stride(1), w_packed.stride(0), w_packed.stride(1),
            scales.stride(0), scales.stride(1),
            0 if zeros is None else zeros.stride(0), 0 if zeros is None else zeros.stride(1),
            y.stride(0), y.stride(1))  # fmt: skip
    flags = {
        "GROUP_SIZE": group_size,
        "HAS_ZEROS": zeros is not None,
        "ATOMIC_OUT": atomic,
        "DOT_FP32": x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and is_interpreted()),
    }
    if config is None:
        config = _configs("decode" if decode else "gemm")
    return launch(_int4_gemm_kernel, _autotuned, _prune_configs, config, args, flags,
                  x=x, y=y, out=out, out_dtype=x.dtype)  # fmt: skip


def launch(kernel, autotuned, prune, config, args, flags, *, x, y, out, out_dtype):
    """Run ``kernel`` (the int4 or int8 GEMM) on ``args``/``flags`` and return ``[M, N]``.

    ``config``: one ``triton.Config`` runs ``kernel`` with it; a list is autotuned over through
    ``autotuned(tuple(configs))``. With ``ATOMIC_OUT`` the kernel added into the fp32 ``y``,
    which is cast into ``out`` or a new tensor of ``out_dtype``; otherwise ``y`` is the result.
    """
    (m, k), n = x.shape, y.shape[1]
    if not isinstance(config, triton.Config) and is_interpreted():
        # autotuning several configs needs a driver: take the first one that fits
        config = prune(list(config), {}, **flags, x_ptr=x, M=m, N=n, K=k)[0]
    if not isinstance(config, triton.Config):
        autotuned(tuple(config))[_grid](*args, **flags)
    else:
        kernel[_grid(config.kwargs | {"M": m, "N": n})](
            *args,
            **flags,
            **config.kwargs,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    if not flags["ATOMIC_OUT"]:
        return y
    return y.to(out_dtype) if out is None else out.copy_(y)


def _grid(meta: dict) -> tuple[int, int]:
    tiles = triton.cdiv(meta["M"], meta["BLOCK_M"]) * triton.cdiv(meta["N"], meta["BLOCK_N"])
    return (tiles, meta["SPLIT_K"])
