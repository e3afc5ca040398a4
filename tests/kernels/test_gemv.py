"""The split-K GEMV (decode, M <= 4) against the plain-PyTorch references, and its errors.

Under TRITON_INTERPRET=1 on CPU when there is no GPU (tests/kernels/conftest.py). Every case
passes ``config=`` (no tuning); one test per op runs ``config=None`` (first valid candidate).
"""

from __future__ import annotations

import pytest
import torch

from compress.kernels import KernelConstraintError, reference

triton = pytest.importorskip("triton")

# relative to the output's magnitude (|x| @ |W|^T): fp32 sums in another order, then rounding
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# (N, K, group): K not a multiple of 64 or 128, N not a multiple of any BLOCK_N, per channel
INT4_SHAPES = [(48, 96, 32), (33, 192, 64), (40, 256, 128), (100, 576, 64), (24, 80, 80)]


def _gemv_configs():
    from compress.kernels import gemv

    return {
        "bn32-bk16-split4": gemv.gemv_config(32, 16, 4, 1, 1),
        "bn64-bk32-split1": gemv.gemv_config(64, 32, 1, 2, 2),
        "bn16-bk64-split3": gemv.gemv_config(16, 64, 3, 1, 1),
    }


def _close(y, expected, magnitude, dtype):
    assert y.dtype == dtype and y.shape == expected.shape
    error = (y.cpu().double() - expected.double()).abs()
    bound = TOLERANCE[dtype] * (magnitude.double() + 1e-3)
    assert (error <= bound).all(), f"max error {error.max():.3g}"


