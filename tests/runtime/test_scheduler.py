"""Continuous batching over the paged KV cache (``compress/runtime/scheduler.py``).

References: the contiguous static-cache runtime (``Runtime.generate`` / ``prefill`` / ``score``)
on the same model, and invariants of the block pool. Every runtime family, tiny random models
(the families test's settings: sliding windows, softcaps, multipliers, MoE)."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from compress.kernels import cpu_attention
from compress.runtime.blocks import ROOT_KEY, BlockPool, OutOfBlocks, block_key
from compress.runtime.engine import Runtime
from compress.runtime.paged import dequantize_int8, kv_bytes_per_token, quantize_int8
from compress.runtime.scheduler import Scheduler
from compress.testing import make_tiny_model

from .test_runtime_families import FAMILIES, make_model

ALL_FAMILIES = ["llama", *FAMILIES]


def family_model(family: str, seed: int = 0):
    if family == "llama":
        model = make_tiny_model("llama", seed, initializer_range=0.3)
        model.config._attn_implementation = "eager"
        return model
    return make_model(family, seed)


def random_requests(rng: random.Random, n: int, vocab: int = 300):
    return [
        ([rng.randrange(1, vocab) for _ in range(rng.randint(1, 40))], rng.randint(1, 24))
        for _ in range(n)
    ]


def drive(scheduler: Scheduler, requests, rng: random.Random | None = None):
    """Run ``requests`` through ``scheduler``, adding them at random steps (``rng``) or all at
    once; the tokens of each request, in request order."""
    pending, ids, out = list(range(len(requests))), {}, {}
    while pending or scheduler.has_work:
        while pending and (rng is None or rng.random() < 0.5 or not scheduler.has_work):
            i = pending.pop(0)
            prompt, n = requests[i]
            ids[scheduler.add(prompt, n)] = i
            out[i] = []
            if rng is not None:
                break
        for event in scheduler.step():
            out[ids[event.id]].append(event.token)
    return [out[i] for i in range(len(requests))]


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_continuous_batching_gives_each_request_its_tokens_alone(family):
    """Randomized arrivals and lengths, a pool small enough to force preemption, prompts that
    share prefixes: greedy fp32 tokens equal each request run alone on the contiguous runtime."""
    runtime = Runtime(family_model(family), max_seq_len=96, compile=False)
    rng = random.Random(zlib.crc32(family.encode()))  # not its place in the list: stable
    requests = random_requests(rng, 10)
    shared = requests[0][0][:9]
    requests += [(shared + p[:10], n) for p, n in requests[1:4]]  # prefix hits
    alone = [runtime.generate([p], n)[0] for p, n in requests]
    scheduler = Scheduler(runtime, num_blocks=24, block_size=4, max_batch=5, prefill_budget=20)
    assert drive(scheduler, requests, rng) == alone
    assert scheduler.stats.preemptions > 0  # the pool was too small for every request at once
    assert scheduler.stats.mixed_steps > 0  # decode rows and prefill chunks in one forward
    assert scheduler.pool.in_use == 0 and not scheduler.has_work


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_the_decode_kernel_computes_the_gathered_attention(family, kv_dtype):
    """The same randomized requests through decode steps that attend in the pool (the C++
    kernel) and through the gather + the runtime's own attention: every logits row within fp32
    rounding, the same greedy tokens."""
    reason = cpu_attention.unavailable_reason(torch.float32, torch.device("cpu"))
    if reason is not None:
        pytest.skip(f"the paged-attention kernel does not run here: {reason}")
    runtime = Runtime(family_model(family), max_seq_len=96, compile=False)
    requests = random_requests(random.Random(7), 8)
    tokens, logits = {}, {}
    for attention in ("kernel", "reference"):
        scheduler = Scheduler(runtime, num_blocks=40, block_size=4, max_batch=4, prefill_budget=24,
                              kv_dtype=kv_dtype, attention=attention)  # fmt: skip
        assert (scheduler.attention_reason is None) == (attention == "kernel")
        recorder = _Logits(scheduler)
        tokens[attention] = drive(scheduler, requests)
        logits[attention] = recorder.rows
    assert tokens["kernel"] == tokens["reference"]
    assert logits["kernel"].keys() == logits["reference"].keys()
    for seq_id, rows in logits["kernel"].items():
        for i, (a, b) in enumerate(zip(rows, logits["reference"][seq_id], strict=True)):
            # int8 pages: from a request's second decode step on, its keys include ones written
            # after an fp32-rounding difference, which can round to the next code (a step of
            # absmax / 127, carried into the logits: seen 6e-3 on Qwen2's); the prefill's row
            # and the first decode step read the same codes in both runs
            tol = 1e-4 if kv_dtype == "float32" or i < 2 else 5e-2
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def record_forwards(scheduler: Scheduler) -> list[tuple[int, int]]:
    """A list that fills with (decode rows, prompt tokens) of each forward the scheduler runs."""
    forwards = []
    run = scheduler._run

    def recording(decode, chunks, kernel):
        forwards.append((len(decode), sum(n for _, n in chunks)))
        return run(decode, chunks, kernel)

    scheduler._run = recording
    return forwards


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_a_mixed_step_computes_what_two_forwards_do(family):
    """Decode rows and prefill chunks through one forward (the default) against a forward each:
    the same greedy tokens, every logits row within fp32 rounding (a GEMM's rounding depends on
    its row count)."""
    runtime = Runtime(family_model(family), max_seq_len=96, compile=False)
    requests = random_requests(random.Random(11), 9)
    tokens, logits = {}, {}
    for mix in (True, False):
        scheduler = Scheduler(runtime, num_blocks=48, block_size=4, max_batch=4, prefill_budget=16,
                              mix=mix)  # fmt: skip
        recorder = _Logits(scheduler)
        forwards = record_forwards(scheduler)
        tokens[mix] = drive(scheduler, requests, random.Random(3))
        logits[mix] = recorder.rows
        assert (scheduler.stats.mixed_steps > 0) == mix
        # the budget counts a mixed forward's decode rows; two forwards: the chunks' tokens
        assert all((d if mix else 0) + c <= 16 for d, c in forwards)
    assert tokens[True] == tokens[False]
    for seq_id, rows in logits[True].items():
        for a, b in zip(rows, logits[False][seq_id], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_phases_that_compute_differently_are_not_mixed():
    """Prefill in fp32 and decode in bf16: two forwards a step, as the reason says; and where
    a step's rows reach the count from which a layer of our integer kernels switches to a float
    GEMM, that step runs as two forwards too."""
    runtime = Runtime(family_model("llama"), max_seq_len=64, compile=False,
                      decode_dtype=torch.bfloat16)  # fmt: skip
    scheduler = Scheduler(runtime, num_blocks=40, block_size=4, max_batch=4, prefill_budget=12)
    assert "float32" in scheduler.mixed_reason and "bfloat16" in scheduler.mixed_reason
    drive(scheduler, random_requests(random.Random(5), 6), random.Random(2))
    assert scheduler.stats.mixed_steps == 0
    runtime = Runtime(family_model("llama"), max_seq_len=64, compile=False)
    runtime.float_gemm_rows = 6  # as if a layer left the integer kernel from 6 rows on
    scheduler = Scheduler(runtime, num_blocks=40, block_size=4, max_batch=4, prefill_budget=12)
    assert scheduler.mixed_reason is None and scheduler.mixed_rows == 6
    forwards = record_forwards(scheduler)
    drive(scheduler, random_requests(random.Random(5), 6), random.Random(2))
    mixed = [d + c for d, c in forwards if d and c]
    assert len(mixed) == scheduler.stats.mixed_steps > 0 and max(mixed) < 6
    # a step that split: its decode forward, then its chunks' forward, 6 rows or more together
    pairs = zip(forwards, forwards[1:], strict=False)
    assert any(a[1] == b[0] == 0 and a[0] and a[0] + b[1] >= 6 for a, b in pairs)


def test_attention_choices():
    runtime = Runtime(family_model("llama"), max_seq_len=32, compile=False)
    with pytest.raises(ValueError, match="expected one of"):
        Scheduler(runtime, num_blocks=8, block_size=4, attention="fused")
    gathered = Scheduler(runtime, num_blocks=8, block_size=4, attention="reference")
    assert gathered.attention_reason == "asked for"


class _Logits:
    """Wraps a scheduler's sampling to record each request's logits rows as they are used."""

    def __init__(self, scheduler: Scheduler):
        self.rows: dict[int, list[torch.Tensor]] = {}
        emit = scheduler._emit

        def recording(seqs, logits):
            for seq, row in zip(seqs, logits, strict=True):
                self.rows.setdefault(seq.id, []).append(row.clone())
            return emit(seqs, logits)

        scheduler._emit = recording


def kl_against_contiguous(scheduler: Scheduler, prompt: list[int], n: int):
    """One request of ``n`` tokens through ``scheduler`` -> its tokens, the contiguous
    runtime's logits for them, and the KL(contiguous || scheduler) of each step."""
    recorder = _Logits(scheduler)
    seq_id = scheduler.add(prompt, n)
    tokens = []
    while scheduler.has_work:
        tokens += [e.token for e in scheduler.step()]
    exact = contiguous_logits(scheduler.runtime, prompt, tokens)
    kl = []
    for a, b in zip(recorder.rows[seq_id], exact, strict=True):
        p, q = a.log_softmax(-1), b.log_softmax(-1)
        kl.append(float((q.exp() * (q - p)).sum()))
    return tokens, exact, kl


