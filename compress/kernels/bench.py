"""Timing of the CUDA kernel candidates, and the kernel table built from it (not a test).

``time_us`` times a call the way decode runs it: 20 calls captured in one CUDA graph, the graph
replayed 7 times between CUDA events, per-call median and spread (min, max) in microseconds, so
Python and launch overhead are out of the kernel's number. Where capture fails it falls back to
an eager loop between events and says so; on CPU (``scripts/gpu_check.py --dry-run``, the
interpreter) it uses ``time.perf_counter`` and the numbers mean nothing. ``measure_table``
times every candidate of ``kernel_table.KERNELS`` (and cuBLAS bf16 as a baseline, which no
int4/int8 layer can run) per (op, N, K, group, M) and returns one ``kernel_table`` table.
"""

from __future__ import annotations

import statistics
import time

import torch

from . import kernel_table, reference

GRAPH_CALLS = 20
REPEATS = 7
METHOD = (f"CUDA graph of {GRAPH_CALLS} calls replayed {REPEATS} times between CUDA events; "
          "per-call median, min and max")  # fmt: skip


def time_us(fn, device: torch.device, *, calls: int = GRAPH_CALLS, repeats: int = REPEATS) -> dict:
    """``{"median_us", "min_us", "max_us", "method"}`` of one call of ``fn`` (module docstring)."""
    fn()  # compile, tune and allocate outside the measurement
    if device.type != "cuda":
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append(1e6 * (time.perf_counter() - start))
        return _summary(samples, "cpu perf_counter (not a GPU measurement)")
    torch.cuda.synchronize(device)
    method = f"CUDA graph of {calls} calls, {repeats} replays"
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            fn()  # a warm-up on the capture stream, as torch's docs ask
        torch.cuda.current_stream(device).wait_stream(stream)
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        run = graph.replay
    except RuntimeError as exc:  # capture refused: time the eager calls instead
        method = f"eager, {calls} calls x {repeats} (graph capture failed: {exc})"[:300]

        def run():
            for _ in range(calls):
                fn()

    run()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(1e3 * start.elapsed_time(end) / calls)
    return _summary(samples, method)


def _summary(samples: list[float], method: str) -> dict:
    return {"median_us": statistics.median(samples), "min_us": min(samples),
            "max_us": max(samples), "method": method}  # fmt: skip


