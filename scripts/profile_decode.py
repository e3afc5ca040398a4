"""Where a runtime decode step's time goes: torch.profiler over N greedy tokens of SmolLM2-135M
W4 (RTN, g128 with g64 fallback) through compress.runtime.engine, after a full-length warm-up.

    python scripts/profile_decode.py --compile --int4-kernel q4q8 --lm-head-bits 4 --out out/prof

Prints and writes (markdown) the ops by self CPU time, with ms per decoded token.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.profiler import profile

from compress.io.load import load_model
from compress.quant.rtn import Int4RtnConfig, quantize_linears
from compress.runtime.engine import Runtime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--int4-kernel", default="torch", choices=["torch", "q4q8"])
    p.add_argument("--int8-kernel", default="torch", choices=["torch", "q8q8"])
    p.add_argument("--lm-head-bits", type=int, choices=[4, 8])
    p.add_argument("--rows", type=int, default=15, help="ops to list")
    p.add_argument("--out", default="out/profile_decode")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model("smollm2-135m")
    quantize_linears(loaded.model, Int4RtnConfig(group_size=128, fallback_group_size=64), 4, "w4")
    ids = loaded.tokenizer("The history of the city begins with a small settlement " * 4)[
        "input_ids"
    ][:32]
    rt = Runtime(
        loaded.model,
        max_seq_len=len(ids) + args.new_tokens,
        compile=args.compile,
        int4_kernel=args.int4_kernel,
        int8_kernel=args.int8_kernel,
        lm_head_bits=args.lm_head_bits,
    )
    rt.generate([ids], args.new_tokens)  # warm-up: every decode graph compiled
    with profile() as prof:
        rt.generate([ids], args.new_tokens)
    ms_per_token = 1 / 1e3 / args.new_tokens  # profiler us -> ms per token (prefill included)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    lines = [
        f"### decode profile: W4 g128, {args.new_tokens} tokens, {args.threads} threads, "
        f"compile={args.compile}, int4_kernel={args.int4_kernel}, "
        f"int8_kernel={args.int8_kernel}, q8 level {rt.q8_isa}, "
        f"lm_head_bits={args.lm_head_bits}",
        "",
        "| op | self CPU ms per token | share | calls per token |",
        "|---|---:|---:|---:|",
    ]
    for e in events[: args.rows]:
        lines.append(
            f"| `{e.key[:70]}` | {e.self_cpu_time_total * ms_per_token:.2f} | "
            f"{e.self_cpu_time_total / total:.0%} | {e.count / args.new_tokens:.1f} |"
        )
    lines.append(f"\nall ops: {total * ms_per_token:.2f} ms per token (self CPU, summed)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