def contiguous_logits(runtime: Runtime, prompt: list[int], tokens: list[int]):
    """The contiguous runtime's logits before each of ``tokens``: its prefill as ``generate``
    runs it (the head on the last row only), then one decode step per token."""
    t = len(prompt)
    slots = torch.arange(t)
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        x = runtime._layers(torch.tensor([prompt]), slots[None], causal, slots, 1, t, decode=False)
        rows = [runtime.head(x[:, -1])[0]]
    runtime.position = t
    rows += [runtime.score([token])[0] for token in tokens[:-1]]
    return rows


@pytest.mark.parametrize(
    "family",
    ["llama", "mistral", "gemma2", "gemma3_text", "qwen3_moe", "smollm3", "phi3", "olmo2",
     "exaone4", "glm4"],
)
def test_paged_equals_contiguous_bit_for_bit(family):
    """One request at a time: the same matmul shapes as the contiguous runtime, keys read
    through block tables with slots scattered over the pool -> the same logits, bit for bit."""
    runtime = Runtime(family_model(family), max_seq_len=64, compile=False)
    scheduler = Scheduler(runtime, num_blocks=24, block_size=4, max_batch=1, prefill_budget=64,
                          attention="reference")  # fmt: skip
    # scatter the free list so that block tables are not 0, 1, 2, ...
    order = list(range(24))
    random.Random(1).shuffle(order)
    scheduler.pool.free.clear()
    scheduler.pool.free.extend(order)
    recorder = _Logits(scheduler)
    for prompt in ([3, 17, 29, 41, 5, 60, 7, 80, 9, 10, 11], [250, 4, 2]):
        seq_id = scheduler.add(prompt, 20)
        tokens = []
        while scheduler.has_work:
            tokens += [e.token for e in scheduler.step()]
        expected = contiguous_logits(runtime, prompt, tokens)
        got = recorder.rows[seq_id]
        assert len(got) == len(expected) == 20
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_prefix_hit_equals_a_miss_bit_for_bit(family):
    """A second request sharing a 12-token system prompt reuses its three blocks (computing
    only its own suffix) and gets the logits of a cold run. The cold run prefills the prompt in
    the same two chunks (prefix, then suffix): a GEMM's rounding depends on its row count, so
    only the same chunking is comparable bit for bit."""
    system = [7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47]
    first, second = system + [2, 3, 4], system + [5, 6]
    runtime = Runtime(family_model(family), max_seq_len=64, compile=False)

    def run(prompts, prefix_caching):
        scheduler = Scheduler(
            runtime, num_blocks=32, block_size=4, max_batch=1, prefill_budget=len(system),
            prefix_caching=prefix_caching,
        )  # fmt: skip
        recorder = _Logits(scheduler)
        ids = [scheduler.add(p, 6) for p in prompts]
        while scheduler.has_work:
            scheduler.step()
        return scheduler, [recorder.rows[i] for i in ids]

    warm, (_, hit) = run([first, second], True)
    assert warm.stats.cached_prompt_tokens == len(system)  # three 4-token blocks reused
    assert warm.stats.prefix_hit_rate == pytest.approx(12 / (15 + 14))
    _, (miss,) = run([second], False)
    for a, b in zip(hit, miss, strict=True):
        assert torch.equal(a, b)


