"""Weights on 4 KB pages against the same weights on 2 MB pages (``memory.HugePageArena``), in
one process, rounds alternated, medians and min-max:

- ``ops``: one decode pass of a 1.1B-shaped model's int4 or int8 linears (22 layers x qkv, o,
  gate_up, down, stacked as the runtime calls them) through our op at one ISA level, one row;
- ``step``: a served export's decode step (``compress serve``'s eager runtime and scheduler,
  ROWS requests), one runtime built with ``hold_in_huge_pages`` and one without.

    python scripts/bench_huge_pages.py ops --isa avx512vnni --bits 4
    COMPRESS_CPU_ISA=avx2 python scripts/bench_huge_pages.py ops --isa avx2 --bits 8
    python scripts/bench_huge_pages.py step ~/.cache/compress/serving/synthetic-1b-w4 --rows 1

(the exports are those ``scripts/bench_serving.py`` writes and caches). Prints one line each,
with the kernel's transparent-huge-page mode and this process's AnonHugePages.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from compress import memory
from compress.eval.report import environment

LAYER = [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]


def anon_huge() -> str:
    with open("/proc/self/smaps_rollup") as handle:
        return next((line.split(":")[1].strip() for line in handle if "AnonHuge" in line), "?")


def alternate(runs: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each named callable, rounds alternating the order."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(runs[name]())
    return times


def ops(args) -> dict[str, list[float]]:
    from compress.kernels import cpu_q8

    op = getattr(cpu_q8.ops(args.isa), "int8_linear_q8" if args.bits == 8 else "int4_linear_q8")
    torch.manual_seed(0)
    plain = []
    for _ in range(22):
        for n, k in LAYER:
            codes = torch.randint(0, 256, (n, k if args.bits == 8 else k // 2), dtype=torch.uint8)
            plain.append((k, codes, (torch.rand(n, k // 128) * 0.01).contiguous()))
    arena = memory.HugePageArena(sum(c.numel() + 64 for _, c, _ in plain))
    huge = [(k, arena.take(c), s) for k, c, s in plain]
    xs = {k: torch.randn(1, k) for k in {k for _, k in LAYER}}

    def run(weights):
        def once() -> float:
            start = time.perf_counter()
            for k, codes, scales in weights:
                op(xs[k], codes, scales, None, 128)
            return time.perf_counter() - start

        return once

    print(f"arena advised: {arena.advised}; AnonHugePages {anon_huge()}")
    return alternate({"4 KB pages": run(plain), "2 MB pages": run(huge)}, args.rounds)


def step(args) -> dict[str, list[float]]:
    from compress.io.load import load_model
    from compress.runtime import engine
    from compress.runtime.scheduler import Scheduler

    held = engine.hold_in_huge_pages

    def build(huge: bool):
        engine.hold_in_huge_pages = held if huge else (lambda modules: None)
        runtime = engine.Runtime(
            load_model(args.export).model, max_seq_len=1024, compile=False,
            prefill_dtype=torch.bfloat16, decode_dtype=torch.bfloat16, int4_kernel="q4q8",
            int8_kernel="q8q8", static_cache=False,
        )  # fmt: skip
        print(f"{'2 MB' if huge else '4 KB'} pages: hold_in_huge_pages {runtime.huge_pages}")
        scheduler = Scheduler(runtime, kv_memory=256 << 20, max_batch=max(8, args.rows))
        generator = torch.Generator().manual_seed(0)
        for _ in range(args.rows):  # token ids every supported vocabulary has
            prompt = torch.randint(100, 30000, (128,), generator=generator).tolist()
            scheduler.add(prompt, 8 * args.rounds + 16)
        while scheduler.waiting or any(s.num_computed < len(s.prompt) for s in scheduler.running):
            scheduler.step()
        for _ in range(3):
            scheduler.step()

        def once() -> float:
            steps = []
            for _ in range(4):
                start = time.perf_counter()
                scheduler.step()
                steps.append(time.perf_counter() - start)
            return statistics.median(steps)

        return once

    plain, huge = build(False), build(True)
    engine.hold_in_huge_pages = held
    print(f"AnonHugePages {anon_huge()}")
    return alternate({"4 KB pages": plain, "2 MB pages": huge}, args.rounds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    o = sub.add_parser("ops")
    o.add_argument("--isa", default="avx512vnni")
    o.add_argument("--bits", type=int, choices=[4, 8], default=4)
    s = sub.add_parser("step")
    s.add_argument("export")
    s.add_argument("--rows", type=int, default=1)
    for q in (o, s):
        q.add_argument("--rounds", type=int, default=11)
        q.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    times = ops(args) if args.what == "ops" else step(args)
    env = environment()
    what = (f"{args.isa} int{args.bits} decode pass" if args.what == "ops"
            else f"{args.export}, {args.rows} rows, decode step")  # fmt: skip
    plain, huge = (statistics.median(times[k]) for k in ("4 KB pages", "2 MB pages"))
    spread = {k: f"{1e3 * min(v):.2f}-{1e3 * max(v):.2f}" for k, v in times.items()}
    print(
        f"{env['cpu']} ({', '.join(env['cpu_flags'])}); torch {env['torch']}; "
        f"{args.threads} threads; {env['date']}; THP {memory.huge_page_mode()}"
    )
    print(f"{what}: 4 KB pages {1e3 * plain:.2f} ms ({spread['4 KB pages']}), 2 MB pages "
          f"{1e3 * huge:.2f} ms ({spread['2 MB pages']}); {plain / huge:.3f}x, medians of "
          f"{args.rounds} alternated rounds")  # fmt: skip


if __name__ == "__main__":
    main()
