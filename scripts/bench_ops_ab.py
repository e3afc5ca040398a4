"""One of our CPU ops from this tree against the same op built from another commit, in one
process: first their outputs over a set of shapes, offsets and row counts (equal bit for bit, or
the script says where not), then ms per decode-or-prefill pass over a model shape's linears
(each layer its own weight, beyond the L3), rounds alternated, medians with min-max.
JSON + markdown:

    python scripts/bench_ops_ab.py --op tiles --base c31abb3 --rows 1 2 4 8 16 128 \
        --out out/tiles_ab
    python scripts/bench_ops_ab.py --op tiles --base 2be01cc --shape smollm2 --rows 1 8 64 256 \
        --out out/tiles_avx2_ab_smollm2
    COMPRESS_CPU_ISA=avx2 python scripts/bench_ops_ab.py --op int8 --isa avx2 --base 0d5b34d \\
        --shape 1b --rows 1 --huge-pages --out out/int8_ab

``--op tiles``: ``int4_linear_q8_tiles`` (csrc/q8_tiles.cpp, at the selected level where it has
column tiles, avx512vnni or avx2, else avx512vnni), int4 g128 in that level's column-tile layout,
one 1.1B layer's projections x 4 as separate calls, or with ``--shape`` that shape's layers
(g64 where 128 does not divide K). ``--op int4`` / ``int8``: ``int4_linear_q8`` /
``int8_linear_q8`` (csrc/q8_dot.cpp with q8_gemm.cpp) at ``--isa``, the
layers of ``--shape`` stacked as the runtime calls them (qkv, o, gate_up, down). ``--huge-pages``
holds both sides' weights in a ``memory.HugePageArena``, as the runtime does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from compress import memory
from compress.eval.report import environment
from compress.kernels import cpu_q8

LEVEL_FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-DCOMPRESS_AVX2"],
    "avxvnni": ["-mavx2", "-mfma", "-mavxvnni", "-DCOMPRESS_AVXVNNI"],
    "avx512vnni": ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni",
                   "-DCOMPRESS_AVX512VNNI"],
}  # fmt: skip
SOURCES = {"tiles": ["q8_tiles.cpp"], "int4": ["q8_dot.cpp", "q8_gemm.cpp"],
           "int8": ["q8_dot.cpp", "q8_gemm.cpp"]}  # fmt: skip
TILES_LAYER = [(2048, 2048), (256, 2048), (256, 2048), (2048, 2048), (5632, 2048), (5632, 2048),
               (2048, 5632)]  # fmt: skip
STACKED = {  # (N, K) of one layer's calls, and how many layers
    "smollm2": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30),
    "1b": ([(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)], 22),
    "7b": ([(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)], 3),
}
CHECKS = [(48, 512, 32), (64, 512, 128), (2048, 2048, 128), (5632, 2048, 64), (256, 5632, 128),
          (16, 256, 256)]  # fmt: skip


def build_base(commit: str, op: str, isa: str, tmp: Path):
    """The base commit's sources of ``op`` (and q8_common.h), built as namespace ``ops_base``."""
    for name in [*SOURCES[op], "q8_common.h"]:
        text = subprocess.run(["git", "show", f"{commit}:compress/kernels/csrc/{name}"],
                              check=True, capture_output=True, text=True).stdout  # fmt: skip
        (tmp / name).write_text(text)
    flags = ["-O3", "-fopenmp", "-DCOMPRESS_OPS=ops_base", *LEVEL_FLAGS[isa]]
    load(name=f"ops_base_{op}_{isa}_{commit}", sources=[str(tmp / n) for n in SOURCES[op]],
         extra_cflags=flags, build_directory=str(tmp), is_python_module=False)  # fmt: skip
    return getattr(torch.ops.ops_base, OP_NAMES[op])


OP_NAMES = {"tiles": "int4_linear_q8_tiles", "int4": "int4_linear_q8", "int8": "int8_linear_q8"}


