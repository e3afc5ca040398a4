"""Probes of what this machine can do, measured here rather than taken from a spec sheet.

- ``memory_bandwidth``: bytes read per second by a reduction over a buffer much larger than the
  last-level cache (a sum reads every byte once and writes almost nothing);
- ``matmul_peak``: FLOP/s of a square fp32 (or given dtype) matmul.

Both report the best of several repetitions (the least disturbed by other work), so MBU and MFU
computed against them are upper-bound-relative fractions. On a shared machine the probes and the
workload see the same contention only if they run close together; results record when they ran.
Nothing runs at import.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def memory_bandwidth(
    size_mb: int = 1024, repeats: int = 4, device: str | torch.device = "cpu"
) -> dict[str, Any]:
    """Best read bandwidth in bytes/s over ``repeats`` sums of a ``size_mb`` float32 buffer.

    The one probe every MBU of the product and its benches is against (``compare``,
    ``bench_e2e``, ``bench_decode_pass``): 1 GiB is over 3x the largest last-level cache met
    here (300 MB), so the sum reads DRAM, not cache."""
    n = size_mb * 2**20 // 4
    buf = torch.ones(n, dtype=torch.float32, device=device)
    float(buf.sum())  # warm-up: page in the buffer
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        float(buf.sum())  # float(): forces completion on any device
        best = min(best, time.perf_counter() - start)
    return {"bytes_per_s": buf.numel() * 4 / best, "buffer_mb": size_mb, "repeats": repeats}


def matmul_peak(
    n: int = 1024,
    repeats: int = 5,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """Best FLOP/s of ``[n, n] @ [n, n]`` (2 n^3 FLOPs) over ``repeats`` runs."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    a @ b  # warm-up: library initialisation, thread pool start
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return {"flops_per_s": 2 * n**3 / best, "n": n, "dtype": str(dtype), "repeats": repeats}


def _sync(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