def _inputs(op: str, n: int, k: int, group: int, m: int, device: torch.device, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    if op == "int4":
        codes = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
        scales = torch.full((n, k // group), 0.01, dtype=dtype, device=device)
        return x, reference.pack_int4(codes).to(device), scales
    w_q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).to(device)
    return x, w_q, torch.full((n, 1), 0.01, dtype=dtype, device=device)


def candidates(op: str, n: int, k: int, group: int, m: int, device: torch.device, dtype):
    """``{name: fn}`` of every kernel that can run this call, GEMV configs as
    ``triton_gemv/<BLOCK_N>x<BLOCK_K>x<SPLIT_K>w<warps>s<stages>``, plus ``torch_bf16``."""
    from . import gemv, int4_gemm, int8_gemm, triton_ops

    x, w, s = _inputs(op, n, k, group, m, device, dtype)
    fits = dict(op=op, n=n, k=k, group_size=group, m=m, device_type=device.type, x_dtype=dtype)
    w_float = torch.randn(n, k, dtype=dtype, device=device) * 0.02
    fns = {"torch_bf16": lambda: x @ w_float.t()}
    if op == "int4":
        if kernel_table.runs("triton_gemv", **fits):
            for c in gemv.valid_configs(gemv._configs(), m=m, n=n, k=k, group_size=group,
                                        min_block_k=8):  # fmt: skip
                fns[_name(c)] = lambda c=c: gemv.int4_gemv_triton(x, w, s, None, group_size=group,
                                                                  config=c)  # fmt: skip
        fns["triton_gemm"] = lambda: int4_gemm.int4_gemm_triton(x, w, s, None, group_size=group)
        if kernel_table.runs("torch_int4pack", **fits):
            packed, sz = triton_ops.prepare_int4pack(w, s, None, group_size=group)
            fns["torch_int4pack"] = lambda: torch._weight_int4pack_mm(x, packed, group, sz)
        return fns
    x_q, x_scales = int8_gemm.quantize_per_token_triton(x)
    if op == "int8":
        if kernel_table.runs("triton_gemv", **fits):
            for c in gemv.valid_configs(gemv._configs(), m=m, n=n, k=k, group_size=k,
                                        min_block_k=16):  # fmt: skip
                fns[_name(c)] = lambda c=c: gemv.int8_gemv_triton(x, w, s, config=c)
        fns["triton_gemm"] = lambda: int8_gemm.int8_weight_gemm_triton(x, w, s)
        return fns
    # w8a8: every candidate starts from the same int8 activations (the quantizer is shared)
    if kernel_table.runs("triton_gemv", **fits):
        for c in gemv.valid_configs(gemv._configs(), m=m, n=n, k=k, group_size=k,
                                    min_block_k=16):  # fmt: skip
            fns[_name(c)] = lambda c=c: gemv.int8_int8_gemv_triton(
                x_q, x_scales, w, s, out_dtype=dtype, config=c)  # fmt: skip
    fns["triton_gemm"] = lambda: int8_gemm.int8_int8_gemm_triton(x_q, x_scales, w, s,
                                                                 out_dtype=dtype)  # fmt: skip
    if kernel_table.runs("torch_int_mm", **fits):
        sw = s.to(torch.float32).t()
        fns["torch_int_mm"] = lambda: (torch._int_mm(x_q, w.t()).float() * x_scales * sw).to(dtype)
    return fns


def _name(c) -> str:
    kw = c.kwargs
    return (f"triton_gemv/{kw['BLOCK_N']}x{kw['BLOCK_K']}x{kw['SPLIT_K']}"
            f"w{c.num_warps}s{c.num_stages}")  # fmt: skip


def measure_entry(op: str, n: int, k: int, group: int, m: int, device, dtype, *,
                  repeats: int = REPEATS) -> dict:  # fmt: skip
    """One table entry: the fastest kernel, its GEMV config, every kernel's time."""
    times, errors = {}, {}
    for name, fn in candidates(op, n, k, group, m, device, dtype).items():
        try:
            times[name] = time_us(fn, device, repeats=repeats)
        except Exception as exc:  # noqa: BLE001  (a measurement tool: record and go on)
            errors[name] = f"{type(exc).__name__}: {exc}"[:300]
    gemv_names = [name for name in times if name.startswith("triton_gemv/")]
    best_gemv = min(gemv_names, key=lambda name: times[name]["median_us"], default=None)
    us = {name: times[name]["median_us"] for name in times if "/" not in name}
    if best_gemv is not None:
        us["triton_gemv"] = times[best_gemv]["median_us"]
    selectable = {name: t for name, t in us.items() if name in kernel_table.KERNELS}
    entry = {"op": op, "n": n, "k": k, "group_size": group, "m": m,
             "kernel": min(selectable, key=selectable.get) if selectable else None,
             "config": _config_dict(best_gemv), "us": selectable,
             "baseline_us": {"torch_bf16": us.get("torch_bf16")},
             "spread_us": {name: [t["min_us"], t["max_us"]] for name, t in times.items()},
             "method": next(iter(times.values()))["method"] if times else None}  # fmt: skip
    if errors:
        entry["errors"] = errors
    return entry


def _config_dict(name: str | None) -> dict | None:
    if name is None:
        return None
    shape, rest = name.split("/")[1].split("w")
    bn, bk, split = map(int, shape.split("x"))
    warps, stages = map(int, rest.split("s"))
    return {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": warps,
            "num_stages": stages}  # fmt: skip


def measure_table(
    shapes,
    m_values,
    *,
    device,
    dtype=torch.bfloat16,
    ops=kernel_table.OPS,
    budget_s: float = 150.0,
    repeats: int = REPEATS,
    on_entry=None,
) -> dict:
    """A ``kernel_table`` table (without ``measured``) of ``shapes`` ``[(N, K), ...]`` x
    ``m_values`` x ``ops``; int4 at group 128 (64 where 128 does not divide K), int8 per
    channel. Stops starting new shapes after ``budget_s`` (listed under ``not_measured``);
    ``on_entry(table)`` after each entry lets a caller save partial results."""
    started = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({device})"
    table = {"gpu": name, "match": [name], "entries": [], "not_measured": []}
    for n, k in shapes:
        if time.perf_counter() - started > budget_s:
            table["not_measured"].append(f"{n}x{k}: time budget of {budget_s:.0f} s spent")
            continue
        for op in ops:
            group = (128 if k % 128 == 0 else 64) if op == "int4" else k
            for m in m_values:
                entry = measure_entry(op, n, k, group, m, device, dtype, repeats=repeats)
                if entry["kernel"] is not None:
                    table["entries"].append(entry)
                if on_entry is not None:
                    on_entry(table)
    return table
