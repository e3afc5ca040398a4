"""Per-layer CPU decode matmuls, one run, interleaved: torch fp32 and bf16 F.linear, torch's
native int8 and int4 weight-only kernels, and our integer-dot Q4 x Q8 and Q8 x Q8 kernels
(compress/kernels/cpu_q8.py) at every ISA level this CPU has (avx2, avxvnni, avx512vnni).

For each weight shape N x K (out x in) and rows M: median microseconds (min-max over rounds),
GB/s of weight bytes read, and speed vs torch's int4 kernel. Shapes: SmolLM2-135M's and a
TinyLlama-1.1B layer's; int4 at group 64 (32 where noted). JSON + markdown:

    python scripts/bench_cpu_kernels.py --threads 1 2 --m 1 4 --out out/cpu_kernels
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from compress.eval.report import environment, markdown_table
from compress.kernels import cpu_native, cpu_q8
from compress.quant.linear import QuantLinear, WeightScheme

SHAPES = ["576x576", "192x576", "1536x576", "576x1536", "49152x576", "2048x2048", "5632x2048"]


def variants(n: int, k: int, group: int) -> dict[str, tuple]:
    """name -> (fn(x), weight bytes read per call)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(k, n, bias=False)
    w32, w16 = linear.weight.detach(), linear.weight.detach().to(torch.bfloat16)
    q4 = QuantLinear.from_linear(linear, WeightScheme(4, group, True))
    q8 = QuantLinear.from_linear(linear, WeightScheme(8, k, True))
    native4 = cpu_native.prepack_int4(
        q4.weight_packed, q4.weight_scale, None, group_size=group, k=k
    )
    ours4 = cpu_q8.prepack_int4(q4.weight_packed, q4.weight_scale, None, group_size=group, k=k)
    ours8 = cpu_q8.prepack_int8(q8.weight, q8.weight_scale, None, group_size=k)
    int8_w, int8_s = q8.weight.contiguous(), q8.weight_scale[:, 0].to(torch.bfloat16)
    g = k // group
    out = {
        "fp32 F.linear": (lambda x: F.linear(x, w32), 4 * n * k),
        "bf16 F.linear": (lambda x: F.linear(x.to(torch.bfloat16), w16), 2 * n * k),
        "torch int8": (
            lambda x: torch._weight_int8pack_mm(x.to(torch.bfloat16), int8_w, int8_s),
            n * k + 2 * n,
        ),
        "torch int4": (
            lambda x: torch._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), native4.packed, group, native4.scale_and_zero
            ),
            n * k // 2 + 4 * n * g,
        ),
    }
    for isa in cpu_q8.built_levels():
        out[f"ours Q4xQ8 {isa}"] = (
            lambda x, isa=isa: cpu_q8.linear_q8(x, ours4, isa),
            n * k // 2 + 4 * n * g,
        )
        out[f"ours Q8xQ8 {isa}"] = (
            lambda x, isa=isa: cpu_q8.linear_q8(x, ours8, isa),
            n * k + 4 * n,
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="*", default=SHAPES)
    p.add_argument("--m", nargs="*", type=int, default=[1, 4])
    p.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default="out/cpu_kernels")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not cpu_q8.built_levels():
        print(f"our kernels unavailable: {cpu_q8.unavailable_reason()}")
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for shape in args.shapes:
            n, k = (int(v) for v in shape.split("x"))
            fns = variants(n, k, args.group)
            for m in args.m:
                x = torch.randn(m, k)
                calls = max(3, int(2e8 // (n * k)))  # ~100 ms of work per sample
                samples = {name: [] for name in fns}
                for _ in range(args.rounds):  # interleaved rounds
                    for name, (fn, _) in fns.items():
                        fn(x)
                        start = time.perf_counter()
                        for _ in range(calls):
                            fn(x)
                        samples[name].append((time.perf_counter() - start) / calls * 1e6)
                base = statistics.median(samples["torch int4"])
                for name, us in samples.items():
                    med = statistics.median(us)
                    rows.append(
                        {
                            "threads": threads,
                            "shape": shape,
                            "m": m,
                            "kernel": name,
                            "us": med,
                            "us_range": f"{min(us):.0f}-{max(us):.0f}",
                            "gb_s": fns[name][1] / med / 1e3,
                            "vs_torch_int4": base / med,
                        }
                    )
                print(rows[-1], flush=True)
    columns = [
        ("threads", "threads"),
        ("shape", "N x K"),
        ("m", "M"),
        ("kernel", "kernel"),
        ("us", "µs (median)"),
        ("us_range", "min-max"),
        ("gb_s", "weight GB/s"),
        ("vs_torch_int4", "speed vs torch int4"),
    ]
    md = markdown_table(rows, columns) + (
        f"\n\nint4 group {args.group} (symmetric), int8 per channel; medians of {args.rounds} "
        f"interleaved rounds of ~100 ms each; torch {torch.__version__}."
    )
    (out / "cpu_kernels.json").write_text(
        json.dumps({"environment": environment(), "rows": rows}, indent=1)
    )
    (out / "cpu_kernels.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
