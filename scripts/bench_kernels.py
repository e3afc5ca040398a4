"""Benchmark the Triton int4/int8 kernels against torch on one CUDA GPU; not a test.

    python scripts/bench_kernels.py [--out DIR] [--m 1 16 512] [--shapes 4096x4096] [--e2e]

For each weight shape N x K and batch M: median time (triton.testing.do_bench), TFLOP/s, GB/s,
% of the measured copy bandwidth and bf16 matmul peak, and the speedup over torch bf16 (cuBLAS),
``torch._weight_int4pack_mm`` and ``torch._int_mm``. Writes bench_kernels.json (rewritten after
every shape, so a timeout keeps what was measured) and bench_kernels.md into --out ($OUT or
./out). --e2e adds SmolLM2-135M greedy decode tokens/s on the compress runtime, W4 g128 on
Triton vs bf16.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib

import torch

LLAMA = ["4096x4096", "14336x4096", "4096x14336", "8192x8192"]  # N x K (out x in)
SMOLLM2 = ["576x576", "1536x576", "576x1536", "192x576"]
M_VALUES = [1, 2, 4, 8, 16, 32, 64, 128, 512, 2048, 8192]
log = logging.getLogger("bench_kernels")


def bench_shapes(shapes, m_values, peaks, out_dir: pathlib.Path) -> list[dict]:
    from compress.kernels import triton_ops

    results = []
    for shape in shapes:
        n, k = map(int, shape.split("x"))
        for m in m_values:
            group = 128 if k % 128 == 0 else 64  # "g128" is g64 where 128 does not divide K
            rows = triton_ops.benchmark_linear(m, n, k, group_size=group)
            base = {r["method"]: r["ms"] for r in rows}
            for r in rows:
                if r["ms"] is not None:
                    r["pct_copy_bw"] = 100 * r["gbs"] / peaks["copy_gbs"]
                    r["pct_bf16_peak"] = 100 * r["tflops"] / peaks["bf16_tflops"]
                    for ref in ("torch_bf16", "torch_int4pack", "torch_int_mm"):
                        if base.get(ref):
                            r[f"speedup_vs_{ref}"] = base[ref] / r["ms"]
                results.append({"n": n, "k": k, "m": m, "group_size": group, **r})
            times = ", ".join(f"{r['method']} {r['ms']:.4f} ms" for r in rows if r["ms"])
            log.info("N=%d K=%d M=%d: %s", n, k, m, times)
        _write(out_dir, {"peaks": peaks, "results": results})
    return results


def decode_tokens_per_s(
    new_tokens: int = 128, config_path: pathlib.Path | None = None, device: str = "cuda"
) -> dict:
    """SmolLM2-135M greedy decode on the compress runtime (``eval.latency.decode_speed``, the
    engine ``compress generate`` serves), bf16 vs W4 g128 QuantLinear on Triton.

    With ``config_path`` (a config.json) the model is built from that config with random weights
    (seed 0) instead of loading the embedded checkpoint: decode speed depends on the shapes, not
    the values, and the GPU machine cannot receive the 270 MB of weights. The report says which.
    """
    from compress.eval.latency import decode_speed
    from compress.quant.linear import QuantLinear, WeightScheme

    if config_path is None:
        from compress.io.load import load_model

        model, weights = load_model("smollm2-135m").model, "SmolLM2-135M-Instruct (embedded GGUF)"
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        config = AutoConfig.from_pretrained(config_path.parent if config_path.name == "config.json"
                                            else config_path)  # fmt: skip
        model = AutoModelForCausalLM.from_config(config)
        weights = f"random, seed 0, config {config_path.name} ({config.model_type})"
    model = model.to(device, torch.bfloat16).eval()
    prompt = torch.randint(0, 1000, (16,)).tolist()
    result = {"weights": weights, "bf16": decode_speed(model, prompt, new_tokens, repeats=3)}
    backend = "triton" if device == "cuda" else "auto"  # "auto": a CPU dry run of this script
    for name, linear in list(model.named_modules()):
        if isinstance(linear, torch.nn.Linear) and "lm_head" not in name:
            parent, _, child = name.rpartition(".")
            # g128, or g64 where 128 does not divide K (SmolLM2's 576), as in docs/results.md
            group = 128 if linear.in_features % 128 == 0 else 64
            scheme = WeightScheme(n_bits=4, group_size=group)
            q = QuantLinear.from_linear(linear, scheme, backend=backend)
            setattr(model.get_submodule(parent), child, q)
    result["w4_triton"] = decode_speed(model, prompt, new_tokens, repeats=3)
    return result


def _write(out_dir: pathlib.Path, report: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_kernels.json").write_text(json.dumps(report, indent=1))
    lines = [
        f"peaks: {report['peaks']}",
        "",
        "| N | K | M | method | ms | TFLOP/s | GB/s | "
        "% copy BW | % bf16 peak | x bf16 | x int4pack | x int_mm |",
        "|" + "---|" * 12,
    ]
    for r in report["results"]:
        if r["ms"] is None:
            lines.append(f"| {r['n']} | {r['k']} | {r['m']} | {r['method']} | n/a: {r['reason']} |"
                         + " |" * 7)  # fmt: skip
            continue
        cols = [r["ms"], r["tflops"], r["gbs"], r["pct_copy_bw"], r["pct_bf16_peak"]] + [
            r.get(f"speedup_vs_{ref}") for ref in ("torch_bf16", "torch_int4pack", "torch_int_mm")
        ]
        cells = " | ".join("-" if c is None else f"{c:.4g}" for c in cols)
        lines.append(f"| {r['n']} | {r['k']} | {r['m']} | {r['method']} | {cells} |")
    if "decode" in report:
        lines += ["", f"SmolLM2-135M decode: {report['decode']}"]
    (out_dir / "bench_kernels.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = pathlib.Path(os.environ.get("OUT", "out"))
    parser.add_argument(
        "--out", type=pathlib.Path, default=default_out, help="default: $OUT or ./out"
    )
    parser.add_argument(
        "--shapes", nargs="*", default=LLAMA + SMOLLM2, help="NxK weight shapes (none: only --e2e)"
    )
    parser.add_argument("--m", nargs="+", type=int, default=M_VALUES, help="batch sizes M")
    parser.add_argument("--e2e", action="store_true", help="also time SmolLM2 decode")
    parser.add_argument(
        "--config", type=pathlib.Path, help="--e2e on random weights built from this config.json"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA GPU")
    from compress.kernels import triton_ops

    peaks = triton_ops.measure_peaks(torch.device("cuda"))
    log.info("%s: %s", torch.cuda.get_device_name(), peaks)
    results = bench_shapes(args.shapes, args.m, peaks, args.out)
    report = {"gpu": torch.cuda.get_device_name(), "peaks": peaks, "results": results}
    if args.e2e:
        report["decode"] = decode_tokens_per_s(config_path=args.config)
        log.info("decode: %s", report["decode"])
    _write(args.out, report)


if __name__ == "__main__":
    main()