def _int4_case(m, n, k, group, symmetric, bias, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    codes = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    w_packed = reference.pack_int4(codes)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 0.005).to(dtype)
    zeros = None
    if not symmetric:
        zeros = reference.pack_int4(
            torch.randint(-8, 8, (n, k // group), generator=g, dtype=torch.int8), dim=0
        )
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    w = reference.int4_weight(w_packed, scales, zeros, group, k)  # [N, K] fp32
    expected = x.float() @ w.t() + (0 if b is None else b.float())
    magnitude = x.float().abs() @ w.abs().t()
    return (x, w_packed, scales, zeros, b), expected, magnitude


@pytest.mark.parametrize("config", ["bn32-bk16-split4", "bn64-bk32-split1", "bn16-bk64-split3"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("shape", INT4_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("m", [1, 2, 3, 4], ids=lambda m: f"M{m}")
def test_int4_gemv_matches_the_reference(m, shape, symmetric, config, device):
    from compress.kernels import gemv

    n, k, group = shape
    c = _gemv_configs()[config]
    if group != k and group % c.kwargs["BLOCK_K"]:
        pytest.skip("BLOCK_K does not divide the group (the launcher refuses it)")
    args, expected, magnitude = _int4_case(m, n, k, group, symmetric, m % 2 == 0, torch.float16)
    args = [None if t is None else t.to(device) for t in args]
    y = gemv.int4_gemv_triton(*args[:4], group_size=group, bias=args[4], config=c)
    _close(y, expected, magnitude, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int4_gemv_dtypes_and_default_config(dtype, device):
    from compress.kernels import gemv

    args, expected, magnitude = _int4_case(2, 40, 256, 128, False, True, dtype)
    args = [None if t is None else t.to(device) for t in args]
    y = gemv.int4_gemv_triton(*args[:4], group_size=128, bias=args[4])
    _close(y, expected, magnitude, dtype)


def _int8_case(m, n, k, groups, symmetric, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w_q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, groups, generator=g) * 0.01 + 0.001).to(dtype)
    zeros = None if symmetric else torch.randint(-20, 20, (n, groups), generator=g).to(torch.int8)
    w = reference.dequantize(w_q, scales, zeros, k // groups)
    return (x, w_q, scales, zeros), x.float() @ w.t(), x.float().abs() @ w.abs().t()


@pytest.mark.parametrize("config", ["bn32-bk16-split4", "bn64-bk32-split1"])
@pytest.mark.parametrize(
    ("n", "k", "groups", "symmetric"),
    [(40, 200, 1, True), (33, 96, 1, False), (48, 256, 4, True), (24, 192, 3, False)],
    ids=["per-channel-K200", "per-channel-asym", "g64", "g64-asym"],
)
@pytest.mark.parametrize("m", [1, 2, 4], ids=lambda m: f"M{m}")
def test_int8_gemv_matches_the_reference(m, n, k, groups, symmetric, config, device):
    from compress.kernels import gemv

    args, expected, magnitude = _int8_case(m, n, k, groups, symmetric, torch.float16)
    y = gemv.int8_gemv_triton(*[None if t is None else t.to(device) for t in args],
                              config=_gemv_configs()[config])  # fmt: skip
    _close(y, expected, magnitude, torch.float16)


@pytest.mark.parametrize("config", ["bn32-bk16-split4", "bn64-bk32-split1", None])
@pytest.mark.parametrize("m", [1, 3, 4], ids=lambda m: f"M{m}")
def test_int8_int8_gemv_equals_the_reference_bit_for_bit(m, config, device):
    """int32 partials summed exactly, then (acc * sx) * sw in the reference's order."""
    from compress.kernels import gemv

    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 200, generator=g)
    w_q = torch.randint(-127, 128, (40, 200), generator=g, dtype=torch.int8)
    w_scales = (torch.rand(40, 1, generator=g) * 0.01).to(torch.float16)
    x_q, x_scales = reference.quantize_per_token_int8(x)
    c = None if config is None else _gemv_configs()[config]
    y = gemv.int8_int8_gemv_triton(
        x_q.to(device), x_scales.to(device), w_q.to(device), w_scales.to(device), config=c
    )
    assert torch.equal(y.cpu(), reference.int8_int8_gemm(x_q, x_scales, w_q, w_scales))


def test_gemv_bad_input_raises(device):
    from compress.kernels import gemv

    (x, w, s, _z, _b), _, _ = _int4_case(5, 32, 128, 32, True, False, torch.float16)
    x, w, s = x.to(device), w.to(device), s.to(device)
    with pytest.raises(KernelConstraintError, match="1..4 rows"):
        gemv.int4_gemv_triton(x, w, s, None, group_size=32)
    with pytest.raises(KernelConstraintError, match="BLOCK_K=64 must be >= 8 and divide"):
        gemv.int4_gemv_triton(x[:2], w, s, None, group_size=32,
                              config=gemv.gemv_config(32, 64, 1, 1, 1))  # fmt: skip
    with pytest.raises(KernelConstraintError, match=r"scales .*expected shape \(32, 4\)"):
        gemv.int4_gemv_triton(x[:2], w, s[:, :2].contiguous(), None, group_size=32)
    with pytest.raises(KernelConstraintError, match="bias"):
        gemv.int4_gemv_triton(x[:2], w, s, None, group_size=32, bias=s[:, 0].contiguous()[:16])


def test_valid_configs_keep_block_k_inside_a_group_and_splits_inside_k():
    from compress.kernels import gemv

    valid = gemv.valid_configs(gemv._configs(), m=4, n=4096, k=4096, group_size=32,
                               min_block_k=8)  # fmt: skip
    assert valid and all(32 % c.kwargs["BLOCK_K"] == 0 for c in valid)
    per_channel = gemv.valid_configs(gemv._configs(), m=1, n=64, k=80, group_size=80,
                                     min_block_k=16)  # fmt: skip
    assert per_channel and all(c.kwargs["SPLIT_K"] <= -(-80 // c.kwargs["BLOCK_K"])
                               for c in per_channel)  # fmt: skip


@pytest.mark.parametrize("m", [1, 2, 4], ids=lambda m: f"M{m}")
def test_a_short_k_still_has_configs_with_one_split_per_k_tile(m, device):
    """K = 64 with groups of 32 (a tiny model's hidden size): every candidate split more than
    K has tiles, and the tuner had none to pick (IndexError); the splits are now cut to fit."""
    from compress.kernels import gemv

    valid = gemv.valid_configs(gemv._configs(), m=m, n=64, k=64, group_size=32, min_block_k=8)
    assert valid and all(c.kwargs["SPLIT_K"] <= 64 // c.kwargs["BLOCK_K"] for c in valid)
    (x, w_packed, scales, zeros, b), expected, magnitude = _int4_case(
        m, 64, 64, 32, True, False, torch.float32
    )
    args = [t if t is None else t.to(device) for t in (x, w_packed, scales, zeros)]
    y = gemv.int4_gemv_triton(*args, group_size=32, config=None)
    _close(y, expected, magnitude, torch.float32)


def test_a_tuned_shape_skips_the_candidate_filter(monkeypatch, device):
    """Once a (kernel, shape, M bucket) has its config, a call is one dict lookup: the
    candidate list is not rebuilt and filtered per call (Python on the decode hot path)."""
    from compress.kernels import gemv

    (x, w_packed, scales, zeros, b), expected, magnitude = _int4_case(
        1, 64, 128, 32, True, False, torch.float32
    )
    args = [t if t is None else t.to(device) for t in (x, w_packed, scales, zeros)]
    flags = {"GROUP_SIZE": 32, "HAS_ZEROS": False, "HAS_BIAS": False}  # int4_gemv_triton's
    key = gemv._problem_key("int4", args[0], 64, 32, flags)
    monkeypatch.setitem(gemv._TUNED, key, gemv.gemv_config(32, 16, 4, 1, 1))

    def rebuilt(*a, **k):
        raise AssertionError("valid_configs ran for a tuned shape")

    monkeypatch.setattr(gemv, "valid_configs", rebuilt)
    y = gemv.int4_gemv_triton(*args, group_size=32, config=None)
    _close(y, expected, magnitude, torch.float32)
