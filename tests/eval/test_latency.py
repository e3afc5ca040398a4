"""Timing math with a fake clock (exact numbers), percentiles vs numpy, goodput vs hand-made
cases, resource formulas vs direct counts. No real timings are asserted anywhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compress.eval.latency import (
    RequestTiming,
    Slo,
    bandwidth_utilization,
    cost,
    distribution,
    goodput,
    hf_stream,
    kv_bytes_per_token,
    percentile,
    roofline,
    summarize,
    time_request,
)


class FakeClock:
    """Returns the given timestamps in order, one per call."""

    def __init__(self, stamps):
        self.stamps = list(stamps)

    def __call__(self):
        return self.stamps.pop(0)


def fake_stream(tokens):
    def stream(prompt, max_new_tokens):
        yield from tokens[:max_new_tokens]

    return stream


def test_time_request_exact_ttft_tpot_itl():
    # arrival at 10.0, tokens ready at 10.5, 10.6, 10.8, 11.1
    clock = FakeClock([10.0, 10.5, 10.6, 10.8, 11.1])
    t = time_request(fake_stream([7, 8, 9, 10]), [1, 2, 3], 4, clock=clock)
    assert t.tokens == [7, 8, 9, 10]
    assert t.ttft == pytest.approx(0.5)
    assert t.itl == pytest.approx([0.1, 0.2, 0.3])
    assert t.tpot == pytest.approx(0.6 / 3)
    assert t.e2e == pytest.approx(1.1)
    assert t.prompt_tokens == 3


def test_single_token_request_has_no_tpot():
    t = RequestTiming(0.0, 4, [0.25], [5])
    assert t.tpot is None and t.itl == [] and t.ttft == 0.25


@pytest.mark.parametrize("n", [1, 2, 7, 100], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("q", [0, 50, 90, 95, 99, 100], ids=lambda q: f"p{q}")
def test_percentile_matches_numpy(n, q):
    values = list(np.random.default_rng(n).exponential(size=n))
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_distribution_matches_numpy():
    values = [0.003, 0.001, 0.002, 0.010, 0.004]
    d = distribution(values, 1e3)
    ms = np.array(values) * 1e3
    assert d["mean"] == pytest.approx(ms.mean()) and d["std"] == pytest.approx(ms.std())
    assert d["p99"] == pytest.approx(np.percentile(ms, 99))
    assert d["min"] == pytest.approx(1.0) and d["max"] == pytest.approx(10.0)


def _requests():
    # ttft (s), token gap (s), tokens
    return [
        RequestTiming(0.0, 10, [0.1, 0.15, 0.20], [1, 2, 3]),  # ttft 100 ms, tpot 50 ms
        RequestTiming(0.0, 20, [0.3, 0.31, 0.32, 0.33], [1, 2, 3, 4]),  # 300 ms, 10 ms
        RequestTiming(1.0, 30, [1.05], [1]),  # 50 ms, no tpot
    ]


@pytest.mark.parametrize(
    "slo, good",
    [
        (Slo(), 3),
        (Slo(ttft_ms=200), 2),
        (Slo(tpot_ms=20), 2),
        (Slo(ttft_ms=200, tpot_ms=20), 1),
        (Slo(ttft_ms=1), 0),
    ],
    ids=["none", "ttft", "tpot", "both", "impossible"],
)
def test_goodput_filter(slo, good):
    g = goodput(_requests(), slo, duration_s=2.0)
    assert g["requests_meeting_slo"] == good
    assert g["requests_per_s"] == pytest.approx(good / 2.0)
    kept = [r for r in _requests() if slo.met_by(r)]
    assert g["output_tokens_per_s"] == pytest.approx(sum(len(r.tokens) for r in kept) / 2.0)


def test_impossible_slo_gives_zero_goodput_and_no_cost():
    g = goodput(_requests(), Slo(ttft_ms=0.001), 2.0)
    assert g["requests_per_s"] == 0 and g["fraction"] == 0
    c = cost(3.6, g)
    assert c["usd_per_1m_output_tokens"] is None and c["usd_per_request"] is None


def test_cost_from_goodput():
    c = cost(3.6, {"output_tokens_per_s": 100.0, "requests_per_s": 0.5})
    # $0.001 per second; 1e6 tokens take 1e4 s
    assert c["usd_per_1m_output_tokens"] == pytest.approx(10.0)
    assert c["usd_per_request"] == pytest.approx(0.002)


def test_summarize_throughput():
    s = summarize(_requests(), 2.0, Slo())
    assert s["throughput"]["input_tokens_per_s"] == pytest.approx(60 / 2)
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(8 / 2)
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert s["itl_ms"]["n"] == 5


def test_kv_bytes_per_token(tiny_model):
    # 2 (K, V) * 2 layers * 2 kv heads * head_dim 16 * 4 bytes
    assert kv_bytes_per_token(tiny_model) == 2 * 2 * 2 * 16 * 4


def test_kv_bytes_per_token_of_latent_attention_is_what_each_engine_caches():
    """DeepSeek's latent attention: transformers' cache (measured: its tensors after a forward)
    and our runtime's hold the latent and the rotary key once per token (the formula of every
    other family gave 2 x 4 KV heads x head_dim 16 per layer)."""
    from compress.runtime.engine import Runtime
    from compress.testing import make_tiny_moe

    model = make_tiny_moe("deepseek_v3", tie_word_embeddings=False)
    with torch.no_grad():
        cache = model(torch.tensor([list(range(1, 11))]), use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (layer.keys, layer.values))
    assert kv_bytes_per_token(model) == held // 10
    runtime = Runtime(model, max_seq_len=16, compile=False)
    assert kv_bytes_per_token(model) == runtime.decode_bytes()["kv_cache"] // 16


def test_roofline_verdicts():
    r = roofline(
        weight_bytes=1000,
        kv_per_token=10,
        matmul_weights=250,
        prompt_tokens=100,
        mean_context=50,
        decode_step_s=1e-6,
        prefill_s=1e-3,
        prefill_flops_=1e6,
        bandwidth_bps=2e9,
        peak_flops=1e11,
    )
    assert r["decode_bytes_per_step"] == 1500
    assert r["mbu"] == pytest.approx(1500 / 1e-6 / 2e9)
    assert r["mfu"] == pytest.approx(1e6 / 1e-3 / 1e11)
    assert r["decode_verdict"].startswith("memory-bandwidth-bound")  # 500/1500 < 50
    assert r["prefill_verdict"].startswith("compute-bound")  # 1e6/2000 = 500 > 50


def test_bandwidth_utilization_is_bytes_over_step_time_over_bandwidth():
    # 1 GB read in 0.5 s is 2 GB/s: half of a 4 GB/s machine
    assert bandwidth_utilization(1e9, 0.5, 4e9) == pytest.approx(0.5)
    assert bandwidth_utilization(1e9, None, 4e9) is None  # no decode step timed


def test_hf_generate_stream_gives_plain_greedy_tokens_and_ignores_eos(tiny_model):
    """transformers' own generate, streamed from its thread: the same tokens as the forward
    loop of hf_stream, EOS (set to the first greedy token) an ordinary token, each stamped."""
    model = tiny_model.double()
    prompt = [5, 17, 33, 2, 9, 41]
    expected = list(hf_stream(model)(prompt, 5))
    model.generation_config.eos_token_id = expected[0]
    stream = hf_stream(model, generate=True)
    timing = time_request(stream, prompt, 5, clock=FakeClock([0.0, 1.0, 2.0, 3.0, 4.0, 5.0]))
    assert stream.engine == "hf generate"
    assert timing.tokens == expected
    assert timing.ttft == 1.0 and timing.tpot == 1.0
