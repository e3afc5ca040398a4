"""Float linears at decode and prompt row counts, the two ways an eager runtime can hold the
weight: plain (``F.linear``: ATen's GEMM, MKL for fp32; oneDNN reorders a bf16 weight each call)
and packed once for oneDNN (``_linear_pointwise``, what ``_FloatLinear.pack`` holds). Each shape
is cycled over ``--copies`` distinct weights (default: enough for 2 GB) so they come from DRAM,
as a model's layers do. Prints us per call (median of the rounds), plain / packed; with
``--pass`` also one pass over every shape once per copy, in ms (``--copies 22`` with the 1.1B
shape's projections is its 22 layers). Sets ``FP32_PACK_MIN_ELEMENTS`` and the bf16 notes.
``--bf16-weights`` (with fp32) adds a third way: the weights held in bf16 for our
``bf16_weight_linear`` (``kernels.cpu_float``: fp32 inputs and sums), plain / packed / ours.

    python scripts/bench_float_linears.py --dtype float32 --shapes 1024x1024 3072x576 \\
        2048x1024 2048x2048 4096x4096 11008x4096 --rows 1 2 4 8 32
    python scripts/bench_float_linears.py --dtype bfloat16 --shapes 2560x2048 2048x2048 \\
        11264x2048 2048x5632 --copies 22 --pass --rows 1 8 16 17 20 24 28 32 33 40 48 64
    python scripts/bench_float_linears.py --dtype bfloat16 --shapes 32000x2048 --copies 4 \\
        --rows 1 8 32
    python scripts/bench_float_linears.py --bf16-weights --shapes 49152x576 3072x576 576x1536 \\
        960x576 --rows 1 2 4 8 32 128 256
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from compress.eval.report import environment
from compress.kernels import cpu_float


def timed(fn, rounds: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--shapes", nargs="+", required=True, help="NxK (out x in features)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 32])
    p.add_argument("--copies", type=int, help="distinct weights per shape (default: ~2 GB)")
    p.add_argument("--pass", dest="whole", action="store_true", help="time all shapes together")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pack-rows", type=int, default=1,
                   help="the row count oneDNN picks the packed layout for (batch-size hint)")
    p.add_argument("--bf16-weights", action="store_true",
                   help="fp32 only: also time our op over bf16 copies of the weights")
    args = p.parse_args()
    if args.bf16_weights and args.dtype != "float32":
        p.error("--bf16-weights compares against fp32 weights: leave --dtype float32")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
    size = dtype.itemsize
    env = environment()
    print(f"{env['cpu']} ({', '.join(env['cpu_flags'])}); torch {env['torch']}; "
          f"{env['threads']} threads; {env['date']}; {args.dtype}; "
          f"packed for {args.pack_rows} rows")
    weights = {}
    for n, k in shapes:
        copies = args.copies or min(40, max(2, int(2e9 // (n * k * size))))
        plain = [torch.randn(n, k).to(dtype) for _ in range(copies)]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, args.pack_rows) for w in plain]
        halves = [w.bfloat16() for w in plain] if args.bf16_weights else []
        weights[(n, k)] = (plain, packed, halves)
    for m in args.rows:
        xs = {k: torch.randn(m, k).to(dtype) for _, k in shapes}
        line = []
        totals = [0.0, 0.0, 0.0] if args.bf16_weights else [0.0, 0.0]
        for (n, k), (plain, packed, halves) in weights.items():
            ways = [lambda x=xs[k], ws=plain: [F.linear(x, w) for w in ws],
                    lambda x=xs[k], ws=packed: [
                        torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                        for w in ws]]  # fmt: skip
            if halves:
                ways.append(lambda x=xs[k], ws=halves: [
                    cpu_float.bf16_weight_linear(x, w) for w in ws])
            per_call = [timed(way, args.rounds) / len(plain) for way in ways]
            line.append(f"{n}x{k} " + " / ".join(f"{1e6 * c:.0f}" for c in per_call) + " us")
            totals = [t + c * len(plain) for t, c in zip(totals, per_call, strict=True)]
        if args.whole:
            line.append("pass " + " / ".join(f"{1e3 * t:.1f}" for t in totals) + " ms")
        print(f"M={m}: " + "; ".join(line), flush=True)


if __name__ == "__main__":
    main()
