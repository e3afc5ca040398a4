"""Workloads: real tokenized prompts, arrival processes, and the loops that serve them.

Prompts are slices of real text (WikiText-2 test by default, via ``compress.data``) tokenized
once; prompt and output lengths are fixed or drawn uniformly from a range with a seeded
generator, so every variant sees the same requests. Arrivals are all-at-once (static batches),
Poisson at a rate (exponential gaps), or a trace file (JSON lines with ``arrival_s`` and optional
``prompt_tokens`` / ``output_tokens``).

``serve_scheduled`` drives the runtime's continuous-batching scheduler (``compress/runtime/
scheduler.py``: paged KV cache, chunked prefill, one batched decode forward per step): each
request is added when its arrival time has passed, every token is stamped when the step that
made it returns, and the KV memory in use is sampled per step. That is the engine the product
serves (``compress serve``).

``serve`` is the loop for engines without a scheduler, one iteration per decode step:
(1) admit every request that has arrived while a batch slot is free, running its prefill alone
(one request per prefill, its first token stamped when the prefill returns); (2) run one batched
decode step over all active requests; (3) retire requests that reached their output length.
Requests wait in the queue while others decode, so queueing shows up in TTFT. With
``HFEngine`` each request keeps its own KV cache; a decode step left-pads the caches to a common
length, masks the padding, passes each request's own positions, and splits the new cache back.
That copy per step costs time at long contexts; it keeps the loop short and exact (greedy
tokens match plain decoding, tested). ``StreamEngine`` serves any ``Stream`` callable by
advancing each request's iterator in turn: interleaved, not batched compute (transformers'
fallback for a model the runtime does not run).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.eval.latency import Clock, RequestTiming, Stream, model_forward, new_cache

Lengths = int | tuple[int, int]  # fixed, or (low, high) drawn uniformly, inclusive


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_new_tokens: int
    arrival_s: float = 0.0  # offset from the start of the workload


def _draw(rng: random.Random, spec: Lengths) -> int:
    return spec if isinstance(spec, int) else rng.randint(spec[0], spec[1])


def parse_lengths(text: str) -> Lengths:
    """``"64"`` -> 64; ``"16-128"`` -> (16, 128), drawn uniformly per request (CLI flag form)."""
    low, sep, high = text.partition("-")
    try:
        spec: Lengths = (int(low), int(high)) if sep else int(low)
    except ValueError:
        raise ValueError(f"expected N or LOW-HIGH token counts, got {text!r}") from None
    low_n, high_n = lengths_bounds(spec)
    if not 1 <= low_n <= high_n:
        raise ValueError(f"token counts must be >= 1 and LOW <= HIGH, got {text!r}")
    return spec


def lengths_bounds(spec: Lengths) -> tuple[int, int]:
    """(smallest, largest) length a spec can draw."""
    return (spec, spec) if isinstance(spec, int) else (spec[0], spec[1])


def lengths_mean(spec: Lengths) -> float:
    low, high = lengths_bounds(spec)
    return (low + high) / 2


def make_requests(
    token_ids: list[int],
    n: int,
    *,
    prompt_tokens: Lengths = 64,
    output_tokens: Lengths = 32,
    arrivals: list[float] | None = None,
    seed: int = 0,
) -> list[Request]:
    """``n`` requests whose prompts are consecutive slices of ``token_ids`` (a tokenized text)."""
    rng = random.Random(seed)
    lengths = [(_draw(rng, prompt_tokens), _draw(rng, output_tokens)) for _ in range(n)]
    prompts = _slices(token_ids, [p for p, _ in lengths])
    arrivals = arrivals if arrivals is not None else [0.0] * n
    return [Request(p, o, a) for p, (_, o), a in zip(prompts, lengths, arrivals, strict=True)]


def _slices(token_ids: list[int], lengths: list[int]) -> list[list[int]]:
    out, start = [], 0
    for length in lengths:
        if start + length > len(token_ids):
            start = 0  # wrap around: short texts still give n requests
        if length > len(token_ids):
            raise ValueError(f"prompt length {length} exceeds the {len(token_ids)}-token text")
        out.append(token_ids[start : start + length])
        start += length
    return out


def trace_requests(
    token_ids: list[int], trace: list[dict[str, Any]], *, prompt_tokens: int, output_tokens: int
) -> list[Request]:
    """Requests of a trace (``read_trace`` rows): its arrivals, its lengths where a row gives
    them (else the defaults), prompts sliced from ``token_ids`` like ``make_requests``."""
    lengths = [
        (int(r.get("prompt_tokens", prompt_tokens)), int(r.get("output_tokens", output_tokens)))
        for r in trace
    ]
    prompts = _slices(token_ids, [p for p, _ in lengths])
    return [
        Request(p, o, float(r["arrival_s"]))
        for p, (_, o), r in zip(prompts, lengths, trace, strict=True)
    ]


def poisson_arrivals(n: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """Arrival offsets of a Poisson process: exponential gaps with mean 1 / rate."""
    if rate_per_s <= 0:
        raise ValueError(f"Poisson rate must be positive (requests/s), got {rate_per_s}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """A trace file: one JSON object per line with ``arrival_s`` (and optional lengths)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON object ({exc})") from None
            if not isinstance(row, dict) or "arrival_s" not in row:
                raise ValueError(f"{path}:{number}: each line needs an 'arrival_s' field")
            bad = [k for k in ("prompt_tokens", "output_tokens") if k in row and row[k] < 1]
            if row["arrival_s"] < 0 or bad:
                raise ValueError(
                    f"{path}:{number}: arrival_s must be >= 0 and token counts >= 1, got {row}"
                )
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: the trace has no requests")
    return rows


