"""The paged KV cache and the runtime's forward over it (continuous batching,
``runtime/scheduler.py``).

Storage: per layer, keys and values in one pool of ``num_blocks * block_size`` token slots,
``[slots, kv_heads, head_dim]``; slot ``block * block_size + offset`` holds one token. A
request's block table (``runtime/blocks.py``) lists its blocks in token order, so its keys are
its blocks' rows (a layer whose values are its keys, latent attention's, has one pool for
both). PagedAttention's layout and vLLM's block-major slot mapping. Decode steps on a
CPU attend where the keys lie (``kernels/cpu_attention.py``, a C++ loop per row and KV head;
int8 pages as code x scale in fp32). Elsewhere (other devices, prefill chunks that follow cached
keys, or when asked) attention copies a batch's blocks into a contiguous ``[B, kv_heads, L,
head_dim]`` and calls the same attention as the contiguous runtime (``_Layer.attend``), so paged
and contiguous compute the same numbers bit for bit on the same keys; that copy is a gather per
layer per step, what the kernel saves.

``kv_dtype`` int8 stores each token's key and value per head as int8 codes with one fp32 scale
(absmax / 127 over head_dim, per token and head: the KIVI/vLLM int8 granularity that keeps an
outlier token from costing the others precision); a gather dequantizes to fp32. Bytes per
token and head: head_dim + 4, against 2 * head_dim in bf16 and 4 * head_dim in fp32.
``kv_dtype`` fp8 stores them as fp8 e4m3fn, value / scale with one scale per layer for keys
and one for values (``kv_scales``): vLLM's ``--kv-cache-dtype fp8`` and the checkpoint form
it reads (``kv_cache_scheme`` + ``self_attn.k_scale`` / ``v_scale``,
``compress/quant/kv_cache.py``). head_dim bytes per token and head; without calibrated scales
every scale is 1.0, as in vLLM, and values beyond +-448 saturate.

The forward runs the runtime's own layer holders (``layers._Layer``): the projections of every
token of a step as one call (decode rows of all requests; prefill chunks of several requests
side by side), attention per request over its own slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compress.kernels import cpu_elementwise
from compress.kernels.cpu_attention import paged_decode_attention
from compress.kernels.cpu_elementwise import quantize_int8
from compress.quant.kv_scales import FP8_E4M3_MAX

FP8 = torch.float8_e4m3fn
KV_DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8, "fp8": FP8,
}  # fmt: skip


def kv_bytes_per_token(n_layers: int, n_kv: int, head_dim: int, dtype: torch.dtype,
                       values_in_keys: bool = False) -> int:
    """Bytes of K and V one token takes over all layers in ``dtype`` (int8: codes + scales;
    fp8's two scales per layer are not per token); ``values_in_keys``: K alone (latent
    attention's cache, ``_Layer.values_in_keys``)."""
    per_head = head_dim + 4 if dtype == torch.int8 else head_dim * dtype.itemsize
    return (1 if values_in_keys else 2) * n_layers * n_kv * per_head


class PagedKVCache:
    """Keys and values of every layer in ``num_blocks`` blocks of ``block_size`` slots."""

    def __init__(
        self,
        *,
        n_layers: int,
        num_blocks: int,
        block_size: int,
        n_kv: int,
        head_dim: int,
        dtype: torch.dtype,
        compute_dtype: torch.dtype,
        device: torch.device | str = "cpu",
        kv_scales: list[tuple[float, float]] | None = None,
        values_in_keys: bool = False,
    ) -> None:
        """``kv_scales``: fp8 pages' (key, value) scale of each layer; None: 1.0 each.
        ``values_in_keys``: the values are the keys (latent attention): one pool for both, the
        value side's tensors the key side's."""
        if not (dtype.is_floating_point or dtype == torch.int8):  # float: the runtime's own
            raise ValueError(f"kv dtype {dtype} is neither a float dtype nor int8")
        if kv_scales is not None and (dtype != FP8 or len(kv_scales) != n_layers):
            raise ValueError(f"kv_scales are one (key, value) pair per layer ({n_layers}) of "
                             f"fp8 pages; got {len(kv_scales)} for {dtype} pages")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype, self.compute_dtype = dtype, compute_dtype
        slots = num_blocks * block_size
        shape = (slots, n_kv, head_dim)
        self.values_in_keys = values_in_keys
        shared = values_in_keys  # short
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = self.k if shared else [torch.zeros_like(k) for k in self.k]
        self.k_scale = self.v_scale = None
        if dtype == torch.int8:
            self.k_scale = [torch.zeros(shape[:2], device=device) for _ in range(n_layers)]
            self.v_scale = self.k_scale if shared else [torch.zeros_like(s) for s in self.k_scale]
        elif dtype == FP8:  # one scale per layer: [1] each, as the attention kernel takes it
            pairs = kv_scales if kv_scales is not None else [(1.0, 1.0)] * n_layers
            for k_s, v_s in pairs:
                if not (k_s > 0 and v_s > 0 and k_s < float("inf") and v_s < float("inf")):
                    raise ValueError(f"fp8 KV scales must be finite and > 0, got {k_s}, {v_s}")
            self.k_scale = [torch.tensor([float(k_s)], device=device) for k_s, _ in pairs]
            self.v_scale = self.k_scale if shared else [
                torch.tensor([float(v_s)], device=device) for _, v_s in pairs]
        self.bytes_per_block = block_size * kv_bytes_per_token(n_layers, n_kv, head_dim, dtype,
                                                               values_in_keys)
        # fp32/bf16/int8 pages written by one C++ call per layer (kernels.cpu_elementwise.
        # write_kv, write_kv_int8) instead of casts (or quantize_int8) and index_copy_ calls:
        # the scheduler turns it on for eager CPU runtimes (the same bytes: .to(bf16) rounds to
        # nearest even as the op does; the int8 op does quantize_int8's fp32 operations)
        self.fused_writes = False

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [N, kv_heads, D] of N tokens at pool ``slots`` [N] (``values_in_keys``:
        k alone, v is the same)."""
        if self.fused_writes and not self.values_in_keys and self.dtype != FP8:
            if self.k_scale is None:
                cpu_elementwise.write_kv(self.k[layer], self.v[layer], slots, k, v)
            else:
                cpu_elementwise.write_kv_int8(self.k[layer], self.v[layer], self.k_scale[layer],
                                              self.v_scale[layer], slots, k, v)  # fmt: skip
            return
        sides = ((self.k, self.k_scale, k),) + (
            () if self.values_in_keys else ((self.v, self.v_scale, v),))
        if self.k_scale is None:
            for pool, _, x in sides:
                pool[layer].index_copy_(0, slots, x.to(self.dtype))
            return
        for codes, scales, x in sides:
            if self.dtype == FP8:  # index_copy_ has no fp8 kernel: copy the bytes
                q = quantize_fp8(x, scales[layer])
                codes[layer].view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))
                continue
            q, s = quantize_int8(x)
            codes[layer].index_copy_(0, slots, q)
            scales[layer].index_copy_(0, slots, s)

    def read(self, layer: int, blocks: torch.Tensor, length: int) -> tuple[torch.Tensor, ...]:
        """Keys and values of the first ``length`` slots of each row's ``blocks`` [B, nb]
        (block tables) -> [B, kv_heads, length, D] in the compute dtype. Whole blocks are
        copied (block_size rows at a time: measured 2x faster than gathering token rows)."""
        b, nb = blocks.shape
        flat = blocks.reshape(-1)
        out = []
        sides = ((self.k, self.k_scale),) + (() if self.values_in_keys else
                                             ((self.v, self.v_scale),))
        for codes, scales in sides:
            pages = codes[layer].view(self.num_blocks, self.block_size, *codes[layer].shape[1:])
            x = pages.index_select(0, flat)  # [B * nb, bs, Hkv, D]
            if self.dtype == FP8:
                x = dequantize_fp8(x, scales[layer])
            elif scales is not None:
                s = scales[layer].view(self.num_blocks, self.block_size, -1).index_select(0, flat)
                x = dequantize_int8(x, s)
            x = x.to(self.compute_dtype).view(b, nb * self.block_size, *x.shape[2:])[:, :length]
            out.append(x.transpose(1, 2))  # [B, L, Hkv, D] -> [B, Hkv, L, D]
        return out[0], out[-1]


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The reference inverse of ``quantize_int8``: codes * scale, fp32."""
    return codes.float() * scale[..., None]


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale as fp8 e4m3fn, saturated at +-448 (one per-tensor ``scale``, fp32 [1])."""
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8)


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The reference inverse of ``quantize_fp8``: value x scale, fp32."""
    return codes.float() * scale


@dataclass
class Segment:
    """One request's tokens in a step: ``tokens`` at positions ``start``, ``start + 1``, ...,
    their KV going to pool ``slots``; its keys are the first ``start + len(tokens)`` slots of
    its block table ``blocks``."""

    start: int
    tokens: list[int]
    slots: list[int]
    blocks: list[int]

    @property
    def length(self) -> int:
        return self.start + len(self.tokens)


def _segment_tensors(segments: list[Segment], device) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([t for s in segments for t in s.tokens], device=device)
    positions = torch.cat(
        [torch.arange(s.start, s.start + len(s.tokens), device=device) for s in segments]
    )
    return ids, positions


def _causal_mask(queries: torch.Tensor, length: int, window: int | None) -> torch.Tensor:
    """[T, L] bool: query at position ``queries[i]`` sees keys at positions 0..queries[i]
    (and, with a sliding window, only the last ``window`` of them)."""
    keys = torch.arange(length, device=queries.device)
    mask = keys[None, :] <= queries[:, None]
    if window is not None:
        mask &= keys[None, :] > queries[:, None] - window
    return mask


@torch.no_grad()
def forward_step(
    runtime,
    cache: PagedKVCache,
    decode: list[Segment],
    chunks: list[Segment],
    *,
    kernel: bool = False,
    every_row: bool = False,
    every_row_of: frozenset[int] = frozenset(),
    stack=None,
) -> torch.Tensor:
    """One forward over a step's tokens: ``decode`` rows (one new token each) and prefill
    ``chunks`` of several requests side by side through every projection, one call each, so the
    weights are read once per step; attention per request. -> logits [B + S, V] fp32: after each
    decode row, then after each chunk's last token (``every_row``: after every chunk token;
    ``every_row_of``: after every token of the chunks at those indices, in place of the last).

    Decode rows attend to their slots in the pool: with ``kernel`` where they lie
    (``kernels.cpu_attention``), else gathered, padded to the longest context and masked,
    through the runtime's own attention (the contiguous runtime's numbers, bit for bit). A
    chunk that starts at 0 attends to its own fresh keys, as the contiguous runtime's prefill
    does; a later chunk (or the rest of a prompt after a prefix-cache hit) attends to its slots
    in the cache, its own new keys included (as stored: int8 pages are read back rounded).

    The projections run in one phase's dtype (decode's when there are decode rows): a caller
    mixes both kinds only where the phases compute alike (``Scheduler.mixed_reason``).

    ``stack``: a ``decode_stack.DecodeStack`` of the runtime that runs a decode-only step's
    layers in one C++ call (under its ``max_rows``, with ``kernel``): the same numbers as the
    loop below."""
    device = runtime.device
    segments = decode + chunks
    b = len(decode)
    ids, positions = _segment_tensors(segments, device)  # [N]
    slots = torch.tensor([x for s in segments for x in s.slots], device=device)
    windows = {layer.window for layer in runtime.layers}
    ropes = {key: (cos[positions][None], sin[positions][None]) for key, (cos, sin) in
             runtime.rope.items()}  # fmt: skip
    if decode:
        nb = max(len(s.blocks) for s in decode)
        # padding blocks repeat a row's own first block: finite values, masked out
        tables = torch.tensor(
            [s.blocks + [s.blocks[0]] * (nb - len(s.blocks)) for s in decode], device=device
        )  # [B, nb]
        lengths = torch.tensor([s.length for s in decode])
        length = int(lengths.max())
        if not kernel:
            decode_masks = {
                w: _causal_mask(positions[:b], length, w)[:, None, None, :]  # [B, 1, 1, L]
                for w in windows
            }
    sizes = [len(s.tokens) for s in chunks]
    chunk_tables = [torch.tensor(s.blocks, device=device)[None] for s in chunks]
    # None: a chunk that no window cuts is plain causal over its keys (_Layer.attend)
    chunk_masks = {
        w: [None if w is None or w >= s.length else
            _causal_mask(p, s.length, w)[None, None]
            for s, p in zip(chunks, positions[b:].split(sizes), strict=True)]
        for w in windows
    }  # fmt: skip
    x = runtime._embed(ids[None], positions[None])  # [1, N, H]
    if stack is not None and kernel and not chunks and b < stack.max_rows:
        rows = [(cos[0], sin[0]) for cos, sin in ropes.values()]  # [B, D] each
        return runtime.head(stack.run(x[0], rows, slots, tables, lengths, cache))
    phase = bool(decode)
    # Here: steps with chunks, and decode-only steps without a stack. A decode-only step does no
    # chunk bookkeeping and no concatenation; still, Python and small ATen calls between the
    # ops were about half of a one-row SmolLM2 W4 step on 2 cores (cProfile: about 8 of 16 ms
    # in our ops), what the stack saves (runtime/decode_stack.py).
    for i, layer in enumerate(runtime.layers):
        cos, sin = ropes[layer.rope_key]
        q, k, v = layer.project_qkv(x, cos, sin, phase)  # [1, heads, N, D]
        # [1, hkv, N, D] -> [N, hkv, D]
        cache.write(i, slots, k[0].transpose(0, 1), v[0].transpose(0, 1))
        parts = []
        if decode:
            q_rows = q[0, :, :b].transpose(0, 1)  # [B, heads, D]
            if kernel:
                scales = None if cache.k_scale is None else (cache.k_scale[i], cache.v_scale[i])
                a = paged_decode_attention(
                    q_rows, cache.k[i], cache.v[i], tables, lengths, cache.block_size,
                    layer.scale, layer.softcap, layer.window, scales=scales, sinks=layer.sinks,
                )  # fmt: skip
            else:
                keys, values = cache.read(i, tables, length)
                a = layer.attend(q_rows[:, :, None], keys, values, decode_masks[layer.window])
            parts.append(a.reshape(1, b, -1))
        if chunks:
            pieces = zip(chunks, q[:, :, b:].split(sizes, 2), k[:, :, b:].split(sizes, 2),
                         v[:, :, b:].split(sizes, 2), chunk_tables, chunk_masks[layer.window],
                         strict=True)  # fmt: skip
            for s, qs, ks, vs, table, mask in pieces:
                keys, values = cache.read(i, table, s.length) if s.start else (ks, vs)
                parts.append(layer.attend(qs, keys, values, mask))
        x = layer.finish(x, parts[0] if len(parts) == 1 else torch.cat(parts, 1), phase)
    if every_row:
        return runtime.head(x[0])
    if not every_row_of:
        rows = torch.cat([torch.arange(b), b + torch.tensor(sizes, dtype=torch.long).cumsum(0) - 1])
        return runtime.head(x[0, rows.to(device)])
    picked, end = list(range(b)), b
    for j, size in enumerate(sizes):
        end += size
        picked += range(end - size, end) if j in every_row_of else [end - 1]
    return runtime.head(x[0, torch.tensor(picked, device=device)])


@torch.no_grad()
def paged_logits(runtime, cache: PagedKVCache, tokens: list[int]) -> torch.Tensor:
    """Logits [T, V] after each of ``tokens`` with every key but the first read back from
    ``cache`` (its first blocks overwritten): the first token alone, then the rest in one chunk
    that attends to the stored keys, as decode steps do. Scores what a KV dtype costs."""
    bs = cache.block_size
    need = -(-len(tokens) // bs)
    if need > cache.num_blocks:
        raise ValueError(
            f"{len(tokens)} tokens need {need} blocks; the cache has {cache.num_blocks}"
        )
    slots = list(range(len(tokens)))  # blocks 0, 1, ... in order
    blocks = list(range(need))
    first = forward_step(
        runtime, cache, [], [Segment(0, tokens[:1], slots[:1], blocks[:1])], every_row=True
    )
    if len(tokens) == 1:
        return first
    rest = Segment(1, tokens[1:], slots[1:], blocks)
    return torch.cat([first, forward_step(runtime, cache, [], [rest], every_row=True)])
