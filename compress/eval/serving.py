"""Latency runs of ``compress compare``: every model measured under one workload and engine.

A run is a list of requests cut from real text (``workload.make_requests`` or a trace). The
``single`` workload times one request at a time on the static-cache runtime (busy time = the
sum of request latencies); the others (wall time of the workload) go through the runtime's
continuous-batching scheduler (``runtime``, the default: the engine ``compress serve`` runs;
paged KV cache sized for ``max_batch`` requests, ``workload.serve_scheduled``) or through
transformers' batched decode (``hf``, ``workload.serve``). Every row names its ``engine``; a
model the runtime does not run is timed on transformers and marked ``hf fallback``. Models run
interleaved, round by round, each after one warm-up request, so that load from other work on the
machine hits every model alike. ``batch`` gives one run per batch size; its rows carry a
``batch_size`` key and its details are keyed by batch size.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from compress.eval.hardware import matmul_peak, memory_bandwidth
from compress.eval.latency import (
    Slo,
    cost,
    engine_name,
    hf_stream,
    kv_bytes_per_token,
    matmul_params,
    prefill_flops,
    roofline,
    runtime_scheduler,
    runtime_stream,
    seq_len_for,
    summarize,
    time_request,
)
from compress.eval.workload import (
    HFEngine,
    Request,
    StreamEngine,
    lengths_bounds,
    lengths_mean,
    make_requests,
    poisson_arrivals,
    read_trace,
    serve,
    serve_scheduled,
    trace_requests,
)

if TYPE_CHECKING:
    from compress.eval.compare import CompareSettings

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = [1, 4, 8]


def time_rounds(streams, requests, rounds: int) -> list[list[Any]]:
    """Timings per stream, one request at a time, rounds interleaved across models; one warm-up
    request each first."""
    for stream in streams:
        time_request(stream, requests[0].prompt, 2)  # warm-up, excluded
    timings: list[list[Any]] = [[] for _ in streams]
    for _ in range(rounds):
        for index, stream in enumerate(streams):
            for req in requests:
                timings[index].append(time_request(stream, req.prompt, req.max_new_tokens))
    return timings


def _serve_one(engine, requests: list[Request], max_batch: int):
    """(timings, wall seconds, cache record or None) of one pass through ``engine``: a
    ``Scheduler`` (continuous batching) or an engine of ``workload.serve``."""
    if isinstance(engine, HFEngine | StreamEngine):
        return (*serve(engine, requests, max_batch=max_batch), None)
    return serve_scheduled(engine, requests)


def _serve_rounds(engines, requests, max_batch: int, rounds: int):
    """Timings, summed wall time and the last round's cache record per engine, rounds
    interleaved."""
    for engine in engines:
        _serve_one(engine, [Request(requests[0].prompt, 2)], 1)  # warm-up, excluded
    timings: list[list[Any]] = [[] for _ in engines]
    durations = [0.0] * len(engines)
    caches: list[dict[str, Any] | None] = [None] * len(engines)
    for _ in range(rounds):
        for index, engine in enumerate(engines):
            done, duration, caches[index] = _serve_one(engine, requests, max_batch)
            timings[index] += done
            durations[index] += duration
    return timings, durations, caches


def _runs(ids: list[int], s: CompareSettings) -> list[tuple[dict[str, Any], list[Request]]]:
    """(description, requests) of every latency run: one, or one per batch size."""
    lengths = dict(prompt_tokens=s.prompt_tokens, output_tokens=s.output_tokens)
    if s.workload == "batch":
        # Static batch: all B requests arrive at t=0 and are served B at a time.
        return [
            ({"batch_size": b, "max_batch": b}, make_requests(ids, b, **lengths))
            for b in s.batch_sizes or DEFAULT_BATCH_SIZES
        ]
    if s.workload == "poisson":
        arrivals = poisson_arrivals(s.requests, s.rate)
        requests = make_requests(ids, s.requests, arrivals=arrivals, **lengths)
        return [({"max_batch": s.max_batch, "rate_per_s": s.rate}, requests)]
    if s.workload == "trace":
        requests = trace_requests(ids, read_trace(s.trace), **lengths)
        return [({"max_batch": s.max_batch, "trace": s.trace}, requests)]
    return [({}, make_requests(ids, s.prompts, **lengths))]


def _measure(models, requests: list[Request], max_batch: int | None, s: CompareSettings):
    """Timings, busy/wall seconds, cache records and the engine that made the tokens, per
    model, for one run. ``runtime`` falls back to transformers (engine ``"hf fallback"``) only
    for a model the runtime does not run."""
    need = seq_len_for(max(len(r.prompt) + r.max_new_tokens for r in requests))

    def stream(model):
        if s.engine == "hf":
            return hf_stream(model)
        return runtime_stream(model, max_seq_len=need, compile=s.compile, int_kernels=s.int_kernels)

    if max_batch is None:  # single stream: the server is busy only inside requests
        streams = [stream(m) for m in models]
        timings = time_rounds(streams, requests, s.rounds)
        busy = [sum(t.e2e for t in ts) for ts in timings]
        return timings, busy, [None] * len(models), [st.engine for st in streams]
    engines, names = [], []
    for model in models:
        scheduler = None
        if s.engine == "runtime":
            scheduler = runtime_scheduler(
                model, max_seq_len=need, max_batch=max_batch, int_kernels=s.int_kernels,
                kv_dtype=None if s.kv_dtype == "auto" else s.kv_dtype,
            )  # fmt: skip
        if scheduler is not None:
            engines.append(scheduler)
            names.append(engine_name(scheduler))
        elif s.engine == "hf":
            engines.append(HFEngine(model))
            names.append("hf")
        else:  # a model the runtime does not run: transformers, one request at a time
            fallback = stream(model)
            engines.append(StreamEngine(fallback))
            names.append(f"{fallback.engine} (interleaved, not batched)")
    return (*_serve_rounds(engines, requests, max_batch, s.rounds), names)


def served_latency(model, ids: list[int], s: CompareSettings) -> list[dict[str, Any]]:
    """One model under a batch or poisson workload (a recipe's ``eval.latency``): per run its
    description, engine, summary (distributions, throughput, goodput), cost and cache use."""
    slo = Slo(s.slo_ttft_ms, s.slo_tpot_ms)
    out = []
    for run, requests in _runs(ids, s):
        timings, durations, caches, engines = _measure([model], requests, run["max_batch"], s)
        stats = summarize(timings[0], durations[0], slo)
        out.append(
            {
                **run,
                "engine": engines[0],
                "summary": stats,
                "kv_cache": caches[0],
                "cost": cost(s.usd_per_hour, stats["goodput"]),
            }
        )
    return out


def measure_latency(rows, details, names, loaded, s: CompareSettings, ids):
    """Latency rows (one set per run) and the workload record for the JSON."""
    bandwidth = memory_bandwidth()["bytes_per_s"]
    peak = matmul_peak()["flops_per_s"]
    slo = Slo(s.slo_ttft_ms, s.slo_tpot_ms)
    models = [lm.model for lm in loaded]
    workload: dict[str, Any] = {
        "kind": s.workload,
        "engine": s.engine,
        "rounds": s.rounds,
        "runs": [],
    }
    out_rows = []
    for run, requests in _runs(ids, s):
        started = time.perf_counter()
        all_timings, durations, caches, engines = _measure(
            models, requests, run.get("max_batch"), s
        )
        log.info("latency run %s took %.1f s", run, time.perf_counter() - started)
        workload["runs"].append(
            {
                **run,
                "requests": len(requests),
                "arrival_s": [r.arrival_s for r in requests],
                "prompt_tokens": [len(r.prompt) for r in requests],
                "output_tokens": [r.max_new_tokens for r in requests],
            }
        )
        for row, name, model, timings, duration, engine, cache in zip(
            rows, names, models, all_timings, durations, engines, caches, strict=True
        ):
            new = {**row, **({"batch_size": run["batch_size"]} if "batch_size" in run else {})}
            new["engine"] = engine
            record = _latency_record(new, model, timings, duration, slo, s, bandwidth, peak)
            record["workload"] = run
            if cache is not None:  # the paged cache's real use replaces the estimate
                record["kv_cache"] = cache
                new["kv_mb_at_peak"] = cache["kv_bytes_peak"] / 1e6
            if "batch_size" in run:
                runs = details[name].setdefault("latency", {"by_batch_size": {}})
                runs["by_batch_size"][str(run["batch_size"])] = record
            else:
                details[name]["latency"] = record
            out_rows.append(new)
    return out_rows, workload


def _latency_record(row, model, timings, duration, slo, s, bandwidth, peak) -> dict[str, Any]:
    """Fill ``row``'s latency columns; return the details (summary, roofline, cost, requests)."""
    stats = summarize(timings, duration, slo)
    ttft, tpot = stats["ttft_ms"], stats["tpot_ms"]
    kv = kv_bytes_per_token(model)
    # Step and prefill times come from TPOT and TTFT only where those are one step: a single
    # stream, or a static batch decoded together (its TTFT includes queueing behind the other
    # prefills, so no MFU). Interleaved or queued serving gives no utilization numbers.
    single = s.workload == "single"
    stepped = single or (s.workload == "batch" and s.engine == "hf")
    prompt_mean = round(lengths_mean(s.prompt_tokens))
    roof = roofline(
        weight_bytes=row["weight_bytes"],
        kv_per_token=kv,
        matmul_weights=matmul_params(model),
        prompt_tokens=prompt_mean,
        mean_context=lengths_mean(s.prompt_tokens) + lengths_mean(s.output_tokens) / 2,
        decode_step_s=tpot["p50"] / 1e3 if tpot and stepped else None,
        prefill_s=ttft["p50"] / 1e3 if single else None,
        prefill_flops_=prefill_flops(model, prompt_mean),
        bandwidth_bps=bandwidth,
        peak_flops=peak,
        batch=row.get("batch_size", 1),
    )
    money = cost(s.usd_per_hour, stats["goodput"])
    row.update(
        ttft_p50_ms=ttft["p50"],
        ttft_p99_ms=ttft["p99"],
        tpot_p50_ms=tpot["p50"] if tpot else None,
        tpot_p99_ms=tpot["p99"] if tpot else None,
        tokens_per_s=1e3 / tpot["p50"] if tpot else None,
        output_tokens_per_s=stats["throughput"]["output_tokens_per_s"],
        goodput_rps=stats["goodput"]["requests_per_s"],
        kv_mb_at_peak=kv
        * (lengths_bounds(s.prompt_tokens)[1] + lengths_bounds(s.output_tokens)[1])
        / 1e6,
        mbu=roof["mbu"],
        mfu=roof["mfu"],
        usd_per_1m_tokens=money["usd_per_1m_output_tokens"],
    )
    per_request = [
        {
            "prompt_tokens": t.prompt_tokens,
            "output_tokens": len(t.token_times),
            "ttft_ms": t.ttft * 1e3,
            "tpot_ms": t.tpot * 1e3 if t.tpot is not None else None,
            "e2e_ms": t.e2e * 1e3,
        }
        for t in timings
    ]
    return {
        "summary": stats,
        "roofline": roof,
        "cost": money,
        "kv_bytes_per_token": kv,
        "requests": per_request,
    }