# ---- engines ------------------------------------------------------------------------------
class HFEngine:
    """Greedy prefill and batched decode over a Hugging Face causal LM, one cache per request.

    A request's state is ``[(k, v), ...]`` per layer, each ``[1, kv_heads, T, head_dim]``.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def prefill(self, prompt: list[int], max_new_tokens: int = 0) -> tuple[int, Any]:
        cache = new_cache(self.model)
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        logits = model_forward(self.model, ids, cache)
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        return int(logits[0, -1].argmax()), layers

    @torch.no_grad()
    def decode(self, states: list[Any], last_tokens: list[int]) -> list[int]:
        lengths = [state[0][0].shape[2] for state in states]
        longest = max(lengths)
        cache = new_cache(self.model)
        for index in range(len(states[0])):
            keys, values = [], []
            for state, length in zip(states, lengths, strict=True):
                k, v = state[index]
                pad = (0, 0, longest - length, 0)  # left-pad the T axis of [1, H, T, D]
                keys.append(torch.nn.functional.pad(k, pad))
                values.append(torch.nn.functional.pad(v, pad))
            cache.update(torch.cat(keys), torch.cat(values), index)
        mask = torch.zeros(len(states), longest + 1, dtype=torch.long, device=self.device)
        for row, length in enumerate(lengths):
            mask[row, longest - length :] = 1
        ids = torch.tensor(last_tokens, dtype=torch.long, device=self.device)[:, None]  # [B, 1]
        positions = torch.tensor(lengths, dtype=torch.long, device=self.device)[:, None]
        logits = model_forward(self.model, ids, cache, attention_mask=mask, position_ids=positions)
        for row, (state, length) in enumerate(zip(states, lengths, strict=True)):
            drop = longest - length
            state[:] = [
                (layer.keys[row : row + 1, :, drop:], layer.values[row : row + 1, :, drop:])
                for layer in cache.layers
            ]
        return [int(t) for t in logits[:, -1].argmax(-1)]


class StreamEngine:
    """Serves ``Stream`` callables: each request's iterator is advanced one token per step."""

    def __init__(self, stream: Stream):
        self.stream = stream

    def prefill(self, prompt: list[int], max_new_tokens: int) -> tuple[int, Any]:
        iterator: Iterator[int] = iter(self.stream(prompt, max_new_tokens))
        return int(next(iterator)), iterator

    def decode(self, states: list[Any], last_tokens: list[int]) -> list[int]:
        return [int(next(it)) for it in states]


