"""``compress run``: load the model, evaluate the baseline, run the passes, evaluate the result,
export the checkpoint and write the baseline-vs-compressed table.

Everything that can be checked before the expensive work is checked first: the recipe (already
validated), the output directory, the model source, and the evaluation and calibration data.
This is the orchestration layer, so it (like the CLI) may import ``compress.eval``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compress.calibration import calibration_mix
from compress.core.registry import PASSES, CompressionState, pass_name_of, run_passes
from compress.data import resolve_text_path
from compress.io.export import export_checkpoint, resolve_export_dtype
from compress.io.load import load_model, local_model_dir
from compress.output_dir import check_output_dir
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
):
    """Perplexity under the recipe's protocol. Per-window results are saved as they go under
    ``<cache dir>/perplexity/`` (keyed by weights, tokens and protocol, see
    ``compress.eval.quality``), so a rerun skips finished evaluations and resumes a cut one.
    top_k: also store this model's top-k log-probs (under ``<cache dir>/perplexity-top-k/``) for
    the KL of later variants; kl_base: the ``top_k_path`` of such a baseline, for ``result.kl``.
    Weight-only int4/int8 layers are scored as their dequantized float32 weights (the reference
    definition; ``compress.quant.linear.dequantized_for_scoring``)."""
    cfg = recipe.eval.perplexity
    if cfg is None or text is None:
        return None
    if cfg.limit is None:
        log.info("%s: scoring every window of %s (WikiText-2 test: 593 windows, 10-15 min per "
                 "model on 2 idle CPU cores); stop at any time, the same command resumes", label,
                 cfg.dataset)
    with dequantized_for_scoring(model):
        result = _perplexity(model, tokenizer, text, cfg, source, progress, label, resume,
                             top_k, kl_base)
    log.info("%s: %.2f over %d windows (%d scored tokens)%s", label, result.perplexity,
             result.windows, result.scored_tokens,
             f"; KL {result.kl.kl_mean:.4g}, top-1 changed {result.kl.top1_changed_pct:.2f}%"
             if result.kl else "")
    return result


def _perplexity(model, tokenizer, text, cfg, source, progress, label, resume, top_k, kl_base):
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
    recipe: Recipe, tokenizer, *, progress: bool = True, data_dir: str | None = None
) -> CompressionState:
    """The ``CompressionState`` a recipe's passes run with: its calibration sequences (drawn
    once, handed out as batches of one) when it has a ``calibration`` section."""
    state = CompressionState(tokenizer=tokenizer, progress=progress, data_dir=data_dir)
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
) -> JobResult:
    """Run ``recipe`` and write the checkpoint and results into ``out_dir`` (default
    ``out/<recipe name>``). ``out_dir`` must be missing, empty or an earlier compress output
    unless ``overwrite``; it is never the model's own folder (checked before any work).
    resume: reuse perplexity windows saved by an earlier run on the same weights and protocol
    (see ``evaluate_perplexity``); False recomputes them. kl_top_k: baseline log-probs kept per
    token for the KL columns (needs ``eval.baseline``); 0 leaves KL out."""
    from compress.eval.report import environment, kl_cells, markdown_table

    started = time.perf_counter()
    out = Path(out_dir or Path("out") / recipe.name)
    check_output_dir(out, overwrite=overwrite, protect=model_folders(recipe, model))
    text, source = None, None
    if recipe.eval.perplexity is not None:
        path = resolve_text_path(recipe.eval.perplexity.dataset, data_dir)
        text, source = path.read_text(encoding="utf-8"), str(path)
    loaded = load_model(model or recipe.model)
    state = recipe_state(recipe, loaded.tokenizer, progress=progress, data_dir=data_dir)
    if any(PASSES[pass_name_of(p)].needs_teacher for p in recipe.passes):
        state.teacher = copy.deepcopy(loaded.model).eval()

    from compress.eval.compare import evaluate_extras

    rows: list[dict[str, Any]] = []
    baseline, baseline_extras = None, {}
    if recipe.eval.baseline:
        baseline = evaluate_perplexity(
            loaded.model, loaded.tokenizer, recipe, text, source, progress,
            label="baseline perplexity", resume=resume, top_k=kl_top_k,
        )
        baseline_extras = evaluate_extras(loaded.model, loaded.tokenizer, recipe.eval, data_dir)
        sizes = model_bytes(loaded.model)
        rows.append({
            "variant": f"baseline ({loaded.source})",
            "perplexity": baseline.perplexity if baseline else None,
            **kl_cells(baseline, baseline),
            "linear_weight_mb": sizes["linear"] / 1e6,
            "weight_mb": sizes["total"] / 1e6,
            **extra_cells(baseline_extras),
        })
    run_passes(loaded.model, recipe.passes, state)
    compressed = evaluate_perplexity(
        loaded.model, loaded.tokenizer, recipe, text, source, progress,
        label="compressed perplexity", resume=resume,
        kl_base=baseline.top_k_path if baseline else None,
    )
    compressed_extras = evaluate_extras(loaded.model, loaded.tokenizer, recipe.eval, data_dir)
    sizes = model_bytes(loaded.model)
    row = {
        "variant": recipe.name,
        "perplexity": compressed.perplexity if compressed else None,
        **kl_cells(compressed, baseline),
        "linear_weight_mb": sizes["linear"] / 1e6,
        "weight_mb": sizes["total"] / 1e6,
        **extra_cells(compressed_extras),
    }
    if baseline and compressed:
        row["ppl_delta_pct"] = 100 * (compressed.perplexity / baseline.perplexity - 1)
    rows.append(row)
    payload: dict[str, Any] = {
        "recipe": recipe.to_dict(),
        "model": loaded.source,
        "environment": environment(),
        "passes": [r.to_dict() for r in state.reports],
        "eval": {
            "baseline": baseline.to_dict() if baseline else None,
            "compressed": compressed.to_dict() if compressed else None,
            "baseline_extras": baseline_extras,  # lm-eval tasks / latency, when requested
            "compressed_extras": compressed_extras,
        },
        "rows": rows,
    }
    if recipe.export.enabled:
        export_checkpoint(
            loaded.model, loaded.tokenizer, out,
            dtype=resolve_export_dtype(recipe.export.dtype, loaded.path),
            recipe_yaml=recipe.to_yaml(), report=payload, overwrite=overwrite,
        )
        row["disk_mb"] = _dir_bytes(out) / 1e6
    payload["seconds"] = round(time.perf_counter() - started, 1)
    protocol = ""
    if compressed:
        protocol = protocol_line(compressed, compressed.kl.top_k if compressed.kl else None)
    known = {*dict(COLUMNS), "kl_stderr"}
    extra = [(k, LATENCY_COLUMNS.get(k, f"{k} acc")) for k in rows[-1] if k not in known]
    columns = COLUMNS[:-1] + extra + COLUMNS[-1:]
    markdown = f"## {recipe.name}\n\n" + markdown_table(rows, columns) + protocol
    from compress.eval.report import write_results

    write_results(out, "results", markdown, payload, overwrite=overwrite)
    return JobResult(out, rows, markdown, payload)
