"""One decode step's worth of quantized linears, each layer its own weight (so they stream from
memory as in a real decode step, not from cache as a one-layer loop would): SmolLM2-135M's
30 layers x 7 projections (576x576, 2 x 192x576, 576x576, 2 x 1536x576, 576x1536), one row;
with --shape 1.1b TinyLlama-1.1B's 22 layers (2048x2048, 2 x 256x2048, 2048x2048, 2 x 5632x2048,
2048x5632) and an int8 head of 49152x2048 (SmolLM2's vocab, as bench_e2e's synthetic 1.1B).

Kernels, called as the runtime's compiled step calls them (the ops, no Python wrappers),
interleaved round by round in one run: torch's int4 / int8 weight-only kernels (bf16
activations) and ours (compress/kernels/cpu_q8.py, int8-rounded activations) at every ISA level
this CPU has; int4 symmetric at --group, int8 per channel. Per kernel: median ms per pass
(min-max), weight GB/s (codes + scales), that as a share of the read bandwidth probed at the
start (MBU), speed vs torch's kernel of the same format. The int8 head is timed the same way.
JSON + markdown:

    python scripts/bench_decode_pass.py --rounds 15 --out out/decode_pass
    python scripts/bench_decode_pass.py --shape 1.1b --group 128 --rounds 9 --out out/decode_pass_1b
    python scripts/bench_decode_pass.py --shape 1.1b --group 128 --hot 20 --out out/decode_1b_hot
    python scripts/bench_decode_pass.py --stacked --rounds 15 --out out/decode_pass_stacked
    python scripts/bench_decode_pass.py --stacked --tiles --rounds 15 --out out/decode_pass_tiles

``--stacked`` adds our kernels with each layer's q/k/v and gate/up stacked into one call each,
as the runtime calls them (4 calls per layer instead of 7); ``--tiles`` our int4 in the
column-tile layout at the levels that have it (``cpu_q8.TILE_WIDTHS``), stacked the same way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from compress.eval.hardware import memory_bandwidth
from compress.eval.report import environment, markdown_table
from compress.kernels import cpu_native, cpu_q8
from compress.quant.linear import QuantLinear, WeightScheme

# (out_features, in_features) of one decoder layer's q, k, v, o, gate, up, down; layer count; head
SHAPES = {
    "smollm2": (
        [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)],
        30,
        (49152, 576),
    ),
    "1.1b": (
        [(2048, 2048), (256, 2048), (256, 2048), (2048, 2048), (5632, 2048), (5632, 2048),
         (2048, 5632)],
        22,
        (49152, 2048),
    ),
}  # fmt: skip


def layers(shapes: list[tuple[int, int]], count: int, bits: int, group: int) -> list[QuantLinear]:
    torch.manual_seed(0)
    scheme = WeightScheme(bits, group if bits == 4 else None, True)
    return [
        QuantLinear.from_linear(torch.nn.Linear(k, n, bias=False), scheme)
        for _ in range(count)
        for n, k in shapes
    ]


def torch_pass(qs: list[QuantLinear], bits: int):
    """fn() running every layer through torch's native kernel, and its weight bytes."""
    if bits == 4:
        packed = [
            cpu_native.prepack_int4(q.weight_packed, q.weight_scale, None,
                                    group_size=q.group_size, k=q.in_features)
            for q in qs
        ]  # fmt: skip
        calls = [
            (q.in_features, lambda x, w=w: torch._weight_int4pack_mm_for_cpu(
                x, w.packed, w.group_size, w.scale_and_zero))
            for q, w in zip(qs, packed, strict=True)
        ]  # fmt: skip
        size = sum(w.packed.numel() + 2 * w.scale_and_zero.numel() for w in packed)
    else:
        held = [
            (cpu_native.aligned(q.weight), cpu_native.aligned(q.weight_scale[:, 0].bfloat16()))
            for q in qs
        ]
        calls = [
            (q.in_features, lambda x, w=w, s=s: torch._weight_int8pack_mm(x, w, s))
            for q, (w, s) in zip(qs, held, strict=True)
        ]
        size = sum(w.numel() + 2 * s.numel() for w, s in held)
    return calls, size


def prepack(qs: list[QuantLinear]) -> list[cpu_q8.Q8Weight]:
    return [
        cpu_q8.prepack_int4(q.weight_packed, q.weight_scale, None, group_size=q.group_size,
                            k=q.in_features)
        if q.kind == "int4"
        else cpu_q8.prepack_int8(q.weight, q.weight_scale, None, group_size=q.group_size)
        for q in qs
    ]  # fmt: skip


# per decoder layer (q, k, v, o, gate, up, down): the projections of one input that the runtime
# stacks into one call of our kernels (compress.runtime.layers._IntLinear.stacked)
STACKED = ((0, 1, 2), (3,), (4, 5), (6,))


def stack(weights: list[cpu_q8.Q8Weight]) -> list[cpu_q8.Q8Weight]:
    """Per decoder layer of 7 weights, the 4 of STACKED (their rows concatenated)."""
    return [
        cpu_q8.stack([weights[start + i] for i in parts])
        for start in range(0, len(weights), 7)
        for parts in STACKED
    ]


