"""GPTQ problems and the agreement every column walk owes the torch walk
(``compress.quant.gptq._walk_block``): shared by the Triton and the C++ walks' tests."""

from __future__ import annotations

import pytest
import torch

# (N, K, group, symmetric, act_order, bits): groups smaller than the block (several walks per
# block), equal to it, larger (a 256-column block), per channel with a ragged last block, static
# groups with act_order, int8
CASES = [
    (40, 256, 32, True, False, 4),
    (33, 384, 128, False, False, 4),
    (24, 512, 256, True, False, 4),
    (17, 200, None, True, False, 4),
    (40, 256, 64, False, True, 4),
    (20, 256, 128, True, False, 8),
]


def problem(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight [n, k] and a Hessian with an uneven diagonal."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(4 * k, k, generator=g) * torch.rand(k, generator=g)  # uneven diag(H)
    return w, x.T @ x / x.shape[0]


def assert_same_as_the_torch_walk(got, ref) -> None:
    """``gptq_quantize``'s results: the same codes up to rounding ties (one step at most), the
    same scales, zero points almost all, the same loss and dampening."""
    codes, scales, zeros, info = (t.cpu() if isinstance(t, torch.Tensor) else t for t in got)
    same = (codes == ref[0]).float().mean().item()
    assert same >= 0.999, f"{100 * (1 - same):.3f}% of codes differ"
    assert (codes.int() - ref[0].int()).abs().max() <= 1  # a tie rounded the other way
    torch.testing.assert_close(scales, ref[1], rtol=1e-5, atol=0)
    assert (zeros is None) == (ref[2] is None)
    if zeros is not None:
        assert (zeros != ref[2]).float().mean() <= 0.01
    assert info["gptq_loss"] == pytest.approx(ref[3]["gptq_loss"], rel=1e-4)
    assert info["dampening"] == ref[3]["dampening"]
