"""Inner loops of our CPU kernels that store vector registers to the stack: each of csrc's
sources compiled to assembly with an ISA level's flags (as ``cpu_q8`` builds it), every
backward jump's loop of at most ``--max-lines`` instructions that holds vector arithmetic,
with its count of ymm/zmm stores to ``%rsp``/``%rbp``.

    python scripts/check_loop_stack_stores.py --isa avx2
    python scripts/check_loop_stack_stores.py --isa avx2 --files prefill_attention.cpp

A store in a hot loop is either a spill (more live values than the 16 or 32 vector registers)
or a value GCC keeps in memory when it need not: prefill_attention.cpp's score tile stored its
12 accumulators every step until its loop became a do-while (docs/notes/
2026-12-07-avx2-tile-registers.md). Which loops are hot, perf says (``perf record`` then
``perf annotate``); this only lists candidates.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from torch.utils import cpp_extension

from compress.kernels import cpu_q8

LABEL = re.compile(r"^(\.L\d+):")
JUMP = re.compile(r"\s+j\w+\s+(\.L\d+)")
STACK_STORE = re.compile(r"\s+vmov\w+\s+%[yz]mm\d+, -?\w*\(%r[sb]p\)")
# AVX-VNNI's vpdpbusd is written with a {vex} prefix
VECTOR_MATH = re.compile(r"\s+(\{vex\}\s+)?v(fmadd|fnmadd|pmadd|pdp|padd|psub|mul|add|sub|max|min)")


def loops(asm: list[str], max_lines: int):
    """(label, instructions, vector ops, stack stores) of each backward jump's body."""
    where = {m.group(1): i for i, line in enumerate(asm) if (m := LABEL.match(line))}
    for i, line in enumerate(asm):
        m = JUMP.match(line)
        if m and where.get(m.group(1), i) < i and i - where[m.group(1)] <= max_lines:
            body = asm[where[m.group(1)]: i + 1]
            math = sum(bool(VECTOR_MATH.match(x)) for x in body)
            stores = sum(bool(STACK_STORE.match(x)) for x in body)
            yield m.group(1), len(body), math, stores


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--isa", default="avx2", choices=sorted(cpu_q8.ISA_LEVELS))
    p.add_argument("--files", nargs="+", default=None, help="csrc file names (default: all)")
    p.add_argument("--max-lines", type=int, default=150)
    p.add_argument("--min-math", type=int, default=4, help="vector ops a loop needs to count")
    args = p.parse_args()
    _, cflags, define = cpu_q8.ISA_LEVELS[args.isa]
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"],
                str(cpu_q8.CSRC)]  # fmt: skip
    sources = [cpu_q8.CSRC / f for f in args.files] if args.files else [
        s for s in cpu_q8.SOURCES if s.suffix == ".cpp"]  # fmt: skip
    found = 0
    with tempfile.TemporaryDirectory() as tmp:
        for source in sources:
            out = Path(tmp) / f"{source.stem}.s"
            cmd = ["c++", "-std=c++20", "-fPIC", *cflags, f"-D{define}",
                   f"-DCOMPRESS_OPS=compress_{args.isa}", "-DTORCH_EXTENSION_NAME=check",
                   *[f"-I{d}" for d in includes], "-S", "-o", str(out), str(source)]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{source.name} did not compile:\n{done.stderr[-2000:]}")
            asm = out.read_text().splitlines()
            for label, lines, math, stores in loops(asm, args.max_lines):
                if stores and math >= args.min_math:
                    found += 1
                    print(f"{source.name} {label}: {lines} instructions, {math} vector ops, "
                          f"{stores} vector stores to the stack")
    print(f"{found} loops with vector stores to the stack ({args.isa}, {len(sources)} files)")


if __name__ == "__main__":
    main()