def our_pass(qs: list[QuantLinear], isa: str, stacked: bool = False, tiles: bool = False):
    weights = prepack(qs)
    weights = stack(weights) if stacked else weights
    if tiles:  # int4 in the level's column-tile layout, as the runtime holds it there
        weights = [cpu_q8.to_tiles(w, cpu_q8.tile_width(isa)) for w in weights]
    op = cpu_q8.ops(isa)

    def kernel(w: cpu_q8.Q8Weight):
        if w.tiles:
            return op.int4_linear_q8_tiles
        return op.int4_linear_q8 if w.bits == 4 else op.int8_linear_q8

    calls = [
        (w.k, lambda x, w=w, f=f: f(x, w.codes, w.scales, w.offsets, w.group_size))
        for w, f in ((w, kernel(w)) for w in weights)
    ]  # fmt: skip
    return calls, sum(w.codes.numel() + 4 * w.scales.numel() for w in weights)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument(
        "--hot",
        type=int,
        default=0,
        metavar="N",
        help="each layer called N times in a row, one decoder layer only: its weights then come "
        "from cache, so the GB/s is what the kernel computes, not what memory delivers",
    )
    p.add_argument(
        "--stacked",
        action="store_true",
        help="also time our kernels with each layer's q/k/v and gate/up stacked into one call "
        "each, as the runtime runs them",
    )
    p.add_argument(
        "--tiles",
        action="store_true",
        help="also time int4 in the column-tile layout (csrc/q8_tiles.cpp) at the levels that "
        "have it, q/k/v and gate/up stacked, as the runtime holds them there",
    )
    p.add_argument("--out", default="out/decode_pass")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = memory_bandwidth()["bytes_per_s"]  # the product's probe, as bench_e2e's
    levels = cpu_q8.built_levels()
    layer, count, (vocab, hidden) = SHAPES[args.shape]
    repeats = max(args.hot, 1)
    count = 1 if args.hot else count
    rows = []
    for what, shapes, n_layers, bits in (
        (f"{count} layers int4 g{args.group}", layer, count, 4),
        (f"{count} layers int8", layer, count, 8),
        (f"int8 head {vocab}x{hidden}", [(vocab, hidden)], 1, 8),
    ):
        qs = layers(shapes, n_layers, bits, args.group)
        kernels = {"torch": torch_pass(qs, bits)}
        kernels |= {f"ours {isa}": our_pass(qs, isa) for isa in levels}
        if args.stacked and len(shapes) == 7:
            kernels |= {f"ours {isa}, q/k/v and gate/up stacked": our_pass(qs, isa, True)
                        for isa in levels}  # fmt: skip
        if args.tiles and bits == 4:
            tiled = [isa for isa in levels if cpu_q8.tile_width(isa) is not None]
            kernels |= {f"ours {isa}, column tiles{', stacked' if len(shapes) == 7 else ''}":
                        our_pass(qs, isa, len(shapes) == 7, tiles=True)
                        for isa in tiled}  # fmt: skip
        # the ops themselves, as the runtime's compiled step calls them: torch's take bf16
        # activations (aligned fresh tensors), ours fp32
        xs = {k: torch.randn(1, k) for k in {q.in_features for q in qs}}
        xs16 = {k: x.bfloat16() for k, x in xs.items()}
        samples = {name: [] for name in kernels}
        for _ in range(args.rounds + 1):  # the first round warms up
            for name, (calls, _) in kernels.items():
                start = time.perf_counter()
                inputs = xs16 if name == "torch" else xs
                for k, fn in calls:
                    for _ in range(repeats):
                        fn(inputs[k])
                samples[name].append(time.perf_counter() - start)
        base = statistics.median(samples["torch"][1:])
        for name, (_, one_pass) in kernels.items():
            size = one_pass * repeats
            ms = [1e3 * s for s in samples[name][1:]]
            med = statistics.median(ms)
            spread = f"{min(ms):.2f}-{max(ms):.2f}"
            rows.append(dict(work=what, kernel=name, ms=med, ms_range=spread,
                             gb_s=size / med / 1e6, mbu=size / (med / 1e3) / bandwidth,
                             vs_torch=base * 1e3 / med))  # fmt: skip
            print(rows[-1], flush=True)
    columns = [("work", "work"), ("kernel", "kernel"), ("ms", "ms per pass (median)"),
               ("ms_range", "min-max"), ("gb_s", "weight GB/s"), ("mbu", "MBU"),
               ("vs_torch", "vs torch")]  # fmt: skip
    write_table(
        Path(args.out),
        "decode_pass",
        rows,
        columns,
        threads=args.threads,
        header=f"; read bandwidth probed {bandwidth / 1e9:.1f} GB/s",
        footer=f"{args.shape} shapes; one row of activations; "
        + (f"each layer {args.hot} times in a row (from cache); " if args.hot else "")
        + f"medians of {args.rounds} "
        "interleaved rounds; MBU = weight bytes per pass / median time / probed "
        "bandwidth.",
    )


def write_table(
    out: Path,
    stem: str,
    rows: list[dict],
    columns,
    *,
    threads: int,
    header: str = "",
    footer: str = "",
) -> None:
    """<out>/<stem>.json (rows + environment) and .md (the machine line, the table, a footer),
    printed too; the machine line names the CPU, its flags and any ISA caps."""
    env = environment()
    caps = env["isa_limits"] or "none"
    md = (
        f"{env['cpu']}; flags {' '.join(env['cpu_flags'])}; ISA caps {caps}; torch "
        f"{env['torch']}; {threads} threads; {env['date']}{header}\n\n"
        + markdown_table(rows, columns)
        + f"\n\n{footer}"
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    (out / f"{stem}.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
