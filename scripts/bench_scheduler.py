"""The serving engine alone, without HTTP: REQUESTS prompts of PROMPT random tokens, OUTPUT new
tokens each, all added at once to a fresh ``Scheduler`` (as ``compress serve`` builds it: eager,
our int kernels, bf16 float matmuls and pages, 1 GiB of KV) and stepped until every one is done.
Wall time and output tokens per second, the median of ``--runs`` (each with new prompts, so no
prefix hit), optionally beside a ``--busy`` neighbour: a process that spins that share of one
core in bursts of 0.4 ms and sleeps the rest, as an HTTP client or server thread does beside the
engine on a small machine. ``--dtype float32`` builds the runtime as ``compress serve --dtype
float32`` does; ``--profile`` adds torch.profiler's ops by self CPU time over one more run. JSON +
markdown. ``--shared-prompt`` times instead what ``bench_serving.py``'s shared-prompt run does,
without HTTP: 8 requests one after another, a 256-token system prompt plus 32 tokens of their
own, 8 new tokens each; time to first token of the first (its prompt not cached yet) against
the median of the later ones (prefix-cache hits), ``--runs`` times with other prompts (with
``--profile``: one more later request's first step under the profiler):

    python scripts/bench_scheduler.py ~/.cache/compress/serving/smollm2-w4 --busy 0 0.2 \
        --out out/scheduler
    python scripts/bench_scheduler.py ~/.cache/compress/serving/smollm2-base --dtype float32 \
        --profile --out out/scheduler-fp32
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from pathlib import Path

import torch

from compress.eval.report import environment, markdown_table
from compress.io.load import load_model
from compress.runtime.engine import Runtime
from compress.runtime.scheduler import Scheduler

BURST_S = 0.0004  # one busy burst of the neighbour


def busy(share: float, stop) -> None:
    """Spin ``share`` of the time in bursts of BURST_S, sleep the rest, until ``stop`` is set."""
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < BURST_S:
            pass
        time.sleep(BURST_S * (1 - share) / share)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("export", type=Path)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--prefill-budget", type=int, default=256)
    p.add_argument("--busy", type=float, nargs="+", default=[0.0],
                   help="the neighbour's share of one core, one run set each (0: none)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="float matmul dtype (the bf16 exports' default in compress serve)")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler over one more run: ops by self CPU time")
    p.add_argument("--shared-prompt", action="store_true",
                   help="time to first token with a shared 256-token system prompt instead")
    p.add_argument("--out", type=Path, default=Path("out/scheduler"))
    args = p.parse_args()
    if any(not 0.0 <= b < 1.0 for b in args.busy):
        p.error("--busy takes shares in [0, 1)")
    torch.set_num_threads(args.threads)
    runtime = Runtime(load_model(args.export).model, max_seq_len=2048, compile=False,
                      prefill_dtype=getattr(torch, args.dtype),
                      decode_dtype=getattr(torch, args.dtype),
                      int4_kernel="q4q8", int8_kernel="q8q8", static_cache=False)  # fmt: skip
    scheduler = Scheduler(runtime, kv_memory=1 << 30, max_batch=args.requests,
                          prefill_budget=args.prefill_budget)  # fmt: skip
    generator = torch.Generator().manual_seed(0)

    def run() -> float:
        for _ in range(args.requests):  # token ids every supported vocabulary has
            prompt = torch.randint(100, 30000, (args.prompt,), generator=generator).tolist()
            scheduler.add(prompt, args.output)
        start = time.perf_counter()
        while scheduler.has_work:
            scheduler.step()
        return time.perf_counter() - start

    if args.shared_prompt:
        shared_prompt(scheduler, generator, args)
        return
    run()  # warm-up: first calls, allocator
    rows = []
    for share in args.busy:
        # spawn, not fork: a fresh interpreter, as a client is (a forked child of this process
        # slowed the engine more: 7.4 s against 6.1 s beside the same loop run separately)
        context = multiprocessing.get_context("spawn")
        stop = context.Event()
        neighbour = None
        if share > 0:
            neighbour = context.Process(target=busy, args=(share, stop), daemon=True)
            neighbour.start()
        try:
            seconds = [run() for _ in range(args.runs)]
        finally:
            stop.set()
            if neighbour is not None:
                neighbour.join()
        tokens = args.requests * args.output
        med = statistics.median(seconds)
        rows.append(dict(busy=share, seconds=med, spread=f"{min(seconds):.2f}-{max(seconds):.2f}",
                         tok_s=tokens / med))  # fmt: skip
        print(rows[-1], flush=True)
    profile = ""
    if args.profile:
        with torch.profiler.profile() as prof:
            run()
        profile = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
        print(profile)
    columns = [("busy", "neighbour's share of a core"), ("seconds", "wall s (median)"),
               ("spread", "min-max"), ("tok_s", "output tok/s")]  # fmt: skip
    what = (f"{args.export.name}: {args.requests} requests of {args.prompt} + {args.output} "
            f"tokens through the Scheduler alone ({args.dtype} matmuls, prefill budget "
            f"{args.prefill_budget}), {args.threads} threads, medians of {args.runs}")
    # the profiled run's ops (the profiler slows the run it watches)
    write_report(args.out, "scheduler", what, rows, columns,
                 ("One more run under torch.profiler, ops by self CPU time", profile)
                 if profile else None)


def write_report(out: Path, name: str, what: str, rows: list[dict], columns: list,
                 profile: tuple[str, str] | None = None) -> None:
    """``out/<name>.json`` (environment and rows) and ``out/<name>.md``: ``what``, the
    machine, the table, and a profile (title, table) when there is one."""
    env = environment()
    md = (f"{what}. {env['cpu']}, torch {env['torch']}, {env['date']}.\n\n"
          + markdown_table(rows, columns) + "\n")  # fmt: skip
    if profile:
        title, table = profile
        md += f"\n{title}:\n\n```\n{table}\n```\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    (out / f"{name}.md").write_text(md)
    print(md)


def shared_prompt(scheduler, generator, args) -> None:
    """``--shared-prompt``: TTFT of sequential requests sharing a system prompt (module doc)."""

    def tokens(n: int) -> list[int]:  # token ids every supported vocabulary has
        return torch.randint(100, 30000, (n,), generator=generator).tolist()

    def ttft_ms(prompt: list[int]) -> float:
        scheduler.add(prompt, 8)
        start, first = time.perf_counter(), None
        while scheduler.has_work:
            events = scheduler.step()
            if first is None and events:
                first = time.perf_counter() - start
        return first * 1e3

    ttft_ms(tokens(32))  # warm-up: first calls, allocator
    rows = []
    for _ in range(args.runs):
        system = tokens(256)
        ttfts = [ttft_ms(system + tokens(32)) for _ in range(8)]
        later = statistics.median(ttfts[1:])
        rows.append(dict(first_ms=ttfts[0], later_ms=later, ratio=later / ttfts[0]))
        print(rows[-1], flush=True)
    profile = ""
    if args.profile:
        scheduler.add(system + tokens(32), 1)
        with torch.profiler.profile() as prof:
            scheduler.step()
        while scheduler.has_work:
            scheduler.step()
        profile = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    columns = [("first_ms", "first TTFT ms"), ("later_ms", "later TTFT ms (median of 7)"),
               ("ratio", "later / first")]  # fmt: skip
    what = (f"{args.export.name}: 8 sequential requests sharing a 256-token system prompt (+32 "
            f"tokens each, 8 new), through the Scheduler alone ({args.dtype} matmuls), "
            f"{args.threads} threads, {args.runs} runs")
    write_report(args.out, "shared_prompt", what, rows, columns,
                 ("One later request's first step under torch.profiler", profile)
                 if profile else None)


if __name__ == "__main__":
    main()