def test_a_request_too_big_for_the_cache_is_refused_and_a_full_pool_preempts():
    runtime = Runtime(family_model("llama"), max_seq_len=96, compile=False)
    scheduler = Scheduler(runtime, num_blocks=8, block_size=4, max_batch=8)
    with pytest.raises(ValueError, match="need 9 KV blocks"):
        scheduler.add(list(range(1, 30)), 7)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        scheduler.add([10_000], 2)
    requests = [([5 + i, 9, 12], 20) for i in range(4)]  # 6 blocks each, 8 in all
    alone = [runtime.generate([p], n)[0] for p, n in requests]
    assert drive(scheduler, requests) == alone
    assert scheduler.stats.preemptions > 0 and scheduler.pool.in_use == 0


def test_abort_frees_the_blocks_and_the_others_go_on():
    runtime = Runtime(family_model("llama"), max_seq_len=64, compile=False)
    scheduler = Scheduler(runtime, num_blocks=16, block_size=4, max_batch=4, prefix_caching=False)
    keep = scheduler.add([1, 2, 3, 4, 5], 12)
    drop = scheduler.add([9, 8, 7], 30)
    tokens = [e.token for e in scheduler.step() if e.id == keep]
    held = scheduler.pool.in_use
    assert scheduler.abort(drop) and not scheduler.abort(drop)
    assert scheduler.pool.in_use == held - 1  # the dropped request's one block
    while scheduler.has_work:
        tokens += [e.token for e in scheduler.step() if e.id == keep]
    assert tokens == runtime.generate([[1, 2, 3, 4, 5]], 12)[0]
    assert scheduler.pool.in_use == 0


