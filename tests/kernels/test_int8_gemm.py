"""int8 Triton kernels (W8A8, per-token quantization, W8A16) vs. the references.

Same conventions as test_int4_gemm.py: NaN-filled outputs, NaN-padded inputs, float64
expectations, interpreter on CPU or CUDA when present.
"""

from __future__ import annotations

import pytest
import torch

from compress.kernels import reference

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

# W8A16 rounds nothing but x (given) and the output; W8A8's integer sum is exact, so its fp32
# output only differs by the order of the two scale multiplications (and split-K atomics).
TOL = {
    torch.float16: {"atol": 2e-2, "rtol": 1e-2},
    torch.bfloat16: {"atol": 1.5e-1, "rtol": 2e-2},
    torch.float32: {"atol": 1e-4, "rtol": 1e-5},
}
DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
SHAPES = [(1, 96, 200), (7, 80, 256), (33, 48, 512), (130, 40, 96)]  # K=200, 96: ragged K
SHAPE_ID = "M{}-N{}-K{}".format


def _padded(t: torch.Tensor, fill) -> torch.Tensor:
    buf = torch.full((t.numel() + 64,), fill, dtype=t.dtype, device=t.device)
    buf[: t.numel()] = t.reshape(-1)
    return buf[: t.numel()].view(t.shape)


def _nan_out(m, n, dtype, device):
    return torch.full((m, n), float("nan"), dtype=dtype, device=device)


# ---- fused per-token quantization ----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("mk", [(1, 200), (9, 4100)], ids=lambda s: f"M{s[0]}-K{s[1]}")
def test_quantize_per_token_is_exact(mk, dtype, device):
    from compress.kernels import int8_gemm

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(*mk, generator=g) * 3).to(dtype)
    x[0, :7] = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 127.0])  # ties and the max
    if mk[0] > 1:
        x[1] = 0  # an all-zero row keeps scale 1
    x_q, x_scales = int8_gemm.quantize_per_token_triton(_padded(x.to(device), float("nan")))
    ref_q, ref_scales = reference.quantize_per_token_int8(x)
    assert torch.equal(x_scales.cpu(), ref_scales)
    assert torch.equal(x_q.cpu(), ref_q)


# ---- W8A8 ---------------------------------------------------------------------------------
def _w8a8_problem(m, n, k, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x_q = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    x_scales = torch.rand(m, 1, generator=g) * 0.05 + 0.01
    w_q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    w_scales = (torch.rand(n, 1, generator=g) * 0.002 + 0.001).to(torch.float16)
    expected = (x_q.double() @ w_q.double().t()) * x_scales.double() * w_scales.double().t()
    tensors = [_padded(t.to(device), 0) for t in (x_q, x_scales, w_q, w_scales)]
    return tensors, expected


@pytest.mark.parametrize("mnk", SHAPES, ids=lambda s: SHAPE_ID(*s))
def test_int8_int8_gemm(mnk, device):
    from compress.kernels import int8_gemm

    (x_q, x_scales, w_q, w_scales), expected = _w8a8_problem(*mnk, device)
    out = _nan_out(mnk[0], mnk[1], torch.float32, device)
    y = int8_gemm.int8_int8_gemm_triton(x_q, x_scales, w_q, w_scales, out=out)
    torch.testing.assert_close(y.cpu().double(), expected, **TOL[torch.float32])


def test_int8_int8_gemm_matches_reference_exactly_on_integers(device):
    # unit scales: the kernel must reproduce the integer sum bit for bit (int32 accumulation)
    from compress.kernels import int8_gemm

    (x_q, _, w_q, _), _ = _w8a8_problem(20, 40, 512, device)
    ones_x = torch.ones(20, 1, device=device)
    ones_w = torch.ones(40, 1, device=device)
    y = int8_gemm.int8_int8_gemm_triton(x_q, ones_x, w_q, ones_w)
    assert torch.equal(
        y.cpu(), reference.int8_int8_gemm(x_q.cpu(), ones_x.cpu(), w_q.cpu(), ones_w.cpu())
    )


# ---- W8A16 --------------------------------------------------------------------------------
def _w8a16(m, n, k, n_groups, symmetric, dtype, device, config=None):
    from compress.kernels import int8_gemm

    g = torch.Generator().manual_seed(2)
    x = torch.randn(m, k, generator=g).to(dtype)
    w_q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, n_groups, generator=g) * 0.002 + 0.001).to(torch.float16)
    zeros = (
        None if symmetric else torch.randint(-30, 30, (n, n_groups), generator=g, dtype=torch.int8)
    )
    expected = (
        x.double() @ reference.dequantize(w_q, scales, zeros, k // n_groups, torch.float64).t()
    )
    args = [_padded(x.to(device), float("nan")), _padded(w_q.to(device), 0),
            _padded(scales.to(device), float("nan"))]  # fmt: skip
    args.append(None if zeros is None else _padded(zeros.to(device), 0))
    out = _nan_out(m, n, dtype, device)
    y = int8_gemm.int8_weight_gemm_triton(*args, config=config, out=out)
    torch.testing.assert_close(y.cpu().double(), expected, **TOL[dtype])


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("mnk", SHAPES, ids=lambda s: SHAPE_ID(*s))
def test_int8_weight_gemm_per_channel(mnk, symmetric, device):
    _w8a16(*mnk, 1, symmetric, torch.float16, device)


@pytest.mark.parametrize("group_size", [32, 64, 128], ids=lambda g: f"g{g}")
@pytest.mark.parametrize("mnk", [(1, 64, 256), (33, 72, 384)], ids=lambda s: SHAPE_ID(*s))
def test_int8_weight_gemm_grouped(mnk, group_size, device):
    if mnk[2] % group_size:
        pytest.skip("K not divisible by the group")
    _w8a16(*mnk, mnk[2] // group_size, False, torch.float16, device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=DTYPE_IDS.get)
def test_int8_weight_gemm_other_dtypes(dtype, device):
    _w8a16(5, 48, 256, 1, False, dtype, device)
    _w8a16(40, 48, 256, 4, True, dtype, device)


def _all_configs():
    from compress.kernels import int8_gemm

    return [("gemm", c) for c in int8_gemm._configs("gemm")] + [
        ("decode", c) for c in int8_gemm._configs("decode")
    ]


def _config_id(pc) -> str:
    path, c = pc
    m = c.kwargs
    return f"{path}-{m['BLOCK_M']}x{m['BLOCK_N']}x{m['BLOCK_K']}-sk{m['SPLIT_K']}"


@pytest.mark.parametrize("path_config", _all_configs(), ids=_config_id)
def test_every_config_w8a8(path_config, device):
    from compress.kernels import int8_gemm

    path, config = path_config
    m = 3 if path == "decode" else 70
    (x_q, x_scales, w_q, w_scales), expected = _w8a8_problem(m, 72, 200, device)
    out = _nan_out(m, 72, torch.float32, device)
    y = int8_gemm.int8_int8_gemm_triton(x_q, x_scales, w_q, w_scales, config=config, out=out)
    torch.testing.assert_close(y.cpu().double(), expected, **TOL[torch.float32])
