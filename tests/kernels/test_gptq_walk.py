"""GPTQ's column walk in Triton (``compress/kernels/gptq_walk.py``) against the torch walk it
replaces on a GPU (``compress.quant.gptq._walk_block``), through ``gptq_quantize``: the same
codes, scales, zero points and loss, up to rounding ties (the torch walk's ``addr_`` may use
FMA, the kernel does not). Under TRITON_INTERPRET=1 on CPU when there is no GPU."""

from __future__ import annotations

import pytest
import torch

from compress.quant.gptq import GptqConfig, gptq_quantize
from compress.quant.linear import WeightScheme
from tests.kernels.gptq_cases import CASES, assert_same_as_the_torch_walk, problem

pytest.importorskip("triton")

@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_triton_walk_matches_the_torch_walk(case, device):
    n, k, group, symmetric, act_order, bits = case
    w, h = problem(n, k)
    scheme = WeightScheme(bits, group, symmetric=symmetric)
    cfg = GptqConfig(act_order=act_order)
    ref = gptq_quantize(w, h, scheme, cfg, walk="torch")
    got = gptq_quantize(w.to(device), h.to(device), scheme, cfg, walk="triton")
    assert_same_as_the_torch_walk(got, ref)


def test_the_walk_refuses_what_it_cannot_hold():
    from compress.kernels import gptq_walk

    w = torch.zeros(4, 512)
    assert "wider than" in gptq_walk.unsupported_reason(w, 512)
    with pytest.raises(ValueError, match="walk='fast': expected auto, torch, triton or cpu"):
        gptq_quantize(torch.randn(4, 64), torch.eye(64), WeightScheme(4, 32), GptqConfig(),
                      walk="fast")


def test_auto_walks_in_torch_when_the_kernel_fails_to_build(monkeypatch, caplog):
    """On a GPU ``walk="auto"`` takes the kernel; if it does not build there, GPTQ warns and
    walks in torch (same result) instead of failing the pass; ``walk="triton"`` raises."""
    from compress.kernels import gptq_walk
    from compress.quant import gptq

    def broken(*args, **kwargs):
        raise RuntimeError("PTX assembly failed")

    monkeypatch.setattr(gptq, "_triton_walk_reason", lambda w, width: None)  # "a GPU"
    monkeypatch.setattr(gptq_walk, "gptq_walk_triton", broken)
    w, h = problem(24, 256)
    scheme, cfg = WeightScheme(4, 64), GptqConfig()
    ref = gptq_quantize(w, h, scheme, cfg, walk="torch")
    got = gptq_quantize(w, h, scheme, cfg)
    assert torch.equal(got[0], ref[0]) and got[3] == ref[3]
    assert caplog.text.count("the Triton column walk failed (RuntimeError: PTX") == 1
    with pytest.raises(RuntimeError, match="PTX assembly failed"):
        gptq_quantize(w, h, scheme, cfg, walk="triton")


def test_the_self_check_passes_the_kernel_and_catches_a_wrong_one(monkeypatch, caplog):
    """Before ``walk="auto"`` uses the kernel on a device it checks it once against the torch
    walk there: the real kernel agrees; one that gets the codes wrong (here: every code one
    higher) is turned off with a warning instead of quantizing a model wrong."""
    from compress.kernels import gptq_walk
    from compress.quant import gptq

    cpu = torch.device("cpu")
    monkeypatch.setattr(gptq, "_WALK_CHECKED", {})
    assert gptq._walk_self_check(cpu) is None
    real = gptq_walk.gptq_walk_triton

    def off_by_one(w, hinv, scales, zeros, codes, *rest, **kwargs):
        real(w, hinv, scales, zeros, codes, *rest, **kwargs)
        codes.add_(1)

    monkeypatch.setattr(gptq, "_WALK_CHECKED", {})
    monkeypatch.setattr(gptq_walk, "gptq_walk_triton", off_by_one)
    reason = gptq._walk_self_check(cpu)
    assert reason is not None and "disagreed with the torch walk" in reason
    assert "walking in torch" in caplog.text
    assert gptq._walk_self_check(cpu) is reason  # once per device and process
