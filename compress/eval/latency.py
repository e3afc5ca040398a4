"""Latency and throughput metrics: per-request timing, distributions, goodput, resources, cost.

Every output token is stamped with an injectable clock (``time.perf_counter`` by default; tests
pass a fake clock and get exact numbers). From the stamps of one request:

- TTFT = first token time - arrival time (queueing + prefill);
- ITL = every gap between consecutive tokens; TPOT = (last - first) / (n - 1), the mean ITL;
- end-to-end latency = last token time - arrival time.

Distributions use numpy's default (linear-interpolation) percentiles. Goodput counts only the
requests that meet an SLO (TTFT and/or TPOT bounds). MBU = bytes a decode step must read
(weights + KV cache) / step time / measured bandwidth; MFU = prefill FLOPs / prefill time /
measured matmul peak (see ``hardware.py``). Tokens come from ``compress.runtime.engine.Runtime``
(``runtime_stream``), the engine ``compress generate`` serves; transformers' loop
(``hf_stream``) runs only models the runtime does not, and says so. Generation is greedy with a
fixed number of new tokens (EOS ignored) so every variant does the same amount of work. Timings
are never asserted in tests: they depend on the machine and on whatever else runs on it.
"""

from __future__ import annotations

import inspect
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

Clock = Callable[[], float]
Stream = Callable[[list[int], int], Iterator[int]]  # (prompt ids, max new tokens) -> tokens
PERCENTILES = (50, 90, 95, 99)


# ---- per-request timing -------------------------------------------------------------------
@dataclass
class RequestTiming:
    """Clock stamps of one request (seconds on the clock's own scale)."""

    arrival: float  # when the request entered the queue
    prompt_tokens: int
    token_times: list[float] = field(default_factory=list)  # when each output token was ready
    tokens: list[int] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.arrival


def time_request(
    stream: Stream,
    prompt: list[int],
    max_new_tokens: int,
    *,
    clock: Clock = time.perf_counter,
    arrival: float | None = None,
) -> RequestTiming:
    """Run one request through ``stream`` and stamp every token as it is yielded."""
    timing = RequestTiming(clock() if arrival is None else arrival, len(prompt))
    for token in stream(prompt, max_new_tokens):
        timing.token_times.append(clock())
        timing.tokens.append(int(token))
    if not timing.token_times:
        raise ValueError("the stream yielded no tokens; max_new_tokens must be >= 1")
    return timing


# ---- token streams: the runtime, transformers only where the runtime cannot run the model ----
def model_forward(model: nn.Module, ids: torch.Tensor, cache: Any, **kwargs: Any) -> torch.Tensor:
    """Logits of ``model(ids)`` that extend ``cache`` in place. transformers >= 5.2x renamed
    ``past_key_values`` to ``cache``; older versions only know the old name."""
    params = inspect.signature(model.forward).parameters
    key = "cache" if "cache" in params else "past_key_values"
    return model(ids, use_cache=True, **{key: cache}, **kwargs).logits


def new_cache(model: nn.Module) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def hf_stream(model: nn.Module, *, generate: bool = False) -> Stream:
    """A ``Stream`` of plain greedy decoding through transformers' forward and KV cache, one
    token per step: the fallback for models the runtime does not run, and ``--engine hf``.
    Its ``engine`` attribute is ``"hf"``.

    ``generate=True``: the tokens come from transformers' own ``model.generate`` loop instead
    (greedy, no EOS: exactly ``max_new_tokens``), for rows that time transformers itself;
    ``engine`` is ``"hf generate"``. generate runs in a worker thread and hands each token over
    through a streamer as its step finishes, so ``time_request`` stamps every token when it is
    ready (plus one queue hand-off, microseconds). Closing the stream early waits for generate.
    """
    device = next(model.parameters()).device
    if generate:

        def generated(prompt: list[int], max_new_tokens: int) -> Iterator[int]:
            return _generate_tokens(model, torch.tensor([prompt], device=device), max_new_tokens)

        generated.engine = "hf generate"
        return generated

    @torch.no_grad()
    def stream(prompt: list[int], max_new_tokens: int) -> Iterator[int]:
        cache = new_cache(model)
        ids = torch.tensor([prompt], dtype=torch.long, device=device)
        for _ in range(max_new_tokens):
            logits = model_forward(model, ids, cache)
            token = int(logits[0, -1].argmax())
            yield token
            ids = torch.tensor([[token]], dtype=torch.long, device=device)

    stream.engine = "hf"
    return stream


_END = object()  # the streamer's end-of-request marker


