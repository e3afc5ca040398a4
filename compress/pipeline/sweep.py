"""``compress sweep``: several recipes against one shared baseline, in one comparison table.

Each recipe is one job of ``compress.pipeline.job`` (``execute_job``: the same load, passes,
evaluation and memory phases as ``compress run``, streamed layer by layer when the job can
stream), checked by the memory preflight before any of them starts. The baseline is evaluated
once (``evaluate_baseline``) and freed; each job then loads its own copy of the model, so no two
copies are alive at once. Rows are what ``compress run`` reports for each recipe alone, plus bits
per weight, pass time and peak memory.

Long sweeps resume. Every finished row is saved in ``<out>/sweep.json`` the moment it is done,
and a rerun of the same command skips rows whose resolved recipe and evaluation protocol are
unchanged; perplexity windows also resume inside an unfinished row (``compress.eval.quality``).
Checkpoints are not kept (``compress run RECIPE`` exports the one you pick); a streamed row
writes its export into a scratch folder beside ``<out>``, scores it and removes it.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from compress.core.device import resolve_device
from compress.core.errors import RecipeError
from compress.output_dir import check_output_dir
from compress.pipeline.job import (
    KL_TOP_K,
    LATENCY_COLUMNS,
    Evaluation,
    JobOptions,
    JobResult,
    evaluate_baseline,
    execute_job,
    extra_cells,
    model_folders,
    plan_job,
    protocol_line,
)
from compress.recipe import Recipe

log = logging.getLogger(__name__)

COLUMNS = [
    ("variant", "variant"),
    ("perplexity", "WikiText-2 ppl"),
    ("ppl_delta_pct", "Δ ppl %"),
    ("kl", "KL"),
    ("top1_changed_pct", "top-1 changed %"),
    ("bits_per_weight", "bits/weight"),
    ("linear_weight_mb", "linear weights MB"),
    ("pass_s", "passes s"),
    ("peak_mb", "peak RSS MB"),
]


def _common_eval(recipes: list[Recipe]) -> dict[str, Any]:
    """The perplexity protocol every recipe shares (one baseline serves them all), or an error
    naming the recipes that differ."""
    protocols = {r.name: r.eval.perplexity.model_dump() if r.eval.perplexity else None
                 for r in recipes}
    first = recipes[0].name
    different = [name for name, p in protocols.items() if p != protocols[first]]
    if protocols[first] is None or different:
        raise RecipeError(
            f"sweep: every recipe must evaluate perplexity with the same settings so that one "
            f"baseline serves them all; {first} has {protocols[first]}, while "
            f"{', '.join(f'{n} has {protocols[n]}' for n in different) or 'it has none'}. "
            "Align them with --set eval.perplexity.KEY=VALUE (applied to every recipe)."
        )
    return protocols[first]


def _load_previous(path: Path, settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Rows of an earlier run with the same settings, by recipe name (empty when none)."""
    try:
        previous = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(previous, dict) or previous.get("settings") != settings \
            or not isinstance(previous.get("rows", []), list):
        return {}
    # a damaged or hand-edited row (not an object, a NaN perplexity) is run again, not reported
    return {row["recipe"]: row for row in previous.get("rows", [])
            if isinstance(row, dict) and isinstance(row.get("recipe"), str) and all(
                math.isfinite(v) for v in row.values() if isinstance(v, float))}


def _row(variant: str, measured: Evaluation, baseline: Evaluation | None) -> dict[str, Any]:
    from compress.eval.report import kl_cells

    result, base = measured.perplexity, baseline.perplexity if baseline else None
    row = {
        "variant": variant,
        "perplexity": result.perplexity,
        **kl_cells(result, base or result),  # the baseline row: its own baseline, KL 0
        "bits_per_weight": measured.bits_per_weight,
        "linear_weight_mb": measured.sizes["linear"] / 1e6,
        "weight_mb": measured.sizes["total"] / 1e6,
        "scored_tokens": result.scored_tokens,
    }
    if base is not None:
        row["ppl_delta_pct"] = 100 * (result.perplexity / base.perplexity - 1)
    return row


