"""bitsandbytes rows next to ours on SmolLM2-135M, and 8-bit vs fp32 AdamW optimizer state.

Rows (one recipe each, reproducible alone with `compress run recipes/<name>.yaml`) run in one
process: WikiText-2 test perplexity on the same windows, linear weight bytes (codes + scales /
absmax / code maps, lm_head excluded), and greedy decode timed the same way for every row
(eval.latency.greedy_stream: plain transformers forward + DynamicCache, fp32 activations).
Then each optimizer trains the full model a few steps in a fresh subprocess (peak RSS is per
process): optimizer-state bytes and peak RSS.  python scripts/bench_bnb.py --limit 8
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from compress.eval.latency import greedy_stream, time_request
from compress.eval.quality import perplexity
from compress.eval.report import environment, markdown_table

from compress.bnb import bnb_weight_bytes, is_bnb_module
from compress.core import CompressionState, run_passes
from compress.data import resolve_text_path
from compress.models import load_model
from compress.modules import QuantLinear
from compress.optim import make_optimizer, optimizer_state_bytes
from compress.recipe import load_recipe

ROWS = ["smollm2-w8-rtn", "smollm2-int8-bnb", "smollm2-w4g128-rtn", "smollm2-w4g32-rtn",
        "smollm2-nf4-bnb"]
COLUMNS = [("variant", "variant"), ("perplexity", "WikiText-2 ppl"), ("ppl_delta_pct", "Δ ppl %"),
           ("linear_weight_mb", "linear weights MB"), ("ttft_ms", "TTFT ms"),
           ("decode_tok_s", "decode tok/s"), ("command", "command")]
OPT_COLUMNS = [(k, k) for k in ("optimizer", "class", "state_mb", "peak_rss_mb", "rss_growth_mb",
                                 "loss_first", "loss_last", "step_s")]


def linear_bytes(model: torch.nn.Module) -> int:  # lm_head excluded, as in model_bytes
    total = 0
    for name, module in model.named_modules():
        if name.endswith("lm_head"):
            continue
        if isinstance(module, QuantLinear):
            total += module.weight_bytes()
        elif is_bnb_module(module):
            total += bnb_weight_bytes(module)
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total


def latency(model, prompt: list[int], new_tokens: int, repeats: int) -> dict[str, float]:
    stream = greedy_stream(model)
    time_request(stream, prompt, 2)  # warm-up: first-call allocations and lazy inits
    timings = [time_request(stream, prompt, new_tokens) for _ in range(repeats)]
    best = min(timings, key=lambda t: t.e2e)  # least disturbed by the other jobs on the cores
    return {"ttft_ms": 1e3 * best.ttft, "decode_tok_s": 1.0 / best.tpot}


def train_child(name: str, steps: int, seq_len: int) -> None:
    """One optimizer, fresh process: full-model training steps on WikiText-2 valid text."""
    loaded = load_model("smollm2-135m")
    model = loaded.model.train()
    text = resolve_text_path("wikitext2-valid").read_text(encoding="utf-8")[:200_000]
    ids = torch.tensor(loaded.tokenizer(text)["input_ids"][: steps * seq_len])
    ids = ids.view(steps, 1, seq_len)  # [steps, batch 1, seq_len]
    opt = make_optimizer(name, model.parameters(), lr=1e-5)
    rss_before = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
    losses, start = [], time.perf_counter()
    for step in range(steps):
        loss = model(ids[step], labels=ids[step]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({
        "optimizer": name, "class": type(opt).__name__,
        "state_mb": optimizer_state_bytes(opt) / 1e6,
        "peak_rss_mb": peak / 1e6, "rss_growth_mb": (peak - rss_before) / 1e6,
        "loss_first": losses[0], "loss_last": losses[-1],
        "step_s": (time.perf_counter() - start) / steps,
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", default=ROWS, help="recipe names under recipes/")
    parser.add_argument("--limit", type=int, default=8, help="first N 512-token test windows")
    parser.add_argument("--new-tokens", type=int, default=32, help="decode tokens per timing")
    parser.add_argument("--repeats", type=int, default=2, help="timed requests per row (best kept)")
    parser.add_argument("--optimizers", nargs="*", default=["adamw", "adamw8bit"])
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument("--train-seq", type=int, default=128)
    parser.add_argument("--train-child", help=argparse.SUPPRESS)  # internal: one optimizer
    parser.add_argument("--out", default="out/bench_bnb")
    args = parser.parse_args()
    if args.train_child:
        return train_child(args.train_child, args.train_steps, args.train_seq)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    (out := Path(args.out)).mkdir(parents=True, exist_ok=True)
    text = resolve_text_path("wikitext2").read_text(encoding="utf-8")
    payload = {"environment": environment(), "rows": [], "optimizer": []}
    base, sets = None, [f"eval.perplexity.limit={args.limit}"]  # same windows for every row
    for name in ["baseline"] + args.rows:
        loaded = load_model("smollm2-135m")
        prompt = loaded.tokenizer(text[:4000])["input_ids"][:32]
        if name != "baseline":
            recipe = load_recipe(f"recipes/{name}.yaml", sets)
            run_passes(loaded.model, recipe.passes, CompressionState(progress=False))
        result = perplexity(loaded.model, loaded.tokenizer, text, context_length=512,
                            limit=args.limit, source="wikitext2", progress=False)
        base = base or result
        row = {"variant": "baseline fp32" if name == "baseline" else name,
               "perplexity": result.perplexity,
               "ppl_delta_pct": 100 * (result.perplexity / base.perplexity - 1),
               "linear_weight_mb": linear_bytes(loaded.model) / 1e6,
               **latency(loaded.model, prompt, args.new_tokens, args.repeats),
               "command": "" if name == "baseline" else
               f"`compress run recipes/{name}.yaml --set {sets[0]}`"}
        payload["rows"].append(row)
        logging.info("%s", row)
        (out / "bench_bnb.json").write_text(json.dumps(payload, indent=2, default=str))
    for name in args.optimizers:
        child = [sys.executable, __file__, "--train-child", name, "--train-steps",
                 str(args.train_steps), "--train-seq", str(args.train_seq)]
        done = subprocess.run(child, capture_output=True, text=True, check=True).stdout
        payload["optimizer"].append(json.loads(done.strip().splitlines()[-1]))
        logging.info("%s", payload["optimizer"][-1])
    p = base.protocol
    md = (markdown_table(payload["rows"], COLUMNS)
          + f"\n\nWikiText-2 test, token perplexity, context 512, {p['windows']} windows "
          f"({base.scored_tokens} scored tokens). Decode: {len(prompt)}-token prompt, "
          f"{args.new_tokens} greedy tokens, best of {args.repeats}; torch {torch.__version__}.\n\n"
          + markdown_table(payload["optimizer"], OPT_COLUMNS)
          + f"\n\nFull SmolLM2-135M training, {args.train_steps} steps of {args.train_seq} tokens.")
    (out / "bench_bnb.json").write_text(json.dumps(payload, indent=2, default=str))
    (out / "bench_bnb.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
