"""``compress run``: load the model, evaluate the baseline, run the passes, evaluate the result,
export the checkpoint and write the baseline-vs-compressed table.

Everything that can be checked before the expensive work is checked first: the recipe (already
validated), the output directory, the model source, and the evaluation and calibration data.
This is the orchestration layer, so it (like the CLI) may import ``compress.eval``.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compress.calibration import calibration_mix
from compress.core import PASSES, CompressionState, pass_name_of, run_passes
from compress.data import resolve_text_path
from compress.export import check_writable, export_checkpoint
from compress.models import load_model
from compress.modules import model_bytes
from compress.recipe import Recipe

log = logging.getLogger(__name__)

COLUMNS = [
    ("variant", "variant"),
    ("perplexity", "WikiText-2 ppl"),
    ("ppl_delta_pct", "Δ ppl %"),
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


LATENCY_COLUMNS = {"ttft_p50_ms": "TTFT p50 ms", "tpot_p50_ms": "TPOT p50 ms"}


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
    return cells


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _evaluate(model, tokenizer, recipe: Recipe, text: str | None, source: str, progress: bool):
    from compress.eval.quality import perplexity

    cfg = recipe.eval.perplexity
    if cfg is None or text is None:
        return None
    return perplexity(
        model,
        tokenizer,
        text,
        context_length=cfg.context_length,
        stride=cfg.stride,
        limit=cfg.limit,
        source=source,
        progress=progress,
    )


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


def run_job(
    recipe: Recipe,
    *,
    model: str | None = None,
    out_dir: str | Path | None = None,
    data_dir: str | None = None,
    progress: bool = True,
) -> JobResult:
    from compress.eval.report import environment, markdown_table

    started = time.perf_counter()
    out = Path(out_dir or Path("out") / recipe.name)
    check_writable(out)
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
        baseline = _evaluate(loaded.model, loaded.tokenizer, recipe, text, source, progress)
        baseline_extras = evaluate_extras(loaded.model, loaded.tokenizer, recipe.eval, data_dir)
        sizes = model_bytes(loaded.model)
        rows.append({
            "variant": f"baseline ({loaded.source})",
            "perplexity": baseline.perplexity if baseline else None,
            "linear_weight_mb": sizes["linear"] / 1e6,
            "weight_mb": sizes["total"] / 1e6,
            **extra_cells(baseline_extras),
        })
    run_passes(loaded.model, recipe.passes, state)
    compressed = _evaluate(loaded.model, loaded.tokenizer, recipe, text, source, progress)
    compressed_extras = evaluate_extras(loaded.model, loaded.tokenizer, recipe.eval, data_dir)
    sizes = model_bytes(loaded.model)
    row = {
        "variant": recipe.name,
        "perplexity": compressed.perplexity if compressed else None,
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
            loaded.model, loaded.tokenizer, out, dtype=recipe.export.dtype,
            recipe_yaml=recipe.to_yaml(), report=payload,
        )
        row["disk_mb"] = _dir_bytes(out) / 1e6
    payload["seconds"] = round(time.perf_counter() - started, 1)
    protocol = ""
    if compressed:
        p = compressed.protocol
        protocol = (
            f"\n\nPerplexity: token-level, {p['source']}, context {p['context_length']}, stride "
            f"{p['stride']}, {p['windows']} windows ({compressed.scored_tokens} scored tokens)."
        )
    extra = [(k, LATENCY_COLUMNS.get(k, f"{k} acc")) for k in rows[-1] if k not in dict(COLUMNS)]
    columns = COLUMNS[:-1] + extra + COLUMNS[-1:]
    markdown = f"## {recipe.name}\n\n" + markdown_table(rows, columns) + protocol
    from compress.eval.report import write_results

    write_results(out, "results", markdown, payload)
    return JobResult(out, rows, markdown, payload)
