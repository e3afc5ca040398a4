"""Two builds of csrc/paged_attention.cpp side by side in one process (each at the avx2 level, in
its own op namespace), timed on the same paged decode-attention calls, rounds alternating: how a
change to the attention loops was measured (docs/notes/2026-12-07-cache-decode-attention.md,
one query head per pass against two). Each folder holds a paged_attention.cpp and the
q8_common.h it includes; outputs are compared too.

    d=$(mktemp -d); mkdir -p $d/old $d/new
    for f in paged_attention.cpp q8_common.h; do
      git show b5850f1:compress/kernels/csrc/$f > $d/old/$f
      git show f2b75c7:compress/kernels/csrc/$f > $d/new/$f
    done
    python scripts/bench_attention_builds.py $d/old $d/new
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

BLOCK, HEAD_DIM, POOL_BLOCKS = 16, 64, 4096
CASES = [(1, 9, 3, 128), (1, 32, 4, 512), (1, 32, 4, 2048), (32, 9, 3, 160), (28, 32, 4, 150),
         (28, 32, 4, 600)]  # rows, heads, kv heads, keys


def build(folder: Path, name: str):
    flags = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-DCOMPRESS_AVX2", f"-DCOMPRESS_OPS={name}"]
    load(name=name, sources=[str(folder / "paged_attention.cpp")], extra_cflags=flags,
         extra_ldflags=["-fopenmp"], is_python_module=False, build_directory=str(folder))
    return getattr(torch.ops, name).paged_decode_attention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ops = {"old": build(args.old, "attn_old"), "new": build(args.new, "attn_new")}
    print("| rows, heads / kv heads, keys | pages | old us (min-max) | new us (min-max) | "
          "speed-up | max diff |\n|---|---|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for b, h, hkv, length in CASES:
            k, v = (torch.randn(POOL_BLOCKS * BLOCK, hkv, HEAD_DIM).to(dtype) for _ in range(2))
            q = torch.randn(b, h, HEAD_DIM)
            nb = -(-length // BLOCK)
            tables = torch.randperm(POOL_BLOCKS)[: b * nb].reshape(b, nb).contiguous()
            lengths = torch.full((b,), length, dtype=torch.long)
            inputs = (q, k, v, None, None, tables, lengths, BLOCK, 0.125, 0.0, 0, None)
            call = {n: (lambda op=op, a=inputs: op(*a)) for n, op in ops.items()}
            diff = (call["old"]() - call["new"]()).abs().max().item()
            rounds: dict[str, list[float]] = {n: [] for n in call}
            for _ in range(7):
                for n, f in call.items():
                    for _ in range(3):
                        f()
                    samples = []
                    for _ in range(15):
                        start = time.perf_counter()
                        f()
                        samples.append(time.perf_counter() - start)
                    rounds[n].append(1e6 * statistics.median(samples))
            old, new = (statistics.median(rounds[n]) for n in ("old", "new"))
            cells = [f"{statistics.median(r):.1f} ({min(r):.1f}-{max(r):.1f})"
                     for r in (rounds["old"], rounds["new"])]  # fmt: skip
            print(f"| {b}, {h} / {hkv}, {length} | {str(dtype)[6:]} | {cells[0]} | {cells[1]} | "
                  f"{old / new:.2f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
