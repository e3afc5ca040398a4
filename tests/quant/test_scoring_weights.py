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


def test_on_a_gpu_the_dequantized_copy_is_in_the_compute_dtype_and_sized_by_gpu_memory(
        monkeypatch, caplog):
    """On a GPU the copy is in the evaluated model's dtype (bf16 there; float32 would double it:
    a 70B model's would not fit), and whether it fits is asked of that GPU's free memory, not
    the host's. Without a GPU: the meta device stands in for the placement (the CPU-only build
    refuses fake CUDA tensors in the unpacking), ``mem_get_info`` is faked."""
    from compress.core.device import on_device
    from compress.quant import linear

    assert linear.scoring_dtype(torch.device("cpu"), torch.bfloat16) == torch.float32
    assert linear.scoring_dtype(torch.device("cuda", 0), torch.bfloat16) == torch.bfloat16
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: asked.append(device) or (7, 9))
    assert linear.available_memory_bytes(torch.device("cuda", 1)) == 7
    assert asked == [torch.device("cuda", 1)]

    model = make_tiny_llama()
    run_passes(model, [Int4RtnConfig(group_size=32)], CompressionState(progress=False))
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    weights = sum(m.in_features * m.out_features for m in layers)
    free = {"bytes": 10 * weights}
    monkeypatch.setattr(linear, "available_memory_bytes", lambda device: free["bytes"])
    with on_device(model, torch.device("meta"), torch.bfloat16):
        with dequantized_for_scoring(model) as held:
            held_weights = {(m._prepared["scoring_weight"].device.type,
                             m._prepared["scoring_weight"].dtype) for m in layers}
        free["bytes"] = 3 * weights  # the bf16 copy (2 bytes a weight) is over half of it
        with dequantized_for_scoring(model) as refused:
            assert not any("scoring_weight" in m._prepared for m in layers)
    assert held == 2 * weights and held_weights == {("meta", torch.bfloat16)}
    assert refused == 0 and "available on meta" in caplog.text
