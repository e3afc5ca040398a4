"""int8 KV cache: quantize/dequantize bounds, generation identical to the float cache on the tiny
model (greedy), stored bytes match the per-token formula."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from compress.kv_cache import Int8KVCache, dequantize_kv, kv_bytes_per_token, quantize_kv
from compress.testing import make_tiny_llama


@pytest.mark.parametrize("axis", ["token", "channel"])
def test_round_trip_error_is_within_half_a_step(axis):
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64) * 3
    codes, scales = quantize_kv(x, axis)
    assert codes.dtype == torch.int8
    assert scales.shape == ((2, 3, 5, 1) if axis == "token" else (2, 3, 1, 8))
    assert torch.all((dequantize_kv(codes, scales, torch.float64) - x).abs() <= scales / 2 + 1e-9)


def test_bad_shape_is_a_clear_error():
    with pytest.raises(ValueError, match=r"\[B, H, T, D\]"):
        quantize_kv(torch.randn(3, 8))


@torch.no_grad()
def test_generation_with_int8_cache_matches_float_cache():
    model = make_tiny_llama()
    ids = torch.randint(3, 300, (2, 10))
    mask = torch.ones_like(ids)
    cache = Int8KVCache()
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=8,
        do_sample=False,
        past_key_values=cache,
        pad_token_id=2,
    )
    ref = model.generate(
        ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=2
    )
    assert torch.equal(out, ref)
    cfg = model.config
    tokens = cache.get_seq_length()
    assert tokens == 17  # the last generated token is not fed back
    per_token = kv_bytes_per_token(
        cfg.num_hidden_layers, cfg.num_key_value_heads, 16, torch.float32
    )
    assert cache.stored_bytes() == 2 * tokens * per_token["int8"]  # batch 2
    assert per_token["saved"] == per_token["float"] - per_token["int8"] > 0


@torch.no_grad()
def test_decode_step_logits_close_to_float_cache():
    model = make_tiny_llama()
    ids = torch.randint(3, 300, (1, 12))
    int8, plain = Int8KVCache(), DynamicCache()
    model(ids, past_key_values=int8, use_cache=True)
    model(ids, past_key_values=plain, use_cache=True)
    step = torch.randint(3, 300, (1, 1))
    a = model(step, past_key_values=int8, use_cache=True).logits
    b = model(step, past_key_values=plain, use_cache=True).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0.02 * float(b.abs().max()))
