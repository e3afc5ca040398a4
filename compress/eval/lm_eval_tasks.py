"""Zero-shot task accuracy through lm-eval's Python API, on the model object we already hold.

The in-memory model (quantized modules and all) is wrapped in lm-eval's ``HFLM`` and evaluated
with ``simple_evaluate``; nothing is re-loaded from disk. Tasks come from a folder of offline task
configs (default: ``<data dir>/lm_eval_tasks``, whose YAMLs read the local data files), passed
as lm-eval's ``include_path``; the built-in tasks (which download from the Hub) are indexed only
with ``builtin=True``. Every result keeps lm-eval's metrics with their standard errors and the
settings (limit, few-shot, seeds, lm-eval version) so that two runs can be checked for identical
settings. Needs the ``lm-eval`` extra (``pip install 'compress[lm-eval]'``).
"""

from __future__ import annotations

import difflib
import logging
import os
from pathlib import Path
from typing import Any

from torch import nn

from compress.core.errors import DataError
from compress.data import resolve_data_dir

log = logging.getLogger(__name__)

SEED = 1234  # the same for every variant: lm-eval's random, numpy, torch and few-shot seeds


def _import_lm_eval():
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as exc:
        raise ImportError(
            "task evaluation needs lm-eval: pip install 'compress[lm-eval]' (or lm-eval==0.4.13)"
        ) from exc
    return lm_eval, HFLM, TaskManager


def task_folder(
    tasks_dir: str | os.PathLike[str] | None = None, data_dir: str | None = None
) -> Path:
    """The folder of offline task configs; a missing folder is a clear error."""
    folder = Path(tasks_dir) if tasks_dir else resolve_data_dir(data_dir) / "lm_eval_tasks"
    if not folder.is_dir():
        raise DataError(
            f"lm-eval task folder not found: {folder}. Pass --tasks-dir pointing at the offline "
            "task configs (shared/data/lm_eval_tasks) or set --data-dir"
        )
    return folder


def task_manager(folder: Path, builtin: bool = False):
    _, _, TaskManager = _import_lm_eval()
    return TaskManager(include_path=str(folder), include_defaults=builtin)


def check_tasks(names: list[str], manager) -> None:
    """Raise a DataError naming every unknown task, with a did-you-mean and the full list."""
    available = sorted(manager.all_tasks)
    unknown = [n for n in names if n not in available]
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, available, n=1, cutoff=0.5)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        more = f", ... ({len(available)} in all)" if len(available) > 40 else ""
        shown = ", ".join(available[:40]) + more
        raise DataError(f"unknown lm-eval task(s): {', '.join(hints)}. Available: {shown}")


def run_tasks(
    model: nn.Module,
    tokenizer: Any,
    tasks: list[str],
    *,
    limit: int | float | None = None,
    tasks_dir: str | None = None,
    data_dir: str | None = None,
    batch_size: int = 4,
    builtin: bool = False,
    log_samples: bool = False,
) -> dict[str, Any]:
    """Evaluate ``tasks`` zero-shot on the in-memory ``model``.

    Returns ``{"tasks": {task: {metric: value, metric_stderr: value, "samples_evaluated": n}},
    "settings": {...}}`` and, with ``log_samples``, lm-eval's per-sample records under
    ``"samples"``.
    """
    lm_eval, HFLM, _ = _import_lm_eval()
    folder = task_folder(tasks_dir, data_dir)
    if not builtin:
        # Without these, dataset and tokenizer code paths can try the network and hang offline.
        for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
            os.environ.setdefault(key, "1")
    if data_dir or "LOCAL_EVAL_DATA_DIR" not in os.environ:
        # The offline YAMLs read their data relative to this variable (default: their parent).
        os.environ["LOCAL_EVAL_DATA_DIR"] = str(resolve_data_dir(data_dir))
    manager = task_manager(folder, builtin)
    check_tasks(tasks, manager)
    device = str(next(model.parameters()).device)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device)
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(tasks),
        num_fewshot=0,
        limit=limit,
        task_manager=manager,
        log_samples=log_samples,
        random_seed=SEED,
        numpy_random_seed=SEED,
        torch_random_seed=SEED,
        fewshot_random_seed=SEED,
        bootstrap_iters=1000,
    )
    results: dict[str, Any] = {}
    for task in tasks:
        metrics = out["results"][task]
        clean: dict[str, Any] = {}
        for key, value in metrics.items():
            if "," not in key:
                continue
            name, _, _filter = key.partition(",")
            clean[name] = value if value != "N/A" else None
        clean["samples_evaluated"] = out.get("n-samples", {}).get(task, {}).get("effective")
        results[task] = clean
    settings = {
        "tasks": list(tasks),
        "num_fewshot": 0,
        "limit": limit,
        "seed": SEED,
        "task_folder": str(folder),
        "lm_eval": getattr(lm_eval, "__version__", "unknown"),
    }
    payload: dict[str, Any] = {"tasks": results, "settings": settings}
    if log_samples:
        payload["samples"] = out["samples"]
    return payload


def headline(task_result: dict[str, Any]) -> tuple[str, float | None, float | None]:
    """The metric a table shows for a task: acc (with stderr), else word perplexity."""
    for metric in ("acc", "acc_norm", "word_perplexity", "perplexity"):
        if task_result.get(metric) is not None:
            return metric, task_result[metric], task_result.get(f"{metric}_stderr")
    return "none", None, None
