"""The runtime's float linear holder (``_FloatLinear``): a float layer's weights in the prefill
and decode dtypes, held on a CPU in the layout its matmul reads fastest (``_FloatLinear.pack``:
oneDNN's blocked layout, our AMX-BF16 tiles, or a bf16 copy for ``cpu_float``'s op), and the op
through which a compiled step calls oneDNN's packed weights.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from compress.kernels import cpu_float, cpu_q8

# How eager runtimes hold fp32 weights for oneDNN (``_FloatLinear.pack``). oneDNN picks the
# blocked layout for a row count (``_reorder_linear_weight``'s batch-size hint): one picked for 32
# rows serves 4-256 rows far better than one picked for 1 row and costs nothing at 1 row.
# Measured on a Xeon (AVX-512/AMX), 2 threads, torch 2.13, weights cycled from DRAM, plain
# F.linear / packed for 1 row / packed for 32 rows (scripts/bench_float_linears.py
# --pack-rows): 49152x576 (SmolLM2's head) at 1 row 4.4 / 4.7 / 4.8 ms, 8 rows 16.6 / 8.2 /
# 6.0, 32 rows 12.5 / 12.1 / 11.1; the 1.1B shape's projections at 8 rows 1.8-2.3x faster
# packed than plain (docs/notes/2026-12-04-fp32-pack-rows.md).
FP32_PACK_ROWS = 32
# fp32 weights from this many elements (16 MB) are held packed only. Smaller ones keep their
# plain copy too, for calls of fewer than ``FP32_PACKED_MIN_ROWS`` rows, where ATen's GEMM (MKL)
# wins: a pass of SmolLM2's 30 layers from DRAM, plain / packed, 1 row 14.1 / 19.3 ms, 2 rows
# 16.0 / 21.9, 4 rows 25.3 / 21.0, 8 rows 32.1 / 23.8, 32 rows 48.5 / 41.1, 256 rows 183 / 181.
# The copy costs the small weights' memory twice; large weights lose less at one row (2048x2048:
# 386 / 428 us) and would cost more.
FP32_PACK_MIN_ELEMENTS = 1 << 22
FP32_PACKED_MIN_ROWS = 4


# oneDNN's packed weights under a compiled step. Dynamo cannot trace the opaque tensor, so a
# compiled graph calls this op with the holder's key instead; the tensor stays out of the
# graph. Keys come from a counter (never reused) and the map holds the holders weakly: a
# runtime keeps its holders, and with them its compiled graphs' keys, alive.
_PACKED_HOLDERS: weakref.WeakValueDictionary[int, _FloatLinear] = weakref.WeakValueDictionary()
_PACKED_KEYS = itertools.count()


@torch.library.custom_op("compress_runtime::packed_linear", mutates_args=())
def _packed_linear(x: torch.Tensor, key: int) -> torch.Tensor:
    return _PACKED_HOLDERS[key].onednn(x)


@_packed_linear.register_fake
def _(x: torch.Tensor, key: int) -> torch.Tensor:
    holder = _PACKED_HOLDERS[key]
    return x.new_empty((*x.shape[:-1], holder.n), dtype=holder.packed_dtype)


class _FloatLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, prefill, decode) -> None:
        super().__init__()
        self.w_prefill = nn.Buffer(weight.detach().to(prefill), persistent=False)
        self.w_decode = (
            self.w_prefill
            if decode == prefill
            else nn.Buffer(weight.detach().to(decode), persistent=False)
        )
        self.bias = None if bias is None else nn.Buffer(bias.detach().float(), persistent=False)
        self.n = weight.shape[0]
        # oneDNN's blocked copy of the weight, our AMX tiles, or a plain bf16 copy (``pack``)
        self.packed = None
        self.packed_dtype = weight.dtype  # with ``packed``: the dtype the input is cast to
        self.amx_op = None  # with ``packed`` in our tile order: ``bf16_linear_tiles_amx``
        self.bf16_op = None  # with ``packed`` bf16 [N, K]: ``cpu_float.bf16_weight_linear``

    def pack(self, fp32: bool = True) -> bool:
        """Hold a weight that both phases use in oneDNN's blocked layout instead, on a CPU (a
        compiled step calls it through ``compress_runtime::packed_linear``: dynamo cannot trace
        the opaque tensor): bf16 weights on a CPU with bf16 matmuls, and fp32 weights of at
        least ``FP32_PACK_MIN_ELEMENTS``.

        bf16: plain ``F.linear`` reorders the weight on every call. Measured on a Xeon (AMX), 2
        threads, SmolLM2's shapes at 1-32 rows: 37-76 us a call against 24-40 packed, and
        1.1-1.5x faster from 128 rows on. Outputs are equal at 1-32 rows and within one bf16
        rounding beyond (another blocking of the sum).

        fp32: ATen's GEMM (MKL) halves its speed from 4 rows on, where oneDNN's packed layout
        (picked for ``FP32_PACK_ROWS`` rows) does not; at one or two rows it is the faster, so
        weights under ``FP32_PACK_MIN_ELEMENTS`` keep their plain copy for calls under
        ``FP32_PACKED_MIN_ROWS`` rows (the constants say where this was measured). Outputs are
        within fp32 rounding (another summation order).

        bf16 on a CPU with AMX-BF16 where the shape allows (``cpu_q8.bf16_tiles_reason``): our
        tile order instead (``cpu_q8.bf16_to_tiles``, run by ``bf16_linear_tiles_amx``: fp32
        output). Measured on a Xeon, 2 threads, the 1.1B shape's four projections of a layer
        from DRAM, ours / oneDNN packed: 1 row 3.84 / 5.07 ms, 16 rows 4.06 / 5.35, 17-32 rows
        4.5-4.9 / 7.1-7.5, 64 rows 6.37 / 8.55, 256 rows 16.9 / 18.2
        (docs/notes/2026-12-04-bf16-amx-prefill.md).

        On a CPU without bf16 matmuls, bf16 weights and fp32 weights of bf16 values (a bf16
        checkpoint served in fp32): a bf16 copy run in fp32 by our op, half the bytes a step
        streams (``cpu_float.holds_bf16_copy`` says which and why).

        ``fp32=False`` leaves fp32 weights plain (a compiled step: its plain fp32 GEMMs are
        what it was measured with). Returns whether it packed; the plain weight is then
        released, but for fp32 weights under ``FP32_PACK_MIN_ELEMENTS``."""
        if self.packed is not None:
            return True
        w = self.w_decode
        if self.w_prefill is not w and w.device.type == "cpu" and w.dtype == torch.bfloat16 \
                and self.w_prefill.dtype == torch.float32 and cpu_q8.bf16_tiles_reason(w) is None:
            # a copy per phase (a quantized model's float layers on a CPU with bf16 matmuls):
            # decode from our tiles, prefill from the fp32 copy as before. Measured on a Xeon
            # (AMX), 2 threads, SmolLM2 with W4 MLPs and float attention, one row: 1.6-1.8x the
            # plain copies' tokens/s (docs/notes/2026-12-07-float-copies-per-phase.md)
            self.packed, self.packed_dtype = cpu_q8.bf16_to_tiles(w), w.dtype
            self.amx_op = cpu_q8.ops().bf16_linear_tiles_amx
            self.w_decode = None
            return True
        if self.w_prefill is not w or w.device.type != "cpu":
            return False
        if w.dtype == torch.bfloat16 and cpu_q8.bf16_tiles_reason(w) is None:
            self.packed, self.packed_dtype = cpu_q8.bf16_to_tiles(w), w.dtype
            self.amx_op = cpu_q8.ops().bf16_linear_tiles_amx
            self.w_prefill = self.w_decode = None
            return True
        if cpu_float.holds_bf16_copy(w):  # an fp32 layer's input stays fp32
            self.packed = w.detach().to(torch.bfloat16).contiguous()  # not the Buffer itself
            self.packed_dtype = w.dtype
            self.bf16_op = cpu_q8.ops().bf16_weight_linear
            self.w_prefill = self.w_decode = None
            return True
        if w.dtype == torch.bfloat16:
            if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
                return False
        elif w.dtype != torch.float32 or not fp32:
            return False
        if not torch.backends.mkldnn.is_available():
            return False
        # bf16: the hint changed nothing under oneDNN's AVX512-BF16 code (the same note)
        rows_hint = FP32_PACK_ROWS if w.dtype == torch.float32 else 1
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, rows_hint)
        self.packed_dtype = w.dtype
        self.packed_key = next(_PACKED_KEYS)
        _PACKED_HOLDERS[self.packed_key] = self
        if w.dtype != torch.float32 or w.numel() >= FP32_PACK_MIN_ELEMENTS:
            self.w_prefill = self.w_decode = None
        return True

    @classmethod
    def stacked_packed(cls, parts: list[nn.Module], fp32: bool = True) -> _FloatLinear | None:
        """One packed holder computing ``parts`` (float linears of one input: q/k/v, gate/up)
        as one oneDNN call, their outputs side by side; None where a part is another holder or
        would not pack; parts holding a copy per phase stack unpacked (``pack`` holds one).
        One call instead of three saves oneDNN's fixed cost per call (about 20 us at SmolLM2's
        shapes, 2 threads). fp32 weights on a CPU stack even where oneDNN
        is missing (one ATen GEMM instead of three) for the layer's fused elementwise ops,
        which need the stacked calls. Measured on a Xeon, 2
        threads, SmolLM2 in fp32, 32 requests of 128 + 64 tokens through the scheduler alone:
        10.8-11.0 s unstacked, 10.35-10.43 s stacked (three runs each; docs/notes/
        2026-12-04-attention-and-folded-scales.md)."""
        if not all(type(p) is cls and p.packed is None and p.w_decode is not None for p in parts):
            return None
        if not fp32 and any(p.w_decode.dtype == torch.float32 for p in parts):
            return None
        weights, prefill = [p.w_decode for p in parts], [p.w_prefill for p in parts]
        biases = [p.bias for p in parts]
        bias = None
        if any(b is not None for b in biases):
            pairs = zip(weights, biases, strict=True)
            bias = torch.cat([torch.zeros(w.shape[0]) if b is None else b for w, b in pairs])
        if any(p is not w for p, w in zip(prefill, weights, strict=True)):
            # a copy per phase (a quantized model's float layers on a CPU with bf16 matmuls:
            # fp32 prefill, bf16 decode): stacked alike and left unpacked, as the parts were;
            # stacked, the layer runs its fused elementwise ops
            if any(p is w for p, w in zip(prefill, weights, strict=True)) or len(
                    {(p.dtype, w.dtype) for p, w in zip(prefill, weights, strict=True)}) != 1:
                return None
            holder = cls(torch.cat(prefill), bias, prefill[0].dtype, weights[0].dtype)
            holder.w_decode = torch.cat(weights)  # the parts' own copies, not a cast of these
            return holder
        weight = torch.cat(weights)
        holder = cls(weight, bias, weight.dtype, weight.dtype)
        if holder.pack(fp32):
            return holder
        return holder if weight.dtype == torch.float32 and weight.device.type == "cpu" else None

    def input_dtype(self, decode: bool) -> torch.dtype:
        """The dtype ``native`` takes its input in for a phase (a norm may write it so)."""
        if self.packed is not None and (decode or self.w_prefill is None):
            return self.packed_dtype
        return (self.w_decode if decode else self.w_prefill).dtype

    def forward(self, x: torch.Tensor, decode: bool) -> torch.Tensor:
        y = self.native(x, decode).float()
        return y if self.bias is None else y + self.bias

    def native(self, x: torch.Tensor, decode: bool) -> torch.Tensor:
        """The product in the weight's dtype (fp32 from our AMX tiles and bf16-weight op), bias
        not added (``forward`` widens it to fp32)."""
        tiles = self.amx_op is not None or self.bf16_op is not None
        if tiles and (decode or self.w_prefill is None):  # fp32 or bf16 in, fp32 out
            x2 = x.reshape(-1, x.shape[-1])
            x2 = (x2 if x2.dtype == torch.bfloat16 else x2.float()).contiguous()
            op = self.amx_op if self.amx_op is not None else self.bf16_op
            return op(x2, self.packed).view(*x.shape[:-1], -1)
        w = self.w_decode if decode else self.w_prefill
        rows = x.numel() // x.shape[-1]
        if self.packed is not None and not tiles and (w is None or rows >= FP32_PACKED_MIN_ROWS):
            if torch.compiler.is_compiling():  # the opaque tensor stays out of the graph
                return torch.ops.compress_runtime.packed_linear(x, self.packed_key)
            return self.onednn(x)
        return F.linear(x.to(w.dtype), w)

    def onednn(self, x: torch.Tensor) -> torch.Tensor:
        """The product through oneDNN's packed weight (eager, or inside ``packed_linear``)."""
        x = x.to(self.packed_dtype).contiguous()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
