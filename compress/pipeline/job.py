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
from compress.core.device import device_name, on_eval_device, resolve_device
from compress.core.errors import RecipeError
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
    # on the recipe's device, in bf16 on a GPU; the protocol records where and in what dtype
    with on_eval_device(model, resolve_device(recipe.device)) as placed, \
            dequantized_for_scoring(model):
        result = _perplexity(model, tokenizer, text, cfg, source, progress, label, resume,
                             top_k, kl_base)
    result = dataclasses.replace(result, protocol={**result.protocol, **placed})
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
    state = CompressionState(tokenizer=tokenizer, progress=progress, data_dir=data_dir,
                             device=resolve_device(recipe.device))
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


def stream_refusal(recipe: Recipe, where) -> str | None:
    """None when the recipe can run layer by layer from the checkpoint at ``where`` (the model
    a meta skeleton, ``compress.io.stream``), else why not (the job then loads the model whole,
    after the memory preflight)."""
    from compress.io.load import is_compressed_checkpoint

    if not isinstance(where, Path):
        return "the model is not a local folder"
    if is_compressed_checkpoint(where):
        return "the model is already a compressed checkpoint"
    if not recipe.export.enabled:
        return "export is disabled (a streamed run writes its result as it goes)"
    if not recipe.passes:
        return "the recipe has no passes"
    whole = [PASSES[pass_name_of(p)].name for p in recipe.passes
             if not PASSES[pass_name_of(p)].layerwise]
    if whole:
        return f"{', '.join(whole)} work on the whole model"
    return None


def _skeleton_refusal(skeleton, reader) -> str | None:
    """Streaming reads tensors under the module tree's names: a checkpoint stored under other
    names (MoE experts, legacy keys) is loaded by transformers instead."""
    from compress.arch import ARCHS, model_type
    from compress.io.export import _tied_head_key

    arch = ARCHS.get(model_type(skeleton))
    if arch is None or arch.moe is not None:
        return f"model_type {model_type(skeleton)!r} is not streamed (MoE or unknown family)"
    names = set(skeleton.state_dict()) - {_tied_head_key(skeleton)}
    stored = set(reader.names())
    if names != stored:
        odd = sorted(names ^ stored)[:3]
        return f"the checkpoint's tensor names differ from the model's ({', '.join(odd)})"
    return None


def _eval_refusal(recipe: Recipe, where, reader) -> str | None:
    """A streamed job scores its export; that is the whole-model path's numbers only when the
    export keeps the checkpoint's float dtype (a float32 source exported in bf16 would be
    scored with rounded embeddings and norms)."""
    from compress.core.registry import DTYPES

    stored = {reader.dtype(n) for n in reader.names() if reader.dtype(n).is_floating_point}
    export = DTYPES[resolve_export_dtype(recipe.export.dtype, where)]
    if stored <= {export}:
        return None
    names = ", ".join(sorted(str(d).removeprefix("torch.") for d in stored))
    return (f"evaluation scores the model in its checkpoint's {names}; a streamed job would "
            f"score the export, rounded to {str(export).removeprefix('torch.')}")


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
    from compress.io.load import resolve_model_path
    from compress.pipeline.preflight import check_memory

    started = time.perf_counter()
    out = Path(out_dir or Path("out") / recipe.name)
    check_output_dir(out, overwrite=overwrite, protect=model_folders(recipe, model))
    resolve_device(recipe.device)  # cuda without a GPU fails here, before any work
    text, source = None, None
    if recipe.eval.perplexity is not None:
        path = resolve_text_path(recipe.eval.perplexity.dataset, data_dir)
        text, source = path.read_text(encoding="utf-8"), str(path)
    where = resolve_model_path(model or recipe.model)
    refusal = stream_refusal(recipe, where)
    skeleton = reader = None
    if refusal is None:
        from compress.io.stream import CheckpointReader, meta_skeleton, verify_checkpoint

        verify_checkpoint(where)
        reader, skeleton = CheckpointReader(where), meta_skeleton(where)
        refusal = _skeleton_refusal(skeleton, reader)
        if refusal is None and _wants_eval(recipe, text):
            refusal = _eval_refusal(recipe, where, reader)
    if stream and refusal is not None:
        raise RecipeError(f"this job cannot stream: {refusal}; leave `stream` unset")
    streamed = refusal is None and stream is not False
    estimate = check_memory(recipe, where, streamed=streamed, skeleton=skeleton)
    memory: dict[str, Any] = {"streamed": streamed, "not_streamed_because": refusal,
                              "estimate": estimate, "peak_rss_bytes": {}}
    if streamed:
        rows, payload_parts = _run_streamed(
            recipe, model or recipe.model, where, skeleton, reader, out, text, source, data_dir,
            progress, overwrite, resume, kl_top_k, memory)
    else:
        rows, payload_parts = _run_in_memory(
            recipe, model, out, text, source, data_dir, progress, overwrite, resume, kl_top_k,
            memory)
    payload, compressed = payload_parts
    payload["seconds"] = round(time.perf_counter() - started, 1)
    protocol = ""
    if compressed:
        protocol = protocol_line(compressed, compressed.kl.top_k if compressed.kl else None)
    known = {*dict(COLUMNS), "kl_stderr"}
    extra = [(k, LATENCY_COLUMNS.get(k, f"{k} acc")) for k in rows[-1] if k not in known]
    columns = COLUMNS[:-1] + extra + COLUMNS[-1:]
    from compress.eval.report import markdown_table, write_results

    markdown = (f"## {recipe.name}\n\n" + markdown_table(rows, columns) + protocol
                + memory_line(memory))
    write_results(out, "results", markdown, payload, overwrite=overwrite)
    return JobResult(out, rows, markdown, payload)