def test_seeded_sampling_does_not_depend_on_the_batch():
    """Each request samples with its own generator: the same seed gives the same tokens alone
    and beside others."""
    runtime = Runtime(family_model("llama"), max_seq_len=64, compile=False)
    settings = dict(temperature=0.8, top_k=40, seed=5)

    def tokens(extra: int) -> list[int]:
        scheduler = Scheduler(runtime, num_blocks=64, block_size=4, max_batch=8)
        target = scheduler.add([4, 8, 15, 16, 23, 42], 16, **settings)
        for i in range(extra):
            scheduler.add([100 + i, 7], 16, temperature=1.0, seed=i)
        out = []
        while scheduler.has_work:
            out += [e.token for e in scheduler.step() if e.id == target]
        return out

    assert tokens(0) == tokens(5)


def test_int8_pages_hold_about_twice_the_tokens_of_bf16_and_stay_close():
    runtime = Runtime(family_model("llama"), max_seq_len=64, compile=False)
    layers, n_kv, d = len(runtime.layers), runtime.layers[0].n_kv, runtime.layers[0].head_dim
    bf16 = kv_bytes_per_token(layers, n_kv, d, torch.bfloat16)
    int8 = kv_bytes_per_token(layers, n_kv, d, torch.int8)
    assert bf16 == 2 * layers * n_kv * d * 2 and int8 == 2 * layers * n_kv * (d + 4)
    memory = 64 * 4 * bf16  # 64 bf16 blocks of 4 tokens

    def blocks(kv_dtype: str) -> int:
        return Scheduler(runtime, kv_memory=memory, block_size=4, kv_dtype=kv_dtype).pool.num_blocks

    assert blocks("bfloat16") == 64 and blocks("int8") == 64 * 2 * d // (d + 4)
    x = torch.randn(50, 2, 16) * torch.logspace(-2, 2, 50)[:, None, None]
    codes, scale = quantize_int8(x)
    # symmetric rounding: at most half a step per element, each token at its own scale
    assert (dequantize_int8(codes, scale) - x).abs().le(scale[..., None] / 2 + 1e-7).all()
    scheduler = Scheduler(runtime, num_blocks=32, block_size=4, kv_dtype="int8")
    tokens, exact, kl = kl_against_contiguous(scheduler, [3, 17, 29, 41, 5, 60, 7, 80], 8)
    # KL per token; this random model's activations are wide (init 0.3), a real model's cost is
    # measured by scripts/bench_kv_cache.py
    assert max(kl) < 0.05
    assert tokens[0] == int(exact[0].argmax())


# ---- the block pool ----------------------------------------------------------------------
def test_block_pool_counts_caches_and_evicts_least_recent_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    with pytest.raises(OutOfBlocks):
        pool.allocate()
    key_a, key_b = block_key(ROOT_KEY, [1, 2]), block_key(ROOT_KEY, [3, 4])
    pool.register(a, key_a)
    pool.register(b, key_b)
    pool.register(c, key_a)  # same content computed twice: the first copy stays cached
    for block in (b, a, c):
        pool.release(block)
    assert pool.available == 3 and pool.in_use == 0
    assert pool.lookup(key_a) == a and pool.lookup(key_b) == b
    pool.acquire(a)  # a hit takes it out of the evictable set
    assert pool.allocate() == c  # unkeyed blocks first
    assert pool.allocate() == b and pool.lookup(key_b) is None  # then the oldest cached
    assert pool.evictions == 1
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(c) or pool.release(c)


def test_block_keys_chain_over_the_whole_prefix():
    one = block_key(block_key(ROOT_KEY, [1, 2]), [5, 6])
    other = block_key(block_key(ROOT_KEY, [1, 3]), [5, 6])
    assert one != other and one == block_key(block_key(ROOT_KEY, [1, 2]), [5, 6])
    assert BlockPool(2, prefix_caching=False).lookup(one) is None


