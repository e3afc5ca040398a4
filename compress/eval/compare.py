"""``compress compare``: measure a baseline and its variants the same way, in one run.

Every model sees the same perplexity text and protocol, the same lm-eval tasks and limit, and
the same tokenized prompts. Latency (greedy, fixed output length, EOS ignored) is measured after
one warm-up request per model, in interleaved rounds (baseline, variant 1, variant 2, baseline,
...) so that drifting load from other work on the machine hits every variant alike, under one of
four workloads: ``single`` (one request at a time), ``batch`` (static batches: B requests arrive
together and are served B at a time, one row set per batch size), ``poisson`` (arrivals at a
rate) or ``trace`` (arrivals and lengths from a file). The engine is our ``runtime`` (default:
one request at a time on its static cache for ``single``, else its continuous-batching
scheduler over a paged KV cache, what ``compress serve`` runs) or transformers (``hf``); every
latency row names its engine, and a model the runtime does not run is timed on transformers and
marked ``hf fallback``. With a
draft model, the baseline also runs speculative decoding on the same prompts. Output:
``compare.md``, ``compare.csv``, ``compare.json`` and ``compare.png``, each with the environment.
Perplexity is per token, so it is only comparable between models that share a tokenizer: a
different tokenizer is refused, not silently compared.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from compress.core.device import place_for_eval, resolve_device
from compress.core.errors import ConfigError, DataError
from compress.data import read_text, resolve_text_path
from compress.eval.latency import (
    INT_KERNELS,
    Slo,
    cost,
    runtime_stream,
    seq_len_for,
    summarize,
)
from compress.eval.report import (
    environment,
    kl_cells,
    kl_note,
    markdown_table,
    write_csv,
    write_results,
)
from compress.eval.serving import (
    DEFAULT_BATCH_SIZES,
    measure_latency,
    served_latency,
    time_rounds,
)
from compress.eval.workload import Lengths, lengths_bounds, make_requests, read_trace
from compress.memory import peak_memory_bytes


@dataclass
class CompareSettings:
    dataset: str | None = "wikitext2"  # perplexity text; None skips perplexity
    context_length: int = 512
    stride: int | None = None
    ppl_limit: int | None = None  # windows
    kl_top_k: int = 32  # baseline log-probs kept per token for KL (compress.eval.quality); 0: none
    resume: bool = True  # reuse perplexity/KL windows saved under $COMPRESS_CACHE_DIR
    tasks: list[str] = field(default_factory=list)
    task_limit: int | None = None  # examples per task
    tasks_dir: str | None = None
    latency: bool = True
    prompts: int = 4  # requests per round
    prompt_tokens: Lengths = 64  # fixed, or (low, high): drawn uniformly per request
    output_tokens: Lengths = 32
    rounds: int = 1
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    usd_per_hour: float = 1.0
    data_dir: str | None = None
    backend: str = "auto"
    progress: bool = False
    workload: str = "single"  # one of WORKLOADS
    batch_sizes: list[int] | None = None  # batch: None means DEFAULT_BATCH_SIZES
    rate: float | None = None  # poisson: requests per second (required)
    requests: int = 16  # poisson: requests per round
    trace: str | None = None  # trace: JSON-lines file (required)
    max_batch: int = 8  # poisson, trace: requests decoded together at most
    kv_dtype: str = "auto"  # batch, poisson, trace: paged KV storage (runtime.paged.KV_DTYPES)
    engine: str = "runtime"  # one of ENGINES
    compile: bool = False  # runtime engine: torch.compile the decode step
    # runtime engine: int4/int8 decode through our integer-dot kernels ("ours", the fastest on
    # CPU, int8-rounded activations) or torch's ("torch"); rows name the one that ran
    int_kernels: str = "ours"
    draft: str | None = None  # speculative decoding of the baseline with this draft model
    draft_k: int = 4  # draft tokens proposed per target forward
    # where every model runs (auto: the first GPU when there is one); bf16 on a GPU
    device: str = "auto"


WORKLOADS = ("single", "batch", "poisson", "trace")
ENGINES = ("runtime", "hf")


def check_settings(s: CompareSettings) -> None:
    """Every workload/engine/draft problem at once, before any model is loaded. Messages name
    the ``compress compare`` flag to change."""
    problems = []
    if s.workload not in WORKLOADS:
        problems.append(f"--workload {s.workload!r} is not one of {', '.join(WORKLOADS)}")
    if s.engine not in ENGINES:
        problems.append(f"--engine {s.engine!r} is not one of {', '.join(ENGINES)}")
    if s.int_kernels not in INT_KERNELS:
        problems.append(f"--int-kernels {s.int_kernels!r} is not one of {', '.join(INT_KERNELS)}")
    if s.workload == "poisson" and s.rate is None:
        problems.append("--workload poisson needs --rate REQ_PER_S (mean arrivals per second)")
    if s.rate is not None and (s.workload != "poisson" or s.rate <= 0):
        problems.append(f"--rate {s.rate} must be > 0 and only goes with --workload poisson")
    if s.workload == "trace" and s.trace is None:
        problems.append("--workload trace needs --trace FILE (JSON lines with arrival_s)")
    if s.trace is not None and s.workload != "trace":
        problems.append("--trace only goes with --workload trace")
    if s.batch_sizes is not None and (s.workload != "batch" or min(s.batch_sizes, default=0) < 1):
        problems.append(f"--batch-sizes {s.batch_sizes} must be >= 1 and only go with "
                        "--workload batch")
    for flag, value in (("--requests", s.requests), ("--max-batch", s.max_batch),
                        ("--draft-k", s.draft_k), ("--rounds", s.rounds),
                        ("--prompts", s.prompts)):
        if value < 1:
            problems.append(f"{flag} must be >= 1, got {value}")
    if s.context_length < 2 or (s.ppl_limit is not None and s.ppl_limit < 1):
        problems.append(f"--context-length {s.context_length} must be >= 2 and --limit "
                        f"{s.ppl_limit} >= 1 (leave --limit out to score every window)")
    if not (math.isfinite(s.usd_per_hour) and s.usd_per_hour >= 0):
        problems.append(f"--usd-per-hour {s.usd_per_hour} must be a price >= 0")
    if s.draft is not None and not (isinstance(s.output_tokens, int) and s.output_tokens >= 2):
        problems.append("--draft needs a fixed --output-tokens >= 2 (one length for the "
                        "speculative and the plain run)")
    for flag, spec in (("--prompt-tokens", s.prompt_tokens), ("--output-tokens", s.output_tokens)):
        low, high = lengths_bounds(spec)
        if low < 1 or low > high:
            problems.append(f"{flag} {spec} must be >= 1 (LOW <= HIGH for a range)")
    if problems:
        raise ConfigError("compare settings: " + "; ".join(problems))
    if s.workload == "trace":
        try:
            read_trace(s.trace)
        except (OSError, ValueError) as exc:  # a bad trace is the user's file: say which flag
            raise DataError(f"--trace: {exc}") from None


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
    from compress.quant.linear import bits_per_weight, model_bytes

    sizes = model_bytes(model)
    return {
        "weight_mb": sizes["total"] / 1e6,
        "linear_weight_mb": sizes["linear"] / 1e6,
        "bits_per_weight": bits_per_weight(model),  # the same layers as sizes["linear"]
        "weight_bytes": sizes["total"],
    }


def compare(
    baseline: str,
    variants: list[str],
    settings: CompareSettings,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Evaluate ``baseline`` and ``variants`` (model dirs, checkpoints or embedded names) and
    write the comparison files into ``out_dir`` (missing, empty or a compress output folder,
    unless ``overwrite``; never a model's folder). Returns the JSON payload."""
    from compress.io.load import load_model, local_model_dir
    from compress.output_dir import check_output_dir
    from compress.pipeline.preflight import check_whole_loads

    check_settings(settings)
    device = resolve_device(settings.device, where="--device")  # before any model loads
    names = [baseline, *variants]
    models = [*names, *([settings.draft] if settings.draft else [])]
    protect = [d for d in map(local_model_dir, models) if d is not None]
    check_output_dir(out_dir, overwrite=overwrite, protect=protect)
    text = source = None
    if settings.dataset is not None:
        path = resolve_text_path(settings.dataset, settings.data_dir)
        text, source = read_text(path), str(path)
    # every model is loaded whole at once (latency rounds interleave them): checked first
    check_whole_loads("compare (every model loaded whole at once)", models, "compare fewer "
                      "variants at once, or score each alone: compress eval --layer-by-layer")
    loaded = [load_model(n, backend=settings.backend) for n in names]
    sizes = [_sizes(lm.model) for lm in loaded]  # as stored, before a GPU's bf16 copy
    placed = [place_for_eval(lm.model, device) for lm in loaded]
    if text is not None:
        _check_tokenizers(names, [m.tokenizer for m in loaded])
    draft = None
    if settings.draft is not None:  # loaded first so that a wrong tokenizer fails before work
        draft = load_model(settings.draft, backend=settings.backend)
        place_for_eval(draft.model, device)
        _check_draft_tokenizer(settings.draft, draft.tokenizer, baseline, loaded[0].tokenizer)
    rows: list[dict[str, Any]] = []
    details: dict[str, Any] = {}
    base_ppl = None
    for name, lm, where, size in zip(names, loaded, placed, sizes, strict=True):
        row: dict[str, Any] = {"variant": Path(name).name or name, "source": name}
        row.update(size)
        details[name] = {"device": where}
        if text is not None:
            ppl = _perplexity(lm, text, source, settings, row["variant"], base_ppl)
            base_ppl = base_ppl or ppl
            row["perplexity"] = ppl.perplexity
            row.update(kl_cells(ppl, base_ppl))  # the baseline's own KL is 0 by definition
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
    workload = speculative = None
    need_ids = settings.latency or draft is not None
    ids = _prompt_ids(loaded[0].tokenizer, text, settings) if need_ids else []
    if settings.latency:
        rows, workload = measure_latency(rows, details, names, loaded, settings, ids)
    if draft is not None:
        speculative = _speculative(loaded[0].model, draft.model, ids, settings)
    for row in rows:
        # The baseline of a row is the first row of the same run (batch size).
        base = next(r for r in rows if r.get("batch_size") == row.get("batch_size"))
        for key in ("perplexity", "tpot_p50_ms", "weight_mb"):
            if row is not base and row.get(key) is not None and base.get(key):
                row[f"{key}_delta_pct"] = 100 * (row[key] / base[key] - 1)
    extra = {"workload": workload, "speculative": speculative}
    return _write(rows, details, settings, Path(out_dir), extra, overwrite=overwrite)


