"""The calibrated passes' C++ loops (``compress/kernels/cpu_gptq.py``) against the torch code
they replace: GPTQ's column walk (``walk="cpu"`` against ``walk="torch"`` through
``gptq_quantize``: the same codes up to rounding ties, scales, zero points and loss) and the
int4 dequantization (bit-equal to ``reference.dequantize`` of the unpacked codes)."""

from __future__ import annotations

import pytest
import torch

from compress.kernels import cpu_gptq, reference
from compress.quant.gptq import GptqConfig, gptq_quantize
from compress.quant.linear import QuantLinear, WeightScheme
from tests.kernels.gptq_cases import CASES, assert_same_as_the_torch_walk, problem

_REASON = cpu_gptq.unavailable_reason(torch.device("cpu"))
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"C++ CPU ops: {_REASON}")

# the walks' shared cases and more rows than one thread's share
CASES = [*CASES, (301, 512, 128, False, False, 4)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_the_cpu_walk_matches_the_torch_walk(case):
    n, k, group, symmetric, act_order, bits = case
    w, h = problem(n, k)
    scheme = WeightScheme(bits, group, symmetric=symmetric)
    cfg = GptqConfig(act_order=act_order)
    ref = gptq_quantize(w, h, scheme, cfg, walk="torch")
    assert_same_as_the_torch_walk(gptq_quantize(w, h, scheme, cfg, walk="cpu"), ref)


def test_auto_walks_in_cpp_on_a_cpu_and_the_walk_is_the_same_on_any_thread_count():
    w, h = problem(64, 256)
    scheme = WeightScheme(4, 32, symmetric=False)
    auto = gptq_quantize(w, h, scheme, GptqConfig())
    cpu = gptq_quantize(w, h, scheme, GptqConfig(), walk="cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = gptq_quantize(w, h, scheme, GptqConfig(), walk="cpu")
    finally:
        torch.set_num_threads(threads)
    for a, b, c in zip(auto[:3], cpu[:3], one[:3], strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)  # rows are independent: no reordering


@pytest.mark.parametrize("n,k,group,symmetric", [(40, 256, 32, False), (33, 384, 128, True),
                                                 (17, 200, 200, False), (64, 4096, 128, False)])
def test_int4_dequantization_is_bit_equal_to_the_reference(n, k, group, symmetric):
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=g) + 0.01
    zeros = None if symmetric else torch.randint(-8, 8, (n, k // group), generator=g,
                                                 dtype=torch.int8)
    packed_zeros = None if zeros is None else reference.pack_int4(zeros.t().contiguous()).t()
    want = reference.dequantize(codes, scales, zeros, group)
    got = cpu_gptq.dequantize_int4(reference.pack_int4(codes), scales, packed_zeros, k, group)
    assert torch.equal(got, want)


def test_a_quant_linear_dequantizes_bit_equal_through_either_path(monkeypatch):
    from compress.quant import linear

    torch.manual_seed(0)
    layer = QuantLinear.from_linear(torch.nn.Linear(96, 40), WeightScheme(4, 32, symmetric=False))
    fast = layer.dequantized_weight()
    monkeypatch.setattr(linear, "_exact_int4_on", lambda device: False)
    assert torch.equal(fast, layer.dequantized_weight())
    w_q, zeros = layer.codes()
    assert torch.equal(fast, reference.dequantize(w_q, layer.weight_scale, zeros, 32))


def test_bad_arguments_are_refused_not_written_out_of_bounds():
    w, h = torch.zeros(4, 8), torch.eye(8)
    scales, codes = torch.ones(4, 1), torch.zeros(4, 8, dtype=torch.int8)
    err, losses = torch.zeros(4, 8), torch.zeros(4)
    cols = torch.arange(8, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="outside codes or scales"):
        cpu_gptq.walk(w, h, scales, None, codes, err, losses, cols + 1, cols * 0, 0, 8, -8, 7)
    with pytest.raises(RuntimeError, match="columns 0..9 outside"):
        cpu_gptq.walk(w, h, scales, None, codes, err, losses, cols, cols * 0, 0, 9, -8, 7)
    with pytest.raises(RuntimeError, match="multiple of the group"):
        cpu_gptq.dequantize_int4(torch.zeros(4, 1, dtype=torch.int32), scales, None, 8, 3)