def test_heads_the_kernel_cannot_take_are_gathered_with_the_reason():
    """head_dim 12 (hidden 48, 4 heads): not a multiple of the decode kernel's 8 lanes. The
    scheduler gathers instead of calling it (which would refuse in C++), and says why."""
    model = make_tiny_model("llama", 0, hidden_size=48, head_dim=12, initializer_range=0.3)
    runtime = Runtime(model, max_seq_len=64, compile=False)
    scheduler = Scheduler(runtime, num_blocks=16, block_size=4, max_batch=2, prefill_budget=32)
    assert scheduler.attention_reason == "head_dim 12 is not a multiple of 8 (the kernel's " \
                                         "vector width)"
    requests = [([3, 17, 29, 41, 5], 8), ([250, 4, 2], 6)]
    alone = [runtime.generate([p], n)[0] for p, n in requests]
    assert drive(scheduler, requests, random.Random(0)) == alone


def test_logprobs_are_the_models_before_temperature():
    """A sampled request's events carry each drawn token's log-probability under the model
    (transformers' fp32 log-softmax at that position), not under the temperature's
    distribution, and the top k; a request that asks none carries none."""
    model = make_tiny_model("llama", 0, initializer_range=0.3)
    runtime = Runtime(model, max_seq_len=64, compile=False)
    scheduler = Scheduler(runtime, num_blocks=16, block_size=4, max_batch=2, prefill_budget=32)
    prompt = [3, 17, 29, 41]
    asked = scheduler.add(prompt, 6, temperature=5.0, seed=3, logprobs=2)
    plain = scheduler.add([250, 4, 2], 3)
    events = []
    while scheduler.has_work:
        events += scheduler.step()
    mine = [e for e in events if e.id == asked]
    assert all(e.logprob is None and e.top_logprobs is None for e in events if e.id == plain)
    tokens = [e.token for e in mine]
    with torch.no_grad():
        ref = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    ref = ref.double().log_softmax(-1)
    assert [e.logprob for e in mine] == pytest.approx(
        [float(ref[i, t]) for i, t in enumerate(tokens)], abs=1e-4)
    assert sum(float(ref[i, t]) < float(ref[i].max()) - 1e-3 for i, t in enumerate(tokens)) > 0
    for row, e in zip(ref, mine, strict=True):  # not always the argmax: sampled at T=5
        values, ids = row.topk(2)
        assert [t for t, _ in e.top_logprobs] == ids.tolist()
        assert [v for _, v in e.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
    with pytest.raises(ValueError, match="logprobs=999 must be in 0..320"):
        scheduler.add(prompt, 2, logprobs=999)


def _adjusted_greedy_reference(model, prompt, n, *, presence, frequency, repetition, bias):
    """Greedy tokens under the penalties and bias, written out from vLLM's definitions on
    transformers' float64 logits: the reference for ``sampling.adjust_logits``."""
    out = []
    for _ in range(n):
        with torch.no_grad():
            row = model.double()(torch.tensor([prompt + out])).logits[0, -1].clone()
        for t in set(prompt + out):
            row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
        for t in set(out):
            row[t] -= frequency * out.count(t) + presence
        for t, b in bias.items():
            row[t] += b
        out.append(int(row.argmax()))
    model.float()
    return out


@pytest.mark.parametrize(
    "presence, frequency, repetition, bias",
    [(1.5, 0.0, 1.0, {}), (0.0, 3.0, 1.0, {}), (0.0, 0.0, 1.8, {}), (0.0, 0.0, 0.6, {}),
     (0.0, 0.0, 1.0, {71: -5.0, 7: 2.0}), (0.8, 0.5, 1.3, {7: 2.0})],
    ids=["presence", "frequency", "repetition", "repetition-below-1", "bias", "all"],
)
def test_penalties_and_logit_bias_follow_their_definitions(presence, frequency, repetition,
                                                           bias):
    model = make_tiny_model("llama", 0, initializer_range=0.3)
    runtime = Runtime(model, max_seq_len=64, decode_dtype=torch.float32, compile=False)
    scheduler = Scheduler(runtime, num_blocks=16, block_size=4, max_batch=2, prefill_budget=32)
    prompt = [3, 17, 29, 41, 17]
    plain = runtime.generate([prompt], 10)[0]
    want = _adjusted_greedy_reference(model, prompt, 10, presence=presence, frequency=frequency,
                                      repetition=repetition, bias=bias)
    assert want != plain  # the adjustment changes the greedy tokens here: a real test
    asked = scheduler.add(prompt, 10, presence_penalty=presence, frequency_penalty=frequency,
                          repetition_penalty=repetition, logit_bias=bias)
    other = scheduler.add([250, 4, 2], 6)  # an unadjusted greedy row beside it
    assert drive_ids(scheduler, [asked, other]) == [want, runtime.generate([[250, 4, 2]], 6)[0]]


def test_min_tokens_holds_the_stop_tokens_back():
    model = make_tiny_model("llama", 0, initializer_range=0.3)
    runtime = Runtime(model, max_seq_len=64, compile=False)
    scheduler = Scheduler(runtime, num_blocks=16, block_size=4, max_batch=2, prefill_budget=32)
    stop = 9  # made the likeliest token by its bias: drawn as soon as it may be
    asked = scheduler.add([3, 17, 29], 12, stop_tokens={stop}, logit_bias={stop: 100.0},
                          min_tokens=4)
    events = []
    while scheduler.has_work:
        events += scheduler.step()
    tokens = [e.token for e in events if e.id == asked]
    assert len(tokens) == 5 and stop not in tokens[:4] and tokens[4] == stop
    assert events[-1].finish_reason == "stop"
    with pytest.raises(ValueError, match="min_tokens=13 in 0..max_tokens"):
        scheduler.add([3], 12, min_tokens=13)
    with pytest.raises(ValueError, match="logit_bias names tokens outside"):
        scheduler.add([3], 4, logit_bias={320: 1.0})


def drive_ids(scheduler: Scheduler, ids: list[int]) -> list[list[int]]:
    """Step ``scheduler`` until idle; the tokens of each request in ``ids``."""
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    while scheduler.has_work:
        for event in scheduler.step():
            if event.token is not None and event.id in tokens:
                tokens[event.id].append(event.token)
    return [tokens[i] for i in ids]


def test_adjusted_logits_by_hand():
    """Known values: repetition 2 halves the seen positive logit and doubles the seen negative
    one; frequency 0.5 x count and presence 1 per output token; bias added; the stop tokens
    masked until min_tokens."""
    from compress.runtime.sampling import adjust_logits, make_adjustments

    row = torch.tensor([2.0, -2.0, 1.0, -1.0, 3.0])
    got = adjust_logits(row, make_adjustments(repetition_penalty=2.0), [0, 1], [], frozenset())
    assert got.tolist() == [1.0, -4.0, 1.0, -1.0, 3.0] and row[1] == -2.0  # row untouched
    got = adjust_logits(row, make_adjustments(presence_penalty=1.0, frequency_penalty=0.5),
                        [0], [2, 2, 4], frozenset())
    assert got.tolist() == [2.0, -2.0, 1.0 - 1.0 - 1.0, -1.0, 3.0 - 1.0 - 0.5]
    got = adjust_logits(row, make_adjustments(logit_bias={3: 5.0}, min_tokens=2), [0], [1],
                        frozenset({4, 99}))  # 99: beyond the vocabulary, ignored
    assert got.tolist() == [2.0, -2.0, 1.0, 4.0, float("-inf")]
    got = adjust_logits(row, make_adjustments(min_tokens=2), [0], [1, 1], frozenset({4}))
    assert got.tolist() == row.tolist()


def test_min_p_keeps_the_tokens_above_its_share_of_the_likeliest():
    from compress.runtime.sampling import _make_sampling, _sample

    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(4000, 4).contiguous()
    kept = _sample(logits, _make_sampling(1.0, min_p=0.5, seed=0))
    assert set(kept.tolist()) == {0, 1}  # 0.15 and 0.05 < 0.5 x 0.5
    share = float((kept == 0).float().mean())
    assert abs(share - 0.5 / 0.8) < 0.03  # the kept ones renormalised: 0.625
    free = _sample(logits, _make_sampling(1.0, seed=0))
    assert set(free.tolist()) == {0, 1, 2, 3}


# heads of 64: the later chunks' attention through the prefill kernel at their offsets where it
# is held (cpu_attention.prefill_unavailable_reason), SDPA with is_causal's mask elsewhere
@pytest.mark.parametrize("head_dim", [16, 64])
def test_prompt_logprobs_are_the_models_over_chunks_and_cached_prefixes(head_dim):
    """Each prompt token's log-probability after the first (and its top 2) on the request's
    first event: transformers' fp32 log-softmax at those positions, the prompt prefilled in
    chunks of 4 beside another request, its prefix already in the cache (which it must not
    take: those positions would have no logits)."""
    model = make_tiny_model("llama", 0, initializer_range=0.3, head_dim=head_dim)
    runtime = Runtime(model, max_seq_len=64, compile=False)
    scheduler = Scheduler(runtime, num_blocks=32, block_size=4, max_batch=3, prefill_budget=6)
    prompt = [3, 17, 29, 41, 5, 60, 7, 80, 9, 10, 11]
    drive_ids(scheduler, [scheduler.add(prompt, 2)])  # caches the prompt's full blocks
    asked = scheduler.add(prompt, 3, prompt_logprobs=2, logprobs=0)
    other = scheduler.add([250, 4, 2, 9, 9], 3)
    events = []
    while scheduler.has_work:
        events += scheduler.step()
    mine = [e for e in events if e.id == asked]
    assert all(e.prompt_logprobs is None for e in events if e.id == other)
    assert mine[0].prompt_logprobs is not None and all(e.prompt_logprobs is None
                                                       for e in mine[1:])
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0, :-1].double().log_softmax(-1)
    got = mine[0].prompt_logprobs
    assert len(got) == len(prompt) - 1
    assert [lp for lp, _ in got] == pytest.approx(
        [float(ref[p, prompt[p + 1]]) for p in range(len(prompt) - 1)], abs=1e-4)
    for row, (_, top) in zip(ref, got, strict=True):
        values, ids = row.topk(2)
        assert [t for t, _ in top] == ids.tolist()
    assert [e.token for e in mine] == runtime.generate([prompt], 3)[0]


