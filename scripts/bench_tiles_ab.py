"""The column-tile int4 op (``csrc/q8_tiles.cpp``, AVX512-VNNI level) of this tree against the
same op built from another commit, in one process: first their outputs over a set of shapes,
offsets and row counts (equal bit for bit, or the script says where not), then ms per call over
one 1.1B-shaped decoder layer's projections x 4 (about 88 MB of int4, beyond the L3), rounds
alternated, medians with min-max. JSON + markdown:

    python scripts/bench_tiles_ab.py --base c31abb3 --rows 1 2 4 8 16 128 --out out/tiles_ab
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from compress.eval.report import environment
from compress.kernels import cpu_q8

CSRC = Path(cpu_q8.__file__).parent / "csrc"
LAYER = [(2048, 2048), (256, 2048), (256, 2048), (2048, 2048), (5632, 2048), (5632, 2048),
         (2048, 5632)]  # fmt: skip
CHECKS = [(48, 512, 32), (64, 512, 128), (2048, 2048, 128), (5632, 2048, 64), (256, 5632, 128),
          (16, 256, 256)]  # fmt: skip


def build_base(commit: str, tmp: Path):
    """The base commit's q8_tiles.cpp and q8_common.h, built as op namespace ``tiles_base``."""
    for name in ("q8_tiles.cpp", "q8_common.h"):
        text = subprocess.run(["git", "show", f"{commit}:compress/kernels/csrc/{name}"],
                              check=True, capture_output=True, text=True).stdout  # fmt: skip
        (tmp / name).write_text(text)
    flags = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl",
             "-mavx512vnni", "-DCOMPRESS_AVX512VNNI", "-DCOMPRESS_OPS=tiles_base"]  # fmt: skip
    load(name=f"tiles_base_{commit}", sources=[str(tmp / "q8_tiles.cpp")], extra_cflags=flags,
         build_directory=str(tmp), is_python_module=False)  # fmt: skip
    return torch.ops.tiles_base.int4_linear_q8_tiles


def tiles_weight(n: int, k: int, group: int, offsets: bool) -> cpu_q8.Q8Weight:
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    scales = (torch.rand(n, k // group) * 0.01).contiguous()
    offs = (torch.randn(n, k // group) * 0.01).contiguous() if offsets else None
    return cpu_q8.to_tiles(cpu_q8.Q8Weight(4, codes, scales, offs, group))


def differences(base, here) -> list[str]:
    found = []
    for n, k, group in CHECKS:
        for offsets in (False, True):
            w = tiles_weight(n, k, group, offsets)
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
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 128])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="out/tiles_ab")
    args = p.parse_args()
    if cpu_q8.build_reason(cpu_q8.TILES_ISA) is not None:
        sys.exit(f"the column-tile op does not run here: {cpu_q8.build_reason(cpu_q8.TILES_ISA)}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    here = cpu_q8.ops(cpu_q8.TILES_ISA).int4_linear_q8_tiles
    with tempfile.TemporaryDirectory() as tmp:
        base = build_base(args.base, Path(tmp))
        diffs = differences(base, here)
        weights = [tiles_weight(n, k, 128, False) for n, k in LAYER * 4]
        macs = sum(n * k for n, k in LAYER * 4)
        rows = []
        for m in args.rows:
            xs = {k: torch.randn(m, k) for k in {k for _, k in LAYER}}
            times: dict[str, list[float]] = {"base": [], "here": []}
            for r in range(args.rounds):
                order = [("base", base), ("here", here)]
                for name, op in order if r % 2 == 0 else order[::-1]:
                    t = time.perf_counter()
                    for w in weights:
                        op(xs[w.codes.shape[1] * 8], w.codes, w.scales, None, 128)
                    times[name].append((time.perf_counter() - t) * 1e3)
            b, h = statistics.median(times["base"]), statistics.median(times["here"])
            rows.append({"rows": m, "base_ms": b, "here_ms": h, "speedup": b / h,
                         "base_range": [min(times["base"]), max(times["base"])],
                         "here_range": [min(times["here"]), max(times["here"])],
                         "here_gmac_s": m * macs / h / 1e6})  # fmt: skip
            print(rows[-1], flush=True)
    env = environment()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"base": args.base, "environment": env, "threads": args.threads,
              "outputs_differ": diffs, "rows": rows}  # fmt: skip
    (out / "tiles_ab.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"{env.get('cpu', '')}; {args.threads} threads; base {args.base}; "
        f"{len(LAYER) * 4} projections (one 1.1B layer x 4, int4 g128)",
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
    (out / "tiles_ab.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
