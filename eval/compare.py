"""``compress compare``: measure a baseline and its variants the same way, in one run.

Every model sees the same perplexity text and protocol, the same lm-eval tasks and limit, and
the same tokenized prompts. Latency is measured single-stream (one request at a time, greedy,
fixed output length, EOS ignored) after one warm-up request per model, in interleaved rounds
(baseline, variant 1, variant 2, baseline, ...) so that drifting load from other work on the
machine hits every variant alike. Output: ``compare.md``, ``compare.csv``, ``compare.json`` and
``compare.png``, each with the environment. Perplexity is per token, so it is only comparable
between models that share a tokenizer: a different tokenizer is refused, not silently compared.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from compress.eval.hardware import matmul_peak, memory_bandwidth
from compress.eval.latency import (
    Slo,
    cost,
    greedy_stream,
    kv_bytes_per_token,
    matmul_params,
    peak_memory_bytes,
    prefill_flops,
    roofline,
    summarize,
    time_request,
)
from compress.eval.report import environment, markdown_table, write_csv, write_results
from compress.eval.workload import make_requests

from compress.data import resolve_text_path
from compress.errors import DataError

log = logging.getLogger(__name__)


@dataclass
class CompareSettings:
    dataset: str | None = "wikitext2"  # perplexity text; None skips perplexity
    context_length: int = 512
    stride: int | None = None
    ppl_limit: int | None = None  # windows
    tasks: list[str] = field(default_factory=list)
    task_limit: int | None = None  # examples per task
    tasks_dir: str | None = None
    latency: bool = True
    prompts: int = 4  # requests per round
    prompt_tokens: int = 64
    output_tokens: int = 32
    rounds: int = 1
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    usd_per_hour: float = 1.0
    data_dir: str | None = None
    backend: str = "auto"
    progress: bool = False


def tokenizer_fingerprint(tokenizer: Any) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def _check_tokenizers(names: list[str], tokenizers: list[Any]) -> None:
    prints = [tokenizer_fingerprint(t) for t in tokenizers]
    different = [n for n, p in zip(names[1:], prints[1:], strict=True) if p != prints[0]]
    if different:
        raise DataError(
            f"refusing to compare perplexity: {', '.join(different)} use(s) a different tokenizer "
            f"than the baseline {names[0]}. Token perplexity is a per-token average, and two "
            "tokenizers split the same text into different numbers of tokens, so the numbers are "
            "not comparable. Use --no-perplexity (and compare task accuracy), or compare models "
            "that share a tokenizer."
        )


def _sizes(model) -> dict[str, float]:
    from compress.modules import model_bytes

    sizes = model_bytes(model)
    # model_bytes' "linear" leaves lm_head out; count the same layers' parameters.
    linear_params = sum(
        m.in_features * m.out_features
        for name, m in model.named_modules()
        if hasattr(m, "in_features") and not name.endswith("lm_head")
    )
    return {
        "weight_mb": sizes["total"] / 1e6,
        "linear_weight_mb": sizes["linear"] / 1e6,
        "bits_per_weight": 8 * sizes["linear"] / linear_params if linear_params else None,
        "weight_bytes": sizes["total"],
    }


def _latency_rounds(models, requests, rounds: int) -> list[list[Any]]:
    """Timings per model, rounds interleaved across models; one warm-up request each first."""
    streams = [greedy_stream(m) for m in models]
    for stream in streams:
        time_request(stream, requests[0].prompt, 2)  # warm-up, excluded
    timings: list[list[Any]] = [[] for _ in models]
    for _ in range(rounds):
        for index, stream in enumerate(streams):
            for req in requests:
                timings[index].append(time_request(stream, req.prompt, req.max_new_tokens))
    return timings


def compare(
    baseline: str, variants: list[str], settings: CompareSettings, out_dir: str | Path
) -> dict[str, Any]:
    """Evaluate ``baseline`` and ``variants`` (model dirs, checkpoints or embedded names) and
    write the comparison files into ``out_dir``. Returns the JSON payload."""
    from compress.models import load_model

    names = [baseline, *variants]
    text = source = None
    if settings.dataset is not None:
        path = resolve_text_path(settings.dataset, settings.data_dir)
        text, source = path.read_text(encoding="utf-8"), str(path)
    loaded = [load_model(n, backend=settings.backend) for n in names]
    if text is not None:
        _check_tokenizers(names, [m.tokenizer for m in loaded])
    rows: list[dict[str, Any]] = []
    details: dict[str, Any] = {}
    for name, lm in zip(names, loaded, strict=True):
        row: dict[str, Any] = {"variant": Path(name).name or name, "source": name}
        row.update(_sizes(lm.model))
        details[name] = {}
        if text is not None:
            from compress.eval.quality import perplexity

            ppl = perplexity(
                lm.model,
                lm.tokenizer,
                text,
                context_length=settings.context_length,
                stride=settings.stride,
                limit=settings.ppl_limit,
                source=source,
                progress=settings.progress,
            )
            row["perplexity"] = ppl.perplexity
            details[name]["perplexity"] = ppl.to_dict()
        if settings.tasks:
            from compress.eval.lm_eval_tasks import headline, run_tasks

            tasks = run_tasks(
                lm.model,
                lm.tokenizer,
                settings.tasks,
                limit=settings.task_limit,
                tasks_dir=settings.tasks_dir,
                data_dir=settings.data_dir,
            )
            details[name]["tasks"] = tasks
            for task, result in tasks["tasks"].items():
                metric, value, stderr = headline(result)
                row[f"{task}:{metric}"] = value
                row[f"{task}:{metric}_stderr"] = stderr
        rows.append(row)
    if settings.latency:
        _add_latency(rows, details, names, loaded, settings, text)
    base = rows[0]
    for row in rows[1:]:
        for key in ("perplexity", "tpot_p50_ms", "weight_mb"):
            if row.get(key) is not None and base.get(key):
                row[f"{key}_delta_pct"] = 100 * (row[key] / base[key] - 1)
    return _write(rows, details, settings, Path(out_dir))


def _add_latency(rows, details, names, loaded, settings: CompareSettings, text) -> None:
    if text is None:
        text = resolve_text_path("wikitext2", settings.data_dir).read_text(encoding="utf-8")
    ids = loaded[0].tokenizer(text[:200_000], add_special_tokens=False)["input_ids"]
    requests = make_requests(
        ids,
        settings.prompts,
        prompt_tokens=settings.prompt_tokens,
        output_tokens=settings.output_tokens,
    )
    bandwidth = memory_bandwidth()["bytes_per_s"]
    peak = matmul_peak()["flops_per_s"]
    slo = Slo(settings.slo_ttft_ms, settings.slo_tpot_ms)
    models = [lm.model for lm in loaded]
    started = time.perf_counter()
    all_timings = _latency_rounds(models, requests, settings.rounds)
    log.info("latency rounds took %.1f s", time.perf_counter() - started)
    for row, name, model, timings in zip(rows, names, models, all_timings, strict=True):
        busy = sum(t.e2e for t in timings)  # single stream: the server is busy only in requests
        stats = summarize(timings, busy, slo)
        ttft, tpot = stats["ttft_ms"], stats["tpot_ms"]
        kv = kv_bytes_per_token(model)
        roof = roofline(
            weight_bytes=row["weight_bytes"],
            kv_per_token=kv,
            matmul_weights=matmul_params(model),
            prompt_tokens=settings.prompt_tokens,
            mean_context=settings.prompt_tokens + settings.output_tokens / 2,
            decode_step_s=tpot["p50"] / 1e3 if tpot else None,
            prefill_s=ttft["p50"] / 1e3,
            prefill_flops_=prefill_flops(model, settings.prompt_tokens),
            bandwidth_bps=bandwidth,
            peak_flops=peak,
        )
        money = cost(settings.usd_per_hour, stats["goodput"])
        row.update(
            ttft_p50_ms=ttft["p50"],
            ttft_p99_ms=ttft["p99"],
            tpot_p50_ms=tpot["p50"] if tpot else None,
            tpot_p99_ms=tpot["p99"] if tpot else None,
            tokens_per_s=1e3 / tpot["p50"] if tpot else None,
            goodput_rps=stats["goodput"]["requests_per_s"],
            kv_mb_at_peak=kv * (settings.prompt_tokens + settings.output_tokens) / 1e6,
            mbu=roof["mbu"],
            mfu=roof["mfu"],
            usd_per_1m_tokens=money["usd_per_1m_output_tokens"],
        )
        details[name]["latency"] = {
            "summary": stats,
            "roofline": roof,
            "cost": money,
            "kv_bytes_per_token": kv,
        }


COLUMNS = [
    ("variant", "variant"),
    ("weight_mb", "weights MB"),
    ("bits_per_weight", "bits/weight"),
    ("perplexity", "ppl"),
    ("perplexity_delta_pct", "Δ ppl %"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("tpot_p50_ms", "TPOT p50 ms"),
    ("tpot_p99_ms", "TPOT p99 ms"),
    ("tokens_per_s", "decode tok/s"),
    ("goodput_rps", "goodput req/s"),
    ("kv_mb_at_peak", "KV MB at peak"),
    ("mbu", "MBU"),
    ("mfu", "MFU"),
    ("usd_per_1m_tokens", "$ / 1M tok"),
]


def _write(rows, details, settings: CompareSettings, out: Path) -> dict[str, Any]:
    from compress.eval.plot import plot_tradeoffs

    task_cols = [(k, k) for k in rows[0] if ":" in k]
    columns = COLUMNS[:5] + task_cols + COLUMNS[5:]
    env = environment()
    env.update(peak_memory_bytes())
    payload = {"environment": env, "settings": asdict(settings), "rows": rows, "details": details}
    notes = [f"Environment: {json.dumps(env)}"]
    first = next(iter(details.values()))
    if "perplexity" in first:
        p = first["perplexity"]["protocol"]
        notes.append(
            f"Perplexity: token-level, {p['source']}, context {p['context_length']}, "
            f"stride {p['stride']}, {p['windows']} windows."
        )
    if settings.latency:
        lat = first["latency"]["roofline"]
        notes.append(
            f"Latency: single stream, {settings.prompts} prompts x {settings.rounds} rounds, "
            f"{settings.prompt_tokens} prompt + {settings.output_tokens} output tokens, greedy, "
            f"warm-up excluded, variants interleaved. Probes: {lat['bandwidth_gbps']:.1f} GB/s, "
            f"{lat['peak_gflops']:.0f} GFLOP/s. Goodput SLO: TTFT <= {settings.slo_ttft_ms} ms, "
            f"TPOT <= {settings.slo_tpot_ms} ms. Cost at ${settings.usd_per_hour}/h."
        )
        for name, d in details.items():
            r = d["latency"]["roofline"]
            notes.append(f"{name}: decode {r['decode_verdict']}; prefill {r['prefill_verdict']}.")
    markdown = markdown_table(rows, columns) + "\n\n" + "\n\n".join(notes)
    write_results(out, "compare", markdown, payload)
    write_csv(out / "compare.csv", rows, [k for k, _ in columns])
    plot = plot_tradeoffs(
        rows, out / "compare.png", title=f"{env['cpu']}, {env['threads']} threads, {env['date']}"
    )
    payload["files"] = [str(out / f) for f in ("compare.md", "compare.csv", "compare.json")]
    if plot:
        payload["files"].append(str(plot))
    payload["markdown"] = markdown
    return payload


def evaluate_extras(model, tokenizer, cfg: Any, data_dir: str | None = None) -> dict[str, Any]:
    """The recipe's ``eval.tasks`` and ``eval.latency`` sections for one model (used by
    ``compress run``); an empty dict when neither is requested."""
    out: dict[str, Any] = {}
    if getattr(cfg, "tasks", None) is not None:
        from compress.eval.lm_eval_tasks import run_tasks

        t = cfg.tasks
        out["tasks"] = run_tasks(
            model, tokenizer, list(t.names), limit=t.limit, tasks_dir=t.tasks_dir, data_dir=data_dir
        )
    if getattr(cfg, "latency", None) is not None:
        lat = cfg.latency
        text = resolve_text_path("wikitext2", data_dir).read_text(encoding="utf-8")
        ids = tokenizer(text[:200_000], add_special_tokens=False)["input_ids"]
        requests = make_requests(
            ids, lat.prompts, prompt_tokens=lat.prompt_tokens, output_tokens=lat.output_tokens
        )
        timings = _latency_rounds([model], requests, lat.rounds)[0]
        slo = Slo(lat.slo_ttft_ms, lat.slo_tpot_ms)
        stats = summarize(timings, sum(t.e2e for t in timings), slo)
        out["latency"] = {"summary": stats, "cost": cost(lat.usd_per_hour, stats["goodput"])}
    return out
