"""Decode attention over the paged KV pool on a CPU (``csrc/paged_attention.cpp``), built with
the integer-dot kernels (``cpu_q8``: the same extension, each ISA level its own build), the
same loops over the runtime's contiguous cache (``cache_decode_attention``), and a prompt's
causal attention (``causal_prefill_attention``, ``csrc/prefill_attention.cpp``).

``paged_decode_attention`` reads each row's keys and values where they lie in the pool instead
of gathering them into a padded contiguous copy first (``PagedKVCache.read`` + SDPA, the path
the runtime keeps for other devices, for prefill chunks and as the bit-for-bit twin of the
contiguous runtime). ``paged_decode_attention_reference`` is its definition in float64 torch.
"""

from __future__ import annotations

import torch

from compress.kernels import cpu_q8

# page dtypes the kernel reads
KV_DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn)
# cache dtypes cache_decode_attention reads (cache_kernel_reads)
CACHE_DTYPES = (torch.float32, torch.bfloat16)
# Levels and head dims whose runtime takes causal_prefill_attention for a prompt's attention
# instead of ATen's flash attention (SDPA, is_causal; a later chunk: SDPA with the mask): where
# it was measured faster. On the AVX2-only Zen 3 EPYC, 2 threads (scripts/
# bench_prefill_attention.py, 2026-12-07, after the tiles' do-while loops and the head-major
# claims; medians of 7 alternated rounds): at 256 / 1,024 / 4,096 tokens SmolLM2's 9 heads of
# 64 over 3 ran 1.72x / 1.68x / 1.28x SDPA's speed, the 1.1B shape's 32 over 4 1.78x / 1.54x /
# 1.19x, an 8B's 32 heads of 128 over 8 1.64x / 1.47x / 1.13x, a 7B's 32 over 32 1.68x /
# 1.29x / 1.08x; chunks of 256 after 768 and 3,840 keys 1.29-1.43x, 1.34x / 1.19x and 1.32x /
# 0.97x (level: 1.11x in another run). Not measured at the AVX-512 levels (their ATen runs
# AVX-512 GEMMs): they keep SDPA.
PREFILL_ISAS = ("avx2",)
PREFILL_HEAD_DIMS = (64, 128)


def unavailable_reason(pool_dtype: torch.dtype, device: torch.device,
                       head_dim: int | None = None) -> str | None:
    """Why the kernel cannot serve pages of ``pool_dtype`` on ``device`` (heads of
    ``head_dim`` channels, when given), or None."""
    if device.type != "cpu":
        return f"the pages are on {device.type}, the kernel is CPU-only"
    if pool_dtype not in KV_DTYPES:
        return f"{pool_dtype} pages (the kernel reads fp32, bf16, or int8 or fp8 with scales)"
    if head_dim is not None and head_dim % 8:
        return f"head_dim {head_dim} is not a multiple of 8 (the kernel's vector width)"
    return cpu_q8.unavailable_reason()


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    *,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    sinks: torch.Tensor | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """q [B, H, D] over each row's first ``lengths[b]`` slots of its block table ``tables[b]``
    in the pools [slots, Hkv, D] -> [B, H, D] fp32. Pools fp32 or bf16, int8 codes with
    ``scales`` (k, v) fp32 [slots, Hkv] (each row is code x scale), or fp8 e4m3fn with
    ``scales`` (k, v) fp32 [1] (value x the layer's scale). ``softcap``: scores become
    ``cap * tanh(s / cap)`` (Gemma 2); ``window``: only the last ``window`` keys; ``sinks``
    [H]: a logit per head that joins each softmax without a value (GPT-OSS). ``isa``: the
    build level (default: ``cpu_q8.selected_isa``)."""
    k_scale, v_scale = scales if scales is not None else (None, None)
    return cpu_q8.ops(isa).paged_decode_attention(
        q.float().contiguous(),
        k_pool,
        v_pool,
        k_scale,
        v_scale,
        tables,
        lengths,
        block_size,
        scale,
        softcap or 0.0,
        window or 0,
        None if sinks is None else sinks.float().contiguous(),
    )


def cache_decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    *,
    isa: str | None = None,
) -> torch.Tensor:
    """q [B, H, D] over a contiguous cache's keys/values [B, Hkv, L, D] (fp32 or bf16; views
    such as ``cache[:B, :, :L]`` are read in place) where ``mask`` [B, L] is True -> [B, H, D]
    fp32. Every row needs one unmasked key. ``softcap``, ``sinks`` and ``isa`` as in
    ``paged_decode_attention``."""
    return cpu_q8.ops(isa).cache_decode_attention(
        q.float().contiguous(),
        keys,
        values,
        mask,
        scale,
        softcap or 0.0,
        None if sinks is None else sinks.float().contiguous(),
    )


def prefill_unavailable_reason(head_dim: int, device: torch.device,
                               isa: str | None = None) -> str | None:
    """Why the runtime's prompts on ``device`` with heads of ``head_dim`` channels do not take
    ``causal_prefill_attention`` (at level ``isa``, default the selected one), or None."""
    if device.type != "cpu":
        return f"the model is on {device.type}, the kernel is CPU-only"
    if head_dim not in PREFILL_HEAD_DIMS:
        return f"heads of {head_dim} (measured faster than SDPA at {PREFILL_HEAD_DIMS} only)"
    isa = isa or cpu_q8.selected_isa()
    if isa not in PREFILL_ISAS:
        return f"not measured faster than ATen's flash attention at the {isa} level"
    return cpu_q8.unavailable_reason()


