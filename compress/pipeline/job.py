"""``compress run``: load the model, evaluate the baseline, run the passes, evaluate the result,
export the checkpoint and write the baseline-vs-compressed table.

This is the one orchestration of ``run``, ``sweep`` and ``tune``: ``plan_job`` checks a job
before any work (the output folder is the caller's; then the device, the evaluation data, the
model source, whether it can stream and the memory preflight), ``execute_job`` runs load ->
baseline -> passes -> evaluation -> export, streamed layer by layer or on the model loaded
whole, and each caller turns its outcome into its own table. This is the orchestration layer,
so it (like the CLI) may import ``compress.eval``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from compress.calibration import calibration_mix
from compress.core.device import current_device, device_name, on_eval_device, resolve_device
from compress.core.errors import RecipeError
from compress.core.registry import PASSES, CompressionState, pass_name_of, run_passes
from compress.data import read_text, resolve_text_path
from compress.io.export import export_checkpoint, resolve_export_dtype, write_provenance
from compress.io.load import load_model, local_model_dir
from compress.output_dir import check_output_dir
from compress.pipeline.preflight import layerwise_eval, layerwise_export_eval
from compress.pipeline.refusals import (
    check_lengths,
    eval_refusal,
    export_dtype,
    refuse_bnb_of_multimodal,
    skeleton_refusal,
    stream_refusal,
)
from compress.quant.linear import dequantized_for_scoring, model_bytes
from compress.recipe import Recipe

log = logging.getLogger(__name__)

# Baseline log-probs kept per scored token for the KL column (compress.eval.quality): 196 bytes
# per token on disk for a vocabulary under 65,536, 59 MB for SmolLM2 on all of WikiText-2 test.
KL_TOP_K = 32

COLUMNS = [
    ("variant", "variant"),
    ("perplexity", "WikiText-2 ppl"),
    ("ppl_delta_pct", "Δ ppl %"),
    ("kl", "KL"),
    ("top1_changed_pct", "top-1 changed %"),
    ("linear_weight_mb", "linear weights MB"),
    ("weight_mb", "all weights MB"),
    ("disk_mb", "checkpoint on disk MB"),
]


@dataclass
class JobResult:
    out_dir: Path
    rows: list[dict[str, Any]]
    markdown: str
    payload: dict[str, Any]


LATENCY_COLUMNS = {"ttft_p50_ms": "TTFT p50 ms", "tpot_p50_ms": "TPOT p50 ms", "engine": "engine"}


def extra_cells(extras: dict[str, Any]) -> dict[str, Any]:
    """Table cells for what the recipe's eval section asked beyond perplexity: each task's
    headline accuracy (± stderr) and the latency medians."""
    from compress.eval.lm_eval_tasks import headline

    cells: dict[str, Any] = {}
    for task, result in (extras.get("tasks") or {}).get("tasks", {}).items():
        _, value, stderr = headline(result)
        cells[task] = f"{value:.3f} ± {stderr:.3f}" if stderr is not None else value
    summary = (extras.get("latency") or {}).get("summary")
    if summary:
        for key, dist in (("ttft_p50_ms", "ttft_ms"), ("tpot_p50_ms", "tpot_ms")):
            cells[key] = summary[dist]["p50"] if summary.get(dist) else None
        # who made the timed tokens: "runtime", or "hf fallback" for a model it does not run
        cells["engine"] = extras["latency"].get("engine")
    return cells


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def evaluate_perplexity(
    model, tokenizer, recipe: Recipe, text: str | None, source: str, progress: bool,
    *, label: str, resume: bool, top_k: int | None = None, kl_base: str | None = None,
    stream=None,
):
    """Perplexity under the recipe's protocol. Per-window results are saved as they go under
    ``<cache dir>/perplexity/`` (keyed by weights, tokens and protocol, see
    ``compress.eval.quality``), so a rerun skips finished evaluations and resumes a cut one.
    top_k: also store this model's top-k log-probs (under ``<cache dir>/perplexity-top-k/``) for
    the KL of later variants; kl_base: the ``top_k_path`` of such a baseline, for ``result.kl``.
    Weight-only int4/int8 layers are scored as their dequantized float32 weights (the reference
    definition; ``compress.quant.linear.dequantized_for_scoring``). stream: score layer by
    layer (``compress.io.export.layerwise_model``; ``model`` is its skeleton) on the recipe's
    device, in bf16 on a GPU as the whole model would be."""
    cfg = recipe.eval.perplexity
    if cfg is None or text is None:
        return None
    if cfg.limit is None:
        log.info("%s: scoring every window of %s (WikiText-2 test: 593 windows, 10-15 min per "
                 "model on 2 idle CPU cores); stop at any time, the same command resumes", label,
                 cfg.dataset)
    device = resolve_device(recipe.device)
    if stream is not None:  # each layer is dequantized for scoring when it is read
        result = _perplexity(model, tokenizer, text, cfg, source, progress, label, resume,
                             top_k, kl_base, stream, device)
        from compress.eval.quality import layerwise_placement

        placed = layerwise_placement(stream, device)
    else:  # on the recipe's device, in bf16 on a GPU; the protocol records where and in what
        with on_eval_device(model, device) as placed, \
                dequantized_for_scoring(model):
            result = _perplexity(model, tokenizer, text, cfg, source, progress, label, resume,
                                 top_k, kl_base)
    result = dataclasses.replace(result, protocol={**result.protocol, **placed})
    log.info("%s: %.2f over %d windows (%d scored tokens)%s", label, result.perplexity,
             result.windows, result.scored_tokens,
             f"; KL {result.kl.kl_mean:.4g}, top-1 changed {result.kl.top1_changed_pct:.2f}%"
             if result.kl else "")
    return result


def _perplexity(model, tokenizer, text, cfg, source, progress, label, resume, top_k, kl_base,
                stream=None, device=None):
    from compress.eval.quality import perplexity
    from compress.io.load import cache_dir

    return perplexity(
        model,
        tokenizer,
        text,
        context_length=cfg.context_length,
        stride=cfg.stride,
        limit=cfg.limit,
        source=source,
        progress=progress,
        label=label,
        state_dir=cache_dir() / "perplexity",
        resume=resume,
        top_k=top_k or None,
        top_k_dir=cache_dir() / "perplexity-top-k",
        kl_base=kl_base,
        stream=stream,
        device=device if stream is not None else None,
    )


def protocol_line(result, kl_top_k: int | None = None) -> str:
    """The table's footnote: what the perplexity column measured, and on how much text; with
    ``kl_top_k``, what the KL columns measured."""
    p = result.protocol
    total = p.get("windows_in_text", p["windows"])
    if p["windows"] < total:
        windows = (f"the first {p['windows']} of its {total} windows (a sample; `--full-eval` "
                   "scores them all)")
    else:
        windows = f"all {p['windows']} windows"
    line = (
        f"\n\nPerplexity: token-level, {p['source']}, context {p['context_length']}, stride "
        f"{p['stride']}, {windows}; {result.scored_tokens:,} scored tokens."
    )
    if kl_top_k:
        from compress.eval.report import kl_note

        line += " " + kl_note(kl_top_k)
    return line


def with_full_eval(recipe: Recipe) -> Recipe:
    """``recipe`` scoring every perplexity window (``eval.perplexity.limit: null``)."""
    cfg = recipe.eval.perplexity
    if cfg is None or cfg.limit is None:
        return recipe
    full = recipe.eval.model_copy(update={"perplexity": cfg.model_copy(update={"limit": None})})
    return dataclasses.replace(recipe, eval=full)


def recipe_state(
    recipe: Recipe, tokenizer, *, progress: bool = True, data_dir: str | None = None,
    activations_near: Path | None = None,
) -> CompressionState:
    """The ``CompressionState`` a recipe's passes run with: its calibration sequences (drawn
    once, handed out as batches of one) when it has a ``calibration`` section;
    ``activations_near``: the folder beside which calibrated passes keep their hidden states
    in files (the preflight's ``activations: disk``)."""
    state = CompressionState(tokenizer=tokenizer, progress=progress, data_dir=data_dir,
                             device=resolve_device(recipe.device),
                             activations_near=activations_near)
    if recipe.calibration is not None:
        cal = recipe.calibration
        batches = calibration_mix(
            cal.mix or {cal.source: 1.0}, tokenizer, num_samples=cal.num_samples,
            seq_len=cal.seq_len, seed=cal.seed, data_dir=data_dir,
        )
        state.calibration_batches = lambda: list(batches.split(1))
    return state


def model_folders(recipe: Recipe, model: str | None) -> list[Path]:
    """Local folders the job reads models from (the model, distillation teachers): the output
    folder may not be, contain or lie inside one of them."""
    sources = [model or recipe.model]
    sources += [t for p in recipe.passes if isinstance(t := getattr(p, "teacher", None), str)]
    return [d for d in map(local_model_dir, sources) if d is not None]


class JobOptions(BaseModel):
    """How a job runs, as the CLI's flags set it (``run_job`` documents each)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data_dir: str | None = None  # data folder (default: $COMPRESS_DATA_DIR)
    progress: bool = True  # progress bars
    overwrite: bool = False  # replace a folder that is not an earlier compress output
    resume: bool = True  # reuse perplexity windows saved by an earlier run
    kl_top_k: int = KL_TOP_K  # baseline log-probs kept per token for KL; 0 leaves KL out


@dataclass
class JobPlan:
    """A job checked before any work (``plan_job``): the recipe, where the model is read from,
    the evaluation text, whether it streams and the memory preflight's estimate. A plan runs
    once: a streamed job's passes rewrite its meta ``skeleton`` in place."""

    recipe: Recipe
    source: str  # the model as asked for (a folder, a hub id or an embedded name)
    where: Path | str  # where it is read from (``compress.io.load.resolve_model_path``)
    text: str | None  # the perplexity text; None when the recipe scores none
    text_source: str | None  # its path, for the protocol
    skeleton: Any  # the meta skeleton a streamed job works on, else None
    reader: Any  # the checkpoint's ``CheckpointReader`` when streamed, else None
    # streamed, not_streamed_because, estimate; peak_rss_bytes is filled as phases run
    memory: dict[str, Any]

    @property
    def streamed(self) -> bool:
        return self.memory["streamed"]


@dataclass
class Evaluation:
    """What a job measured on one model, the baseline or the compressed one. ``evaluated`` is
    False for a streamed job that evaluates nothing: only ``sizes`` (of its skeleton) then."""

    perplexity: Any  # compress.eval.quality's result; None without eval.perplexity
    extras: dict[str, Any]  # lm-eval tasks / latency, when the recipe asks for them
    sizes: dict[str, int]  # compress.quant.linear.model_bytes
    bits_per_weight: float | None = None  # over every weight matrix (quant.linear)
    evaluated: bool = True


@dataclass
class JobOutcome:
    """One job's results, before a caller turns them into its rows."""

    state: CompressionState  # its reports
    baseline: Evaluation | None  # the baseline it scored against (given or its own)
    compressed: Evaluation
    pass_seconds: float  # wall time of the passes
    pass_peak_bytes: int  # the largest peak resident memory of a pass
    report: dict[str, Any] | None = None  # what ``report`` returned (the export's report.json)
    disk_bytes: int | None = None  # the checkpoint's size on disk, None when none was kept


def plan_job(
    recipe: Recipe, *, model: str | None = None, data_dir: str | None = None,
    stream: bool | None = None,
) -> JobPlan:
    """Every check that needs no model in memory, in order: the device, the evaluation text,
    the model source, whether the job can stream (``stream`` as for ``run_job``) and the
    memory preflight (``compress.pipeline.preflight.check_memory``, which refuses a job that
    would not fit). Reads only file headers and config.json."""
    from compress.io.load import resolve_model_path
    from compress.pipeline.preflight import check_memory

    resolve_device(recipe.device)  # cuda without a GPU fails here, before any work
    text, source = None, None
    if recipe.eval.perplexity is not None:
        path = resolve_text_path(recipe.eval.perplexity.dataset, data_dir)
        text, source = read_text(path), str(path)
    where = resolve_model_path(model or recipe.model)
    refuse_bnb_of_multimodal(recipe, where)
    check_lengths(recipe, where)
    refusal = stream_refusal(recipe, where)
    skeleton = reader = None
    if refusal is None:
        from compress.io.names import tree_reader
        from compress.io.stream import meta_skeleton, verify_checkpoint

        verify_checkpoint(where)
        skeleton = meta_skeleton(where)
        reader = tree_reader(skeleton, where)  # MoE: per-expert weights fused as layers are read
        refusal = skeleton_refusal(skeleton, reader)
        if refusal is None and _wants_eval(recipe, text):
            refusal = eval_refusal(recipe, where, reader)
    if stream and refusal is not None:
        raise RecipeError(f"this job cannot stream: {refusal}; leave `stream` unset")
    streamed = refusal is None and stream is not False
    estimate = check_memory(recipe, where, streamed=streamed, skeleton=skeleton)
    memory: dict[str, Any] = {"streamed": streamed, "not_streamed_because": refusal,
                              "estimate": estimate, "peak_rss_bytes": {},
                              "activations": estimate["activations"]}
    if not streamed:
        skeleton = reader = None  # the job loads the model whole; the skeleton is not needed
    return JobPlan(recipe, model or recipe.model, where, text, source, skeleton, reader, memory)


def _plan_key(recipe: Recipe) -> tuple:
    """What a plan's decisions depend on: the passes' kinds, the calibration, the evaluation,
    the export and the device (``compress.pipeline.preflight.estimate``, ``stream_refusal``)."""
    return ([pass_name_of(p) for p in recipe.passes], recipe.calibration, recipe.eval,
            recipe.export, recipe.device, recipe.model)


def with_recipe(plan: JobPlan, recipe: Recipe) -> JobPlan:
    """``plan`` for ``recipe``, a recipe its checks hold for unchanged: the same pass kinds,
    calibration, evaluation, export, device and model, other settings (formats per layer)
    free. ``compress tune`` plans its verification before it knows the layers' formats."""
    if _plan_key(recipe) != _plan_key(plan.recipe):
        raise ValueError(f"recipe {recipe.name!r} differs from the planned {plan.recipe.name!r} "
                         "in what the plan checked (passes, calibration, eval, export, device)")
    return dataclasses.replace(plan, recipe=recipe)


def run_job(
    recipe: Recipe,
    *,
    model: str | None = None,
    out_dir: str | Path | None = None,
    data_dir: str | None = None,
    progress: bool = True,
    overwrite: bool = False,
    resume: bool = True,
    kl_top_k: int = KL_TOP_K,
    stream: bool | None = None,
) -> JobResult:
    """Run ``recipe`` and write the checkpoint and results into ``out_dir`` (default
    ``out/<recipe name>``). ``out_dir`` must be missing, empty or an earlier compress output
    unless ``overwrite``; it is never the model's own folder (checked before any work).
    resume: reuse perplexity windows saved by an earlier run on the same weights and protocol
    (see ``evaluate_perplexity``); False recomputes them. kl_top_k: baseline log-probs kept per
    token for the KL columns (needs ``eval.baseline``); 0 leaves KL out.

    stream: run the passes layer by layer from the checkpoint (``stream_refusal`` says when
    that is possible; None: whenever it is). Streamed, only one decoder layer is in memory in
    the compute dtype at a time and the export is written as layers finish; evaluation loads
    the baseline and then the exported checkpoint whole, one at a time. Every job is first
    checked against the available memory (``compress.pipeline.preflight``)."""
    out = Path(out_dir or Path("out") / recipe.name)
    check_output_dir(out, overwrite=overwrite, protect=model_folders(recipe, model))
    plan = plan_job(recipe, model=model, data_dir=data_dir, stream=stream)
    options = JobOptions(data_dir=data_dir, progress=progress, overwrite=overwrite,
                         resume=resume, kl_top_k=kl_top_k)
    return run_planned(plan, out, options)


def run_planned(plan: JobPlan, out: Path, options: JobOptions) -> JobResult:
    """``run_job`` after its checks: the job of ``plan`` (``execute_job``), its checkpoint in
    ``out`` and its results table (``results.md``/``results.json``) beside it."""
    from compress.eval.report import markdown_table, write_results

    started = time.perf_counter()
    recipe = plan.recipe
    rows: list[dict[str, Any]] = []

    def report(outcome: JobOutcome) -> dict[str, Any]:
        rows.extend(_job_rows(plan, outcome))
        return _payload(plan, outcome, rows)

    outcome = execute_job(plan, out, options, report=report)
    payload = outcome.report
    if outcome.disk_bytes is not None:
        rows[-1]["disk_mb"] = outcome.disk_bytes / 1e6  # after report.json was written
    payload["seconds"] = round(time.perf_counter() - started, 1)
    compressed = outcome.compressed.perplexity
    protocol = ""
    if compressed:
        protocol = protocol_line(compressed, compressed.kl.top_k if compressed.kl else None)
    known = {*dict(COLUMNS), "kl_stderr"}
    extra = [(k, LATENCY_COLUMNS.get(k, f"{k} acc")) for k in rows[-1] if k not in known]
    columns = COLUMNS[:-1] + extra + COLUMNS[-1:]
    markdown = (f"## {recipe.name}\n\n" + markdown_table(rows, columns) + protocol
                + memory_line(plan.memory))
    write_results(out, "results", markdown, payload, overwrite=options.overwrite)
    return JobResult(out, rows, markdown, payload)


def execute_job(
    plan: JobPlan, out: Path, options: JobOptions, *, export: bool = True,
    baseline: Evaluation | None = None, report=None, label: str = "compressed perplexity",
) -> JobOutcome:
    """The one orchestration of ``run``, ``sweep`` and ``tune``: load, baseline, passes,
    evaluation, export, each phase's peak memory into ``plan.memory``. Streamed when the plan
    says so (``_run_streamed``), else on the model loaded whole (``_run_in_memory``).

    export: write the checkpoint into ``out`` (atomically). Without it nothing is kept: a
    streamed job writes its export into a scratch folder beside ``out``, scores it there and
    removes it. baseline: an evaluation of the unmodified model to score against (a sweep's
    shared one); None evaluates one here when ``recipe.eval.baseline``. report: called with the
    outcome once the compressed model is evaluated; what it returns is the export's
    ``report.json``. label: the compressed perplexity's progress-bar name."""
    run = _run_streamed if plan.streamed else _run_in_memory
    with current_device(resolve_device(plan.recipe.device)):  # Triton launches on the current
        return run(plan, out, options, export=export, baseline=baseline, report=report,
                   label=label)


def evaluate_baseline(plan: JobPlan, options: JobOptions) -> Evaluation:
    """The unmodified model of ``plan`` loaded whole, evaluated under its recipe's ``eval``
    (with the top-k log-probs later variants' KL needs) and freed before this returns: a
    sweep's shared baseline, and a streamed job's own."""
    import gc

    with _Phase(plan.memory, "baseline eval"):
        if plan.streamed and layerwise_eval(plan.recipe):  # preflight's rule, one place
            return _evaluate_layerwise(plan, plan.where, options, label="baseline perplexity",
                                       top_k=options.kl_top_k)
        loaded = _load_whole(plan)
        result = _evaluate(plan, loaded.model, loaded.tokenizer, options,
                           label="baseline perplexity", top_k=options.kl_top_k)
        del loaded
        gc.collect()
    return result


def _evaluate_layerwise(plan: JobPlan, folder: Path, options: JobOptions, *, label: str,
                        top_k: int | None = None,
                        baseline: Evaluation | None = None) -> Evaluation:
    """``_evaluate`` of the checkpoint at ``folder`` read one decoder layer at a time: the
    same numbers as the model loaded whole (``compress.eval.quality``)."""
    from compress.io.export import layerwise_model
    from compress.io.load import load_tokenizer
    from compress.quant.linear import bits_per_weight

    stream = layerwise_model(folder)
    kl_base = baseline.perplexity.top_k_path if baseline and baseline.perplexity else None
    result = evaluate_perplexity(
        stream.model, load_tokenizer(folder), plan.recipe, plan.text,
        plan.text_source, options.progress, label=label, resume=options.resume, top_k=top_k,
        kl_base=kl_base, stream=stream,
    )
    return Evaluation(result, {}, model_bytes(stream.model), bits_per_weight(stream.model))


def memory_line(memory: dict[str, Any]) -> str:
    """The table's footnote on memory: peak resident memory per phase, and how it ran."""
    peaks = memory.get("peak_rss_bytes") or {}
    if not peaks:
        return ""
    cells = ", ".join(f"{phase} {value / 2**30:.2f}" for phase, value in peaks.items())
    how = ("streamed layer by layer" if memory.get("streamed")
           else f"loaded whole ({memory.get('not_streamed_because') or 'stream: false'})")
    if memory.get("activations") == "disk":  # resident pages of those files count above
        how += ", the calibration's hidden states waiting in files beside the output"
    return f"\n\nPeak resident memory per phase, GiB: {cells}; the model was {how}."


class _Phase:
    """Peak resident memory of one phase of the job (``compress.memory.MemoryMonitor``) into
    ``memory["peak_rss_bytes"][name]``."""

    def __init__(self, memory: dict[str, Any], name: str) -> None:
        import torch

        from compress.memory import MemoryMonitor

        self.memory, self.name = memory, name
        self.monitor = MemoryMonitor(torch.device("cpu"))

    def __enter__(self) -> _Phase:
        self.monitor.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.monitor.__exit__(*exc)
        peaks = self.memory["peak_rss_bytes"]
        peaks[self.name] = max(peaks.get(self.name, 0), self.monitor.peak_bytes)


def _load_whole(plan: JobPlan):
    """The model loaded whole (float32). A streamed plan reads the folder it resolved (an
    embedded model's cache); the source stays what was asked for, for the tables."""
    loaded = load_model(str(plan.where) if plan.streamed else plan.source)
    loaded.source = plan.source
    return loaded


def _evaluate(plan: JobPlan, model, tokenizer, options: JobOptions, *, label: str,
              top_k: int | None = None, baseline: Evaluation | None = None) -> Evaluation:
    """Perplexity (with the KL against ``baseline``'s top-k), the recipe's tasks and latency,
    and the sizes of ``model``."""
    from compress.eval.compare import evaluate_extras
    from compress.quant.linear import bits_per_weight

    recipe = plan.recipe
    kl_base = baseline.perplexity.top_k_path if baseline and baseline.perplexity else None
    result = evaluate_perplexity(
        model, tokenizer, recipe, plan.text, plan.text_source, options.progress,
        label=label, resume=options.resume, top_k=top_k, kl_base=kl_base,
    )
    with on_eval_device(model, resolve_device(recipe.device)):
        extras = evaluate_extras(model, tokenizer, recipe.eval, options.data_dir)
    return Evaluation(result, extras, model_bytes(model), bits_per_weight(model))


def _sizes_only(model) -> Evaluation:
    """A streamed job that evaluates nothing still reports its (skeleton's) sizes."""
    return Evaluation(None, {}, model_bytes(model), evaluated=False)


def _job_rows(plan: JobPlan, outcome: JobOutcome) -> list[dict[str, Any]]:
    """``compress run``'s table: the baseline (when evaluated here or given) and the result."""
    from compress.eval.report import kl_cells

    def row(variant: str, ev: Evaluation, base) -> dict[str, Any]:
        cells: dict[str, Any] = {"variant": variant}
        if ev.evaluated:
            cells["perplexity"] = ev.perplexity.perplexity if ev.perplexity else None
            cells.update(kl_cells(ev.perplexity, base))
        cells["linear_weight_mb"] = ev.sizes["linear"] / 1e6
        cells["weight_mb"] = ev.sizes["total"] / 1e6
        return {**cells, **extra_cells(ev.extras)}

    rows = []
    baseline = outcome.baseline.perplexity if outcome.baseline else None
    if outcome.baseline is not None:
        rows.append(row(f"baseline ({plan.source})", outcome.baseline, baseline))
    compressed = outcome.compressed
    rows.append(row(plan.recipe.name, compressed, baseline))
    if baseline and compressed.perplexity:
        rows[-1]["ppl_delta_pct"] = 100 * (compressed.perplexity.perplexity
                                           / baseline.perplexity - 1)
    return rows


def _payload(plan: JobPlan, outcome: JobOutcome, rows) -> dict[str, Any]:
    from compress.eval.report import environment

    baseline, compressed = outcome.baseline, outcome.compressed
    return {
        "recipe": plan.recipe.to_dict(),
        "model": plan.source,
        "environment": environment(),
        "device": device_name(outcome.state.device),  # where the passes ran (eval: its protocol)
        "passes": [r.to_dict() for r in outcome.state.reports],
        "eval": {
            "baseline": baseline.perplexity.to_dict() if baseline and baseline.perplexity
            else None,
            "compressed": compressed.perplexity.to_dict() if compressed.perplexity else None,
            # lm-eval tasks / latency, when requested
            "baseline_extras": baseline.extras if baseline else {},
            "compressed_extras": compressed.extras,
        },
        "rows": rows,
        "memory": plan.memory,
    }


def _wants_eval(recipe: Recipe, text) -> bool:
    cfg = recipe.eval
    return (cfg.perplexity is not None and text is not None) or any(
        getattr(cfg, k, None) is not None for k in ("tasks", "latency"))


def _run_passes_timed(plan: JobPlan, model, state: CompressionState, before_each=None):
    """Each pass in its own memory phase; returns (seconds, the largest pass peak).
    before_each(index): called before pass ``index`` (a stream points its sink there)."""
    started = time.perf_counter()
    peaks = plan.memory["peak_rss_bytes"]
    names = []
    for index, cfg in enumerate(plan.recipe.passes):
        if before_each is not None:
            before_each(index)
        names.append(f"pass {index} {pass_name_of(cfg)}")
        with _Phase(plan.memory, names[-1]):
            run_passes(model, [cfg], state, first_index=index)
    return time.perf_counter() - started, max((peaks[n] for n in names), default=0)


def _run_in_memory(plan, out, options, *, export, baseline, report, label) -> JobOutcome:
    recipe = plan.recipe
    with _Phase(plan.memory, "load"):
        loaded = _load_whole(plan)
    state = recipe_state(recipe, loaded.tokenizer, progress=options.progress,
                         data_dir=options.data_dir, activations_near=_spill_near(plan, out))
    if any(PASSES[pass_name_of(p)].needs_teacher for p in recipe.passes):
        state.teacher = copy.deepcopy(loaded.model).eval()
    if baseline is None and recipe.eval.baseline:
        with _Phase(plan.memory, "baseline eval"):  # on the loaded model: no second load
            baseline = _evaluate(plan, loaded.model, loaded.tokenizer, options,
                                 label="baseline perplexity", top_k=options.kl_top_k)
    seconds, peak = _run_passes_timed(plan, loaded.model, state)
    with _Phase(plan.memory, "eval"):
        compressed = _evaluate(plan, loaded.model, loaded.tokenizer, options, label=label,
                               baseline=baseline)
    outcome = JobOutcome(state, baseline, compressed, seconds, peak)
    outcome.report = report(outcome) if report else None
    if export and recipe.export.enabled:
        with _Phase(plan.memory, "export"):
            export_checkpoint(
                loaded.model, loaded.tokenizer, out,
                dtype=resolve_export_dtype(recipe.export.dtype, loaded.path),
                recipe_yaml=recipe.to_yaml(), report=outcome.report,
                overwrite=options.overwrite, max_shard_size=recipe.export.max_shard_size,
            )
        outcome.disk_bytes = _dir_bytes(out)
    return outcome


def _spill_near(plan: JobPlan, out: Path) -> Path | None:
    """Where calibrated passes put their hidden states' files: beside the output (the disk the
    user chose for checkpoints, not a temp folder that may be memory), or None: in memory."""
    return Path(out).parent if plan.memory.get("activations") == "disk" else None


@contextlib.contextmanager
def _scratch_directory(near: Path) -> Iterator[Path]:
    """A hidden sibling of ``near`` for a streamed job that keeps no checkpoint (a sweep row):
    its export is written, scored and removed there. Beside the output, not in the system
    temp folder: on the same disk, which the preflight's user chose for checkpoints."""
    import shutil
    import tempfile

    near.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f".{near.name}.scratch-", dir=near.parent))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _run_streamed(plan, out, options, *, export, baseline, report, label) -> JobOutcome:
    """The passes layer by layer (``compress.io.stream.StreamedModel``), the last one writing
    each finished layer into the export; evaluation layer by layer too (``layerwise_eval``;
    a bitsandbytes export is loaded whole, ``layerwise_export_eval``), else on whole models,
    one at a time."""
    import gc

    from compress.io.load import check_tokenizer_fits, load_tokenizer
    from compress.output_dir import atomic_directory

    recipe, skeleton = plan.recipe, plan.skeleton
    tokenizer = load_tokenizer(plan.where)  # the checks load_model makes
    check_tokenizer_fits(tokenizer, skeleton.get_input_embeddings().num_embeddings, plan.where)
    state = recipe_state(recipe, tokenizer, progress=options.progress, data_dir=options.data_dir,
                         activations_near=_spill_near(plan, out))
    wants_eval = _wants_eval(recipe, plan.text)
    if baseline is None and recipe.eval.baseline:
        baseline = evaluate_baseline(plan, options) if wants_eval else _sizes_only(skeleton)
    folder = (atomic_directory(out, overwrite=options.overwrite) if export
              else _scratch_directory(out))
    with folder as tmp:
        seconds, peak = _stream_passes(plan, state, tmp, tokenizer)
        compressed = _sizes_only(skeleton)
        if wants_eval and layerwise_export_eval(recipe):
            with _Phase(plan.memory, "eval"):
                compressed = _evaluate_layerwise(plan, tmp, options, label=label,
                                                 baseline=baseline)
        elif wants_eval:
            with _Phase(plan.memory, "eval"):
                loaded = load_model(str(tmp))
                compressed = _evaluate(plan, loaded.model, loaded.tokenizer, options,
                                       label=label, baseline=baseline)
                del loaded
                gc.collect()
        outcome = JobOutcome(state, baseline, compressed, seconds, peak)
        outcome.report = report(outcome) if report else None
        if export:
            write_provenance(tmp, None, None, outcome.report)
            outcome.disk_bytes = _dir_bytes(tmp)
    return outcome


