"""8-bit vs fp32 AdamW optimizer state on SmolLM2-135M (bitsandbytes' AdamW8bit on CPU).

Each optimizer trains the full model a few steps in a fresh subprocess (peak RSS is per
process): optimizer-state bytes, peak RSS, losses and step time, JSON + markdown:

    python scripts/bench_bnb.py --train-steps 3 --train-seq 128 --out out/bench_bnb

The bitsandbytes NF4 / LLM.int8 quality and speed rows come from `compress sweep` over
recipes/smollm2-nf4-bnb.yaml and recipes/smollm2-int8-bnb.yaml beside the other recipes (same
windows, tasks and runtime timing as our RTN/GPTQ/AWQ rows).
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

from compress.data import resolve_text_path
from compress.eval.report import environment, markdown_table
from compress.io.load import load_model
from compress.optim import make_optimizer, optimizer_state_bytes

OPT_COLUMNS = [(k, k) for k in ("optimizer", "class", "state_mb", "peak_rss_mb", "rss_growth_mb",
                                 "loss_first", "loss_last", "step_s")]


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
    payload = {"environment": environment(), "optimizer": []}
    for name in args.optimizers:
        child = [sys.executable, __file__, "--train-child", name, "--train-steps",
                 str(args.train_steps), "--train-seq", str(args.train_seq)]
        done = subprocess.run(child, capture_output=True, text=True, check=True).stdout
        payload["optimizer"].append(json.loads(done.strip().splitlines()[-1]))
        logging.info("%s", payload["optimizer"][-1])
    md = (markdown_table(payload["optimizer"], OPT_COLUMNS)
          + f"\n\nFull SmolLM2-135M training, {args.train_steps} steps of {args.train_seq} "
          f"tokens; torch {torch.__version__}.")
    (out / "bench_bnb.json").write_text(json.dumps(payload, indent=2, default=str))
    (out / "bench_bnb.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
