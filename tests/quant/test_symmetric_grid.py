"""The three symmetric int grids: ``restricted`` (amax / 7 at 4 bits, code -8 unused), ``full``
(amax / 7.5, every code used, the compressed-tensors / AutoGPTQ convention) and ``signed``
(+-amax / 8, the largest magnitude exactly on code -8: llama.cpp's and auto-round's)."""

from __future__ import annotations

import pytest
import torch

from compress.core.errors import RecipeError
from compress.core.registry import run_passes
from compress.quant import primitives as quant_primitives
from compress.quant.gptq import GptqConfig
from compress.quant.rtn import Int4RtnConfig
from compress.recipe import parse_recipe
from compress.testing import make_tiny_llama
from tests.quant.quant_helpers import tiny_state


@pytest.mark.parametrize("n_bits", [4, 8])
def test_full_grid_against_float64(n_bits):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    scales, zeros = quant_primitives.compute_qparams(
        w, n_bits=n_bits, group_size=64, symmetric=True, grid="full"
    )
    amax = w.double().reshape(64, 4, 64).abs().amax(-1)
    torch.testing.assert_close(scales.double(), amax / ((2**n_bits - 1) / 2))
    assert zeros is None
    codes = quant_primitives.quantize(w, scales, None, n_bits=n_bits, group_size=64)
    assert int(codes.min()) == -(2 ** (n_bits - 1)) and int(codes.max()) == 2 ** (n_bits - 1) - 1
    deq = (codes.double().reshape(64, 4, 64) * scales.double().unsqueeze(-1)).reshape(64, 256)
    err = (deq - w.double()).abs().reshape(64, 4, 64).amax(-1)
    assert bool((err <= scales.double() / 2 + 1e-6).all())  # clipping at +7 stays within scale/2


@pytest.mark.parametrize("n_bits", [4, 8])
def test_signed_grid_against_float64(n_bits):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(2)).double()
    w[0, :64] = 0.0  # an all-zero group: scale 1, codes 0
    scales, zeros = quant_primitives.compute_qparams(
        w, n_bits=n_bits, group_size=64, symmetric=True, grid="signed"
    )
    groups = w.reshape(64, 4, 64)
    wmax, wmin = groups.amax(-1).clamp(min=0), groups.amin(-1).clamp(max=0)
    # the larger magnitude over 2**(b-1), negative when it is the positive side (ties: negative)
    expected = torch.where(wmax < -wmin, -wmin, -wmax) / 2 ** (n_bits - 1)
    expected[0, 0] = 1.0
    torch.testing.assert_close(scales.double(), expected, rtol=1e-6, atol=0)
    assert zeros is None and bool((scales < 0).any()) and bool((scales[1:] > 0).any())
    codes = quant_primitives.quantize(w, scales, None, n_bits=n_bits, group_size=64)
    extreme = groups.abs().argmax(-1, keepdim=True)  # lands on the lowest code, exactly
    picked = codes.reshape(64, 4, 64).gather(-1, extreme)[1:]
    assert bool((picked == -(2 ** (n_bits - 1))).all())
    deq = (codes.double().reshape(64, 4, 64) * scales.double().unsqueeze(-1)).reshape(64, 256)
    err = (deq - w).abs().reshape(64, 4, 64).amax(-1)
    assert bool((err <= scales.double().abs() + 1e-9).all())  # at most one step (the clip)


def test_finer_grids_have_lower_rtn_error():
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(1))
    errors = {
        grid: float(
            (quant_primitives.fake_quantize(w, n_bits=4, group_size=64, symmetric=True,
                                            grid=grid) - w).pow(2).mean()
        )
        for grid in quant_primitives.GRIDS
    }
    assert errors["full"] < 0.95 * errors["restricted"]  # step 7/7.5 finer: ~13% less
    assert errors["signed"] < errors["full"], errors  # step 7.5/8 finer, rare one-step clips
    with pytest.raises(ValueError, match="grid 'wide'"):
        quant_primitives.compute_qparams(w, n_bits=4, group_size=64, symmetric=True, grid="wide")


def test_recipe_field_reaches_the_layers():
    with pytest.raises(RecipeError, match="symmetric_grid"):
        parse_recipe({"passes": [{"pass": "quantize.int4_rtn", "symmetric_grid": "wide"}]})
    for cfg in (Int4RtnConfig(group_size=32, symmetric_grid="full"),
                GptqConfig(group_size=32, symmetric_grid="full")):
        model = make_tiny_llama()
        run_passes(model, [cfg], tiny_state())
        layer = model.model.layers[0].self_attn.q_proj
        assert layer.scheme.grid == "full"
        codes, _ = layer.codes()
        assert int(codes.min()) == -8  # only the full grid reaches code -8
