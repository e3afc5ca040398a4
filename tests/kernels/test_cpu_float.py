"""``bf16_weight_linear`` (``compress/kernels/cpu_float.py``), every ISA level this CPU builds,
against float64 products of the same bf16 weights, and the rule that picks it."""

from __future__ import annotations

import pytest
import torch

from compress.kernels import cpu_float


def _op(isa):
    return getattr(torch.ops, f"compress_{isa}").bf16_weight_linear


def _check(got, x, w):
    want = x.double() @ w.double().T
    # fp32 sums of K products: the error bound grows with the sum of their magnitudes
    bound = (x.double().abs() @ w.double().abs().T) * (x.shape[1] + 8) * 2.0**-24
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert ((got.double() - want).abs() <= bound + 1e-30).all()


# rows: one, the row-tile sizes and their remainders, and the blocked form's (from 24 rows:
# tiles of 6 rows, passes of 96); columns: whole vector steps (8 and 16 lanes), remainders,
# fewer than one vector, more than one K block of the blocked form (256) with a remainder;
# outputs not multiples of the column tiles or panels (16 and 32)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 23, 24, 29, 97])
@pytest.mark.parametrize(
    "k,n", [(576, 100), (600, 37), (64, 13), (40, 7), (17, 9), (5, 3), (1, 1)]
)
def test_bf16_weight_linear_matches_float64(isa, m, k, n):
    g = torch.Generator().manual_seed(m * 1000 + k * 10 + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).bfloat16()
    _check(_op(isa)(x, w), x, w)


def test_bf16_weight_linear_threads_over_large_calls(isa):
    """Past the one-thread size: runs of columns claimed by both threads, the last one short
    (and, in the blocked form, blocks of 96 rows, the last one short)."""
    g = torch.Generator().manual_seed(1)
    for m in (1, 6, 30, 200):
        x = torch.randn(m, 576, generator=g)
        w = torch.randn(5001, 576, generator=g).bfloat16()
        _check(_op(isa)(x, w), x, w)


def test_bf16_input_is_widened_exactly(isa):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 96, generator=g).bfloat16()
    w = torch.randn(24, 96, generator=g).bfloat16()
    got = _op(isa)(x, w)
    assert torch.equal(got, _op(isa)(x.float(), w))
    _check(got, x, w)


@pytest.mark.parametrize("m", [2, 30])  # both forms
def test_nan_and_inf_propagate(isa, m):
    x = torch.ones(m, 48)
    x[0, 47] = float("nan")  # in the scalar tail of no level (48 = 3 x 16)
    x[1, 3] = float("inf")
    w = torch.ones(5, 48).bfloat16()
    got = _op(isa)(x, w)
    assert got[0].isnan().all() and (got[1] == float("inf")).all()
    assert torch.equal(got[2:], torch.full((m - 2, 5), 48.0))


def test_empty_shapes(isa):
    w = torch.ones(3, 0).bfloat16()
    assert torch.equal(_op(isa)(torch.ones(2, 0), w), torch.zeros(2, 3))
    assert _op(isa)(torch.ones(0, 8), torch.ones(3, 8).bfloat16()).shape == (0, 3)


@pytest.mark.parametrize("x,w,match", [
    (torch.ones(2, 8), torch.ones(3, 8), "bf16"),
    (torch.ones(2, 8, dtype=torch.float64), torch.ones(3, 8).bfloat16(), "fp32 or bf16"),
    (torch.ones(2, 8), torch.ones(3, 9).bfloat16(), "columns"),
    (torch.ones(2, 8), torch.ones(8, 3).bfloat16().T, "contiguous"),
    (torch.ones(8), torch.ones(3, 8).bfloat16(), r"\[M, K\]"),
])
def test_bad_arguments_are_refused(isa, x, w, match):
    with pytest.raises(RuntimeError, match=match):
        _op(isa)(x, w)


def test_wrapper_keeps_leading_dimensions(isa):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 64, generator=g)
    w = torch.randn(10, 64, generator=g).bfloat16()
    got = cpu_float.bf16_weight_linear(x, w)
    assert got.shape == (2, 3, 10)
    torch.testing.assert_close(got, cpu_float.bf16_weight_linear_reference(x, w))


def test_bf16_exact_reads_the_low_bits(monkeypatch):
    exact = torch.randn(1000).bfloat16().float()
    assert cpu_float.bf16_exact(exact)
    assert cpu_float.bf16_exact(torch.tensor([0.0, -0.0, float("inf"), 1.5]))
    assert cpu_float.bf16_exact(torch.zeros(0))
    near = exact.clone()
    near[999] = torch.nextafter(near[999], torch.tensor(10.0))  # one fp32 ulp off
    assert not cpu_float.bf16_exact(near)
    monkeypatch.setattr(cpu_float, "_EXACT_CHUNK_ELEMENTS", 7)  # the last chunk checked too
    assert not cpu_float.bf16_exact(near) and cpu_float.bf16_exact(exact)
    assert not cpu_float.bf16_exact(exact.bfloat16())  # only fp32 tensors are asked about
    assert cpu_float.bf16_exact(exact.view(10, 100).T)  # any strides


def test_holds_bf16_copy_only_without_bf16_matmuls(monkeypatch):
    if cpu_float.unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip(f"our kernels do not build here: "
                    f"{cpu_float.unavailable_reason(torch.device('cpu'))}")
    exact = torch.randn(4, 8).bfloat16().float()
    monkeypatch.setattr(cpu_float, "cpu_bf16_matmuls", lambda: False)
    assert cpu_float.holds_bf16_copy(exact)  # fp32 of bf16 values: lossless
    assert cpu_float.holds_bf16_copy(exact.bfloat16())
    assert not cpu_float.holds_bf16_copy(torch.randn(4, 8))  # would round
    assert not cpu_float.holds_bf16_copy(exact.double())
    assert not cpu_float.holds_bf16_copy(exact.half())
    monkeypatch.setattr(cpu_float, "cpu_bf16_matmuls", lambda: True)
    assert not cpu_float.holds_bf16_copy(exact.bfloat16())
    assert not cpu_float.holds_bf16_copy(exact)