def run_sweep(
    recipes: list[Recipe],
    *,
    model: str | None = None,
    out_dir: str | Path = "out/sweep",
    data_dir: str | None = None,
    progress: bool = True,
    overwrite: bool = False,
    resume: bool = True,
    kl_top_k: int = KL_TOP_K,
) -> JobResult:
    """Run each recipe as a job against one baseline and write ``sweep.md``/``sweep.json``
    (and the same table so far after every row) into ``out_dir``. kl_top_k: as for
    ``run_job`` (0 leaves the KL columns out). Every job that will run is planned, and so
    checked against the available memory, before the first one starts."""
    from compress.eval.report import environment, markdown_table, write_results

    if not recipes:
        raise RecipeError("sweep: give at least one recipe")
    names = [r.name for r in recipes]
    if len(set(names)) != len(names):
        raise RecipeError(f"sweep: recipe names must differ (they name the rows): {names}")
    sources = {model or r.model for r in recipes}
    if len(sources) != 1:
        raise RecipeError(
            f"sweep: the recipes name different models {sorted(sources)}; one baseline needs one "
            "model: pass --model to run them all on the same one"
        )
    out = Path(out_dir)
    protect = [d for r in recipes for d in model_folders(r, model)]
    check_output_dir(out, overwrite=overwrite, protect=protect)
    protocol = _common_eval(recipes)
    source_model = sources.pop()
    # where the rows run (``device: auto`` is the GPU on one host, the CPU on another): a row
    # computed on one is not reused on the other
    devices = sorted({str(resolve_device(r.device)) for r in recipes})
    settings = {"model": source_model, "perplexity": protocol, "kl_top_k": kl_top_k,
                "devices": devices}
    done = _load_previous(out / "sweep.json", settings) if resume else {}
    pending = {r.name for r in recipes
               if r.to_yaml() != done.get(r.name, {}).get("recipe_yaml")}
    # every job that will run is checked before the first starts; the first recipe's plan
    # also serves the baseline (its eval section, as before)
    plans = {r.name: plan_job(r, model=source_model, data_dir=data_dir)
             for r in recipes if r is recipes[0] or r.name in pending}
    options = JobOptions(data_dir=data_dir, progress=progress, overwrite=overwrite,
                         resume=resume, kl_top_k=kl_top_k)

    baseline = evaluate_baseline(plans[recipes[0].name], options)
    # lm-eval tasks / latency when the recipes' eval asks for them (the first recipe's section
    # for the baseline): the columns bench scripts used to add, now from the product
    extra_keys: list[str] = []

    def extras(measured: Evaluation) -> dict[str, Any]:
        cells = extra_cells(measured.extras)
        extra_keys.extend(k for k in cells if k not in extra_keys)
        return cells

    rows = [{**_row(f"baseline ({source_model})", baseline, None), **extras(baseline),
             "recipe": None}]
    footnote_top_k = kl_top_k if baseline.perplexity.top_k_path else None
    payload: dict[str, Any] = {"settings": settings, "environment": environment(), "rows": rows}

    def save() -> str:
        for row in rows:  # rows read back from an earlier run bring their extra columns
            extra_keys.extend(k for k in row.get("extra_keys", ()) if k not in extra_keys)
        columns = COLUMNS + [(k, LATENCY_COLUMNS.get(k, f"{k} acc")) for k in extra_keys]
        markdown = (f"## sweep on {source_model}\n\n" + markdown_table(rows, columns)
                    + protocol_line(baseline.perplexity, footnote_top_k))
        write_results(out, "sweep", markdown, payload, overwrite=overwrite)
        return markdown

    for index, recipe in enumerate(recipes, 1):
        if recipe.name not in pending:
            log.info("sweep %d/%d %s: done in an earlier run, row read back", index,
                     len(recipes), recipe.name)
            rows.append(done[recipe.name])
            continue
        log.info("sweep %d/%d %s", index, len(recipes), recipe.name)
        outcome = execute_job(plans.pop(recipe.name), out, options, export=False,
                              baseline=baseline, label=f"{recipe.name} perplexity")
        cells = extras(outcome.compressed)
        rows.append({
            **_row(recipe.name, outcome.compressed, baseline),
            **cells,
            "extra_keys": list(cells),
            "recipe": recipe.name,
            "recipe_yaml": recipe.to_yaml(),
            "pass_s": round(outcome.pass_seconds, 1),
            "peak_mb": outcome.pass_peak_bytes / 1e6,
            "passes": [r.to_dict() for r in outcome.state.reports],
        })
        save()  # the row is on disk before the next recipe starts
    return JobResult(out, rows, save(), payload)
