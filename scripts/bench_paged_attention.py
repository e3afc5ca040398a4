"""Decode attention in the paged pool (``paged_decode_attention``, csrc/paged_attention.cpp), one
layer's call: B rows of L keys each, H query heads over Hkv kv heads, head_dim 64, blocks of 16
scattered over a 4096-block pool (which stays in cache here; in a serving step the pages come
from DRAM). Pages in bf16, fp32, int8 (per token and head scales) and fp8 e4m3 (one scale per
layer). Median us per call over 100 calls.

    python scripts/bench_paged_attention.py --case 28,32,4,150 --case 28,32,4,600 \\
        --case 32,9,3,160 --case 32,3,3,160 --case 32,9,3,16 --case 1,9,3,160

``--cache``: the runtime's contiguous-cache decode attention instead, as its layers call it
(``cpu_attention.attend_decode`` with the level's ``cache_decode_attention`` op, against
``F.scaled_dot_product_attention`` as ``_Layer.attend`` called it before), over a
[B, Hkv, 4096, 64] cache read through the view [:, :, :L], fp32 and bf16, the two interleaved
over 7 rounds of 30 calls: median (min-max) of the rounds' medians.

    python scripts/bench_paged_attention.py --cache --case 1,9,3,128 --case 1,9,3,1024 \\
        --case 1,32,4,64 --case 1,32,4,512 --case 1,32,4,2048 --case 4,32,4,512
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from compress.eval.report import environment
from compress.kernels import cpu_attention, cpu_q8
from compress.runtime.paged import FP8, quantize_fp8, quantize_int8

BLOCK, HEAD_DIM, POOL_BLOCKS = 16, 64, 4096


def pools(hkv: int, dtype: torch.dtype):
    """Random key and value pools in ``dtype`` and their scales as PagedKVCache writes them
    (int8: per slot and head; fp8: one per layer; None for float pages)."""
    k, v = (torch.randn(POOL_BLOCKS * BLOCK, hkv, HEAD_DIM) for _ in range(2))
    if dtype == torch.int8:
        (k, ks), (v, vs) = quantize_int8(k), quantize_int8(v)
        return k, v, ks, vs
    if dtype == FP8:
        scale = torch.tensor([0.01])
        return quantize_fp8(k, scale), quantize_fp8(v, scale), scale, scale
    return k.to(dtype), v.to(dtype), None, None


def time_case(b: int, h: int, hkv: int, length: int, dtype: torch.dtype) -> float:
    ops = cpu_q8.ops()
    k_pool, v_pool, k_scale, v_scale = pools(hkv, dtype)
    nb = -(-length // BLOCK)
    tables = torch.randperm(POOL_BLOCKS)[: b * nb].view(b, nb).contiguous()
    lengths = torch.full((b,), length, dtype=torch.long)
    q = torch.randn(b, h, HEAD_DIM)

    def call():
        return ops.paged_decode_attention(q, k_pool, v_pool, k_scale, v_scale, tables, lengths,
                                          BLOCK, HEAD_DIM**-0.5, 0.0, 0)  # fmt: skip

    for _ in range(3):
        call()
    samples = []
    for _ in range(100):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return 1e6 * statistics.median(samples)


def time_cache_case(b: int, h: int, hkv: int, length: int, dtype: torch.dtype) -> dict[str, list]:
    """Our cache kernel and SDPA on one view of a contiguous cache: per round, each one's median
    us over 30 calls, rounds alternating."""
    op = cpu_q8.ops().cache_decode_attention
    k_cache, v_cache = (torch.randn(b, hkv, 4096, HEAD_DIM).to(dtype) for _ in range(2))
    keys, values = k_cache[:, :, :length], v_cache[:, :, :length]
    q = torch.randn(b, h, 1, HEAD_DIM)
    mask = torch.ones(b, 1, 1, length, dtype=torch.bool)
    calls = {
        "ours": lambda: cpu_attention.attend_decode(op, q, keys, values, mask, 0.125, None, None),
        "sdpa": lambda: F.scaled_dot_product_attention(
            q.to(dtype), keys, values, attn_mask=mask, scale=0.125, enable_gqa=hkv != h),
    }  # fmt: skip
    rounds: dict[str, list] = {name: [] for name in calls}
    for _ in range(7):
        for name, call in calls.items():
            for _ in range(3):
                call()
            samples = []
            for _ in range(30):
                start = time.perf_counter()
                call()
                samples.append(time.perf_counter() - start)
            rounds[name].append(1e6 * statistics.median(samples))
    return rounds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", required=True, help="rows,heads,kv_heads,keys")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache", action="store_true", help="the contiguous-cache op against SDPA")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    env = environment()
    print(f"{env['cpu']} ({', '.join(env['cpu_flags'])}); torch {env['torch']}; "
          f"our kernels at {cpu_q8.selected_isa()}; {env['threads']} threads; {env['date']}")
    if args.cache:
        print("| rows, heads / kv heads, keys | cache | ours us | SDPA us | SDPA / ours |")
        print("|---|---|---:|---:|---:|")
    for case in args.case:
        if args.cache:
            b, h, hkv, length = (int(v) for v in case.split(","))
            for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                r = time_cache_case(b, h, hkv, length, dt)
                ours, sdpa = (statistics.median(r[k]) for k in ("ours", "sdpa"))
                print(f"| {b}, {h} / {hkv}, {length} | {name} | {ours:.1f} ({min(r['ours']):.1f}-"
                      f"{max(r['ours']):.1f}) | {sdpa:.1f} ({min(r['sdpa']):.1f}-"
                      f"{max(r['sdpa']):.1f}) | {sdpa / ours:.2f} |", flush=True)
            continue
        b, h, hkv, length = (int(v) for v in case.split(","))
        cells = [f"{name} {time_case(b, h, hkv, length, dt):.0f} us"
                 for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32),
                                  ("int8", torch.int8), ("fp8", FP8))]  # fmt: skip
        print(f"B={b} H={h} Hkv={hkv} L={length}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
