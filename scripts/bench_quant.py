"""Quantization results table on SmolLM2-135M: baseline, RTN, GPTQ, AWQ, W8 RTN, SmoothQuant W8A8.

Each row is one recipe from recipes/ (reproducible alone with `compress run recipes/<name>.yaml`
plus the same --set overrides); this script runs them in one process, evaluating every row on
the same WikiText-2 test windows, and writes JSON + markdown:

    python scripts/bench_quant.py --limit 16 --num-samples 16 --out out/bench_quant

--limit keeps the first N windows of 512 tokens of the test split (full split: omit it);
--num-samples overrides the recipes' calibration sample count (timing on shared cores);
--tasks adds lm-eval zero-shot accuracy columns (local task configs, --task-limit examples each),
--latency N adds TTFT and decode tok/s (N greedy tokens, the same loop for every row, bitsandbytes
rows included); --resume keeps the rows of an interrupted run made with the same settings:

    python scripts/bench_quant.py --limit 16 --num-samples 32 --tasks piqa_local,arc_easy_local \
        --task-limit 200 --rows smollm2-w4g128-rtn smollm2-w4g128-gptq --out out/bench_tasks
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from compress.core.registry import run_passes
from compress.data import resolve_text_path
from compress.eval.latency import decode_speed
from compress.eval.lm_eval_tasks import run_tasks
from compress.eval.quality import PerplexityResult, perplexity
from compress.eval.report import environment, markdown_table
from compress.io.load import load_model
from compress.pipeline.job import extra_cells, recipe_state
from compress.quant.linear import QuantLinear, model_bytes
from compress.recipe import load_recipe

ROWS = [
    "smollm2-w4g128-rtn",
    "smollm2-w4g128-gptq",
    "smollm2-w4g128-awq",
    "smollm2-w4g32-rtn",
    "smollm2-w4g32-gptq",
    "smollm2-w4g32-awq",
    "smollm2-w8-rtn",
    "smollm2-w8a8-smoothquant",
    "smollm2-w4g128-gptq-mixed",
    "smollm2-int8-bnb",  # bitsandbytes rows: need the [bnb] extra
    "smollm2-nf4-bnb",
]
COLUMNS = [
    ("variant", "variant"),
    ("perplexity", "WikiText-2 ppl"),
    ("ppl_delta_pct", "Δ ppl %"),
    ("bits_per_weight", "bits/weight"),
    ("linear_weight_mb", "linear weights MB"),
    ("calib_s", "calibration s"),
    ("peak_mb", "peak RSS MB"),
    ("command", "command"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", default=ROWS, help="recipe names under recipes/")
    parser.add_argument(
        "--limit", type=int, default=None, help="first N test windows (default: all)"
    )
    parser.add_argument(
        "--num-samples", type=int, default=None, help="override calibration samples"
    )
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--tasks", default="", help="comma-separated lm-eval tasks (local configs)")
    parser.add_argument("--task-limit", type=int, help="lm-eval examples per task")
    parser.add_argument(
        "--latency",
        type=int,
        default=0,
        metavar="NEW_TOKENS",
        help="add TTFT and decode tok/s columns: greedy NEW_TOKENS after a 32-token prompt",
    )
    parser.add_argument("--repeats", type=int, default=2, help="timed requests per row (best)")
    parser.add_argument(
        "--weight-backend",
        choices=["auto", "reference"],
        default="auto",
        help="weight-only int4/int8 layers during evaluation: auto (torch's native CPU kernels, "
        "bf16 activations; measured 1.7-2.4x slower than an fp32 matmul at 512 rows on this "
        "AVX2 CPU) or reference (dequantized fp32 weights, exact fp32 activations)",
    )
    parser.add_argument("--out", default="out/bench_quant")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep rows already in OUT/bench_quant.json when it was made with the same settings",
    )
    args = parser.parse_args()
    if args.latency and args.weight_backend == "reference":
        parser.error("--latency times the native kernels: drop --weight-backend reference")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = resolve_text_path("wikitext2").read_text(encoding="utf-8")

    def evaluate(model, tokenizer):
        return perplexity(
            model,
            tokenizer,
            text,
            context_length=args.context,
            limit=args.limit,
            source="wikitext2",
            progress=False,
        )

    tasks = [t for t in args.tasks.split(",") if t]
    columns = COLUMNS[:-1] + [(t, f"{t} acc") for t in tasks] + COLUMNS[-1:]
    if args.latency:
        columns[-1:-1] = [
            ("ttft_ms", "TTFT ms"), ("decode_tok_s", "decode tok/s"), ("engine", "engine")
        ]
    prompt = None

    def speed(model, tokenizer) -> dict[str, Any]:  # tokens timed on the runtime (decode_speed)
        nonlocal prompt
        if not args.latency:
            return {}
        prompt = prompt or tokenizer(text[:4000])["input_ids"][:32]
        return decode_speed(model, prompt, args.latency, args.repeats)

    def task_scores(model, tokenizer) -> dict[str, str]:
        if not tasks:
            return {}
        return extra_cells({"tasks": run_tasks(model, tokenizer, tasks, limit=args.task_limit)})

    sets = [f"eval.perplexity.limit={args.limit}"] if args.limit else []
    if args.num_samples:
        sets.append(f"calibration.num_samples={args.num_samples}")
    settings = {
        "limit": args.limit,
        "num_samples": args.num_samples,
        "context": args.context,
        "tasks": tasks,
        "task_limit": args.task_limit,
        "latency": args.latency,
        "repeats": args.repeats,
    }
    if args.weight_backend != "auto":  # absent by default, so older result files still resume
        settings["weight_backend"] = args.weight_backend
    done = _resumable(out / "bench_quant.json", settings) if args.resume else None
    loaded = load_model("smollm2-135m")
    linear_params = model_bytes(loaded.model)["linear"] // 4  # fp32 baseline: 4 bytes each
    if done is not None:  # the baseline row (and its perplexity) come from the earlier run
        payload = done
        rows = payload["rows"]
        base = PerplexityResult(
            rows[0]["perplexity"], 0.0, payload["scored_tokens"], 0, payload["protocol"]
        )
        logging.info("resuming: %d rows kept from %s", len(rows) - 1, out / "bench_quant.json")
    else:
        base = evaluate(loaded.model, loaded.tokenizer)
        rows = [
            {
                "variant": "baseline fp32",
                "perplexity": base.perplexity,
                "bits_per_weight": 32.0,
                "linear_weight_mb": model_bytes(loaded.model)["linear"] / 1e6,
                **task_scores(loaded.model, loaded.tokenizer),
                **speed(loaded.model, loaded.tokenizer),
            }
        ]
        payload = {
            "environment": environment(),
            "settings": settings,
            "protocol": base.protocol,
            "scored_tokens": base.scored_tokens,
            "rows": rows,
            "reports": {},
        }
    for name in args.rows:
        if any(row["variant"] == name for row in rows):
            continue
        path = f"recipes/{name}.yaml"
        own_sets = [s for s in sets if _applies(s, path)]
        recipe = load_recipe(path, own_sets)
        loaded = load_model(recipe.model)
        state = recipe_state(recipe, loaded.tokenizer, progress=False)
        start = time.perf_counter()
        run_passes(loaded.model, recipe.passes, state)
        seconds = time.perf_counter() - start
        linear_bytes = model_bytes(loaded.model)["linear"]
        if args.weight_backend == "reference":
            _dequantize_weight_only(loaded.model)
        result = evaluate(loaded.model, loaded.tokenizer)
        peak = state.reports[-1].peak_memory_bytes
        rows.append(
            {
                "variant": name,
                "perplexity": result.perplexity,
                "ppl_delta_pct": 100 * (result.perplexity / base.perplexity - 1),
                # stored bits per decoder-linear weight, whatever the format (bnb included)
                "bits_per_weight": 8 * linear_bytes / linear_params,
                "linear_weight_mb": linear_bytes / 1e6,
                "calib_s": seconds if recipe.calibration is not None else None,
                "peak_mb": peak / 1e6 if peak and recipe.calibration is not None else None,
                "command": f"`compress run recipes/{name}.yaml "
                + " ".join(f"--set {s}" for s in own_sets)
                + "`",
                **task_scores(loaded.model, loaded.tokenizer),
                **speed(loaded.model, loaded.tokenizer),
            }
        )
        payload["reports"][name] = [r.to_dict() for r in state.reports]
        (out / "bench_quant.json").write_text(json.dumps(payload, indent=2, default=str))
        logging.info("%s: ppl %.3f (%.1fs)", name, result.perplexity, seconds)
    p = base.protocol
    md = markdown_table(rows, columns) + (
        f"\n\nWikiText-2 test, token perplexity, context {p['context_length']}, "
        f"{p['windows']} windows ({base.scored_tokens} scored tokens); torch {torch.__version__}."
        + (
            f" lm-eval: zero-shot, {args.task_limit or 'all'} examples per task, acc ± stderr."
            if tasks
            else ""
        )
        + (
            f" Decode: 32-token prompt, {args.latency} greedy tokens (transformers forward + "
            f"DynamicCache, fp32 activations), best of {args.repeats} after a warm-up."
            if args.latency
            else ""
        )
        + (
            " Weight-only int4/int8 layers evaluated with the reference backend (dequantized "
            "fp32 weights, fp32 activations)."
            if args.weight_backend == "reference"
            else ""
        )
    )
    (out / "bench_quant.md").write_text(md + "\n")
    print(md)


def _dequantize_weight_only(model: torch.nn.Module) -> None:
    """Weight-only QuantLinears -> nn.Linear holding their dequantized fp32 weights: the
    reference backend's product (dequantize, then matmul) without dequantizing on every call
    (which made a full-split row ~1.75x slower than the fp32 baseline). W8A8 layers keep their
    exact int8 x int8 path."""
    for name, module in list(model.named_modules()):
        if type(module) is QuantLinear:
            linear = torch.nn.Linear(
                module.in_features, module.out_features, bias=module.bias is not None, device="meta"
            )
            linear.weight = torch.nn.Parameter(module.dequantized_weight(), requires_grad=False)
            if module.bias is not None:
                linear.bias = torch.nn.Parameter(module.bias.detach().float(), requires_grad=False)
            model.set_submodule(name, linear)


def _resumable(path: Path, settings: dict) -> dict | None:
    """The earlier payload at ``path`` when it was made with ``settings`` (else start over)."""
    if not path.exists():
        return None
    payload = json.loads(path.read_text())
    if payload.get("settings") != settings:
        logging.warning("%s was made with other settings; starting over", path)
        return None
    return payload


def _applies(setting: str, path: str) -> bool:
    """Calibration overrides only apply to recipes that have a calibration section (RTN and
    bitsandbytes recipes have none: a --set would create one they never use)."""
    return not setting.startswith("calibration") or load_recipe(path).calibration is not None


if __name__ == "__main__":
    main()