def memory_line(memory: dict[str, Any]) -> str:
    """The table's footnote on memory: peak resident memory per phase, and how it ran."""
    peaks = memory.get("peak_rss_bytes") or {}
    if not peaks:
        return ""
    cells = ", ".join(f"{phase} {value / 2**30:.2f}" for phase, value in peaks.items())
    how = ("streamed layer by layer" if memory.get("streamed")
           else f"loaded whole ({memory.get('not_streamed_because') or 'stream: false'})")
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


def _baseline_row(loaded, recipe, text, source, progress, resume, kl_top_k, data_dir):
    from compress.eval.compare import evaluate_extras
    from compress.eval.report import kl_cells

    baseline = evaluate_perplexity(
        loaded.model, loaded.tokenizer, recipe, text, source, progress,
        label="baseline perplexity", resume=resume, top_k=kl_top_k,
    )
    with on_eval_device(loaded.model, resolve_device(recipe.device)):
        extras = evaluate_extras(loaded.model, loaded.tokenizer, recipe.eval, data_dir)
    sizes = model_bytes(loaded.model)
    row = {
        "variant": f"baseline ({loaded.source})",
        "perplexity": baseline.perplexity if baseline else None,
        **kl_cells(baseline, baseline),
        "linear_weight_mb": sizes["linear"] / 1e6,
        "weight_mb": sizes["total"] / 1e6,
        **extra_cells(extras),
    }
    return baseline, extras, row


def _compressed_row(model, tokenizer, recipe, text, source, progress, resume, baseline,
                    data_dir):
    from compress.eval.compare import evaluate_extras
    from compress.eval.report import kl_cells

    compressed = evaluate_perplexity(
        model, tokenizer, recipe, text, source, progress,
        label="compressed perplexity", resume=resume,
        kl_base=baseline.top_k_path if baseline else None,
    )
    with on_eval_device(model, resolve_device(recipe.device)):
        extras = evaluate_extras(model, tokenizer, recipe.eval, data_dir)
    sizes = model_bytes(model)
    row = {
        "variant": recipe.name,
        "perplexity": compressed.perplexity if compressed else None,
        **kl_cells(compressed, baseline),
        "linear_weight_mb": sizes["linear"] / 1e6,
        "weight_mb": sizes["total"] / 1e6,
        **extra_cells(extras),
    }
    if baseline and compressed:
        row["ppl_delta_pct"] = 100 * (compressed.perplexity / baseline.perplexity - 1)
    return compressed, extras, row


def _payload(recipe, source, state, baseline, compressed, baseline_extras, compressed_extras,
             rows, memory) -> dict[str, Any]:
    from compress.eval.report import environment

    return {
        "recipe": recipe.to_dict(),
        "model": source,
        "environment": environment(),
        "device": device_name(state.device),  # where the passes ran (eval: its protocol)
        "passes": [r.to_dict() for r in state.reports],
        "eval": {
            "baseline": baseline.to_dict() if baseline else None,
            "compressed": compressed.to_dict() if compressed else None,
            "baseline_extras": baseline_extras,  # lm-eval tasks / latency, when requested
            "compressed_extras": compressed_extras,
        },
        "rows": rows,
        "memory": memory,
    }


def _wants_eval(recipe: Recipe, text) -> bool:
    cfg = recipe.eval
    return (cfg.perplexity is not None and text is not None) or any(
        getattr(cfg, k, None) is not None for k in ("tasks", "latency"))


