"""The calibrated passes' per-layer CPU work at a real model's widths, each part through the
torch reference and through its faster replacement, interleaved round by round in one run:

- GPTQ: ``gptq_quantize`` of each distinct projection of a decoder layer (``walk="torch"``
  against ``walk="cpu"``, ``compress.kernels.cpu_gptq``; the Hessian factorization and the lazy
  block updates are the same in both);
- an int4 projection's float32 weight (``QuantLinear.dequantized_weight``: the reference unpack
  and dequantize against the C++ pass), which every calibration forward through a quantized
  layer computes with, once per sample;
- AWQ: one evaluation of its scale search's error ``tr(D H D^T)`` for each consumer group
  (``awq._output_error_reference`` against the blocked ``awq._output_error``), which the search
  repeats ``n_grid + 1`` times per group.

Per part: median seconds (min-max) and the ratio; the layer's totals weight each projection by
how many the layer has. Random weights and Hessians (a Hessian from random activations): the
time does not depend on the values. JSON + markdown:

    python scripts/bench_calibrated_layer.py --shape 7b --reps 3 --out out/bench_calibrated_layer_7b
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode_pass import write_table  # noqa: E402

from compress.kernels import cpu_gptq  # noqa: E402
from compress.quant import awq  # noqa: E402
from compress.quant import linear as quant_linear  # noqa: E402
from compress.quant.gptq import GptqConfig, gptq_quantize  # noqa: E402
from compress.quant.linear import QuantLinear, WeightScheme  # noqa: E402
from compress.testing import LLAMA_SHAPES  # noqa: E402


def projections(shape: str) -> list[tuple[str, int, int, int]]:
    """(names, N, K, how many in a layer) of a Llama-shaped layer's distinct projections."""
    c = LLAMA_SHAPES[shape]
    h, inter = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    rows = [("q_proj, o_proj", h, h, 2), ("k_proj, v_proj", kv, h, 2),
            ("gate_proj, up_proj", inter, h, 2), ("down_proj", h, inter, 1)]
    merged: dict[tuple[int, int], list] = {}
    for name, n, k, count in rows:  # Llama-2-7B's k/v are as wide as q: one row of 4
        if (n, k) in merged:
            merged[(n, k)][0] += ", " + name
            merged[(n, k)][3] += count
        else:
            merged[(n, k)] = [name, n, k, count]
    return [tuple(v) for v in merged.values()]


def consumer_groups(shape: str) -> list[tuple[str, int, int]]:
    """(names, N, K) of the groups AWQ scales in a Llama-shaped layer: consumers of one input."""
    c = LLAMA_SHAPES[shape]
    h, inter = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    return [("q/k/v_proj", h + 2 * kv, h), ("o_proj", h, h), ("gate/up_proj", 2 * inter, h),
            ("down_proj", h, inter)]


def awq_errors(args) -> list[dict]:
    """One error evaluation per consumer group, reference against blocked; the layer's total
    is ``n_grid + 1`` evaluations of each group."""
    rows, totals = [], {"reference": 0.0, "blocked": 0.0}
    for name, n, k in consumer_groups(args.shape):
        g = torch.Generator().manual_seed(0)
        d = torch.randn(n, k, generator=g) * 1e-3
        x = torch.randn(args.tokens, k, generator=g)
        h = x.T @ x / args.tokens
        del x
        times: dict[str, list[float]] = {key: [] for key in totals}
        for _ in range(args.reps):
            times["reference"].append(timed(awq._output_error_reference, d, h))
            times["blocked"].append(timed(awq._output_error, d, h))
        med = {key: statistics.median(v) for key, v in times.items()}
        for key in totals:
            totals[key] += med[key] * (args.n_grid + 1)
        rows.append({"consumer group": f"{name} ({n} x {k})",
                     **{f"error, {key} s": f"{med[key]:.3f} ({min(v):.3f}-{max(v):.3f})"
                        for key, v in times.items()},
                     "speed-up": f"{med['reference'] / med['blocked']:.2f}x"})
    rows.append({"consumer group": f"**one {args.shape} layer's search** "
                                   f"({args.n_grid + 1} evaluations a group)",
                 "error, reference s": f"{totals['reference']:.1f}",
                 "error, blocked s": f"{totals['blocked']:.1f}",
                 "speed-up": f"{totals['reference'] / totals['blocked']:.2f}x"})
    return rows


