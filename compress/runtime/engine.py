"""Generation runtime for decoder-only models (plain or with our QuantLinear layers): Llama and
the families whose arithmetic ``compress.arch.RUNTIME_SPECS`` describes (Qwen2/3, Mistral,
Granite, Gemma 2/3 text: q/k norms, post-norms, multipliers, softcaps, sliding windows).

The idea is gpt-fast's: a pre-allocated static KV cache, a decode step whose shapes never
change (so it compiles once), and a plain Python loop around it instead of ``generate()``.
The model's weights are re-held once at construction in the layout each phase wants:
native CPU int4/int8 kernels for QuantLinear layers (one-time repack), float weights in the
prefill and decode dtypes. Numerics do not depend on the CPU class: by default prefill runs
in the weights' dtype and so does decode of a float model (an fp32 model is fp32 throughout,
its greedy tokens equal transformers'); a quantized model decodes its remaining float layers
in bf16, as the native kernels take bf16 activations. Reduced-precision prefill is opt-in.
The residual stream, norms and softmax stay fp32; only the matmul inputs change dtype. Layers
on our integer-dot kernels run each decoder layer's q/k/v and gate/up as one call each (their
weights stacked, ``_IntLinear.stacked``): the same outputs bit for bit, 4 calls instead of 7.

The decode step is compiled whole (``compile=True`` or ``"step"``): embedding, every layer and
the head in one graph, so a token costs one compiled-region entry and one guard check (issue 19:
with one graph per layer, guards and region entry were 15% of a W4 token on an AVX2 CPU). The
first call compiles every layer's code (longer than one layer's); one graph per power-of-two
key length. ``compile="layer"`` compiles one decoder layer that serves every layer instead.
Prefill runs eager by default; ``compile_prefill=True`` pads prompts to power-of-two buckets
and compiles once per bucket. Batches are left-padded; each row has its own positions.

Sliding-window layers mask keys ``sliding_window`` or more slots behind the query; the cache
keeps every slot (no ring buffer). Not supported (falls back to transformers ``generate`` with
a warning; ``unsupported_reason`` says why): families without a ``RuntimeSpec``, rope types
whose tables depend on the sequence length, other activations and layer types, bidirectional
attention. Attention reads the filled cache prefix each step: size ``max_seq_len`` to the job.
"""

from __future__ import annotations

import copy
import logging
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from compress.arch import (
    RUNTIME_SPECS,
    Arch,
    NormForm,
    RuntimeSpec,
    arch_for,
    decoder_layers,
    runtime_model_types,
)
from compress.core.errors import NumericsError
from compress.kernels import cpu_native, cpu_q8, dispatch
from compress.quant.linear import QuantLinear, WeightScheme
from compress.runtime.families import (
    ACTIVATIONS,
    config_unsupported_reason,
    config_value,
    embed_factor,
    layer_window,
    rope_tables,
    softcapped_attention,
    window_mask,
)

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = runtime_model_types()  # compress.arch entries with runtime=True
INT4_KERNELS = dispatch.INT4_KERNELS
INT8_KERNELS = dispatch.INT8_KERNELS
LM_HEAD_SCHEMES = {4: WeightScheme(4, 32, True), 8: WeightScheme(8, None, True)}  # RTN


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the runtime cannot run ``model`` itself (then it falls back), or None."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    arch = arch_for(model, "compress runtime")
    if arch.attn_norm is None or arch.mlp_norm is None or arch.qk_norm_span != "head":
        return (
            f"model_type {model_type!r}: the runtime's layer needs pre-norms and per-head q/k norms"
        )
    return config_unsupported_reason(config, RUNTIME_SPECS[model_type])


# ---- linear layers, re-held per phase --------------------------------------------------
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

    def forward(self, x: torch.Tensor, decode: bool) -> torch.Tensor:
        w = self.w_decode if decode else self.w_prefill
        y = F.linear(x.to(w.dtype), w).float()
        return y if self.bias is None else y + self.bias


class _IntKernels(NamedTuple):
    """The runtime's int-layer kernels (both phases): ``int4`` in INT4_KERNELS, ``int8`` in
    INT8_KERNELS."""

    int4: str = "torch"
    int8: str = "torch"