# ---- the serving loop ---------------------------------------------------------------------
def serve(
    engine: HFEngine | StreamEngine,
    requests: list[Request],
    *,
    max_batch: int = 8,
    clock: Clock = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[list[RequestTiming], float]:
    """Run ``requests`` through the continuous-batching loop of the module docstring.

    Returns the timings (in request order) and the wall-clock duration of the workload.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    timings: list[RequestTiming | None] = [None] * len(requests)
    active: list[tuple[int, Any]] = []  # (request index, engine state)
    start = clock()
    while order or active:
        while order and len(active) < max_batch and requests[order[0]].arrival_s <= clock() - start:
            i = order.pop(0)
            timing = RequestTiming(start + requests[i].arrival_s, len(requests[i].prompt))
            token, state = engine.prefill(requests[i].prompt, requests[i].max_new_tokens)
            timing.token_times.append(clock())
            timing.tokens.append(token)
            timings[i] = timing
            if requests[i].max_new_tokens > 1:
                active.append((i, state))
        if not active:
            if order:  # idle: wait for the next arrival
                sleep(max(0.0, start + requests[order[0]].arrival_s - clock()))
            continue
        tokens = engine.decode([s for _, s in active], [timings[i].tokens[-1] for i, _ in active])
        now = clock()
        for (i, _), token in zip(active, tokens, strict=True):
            timings[i].token_times.append(now)
            timings[i].tokens.append(token)
        active = [(i, s) for i, s in active if len(timings[i].tokens) < requests[i].max_new_tokens]
    return [t for t in timings if t is not None], clock() - start


def serve_scheduled(
    scheduler,
    requests: list[Request],
    *,
    clock: Clock = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[list[RequestTiming], float, dict[str, Any]]:
    """Run ``requests`` through a ``compress.runtime.scheduler.Scheduler`` (greedy, every
    request to its full length: no stop tokens). Returns the timings in request order, the
    wall-clock duration and what the cache did: ``kv_bytes_peak`` and ``kv_bytes_mean`` (in
    use, sampled per step), ``prefix_hit_rate``, ``preemptions``, ``mean_decode_rows_per_step``."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    timings: list[RequestTiming | None] = [None] * len(requests)
    index_of: dict[int, int] = {}
    in_use: list[int] = []
    before = (scheduler.stats.decode_rows, scheduler.stats.steps, scheduler.stats.preemptions,
              scheduler.stats.prompt_tokens, scheduler.stats.cached_prompt_tokens)  # fmt: skip
    start = clock()
    while order or scheduler.has_work:
        now = clock() - start
        while order and requests[order[0]].arrival_s <= now:
            i = order.pop(0)
            timings[i] = RequestTiming(start + requests[i].arrival_s, len(requests[i].prompt))
            index_of[scheduler.add(requests[i].prompt, requests[i].max_new_tokens)] = i
        if not scheduler.has_work:
            sleep(max(0.0, start + requests[order[0]].arrival_s - clock()))
            continue
        events = scheduler.step()
        stamp = clock()
        in_use.append(scheduler.kv_bytes_in_use())
        for event in events:
            timing = timings[index_of[event.id]]
            timing.token_times.append(stamp)
            timing.tokens.append(event.token)
    duration = clock() - start
    stats = scheduler.stats
    rows, steps = stats.decode_rows - before[0], stats.steps - before[1]
    prompt, cached = stats.prompt_tokens - before[3], stats.cached_prompt_tokens - before[4]
    cache = {
        "kv_bytes_peak": max(in_use, default=0),
        "kv_bytes_mean": sum(in_use) / len(in_use) if in_use else 0.0,
        "kv_dtype": str(scheduler.cache.dtype).removeprefix("torch."),
        "prefix_hit_rate": cached / prompt if prompt else None,
        "preemptions": stats.preemptions - before[2],
        "mean_decode_rows_per_step": rows / steps if steps else None,
    }
    return [t for t in timings if t is not None], duration, cache