# ---- failures in a step -----------------------------------------------------------------------
MARKER = 13  # the failing request's setting, which the injected failure looks for


def _failing(original, bad):
    """``original`` that raises instead when ``bad(*its positional arguments)``."""
    def wrapper(*args, **kwargs):
        if bad(*args):
            raise RuntimeError("injected failure")
        return original(*args, **kwargs)
    return wrapper


# where one request's own work raises -> (the function wrapped, when it raises, what the failing
# request asks, what its error says failed)
OWN_FAILURES = {
    "sampling": ("_sample", lambda logits, s: s.top_k == MARKER,
                 {"temperature": 1.0, "top_k": MARKER}, "sampling its next token"),
    "adjustments": ("adjust_logits", lambda row, a, *_: (MARKER, 0.5) in a.logit_bias,
                    {"logit_bias": {MARKER: 0.5}}, "sampling its next token"),
    "logprobs": ("_logprobs", lambda seqs, _, tokens: any(seqs[i].logprobs == MARKER
                                                          for i in tokens),
                 {"logprobs": MARKER}, "computing its log-probabilities"),
    # (torch's: only the failing request asks for the top 13)
    "prompt-scores": ("topk", lambda _, k: k == MARKER, {"prompt_logprobs": MARKER},
                      "scoring its prompt"),
}
# the requests beside the failing one: greedy, with log-probs, seeded sampling, adjusted and
# prompt-scored (so each wrapped function also runs for a request it must not fail)
OTHERS = [
    ([1, 40, 50, 60], 10, {}),
    ([1, 70, 80], 8, {"logprobs": 2}),
    ([1, 40, 50, 61, 62], 9, {"temperature": 0.9, "seed": 7}),
    ([5, 6, 7, 8, 9, 10], 6, {"prompt_logprobs": 1, "logit_bias": {3: 1.0}}),
]


