"""What each KV-cache storage costs in quality and buys in memory on the real SmolLM2-135M:
fp32, bf16, int8 (per token and head scales), fp8 e4m3 at vLLM's default scale 1.0, and fp8 at
per-layer scales calibrated by ``quantize.kv_cache_fp8`` (WikiText-2 valid, as the recipe
``recipes/smollm2-w4g128-rtn-fp8kv.yaml`` does). The protocol is ``compress.eval.kv_quality``:
the first WINDOWS WikiText-2 test windows of 512 tokens, every key and value but each window's
first written to pages and read back, against fp32 pages; matmuls in fp32.

    python scripts/bench_kv_cache.py --out out/bench-kv-cache

Writes results.json and results.md to --out (about 3 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from compress.eval.report import environment


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("out/bench-kv-cache"))
    p.add_argument("--windows", type=int, default=8, help="WikiText-2 test windows scored")
    p.add_argument("--request-tokens", type=int, default=192, help="for requests per GiB")
    p.add_argument("--calibration-samples", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    import compress
    from compress.calibration import calibration_sequences
    from compress.core.registry import CompressionState, run_passes
    from compress.data import resolve_text_path
    from compress.eval.kv_quality import kv_cache_quality
    from compress.quant.kv_cache import KvCacheFp8Config
    from compress.quant.kv_scales import kv_cache_scales

    loaded = compress.load("smollm2-135m")
    text = resolve_text_path("wikitext2").read_text()
    settings = dict(limit=args.windows, request_tokens=args.request_tokens)
    started = time.perf_counter()
    plain = kv_cache_quality(loaded.model, loaded.tokenizer, text,
                             kv_dtypes=("bfloat16", "int8", "fp8"), **settings)  # fmt: skip
    ids = calibration_sequences("wikitext2-valid", loaded.tokenizer,
                                num_samples=args.calibration_samples, seq_len=512, seed=0)
    state = CompressionState(calibration_batches=lambda: list(ids.split(1)), progress=False)
    run_passes(loaded.model, [KvCacheFp8Config()], state)
    scales = kv_cache_scales(loaded.model)
    calibrated = kv_cache_quality(loaded.model, loaded.tokenizer, text, kv_dtypes=("fp8",),
                                  **settings)  # fmt: skip
    rows = dict(plain["dtypes"])
    rows["fp8 (scales 1.0)"] = rows.pop("fp8")
    rows["fp8 (calibrated scales)"] = calibrated["dtypes"]["fp8"]
    results = {
        "environment": environment(),
        "command": "python scripts/bench_kv_cache.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "protocol": {k: plain[k] for k in ("windows", "scored_tokens", "context_length",
                                           "request_tokens")},  # fmt: skip
        "calibration": f"wikitext2-valid, {args.calibration_samples} x 512 tokens, seed 0",
        "kv_scales": scales,
        "kv_amax_max": [max(a for a, _ in state.reports[-1].metrics["kv_amax"].values()),
                        max(b for _, b in state.reports[-1].metrics["kv_amax"].values())],
        "dtypes": rows,
        "seconds": round(time.perf_counter() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    (args.out / "results.md").write_text(markdown(results))
    print(markdown(results))


def markdown(results: dict) -> str:
    env, proto = results["environment"], results["protocol"]
    k_max, v_max = results["kv_amax_max"]
    lines = [
        f"KV-cache storage on SmolLM2-135M (fp32 matmuls), first {proto['windows']} WikiText-2 "
        f"test windows of {proto['context_length']} tokens ({proto['scored_tokens']} scored), "
        f"against fp32 pages. {env['cpu']}, torch {env['torch']}, {env['date']}. "
        f"`{results['command']}`",
        "",
        "| KV pages | ppl | delta ppl | KL (nats/token) | bytes/token | "
        f"requests of {proto['request_tokens']} tokens per GiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, d in results["dtypes"].items():
        lines.append(f"| {name} | {d['ppl']:.3f} | {d['delta_ppl_pct']:+.3f}% | {d['kl']:.5f} | "
                     f"{d['bytes_per_token']} | {d['requests_per_gib']} |")  # fmt: skip
    lines += ["", f"Calibration: {results['calibration']}; largest |key| seen {k_max:.1f}, "
              f"largest |value| {v_max:.1f} (fp8 e4m3's largest value is 448)."]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
