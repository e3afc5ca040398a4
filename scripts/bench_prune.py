"""Prune -> distill -> quantize on SmolLM2-135M, and width vs depth at equal parameter count.

Rows: teacher; width-only and depth-only pruning at the same parameter count (before
distillation); the recipe's pruning (MLP 1024 + 26 layers) before distillation, after N steps of
distillation, after int4 RTN. Columns: parameters, weight bytes, WikiText-2 token perplexity
(first --limit windows of 512 tokens, non-overlapping) and the held-out ppl of the distillation
data. Writes JSON + markdown to --out.

    python scripts/bench_prune.py --steps 150 --limit 40 --out out/bench_prune
"""

from __future__ import annotations

import argparse
import copy
import logging
import time
from pathlib import Path

import torch

from compress.calibration import calibration_sequences
from compress.core.registry import CompressionState, run_passes
from compress.data import resolve_text_path
from compress.distill import LogitsConfig
from compress.eval.quality import perplexity
from compress.eval.report import environment, markdown_table, write_results
from compress.io.load import load_model
from compress.prune.config import LayersConfig, MlpChannelsConfig
from compress.prune.slicing import count_params
from compress.quant.linear import model_bytes
from compress.quant.rtn import Int4RtnConfig

COLUMNS = [
    ("variant", "variant"),
    ("params_m", "params (M)"),
    ("weight_mb", "weight MB"),
    ("ppl", "WikiText-2 ppl"),
    ("ppl_delta_pct", "Δ ppl % vs teacher"),
    ("held_out_ppl", "held-out web ppl"),
    ("notes", "notes"),
]


def measure(name, model, tok, text, args, notes="", held_out=None):
    start = time.perf_counter()
    ppl = perplexity(model, tok, text, context_length=512, limit=args.limit, progress=False)
    row = {
        "variant": name,
        "params_m": count_params(model) / 1e6,
        "weight_mb": model_bytes(model)["total"] / 1e6,
        "ppl": ppl.perplexity,
        "held_out_ppl": held_out,
        "notes": notes,
        "eval_seconds": time.perf_counter() - start,
    }
    logging.info("%s: ppl %.3f (%.0fs)", name, ppl.perplexity, row["eval_seconds"])
    return row, ppl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="distillation steps")
    parser.add_argument("--limit", type=int, default=40, help="WikiText-2 windows of 512 tokens")
    parser.add_argument("--layers", type=int, default=26, help="layers kept (depth pruning)")
    parser.add_argument("--seq-len", type=int, default=256, help="distillation sequence length")
    parser.add_argument("--batch-size", type=int, default=4, help="distillation sequences per step")
    parser.add_argument("--warmup", type=int, default=10, help="distillation warm-up steps")
    parser.add_argument("--cal-samples", type=int, default=32, help="calibration sequences")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 is faster on a busy box)"
    )
    parser.add_argument("--out", default="out/bench_prune", help="output folder")
    parser.add_argument(
        "--save-student", help="also save the distilled fp32 student here (e.g. as a draft model "
        "for `compress compare --draft`)"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    loaded = load_model("smollm2-135m")
    tok, teacher = loaded.tokenizer, loaded.model
    text = resolve_text_path("wikitext2").read_text(encoding="utf-8")
    cal = calibration_sequences(
        "train_text/web", tok, num_samples=args.cal_samples, seq_len=256, seed=0
    )

    def state():
        return CompressionState(
            tokenizer=tok,
            teacher=teacher,
            progress=False,
            calibration_batches=lambda: list(cal.split(1)),
        )

    rows = []

    def add(name, model, notes):
        rows.append(measure(name, model, tok, text, args, notes)[0])

    row, base = measure("teacher (SmolLM2-135M)", teacher, tok, text, args)
    rows.append(row)
    # width vs depth at the same parameter count, before distillation
    depth = copy.deepcopy(teacher)
    run_passes(depth, [LayersConfig(num_layers=args.layers)], state())
    budget = count_params(depth)
    width = copy.deepcopy(teacher)
    run_passes(width, [MlpChannelsConfig(target_params=budget)], state())
    add(f"depth only: 30 -> {args.layers} layers", depth, "block influence, no distillation")
    add(f"width only: MLP 1536 -> {width.config.intermediate_size}", width, "same params, no KD")
    del depth, width
    # the recipe's chain
    student = copy.deepcopy(teacher)
    st = state()
    run_passes(
        student,
        [MlpChannelsConfig(intermediate_size=1024), LayersConfig(num_layers=args.layers)],
        st,
    )
    add(f"pruned: MLP 1024 + {args.layers} layers", student, "before distillation")
    distill_cfg = LogitsConfig(
        data="train_text/web",
        steps=args.steps,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        lr=3e-4,
        warmup_steps=args.warmup,
        eval_every=max(1, args.steps // 3),
    )
    start = time.perf_counter()
    run_passes(student, [distill_cfg], st)
    distill_seconds = time.perf_counter() - start
    m = st.reports[-1].metrics
    rows[-1]["held_out_ppl"] = m["held_out_ppl_before"]
    minutes = distill_seconds / 60
    add(
        f"+ distilled {args.steps} steps", student, f"{m['tokens']:,} tokens, {minutes:.1f} min CPU"
    )
    rows[-1]["held_out_ppl"] = m["held_out_ppl_after"]
    if args.save_student:
        student.save_pretrained(args.save_student)
        tok.save_pretrained(args.save_student)
    run_passes(student, [Int4RtnConfig(group_size=128, fallback_group_size=64)], st)
    add("+ int4 RTN g128 (g64 fallback)", student, "weights came from a Q4_1 grid")
    for r in rows:
        r["ppl_delta_pct"] = 100 * (r["ppl"] / base.perplexity - 1)
    teacher_ppl, pruned_ppl, distilled_ppl = rows[0]["ppl"], rows[3]["ppl"], rows[4]["ppl"]
    recovered = (pruned_ppl - distilled_ppl) / (pruned_ppl - teacher_ppl)
    md = markdown_table(rows, COLUMNS) + (
        f"\n\nRecovered {100 * recovered:.1f}% of the WikiText-2 ppl lost by pruning "
        f"({pruned_ppl:.2f} -> {distilled_ppl:.2f}; teacher {teacher_ppl:.2f}). Teacher held-out "
        f"web ppl {m['teacher_held_out_ppl']:.2f}. Perplexity: first {args.limit} windows of 512 "
        f"tokens of WikiText-2 test ({base.scored_tokens} tokens)."
    )
    print(md)
    write_results(
        Path(args.out),
        "bench_prune",
        md,
        {
            "rows": rows,
            "recovered_fraction": recovered,
            "distill": m,
            "distill_seconds": distill_seconds,
            "args": vars(args),
            "environment": environment(),
        },
    )


if __name__ == "__main__":
    main()
