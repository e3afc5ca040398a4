"""KV-cache dtype quality (``compress/eval/kv_quality.py``) against the contiguous runtime."""

from __future__ import annotations

import pytest
import torch

from compress.eval.kv_quality import kv_cache_quality
from compress.runtime.engine import Runtime
from compress.runtime.paged import PagedKVCache, paged_logits
from compress.testing import make_char_tokenizer, make_tiny_llama

TEXT = "Pack my box with five dozen liquor jugs. The quick brown fox jumps over the lazy dog. " * 6


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(seed=0, initializer_range=0.3)


def test_paged_logits_in_fp32_equal_the_contiguous_prefill(model):
    runtime = Runtime(model, max_seq_len=64, compile=False)
    tokens = make_char_tokenizer()(TEXT[:40], add_special_tokens=False)["input_ids"]
    cache = PagedKVCache(
        n_layers=2,
        num_blocks=10,
        block_size=4,
        n_kv=2,
        head_dim=16,
        dtype=torch.float32,
        compute_dtype=torch.float32,
    )
    expected = runtime.prefill(tokens)  # last row of a whole-prompt prefill
    runtime.position = 0
    whole = runtime.score(tokens)  # every row
    got = paged_logits(runtime, cache, tokens)
    assert got.shape == whole.shape
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[-1], expected, rtol=1e-5, atol=1e-5)


def test_kv_quality_reports_cost_and_capacity(model):
    result = kv_cache_quality(
        model,
        make_char_tokenizer(),
        TEXT,
        context_length=64,
        limit=3,
        block_size=4,
        request_tokens=64,
        kv_dtypes=("bfloat16", "int8", "fp8"),
    )
    fp32, bf16, int8 = (result["dtypes"][k] for k in ("float32", "bfloat16", "int8"))
    fp8 = result["dtypes"]["fp8"]
    assert result["fp8_scales"] == "1.0"  # this model has no calibrated scales
    assert 0.0 < fp8["kl"] < 0.2 and fp8["bytes_per_token"] == 128  # 2 x 2 x 2 x 16
    # each window scores all but its first token (nothing before it in the window)
    assert result["windows"] == 3 and result["scored_tokens"] == 3 * 63
    assert fp32["kl"] == 0.0 and fp32["delta_ppl_pct"] == 0.0
    assert 0.0 < int8["kl"] < 0.05 and 0.0 < bf16["kl"] < 0.05
    assert abs(int8["delta_ppl_pct"]) < 5
    # 2 layers x 2 heads x (16 + 4) bytes, twice (K and V); bf16 2 x 2 x 2 x 32
    assert int8["bytes_per_token"] == 160 and bf16["bytes_per_token"] == 256
    assert int8["requests_per_gib"] == (1 << 30) // (160 * 64)