def weight(op: str, n: int, k: int, group: int, offsets: bool, isa: str) -> cpu_q8.Q8Weight:
    """Random codes and scales in ``op``'s layout."""
    bits = 8 if op == "int8" else 4
    codes = torch.randint(0, 256, (n, k if bits == 8 else k // 2), dtype=torch.uint8)
    scales = (torch.rand(n, k // group) * 0.01).contiguous()
    offs = (torch.randn(n, k // group) * 0.01).contiguous() if offsets else None
    w = cpu_q8.Q8Weight(bits, codes, scales, offs, group)
    return cpu_q8.to_tiles(w, cpu_q8.TILE_WIDTHS[isa]) if op == "tiles" else w


def differences(op: str, isa: str, base, here) -> list[str]:
    found = []
    for n, k, group in CHECKS:
        for offsets in (False, True):
            w = weight(op, n, k, group, offsets, isa)
            for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 33, 128):
                x = torch.randn(m, k) * 3
                args = (w.codes, w.scales, w.offsets, group)
                a, b = base(x, *args), here(x, *args)
                if not torch.equal(a, b):
                    found.append(f"N={n} K={k} g{group} offsets={offsets} M={m}: "
                                 f"max |diff| {(a - b).abs().max().item():.3g}")  # fmt: skip
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the commit to compare against")
    p.add_argument("--op", choices=sorted(SOURCES), default="tiles")
    p.add_argument("--isa", default=None, help="level (default: tiles' level, else selected)")
    p.add_argument("--shape", choices=sorted(STACKED), default=None,
                   help="the layers timed (default: 1b; tiles: one 1.1B layer's calls x 4)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 128])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--huge-pages", action="store_true")
    p.add_argument("--out", default="out/ops_ab")
    args = p.parse_args()
    selected = cpu_q8.selected_isa()
    tiles_isa = selected if selected in cpu_q8.TILE_WIDTHS else cpu_q8.AMX_ISA
    isa = args.isa or (tiles_isa if args.op == "tiles" else selected)
    if args.op == "tiles" and isa not in cpu_q8.TILE_WIDTHS:
        sys.exit(f"--op tiles runs at {', '.join(cpu_q8.TILE_WIDTHS)}, not {isa}")
    if cpu_q8.build_reason(isa) is not None:
        sys.exit(f"the {isa} level does not run here: {cpu_q8.build_reason(isa)}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    here = getattr(cpu_q8.ops(isa), OP_NAMES[args.op])
    group = 128
    if args.op == "tiles" and args.shape is None:
        calls, label = TILES_LAYER * 4, "one 1.1B layer's projections x 4, int4 g128, tiles"
    else:
        shape = args.shape or "1b"
        layer, count = STACKED[shape]
        calls = layer * count
        label = f"{shape}: {count} layers x {len(layer)} stacked calls, {args.op}"
        group = None if args.op == "int8" else 128
    with tempfile.TemporaryDirectory() as tmp:
        base = build_base(args.base, args.op, isa, Path(tmp))
        diffs = differences(args.op, isa, base, here)
        # g128, or g64 where 128 does not divide K (SmolLM2's 576)
        weights = [weight(args.op, n, k, group or k if k % (group or k) == 0 else 64, False, isa)
                   for n, k in calls]  # fmt: skip
        if args.huge_pages:
            arena = memory.HugePageArena(sum(w.codes.numel() + 64 for w in weights))
            weights = [dataclasses.replace(w, codes=arena.take(w.codes)) for w in weights]
        macs = sum(n * k for n, k in calls)
        rows = []
        for m in args.rows:
            xs = {k: torch.randn(m, k) for k in {k for _, k in calls}}
            times: dict[str, list[float]] = {"base": [], "here": []}
            for r in range(args.rounds):
                order = [("base", base), ("here", here)]
                for name, op in order if r % 2 == 0 else order[::-1]:
                    start = time.perf_counter()
                    for w, (_, k) in zip(weights, calls, strict=True):
                        op(xs[k], w.codes, w.scales, None, w.group_size)
                    times[name].append((time.perf_counter() - start) * 1e3)
            b, h = statistics.median(times["base"]), statistics.median(times["here"])
            rows.append({"rows": m, "base_ms": b, "here_ms": h, "speedup": b / h,
                         "base_range": [min(times["base"]), max(times["base"])],
                         "here_range": [min(times["here"]), max(times["here"])],
                         "here_gmac_s": m * macs / h / 1e6})  # fmt: skip
            print(rows[-1], flush=True)
    env = environment()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"base": args.base, "op": args.op, "isa": isa, "environment": env,
              "threads": args.threads, "huge_pages": args.huge_pages, "outputs_differ": diffs,
              "rows": rows}  # fmt: skip
    (out / "ops_ab.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"{env.get('cpu', '')}; {args.threads} threads; {isa}; base {args.base}; {label}"
        + ("; 2 MB pages" if args.huge_pages else ""),
        "",
        "| M | base ms | here ms | speedup | here GMAC/s |",
        "|---:|---:|---:|---:|---:|",
    ]

    def timed(ms: float, spread: list[float]) -> str:
        return f"{ms:.2f} ({spread[0]:.2f}-{spread[1]:.2f})"

    for r in rows:
        lines.append(
            f"| {r['rows']} | {timed(r['base_ms'], r['base_range'])} | "
            f"{timed(r['here_ms'], r['here_range'])} | {r['speedup']:.3f}x | "
            f"{r['here_gmac_s']:.0f} |"
        )
    lines += ["", f"Medians of {args.rounds} alternated rounds. Outputs: "
              + ("equal bit for bit." if not diffs else "DIFFER: " + "; ".join(diffs))]  # fmt: skip
    (out / "ops_ab.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