def _run_in_memory(recipe, model, out, text, source, data_dir, progress, overwrite, resume,
                   kl_top_k, memory):
    with _Phase(memory, "load"):
        loaded = load_model(model or recipe.model)
    state = recipe_state(recipe, loaded.tokenizer, progress=progress, data_dir=data_dir)
    if any(PASSES[pass_name_of(p)].needs_teacher for p in recipe.passes):
        state.teacher = copy.deepcopy(loaded.model).eval()
    rows: list[dict[str, Any]] = []
    baseline, baseline_extras = None, {}
    if recipe.eval.baseline:
        with _Phase(memory, "baseline eval"):
            baseline, baseline_extras, row = _baseline_row(
                loaded, recipe, text, source, progress, resume, kl_top_k, data_dir)
        rows.append(row)
    for index, cfg in enumerate(recipe.passes):
        with _Phase(memory, f"pass {index} {pass_name_of(cfg)}"):
            run_passes(loaded.model, [cfg], state, first_index=index)
    with _Phase(memory, "eval"):
        compressed, compressed_extras, row = _compressed_row(
            loaded.model, loaded.tokenizer, recipe, text, source, progress, resume, baseline,
            data_dir)
    rows.append(row)
    payload = _payload(recipe, loaded.source, state, baseline, compressed, baseline_extras,
                       compressed_extras, rows, memory)
    if recipe.export.enabled:
        with _Phase(memory, "export"):
            export_checkpoint(
                loaded.model, loaded.tokenizer, out,
                dtype=resolve_export_dtype(recipe.export.dtype, loaded.path),
                recipe_yaml=recipe.to_yaml(), report=payload, overwrite=overwrite,
                max_shard_size=recipe.export.max_shard_size,
            )
        row["disk_mb"] = _dir_bytes(out) / 1e6
    return rows, (payload, compressed)


def _run_streamed(recipe, model_source, where, skeleton, reader, out, text, source, data_dir,
                  progress, overwrite, resume, kl_top_k, memory):
    """The passes layer by layer (``compress.io.stream.StreamedModel``), the last one writing
    each finished layer into the export; evaluation on whole models, one at a time."""
    import gc

    import torch
    from transformers import AutoTokenizer

    from compress.arch import arch_for, decoder_layers
    from compress.io.export import StreamedExport, atomic_directory, write_provenance
    from compress.io.stream import StreamedModel

    tokenizer = AutoTokenizer.from_pretrained(where)
    state = recipe_state(recipe, tokenizer, progress=progress, data_dir=data_dir)
    rows: list[dict[str, Any]] = []
    baseline, baseline_extras = None, {}
    if recipe.eval.baseline and _wants_eval(recipe, text):
        with _Phase(memory, "baseline eval"):
            loaded = load_model(str(where))
            loaded.source = model_source
            baseline, baseline_extras, row = _baseline_row(
                loaded, recipe, text, source, progress, resume, kl_top_k, data_dir)
            del loaded
            gc.collect()
        rows.append(row)
    elif recipe.eval.baseline:
        sizes = model_bytes(skeleton)
        rows.append({"variant": f"baseline ({model_source})",
                     "linear_weight_mb": sizes["linear"] / 1e6, "weight_mb": sizes["total"] / 1e6})
    dtype = resolve_export_dtype(recipe.export.dtype, where)
    compressed, compressed_extras = None, {}
    with atomic_directory(out, overwrite=overwrite) as tmp:
        arch = arch_for(skeleton, "streaming")
        streamed = StreamedModel(skeleton, reader, torch.float32,
                                 decoder_layers(skeleton, "streaming"), arch.layer_prefix,
                                 tmp / ".scratch")
        exporter = StreamedExport(skeleton, tmp, dtype, recipe.export.max_shard_size)
        state.stream = streamed
        try:
            last = len(recipe.passes) - 1
            for index, cfg in enumerate(recipe.passes):
                streamed.sink = exporter if index == last else None
                with _Phase(memory, f"pass {index} {pass_name_of(cfg)}"):
                    run_passes(skeleton, [cfg], state, first_index=index)
            with _Phase(memory, "export"):
                exporter.finish(streamed)
        except BaseException:
            exporter.writer.abort()
            raise
        finally:
            streamed.close()
            state.stream = None
        write_provenance(tmp, tokenizer, recipe.to_yaml(), None)
        sizes = model_bytes(skeleton)
        row = {"variant": recipe.name, "linear_weight_mb": sizes["linear"] / 1e6,
               "weight_mb": sizes["total"] / 1e6}
        if _wants_eval(recipe, text):
            with _Phase(memory, "eval"):
                loaded = load_model(str(tmp))
                compressed, compressed_extras, row = _compressed_row(
                    loaded.model, loaded.tokenizer, recipe, text, source, progress, resume,
                    baseline, data_dir)
                del loaded
                gc.collect()
        rows.append(row)
        payload = _payload(recipe, model_source, state, baseline, compressed, baseline_extras,
                           compressed_extras, rows, memory)
        write_provenance(tmp, None, None, payload)
        row["disk_mb"] = _dir_bytes(tmp) / 1e6
    return rows, (payload, compressed)