def prefill_kernel_reads(q, keys, values) -> bool:
    """Whether ``causal_prefill_attention`` takes this chunk's attention: one sequence (q [1,
    heads, T, D] over keys/values [1, Hkv, L, D], L >= T), fp32 or bf16, one head dim for all three
    (latent attention's values are narrower than its queries: SDPA takes those) a multiple of
    16."""
    d = q.shape[-1]
    return (q.shape[0] == 1 and keys.shape[-1] == d and values.shape[-1] == d and d % 16 == 0
            and keys.dtype in CACHE_DTYPES and values.dtype in CACHE_DTYPES
            and q.dtype in CACHE_DTYPES)  # fmt: skip


def causal_prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                             scale: float, offset: int = 0, *,
                             isa: str | None = None) -> torch.Tensor:
    """Causal attention of one sequence: q [H, T, D] over keys/values [Hkv, offset + T, D]
    (fp32 or bf16, any strides with D contiguous), query i at position ``offset + i`` seeing
    keys 0 .. offset + i -> [T, H * D] fp32 (query head h reads key head h // (H / Hkv))."""
    return cpu_q8.ops(isa).causal_prefill_attention(q, keys, values, scale, offset)


def causal_prefill_attention_reference(q, keys, values, scale: float,
                                       offset: int = 0) -> torch.Tensor:
    """``causal_prefill_attention`` in float64 with plain torch (for tests)."""
    h, t, d = q.shape
    groups = h // keys.shape[0]
    k, v = (x.double().repeat_interleave(groups, 0) for x in (keys, values))  # [H, L, D]
    scores = torch.einsum("htd,hld->htl", q.double(), k) * scale
    seen = torch.arange(k.shape[1])[None, :] <= (offset + torch.arange(t))[:, None]  # [T, L]
    weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    return torch.einsum("htl,hld->thd", weights, v).reshape(t, h * d)


def cache_kernel_reads(q, keys, values) -> bool:
    """Whether ``cache_decode_attention`` takes this attention: one query (q [B, heads, 1, D]),
    fp32 or bf16 keys and values of one layout whose positions are D contiguous values (the
    runtime's cache views; not the fresh keys and values of a one-token prompt chunk)."""
    d = keys.shape[-1]
    return (q.shape[2] == 1 and keys.dtype in CACHE_DTYPES and values.dtype == keys.dtype
            and keys.stride() == values.stride() and keys.stride(-1) == 1
            and all(s % d == 0 for s in keys.stride()[:-1]))  # fmt: skip


def attend_decode(op, q, keys, values, mask, scale: float, softcap: float | None,
                  sinks: torch.Tensor | None) -> torch.Tensor:
    """One-query attention through ``op`` (a level's ``cache_decode_attention``, as the
    runtime's layers hold it: a compiled step calls it without this module's dispatch): q
    [B, heads, 1, D] over keys/values [B, Hkv, L, D] where the bool ``mask`` (broadcastable to
    [B, 1, 1, L]) is True -> [B, 1, heads * D] fp32."""
    b, length = q.shape[0], keys.shape[2]
    a = op(q[:, :, 0].float().contiguous(), keys, values,
           mask.expand(b, 1, 1, length)[:, 0, 0], scale, softcap or 0.0, sinks)  # fmt: skip
    return a.view(b, 1, -1)


def _attend_reference(q, keys, values, scale, softcap, sinks) -> torch.Tensor:
    """One row's query [H, D] over its keys/values [n, Hkv, D], float64 -> [H, D]."""
    groups = q.shape[0] // keys.shape[1]
    keys, values = (t.repeat_interleave(groups, dim=1) for t in (keys, values))  # [n, H, D]
    scores = torch.einsum("hd,nhd->hn", q.double(), keys) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if sinks is not None:  # one more column per head, dropped after the softmax
        scores = torch.cat([scores, sinks.double()[:, None]], 1)
    weights = scores.softmax(-1)[:, : keys.shape[0]]
    return torch.einsum("hn,nhd->hd", weights, values)


def paged_decode_attention_reference(
    q, k_pool, v_pool, tables, lengths, block_size, scale, softcap=None, window=None, *,
    scales=None, sinks=None,
) -> torch.Tensor:  # fmt: skip
    """``paged_decode_attention`` in float64, row by row with plain torch (for tests)."""
    b, h, d = q.shape
    k, v = k_pool.double(), v_pool.double()
    if scales is not None:
        k, v = k * scales[0].double()[..., None], v * scales[1].double()[..., None]
    out = torch.empty(b, h, d, dtype=torch.float64)
    for row in range(b):
        n = int(lengths[row])
        slots = torch.arange(n)
        slots = tables[row][slots // block_size] * block_size + slots % block_size
        first = max(0, n - window) if window else 0
        out[row] = _attend_reference(q[row], k[slots[first:]], v[slots[first:]], scale,
                                     softcap, sinks)
    return out


def cache_decode_attention_reference(
    q, keys, values, mask, scale, softcap=None, sinks=None
) -> torch.Tensor:
    """``cache_decode_attention`` in float64, row by row with plain torch (for tests)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for row in range(q.shape[0]):
        kept = mask[row].nonzero()[:, 0]
        # [Hkv, L, D] -> the kept positions as [n, Hkv, D]
        k, v = (t[row][:, kept].double().transpose(0, 1) for t in (keys, values))
        out[row] = _attend_reference(q[row], k, v, scale, softcap, sinks)
    return out