def _perplexity(lm, text: str, source: str, s: CompareSettings, variant: str, base):
    """Perplexity of one model; the baseline (``base`` None) stores its top-k log-probs, the
    variants get their KL from them. Windows are saved and resumed under the cache folder."""
    from compress.eval.quality import perplexity
    from compress.io.load import cache_dir

    return perplexity(
        lm.model,
        lm.tokenizer,
        text,
        context_length=s.context_length,
        stride=s.stride,
        limit=s.ppl_limit,
        source=source,
        progress=s.progress,
        label=f"{variant} perplexity",
        state_dir=cache_dir() / "perplexity",
        resume=s.resume,
        top_k=(s.kl_top_k or None) if base is None else None,
        top_k_dir=cache_dir() / "perplexity-top-k",
        kl_base=base.top_k_path if base is not None else None,
    )


def _check_draft_tokenizer(draft: str, draft_tok, baseline: str, base_tok) -> None:
    if tokenizer_fingerprint(draft_tok) != tokenizer_fingerprint(base_tok):
        raise DataError(
            f"--draft {draft} uses a different tokenizer than the baseline {baseline}. "
            "Speculative decoding feeds the draft's token ids to the target, so both must share "
            "one vocabulary; pick a draft from the same model family."
        )


def _prompt_ids(tokenizer, text: str | None, settings: CompareSettings) -> list[int]:
    """Token ids of the real text prompts are cut from (the perplexity text, else WikiText-2)."""
    if text is None:
        text = resolve_text_path("wikitext2", settings.data_dir).read_text(encoding="utf-8")
    return tokenizer(text[:200_000], add_special_tokens=False)["input_ids"]


