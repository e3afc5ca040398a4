"""Row blocks bound the temporaries of RTN codes, int4 packing and the RTN error sum (a
13B-sized linear's would be several times its size): the results must be the same as one
block over the whole weight, bit for bit, and the streamed RTN pass must hold one target
linear in float at a time, not the whole layer."""

from __future__ import annotations

import pytest
import torch

from compress.kernels import reference
from compress.quant import rtn
from compress.quant.linear import QuantLinear, WeightScheme, rtn_codes


@pytest.fixture
def tiny_blocks(monkeypatch):
    """Blocks of 96 elements: a few rows each, with a last partial block."""
    monkeypatch.setattr(reference, "ROW_BLOCK_ELEMENTS", 96)


SCHEMES = [(bits, True, grid) for bits in (4, 8) for grid in ("restricted", "full", "signed")]
SCHEMES += [(4, False, "restricted"), (8, False, "restricted")]  # other grids: symmetric only


@pytest.mark.parametrize(("n_bits", "symmetric", "grid"), SCHEMES)
def test_rtn_codes_in_blocks_equal_one_block(monkeypatch, n_bits, symmetric, grid):
    w = torch.randn(37, 64, generator=torch.Generator().manual_seed(n_bits)) * 0.03
    scheme = WeightScheme(n_bits=n_bits, group_size=16, symmetric=symmetric, grid=grid)
    monkeypatch.setattr(reference, "ROW_BLOCK_ELEMENTS", 1 << 40)
    whole = rtn_codes(w, scheme)
    monkeypatch.setattr(reference, "ROW_BLOCK_ELEMENTS", 96)
    blocked = rtn_codes(w, scheme)
    for a, b in zip(whole, blocked, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("k", [64, 60, 13])  # a multiple of 8, and padded rows
def test_pack_int4_in_blocks_equals_one_block(monkeypatch, k):
    gen = torch.Generator().manual_seed(k)
    w_q = torch.randint(-8, 8, (29, k), dtype=torch.int8, generator=gen)
    monkeypatch.setattr(reference, "ROW_BLOCK_ELEMENTS", 1 << 40)
    whole = reference.pack_int4(w_q)
    monkeypatch.setattr(reference, "ROW_BLOCK_ELEMENTS", 16)
    blocked = reference.pack_int4(w_q)
    assert torch.equal(whole, blocked)
    assert torch.equal(reference.unpack_int4(blocked, k), w_q)  # and it is still the format


def test_squared_error_in_blocks_matches_float64(tiny_blocks):
    lin = torch.nn.Linear(64, 41, bias=False)
    scheme = WeightScheme(n_bits=4, group_size=32, symmetric=False)
    quant = QuantLinear.from_linear(lin, scheme)
    num, den = rtn._squared_error(quant, lin.weight.detach())
    w = lin.weight.detach().double()
    dq = quant.dequantized_weight(torch.float64)
    assert num == pytest.approx(float((dq - w).pow(2).sum()), rel=1e-5)
    assert den == pytest.approx(float(w.pow(2).sum()), rel=1e-6)
