"""A tiny random Llama with every Linear swapped for a QuantLinear on the Triton backend gives
the same logits as the reference backend (interpreter on CPU, or CUDA when present)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

triton = pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")

# Both backends use the same dequantized weight; they differ in summation order and, for fp16,
# in where the products are rounded (the reference runs F.linear on an fp16 weight).
TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.float16: {"atol": 2e-2, "rtol": 1e-2}}


def _tiny_llama(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=128, vocab_size=128, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def _quantize(model: nn.Module, scheme, backend: str) -> int:
    from compress.quant.linear import QuantLinear

    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in linears:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantLinear.from_linear(linear, scheme, backend=backend))
    return len(linears)


# (n_bits, group_size, symmetric, dtype, batch): batch 1 x 8 tokens takes the split-K decode
# path (M = 8), batch 3 the prefill path (M = 24). A full cross product costs minutes in the
# interpreter, so each case covers a different scheme, dtype and path.
CASES = {
    "w4g32-fp16-prefill": (4, 32, True, torch.float16, 3),
    "w4g32-asym-fp32-decode": (4, 32, False, torch.float32, 1),
    "w8-channel-fp32-prefill": (8, None, True, torch.float32, 3),
    "w8-channel-asym-fp16-decode": (8, None, False, torch.float16, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_llama_triton_matches_reference(case, device):
    import copy

    from compress.quant.linear import WeightScheme

    n_bits, group_size, symmetric, dtype, batch = CASES[case]
    scheme = WeightScheme(n_bits=n_bits, group_size=group_size, symmetric=symmetric)
    model = _tiny_llama(dtype).to(device)
    reference_model = copy.deepcopy(model)
    assert _quantize(model, scheme, "triton") == 15  # 7 per layer + lm_head
    _quantize(reference_model, scheme, "reference")
    tokens = torch.randint(0, 128, (batch, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(tokens.to(device)).logits
        expected = reference_model(tokens.to(device)).logits
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.float().cpu(), expected.float().cpu(), **TOL[dtype])
    backends = {m.resolved_backend(got.device) for m in model.modules() if hasattr(m, "scheme")}
    assert backends == {"triton"}
