"""``compress sweep``: several recipes against one shared baseline, in one comparison table.

The model is loaded once and the baseline evaluated once; each recipe then runs its passes on a
fresh copy of the baseline weights and is evaluated on the same perplexity windows. Rows are
what ``compress run`` would report for each recipe alone (the same passes, calibration and
evaluation code), plus bits per weight, pass time and peak memory.

Long sweeps resume. Every finished row is saved in ``<out>/sweep.json`` the moment it is done,
and a rerun of the same command skips rows whose resolved recipe and evaluation protocol are
unchanged; perplexity windows also resume inside an unfinished row (``compress.eval.quality``).
Checkpoints are not exported (``compress run RECIPE`` does that for the one you pick).
"""

from __future__ import annotations

import copy
import json
import logging
import time
from pathlib import Path
from typing import Any

from compress.core.errors import RecipeError
from compress.core.registry import PASSES, pass_name_of, run_passes
from compress.data import resolve_text_path
from compress.io.load import load_model
from compress.memory import MemoryMonitor
from compress.output_dir import check_output_dir
from compress.pipeline.job import (
    KL_TOP_K,
    LATENCY_COLUMNS,
    JobResult,
    evaluate_perplexity,
    extra_cells,
    model_folders,
    protocol_line,
    recipe_state,
)
from compress.quant.linear import bits_per_weight, model_bytes
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
    except (OSError, ValueError):
        return {}
    if previous.get("settings") != settings:
        return {}
    return {row["recipe"]: row for row in previous.get("rows", []) if "recipe" in row}


def _row(variant: str, model, result, baseline) -> dict[str, Any]:
    from compress.eval.report import kl_cells

    sizes = model_bytes(model)
    row = {
        "variant": variant,
        "perplexity": result.perplexity,
        **kl_cells(result, baseline or result),  # the baseline row: its own baseline, KL 0
        "bits_per_weight": bits_per_weight(model),
        "linear_weight_mb": sizes["linear"] / 1e6,
        "weight_mb": sizes["total"] / 1e6,
        "scored_tokens": result.scored_tokens,
    }
    if baseline is not None:
        row["ppl_delta_pct"] = 100 * (result.perplexity / baseline.perplexity - 1)
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
    """Run each recipe's passes on a copy of one baseline and write ``sweep.md``/``sweep.json``
    (and the same table so far after every row) into ``out_dir``. kl_top_k: as for
    ``run_job`` (0 leaves the KL columns out)."""
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
    text_path = resolve_text_path(protocol["dataset"], data_dir)
    text, source = text_path.read_text(encoding="utf-8"), str(text_path)
    source_model = sources.pop()
    settings = {"model": source_model, "perplexity": protocol, "kl_top_k": kl_top_k}
    done = _load_previous(out / "sweep.json", settings) if resume else {}

    loaded = load_model(source_model)
    baseline = evaluate_perplexity(
        loaded.model, loaded.tokenizer, recipes[0], text, source, progress,
        label="baseline perplexity", resume=resume, top_k=kl_top_k,
    )
    from compress.eval.compare import evaluate_extras

    # lm-eval tasks / latency when the recipes' eval asks for them (the first recipe's section
    # for the baseline): the columns bench scripts used to add, now from the product
    extra_keys: list[str] = []

    def extras(model, recipe: Recipe) -> dict[str, Any]:
        cells = extra_cells(evaluate_extras(model, loaded.tokenizer, recipe.eval, data_dir))
        extra_keys.extend(k for k in cells if k not in extra_keys)
        return cells

    rows = [{**_row(f"baseline ({loaded.source})", loaded.model, baseline, None),
             **extras(loaded.model, recipes[0]), "recipe": None}]
    kl_top_k = kl_top_k if baseline.top_k_path else None  # for the footnote
    payload: dict[str, Any] = {"settings": settings, "environment": environment(), "rows": rows}

    def save() -> str:
        for row in rows:  # rows read back from an earlier run bring their extra columns
            extra_keys.extend(k for k in row.get("extra_keys", ()) if k not in extra_keys)
        columns = COLUMNS + [(k, LATENCY_COLUMNS.get(k, f"{k} acc")) for k in extra_keys]
        markdown = (f"## sweep on {loaded.source}\n\n" + markdown_table(rows, columns)
                    + protocol_line(baseline, kl_top_k))
        write_results(out, "sweep", markdown, payload, overwrite=overwrite)
        return markdown

    for index, recipe in enumerate(recipes, 1):
        key = recipe.to_yaml()
        if key == done.get(recipe.name, {}).get("recipe_yaml"):
            log.info("sweep %d/%d %s: done in an earlier run, row read back", index,
                     len(recipes), recipe.name)
            rows.append(done[recipe.name])
            continue
        log.info("sweep %d/%d %s", index, len(recipes), recipe.name)
        variant = copy.deepcopy(loaded.model)
        state = recipe_state(recipe, loaded.tokenizer, progress=progress, data_dir=data_dir)
        if any(PASSES[pass_name_of(p)].needs_teacher for p in recipe.passes):
            state.teacher = copy.deepcopy(loaded.model).eval()  # as run_job: a frozen copy
        started = time.perf_counter()
        with MemoryMonitor(variant.device) as memory:
            run_passes(variant, recipe.passes, state)
        pass_s = time.perf_counter() - started
        result = evaluate_perplexity(
            variant, loaded.tokenizer, recipe, text, source, progress,
            label=f"{recipe.name} perplexity", resume=resume, kl_base=baseline.top_k_path,
        )
        cells = extras(variant, recipe)
        rows.append({
            **_row(recipe.name, variant, result, baseline),
            **cells,
            "extra_keys": list(cells),
            "recipe": recipe.name,
            "recipe_yaml": key,
            "pass_s": round(pass_s, 1),
            "peak_mb": memory.peak_bytes / 1e6,
            "passes": [r.to_dict() for r in state.reports],
        })
        del variant, state
        save()  # the row is on disk before the next recipe starts
    return JobResult(out, rows, save(), payload)
