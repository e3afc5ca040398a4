"""W4A16 Triton kernel vs. the float64 reference (interpreter on CPU, or CUDA when present).

Outputs are pre-filled with NaN and inputs are followed by NaN padding in memory, so unwritten
outputs and out-of-bounds reads both fail the comparison.
"""

from __future__ import annotations

import pytest
import torch

from compress.kernels import reference

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")  # numpy fp16 overflow

# Output tolerance per activation dtype: the weight is rounded to the activation dtype before
# the dot (as on the GPU) and the output is rounded once; bf16 keeps 8 mantissa bits.
TOL = {
    torch.float16: {"atol": 2e-2, "rtol": 1e-2},
    torch.bfloat16: {"atol": 1.5e-1, "rtol": 2e-2},
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
}
DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _padded(t: torch.Tensor, fill: float | int) -> torch.Tensor:
    """A contiguous copy of ``t`` followed in memory by 64 elements of ``fill``."""
    buf = torch.full((t.numel() + 64,), fill, dtype=t.dtype, device=t.device)
    buf[: t.numel()] = t.reshape(-1)
    return buf[: t.numel()].view(t.shape)


def _problem(m, n, k, group_size, symmetric, dtype, device, seed=0):
    """Random x, packed weight, scales, zeros (+ NaN padding) and the float64 expected output."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w_q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, k // group_size, generator=g) * 0.02 + 0.01).to(torch.float16)
    zeros = None
    if not symmetric:
        zeros = reference.pack_int4(
            torch.randint(-8, 8, (n, k // group_size), generator=g, dtype=torch.int8), dim=0
        )
    w = reference.int4_weight(reference.pack_int4(w_q), scales, zeros, group_size, k, torch.float64)
    expected = x.to(torch.float64) @ w.t()
    x = _padded(x.to(device), float("nan"))
    w_packed = _padded(reference.pack_int4(w_q).to(device), -1)
    scales = _padded(scales.to(device), float("nan"))
    zeros = None if zeros is None else _padded(zeros.to(device), -1)
    return x, w_packed, scales, zeros, expected


def _run(m, n, k, group_size, symmetric, dtype, device, config=None):
    from compress.kernels import int4_gemm

    x, w_packed, scales, zeros, expected = _problem(m, n, k, group_size, symmetric, dtype, device)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    y = int4_gemm.int4_gemm_triton(
        x, w_packed, scales, zeros, group_size=group_size, config=config, out=out
    )
    assert y.data_ptr() == out.data_ptr()
    torch.testing.assert_close(y.cpu().to(torch.float64), expected, **TOL[dtype])


# ---- packing format and reference (CPU, exact) ---------------------------------------------
@pytest.mark.parametrize("shape", [(5, 16), (3, 13), (9, 1)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dim", [0, 1], ids=["dim0", "dim1"])
def test_pack_unpack_round_trip(shape, dim):
    w_q = torch.randint(-8, 8, shape, dtype=torch.int8)
    packed = reference.pack_int4(w_q, dim=dim)
    assert torch.equal(reference.unpack_int4(packed, shape[dim], dim=dim), w_q)


def test_reference_matches_dequantize_then_matmul():
    x, w_packed, scales, zeros, _ = _problem(4, 24, 64, 32, False, torch.float32, "cpu")
    w = reference.int4_weight(w_packed, scales, zeros, 32, 64)
    got = reference.int4_gemm(x, w_packed, scales, zeros, group_size=32, k=64)
    assert torch.equal(got, x @ w.t())


# ---- kernel vs reference -------------------------------------------------------------------
# (M, N, K): decode and prefill M, ragged M and N (no multiple of 16 beyond 96), K = 384 is
# 3 x 128 and 1.5 x 256 (the K loop runs 3-12 tiles). Interpreter cost grows with programs x
# K tiles, so shapes stay small; big shapes are benchmarked on the GPU (scripts/).
SHAPES = [(1, 96, 256), (7, 80, 384), (33, 96, 256), (333, 40, 128)]


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group_size", [32, 64, 128], ids=lambda g: f"g{g}")
@pytest.mark.parametrize("mnk", SHAPES, ids=lambda s: "M{}-N{}-K{}".format(*s))
def test_int4_fp16(mnk, group_size, symmetric, device):
    _run(*mnk, group_size, symmetric, torch.float16, device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=DTYPE_IDS.get)
@pytest.mark.parametrize(
    "mnk", [(1, 96, 256), (33, 80, 384)], ids=lambda s: "M{}-N{}-K{}".format(*s)
)
def test_int4_other_dtypes(mnk, dtype, device):
    _run(*mnk, 64, False, dtype, device)


def _config_id(c) -> str:
    m = c.kwargs
    tile = f"{m['BLOCK_M']}x{m['BLOCK_N']}x{m['BLOCK_K']}"
    return f"{tile}-sk{m['SPLIT_K']}-w{c.num_warps}s{c.num_stages}"


def _all_configs():
    from compress.kernels import int4_gemm

    return [("gemm", c) for c in int4_gemm._configs("gemm")] + [
        ("decode", c) for c in int4_gemm._configs("decode")
    ]


@pytest.mark.parametrize(
    "path_config", _all_configs(), ids=lambda pc: f"{pc[0]}-{_config_id(pc[1])}"
)
def test_every_config(path_config, device):
    path, config = path_config
    m = 3 if path == "decode" else 70
    group_size = max(128, config.kwargs["BLOCK_K"])
    _run(m, 72, 256, group_size, False, torch.float16, device, config=config)


@pytest.mark.parametrize("split_k", [1, 3, 4, 8], ids=lambda s: f"split{s}")
def test_m1_split_k_ragged_splits(split_k, device):
    # K = 320 with BLOCK_K 32 is 10 K tiles: 3 and 4 splits are uneven, 8 leaves splits empty
    from compress.kernels.int4_gemm import _config

    _run(1, 64, 320, 32, True, torch.float16, device, config=_config(16, 32, 32, split_k, 4, 2))


def test_autotuned_default_path(device):
    # No config: the interpreter takes the first fitting entry, a GPU autotunes the list
    _run(20, 64, 256, 128, True, torch.float16, device)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="autotuning several configs needs CUDA")
def test_autotune_smoke():
    from compress.kernels import int4_gemm

    for m in (1, 300):
        x, w_packed, scales, zeros, expected = _problem(
            m, 256, 512, 128, False, torch.float16, "cuda"
        )
        y = int4_gemm.int4_gemm_triton(x, w_packed, scales, zeros, group_size=128)
        torch.testing.assert_close(y.cpu().double(), expected, **TOL[torch.float16])
