"""The AVX2 Q4 x Q8 CPU kernel: its layout holds our int4 weights exactly, the compiled op
equals a float64 plain-torch model of the same arithmetic, and that model is within int8
activation rounding of the exact product (so the rounding is really there and bounded)."""

from __future__ import annotations

import pytest
import torch

from compress.kernels import cpu_avx2
from compress.quant.linear import QuantLinear, WeightScheme


def quant_layer(n: int, k: int, group: int, symmetric: bool, seed: int = 0) -> QuantLinear:
    torch.manual_seed(seed)
    return QuantLinear.from_linear(
        torch.nn.Linear(k, n, bias=False), WeightScheme(4, group, symmetric)
    )


def avx2_weight(layer: QuantLinear) -> cpu_avx2.Int4Q8Weight:
    zp = None if layer.scheme.symmetric else layer.weight_zero_point
    return cpu_avx2.prepack(
        layer.weight_packed,
        layer.weight_scale,
        zp,
        group_size=layer.group_size,
        k=layer.in_features,
    )


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_prepacked_layout_dequantizes_to_the_same_weights(symmetric):
    layer = quant_layer(48, 192, 64, symmetric)
    w = avx2_weight(layer)
    c = w.codes.view(48, 192 // 32, 16)
    q = torch.cat([c & 0xF, c >> 4], dim=-1).reshape(48, 192).double()
    scales = w.scales.double().repeat_interleave(64, dim=1)
    offsets = w.offsets.double().repeat_interleave(64, dim=1)
    expected = layer.dequantized_weight().double()
    assert torch.allclose(q * scales + offsets, expected, atol=1e-6, rtol=0)


def test_reference_is_the_exact_product_up_to_int8_activation_rounding():
    layer = quant_layer(64, 576, 64, True)
    x = torch.randn(3, 576)
    exact = x.double() @ layer.dequantized_weight().double().T
    approx = cpu_avx2.int4_linear_q8_reference(x, avx2_weight(layer))
    rel = ((approx - exact).norm() / exact.norm()).item()
    # half an int8 step per element of a gaussian block: ~0.5-1% of the output's norm
    assert 1e-4 < rel < 2e-2


def test_all_zero_activation_block_gives_zero_not_nan():
    layer = quant_layer(16, 64, 32, False)
    x = torch.zeros(1, 64)
    x[0, 40] = 3.0  # second block non-zero, first all zeros
    y = cpu_avx2.int4_linear_q8_reference(x, avx2_weight(layer))
    exact = x.double() @ layer.dequantized_weight().double().T
    assert torch.allclose(y, exact, atol=1e-5)  # one non-zero per block rounds exactly


def test_unsupported_shapes_are_named():
    assert "multiple of 32" in cpu_avx2.unsupported_reason(16, 96, 48)
    assert "not divisible" in cpu_avx2.unsupported_reason(16, 96, 64)
    layer = quant_layer(16, 96, 32, True)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_avx2.prepack(layer.weight_packed, layer.weight_scale, None, group_size=48, k=96)


@pytest.fixture(scope="module")
def built():
    reason = cpu_avx2.unavailable_reason()  # ~1 minute to compile on first use
    if reason is not None:
        pytest.skip(f"AVX2 kernel not available here: {reason}")


@pytest.mark.parametrize(
    "n,k,group,symmetric,m",
    [
        (64, 576, 64, True, 1),  # SmolLM2 q_proj-like, one decode row
        (48, 576, 32, False, 3),  # asymmetric, a small batch
        (32, 1536, 128, True, 5),  # down_proj-like K; rows in chunks of 4 and 1
        (16, 96, 32, True, 1),  # odd number of blocks (the kernel's tail)
    ],
)
def test_kernel_equals_float64_reference(built, n, k, group, symmetric, m):
    layer = quant_layer(n, k, group, symmetric, seed=n + k)
    w = avx2_weight(layer)
    x = torch.randn(m, k) * torch.linspace(0.1, 4.0, k)  # blocks of different scales
    y = cpu_avx2.int4_linear_q8(x, w)
    ref = cpu_avx2.int4_linear_q8_reference(x, w)
    assert y.shape == (m, n) and y.dtype == torch.float32
    # integer block dots are exact; only fp32 scaling/accumulation order differs
    assert torch.allclose(y.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=0)


def test_kernel_keeps_leading_dims_and_dtype(built):
    layer = quant_layer(32, 64, 32, True)
    w = avx2_weight(layer)
    x = torch.randn(2, 1, 64, dtype=torch.bfloat16)
    y = cpu_avx2.int4_linear_q8(x, w)
    assert y.shape == (2, 1, 32) and y.dtype == torch.bfloat16
    ref = cpu_avx2.int4_linear_q8_reference(x.reshape(2, 64), w)
    assert torch.allclose(y.reshape(2, 32).double(), ref, atol=2e-2 * ref.abs().max().item())
