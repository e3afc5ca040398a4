"""One prefill pass's linears (every decoder layer's projections, each its own weight), M rows
of activations, through each way the runtime can run them, interleaved round by round in one
run: dense fp32 and bf16 ``F.linear`` (the float baselines), torch's int4 / int8 weight-only
kernels (bf16 activations) and ours (``cpu_q8``: int8-rounded activations; from 8 rows on its
row-tile GEMM, ``csrc/q8_gemm.cpp``) at every ISA level this CPU has, and at the avx512vnni
and avx2 levels int4 in the column-tile layout the runtime holds there (the tile op and, where
the CPU grants AMX, its AMX form). ``--dequant-gemm`` adds
the long-prompt alternative: our weights dequantized per call (``cpu_q8.dequantize``, lowest
level) into ATen's fp32 GEMM, which sets ``cpu_q8.FLOAT_GEMM_MIN_ROWS``. Per kernel: median ms
per pass (min-max) and speed vs dense fp32. JSON + markdown:

    python scripts/bench_prefill.py --shape smollm2 --rows 32 128 --out out/prefill
    python scripts/bench_prefill.py --shape 1b --rows 32 --out out/prefill_1b
    python scripts/bench_prefill.py --shape 1b --group 128 --rows 16 32 128 256 \
        --only tiles bf16 --out out/prefill_1b_amx

(where the CPU grants AMX-BF16, ``--only bf16`` also times the dense bf16 weights in AMX's tile
order through the same loops.)
    COMPRESS_CPU_ISA=avx2 python scripts/bench_prefill.py --rows 64 128 256 512 --dequant-gemm
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode_pass import layers, our_pass, prepack, torch_pass, write_table  # noqa: E402

from compress.kernels import cpu_q8  # noqa: E402

SHAPES = {  # (N, K) of one decoder layer's projections, and the layer count
    "smollm2": ([(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576),
                 (576, 1536)], 30),
    "1b": ([(2048, 2048), (256, 2048), (256, 2048), (2048, 2048), (5632, 2048), (5632, 2048),
            (2048, 5632)], 22),
}  # fmt: skip


def dense(qs, dtype: torch.dtype):
    ws = [q.dequantized_weight().to(dtype) for q in qs]
    return [(w.shape[1], lambda x, w=w: F.linear(x.to(w.dtype), w)) for w in ws]


def dequant_gemm(qs, isa: str):
    """What the runtime runs from ``FLOAT_GEMM_MIN_ROWS`` rows: dequantize, then fp32 GEMM."""
    return [(w.k, lambda x, w=w: F.linear(x, cpu_q8.dequantize(w, isa))) for w in prepack(qs)]


def tile_pass(qs, isa: str, amx: bool, bf16: bool = False):
    """int4 in level ``isa``'s column-tile layout (what the runtime holds at the avx512vnni and
    avx2 levels): the tile op, at avx512vnni also its AMX-INT8 form, or with ``bf16`` the
    AMX-BF16 op (bf16 activations; both ``csrc/q8_amx.cpp``)."""
    weights = [cpu_q8.to_tiles(w, cpu_q8.tile_width(isa)) for w in prepack(qs)]
    if bf16:
        op = cpu_q8.ops(isa).int4_linear_bf16_tiles_amx
        return [(w.k, lambda x, w=w: op(x, w.codes, w.scales, w.offsets, w.group_size))
                for w in weights]  # fmt: skip
    return [(w.k, lambda x, w=w: cpu_q8.linear_q8(x, w, isa, amx=amx)) for w in weights]


def bf16_tile_pass(qs):
    """The dequantized weights in bf16, in AMX's B-tile order (``cpu_q8.bf16_to_tiles``), through
    ``bf16_linear_tiles_amx``: the float layers of eager bf16 runtimes on AMX-BF16 CPUs."""
    op = cpu_q8.ops(cpu_q8.AMX_ISA).bf16_linear_tiles_amx
    weights = [cpu_q8.bf16_to_tiles(q.dequantized_weight().to(torch.bfloat16)) for q in qs]
    return [(w.shape[1] * 2, lambda x, w=w: op(x, w)) for w in weights]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--rows", type=int, nargs="+", default=[32, 128])
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument(
        "--dequant-gemm",
        action="store_true",
        help="add our weights dequantized per call into ATen's fp32 GEMM",
    )
    p.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="time only kernels whose name holds one of these words (dense fp32 always runs)",
    )
    p.add_argument("--out", default="out/prefill")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    levels = cpu_q8.built_levels()
    shapes, count = SHAPES[args.shape]
    rows = []
    for bits in (4, 8):
        qs = layers(shapes, count, bits, args.group)
        kernels = {
            "dense fp32": dense(qs, torch.float32),
            "dense bf16": dense(qs, torch.bfloat16),
            f"torch int{bits} (bf16 x)": torch_pass(qs, bits)[0],
        }
        kernels |= {f"ours int{bits} ({isa})": our_pass(qs, isa)[0] for isa in levels}
        for isa in levels if bits == 4 else []:
            if cpu_q8.tile_width(isa) is not None:
                kernels[f"ours int4 column tiles ({isa})"] = tile_pass(qs, isa, amx=False)
        if bits == 4 and cpu_q8.AMX_ISA in levels:
            amx_isa = cpu_q8.AMX_ISA
            if cpu_q8.amx_reason() is None:
                kernels["ours int4 column tiles (AMX-INT8)"] = tile_pass(qs, amx_isa, amx=True)
            if cpu_q8.amx_bf16_reason() is None:
                kernels["ours int4 column tiles (AMX-BF16, bf16 x)"] = tile_pass(
                    qs, amx_isa, True, True
                )
        if bits == 4 and cpu_q8.amx_bf16_reason() is None:
            # the same AMX loops over dense bf16 weights (what eager bf16 runtimes run)
            kernels["ours dense bf16 tiles (AMX-BF16)"] = bf16_tile_pass(qs)
        if args.dequant_gemm:
            kernels[f"ours int{bits} dequantized + fp32 GEMM ({levels[-1]})"] = dequant_gemm(
                qs, levels[-1]
            )
        if args.only:
            kernels = {
                name: calls
                for name, calls in kernels.items()
                if name == "dense fp32" or any(word in name for word in args.only)
            }
        for m in args.rows:
            xs = {k: torch.randn(m, k) for k in {q.in_features for q in qs}}
            xs16 = {k: x.bfloat16() for k, x in xs.items()}
            samples = {name: [] for name in kernels}
            for _ in range(args.rounds + 1):  # the first round warms up
                for name, calls in kernels.items():
                    inputs = xs16 if name.startswith("torch") else xs
                    start = time.perf_counter()
                    for k, fn in calls:
                        fn(inputs[k])
                    samples[name].append(time.perf_counter() - start)
            base = statistics.median(samples["dense fp32"][1:])
            for name in kernels:
                if bits == 8 and name.startswith("dense"):
                    continue  # the same dense rows as int4's
                ms = [1e3 * s for s in samples[name][1:]]
                med = statistics.median(ms)
                rows.append(dict(rows=m, kernel=name, ms=med,
                                 ms_range=f"{min(ms):.1f}-{max(ms):.1f}",
                                 vs_fp32=base * 1e3 / med))  # fmt: skip
                print(rows[-1], flush=True)
        del qs, kernels
    columns = [("rows", "M"), ("kernel", "kernel"), ("ms", "ms per pass (median)"),
               ("ms_range", "min-max"), ("vs_fp32", "vs dense fp32")]  # fmt: skip
    write_table(
        Path(args.out), "prefill", sorted(rows, key=lambda r: r["rows"]), columns,
        threads=args.threads, footer=f"Medians of {args.rounds} interleaved rounds.",
        header=f"; {count} layers x {len(shapes)} projections ({args.shape}); int4 "
        f"g{args.group}, int8 per channel",
    )  # fmt: skip


if __name__ == "__main__":
    main()
