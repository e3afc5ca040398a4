"""A paged decode step's decoder layers as one C++ call (``csrc/decode_stack.cpp``).

The scheduler's decode-only steps on a CPU (``paged.forward_step`` with the attention kernel)
run every layer through our CPU ops: about a dozen op calls per layer, and the Python and
dispatcher work between them cost as much as the ops at small batches. ``DecodeStack`` hands
the same ops, the same tensors and the same order to C++ once per step, so its output is the
Python loop's bit for bit (the reference, ``tests/runtime/test_decode_stack.py``). Measured on
an AMD EPYC Zen 3 (AVX2, 2 threads), SmolLM2 W4 through the scheduler, both loops in turns in
one process: one row 17.2 -> 7.4 ms a step, 8 rows 38.2 -> 28.1
(docs/notes/2026-12-07-decode-stack.md).

It takes dense layers of the runtime's own attention: ``project_qkv`` and ``finish`` in either
of their forms, the fused ops or torch's (``build`` says why not for the others: those steps
stay in Python); linears of the kinds the runtime holds on a CPU
(``KINDS``); and steps of fewer rows than ``DecodeStack.max_rows``: from there an int layer
leaves its base op (AMX forms, a float GEMM), which the Python holder picks per call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from compress.kernels import cpu_q8
from compress.runtime import float_linear
from compress.runtime.families import ACTIVATIONS
from compress.runtime.float_linear import _FloatLinear
from compress.runtime.layers import _input_dtype, _Int4Linear, _Int8Linear, _Layer

# csrc/decode_stack.cpp's Linear::Kind: the holders a layer's linears may be
KINDS = {
    "q4_tiles": 1,  # _Int4Linear through our int4 column-tile op
    "q4_rows": 2,  # _Int4Linear, row layout
    "q8_rows": 3,  # _Int8Linear, row layout
    "bf16_weight": 4,  # _FloatLinear holding a bf16 copy (cpu_float.bf16_weight_linear)
    "bf16_tiles_amx": 5,  # _FloatLinear in our AMX-BF16 tiles
    "dense": 6,  # _FloatLinear, plain (and oneDNN-packed from FP32_PACKED_MIN_ROWS rows)
    "onednn": 7,  # _FloatLinear, oneDNN-packed only
}
FLOATS = (torch.float32, torch.bfloat16)
# a layer's linears, in csrc/decode_stack.cpp's add_layer order (None where it has none)
LINEARS = ("qkv", "o", "gate_up", "down", "gate", "up", "q", "k", "v")
# the MLP activations it runs, in its Act order (runtime/families.ACTIVATIONS' functions)
ACTS_NAMED = ("silu", "gelu_pytorch_tanh", "gelu", "relu", "relu2")
ACTS = tuple(ACTIVATIONS[name] for name in ACTS_NAMED)


@dataclass
class DecodeStack:
    """The C++ object (``native``) and the rows it serves: steps of 1 to ``max_rows - 1``."""

    native: object
    max_rows: int

    def run(self, x: torch.Tensor, ropes: list[tuple[torch.Tensor, torch.Tensor]],
            slots: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
            cache) -> torch.Tensor:
        """x [R, hidden] fp32, the embedded rows; ``ropes``: (cos, sin) [R, head_dim] per rope
        table, in ``Runtime.rope``'s order; slots [R], tables [R, blocks], lengths [R] as
        ``forward_step`` makes them; ``cache`` a ``PagedKVCache`` of any page dtype (keys and
        values apart) -> [R, hidden] fp32 after every layer (their keys and values written)."""
        return self.native.run(x, [c for c, _ in ropes], [s for _, s in ropes], slots, tables,
                               lengths, cache.k, cache.v, cache.k_scale or [],
                               cache.v_scale or [], cache.block_size)  # fmt: skip


def build(runtime) -> tuple[DecodeStack | None, str | None]:
    """``runtime``'s layers as a ``DecodeStack``, or None and the reason the steps stay in
    Python (the first layer or linear that the C++ loop does not compute as the Python one)."""
    if runtime.device.type != "cpu":
        return None, f"the runtime is on {runtime.device.type}"
    rope_index = {key: i for i, key in enumerate(runtime.rope)}
    limits: list[int] = []
    described: list[tuple] = []
    for i, layer in enumerate(runtime.layers):
        why = _layer_reason(layer)
        if why is not None:
            return None, f"layer {i}: {why}"
        linears = []
        for name in LINEARS:
            holder = getattr(layer, name, None)
            described_linear = None if holder is None else _linear(holder, limits)
            if isinstance(described_linear, str):
                return None, f"layer {i}'s {name}: {described_linear}"
            linears.append(described_linear)
        holders = [getattr(layer, n) for n in ("qkv", "gate_up", "down")]
        inputs = [torch.float32 if h is None else _input_dtype(h, True) for h in holders]
        if any(d not in FLOATS for d in inputs):
            return None, f"layer {i}: a linear reads {inputs} (the C++ loop casts to fp32 or bf16)"
        described.append((layer, linears, inputs, rope_index[layer.rope_key]))
    try:
        native = cpu_q8.classes().DecodeStack()
    except RuntimeError as exc:  # the kernels do not build here
        return None, str(exc)
    for layer, linears, inputs, rope in described:
        ids = [-1 if args is None else native.add_linear(*args) for args in linears]
        norms = [layer.norm_in, layer.norm_post, layer.norm_post_bias, layer.attn_out_norm,
                 layer.mlp_out_norm, layer.norm_q, layer.norm_k, layer.sinks, layer.norm_in_bias,
                 layer.rope_perm]  # fmt: skip
        # which form of project_qkv and finish the Python layer takes (a parallel block
        # returns before the fused finish)
        fused_finish = layer.fuses_finish() and not layer.parallel
        flags = [fused_finish, layer.fuses_qkv(), layer.centered, layer.parallel,
                 layer.qkv_per_head, layer.qk_norm_heads, layer.qk_norm_after_rope]  # fmt: skip
        ints = [layer.n_heads, layer.n_kv, layer.head_dim, rope, layer.window or 0,
                ACTS.index(layer.act), *map(int, flags)]  # fmt: skip
        multiplier = layer.residual_multiplier
        floats = [layer.eps, layer.scale, layer.softcap or 0.0,
                  math.nan if multiplier is None else float(multiplier)]  # fmt: skip
        native.add_layer(norms, ids, [int(d == torch.bfloat16) for d in inputs], ints, floats)
    return DecodeStack(native, min(limits, default=1 << 62)), None


def _layer_reason(layer) -> str | None:
    """Why ``layer``'s decode step is not what the C++ loop repeats, or None: ``project_qkv``
    (fused or torch's ops), paged attention, then ``finish`` in either form."""
    checks = (
        (type(layer) is not _Layer, f"{type(layer).__name__} computes its own attention"),
        (not layer.fused, "the fused CPU ops are off"),
        (layer.sparse_mlp is not None, "a sparse MoE block"),
        (not any(layer.act is act for act in ACTS),
         f"the MLP's activation {layer.act} (the C++ loop runs {ACTS_NAMED})"),
        (layer.parallel and layer.norm_post is None and layer.norm_in is None,
         "a parallel block without a norm"),
        (layer.values_in_keys, "the values are the keys"),
    )  # fmt: skip
    return next((why for failed, why in checks if failed), None)


def _linear(holder, limits: list[int]) -> tuple | str:
    """``DecodeStack.add_linear``'s arguments for ``holder`` (appending to ``limits`` the row
    count from which it would leave that op), or why it has none."""
    if type(holder) in (_Int4Linear, _Int8Linear):
        q8 = holder.q8
        if q8 is None:
            return "torch's int kernel"
        kind = "q4_tiles" if q8.tiles else ("q4_rows" if q8.bits == 4 else "q8_rows")
        if q8.amx_op is not None:
            limits.append(cpu_q8.AMX_MIN_ROWS)
        limits += [r for r in (q8.float_rows, q8.bf16_rows if q8.bf16_op else None)
                   if r is not None]  # fmt: skip
        return (KINDS[kind], q8.codes, q8.scales, q8.offsets, q8.group_size, holder.bias, 0, 0)
    if type(holder) is not _FloatLinear:
        return f"{type(holder).__name__} holds it"
    if holder.amx_op is not None or holder.bf16_op is not None:
        kind = "bf16_tiles_amx" if holder.amx_op is not None else "bf16_weight"
        return (KINDS[kind], holder.packed, None, None, 0, holder.bias, 0, 0)
    cast = holder.packed_dtype if holder.packed is not None else holder.w_decode.dtype
    if cast not in FLOATS:
        return f"{cast} weights"
    bf16 = int(cast == torch.bfloat16)
    if holder.packed is not None and holder.w_decode is None:
        return (KINDS["onednn"], holder.packed, None, None, 0, holder.bias, bf16, 0)
    rows = float_linear.FP32_PACKED_MIN_ROWS  # read now: the holder's rule when it was built
    return (KINDS["dense"], holder.w_decode, None, holder.packed, 0, holder.bias, bf16, rows)