def timed(fn, *args, **kwargs) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def gptq_parts(args) -> list[dict]:
    """GPTQ and the int4 weight per distinct projection, and the layer's totals."""
    scheme, cfg = WeightScheme(4, args.group, symmetric=False), GptqConfig()
    rows, totals = [], {"walk torch": 0.0, "walk cpu": 0.0, "deq torch": 0.0, "deq cpu": 0.0}
    fast_path = quant_linear._exact_int4_on
    for name, n, k, count in projections(args.shape):
        g = torch.Generator().manual_seed(0)
        w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
        x = torch.randn(args.tokens, k, generator=g)
        h = x.T @ x / args.tokens
        del x
        layer = QuantLinear(k, n, scheme, bias=False)
        times: dict[str, list[float]] = {key: [] for key in totals}
        for _ in range(args.reps):
            for walk in ("torch", "cpu"):
                times[f"walk {walk}"].append(timed(gptq_quantize, w, h, scheme, cfg, walk=walk))
            w_q, scales, zeros, _ = gptq_quantize(w, h, scheme, cfg)
            layer.set_quantized(w_q, scales, zeros)
            for path, on in (("torch", lambda device: False), ("cpu", fast_path)):
                quant_linear._exact_int4_on = on
                try:
                    times[f"deq {path}"].append(timed(layer.dequantized_weight))
                finally:
                    quant_linear._exact_int4_on = fast_path
        med = {key: statistics.median(v) for key, v in times.items()}
        for key in totals:
            scale = count * (args.samples if key.startswith("deq") else 1)
            totals[key] += med[key] * scale
        spread = {key: f"{min(v):.3f}-{max(v):.3f}" for key, v in times.items()}
        rows.append({
            "projections": f"{name} ({n} x {k}, x{count})",
            "GPTQ, torch walk s": f"{med['walk torch']:.2f} ({spread['walk torch']})",
            "GPTQ, C++ walk s": f"{med['walk cpu']:.2f} ({spread['walk cpu']})",
            "GPTQ speed-up": f"{med['walk torch'] / med['walk cpu']:.2f}x",
            "int4 weight, reference s": f"{med['deq torch']:.3f} ({spread['deq torch']})",
            "int4 weight, C++ s": f"{med['deq cpu']:.3f} ({spread['deq cpu']})",
            "weight speed-up": f"{med['deq torch'] / med['deq cpu']:.1f}x",
        })
    rows.append({
        "projections": f"**one {args.shape} layer** (int4 weights x {args.samples} samples)",
        "GPTQ, torch walk s": f"{totals['walk torch']:.1f}",
        "GPTQ, C++ walk s": f"{totals['walk cpu']:.1f}",
        "GPTQ speed-up": f"{totals['walk torch'] / totals['walk cpu']:.2f}x",
        "int4 weight, reference s": f"{totals['deq torch']:.1f}",
        "int4 weight, C++ s": f"{totals['deq cpu']:.1f}",
        "weight speed-up": f"{totals['deq torch'] / totals['deq cpu']:.1f}x",
    })
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="7b", choices=sorted(LLAMA_SHAPES))
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tokens", type=int, default=2048, help="rows of the random activations")
    p.add_argument("--samples", type=int, default=16,
                   help="calibration samples: forwards through each quantized layer")
    p.add_argument("--parts", nargs="+", choices=["gptq", "awq"], default=["gptq", "awq"])
    p.add_argument("--n-grid", type=int, default=20, help="AWQ's grid: n_grid + 1 evaluations")
    p.add_argument("--out", default="out/bench_calibrated_layer")
    args = p.parse_args()
    reason = cpu_gptq.unavailable_reason(torch.device("cpu"))
    if reason is not None:
        sys.exit(f"the C++ ops are unavailable here: {reason}")
    if "gptq" in args.parts:
        rows = gptq_parts(args)
        write_table(Path(args.out), "bench_calibrated_layer", rows, [(c, c) for c in rows[0]],
                    threads=torch.get_num_threads(),
                    header=f"; shape {args.shape}, W4 g{args.group} asymmetric, "
                           f"{args.reps} rounds, median (min-max)")
    if "awq" in args.parts:
        awq_rows = awq_errors(args)
        write_table(Path(args.out), "bench_calibrated_layer_awq", awq_rows,
                    [(c, c) for c in awq_rows[0]], threads=torch.get_num_threads(),
                    header=f"; shape {args.shape}, AWQ's search error, {args.reps} rounds, "
                           "median (min-max)")


if __name__ == "__main__":
    main()
