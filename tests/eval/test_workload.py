"""Continuous batching and speculative decoding give exactly the greedy tokens of plain
decoding (float64 tiny model, so no near-ties flip); arrivals and queueing with a fake clock."""

from __future__ import annotations

import pytest
import torch

from compress.eval.latency import hf_stream, runtime_stream
from compress.eval.speculative import SpeculativeStats, speculative_generate
from compress.eval.workload import (
    HFEngine,
    Request,
    StreamEngine,
    make_requests,
    poisson_arrivals,
    serve,
)
from compress.runtime.engine import Runtime
from compress.testing import make_tiny_llama  # noqa: E402


@pytest.fixture
def model64():
    return make_tiny_llama(seed=0).double()


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 9, 3, 12)]


def _plain(model, prompt, n):
    return list(hf_stream(model)(prompt, n))


def test_hf_stream_matches_full_forward(model64):
    prompt = _prompts()[1]
    tokens = _plain(model64, prompt, 6)
    seq = list(prompt)
    for _ in range(6):  # recompute from scratch, no cache
        seq.append(int(model64(torch.tensor([seq])).logits[0, -1].argmax()))
    assert tokens == seq[len(prompt) :]


class StepClock:
    """Fake clock advancing 1.0 per call; sleep() advances it by the requested time."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1.0
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_continuous_batching_matches_plain_greedy(model64):
    prompts = _prompts()
    lengths = [4, 1, 6, 3]
    pairs = enumerate(zip(prompts, lengths, strict=True))
    requests = [Request(p, n, arrival_s=0.5 * i) for i, (p, n) in pairs]
    clock = StepClock()
    timings, duration = serve(
        HFEngine(model64), requests, max_batch=2, clock=clock, sleep=clock.sleep
    )
    for req, timing in zip(requests, timings, strict=True):
        assert timing.tokens == _plain(model64, req.prompt, req.max_new_tokens)
        assert len(timing.token_times) == req.max_new_tokens
        assert timing.ttft > 0 and timing.token_times == sorted(timing.token_times)
    assert duration > 0


def test_stream_engine_serves_any_stream(model64):
    prompts = _prompts()[:3]
    requests = [Request(p, 3) for p in prompts]
    clock = StepClock()
    timings, _ = serve(
        StreamEngine(hf_stream(model64)), requests, max_batch=8, clock=clock, sleep=clock.sleep
    )
    assert [t.tokens for t in timings] == [_plain(model64, p, 3) for p in prompts]


def test_queueing_shows_in_ttft(model64):
    # max_batch=1: the second request (same arrival) waits for the whole first one.
    requests = [Request(_prompts()[0], 4), Request(_prompts()[1], 4)]
    clock = StepClock()
    timings, _ = serve(HFEngine(model64), requests, max_batch=1, clock=clock, sleep=clock.sleep)
    assert timings[1].ttft > timings[0].e2e


def test_idle_server_sleeps_until_arrival(model64):
    clock = StepClock()
    timings, _ = serve(
        HFEngine(model64), [Request([5, 6], 1, arrival_s=100.0)], clock=clock, sleep=clock.sleep
    )
    # start stamp 1.0, arrival at 101.0: first token cannot come before that
    assert timings[0].token_times[0] >= 101.0 and timings[0].arrival == 101.0


def test_poisson_arrivals_mean_gap():
    arrivals = poisson_arrivals(4000, rate_per_s=5.0, seed=3)
    gaps = [b - a for a, b in zip([0.0] + arrivals, arrivals, strict=False)]
    assert sum(gaps) / len(gaps) == pytest.approx(0.2, rel=0.05)
    assert arrivals == sorted(arrivals)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, 0)


def test_make_requests_lengths_and_determinism():
    ids = list(range(1000))
    a = make_requests(ids, 5, prompt_tokens=(10, 20), output_tokens=7, seed=1)
    b = make_requests(ids, 5, prompt_tokens=(10, 20), output_tokens=7, seed=1)
    assert a == b
    assert all(10 <= len(r.prompt) <= 20 and r.max_new_tokens == 7 for r in a)
    assert a[1].prompt[0] == a[0].prompt[-1] + 1  # consecutive slices of the text


def _runtime(model):
    return Runtime(model, max_seq_len=64, compile=False)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_speculative_on_the_runtime_equals_plain_greedy(model64, k):
    # Draft and target on runtime static caches: the tokens are the target runtime's plain
    # greedy tokens, which are transformers' greedy tokens.
    draft = make_tiny_llama(seed=7).double()
    target_rt, draft_rt = _runtime(model64), _runtime(draft)
    for prompt in _prompts():
        stats = SpeculativeStats()
        out = speculative_generate(target_rt, draft_rt, prompt, 9, k=k, stats=stats)
        plain = _runtime(model64).generate([prompt], 9)[0]
        assert out == plain == _plain(model64, prompt, 9)
        assert stats.accepted <= stats.proposed


def test_speculative_self_draft_accepts_everything(model64):
    stats = SpeculativeStats()
    out = speculative_generate(
        _runtime(model64), _runtime(model64), _prompts()[0], 9, k=4, stats=stats
    )
    assert out == _plain(model64, _prompts()[0], 9)
    assert stats.accepted == stats.proposed
    # prefill gives 1 token, then each verify gives k + 1 = 5 tokens: 1 + 5 + 3 (last, truncated)
    assert stats.target_forwards == 3


def test_runtime_stream_names_its_engine_and_falls_back_only_when_it_must(model64):
    stream = runtime_stream(model64, max_seq_len=64)
    assert stream.engine == "runtime" and stream.fallback_reason is None
    prompt = _prompts()[1]
    assert list(stream(prompt, 6)) == _runtime(model64).generate([prompt], 6)[0]

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=320, n_positions=64, n_embd=32, n_layer=1,
                                      n_head=2, initializer_range=0.3)).eval()
    fallback = runtime_stream(gpt2, max_seq_len=64)
    assert fallback.engine == "hf fallback" and "gpt2" in fallback.fallback_reason
    assert list(fallback(prompt, 6)) == _plain(gpt2, prompt, 6)


def test_runtime_stream_names_our_int_kernels_only_where_they_run(model64):
    from compress.kernels import cpu_q8
    from compress.quant.rtn import Int4RtnConfig, quantize_linears

    # a float model has no layer for them: plain "runtime" whatever was asked
    assert runtime_stream(model64, max_seq_len=64, int_kernels="ours").engine == "runtime"
    with pytest.raises(ValueError, match="int_kernels='fast'"):
        runtime_stream(model64, max_seq_len=64, int_kernels="fast")
    model = make_tiny_llama(seed=0)  # fp32, as the int4 CPU kernels want
    quantize_linears(model, Int4RtnConfig(group_size=32), 4, "test")
    assert runtime_stream(model, max_seq_len=64, int_kernels="torch").engine == "runtime"
    ours = runtime_stream(model, max_seq_len=64, int_kernels="ours")
    if cpu_q8.unavailable_reason() is None:
        assert ours.engine == f"runtime, our int kernels ({cpu_q8.selected_isa()})"
    else:
        assert ours.engine == "runtime"


def test_serve_scheduled_batches_requests_as_they_arrive(model64):
    """The scheduler loop: each request's greedy tokens equal plain decoding, a request that
    arrives later is added only then (its TTFT counts from its arrival), the KV memory in use
    is recorded."""
    from compress.eval.latency import runtime_scheduler
    from compress.eval.workload import serve_scheduled

    scheduler = runtime_scheduler(model64, max_seq_len=64, max_batch=4)
    requests = [Request([1, 5, 9, 2], 6, 0.0), Request([1, 7], 5, 0.0), Request([3, 3, 3], 4, 0.05)]
    timings, duration, cache = serve_scheduled(scheduler, requests)
    rt = Runtime(model64, max_seq_len=64, compile=False)
    assert [t.tokens for t in timings] == [rt.generate([r.prompt], r.max_new_tokens)[0]
                                          for r in requests]  # fmt: skip
    assert timings[2].token_times[0] >= timings[2].arrival and duration >= 0.05
    assert cache["kv_bytes_peak"] > 0 and cache["preemptions"] == 0
    assert cache["mean_decode_rows_per_step"] > 1  # the first two decoded together
