"""``dequantized_for_scoring``: inside it a quantized model computes exactly its reference
definition (dequantized weights, float GEMM), W8A8 layers keep their int8 activations, and
nothing is held after it."""

from __future__ import annotations

import torch

from compress.core.registry import CompressionState, run_passes
from compress.quant.linear import QuantLinear, dequantized_for_scoring
from compress.quant.rtn import Int4RtnConfig
from compress.quant.smoothquant import SmoothquantConfig
from compress.testing import make_tiny_llama

IDS = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 12, 64, 33, 21, 8]])


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def test_scoring_weights_equal_the_reference_backend_and_are_dropped_after():
    model = make_tiny_llama()
    run_passes(model, [Int4RtnConfig(group_size=32)], CompressionState(progress=False))
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    with dequantized_for_scoring(model) as held:
        scored = _logits(model)
    assert held == sum(4 * m.in_features * m.out_features for m in layers)
    assert not any("scoring_weight" in m._prepared for m in layers)
    for m in layers:
        m.backend = "reference"
        m._prepared.clear()
    torch.testing.assert_close(scored, _logits(model), rtol=0, atol=0)


def test_w8a8_layers_keep_their_int8_activations():
    model = make_tiny_llama()
    gen = torch.Generator().manual_seed(0)
    batches = list(torch.randint(3, 300, (2, 1, 32), generator=gen))
    state = CompressionState(calibration_batches=lambda: batches, progress=False)
    run_passes(model, [SmoothquantConfig()], state)
    before = _logits(model)
    with dequantized_for_scoring(model) as held:
        assert held == 0
        torch.testing.assert_close(_logits(model), before, rtol=0, atol=0)
