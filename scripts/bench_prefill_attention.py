"""A prompt's causal attention: our ``causal_prefill_attention`` (csrc/prefill_attention.cpp)
against ATen's flash attention (SDPA with ``is_causal``, the form the runtime used before it),
in one process, rounds alternated, medians with min-max, plus the largest difference between
the two. ``--offsets``: chunks whose queries follow that many earlier keys (a prompt's later
chunk, or its rest after a prefix-cache hit), against SDPA with the bottom-right causal mask
(what the runtime passed such chunks before the kernel took them). JSON + markdown:

    python scripts/bench_prefill_attention.py --out out/prefill_attention
    python scripts/bench_prefill_attention.py --shapes smollm2 1b --tokens 256 \
        --offsets 256 768 --out out/prefill_attention_chunks

Heads: SmolLM2's (9 of 64 over 3), the 1.1B shape's (32 of 64 over 4), a 7B's (32 of 128 over
32). ``--isa`` picks our build level (default: the selected one); whether the runtime takes the
kernel at a level is ``cpu_attention.PREFILL_ISAS``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from compress.eval.report import environment
from compress.kernels import cpu_attention, cpu_q8

SHAPES = {  # heads, kv heads, head dim
    "smollm2": (9, 3, 64), "1b": (32, 4, 64), "7b": (32, 32, 128), "8b": (32, 8, 128),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--offsets", type=int, nargs="+", default=[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--isa", default=None)
    p.add_argument("--out", default="out/prefill_attention")
    args = p.parse_args()
    isa = args.isa or cpu_q8.selected_isa()
    if cpu_q8.unavailable_reason() is not None:
        raise SystemExit(f"our kernels do not run here: {cpu_q8.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    rows = []
    for shape in args.shapes:
        h, hkv, d = SHAPES[shape]
        for t, offset in ((t, o) for t in args.tokens for o in args.offsets):
            g = torch.Generator().manual_seed(t + offset)
            length = offset + t
            q = torch.randn(1, h, t, d, generator=g)
            k, v = (torch.randn(1, hkv, length, d, generator=g) for _ in range(2))
            scale = d**-0.5
            # None: SDPA's own causal form (offset 0); else query i over keys 0 .. offset + i
            mask = torch.ones(t, length, dtype=torch.bool).tril(offset) if offset else None
            sides = {
                "ours": lambda q=q, k=k, v=v, s=scale, o=offset: (
                    cpu_attention.causal_prefill_attention(q[0], k[0], v[0], s, o, isa=isa)),
                "sdpa": lambda q=q, k=k, v=v, s=scale, m=mask, gqa=h != hkv: (
                    F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=m is None,
                                                   scale=s, enable_gqa=gqa)),
            }  # fmt: skip
            ours = sides["ours"]()
            ref = sides["sdpa"]()[0].transpose(0, 1).reshape(t, h * d)
            times: dict[str, list[float]] = {name: [] for name in sides}
            for r in range(args.rounds):
                order = list(sides.items())
                for name, run in order if r % 2 == 0 else order[::-1]:
                    start = time.perf_counter()
                    run()
                    times[name].append((time.perf_counter() - start) * 1e3)
            o, s = statistics.median(times["ours"]), statistics.median(times["sdpa"])
            rows.append({"shape": shape, "heads": h, "kv_heads": hkv, "head_dim": d, "tokens": t,
                         "offset": offset,
                         "ours_ms": o, "sdpa_ms": s, "speedup": s / o,
                         "ours_range": [min(times["ours"]), max(times["ours"])],
                         "sdpa_range": [min(times["sdpa"]), max(times["sdpa"])],
                         "max_abs_diff": (ours - ref).abs().max().item()})  # fmt: skip
            print(rows[-1], flush=True)
    env = environment()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_attention.json").write_text(
        json.dumps({"isa": isa, "threads": args.threads, "environment": env, "rows": rows},
                   indent=2))  # fmt: skip
    lines = [
        f"{env.get('cpu', '')}; {args.threads} threads; ours at {isa}; torch {env.get('torch')}",
        "",
        "| heads (kv) x dim | tokens | after | ours ms | SDPA causal ms | speedup "
        "| max abs diff |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']}: {r['heads']} ({r['kv_heads']}) x {r['head_dim']} | {r['tokens']} | "
            f"{r['offset']} | "
            f"{r['ours_ms']:.2f} ({r['ours_range'][0]:.2f}-{r['ours_range'][1]:.2f}) | "
            f"{r['sdpa_ms']:.2f} ({r['sdpa_range'][0]:.2f}-{r['sdpa_range'][1]:.2f}) | "
            f"{r['speedup']:.2f}x | {r['max_abs_diff']:.1e} |"
        )
    lines += ["", f"Medians (min-max) of {args.rounds} alternated rounds."]
    (out / "prefill_attention.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
