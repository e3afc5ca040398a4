"""The runtime's holders of a model's modules (``runtime/engine.py`` builds them once per
``Runtime``): each linear layer re-held in the layout each phase wants, one decoder layer and the
head, computed the runtime's way (fp32 residual stream, norms and softmax; matmul inputs in the
phase's dtype).

Linear holders, from the dispatcher's plan per phase (``_convert_linear``): float weights in the
prefill and decode dtypes (``_FloatLinear``), int4/int8 weights repacked once for torch's native
CPU kernels or for our integer-dot kernels (``_Int4Linear``, ``_Int8Linear``, ``_Q8Kernel``),
W8A8 and any other layer called as it is (``_ModuleLinear``). Holders on our kernels that read one
input (q/k/v, gate/up) stack into one call (``_IntLinear.stacked``): the same outputs bit for bit.
A quantized linear whose holder keeps a copy of its own (repacked or dequantized) is released
from the model right after its holder is built (``release_weights``, unless the runtime is
asked to keep the model's weights): the model's tensors become meta tensors and the model's
own forward refuses to run it, so the two copies never coexist beyond one linear.

The decoder layer (``_Layer``) writes its keys and values into the cache buffers it is handed and
attends over them; it holds no cache of its own, so the contiguous runtime and the paged one
(``runtime/paged.py``) share it. The family differences it computes are ``compress.arch``'s
``RuntimeSpec`` read through ``runtime/families.py``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from compress.arch import Arch, RuntimeSpec, layer_arch
from compress.kernels import cpu_attention, cpu_elementwise, cpu_native, cpu_q8
from compress.quant.linear import QuantLinear, WeightScheme
from compress.runtime.families import (
    ACTIVATIONS,
    config_value,
    explicit_attention,
    head_dim_of_config,
    kv_heads_of,
    layer_rope_key,
    layer_window,
    rope_permutation,
)
from compress.runtime.float_linear import _FloatLinear
from compress.runtime.norms import _norm, _norm_bias, _norm_eps, _norm_weight, _rms_norm

LM_HEAD_SCHEMES = {4: WeightScheme(4, 32, True), 8: WeightScheme(8, None, True)}  # RTN


# ---- linear layers, re-held per phase --------------------------------------------------
class _IntKernels(NamedTuple):
    """The runtime's int-layer kernels (both phases): ``int4`` in INT4_KERNELS, ``int8`` in
    INT8_KERNELS."""

    int4: str = "torch"
    int8: str = "torch"


class _Q8Kernel(nn.Module):
    """Our integer-dot kernel (``compress/kernels/cpu_q8.py``: activations rounded to int8 per
    block of 32; one or a few rows for decode, a row-tile GEMM from 8 rows on for prefill).
    From ``float_rows`` rows on (long prompts on the 256-bit levels, row layout only: ``cpu_q8.
    float_gemm_min_rows``; None: never) the layer dequantizes its weights per call and runs
    ATen's fp32 GEMM, which is faster there; those rows skip the activation rounding.

    int4 weights are held in the column-tile layout where the level has one (``cpu_q8.
    to_tiles``, csrc/q8_tiles.cpp: every row count through one kernel; 16
    columns a tile at AVX512-VNNI, 8 at AVX2, N a multiple of that), unless ``tiles=False``;
    from ``cpu_q8.AMX_MIN_ROWS`` rows on where the CPU grants AMX-INT8, through that kernel's
    AMX form (csrc/q8_amx.cpp), bit for bit the same outputs; from ``cpu_q8.
    bf16_amx_min_rows()`` rows where it also has AMX-BF16, through the bf16-activation op
    (``int4_linear_bf16_tiles_amx``: no int8 rounding, so other numbers). Measured on a Xeon
    at AVX512-VNNI (2 threads, weights from DRAM): one row 7-16% faster than the row layout on
    SmolLM2's and the 1.1B shape's layers, 4 rows 2.3-2.8x, 8 rows 2.5-3.8x; the AVX2 form in
    docs/notes/2026-12-07-avx2-column-tiles.md."""

    def __init__(self, w: cpu_q8.Q8Weight, tiles: bool = True) -> None:
        super().__init__()
        isa = cpu_q8.selected_isa()  # the level chosen for this CPU (built on first use)
        ops = cpu_q8.ops(isa)
        if tiles and cpu_q8.tiles_reason(w, isa) is None:
            w = cpu_q8.to_tiles(w, cpu_q8.tile_width(isa))
        # the row layout's GEMM only: the tile op beats the fp32 GEMM at every length measured
        self.float_rows = None if w.tiles else cpu_q8.float_gemm_min_rows(isa, w.bits)
        self.bits, self.tiles = w.bits, w.tiles
        # from AMX_MIN_ROWS rows the AMX form of the tile op where the CPU grants it: the same
        # outputs bit for bit, so the row count of a step never changes a token
        self.amx_op = self.bf16_op = self.bf16_rows = None
        if w.tiles:
            self.op = ops.int4_linear_q8_tiles
            if cpu_q8.amx_reason(isa) is None:
                self.amx_op = ops.int4_linear_q8_tiles_amx
            # from BF16_AMX_MIN_ROWS rows bf16 activations on AMX-BF16: not the int8 ops'
            # numbers, so a step's row count decides how its rows are rounded there
            self.bf16_rows = cpu_q8.bf16_amx_min_rows(isa)
            if self.bf16_rows is not None:
                self.bf16_op = ops.int4_linear_bf16_tiles_amx
        else:
            self.op = ops.int4_linear_q8 if w.bits == 4 else ops.int8_linear_q8
        self.dequantize = ops.dequantize_q4 if w.bits == 4 else ops.dequantize_q8
        self.codes = nn.Buffer(w.codes, persistent=False)
        self.scales = nn.Buffer(w.scales, persistent=False)
        offsets = w.offsets
        self.offsets = None if offsets is None else nn.Buffer(offsets, persistent=False)
        self.group_size = w.group_size

    @property
    def weight(self) -> cpu_q8.Q8Weight:
        """The held weight, in the kernels' layout (rows or column tiles)."""
        return cpu_q8.Q8Weight(
            self.bits, self.codes, self.scales, self.offsets, self.group_size, self.tiles
        )

    def forward(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, K] -> [M, N] fp32."""
        rows = x2.shape[0]
        if self.bf16_op is not None and rows >= self.bf16_rows:
            x2 = x2 if x2.dtype == torch.bfloat16 else x2.float()
            return self.bf16_op(x2.contiguous(), self.codes, self.scales, self.offsets,
                                self.group_size)  # fmt: skip
        x2 = x2.float().contiguous()
        if self.float_rows is not None and rows >= self.float_rows:
            w = self.dequantize(self.codes, self.scales, self.offsets, self.group_size)
            return F.linear(x2, w)
        op = self.op
        if self.amx_op is not None and x2.shape[0] >= cpu_q8.AMX_MIN_ROWS:
            op = self.amx_op
        return op(x2, self.codes, self.scales, self.offsets, self.group_size)


def _q8_kernel(q: QuantLinear) -> _Q8Kernel:
    zp = None if q.scheme.symmetric else q.weight_zero_point
    if q.kind == "int4":
        w = cpu_q8.prepack_int4(
            q.weight_packed, q.weight_scale, zp, group_size=q.group_size, k=q.in_features
        )
    else:
        w = cpu_q8.prepack_int8(q.weight, q.weight_scale, zp, group_size=q.group_size)
    return _Q8Kernel(w)


class _IntLinear(nn.Module):
    """What the int4 and int8 holders share: output width ``n``, fp32 ``bias`` (or None) and
    ``q8``, our integer-dot kernel (None: torch's kernel holds the weights)."""

    n: int
    bias: torch.Tensor | None
    q8: _Q8Kernel | None

    @classmethod
    def stacked(cls, parts: list[nn.Module]) -> _IntLinear | None:
        """One holder of ``cls`` that computes ``parts`` (linears of one input: q/k/v, gate/up)
        as one call of our kernel, their outputs side by side; None where a part is another
        holder, runs torch's kernel, or the weights cannot stack.

        Why: SmolLM2 decodes through 210 int4 calls per token; stacking makes 120, the fixed
        cost per call (activation rounding, output, thread wake-up) is paid once per input,
        and k/v (192 rows, one thread on their own) share the q call's two threads. Measured
        on a Xeon, 2 threads, SmolLM2's 210 int4 g64 layers (``scripts/bench_decode_pass.py
        --stacked``): 6.07 -> 4.48 ms at the AVX2 level, 5.76 -> 4.68 ms at AVX512-VNNI."""
        if not all(type(p) is cls and p.q8 is not None for p in parts):
            return None
        rows = [cpu_q8.from_tiles(w) if w.tiles else w for w in (p.q8.weight for p in parts)]
        weight = cpu_q8.stack(rows)
        if weight is None:
            return None
        # column tiles only where every part has them: a column's value is then the part's bit
        # for bit (each lane computes its own column), as with the row layout
        q8 = _Q8Kernel(weight, tiles=all(p.q8.tiles for p in parts))
        holder = cls.__new__(cls)
        nn.Module.__init__(holder)
        holder.n = sum(p.n for p in parts)
        biases = [p.bias for p in parts]
        if all(b is None for b in biases):
            holder.bias = None
        else:
            zeros = [torch.zeros(p.n, device=q8.scales.device) for p in parts]
            bias = torch.cat([z if b is None else b for z, b in zip(zeros, biases, strict=True)])
            holder.bias = nn.Buffer(bias, persistent=False)
        holder.q8 = q8
        return holder


class _Int4Linear(_IntLinear):
    """int4 weights: torch's native CPU kernel (bf16 activations) in both phases, or with ``q8``
    our Q4 x Q8 kernel in both (``_Q8Kernel``; its row-tile GEMM for prefill), never both
    layouts at once."""

    def __init__(self, q: QuantLinear, q8: bool = False) -> None:
        super().__init__()
        self.n = q.out_features
        self.bias = None if q.bias is None else nn.Buffer(q.bias.detach().float(), persistent=False)
        self.q8 = _q8_kernel(q) if q8 else None
        if q8:
            return
        zp = None if q.scheme.symmetric else q.weight_zero_point
        w = cpu_native.prepack_int4(
            q.weight_packed, q.weight_scale, zp, group_size=q.group_size, k=q.in_features
        )
        self.packed = nn.Buffer(w.packed, persistent=False)
        self.scale_and_zero = nn.Buffer(w.scale_and_zero, persistent=False)
        self.group_size = w.group_size

    def forward(self, x: torch.Tensor, decode: bool) -> torch.Tensor:
        if self.q8 is not None:
            y = self.q8.forward(x.reshape(-1, x.shape[-1]))  # why forward: _native_out
        else:
            x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
            y = torch._weight_int4pack_mm_for_cpu(
                x2, self.packed, self.group_size, self.scale_and_zero
            )
        y = y.float().reshape(*x.shape[:-1], self.n)
        return y if self.bias is None else y + self.bias


class _Int8Linear(_IntLinear):
    """int8 weights (symmetric, per output channel): torch's native CPU kernel (bf16
    activations) in both phases, or with ``q8`` our Q8 x Q8 kernel in both (``_Q8Kernel``)."""

    def __init__(self, q: QuantLinear, q8: bool = False) -> None:
        super().__init__()
        self.n = q.out_features
        self.bias = None if q.bias is None else nn.Buffer(q.bias.detach().float(), persistent=False)
        self.q8 = _q8_kernel(q) if q8 else None
        if q8:
            return
        # Aligned once here: the kernel crashes on weights that are not 16-byte aligned.
        self.weight = nn.Buffer(cpu_native.aligned(q.weight), persistent=False)
        scales = q.weight_scale[:, 0].to(torch.bfloat16)
        self.scales = nn.Buffer(cpu_native.aligned(scales), persistent=False)

    def forward(self, x: torch.Tensor, decode: bool) -> torch.Tensor:
        if self.q8 is not None:
            y = self.q8.forward(x.reshape(-1, x.shape[-1]))  # why forward: _native_out
        else:
            # x is the fp32 residual stream, so .to(bf16) allocates: fresh buffers are 64-byte
            # aligned, as the kernel needs (cpu_native module docstring).
            x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
            y = torch._weight_int8pack_mm(x2, self.weight, self.scales)
        y = y.float().reshape(*x.shape[:-1], self.n)
        return y if self.bias is None else y + self.bias


class _ModuleLinear(nn.Module):
    """Any other layer (e.g. QuantLinear on CUDA through Triton): call it as it is."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module, self.dtype = module, dtype
        self.n = module.out_features

    def forward(self, x: torch.Tensor, decode: bool) -> torch.Tensor:
        return self.module(x.to(self.dtype)).float()


def _convert_linear(
    module: nn.Module,
    name: str,
    prefill,
    decode,
    notes: list[str],
    kernels: _IntKernels = _IntKernels(),  # noqa: B008  (an immutable tuple)
    *,
    release: bool = False,
) -> nn.Module:
    """The runtime's holder of one linear layer, from the dispatcher's plan per phase.
    ``release``: drop the model's tensors of a quantized layer whose holder keeps its own copy
    (``release_weights``)."""
    if not isinstance(module, QuantLinear):
        assert isinstance(module, nn.Linear), f"{name} is {type(module).__name__}"
        return _FloatLinear(module.weight, module.bias, prefill, decode)
    if module.weight_scale.is_meta:
        raise RuntimeError(
            f"{name}: this quantized layer's weights were handed to another compress Runtime "
            "and released from the model; build that first Runtime with "
            "keep_model_weights=True to build more, or share it (Runtime.fork)"
        )
    holder = _quantized_holder(module, name, prefill, decode, notes, kernels)
    if release and not isinstance(holder, _ModuleLinear):
        release_weights(module, name)
    return holder


def _quantized_holder(
    module: QuantLinear, name: str, prefill, decode, notes: list[str], kernels: _IntKernels
) -> nn.Module:
    if module.kind == "w8a8":
        # Per-token int8 activations are part of the format. The layer runs itself (its own
        # plan), so the runtime computes what evaluation measured (a weight-only int8 kernel
        # would not).
        return _ModuleLinear(module, torch.float32)
    device = module.weight_scale.device
    prefs = dict(int4_kernel=kernels.int4, int8_kernel=kernels.int8)
    plan = module.plan(device, phase="prefill", **prefs)
    q8 = module.plan(device, phase="decode", **prefs).backend in ("q4q8", "q8q8")
    if plan.backend in ("cpu", "q4q8", "q8q8"):
        return _Int4Linear(module, q8=q8) if module.kind == "int4" else _Int8Linear(module, q8=q8)
    if plan.backend == "reference" and device.type == "cpu":
        # Correct but not compressed in memory: the reference path re-dequantizes per call.
        reason = plan.reason or f"backend={module.backend!r}"
        notes.append(f"{name}: {reason}; dequantized once to {decode}")
        return _FloatLinear(module.dequantized_weight(), module.bias, decode, decode)
    return _ModuleLinear(module, decode)


def release_weights(module: QuantLinear, name: str) -> None:
    """Drop the model's own tensors of a quantized linear that a runtime now holds in its own
    layout: every buffer and parameter becomes a meta tensor of the same shape and dtype (shapes
    stay readable, no memory stays held by the model; storage a holder shares, such as an
    aligned int8 weight or an fp32 bias, stays alive through the holder), the layer's cached
    repacks are cleared, and calling the layer raises, naming the way to keep both."""
    with torch.no_grad():
        for key, t in list(module._buffers.items()):
            if t is not None:
                module._buffers[key] = t.to("meta")
        for key, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[key] = nn.Parameter(p.to("meta"), requires_grad=False)
    module._prepared.clear()  # plans and repacks of the tensors just dropped
    module.register_forward_pre_hook(functools.partial(_refuse_released, name))


def _refuse_released(name: str, module: nn.Module, args) -> None:
    raise RuntimeError(
        f"{name}: this layer's weights were handed to a compress Runtime and released from the "
        "model; build the Runtime with keep_model_weights=True to run the model itself too (a "
        "second copy of every quantized layer)"
    )


# ---- decoder layer ---------------------------------------------------------------------
def _input_dtype(holder: nn.Module, decode: bool) -> torch.dtype:
    """The dtype a linear holder casts its input to: a float layer's weight dtype (a norm may
    write it directly, sparing the cast); fp32 for the others (int kernels quantize or cast
    their fp32 input themselves)."""
    if isinstance(holder, _FloatLinear):
        return holder.input_dtype(decode)
    return torch.float32


def _native_out(holder: nn.Module, x: torch.Tensor, decode: bool) -> torch.Tensor:
    """A holder's output as its matmul leaves it (bf16 for a bf16 float layer without a bias:
    no fp32 copy; the fused ops and a promoting add widen it exactly), else fp32. Calls
    ``forward`` itself: the holders take no hooks, and nn.Module's call path cost about 1 ms of
    a 16 ms one-row SmolLM2 W4 step through the scheduler (cProfile, 2 cores)."""
    if isinstance(holder, _FloatLinear) and holder.bias is None:
        return holder.native(x, decode)
    return holder.forward(x, decode)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _Layer(nn.Module):
    values_in_keys = False  # True: the cached values are the keys (one tensor; runtime.latent)
    absorbed: tuple[str, ...] = ()  # projections a subclass computes itself (not converted)

    def __init__(self, layer: nn.Module, config, prefill, decode, notes: list[str], i: int,
                 kernels: _IntKernels, arch: Arch, *, spec: RuntimeSpec, release: bool = False):
        super().__init__()
        # an MoE model's layer with a dense MLP runs it as a dense family's, through our kernels
        arch = layer_arch(arch, layer)
        self.n_heads, self.n_kv = config.num_attention_heads, kv_heads_of(config, arch)
        # the fused qkv output is [q_h; k_h; v_h] per head (GPT-NeoX), not [q; k; v]
        self.qkv_per_head = arch.qkv_per_head
        self.head_dim = head_dim_of_config(config)
        self.eps = _norm_eps(config, spec.norm_eps_key, layer.get_submodule(
            arch.attn_norm or arch.post_norms[0]))
        # LayerNorm families (Arch.norm_kind): mean-centred norms with biases, through torch's
        # ops (the fused CPU ops are RMSNorms)
        self.centered = arch.norm_kind == "layer"
        # Phi, Cohere: attention and MLP read the same normed input, added to x together;
        # GPT-NeoX (its config says): each reads its own norm of the same x
        self.parallel = arch.parallel or bool(
            spec.parallel_residual_key and getattr(config, spec.parallel_residual_key, False))
        self.scale = float(layer.get_submodule(arch.attention).scaling)
        # Read by Runtime._apply, not by forward: which rope table and mask this layer takes.
        self.window = layer_window(config, i)
        self.rope_key = layer_rope_key(config, arch, spec, i)
        self.act = (layer.get_submodule(spec.activation_module) if spec.activation_module
                    else ACTIVATIONS[getattr(config, spec.activation_key, "silu")])
        # Eager CPU runtimes set this: norms, RoPE and SiLU x up through the fused ops of
        # kernels.cpu_elementwise (where q/k/v and gate/up are one stacked call each)
        self.fused = False
        # CPU runtimes set it where it builds: one-query attention through that op, not SDPA
        self.cache_attention = None  # a level's cpu_attention.cache_decode_attention op
        self.prefill_attention = None  # a level's cpu_attention.causal_prefill_attention op
        self.softcap = config_value(config, spec.attn_softcap)
        self.register_buffer("sinks", layer.get_parameter(arch.attention_sinks).detach().float()
                             if arch.attention_sinks else None, persistent=False)  # fmt: skip
        self.residual_multiplier = config_value(config, spec.residual_multiplier)
        form = arch.norm_form
        # None: the family has no norm before the block (OLMo2: its norms come after them)
        self.norm_in, self.norm_post = (
            None if path is None else _norm_weight(layer.get_submodule(path), form)
            for path in (arch.attn_norm, arch.mlp_norm)
        )
        self.norm_in_bias, self.norm_post_bias = (
            None if path is None else _norm_bias(layer.get_submodule(path))
            for path in (arch.attn_norm, arch.mlp_norm)
        )
        # q/k norms over all heads at once (OLMo2: weights [H * D] and [KVH * D]), else per head
        self.qk_norm_heads = arch.qk_norm_span == "heads"
        # per-head q/k norms on the rotated q/k (HunYuan), else before RoPE
        self.qk_norm_after_rope = spec.qk_norm_after_rope
        # q/k channels reordered so that rotating halves is the family's RoPE (partial or
        # interleaved); None: already so
        perm = rope_permutation(config, spec)
        device = next(layer.parameters()).device
        self.rope_perm = None if perm is None else nn.Buffer(perm.to(device), persistent=False)
        qk, post = arch.qk_norms or (None, None), arch.post_norms or (None, None)
        norms = {
            "norm_q": qk[0],
            "norm_k": qk[1],
            "attn_out_norm": post[0],
            "mlp_out_norm": post[1],
        }
        for name, path in norms.items():
            weight = None if path is None else _norm_weight(layer.get_submodule(path), form)
            setattr(self, name, weight)
        # The projections, in the order forward uses them: the runtime's own short names.
        paths = {n: p for n, p in zip("qkvo", (arch.q, arch.k, arch.v, arch.o), strict=True)
                 if n not in self.absorbed}
        if arch.moe is None:  # a non-gated MLP (Arcee) has no gate path: down(act(up(x)))
            mlp = {"gate": arch.gate, "up": arch.up, "down": arch.down}
            paths.update({name: path for name, path in mlp.items() if path})
            self.gate = None
        # A family whose checkpoint fuses them (Phi-3's qkv_proj [q; k; v], gate_up_proj
        # [gate; up]) names one linear for every part: it is the stacked call itself.
        stacks = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}
        for stack, parts in stacks.items():
            if parts[0] in paths and len({paths.get(p) for p in parts}) == 1:
                paths[stack] = paths[parts[0]]
                for part in parts:
                    del paths[part]
                    setattr(self, part, None)
        # MoE: the family's own sparse block (router + experts, QuantExperts when quantized):
        # routing is data-dependent, so it runs as transformers' module inside our layer
        self.sparse_mlp = None if arch.moe is None else layer.get_submodule(arch.moe.block)
        # the dtype the model runs it in: its norms' (a dense MLP an MoE config leaves in some
        # layers, mlp_only_layers, may hold no float parameter once quantized)
        self.sparse_dtype = None if arch.moe is None else next(
            p.dtype for p in layer.parameters() if p.is_floating_point())  # fmt: skip
        for name, path in paths.items():
            linear = _convert_linear(
                layer.get_submodule(path), f"layers.{i}.{path}", prefill, decode, notes, kernels,
                release=release,
            )  # fmt: skip
            setattr(self, name, linear)
        # Projections of one input as one kernel call where they can (_IntLinear.stacked):
        # qkv (then q, k, v are None) and gate_up (then gate, up are None); else None.
        if "qkv" not in paths:
            self.qkv = self._stack("q", "k", "v")
        if "gate_up" not in paths:
            self.gate_up = self._stack("gate", "up") if arch.moe is None and arch.gate else None

    def _stack(self, *names: str) -> nn.Module | None:
        parts = [getattr(self, name) for name in names]
        holder = type(parts[0])
        stacked = holder.stacked(parts) if issubclass(holder, _IntLinear) else None
        if stacked is not None:
            for name in names:
                setattr(self, name, None)
        return stacked

    def pack_float(self, fp32: bool = True) -> None:
        """For runtimes on a CPU: bf16 float projections held packed for oneDNN
        (``_FloatLinear.pack``), q/k/v and gate/up as one packed call each where every part
        packs (then the parts are None, as with stacked int holders). ``fp32=False``: fp32
        projections stay as they are (``_FloatLinear.pack``)."""
        for attr, names in (("qkv", ("q", "k", "v")), ("gate_up", ("gate", "up"))):
            parts = [getattr(self, name, None) for name in names]
            if getattr(self, attr) is not None or any(p is None for p in parts):
                continue
            stacked = _FloatLinear.stacked_packed(parts, fp32)
            if stacked is not None:
                setattr(self, attr, stacked)
                for name in names:
                    setattr(self, name, None)
        for module in self.modules():
            if isinstance(module, _FloatLinear):
                module.pack(fp32)

    def forward(self, x, cos, sin, mask, k_cache, v_cache, slots, decode: bool, length: int):
        """x [B, T, H] fp32; cos/sin [B, T, D]; mask [B, 1, T, T] (prefill; None: causal,
        ``attend``) or [B, 1, 1, L] (decode) bool; caches [B_max, Hkv, S, D], this layer's
        whole buffers (see ``Runtime._apply``); slots [T] cache indices the T new positions
        are written to; decode attends to the first ``length`` slots."""
        b, t, _ = x.shape
        q, k, v = self.project_qkv(x, cos, sin, decode)
        # the whole buffer when every row is in use: a write into a view of a compiled graph's
        # input costs a copy of the view
        full = b == k_cache.shape[0]
        (k_cache if full else k_cache[:b]).index_copy_(2, slots, k.to(k_cache.dtype))
        if not self.values_in_keys:  # else v_cache is k_cache
            (v_cache if full else v_cache[:b]).index_copy_(2, slots, v.to(v_cache.dtype))
        # Prefill attends to its own fresh (prefill-dtype) keys: the cache holds nothing older.
        keys, values = (k_cache[:b, :, :length], v_cache[:b, :, :length]) if decode else (k, v)
        return self.finish(x, self.attend(q, keys, values, mask), decode)

    def project_qkv(self, x, cos, sin, decode: bool):
        """x [B, T, H] fp32 -> q [B, heads, T, D], k and v [B, kv_heads, T, D]: normed,
        projected, q/k-normed and rotated (cos/sin [B, T, D])."""
        b, t, _ = x.shape
        if self.fuses_qkv():
            return self._project_qkv_fused(x, cos, sin, decode)
        h = x if self.norm_in is None else _norm(
            x, self.norm_in, self.eps, self.norm_in_bias, self.centered)  # fmt: skip
        if self.qkv is not None and self.qkv_per_head:  # [B, T, heads, 3, D]: q, k, v per head
            q, k, v = self.qkv(h, decode).view(b, t, self.n_heads, 3, self.head_dim).unbind(3)
        elif self.qkv is not None:
            kv_width = self.n_kv * self.head_dim
            q, k, v = self.qkv(h, decode).split([self.qkv.n - 2 * kv_width, kv_width, kv_width], -1)
        else:
            q, k, v = self.q(h, decode), self.k(h, decode), self.v(h, decode)
        if self.norm_q is not None and self.qk_norm_heads:  # over all heads, before RoPE
            q, k = _rms_norm(q, self.norm_q, self.eps), _rms_norm(k, self.norm_k, self.eps)
        q = q.view(b, t, self.n_heads, self.head_dim)
        k = k.view(b, t, self.n_kv, self.head_dim)
        per_head = self.norm_q is not None and not self.qk_norm_heads
        if per_head and not self.qk_norm_after_rope:  # per head, over D, before RoPE
            q, k = _rms_norm(q, self.norm_q, self.eps), _rms_norm(k, self.norm_k, self.eps)
        if self.rope_perm is not None:
            q, k = q.index_select(-1, self.rope_perm), k.index_select(-1, self.rope_perm)
        # [B, T, heads, D] -> [B, heads, T, D]
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if per_head and self.qk_norm_after_rope:  # per head, over D, after RoPE
            q, k = _rms_norm(q, self.norm_q, self.eps), _rms_norm(k, self.norm_k, self.eps)
        return q, k, v

    def fuses_qkv(self) -> bool:
        """Whether ``project_qkv`` runs the fused CPU ops (``_project_qkv_fused``; also read by
        runtime/decode_stack.py). The fused op norms per head, then rotates halves of the
        projection's own channel order."""
        plain_heads = (
            not self.qk_norm_heads and not self.qk_norm_after_rope and self.rope_perm is None
        )
        return self.fused and not self.centered and self.qkv is not None and plain_heads

    def fuses_finish(self) -> bool:
        """Whether ``finish`` runs ``_finish_fused`` (for a block that is not parallel)."""
        return (self.fused and not self.centered and self.gate_up is not None
                and self.act is F.silu)  # fmt: skip

    def _project_qkv_fused(self, x, cos, sin, decode: bool):
        """``project_qkv`` through the fused CPU ops (``kernels.cpu_elementwise``): the norm
        written in the projection's input dtype, then q/k norms and RoPE in one call. q, k and v
        come back as [B, heads, T, D] views of token-major [B * T, heads, D] tensors: the paged
        decode kernel and the cache writes read the rows without a copy."""
        b, t, _ = x.shape
        dtype = _input_dtype(self.qkv, decode)
        h = x.to(dtype) if self.norm_in is None else cpu_elementwise.rms_norm(
            x, self.norm_in, self.eps, dtype)  # fmt: skip
        qkv = _native_out(self.qkv, h, decode).view(b * t, -1)
        d = self.head_dim
        q, k, v = cpu_elementwise.rope_qkv(
            qkv, cos.expand(b, t, d).reshape(b * t, d), sin.expand(b, t, d).reshape(b * t, d),
            self.n_heads, self.n_kv, self.norm_q, self.norm_k, self.eps,
        )  # fmt: skip
        return tuple(y.view(b, t, -1, d).transpose(1, 2) for y in (q, k, v))

    def attend(self, q, keys, values, mask) -> torch.Tensor:
        """q [B, heads, T, D] over keys/values [B, kv_heads, L, D] (their dtype) with a bool
        mask broadcastable to [B, 1, T, L], or None: causal, the queries being the last T of
        the L keys (query i sees keys 0 .. L - T + i: a prompt's chunk that no window cuts;
        L = T from position 0) -> [B, T, heads * D] fp32. None lets SDPA skip the blocks above
        the diagonal instead of reading a mask (is_causal, where L = T): SmolLM2's 9 heads over
        1,024 tokens took 16.0 ms against 22.5 with the same causal mask as a tensor, the same
        outputs bit for bit (Zen 3, 2 threads). Where the runtime holds ``prefill_attention``
        (cpu_attention.prefill_unavailable_reason), a causal chunk goes through our kernel
        instead (flash-style, fp32; 1.0-1.8x SDPA's speed where it is held)."""
        b, _, t, _ = q.shape
        if (mask is not None and self.cache_attention is not None
                and cpu_attention.cache_kernel_reads(q, keys, values)):  # fmt: skip
            return cpu_attention.attend_decode(self.cache_attention, q, keys, values, mask,
                                               self.scale, self.softcap, self.sinks)
        offset = keys.shape[2] - t  # a causal chunk's first position
        if (mask is None and self.prefill_attention is not None and self.softcap is None
                and self.sinks is None and cpu_attention.prefill_kernel_reads(q, keys, values)):
            # [T, heads * D] fp32 from q [heads, T, D] over keys/values [Hkv, L, D]
            return self.prefill_attention(q[0], keys[0], values[0], self.scale, offset)[None]
        if mask is None and offset:  # SDPA's is_causal puts query i over keys 0 .. i
            mask = torch.ones(t, keys.shape[2], dtype=torch.bool, device=q.device).tril(offset)
        if self.softcap is None and self.sinks is None:
            a = F.scaled_dot_product_attention(
                q.to(keys.dtype),
                keys,
                values,
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=self.n_heads != self.n_kv,
            )
        else:
            if mask is None:
                mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
            a = explicit_attention(q.to(keys.dtype), keys, values, mask, self.scale,
                                   self.softcap, self.sinks)
        # [B, heads, T, D] -> [B, T, heads * D]
        return a.float().transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)

    def finish(self, x, a, decode: bool) -> torch.Tensor:
        """The rest of the layer after attention ``a`` [B, T, heads * D]: output projection,
        residual, MLP (or the sparse block), residual -> [B, T, H] fp32."""
        if self.parallel:  # the MLP reads a norm of the block's input, not the new residual
            own = self.norm_post is not None  # GPT-NeoX: its own norm; Phi, Cohere: attention's
            h = _norm(x, self.norm_post if own else self.norm_in, self.eps,
                      self.norm_post_bias if own else self.norm_in_bias, self.centered)
            return x + self._block_out(self.o(a, decode), None) + self._block_out(
                self._mlp(h, decode), None)  # fmt: skip
        if self.fuses_finish():
            return self._finish_fused(x, a, decode)
        x = x + self._block_out(self.o(a, decode), self.attn_out_norm)
        h = x if self.norm_post is None else _norm(
            x, self.norm_post, self.eps, self.norm_post_bias, self.centered)  # fmt: skip
        return x + self._block_out(self._mlp(h, decode), self.mlp_out_norm)

    def _mlp(self, h: torch.Tensor, decode: bool) -> torch.Tensor:
        """The MLP (or the sparse block) on its normed input ``h``."""
        if self.sparse_mlp is not None:
            return self._routed(h)
        if self.gate_up is not None:
            gate, up = self.gate_up(h, decode).chunk(2, -1)
            return self.down(self.act(gate) * up, decode)
        if self.gate is not None:
            return self.down(self.act(self.gate(h, decode)) * self.up(h, decode), decode)
        return self.down(self.act(self.up(h, decode)), decode)  # not gated

    def _finish_fused(self, x, a, decode: bool) -> torch.Tensor:
        """``finish`` through the fused CPU ops: the residual add and the MLP norm in one call
        (where the attention block adds its output as it is), SiLU x up in one, the matmul
        outputs as they leave the matmul (the adds widen bf16 exactly)."""
        gate_up_dtype = _input_dtype(self.gate_up, decode)
        if self.norm_post is None:  # EXAONE 4: the MLP reads the residual stream itself
            x = x + self._block_out(self.o(a, decode), self.attn_out_norm)
            h = x.to(gate_up_dtype)
        elif self.attn_out_norm is None and self.residual_multiplier is None:
            x, h = cpu_elementwise.add_rms_norm(x, _native_out(self.o, a, decode), self.norm_post,
                                                self.eps, gate_up_dtype)  # fmt: skip
        else:
            x = x + self._block_out(self.o(a, decode), self.attn_out_norm)
            h = cpu_elementwise.rms_norm(x, self.norm_post, self.eps, gate_up_dtype)
        up = cpu_elementwise.silu_mul(_native_out(self.gate_up, h, decode),
                                      _input_dtype(self.down, decode))  # fmt: skip
        if self.mlp_out_norm is None and self.residual_multiplier is None:
            return x + _native_out(self.down, up, decode)  # promotes to fp32: one op
        return x + self._block_out(self.down(up, decode), self.mlp_out_norm)

    def _routed(self, h: torch.Tensor) -> torch.Tensor:
        """The sparse MoE block on ``h [B, T, H]``, in the model's dtype, back to fp32."""
        out = self.sparse_mlp(h.to(self.sparse_dtype))
        return (out[0] if isinstance(out, tuple) else out).float()

    def _block_out(self, y: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """What a block adds to the residual: its output, post-normed (Gemma) and scaled
        (Granite) where the family does."""
        if norm is not None:
            y = _rms_norm(y, norm, self.eps)
        if self.residual_multiplier is not None:
            y = y * self.residual_multiplier
        return y
