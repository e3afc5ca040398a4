"""Packing and quantization properties (hypothesis), and backend agreement with the reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compress.kernels import cpu_native, reference
from compress.quant import primitives as quant_primitives
from compress.quant.linear import QuantLinear, WeightScheme

shapes = st.tuples(st.integers(1, 24), st.integers(1, 70))


@settings(max_examples=60, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**16), dim=st.sampled_from([0, 1]),
       bits=st.sampled_from([4, 8]))
def test_pack_unpack_round_trip_is_exact(shape, seed, dim, bits):
    gen = torch.Generator().manual_seed(seed)
    w_q = torch.randint(-(1 << bits - 1), 1 << bits - 1, shape, generator=gen, dtype=torch.int8)
    pack, unpack = ((reference.pack_int4, reference.unpack_int4) if bits == 4 else
                    (reference.pack_int8, reference.unpack_int8))
    packed = pack(w_q, dim=dim)
    assert packed.dtype == torch.int32 and packed.shape[dim] == -(-shape[dim] * bits // 32)
    assert torch.equal(unpack(packed, shape[dim], dim=dim), w_q)


def test_int4_packing_matches_compressed_tensors_layout():
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    w_q = torch.randint(-8, 8, (9, 21), dtype=torch.int8)
    assert torch.equal(reference.pack_int4(w_q), ct.pack_to_int32(w_q, 4))
    assert torch.equal(reference.pack_int4(w_q, dim=0), ct.pack_to_int32(w_q, 4, packed_dim=0))


def test_int4_packing_known_value():
    # codes 0..7 offset by 8 -> nibbles 8..15, lowest nibble first: 0xFEDCBA98
    w_q = torch.arange(8, dtype=torch.int8).view(1, 8)
    assert reference.pack_int4(w_q).item() == 0xFEDCBA98 - 2**32


def test_int8_packing_matches_compressed_tensors_layout():
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    w_q = torch.randint(-128, 128, (9, 21), dtype=torch.int8)  # 21: a padded last word
    assert torch.equal(reference.pack_int8(w_q), ct.pack_to_int32(w_q, 8))
    assert torch.equal(reference.pack_int8(w_q, dim=0), ct.pack_to_int32(w_q, 8, packed_dim=0))
    assert torch.equal(ct.unpack_from_int32(reference.pack_int8(w_q), 8, w_q.shape), w_q)


def test_int8_packing_known_value():
    # codes -128, -1, 0, 127 offset by 128 -> bytes 0x00, 0x7F, 0x80, 0xFF, lowest byte first
    w_q = torch.tensor([[-128, -1, 0, 127]], dtype=torch.int8)
    assert reference.pack_int8(w_q).item() == 0xFF807F00 - 2**32


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 8),
    groups=st.integers(1, 4),
    group_size=st.sampled_from([8, 32, 64]),
    n_bits=st.sampled_from([4, 8]),
    symmetric=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rtn_error_within_half_a_step(n, groups, group_size, n_bits, symmetric, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, groups * group_size, generator=gen, dtype=torch.float64) * 0.05
    scales, zeros = quant_primitives.compute_qparams(
        w, n_bits=n_bits, group_size=group_size, symmetric=symmetric
    )
    w_q = quant_primitives.quantize(w, scales, zeros, n_bits=n_bits, group_size=group_size)
    qmin, qmax = quant_primitives.code_range(n_bits)
    assert int(w_q.min()) >= qmin and int(w_q.max()) <= qmax
    w_hat = reference.dequantize(w_q, scales, zeros, group_size, torch.float64)
    step = scales.to(torch.float64).repeat_interleave(group_size, dim=1)
    # the quantizer computes in float32 (w is rounded to it first): allow fp32 rounding of
    # w / scale, a few 1e-7 of a step (seen: 5e-7 at n=6, 8-bit asymmetric, seed 4096)
    assert torch.all((w_hat - w).abs() <= step / 2 * (1 + 1e-5))


def test_dequantize_matches_float64_formula():
    w_q = torch.randint(-8, 8, (4, 64), dtype=torch.int8)
    scales = torch.rand(4, 2, dtype=torch.float64) + 0.1
    zeros = torch.randint(-8, 8, (4, 2), dtype=torch.int8)
    expected = torch.empty(4, 64, dtype=torch.float64)
    for row in range(4):
        for col in range(64):
            g = col // 32
            expected[row, col] = (int(w_q[row, col]) - int(zeros[row, g])) * float(scales[row, g])
    got = reference.dequantize(w_q, scales, zeros, 32, torch.float64)
    assert torch.allclose(got, expected, rtol=1e-6, atol=0)


CPU_CASES = [
    pytest.param(4, 32, True, id="int4-g32-sym"),
    pytest.param(4, 64, False, id="int4-g64-asym"),
    pytest.param(4, 128, True, id="int4-g128-sym"),
    pytest.param(8, None, True, id="int8-channel"),
]


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_int4_unsigned_parts_rebuild_the_dequantized_weight(symmetric):
    # The kernels' common repacking input: (codes - 8 - zeros) * scales must be the weight.
    layer = QuantLinear.from_linear(
        torch.nn.Linear(64, 24, bias=False), WeightScheme(4, 32, symmetric), backend="reference"
    )
    zp = None if symmetric else layer.weight_zero_point
    codes, scales, zeros = reference.int4_unsigned_parts(
        layer.weight_packed, layer.weight_scale, zp, 64
    )
    assert codes.dtype == torch.int32 and int(codes.min()) >= 0 and int(codes.max()) <= 15
    w = (codes.double().view(24, 2, 32) - 8 - zeros.double().unsqueeze(-1)) * scales.double()[
        ..., None
    ]
    assert torch.equal(w.view(24, 64), layer.dequantized_weight(torch.float64))
    assert symmetric == bool((zeros == 0).all())


@pytest.mark.parametrize("n_bits,group_size,symmetric", CPU_CASES)
@pytest.mark.parametrize("m", [1, 5, 33])
def test_cpu_backend_agrees_with_reference(n_bits, group_size, symmetric, m):
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96, bias=True)
    scheme = WeightScheme(n_bits, group_size, symmetric)
    ref = QuantLinear.from_linear(linear, scheme, backend="reference")
    fast = QuantLinear.from_linear(linear, scheme, backend="cpu")
    x = torch.randn(m, 256)
    w_ref = ref.dequantized_weight(torch.float64)
    y_ref = torch.nn.functional.linear(x.double(), w_ref) + ref.bias.double()
    y_fast = fast(x)
    assert fast.resolved_backend(x.device) == "cpu"
    # bf16 activations inside the native kernels: error ~ 2^-8 relative per product.
    tol = 2e-2 * y_ref.abs().max().item()
    assert torch.allclose(y_fast.double(), y_ref, atol=tol, rtol=0)
    assert torch.allclose(ref(x).double(), y_ref, atol=1e-4, rtol=1e-4)


def test_auto_backend_falls_back_to_reference_for_unsupported_shape():
    linear = torch.nn.Linear(64, 24)  # N=24 is not a multiple of 16 for the int4 CPU kernel
    layer = QuantLinear.from_linear(linear, WeightScheme(4, 32, True))
    assert cpu_native.int4_unsupported_reason(24, 64, 32) is not None
    assert layer.resolved_backend(torch.device("cpu")) == "reference"


def test_forced_cpu_backend_on_unsupported_shape_raises():
    from compress.core.errors import KernelConstraintError

    layer = QuantLinear.from_linear(
        torch.nn.Linear(64, 24), WeightScheme(4, 32, True), backend="cpu"
    )
    with pytest.raises(KernelConstraintError, match="N=24"):
        layer(torch.randn(2, 64))
