"""One scheduler decode step of a served export, the way ``compress serve`` runs it (eager
runtime, our integer kernels, paged KV cache): ROWS requests of 128-token prompts are prefilled,
then the median of 8 decode steps is printed; ``--profile`` adds torch.profiler's ops by self
CPU time over 5 more steps. ``--no-fp32-pack`` keeps fp32 weights plain (``F.linear``) to time
``FP32_PACK_MIN_ELEMENTS`` against.

    S=~/.cache/compress/serving  # the exports scripts/bench_serving.py writes and caches
    python scripts/profile_serving_step.py $S/synthetic-1b-w4 28 --profile
    python scripts/profile_serving_step.py $S/smollm2-base 32 --profile
    python scripts/profile_serving_step.py $S/synthetic-1b-base 8 --no-fp32-pack

``--burst`` instead times ROWS requests added at once (128-token prompts, 64 new tokens each)
against one alone, split into the steps that still prefill and the decode-only ones:

    python scripts/profile_serving_step.py $S/synthetic-1b-w4 8 --burst

``--python-layers`` runs the decode steps' layers through the Python loop instead of one C++
call (``Scheduler(decode_stack=False)``); ``--loops`` times both in one process, blocks of steps
taking turns, two schedulers of ROWS requests on one runtime:

    python scripts/profile_serving_step.py $S/smollm2-w4 1 --loops --steps 40

``--dtype auto`` (the default) picks the float dtype as ``compress serve`` does: bf16 for these
bf16 exports (float layers, head and KV pages) on CPUs with bf16 matmuls, float32 on others.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from compress.cli_flags import runtime_dtypes
from compress.eval.report import environment
from compress.io.load import load_model
from compress.runtime import float_linear
from compress.runtime.engine import Runtime
from compress.runtime.scheduler import Scheduler


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("export")
    p.add_argument("rows", type=int, help="requests decoding together")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="float layers' matmul dtype, picked as serve's --dtype picks it")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "int8", "fp8"],
                   help="KV pages (auto: the runtime's KV dtype)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--shapes", action="store_true", help="--profile: one row per op and shapes")
    p.add_argument("--rows-shown", type=int, default=20, help="--profile: table rows")
    p.add_argument("--no-fp32-pack", action="store_true")
    p.add_argument("--burst", action="store_true", help="time ROWS requests at once vs one")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps (the median shown)")
    p.add_argument("--python-layers", action="store_true",
                   help="decode layers through the Python loop, not one C++ call")
    p.add_argument("--loops", action="store_true", help="time the C++ and Python loops in turns")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.no_fp32_pack:
        float_linear.FP32_PACK_MIN_ELEMENTS = 1 << 62
    args.dtype, matmul, load_dtype = runtime_dtypes(args.export, args.dtype)
    runtime = Runtime(load_model(args.export, dtype=load_dtype).model, max_seq_len=2048,
                      compile=False,
                      prefill_dtype=matmul, decode_dtype=matmul, int4_kernel="q4q8",
                      int8_kernel="q8q8", static_cache=False)  # fmt: skip
    kv_dtype = None if args.kv_dtype == "auto" else args.kv_dtype
    scheduler = Scheduler(runtime, kv_memory=1 << 30, max_batch=max(32, args.rows),
                          kv_dtype=kv_dtype, decode_stack=not args.python_layers)
    generator = torch.Generator().manual_seed(0)
    if args.loops:
        python_loop = Scheduler(runtime, kv_memory=1 << 30, max_batch=max(32, args.rows),
                                kv_dtype=kv_dtype, decode_stack=False)
        loops(args, {"C++": scheduler, "Python": python_loop})
        return
    if args.burst:
        env = environment()
        print(f"{env['cpu']} ({', '.join(env['cpu_flags'])}); torch {env['torch']}; "
              f"{env['threads']} threads; {env['date']}; {args.export}, {args.dtype}")  # fmt: skip
        burst(scheduler, generator, 1)  # warm-up
        for rows in (1, args.rows):
            burst(scheduler, generator, rows)
        return
    start_decoding(scheduler, args.rows, args.steps + 40, generator)
    times = [timed_step(scheduler) for _ in range(args.steps)]
    print_environment()
    where = "Python" if scheduler.decode_stack is None else "C++"
    print(f"{args.export}, {args.rows} rows, {args.dtype}, decode layers in {where}: decode step "
          f"median {1e3 * statistics.median(times):.1f} ms (min {1e3 * min(times):.1f})")
    if args.profile:
        with torch.profiler.profile(record_shapes=args.shapes) as prof:
            for _ in range(5):
                scheduler.step()
        print("5 steps:")
        averages = prof.key_averages(group_by_input_shape=args.shapes)
        print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows_shown))


def print_environment() -> None:
    env = environment()
    print(f"{env['cpu']} ({', '.join(env['cpu_flags'])}); torch {env['torch']}; "
          f"{env['threads']} threads; {env['date']}")


def start_decoding(scheduler: Scheduler, rows: int, tokens: int,
                   generator: torch.Generator) -> None:
    """``rows`` requests of 128-token prompts and ``tokens`` new tokens, prefilled, then three
    decode steps."""
    for _ in range(rows):  # token ids every supported vocabulary has
        scheduler.add(torch.randint(100, 30000, (128,), generator=generator).tolist(), tokens)
    while scheduler.waiting or any(s.num_computed < len(s.prompt) for s in scheduler.running):
        scheduler.step()
    for _ in range(3):
        scheduler.step()


def timed_step(scheduler: Scheduler) -> float:
    start = time.perf_counter()
    scheduler.step()
    return time.perf_counter() - start


def loops(args, schedulers: dict[str, Scheduler]) -> None:
    """Decode steps of each scheduler in turns, blocks of 5 (the same requests on each): the
    median, min and max per scheduler."""
    blocks = max(1, args.steps // 5)
    times: dict[str, list[float]] = {name: [] for name in schedulers}
    for scheduler in schedulers.values():
        start_decoding(scheduler, args.rows, 5 * blocks + 40, torch.Generator().manual_seed(0))
    for _ in range(blocks):
        for name, scheduler in schedulers.items():
            times[name] += [timed_step(scheduler) for _ in range(5)]
    print_environment()
    for name, t in times.items():
        print(f"{args.export}, {args.rows} rows, {args.dtype}, decode layers in {name}: step "
              f"median {1e3 * statistics.median(t):.2f} ms (min {1e3 * min(t):.2f}, max "
              f"{1e3 * max(t):.2f}; {len(t)} steps)")  # fmt: skip


def burst(scheduler: Scheduler, generator: torch.Generator, rows: int) -> None:
    """``rows`` requests added at once, run to the end: output tokens/s, and the steps that
    still prefill against the decode-only ones."""
    for _ in range(rows):
        scheduler.add(torch.randint(100, 30000, (128,), generator=generator).tolist(), 64)
    steps: list[tuple[bool, float]] = []
    begin = time.perf_counter()
    while scheduler.waiting or scheduler.running:
        prefill = bool(scheduler.waiting) or any(
            s.num_computed < len(s.prompt) for s in scheduler.running
        )
        start = time.perf_counter()
        scheduler.step()
        steps.append((prefill, time.perf_counter() - start))
    total = time.perf_counter() - begin
    pre = [t for p, t in steps if p]
    dec = [t for p, t in steps if not p]
    print(f"{rows} requests at once: {total:.2f} s, {rows * 64 / total:.1f} out tok/s; "
          f"{len(pre)} steps with prefill {sum(pre):.2f} s, {len(dec)} decode-only steps "
          f"{sum(dec):.2f} s (median {1e3 * statistics.median(dec):.1f} ms)")  # fmt: skip


if __name__ == "__main__":
    main()