def _generate_tokens(model: nn.Module, ids: torch.Tensor, max_new_tokens: int) -> Iterator[int]:
    """Tokens of ``model.generate(ids)`` ([1, T] prompt) as its streamer receives them."""
    from transformers.generation.streamers import BaseStreamer

    handoff: queue.SimpleQueue = queue.SimpleQueue()

    class Handoff(BaseStreamer):
        prompt_seen = False  # generate's first put() is the prompt itself

        def put(self, value: torch.Tensor) -> None:
            if self.prompt_seen:
                handoff.put(int(value.reshape(-1)[0]))  # [batch=1] or [1, 1]
            self.prompt_seen = True

        def end(self) -> None:
            handoff.put(_END)

    def run() -> None:
        try:
            # eos_token_id=None: EOS is an ordinary token (as in the runtime), so every request
            # does the same work and the tokens are plain argmax (min_new_tokens would instead
            # mask EOS and change them).
            model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0,
                streamer=Handoff(),
            )  # fmt: skip
        except BaseException as exc:  # re-raised in the consumer's thread
            handoff.put(exc)

    worker = threading.Thread(target=run, name="hf-generate", daemon=True)
    worker.start()
    try:
        while (item := handoff.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        worker.join()


def seq_len_for(longest: int) -> int:
    """Cache slots for requests of at most ``longest`` tokens (prompt + output), rounded up to
    64 so that nearby workloads share compiled shapes."""
    return -(-longest // 64) * 64


# the runtime's int4/int8 decode kernels: torch's (bf16 activations) or ours (int8-rounded
# activations, integer dot products; compress.kernels.cpu_q8)
INT_KERNELS = ("torch", "ours")


def _runtime(
    model: nn.Module, max_seq_len: int, compile: bool, int_kernels: str, static_cache: bool = True
):
    """The runtime over ``model`` with torch's or our int4/int8 kernels (``INT_KERNELS``). The
    model keeps its weights (``keep_model_weights``): latency runs build one runtime per run
    from the same model, and the caller goes on using it."""
    from compress.runtime.engine import Runtime

    if int_kernels not in INT_KERNELS:
        raise ValueError(f"int_kernels={int_kernels!r}: expected one of {INT_KERNELS}")
    ours = int_kernels == "ours"
    return Runtime(
        model,
        max_seq_len=max_seq_len,
        compile=compile,
        int4_kernel="q4q8" if ours else "torch",
        int8_kernel="q8q8" if ours else "torch",
        keep_model_weights=True,
        static_cache=static_cache,
    )


def runtime_stream(
    model: nn.Module,
    *,
    max_seq_len: int,
    slots: int = 1,
    compile: bool = False,
    int_kernels: str = "torch",
) -> Stream:
    """A greedy ``Stream`` over ``compress.runtime.engine.Runtime`` (static KV cache): the engine
    that ``compress generate`` serves. Its ``engine`` attribute says who made the tokens:
    ``"runtime"``, ``"runtime, our int kernels (<ISA>)"`` when ``int_kernels="ours"`` put int4/
    int8 layers on our integer-dot decode kernels (``compress.kernels.cpu_q8``), or
    ``"hf fallback"`` (``hf_stream``, reason in ``fallback_reason``) for a model the runtime
    does not run.

    A Runtime has one cache, so requests open at the same time (``StreamEngine`` interleaves up
    to ``slots`` of them) each take a fork of it; a fork is handed back as soon as its request's
    last token is out, because ``serve`` stops advancing a finished iterator without closing it.
    """
    from compress.runtime.engine import unsupported_reason

    reason = unsupported_reason(model)
    if reason is not None:
        fallback = hf_stream(model)
        fallback.engine, fallback.fallback_reason = "hf fallback", reason
        return fallback
    first = _runtime(model, max_seq_len, compile, int_kernels)
    free = [first] + [first.fork() for _ in range(slots - 1)]

    def stream(prompt: list[int], max_new_tokens: int) -> Iterator[int]:
        if not free:
            raise RuntimeError(f"more than {slots} requests open at once on the runtime pool")
        runtime = free.pop()
        tokens = runtime.stream(prompt, max_new_tokens)
        try:
            for index in range(max_new_tokens):
                token = next(tokens)
                if index == max_new_tokens - 1:
                    tokens.close()
                    free.append(runtime)
                    runtime = None
                yield token
        finally:
            if runtime is not None:  # closed early: the cache is free again
                tokens.close()
                free.append(runtime)

    engine = f"runtime, our int kernels ({first.q8_isa})" if first.q8_layers else "runtime"
    stream.engine, stream.fallback_reason = engine, None
    return stream


def runtime_scheduler(
    model: nn.Module,
    *,
    max_seq_len: int,
    max_batch: int,
    int_kernels: str = "torch",
    kv_dtype: str | None = None,
    kv_memory: int | None = None,
    block_size: int = 16,
    prefix_caching: bool = True,
):
    """The runtime's continuous-batching scheduler over ``model`` (``compress serve``'s engine),
    or None for a model the runtime does not run. ``kv_memory`` None sizes the paged cache for
    ``max_batch`` requests of ``max_seq_len`` tokens (no preemption); ``engine_name`` names it
    for reports."""
    from compress.runtime.engine import unsupported_reason
    from compress.runtime.scheduler import Scheduler

    if unsupported_reason(model) is not None:
        return None
    runtime = _runtime(model, max_seq_len, False, int_kernels, static_cache=False)  # paged only
    blocks = None if kv_memory is not None else max_batch * -(-max_seq_len // block_size) + 1
    return Scheduler(
        runtime,
        kv_memory=kv_memory,
        num_blocks=blocks,
        block_size=block_size,
        max_batch=max_batch,
        kv_dtype=kv_dtype,
        prefix_caching=prefix_caching,
    )


def engine_name(scheduler) -> str:
    """How reports name the scheduler's engine."""
    rt = scheduler.runtime
    kernels = f", our int kernels ({rt.q8_isa})" if rt.q8_layers else ""
    kv = str(scheduler.cache.dtype).removeprefix("torch.")
    return f"runtime scheduler (continuous batching, paged {kv} KV{kernels})"


def decode_speed(
    model: nn.Module, prompt: list[int], new_tokens: int, repeats: int
) -> dict[str, Any]:
    """TTFT (ms) and decode tokens/s of greedy ``runtime_stream`` requests, best of ``repeats``
    after one warm-up (first-call allocations and lazy inits): the least disturbed request on
    shared cores; ``engine`` names who made the tokens. For distributions use
    ``compress compare --latency``."""
    stream = runtime_stream(model, max_seq_len=seq_len_for(len(prompt) + new_tokens))
    time_request(stream, prompt, 2)
    timings = [time_request(stream, prompt, new_tokens) for _ in range(repeats)]
    best = min(timings, key=lambda t: t.e2e)
    return {"ttft_ms": 1e3 * best.ttft, "decode_tok_s": 1.0 / best.tpot, "engine": stream.engine}


# ---- statistics ---------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default method), q in [0, 100]."""
    if not values:
        raise ValueError("percentile of an empty list")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: list[float], scale: float = 1.0) -> dict[str, float | int] | None:
    """n, mean, std, min, max and p50/p90/p95/p99 of ``values`` times ``scale`` (e.g. 1e3 ms)."""
    values = [v * scale for v in values if v is not None]
    if not values:
        return None
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    out: dict[str, float | int] = {"n": len(values), "mean": mean, "std": std}
    out.update(min=min(values), max=max(values))
    out.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    return out


@dataclass(frozen=True)
class Slo:
    """Service-level objective; None means no bound on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met_by(self, t: RequestTiming) -> bool:
        if self.ttft_ms is not None and t.ttft * 1e3 > self.ttft_ms:
            return False
        # A single-token request has no TPOT; it cannot violate a TPOT bound.
        if self.tpot_ms is not None and t.tpot is not None and t.tpot * 1e3 > self.tpot_ms:
            return False
        return True


def throughput(timings: list[RequestTiming], duration_s: float) -> dict[str, float]:
    """Requests/s and input/output/total tokens/s over a wall-clock ``duration_s``."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    inp = sum(t.prompt_tokens for t in timings)
    out = sum(len(t.token_times) for t in timings)
    return {
        "requests_per_s": len(timings) / duration_s,
        "input_tokens_per_s": inp / duration_s,
        "output_tokens_per_s": out / duration_s,
        "total_tokens_per_s": (inp + out) / duration_s,
    }


def goodput(timings: list[RequestTiming], slo: Slo, duration_s: float) -> dict[str, Any]:
    """Throughput counting only requests that meet ``slo``; zero (not an error) if none do."""
    good = [t for t in timings if slo.met_by(t)]
    rates = throughput(good, duration_s)
    return {
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "requests_meeting_slo": len(good),
        "requests": len(timings),
        "fraction": len(good) / len(timings) if timings else 0.0,
        "requests_per_s": rates["requests_per_s"],
        "output_tokens_per_s": rates["output_tokens_per_s"],
    }


def cost(usd_per_hour: float, goodput_stats: dict[str, Any]) -> dict[str, float | None]:
    """$ per 1M output tokens and per request at the measured goodput (None when goodput is 0)."""
    per_s = usd_per_hour / 3600
    tok_s, req_s = goodput_stats["output_tokens_per_s"], goodput_stats["requests_per_s"]
    return {
        "usd_per_hour": usd_per_hour,
        "usd_per_1m_output_tokens": per_s / tok_s * 1e6 if tok_s > 0 else None,
        "usd_per_request": per_s / req_s if req_s > 0 else None,
    }


def summarize(timings: list[RequestTiming], duration_s: float, slo: Slo) -> dict[str, Any]:
    """Distributions (ms), throughput and goodput of a finished workload."""
    return {
        "requests": len(timings),
        "ttft_ms": distribution([t.ttft for t in timings], 1e3),
        "tpot_ms": distribution([t.tpot for t in timings], 1e3),
        "itl_ms": distribution([g for t in timings for g in t.itl], 1e3),
        "e2e_ms": distribution([t.e2e for t in timings], 1e3),
        "duration_s": duration_s,
        "throughput": throughput(timings, duration_s),
        "goodput": goodput(timings, slo, duration_s),
    }


# ---- resources and roofline ---------------------------------------------------------------
def kv_bytes_per_token(model: nn.Module) -> int:
    """K and V bytes one token adds to the cache: 2 * layers * kv_heads * head_dim * dtype;
    latent attention (DeepSeek): layers * (latent + rotary key) * dtype, what transformers and
    our runtime (``compress.runtime.latent``) cache."""
    from compress.arch import ARCHS
    from compress.runtime.families import head_dim_of_config, kv_heads_of

    cfg = model.config
    arch = ARCHS.get(getattr(cfg, "model_type", None), ARCHS["llama"])
    elem = next(model.parameters()).element_size()
    if arch.latent_attention:
        _, rope, _, rank = (int(getattr(cfg, k)) for k in arch.latent_attention.widths)
        return cfg.num_hidden_layers * (rank + rope) * elem
    kv_heads, head_dim = kv_heads_of(cfg, arch), head_dim_of_config(cfg)
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * elem


def matmul_params(model: nn.Module) -> int:
    """Weights that take part in matmuls per token (every Linear/QuantLinear, lm_head included)."""
    return sum(
        m.in_features * m.out_features
        for m in model.modules()
        if hasattr(m, "in_features") and hasattr(m, "out_features")
    )


def prefill_flops(model: nn.Module, prompt_tokens: int) -> float:
    """2 * matmul params * T for the projections + 2 * layers * T^2 * attention width for
    QK^T and AV under a causal mask (half of the 4 * T^2 * width of a full square)."""
    cfg = model.config
    width = (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads) * (
        cfg.num_attention_heads
    )
    t = prompt_tokens
    return 2.0 * matmul_params(model) * t + 2.0 * cfg.num_hidden_layers * t * t * width


def bandwidth_utilization(
    bytes_per_step: float, step_s: float | None, bandwidth_bps: float
) -> float | None:
    """MBU: the bytes one decode step must read / the step's time / the measured read
    bandwidth (``hardware.memory_bandwidth``); None without a step time."""
    return bytes_per_step / step_s / bandwidth_bps if step_s else None


def roofline(
    *,
    weight_bytes: int,
    kv_per_token: int,
    matmul_weights: int,
    prompt_tokens: int,
    mean_context: float,
    decode_step_s: float | None,
    prefill_s: float | None,
    prefill_flops_: float,
    bandwidth_bps: float,
    peak_flops: float,
    batch: int = 1,
) -> dict[str, Any]:
    """MBU of decode, MFU of prefill, and a bound verdict per phase from arithmetic intensity
    (FLOPs per byte moved) against the machine balance (peak FLOP/s / bandwidth). A decode step
    of ``batch`` rows reads the weights once and every row's KV cache."""
    balance = peak_flops / bandwidth_bps
    step_bytes = weight_bytes + kv_per_token * mean_context * batch
    decode_intensity = 2.0 * matmul_weights * batch / step_bytes
    prefill_intensity = prefill_flops_ / (weight_bytes + kv_per_token * prompt_tokens)

    def verdict(intensity: float) -> str:
        kind = "memory-bandwidth-bound" if intensity < balance else "compute-bound"
        return f"{kind} ({intensity:.3g} FLOP/B vs machine balance {balance:.3g} FLOP/B)"

    mbu = bandwidth_utilization(step_bytes, decode_step_s, bandwidth_bps)
    mfu = prefill_flops_ / prefill_s / peak_flops if prefill_s else None
    return {
        "decode_batch": batch,
        "decode_bytes_per_step": step_bytes,
        "mbu": mbu,
        "decode_verdict": verdict(decode_intensity),
        "prefill_flops": prefill_flops_,
        "mfu": mfu,
        "prefill_verdict": verdict(prefill_intensity),
        "bandwidth_gbps": bandwidth_bps / 1e9,
        "peak_gflops": peak_flops / 1e9,
    }
