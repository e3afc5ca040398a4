"""Decode attention in the paged pool (``paged_decode_attention``, csrc/paged_attention.cpp), one
layer's call: B rows of L keys each, H query heads over Hkv kv heads, head_dim 64, blocks of 16
scattered over a 4096-block pool (which stays in cache here; in a serving step the pages come
from DRAM). Pages in bf16, fp32, int8 (per token and head scales) and fp8 e4m3 (one scale per
layer). Median us per call over 100 calls.

    python scripts/bench_paged_attention.py --case 28,32,4,150 --case 28,32,4,600 \\
        --case 32,9,3,160 --case 32,3,3,160 --case 32,9,3,16 --case 1,9,3,160
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from compress.eval.report import environment
from compress.kernels import cpu_q8
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", required=True, help="rows,heads,kv_heads,keys")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    env = environment()
    print(f"{env['cpu']} ({', '.join(env['cpu_flags'])}); torch {env['torch']}; "
          f"{env['threads']} threads; {env['date']}")
    for case in args.case:
        b, h, hkv, length = (int(v) for v in case.split(","))
        cells = [f"{name} {time_case(b, h, hkv, length, dt):.0f} us"
                 for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32),
                                  ("int8", torch.int8), ("fp8", FP8))]  # fmt: skip
        print(f"B={b} H={h} Hkv={hkv} L={length}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