def _lengths(spec: Lengths) -> str:
    return str(spec) if isinstance(spec, int) else f"{spec[0]}-{spec[1]} (uniform)"


def _speculative(target, draft, ids: list[int], s: CompareSettings) -> dict[str, Any]:
    """Speculative vs plain greedy decoding of the baseline on the latency prompts."""
    from compress.eval.speculative import evaluate

    requests = make_requests(ids, s.prompts, prompt_tokens=s.prompt_tokens,
                             output_tokens=s.output_tokens)
    result = evaluate(target, draft, [r.prompt for r in requests], s.output_tokens, k=s.draft_k)
    return {"draft": s.draft, **result}


COLUMNS = [
    ("variant", "variant"),
    ("engine", "engine"),
    ("weight_mb", "weights MB"),
    ("bits_per_weight", "bits/weight"),
    ("perplexity", "ppl"),
    ("perplexity_delta_pct", "Δ ppl %"),
    ("kl", "KL"),
    ("top1_changed_pct", "top-1 changed %"),
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
# Served workloads (not single stream) add the batch size and the aggregate output throughput.
SERVED_COLUMNS = [("batch_size", "batch"), ("output_tokens_per_s", "output tok/s")]
SPECULATIVE_COLUMNS = [
    ("draft", "draft"),
    ("k", "k"),
    ("acceptance_rate", "acceptance"),
    ("tokens_per_target_forward", "tokens / target forward"),
    ("plain_tpot_p50_ms", "greedy TPOT p50 ms"),
    ("speculative_tpot_p50_ms", "speculative TPOT p50 ms"),
    ("tpot_speedup_p50", "TPOT speedup"),
    ("outputs_identical", "same output as greedy"),
]


def _latency_records(detail: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    latency = detail["latency"]
    if "by_batch_size" in latency:
        return [(f" (batch {b})", r) for b, r in latency["by_batch_size"].items()]
    return [("", latency)]


def _workload_note(s: CompareSettings) -> str:
    kind = {
        "single": "single stream",
        "batch": f"static batches of {s.batch_sizes or DEFAULT_BATCH_SIZES} requests arriving "
        "together, served that many at a time",
        "poisson": f"{s.requests} Poisson arrivals at {s.rate} req/s, up to {s.max_batch} in "
        "flight",
        "trace": f"arrivals from {s.trace}, up to {s.max_batch} in flight",
    }[s.workload]
    count = f"{s.prompts} prompts x " if s.workload == "single" else ""
    own = " unless a trace line sets its own" if s.workload == "trace" else ""
    return (
        f"Latency: {kind}, engine {s.engine}"
        f"{f' (int4/int8 decode kernels: {s.int_kernels})' if s.engine == 'runtime' else ''}, "
        f"{count}{s.rounds} rounds, "
        f"{_lengths(s.prompt_tokens)} prompt + {_lengths(s.output_tokens)} output tokens{own}, "
        "greedy, warm-up excluded, variants interleaved."
    )


def _speculative_table(spec: dict[str, Any]) -> str:
    row = {
        **spec,
        "plain_tpot_p50_ms": spec["plain_tpot_ms"]["p50"],
        "speculative_tpot_p50_ms": spec["speculative_tpot_ms"]["p50"],
        "outputs_identical": "yes" if spec["outputs_identical"] else "NO",
    }
    return (
        f"Speculative decoding of the baseline (greedy acceptance, {spec['prompts']} prompts, "
        f"{spec['max_new_tokens']} new tokens, plain greedy timed in the same run):\n\n"
        + markdown_table([row], SPECULATIVE_COLUMNS)
    )


def _write(
    rows, details, settings: CompareSettings, out: Path, extra, *, overwrite: bool = False
) -> dict[str, Any]:
    from compress.eval.plot import plot_tradeoffs

    task_cols = [(k, k) for k in rows[0] if ":" in k]
    served = settings.latency and settings.workload != "single"
    batch = SERVED_COLUMNS[:1] if served and settings.workload == "batch" else []
    latency = COLUMNS[1:2] if settings.latency else []  # engine
    columns = COLUMNS[:1] + batch + latency + COLUMNS[2:8] + task_cols + COLUMNS[8:13]
    columns += (SERVED_COLUMNS[1:] if served else []) + COLUMNS[13:]
    env = environment()
    env.update(peak_memory_bytes())
    payload = {"environment": env, "settings": asdict(settings), "rows": rows, "details": details}
    payload.update({k: v for k, v in extra.items() if v is not None})
    notes = [f"Environment: {json.dumps(env)}"]
    first = next(iter(details.values()))
    if "perplexity" in first:
        p = first["perplexity"]["protocol"]
        notes.append(
            f"Perplexity: token-level, {p['source']}, context {p['context_length']}, "
            f"stride {p['stride']}, {p['windows']} windows."
        )
        kl = next((d["perplexity"]["kl"] for d in details.values()
                   if d.get("perplexity", {}).get("kl")), None)
        if kl is not None:
            notes[-1] += " " + kl_note(kl["top_k"])
    if settings.latency:
        lat = _latency_records(first)[0][1]["roofline"]
        notes.append(
            f"{_workload_note(settings)} Probes: {lat['bandwidth_gbps']:.1f} GB/s, "
            f"{lat['peak_gflops']:.0f} GFLOP/s. Goodput SLO: TTFT <= {settings.slo_ttft_ms} ms, "
            f"TPOT <= {settings.slo_tpot_ms} ms. Cost at ${settings.usd_per_hour}/h."
        )
        for name, d in details.items():
            for label, record in _latency_records(d):
                r = record["roofline"]
                notes.append(
                    f"{name}{label}: decode {r['decode_verdict']}; prefill {r['prefill_verdict']}."
                )
        fallback = sorted({r["variant"] for r in rows if r.get("engine") == "hf fallback"})
        if fallback:
            notes.append(
                f"Engine hf fallback: {', '.join(fallback)} timed on transformers' decode loop, "
                "not on the compress runtime (an architecture the runtime does not run)."
            )
    if extra.get("speculative"):
        notes.append(_speculative_table(extra["speculative"]))
    markdown = markdown_table(rows, columns) + "\n\n" + "\n\n".join(notes)
    write_results(out, "compare", markdown, payload, overwrite=overwrite)
    write_csv(out / "compare.csv", rows, [k for k, _ in columns])
    # One point per variant: the largest batch size when there are several.
    largest = max((r.get("batch_size") or 0 for r in rows), default=0)
    plot = plot_tradeoffs(
        [r for r in rows if (r.get("batch_size") or 0) == largest],
        out / "compare.png",
        title=f"{env['cpu']}, {env['threads']} threads, {env['date']}",
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
    if getattr(cfg, "latency", None) is not None and cfg.latency.workload != "single":
        lat = cfg.latency
        text = resolve_text_path("wikitext2", data_dir).read_text(encoding="utf-8")
        ids = tokenizer(text[:200_000], add_special_tokens=False)["input_ids"]
        settings = CompareSettings(
            prompts=lat.prompts, prompt_tokens=lat.prompt_tokens, output_tokens=lat.output_tokens,
            rounds=lat.rounds, slo_ttft_ms=lat.slo_ttft_ms, slo_tpot_ms=lat.slo_tpot_ms,
            usd_per_hour=lat.usd_per_hour, workload=lat.workload, batch_sizes=lat.batch_sizes,
            rate=lat.rate, requests=lat.requests, max_batch=lat.max_batch, kv_dtype=lat.kv_dtype,
        )  # fmt: skip
        runs = served_latency(model, ids, settings)
        # the headline: the largest batch, or the poisson run
        out["latency"] = {**runs[-1], "workload": lat.workload, "runs": runs}
    elif getattr(cfg, "latency", None) is not None:
        lat = cfg.latency
        text = resolve_text_path("wikitext2", data_dir).read_text(encoding="utf-8")
        ids = tokenizer(text[:200_000], add_special_tokens=False)["input_ids"]
        requests = make_requests(
            ids, lat.prompts, prompt_tokens=lat.prompt_tokens, output_tokens=lat.output_tokens
        )
        need = seq_len_for(max(len(r.prompt) + r.max_new_tokens for r in requests))
        stream = runtime_stream(model, max_seq_len=need)
        timings = time_rounds([stream], requests, lat.rounds)[0]
        slo = Slo(lat.slo_ttft_ms, lat.slo_tpot_ms)
        stats = summarize(timings, sum(t.e2e for t in timings), slo)
        out["latency"] = {"engine": stream.engine, "summary": stats,
                          "cost": cost(lat.usd_per_hour, stats["goodput"])}
    return out