def run_requests(scheduler: Scheduler, requests) -> list[list]:
    """Add ``requests`` (prompt, max new tokens, ``add``'s keywords) at once and step until
    idle; each request's events."""
    ids = [scheduler.add(p, n, **kw) for p, n, kw in requests]
    events: dict[int, list] = {i: [] for i in ids}
    while scheduler.has_work:
        for event in scheduler.step():
            events[event.id].append(event)
    return [events[i] for i in ids]


@pytest.mark.parametrize("where", list(OWN_FAILURES))
def test_a_request_whose_own_work_raises_fails_alone(monkeypatch, where):
    """The failing request finishes with an error event naming what failed, its blocks freed;
    the requests in the same batch get the tokens they get without it."""
    import compress.runtime.scheduler as scheduler_module

    runtime = Runtime(family_model("llama"), max_seq_len=64, compile=False)
    expected = run_requests(Scheduler(runtime, num_blocks=32, block_size=4), OTHERS)
    name, bad, asks, what = OWN_FAILURES[where]
    owner = torch if name == "topk" else scheduler_module
    monkeypatch.setattr(owner, name, _failing(getattr(owner, name), bad))
    scheduler = Scheduler(runtime, num_blocks=32, block_size=4)
    *others, failed = run_requests(scheduler, [*OTHERS, ([1, 90, 91, 92], 8, asks)])
    assert [[e.token for e in events] for events in others] == [
        [e.token for e in events] for events in expected]
    assert others[1][0].logprob is not None and others[3][0].prompt_logprobs is not None
    assert len(failed) == 1 and failed[0].token is None and failed[0].finish_reason == "error"
    assert f"while {what}: RuntimeError: injected failure" in failed[0].error
    assert scheduler.pool.in_use == 0 and scheduler.stats.failed_requests == 1