def _stream_passes(plan: JobPlan, state: CompressionState, folder: Path, tokenizer):
    """Run the passes on the stream, the last one sinking finished layers into the export in
    ``folder``; then the rest of the export and its tokenizer and recipe. Returns
    ``_run_passes_timed``'s (seconds, peak)."""
    import torch

    from compress.arch import arch_for, decoder_layers
    from compress.io.export import StreamedExport
    from compress.io.stream import StreamedModel

    recipe, skeleton = plan.recipe, plan.skeleton
    arch = arch_for(skeleton, "streaming")
    streamed = StreamedModel(skeleton, plan.reader, torch.float32,
                             decoder_layers(skeleton, "streaming"), arch.layer_prefix,
                             folder / ".scratch")
    dtype = export_dtype(recipe, plan.where)
    if dtype != resolve_export_dtype(recipe.export.dtype, plan.where):  # as export_checkpoint
        log.warning("bitsandbytes export keeps non-quantized tensors in %s (asked: %s)", dtype,
                    resolve_export_dtype(recipe.export.dtype, plan.where))
    exporter = StreamedExport(skeleton, folder, dtype, recipe.export.max_shard_size)
    state.stream = streamed
    last = len(recipe.passes) - 1

    def sink_after_last(index: int) -> None:
        streamed.sink = exporter if index == last else None

    try:
        timed = _run_passes_timed(plan, skeleton, state, before_each=sink_after_last)
        with _Phase(plan.memory, "export"):
            exporter.finish(streamed)
        streamed.release_outside()  # written: the evaluation after it reads the export
    except BaseException:
        exporter.writer.abort()
        raise
    finally:
        streamed.close()
        state.stream = None
    write_provenance(folder, tokenizer, recipe.to_yaml(), None)
    return timed