class _Q8Kernel(nn.Module):
    """Our integer-dot kernel (``compress/kernels/cpu_q8.py``: activations rounded to int8 per
    block of 32; one or a few rows for decode, a row-tile GEMM from 8 rows on for prefill).
    From ``float_rows`` rows on (long prompts on the 256-bit levels: ``cpu_q8.
    float_gemm_min_rows``; None: never) the layer dequantizes its weights per call and runs
    ATen's fp32 GEMM, which is faster there; those rows skip the activation rounding."""

    def __init__(self, w: cpu_q8.Q8Weight) -> None:
        super().__init__()
        isa = cpu_q8.selected_isa()  # the level chosen for this CPU (built on first use)
        ops = cpu_q8.ops(isa)
        self.bits = w.bits
        self.op = ops.int4_linear_q8 if w.bits == 4 else ops.int8_linear_q8
        self.dequantize = ops.dequantize_q4 if w.bits == 4 else ops.dequantize_q8
        self.float_rows = cpu_q8.float_gemm_min_rows(isa, w.bits)
        self.codes = nn.Buffer(w.codes, persistent=False)
        self.scales = nn.Buffer(w.scales, persistent=False)
        offsets = w.offsets
        self.offsets = None if offsets is None else nn.Buffer(offsets, persistent=False)
        self.group_size = w.group_size

    @property
    def weight(self) -> cpu_q8.Q8Weight:
        """The held weight, in the kernels' layout."""
        return cpu_q8.Q8Weight(self.bits, self.codes, self.scales, self.offsets, self.group_size)

    def forward(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, K] -> [M, N] fp32."""
        x2 = x2.float().contiguous()
        if self.float_rows is not None and x2.shape[0] >= self.float_rows:
            w = self.dequantize(self.codes, self.scales, self.offsets, self.group_size)
            return F.linear(x2, w)
        return self.op(x2, self.codes, self.scales, self.offsets, self.group_size)


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
        weight = cpu_q8.stack([p.q8.weight for p in parts])
        if weight is None:
            return None
        q8 = _Q8Kernel(weight)
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
            y = self.q8(x.reshape(-1, x.shape[-1]))
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
            y = self.q8(x.reshape(-1, x.shape[-1]))
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

    def forward(self, x: torch.Tensor, decode: bool) -> torch.Tensor:
        return self.module(x.to(self.dtype)).float()


def _convert_linear(
    module: nn.Module,
    name: str,
    prefill,
    decode,
    notes: list[str],
    kernels: _IntKernels = _IntKernels(),  # noqa: B008  (an immutable tuple)
) -> nn.Module:
    """The runtime's holder of one linear layer, from the dispatcher's plan per phase."""
    if not isinstance(module, QuantLinear):
        assert isinstance(module, nn.Linear), f"{name} is {type(module).__name__}"
        return _FloatLinear(module.weight, module.bias, prefill, decode)
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


# ---- decoder layer ---------------------------------------------------------------------
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _norm_weight(norm: nn.Module, form: NormForm) -> nn.Buffer:
    """The norm's multiplier in fp32: ``w``, or ``1 + w`` (Gemma, which adds in fp32 too)."""
    w = norm.weight.detach().float()
    return nn.Buffer(w if form == "w" else 1.0 + w, persistent=False)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _Layer(nn.Module):
    def __init__(
        self,
        layer: nn.Module,
        config,
        prefill,
        decode,
        notes: list[str],
        i: int,
        kernels: _IntKernels,
        arch: Arch,
        *,
        spec: RuntimeSpec,
    ):
        super().__init__()
        self.n_heads, self.n_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.eps = float(config.rms_norm_eps)
        self.scale = float(layer.get_submodule(arch.attention).scaling)
        # Read by Runtime._apply, not by forward: which rope table and mask this layer takes.
        self.window = layer_window(config, i)
        self.rope_key = config.layer_types[i] if spec.rope_per_layer_type else None
        self.act = ACTIVATIONS[getattr(config, spec.activation_key, "silu")]
        self.softcap = config_value(config, spec.attn_softcap)
        self.residual_multiplier = config_value(config, spec.residual_multiplier)
        form = arch.norm_form
        self.norm_in = _norm_weight(layer.get_submodule(arch.attn_norm), form)
        self.norm_post = _norm_weight(layer.get_submodule(arch.mlp_norm), form)
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
        paths = {"q": arch.q, "k": arch.k, "v": arch.v, "o": arch.o}
        if arch.moe is None:
            paths.update(gate=arch.gate, up=arch.up, down=arch.down)
        # MoE: the family's own sparse block (router + experts, QuantExperts when quantized):
        # routing is data-dependent, so it runs as transformers' module inside our layer
        self.sparse_mlp = None if arch.moe is None else layer.get_submodule(arch.moe.block)
        for name, path in paths.items():
            linear = _convert_linear(
                layer.get_submodule(path), f"layers.{i}.{path}", prefill, decode, notes, kernels
            )
            setattr(self, name, linear)
        # Projections of one input as one kernel call where they can (_IntLinear.stacked):
        # qkv (then q, k, v are None) and gate_up (then gate, up are None); else None.
        self.qkv = self._stack("q", "k", "v")
        self.gate_up = self._stack("gate", "up") if arch.moe is None else None

    def _stack(self, *names: str) -> nn.Module | None:
        parts = [getattr(self, name) for name in names]
        holder = type(parts[0])
        stacked = holder.stacked(parts) if issubclass(holder, _IntLinear) else None
        if stacked is not None:
            for name in names:
                setattr(self, name, None)
        return stacked

    def forward(self, x, cos, sin, mask, k_cache, v_cache, slots, decode: bool, length: int):
        """x [B, T, H] fp32; cos/sin [B, T, D]; mask [B, 1, T, T] (prefill) or [B, 1, 1, L]
        (decode) bool; caches [B_max, Hkv, S, D], this layer's whole buffers (see
        ``Runtime._apply``); slots [T] cache indices the T new positions are written to;
        decode attends to the first ``length`` slots."""
        b, t, _ = x.shape
        q, k, v = self.project_qkv(x, cos, sin, decode)
        # the whole buffer when every row is in use: a write into a view of a compiled graph's
        # input costs a copy of the view
        full = b == k_cache.shape[0]
        (k_cache if full else k_cache[:b]).index_copy_(2, slots, k.to(k_cache.dtype))
        (v_cache if full else v_cache[:b]).index_copy_(2, slots, v.to(v_cache.dtype))
        # Prefill attends to its own fresh (prefill-dtype) keys: the cache holds nothing older.
        keys, values = (k_cache[:b, :, :length], v_cache[:b, :, :length]) if decode else (k, v)
        return self.finish(x, self.attend(q, keys, values, mask), decode)

    def project_qkv(self, x, cos, sin, decode: bool):
        """x [B, T, H] fp32 -> q [B, heads, T, D], k and v [B, kv_heads, T, D]: normed,
        projected, q/k-normed and rotated (cos/sin [B, T, D])."""
        b, t, _ = x.shape
        h = _rms_norm(x, self.norm_in, self.eps)
        if self.qkv is not None:
            kv_width = self.n_kv * self.head_dim
            q, k, v = self.qkv(h, decode).split([self.qkv.n - 2 * kv_width, kv_width, kv_width], -1)
        else:
            q, k, v = self.q(h, decode), self.k(h, decode), self.v(h, decode)
        q = q.view(b, t, self.n_heads, self.head_dim)
        k = k.view(b, t, self.n_kv, self.head_dim)
        if self.norm_q is not None:  # per head, over D, before RoPE
            q, k = _rms_norm(q, self.norm_q, self.eps), _rms_norm(k, self.norm_k, self.eps)
        # [B, T, heads, D] -> [B, heads, T, D]
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def attend(self, q, keys, values, mask) -> torch.Tensor:
        """q [B, heads, T, D] over keys/values [B, kv_heads, L, D] (their dtype) with a bool
        mask broadcastable to [B, 1, T, L] -> [B, T, heads * D] fp32."""
        b, _, t, _ = q.shape
        if self.softcap is None:
            a = F.scaled_dot_product_attention(
                q.to(keys.dtype),
                keys,
                values,
                attn_mask=mask,
                scale=self.scale,
                enable_gqa=self.n_heads != self.n_kv,
            )
        else:
            a = softcapped_attention(q.to(keys.dtype), keys, values, mask, self.scale, self.softcap)
        # [B, heads, T, D] -> [B, T, heads * D]
        return a.float().transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)

    def finish(self, x, a, decode: bool) -> torch.Tensor:
        """The rest of the layer after attention ``a`` [B, T, heads * D]: output projection,
        residual, MLP (or the sparse block), residual -> [B, T, H] fp32."""
        x = x + self._block_out(self.o(a, decode), self.attn_out_norm)
        h = _rms_norm(x, self.norm_post, self.eps)
        if self.sparse_mlp is not None:
            y = self._routed(h)
        else:
            if self.gate_up is not None:
                gate, up = self.gate_up(h, decode).chunk(2, -1)
            else:
                gate, up = self.gate(h, decode), self.up(h, decode)
            y = self.down(self.act(gate) * up, decode)
        return x + self._block_out(y, self.mlp_out_norm)

    def _routed(self, h: torch.Tensor) -> torch.Tensor:
        """The sparse MoE block on ``h [B, T, H]``, in its router's dtype, back to fp32."""
        dtype = next(self.sparse_mlp.parameters()).dtype
        out = self.sparse_mlp(h.to(dtype))
        return (out[0] if isinstance(out, tuple) else out).float()

    def _block_out(self, y: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """What a block adds to the residual: its output, post-normed (Gemma) and scaled
        (Granite) where the family does."""
        if norm is not None:
            y = _rms_norm(y, norm, self.eps)
        if self.residual_multiplier is not None:
            y = y * self.residual_multiplier
        return y


class _Head(nn.Module):
    def __init__(
        self,
        model: nn.Module,
        decode,
        notes: list[str],
        kernels: _IntKernels,
        bits: int | None,
        arch: Arch,
        *,
        spec: RuntimeSpec,
    ) -> None:
        super().__init__()
        self.norm = _norm_weight(model.get_submodule(arch.final_norm), arch.norm_form)
        self.eps = float(model.config.rms_norm_eps)
        self.divisor = config_value(model.config, spec.logits_divisor)
        self.softcap = config_value(model.config, spec.final_softcap)
        head = model.get_submodule(arch.lm_head)
        if bits is not None and not isinstance(head, QuantLinear):
            # A quantized copy for the head only: tied input embeddings stay as they are.
            head = QuantLinear.from_linear(head, LM_HEAD_SCHEMES[bits])
        # Only the last position's logits are needed, so both phases use the decode weights.
        # Named lm_head whatever the family calls it: the runtime's own name for its head.
        self.lm_head = _convert_linear(head, arch.lm_head, decode, decode, notes, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(_rms_norm(x, self.norm, self.eps), True)  # [B, V] fp32
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


@dataclass
class _Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None


def _sample(logits: torch.Tensor, s: _Sampling) -> torch.Tensor:
    """Next tokens [B] from logits [B, V] (greedy when temperature is 0). Non-finite logits are
    refused: argmax of NaN is token 0 and multinomial of NaN fails, both silent garbage."""
    # max and min propagate NaN and hold any Inf: two reductions, not a [B, V] bool mask
    # (measured 1.8 ms vs 0.1 ms for 32 x 49152 logits on 2 cores)
    if not (bool(torch.isfinite(logits.amax())) and bool(torch.isfinite(logits.amin()))):
        raise NumericsError(
            "the model's next-token logits hold NaN or Inf, so there is nothing to decode; the "
            "checkpoint's weights or scales are corrupt, or the model overflowed in this dtype "
            "(try float32)"
        )
    if s.temperature <= 0:
        return logits.argmax(-1)
    logits = logits / s.temperature
    if s.top_k is not None:
        kth = torch.topk(logits, min(s.top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p is not None:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = probs.cumsum(-1) - probs >= s.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=s.generator).squeeze(-1)


def _call_layer(
    layer: _Layer, x, cos, sin, mask, k_cache, v_cache, slots, decode: bool, length: int
):
    return layer(x, cos, sin, mask, k_cache, v_cache, slots, decode, length)


def _decode_step(runtime: Runtime, tokens, positions, mask, slots, b: int, length: int):
    """One whole decode step, token ids [B, 1] to next-token logits [B, V] fp32: embedding, every
    layer (writing its cache slot) and the head. Compiled as one graph (``compile="step"``), a
    token costs one compiled-region entry and one guard check instead of one per layer."""
    x = runtime._apply(_call_layer, runtime._embed(tokens), positions, mask, slots, b, length, True)
    return runtime.head(x[:, -1])


# No guards on the step's modules: this runtime builds them and never changes them, and each
# runtime compiles its own copy of the step's code (``_own_code``), whose graphs only it calls.
# Measured: the module guards (hook dicts, types, constants; ~1500 for SmolLM2) cost 1.4 ms of
# a 15 ms W4 token; without them the cache lookup takes 0.1 ms. Guards on the inputs, the
# caches and the ints (batch, length) stay.
_STEP_GUARDS = torch.compiler.skip_guard_on_all_nn_modules_unsafe


def _own_code(fn):
    """``fn`` with a code object of its own. Dynamo keeps its compiled graphs per code object,
    so runtimes of other models (other module structure) never find this one's graphs; that is
    what makes dropping the module guards safe."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)


def _compile_options() -> dict[str, int]:
    """Inductor options that pin its C++ vector width to the ISA ATen dispatches to.

    Why: inductor's on-disk cache key leaves out ATen's CPU capability. Measured on torch 2.13,
    AVX-512 CPU: a decode step compiled once normally, then again under
    ``ATEN_CPU_CAPABILITY=avx2``, reused the cached 16-lane C++ with 8-lane vectors and died
    with SIGSEGV (a fresh cache directory ran fine). Naming the width puts it in the key."""
    lanes = {"AVX512": 512, "AVX2": 256}.get(torch.backends.cpu.get_cpu_capability())
    return {} if lanes is None else {"cpp.simdlen": lanes}


def _bucket(n: int, cap: int) -> int:
    return min(max(16, 1 << (n - 1).bit_length()), cap)


class Runtime:
    """Static-cache generation for one model; reuse it across calls (the cache is allocated once).

    ``max_seq_len``: cache slots per row (prompt + new tokens); ``max_batch_size``: rows
    allocated. ``prefill_dtype``/``decode_dtype``: matmul input dtype per phase (None: prefill
    in the weights' dtype on every CPU; decode in bf16 for quantized or bf16 models, else the
    weights' dtype). ``kv_dtype`` defaults to fp32 when prefill is fp32 on CPU (one-query
    attention over 512 bf16 keys measured 2.0 ms vs 0.36 ms in fp32 on an AVX2 CPU), else the
    decode dtype. ``compile``: True/``"step"`` compiles the whole decode step as one graph,
    ``"layer"`` one decoder layer reused by all, False: eager. ``int4_kernel``: ``"torch"``
    (torch's native int4 kernel, bf16 activations: the default, tokens equal transformers') or
    ``"q4q8"`` (both phases through our integer-dot kernel, ``compress/kernels/cpu_q8.py``, at
    the CPU's ISA level, activations rounded to int8 per block of 32, llama.cpp's scheme: faster
    decode and prefill (a row-tile GEMM; on the 256-bit levels, prompts from
    ``cpu_q8.FLOAT_GEMM_MIN_ROWS`` tokens run an fp32 GEMM of the dequantized weights instead),
    +0.2% perplexity measured on SmolLM2 W4, tokens may differ; torch's layout is not held
    then). ``int8_kernel``: the same choice for int8 layers
    and an int8 head (``"torch"`` or ``"q8q8"``). Both fall back to "torch" with a warning where
    our kernels cannot be built; ``q8_isa`` says which level runs. ``lm_head_bits``: None keeps
    a float lm_head (in the decode dtype); 4 or 8 quantizes a copy at construction (RTN,
    symmetric; int4 group 32, int8 per channel) run by the int4/int8 kernels above: the (tied)
    lm_head is the largest matrix of small models (SmolLM2: 49152x576, 45% of W4's decode bytes
    in bf16).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_seq_len: int = 512,
        max_batch_size: int = 1,
        prefill_dtype: torch.dtype | None = None,
        decode_dtype: torch.dtype | None = None,
        kv_dtype: torch.dtype | None = None,
        compile: bool = True,
        compile_prefill: bool = False,
        int4_kernel: str = "torch",
        int8_kernel: str = "torch",
        lm_head_bits: int | None = None,
    ) -> None:
        if int4_kernel not in INT4_KERNELS:
            raise ValueError(f"int4_kernel={int4_kernel!r}: expected one of {INT4_KERNELS}")
        if int8_kernel not in INT8_KERNELS:
            raise ValueError(f"int8_kernel={int8_kernel!r}: expected one of {INT8_KERNELS}")
        if lm_head_bits not in (None, *LM_HEAD_SCHEMES):
            raise ValueError(f"lm_head_bits={lm_head_bits!r}: expected None, 4 or 8")
        if max_seq_len < 2 or max_batch_size < 1:
            raise ValueError(
                f"max_seq_len={max_seq_len} and max_batch_size={max_batch_size} must be >= 2, 1"
            )
        self.model, self.max_seq_len, self.max_batch_size = model, max_seq_len, max_batch_size
        self.fallback_reason = unsupported_reason(model)
        self.device = model.get_input_embeddings().weight.device  # seeded generators live here
        if self.fallback_reason is not None:
            warnings.warn(
                f"compress runtime falls back to transformers generate: {self.fallback_reason}",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        config = model.config
        embed = model.get_input_embeddings().weight
        device, w_dtype = embed.device, embed.dtype
        quantized = any(isinstance(m, QuantLinear) for m in model.modules())
        if decode_dtype is None:
            cpu_quant = quantized and device.type == "cpu"
            decode_dtype = torch.bfloat16 if cpu_quant or w_dtype == torch.bfloat16 else w_dtype
        if prefill_dtype is None:
            # The weights' dtype on every CPU class: bf16 prefill is faster where the CPU has
            # bf16 matmuls but changes an fp32 model's tokens, so it is opt-in.
            prefill_dtype = w_dtype
        self.prefill_dtype, self.decode_dtype = prefill_dtype, decode_dtype
        if kv_dtype is None:
            fp32_prefill = device.type == "cpu" and prefill_dtype == torch.float32
            kv_dtype = torch.float32 if fp32_prefill else decode_dtype
        self.kv_dtype = kv_dtype
        wants_q8 = int4_kernel == "q4q8" or int8_kernel == "q8q8"
        q8_reason = dispatch.q8_unavailable_reason() if wants_q8 else None
        if q8_reason is not None:
            warnings.warn(
                f"int4_kernel={int4_kernel!r}, int8_kernel={int8_kernel!r}: our integer-dot "
                f"kernels are unavailable ({q8_reason}); using torch's int4/int8 kernels",
                RuntimeWarning,
                stacklevel=2,
            )
            int4_kernel = int8_kernel = "torch"
        self.int4_kernel, self.int8_kernel = int4_kernel, int8_kernel
        # the ISA level of our kernels in this process, for reports (None: not asked for)
        self.q8_isa = cpu_q8.selected_isa() if wants_q8 and q8_reason is None else None
        kernels = _IntKernels(int4_kernel, int8_kernel)
        notes: list[str] = []
        arch = arch_for(model, "compress runtime")
        spec = RUNTIME_SPECS[arch.model_type]
        with torch.no_grad():
            self.layers = nn.ModuleList(
                _Layer(
                    layer,
                    config,
                    prefill_dtype,
                    decode_dtype,
                    notes,
                    i,
                    kernels,
                    arch,
                    spec=spec,
                )  # fmt: skip
                for i, layer in enumerate(decoder_layers(model, "compress runtime"))
            )
            self.head = _Head(
                model, decode_dtype, notes, kernels, lm_head_bits, arch, spec=spec
            )
            self.embed = embed.detach()
            self.embed_factor = embed_factor(config, arch, spec, w_dtype)
            self.rope = rope_tables(model, arch, spec, max_seq_len)
        # layers (lm_head included) that decode through our integer-dot kernels
        held = list(self.layers.modules()) + list(self.head.modules())
        self.q8_layers = sum(isinstance(m, _Q8Kernel) for m in held)
        # Windows at or beyond the cache length never cut a key, so they need no mask.
        self._windows = {
            layer.window for layer in self.layers if layer.window and layer.window < max_seq_len
        }
        if notes:
            log.warning(
                "runtime: %d layers without a native kernel: %s", len(notes), "; ".join(notes[:20])
            )
        self.device = device
        self.k_cache, self.v_cache = self._new_cache(), self._new_cache()
        self.valid = torch.zeros(max_batch_size, max_seq_len, dtype=torch.bool, device=device)
        self._slot = torch.zeros(1, dtype=torch.long, device=device)
        self.compile_prefill = compile_prefill
        self._decode_fn = self._prefill_fn = _call_layer
        self._step = _decode_step
        if compile not in (False, True, "step", "layer"):
            raise ValueError(f"compile={compile!r}: expected True/'step', 'layer' or False")
        self._compiled = bool(compile)
        if compile:
            options = _compile_options() if device.type == "cpu" else {}
            if compile == "layer":
                self._decode_fn = torch.compile(_call_layer, dynamic=False, options=options)
            else:
                self._step = torch.compile(
                    _own_code(_decode_step),
                    dynamic=False,
                    options={**options, "guard_filter_fn": _STEP_GUARDS},
                )
            if compile_prefill:
                self._prefill_fn = torch.compile(_call_layer, dynamic=False, options=options)

    # ---- public API ----------------------------------------------------------------------
    def stream(self, input_ids: list[int], max_new_tokens: int, **sampling) -> Iterator[int]:
        """Yield new tokens of one prompt as they are produced (see ``generate`` for options)."""
        stop = set(sampling.pop("stop_tokens", None) or ())
        if self.fallback_reason is not None:
            yield from self.generate([input_ids], max_new_tokens, stop_tokens=stop, **sampling)[0]
            return
        sampling_ = _make_sampling(**sampling, device=self.device)
        for tokens in self._run([list(input_ids)], max_new_tokens, sampling_):
            token = int(tokens[0])
            yield token
            if token in stop:
                return

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        *,
        stop_tokens: list[int] | set[int] | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> list[list[int]]:
        """New tokens per prompt (a stop token ends its row and is included).

        Greedy when ``temperature`` is 0; otherwise sampling with optional top-k/top-p and a
        seeded generator. Rows decode together (left-padded); generation ends when every row
        has stopped or ``max_new_tokens`` are produced.
        """
        prompts = [list(p) for p in prompts]
        stop = set(stop_tokens or ())
        sampling = _make_sampling(temperature, top_k, top_p, seed, device=self.device)
        if self.fallback_reason is not None:
            return self._hf_generate(prompts, max_new_tokens, stop, sampling)
        out: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        for tokens in self._run(prompts, max_new_tokens, sampling):
            for row, token in enumerate(tokens.tolist()):
                if not done[row]:
                    out[row].append(token)
                    done[row] = token in stop
            if all(done):
                break
        return out

    def fork(self) -> Runtime:
        """Another runtime with its own KV cache that shares this one's weights and compiled
        step: one per request that must stay open while others run (interleaved serving),
        without repacking the weights again."""
        other = copy.copy(self)
        if self.fallback_reason is None:  # the fallback keeps no cache
            other.k_cache, other.v_cache = self._new_cache(), self._new_cache()
            other.valid, other._slot = torch.zeros_like(self.valid), torch.zeros_like(self._slot)
        return other

    def decode_bytes(self) -> dict[str, int]:
        """Bytes a decode step reads: ``weights`` (every layer's decode-phase weights and the
        head; one embedding row is negligible) and ``kv_cache`` (the whole allocated cache)."""
        seen: set[int] = set()
        weights = 0
        for module in list(self.layers.modules()) + list(self.head.modules()):
            tensors = dict(module.named_buffers(recurse=False))
            if isinstance(module, _FloatLinear):  # decode reads w_decode (maybe w_prefill itself)
                tensors["w_prefill"] = module.w_decode
            for t in tensors.values():
                if t is not None and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    weights += t.numel() * t.element_size()
        cache = 2 * sum(c.numel() * c.element_size() for c in self.k_cache)
        return {"weights": weights, "kv_cache": cache}

    def _new_cache(self) -> list[torch.Tensor]:
        """One zeroed [B_max, Hkv, S, D] buffer per layer. Separate tensors, not views of one:
        the compiled step writes each in place, where it copied a view's slice out and back
        (measured: a KV-slice copy per layer per token, torch 2.13)."""
        first = self.layers[0]
        shape = (self.max_batch_size, first.n_kv, self.max_seq_len, first.head_dim)
        return [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in self.layers]

    # ---- one row, step by step (speculative decoding) ------------------------------------
    position = 0  # tokens in row 0's cache for prefill/score/rewind

    def prefill(self, prompt: list[int]) -> torch.Tensor:
        """Start row 0 at ``prompt``: fill its cache, return the next-token logits [V] fp32.
        Then ``score`` feeds tokens and ``rewind`` drops them; ``position`` is the cache length."""
        if self.fallback_reason is not None:
            raise RuntimeError(f"the runtime does not run this model: {self.fallback_reason}")
        self._check([list(prompt)], 1)
        self.position = 0
        return self.score(list(prompt))[-1]

    @torch.no_grad()
    def score(self, tokens: list[int]) -> torch.Tensor:
        """Logits [T, V] fp32 after each of ``tokens``, fed in one forward from ``position``
        (gpt-fast's verify step): row i is what greedy decoding would compute after token i.
        A single token goes through the (compiled) decode step; several run it eager."""
        start, t = self.position, len(tokens)
        if t < 1 or start + t > self.max_seq_len:
            raise ValueError(
                f"{t} tokens at position {start} do not fit max_seq_len={self.max_seq_len}"
            )
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        slots = torch.arange(start, start + t, device=self.device)
        if start == 0:  # prefill: attends to its own fresh keys, as in ``_run``
            mask = torch.ones(t, t, dtype=torch.bool, device=self.device).tril()[None, None]
            x = self._layers(ids, slots[None], mask, slots, 1, t, decode=False)
        else:
            length = start + t
            if t == 1 and self._compiled:  # the compiled step's power-of-two key lengths
                length = _bucket(length, self.max_seq_len)
            keys = torch.arange(length, device=self.device)
            mask = (keys[None, :] <= slots[:, None])[None, None]  # [1, 1, T, L] causal
            if t == 1:  # [1, V]
                self._slot.fill_(start)
                self.position = start + t
                return self._decode(ids, slots[None], mask, 1, length)
            else:  # eager: a k-token decode step is another shape than the compiled one
                x = self._embed(ids)
                x = self._apply(_call_layer, x, slots[None], mask, slots, 1, length, True)
        self.position = start + t
        return self.head(x[0])

    def rewind(self, position: int) -> None:
        """Forget every token at or after ``position`` (their cache slots get overwritten)."""
        if not 0 < position <= self.position:
            raise ValueError(f"cannot rewind to {position}: the cache holds {self.position}")
        self.position = position

    # ---- the loop ------------------------------------------------------------------------
    def _check(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if len(prompts) > self.max_batch_size:
            raise ValueError(
                f"batch of {len(prompts)} prompts exceeds max_batch_size={self.max_batch_size} "
                f"allocated; create the Runtime with max_batch_size>={len(prompts)}"
            )
        need = max(len(p) for p in prompts) + max_new_tokens
        if max_new_tokens < 1 or need > self.max_seq_len:
            raise ValueError(
                f"longest prompt ({max(len(p) for p in prompts)} tokens) + max_new_tokens "
                f"({max_new_tokens}) must be in 1..max_seq_len={self.max_seq_len}; create the "
                f"Runtime with max_seq_len>={need} or shorten the prompt"
            )
        vocab = self.embed.shape[0]
        bad = [t for p in prompts for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}")

    @torch.no_grad()
    def _run(self, prompts, max_new_tokens: int, sampling: _Sampling) -> Iterator[torch.Tensor]:
        self._check(prompts, max_new_tokens)
        b, t = len(prompts), max(len(p) for p in prompts)
        tb = _bucket(t, self.max_seq_len) if self.compile_prefill else t
        tokens = torch.zeros(b, tb, dtype=torch.long)
        pad = torch.tensor([t - len(p) for p in prompts])
        self.valid.zero_()
        for row, p in enumerate(prompts):  # left padding: every row's last token is at t - 1
            tokens[row, t - len(p) : t] = torch.tensor(p)
            self.valid[row, t - len(p) : t] = True
        pad, tokens = pad.to(self.device), tokens.to(self.device)
        positions = (torch.arange(tb, device=self.device)[None] - pad[:, None]).clamp(min=0)
        keys = self.valid[:b, :tb]
        causal = torch.ones(tb, tb, dtype=torch.bool, device=self.device).tril()
        # Every query sees itself, so padding rows stay finite (their outputs are never read).
        eye = torch.eye(tb, dtype=torch.bool, device=self.device)
        mask = ((causal & keys[:, None, :]) | eye)[:, None]  # [B, 1, T, T]
        slots = torch.arange(tb, device=self.device)
        x = self._layers(tokens, positions, mask, slots, b, tb, decode=False)
        logits = self.head(x[:, t - 1])
        pos = t
        for step in range(max_new_tokens):
            next_tokens = _sample(logits, sampling)
            yield next_tokens
            if step == max_new_tokens - 1:
                return
            self.valid[:b, pos] = True
            self._slot.fill_(pos)
            # Attend to the filled prefix only (measured: the whole 512-slot cache cost more per
            # token than every int4 matmul together); compiled steps use power-of-two lengths so
            # that only log2(max_seq_len) graphs exist.
            length = _bucket(pos + 1, self.max_seq_len) if self._compiled else pos + 1
            mask = self.valid[:b, None, None, :length]  # [B, 1, 1, L]
            logits = self._decode(next_tokens[:, None], (pos - pad)[:, None], mask, b, length)
            pos += 1

    def _decode(self, tokens, positions, mask, b: int, length: int) -> torch.Tensor:
        """Logits [B, V] of one decode step at cache slot ``self._slot`` (whole-step compiled,
        per-layer compiled or eager: ``compile``)."""
        if self._step is _decode_step:
            x = self._layers(tokens, positions, mask, self._slot, b, length, decode=True)
            return self.head(x[:, -1])
        try:
            return self._step(self, tokens, positions, mask, self._slot, b, length)
        except Exception as exc:  # noqa: BLE001  (any compiler failure: warn once, run eager)
            self._compile_failed(exc)
            return self._decode(tokens, positions, mask, b, length)

    def _compile_failed(self, exc: Exception) -> None:
        warnings.warn(
            f"compress runtime: torch.compile failed ({type(exc).__name__}: {exc}); "
            "running eager from now on",
            RuntimeWarning,
            stacklevel=3,
        )
        self._decode_fn = self._prefill_fn = _call_layer
        self._step = _decode_step

    def _layers(
        self, tokens, positions, mask, slots, b: int, length: int, *, decode: bool
    ) -> torch.Tensor:
        fn = self._decode_fn if decode else self._prefill_fn
        x = self._embed(tokens)  # [B, T, H]
        try:
            return self._apply(fn, x, positions, mask, slots, b, length, decode)
        except Exception as exc:  # noqa: BLE001  (any compiler failure: warn once, run eager)
            if fn is _call_layer:
                raise
            self._compile_failed(exc)
            # Re-running is safe: each layer rewrites the same cache slots from the same input.
            return self._apply(_call_layer, x, positions, mask, slots, b, length, decode)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embeddings [B, T, H] fp32, scaled in the model dtype where the family scales."""
        x = self.embed[tokens]
        if self.embed_factor is not None:
            x = x * self.embed_factor
        return x.float()

    def _apply(self, fn, x, positions, mask, slots, b: int, length: int, decode: bool):
        """All layers; each gets its whole cache buffers and uses rows ``:b`` and slots
        ``:length``. positions [B, T] index the rope tables; slots [T] are the queries' cache
        slots (for sliding windows)."""
        ropes = {key: (cos[positions], sin[positions]) for key, (cos, sin) in self.rope.items()}
        masks = {window: window_mask(mask, slots, window) for window in self._windows}
        for i, layer in enumerate(self.layers):
            cos, sin = ropes[layer.rope_key]  # [B, T, D]
            layer_mask = masks.get(layer.window, mask)
            k_cache, v_cache = self.k_cache[i], self.v_cache[i]
            x = fn(layer, x, cos, sin, layer_mask, k_cache, v_cache, slots, decode, length)
        return x

    def _hf_generate(self, prompts, max_new_tokens: int, stop: set[int], s: _Sampling):
        pad_id = next(iter(stop), 0)
        t = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (t - len(p)) + p for p in prompts])
        attention = torch.tensor([[0] * (t - len(p)) + [1] * len(p) for p in prompts])
        kwargs = dict(
            do_sample=s.temperature > 0,
            max_new_tokens=max_new_tokens,
            eos_token_id=sorted(stop) or None,
            pad_token_id=pad_id,
        )
        if s.temperature > 0:
            kwargs.update(temperature=s.temperature, top_k=s.top_k or 0, top_p=s.top_p or 1.0)
        device = self.model.get_input_embeddings().weight.device
        with torch.no_grad():
            out = self.model.generate(
                ids.to(device), attention_mask=attention.to(device), **kwargs
            )[:, t:]
        result = []
        for row in out.tolist():
            cut = next((i + 1 for i, tok in enumerate(row) if tok in stop), len(row))
            result.append(row[:cut])
        return result


def _make_sampling(
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    device: torch.device | None = None,
) -> _Sampling:
    """Sampling settings; a seed makes a generator on ``device`` (the model's: multinomial on
    CUDA refuses a CPU generator; None: the CPU)."""
    if (
        temperature < 0
        or (top_k is not None and top_k < 1)
        or not (top_p is None or 0 < top_p <= 1)
    ):
        raise ValueError(
            f"temperature={temperature} must be >= 0, top_k={top_k} >= 1, top_p={top_p} in (0, 1]"
        )
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device or "cpu").manual_seed(seed)
    return _Sampling(temperature, top_k, top_p, generator)