def test_non_finite_logits_in_one_row_fail_that_request_alone(monkeypatch):
    """NaN logits in one row of a greedy batch (the one-call pick raises for every row): that
    request fails with the NumericsError, the rows beside it get their tokens."""
    import compress.runtime.scheduler as scheduler_module

    forward = scheduler_module.forward_step

    def poisoned(runtime, cache, decode, chunks, **kwargs):
        logits = forward(runtime, cache, decode, chunks, **kwargs)
        for j, chunk in enumerate(chunks):
            if 299 in chunk.tokens:
                logits[len(decode) + j] = float("nan")
        return logits

    monkeypatch.setattr(scheduler_module, "forward_step", poisoned)
    runtime = Runtime(family_model("llama"), max_seq_len=64, compile=False)
    scheduler = Scheduler(runtime, num_blocks=32, block_size=4)
    first = scheduler.add([1, 40, 50, 60], 12)
    events = scheduler.step() + scheduler.step()  # decoding when the others arrive
    bad, good = scheduler.add([1, 299, 7], 8), scheduler.add([2, 9, 4], 8)
    while scheduler.has_work:
        events += scheduler.step()
    assert scheduler.stats.mixed_steps > 0  # the poisoned row was sampled beside decode rows
    [failed] = [e for e in events if e.id == bad]
    assert failed.finish_reason == "error" and "NumericsError" in failed.error
    tokens = [[e.token for e in events if e.id == i] for i in (first, good)]
    assert tokens == [runtime.generate([[1, 40, 50, 60]], 12)[0],
                      runtime.generate([[2, 9, 4]], 8)[0]]
    assert scheduler.pool.in_use == 0


@pytest.mark.parametrize("decode_stack", [True, False])
def test_a_failed_forward_fails_its_requests_and_later_ones_get_fresh_tokens(monkeypatch,
                                                                             decode_stack):
    """A forward that raises after a layer wrote its keys: every request in it finishes with the
    error and every block goes back; requests after it (the same prompts, from the prefix cache,
    and a new one) get the tokens of a fresh runtime. In the Python layer loop and in the C++
    one (``decode_stack``)."""
    runtime = Runtime(family_model("llama"), max_seq_len=64, compile=False)
    scheduler = Scheduler(runtime, num_blocks=32, block_size=4, decode_stack=decode_stack)
    requests = [([1, 40, 50, 60, 70, 80], 12), ([1, 40, 50, 60, 71], 12), ([2, 9], 12)]
    ids = [scheduler.add(p, n) for p, n in requests]
    for _ in range(3):  # all three decoding, their first blocks full and in the prefix cache
        scheduler.step()

    def broken(*args, **kwargs):
        raise RuntimeError("injected kernel failure")

    monkeypatch.setattr(runtime.layers[1], "project_qkv", broken)  # the Python layer loop
    # the C++ one: layer 1's value pages in a dtype it refuses
    assert (scheduler.decode_stack is not None) == decode_stack, scheduler.decode_stack_reason
    pages = scheduler.cache.v[1]
    scheduler.cache.v[1] = pages.double()
    events = scheduler.step()
    scheduler.cache.v[1] = pages
    message = ("the pools must be contiguous fp32 or bf16" if decode_stack
               else "injected kernel failure")  # fmt: skip
    assert sorted(e.id for e in events) == ids
    assert all(e.finish_reason == "error" and e.token is None and "forward failed" in e.error
               and message in e.error for e in events)  # fmt: skip
    assert scheduler.pool.in_use == 0 and not scheduler.has_work
    assert scheduler.forward_failures == 1 and scheduler.stats.failed_requests == 3
    monkeypatch.undo()
    again = [*requests, ([3, 4, 5], 10)]
    assert drive(scheduler, again) == [runtime.generate([p], n)[0] for p, n in again]
    assert scheduler.stats.cached_prompt_tokens > 0 and scheduler.forward_failures == 0
    assert scheduler.pool.in_use == 0
