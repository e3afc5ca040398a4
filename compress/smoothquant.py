"""SmoothQuant (Xiao et al., 2022) + W8A8: ``quantize.smoothquant`` and ``W8A8Linear``.

Activations of LLMs have a few outlier channels that make per-token int8 activations lossy.
SmoothQuant moves that difficulty into the weights: per input channel j,
``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)``; the producer of the input is divided by s
(RMSNorm weight, or the rows of ``up_proj`` for ``down_proj``) and the consumers' columns are
multiplied by it, so the float model is unchanged. Mappings (Llama-style layers):
input_layernorm -> q/k/v, post_attention_layernorm -> gate/up, up_proj -> down_proj
(``smooth_down``). The pass then turns every targeted Linear into a ``W8A8Linear`` (one pass,
no separate W8A8 pass to order): int8 symmetric per-output-channel weights and dynamic
symmetric per-token int8 activations, ``y = (x_q @ w_q^T) * sx * sw``, the int8 x int8 product
accumulated in int32. Backends, all bit-identical: ``cpu`` ``torch._int_mm`` (int8 x int8 ->
int32, CPU since torch 2.2; fast only with VNNI int8 dot products: on an AVX2-only CPU it measured
261 ms vs 8 ms for ``float_exact`` at [512,1536]x[1536,576]), ``float_exact`` (the int8 values
widened to float32 and multiplied in K-chunks of at most 1040, so every partial sum is an integer
below 2^24 and exact; chunks summed in int32), ``triton`` (``kernels.triton_ops.int8_int8_linear``
on CUDA, when present), ``reference`` (float64, exact for K < 2^38 / 127^2). ``auto`` picks
triton on CUDA, ``cpu`` on CPUs that report VNNI, else ``float_exact``. Exported as
compressed-tensors ``int-quantized`` with dynamic per-token ``input_activations``. Only
``nn.Linear`` can become W8A8; anything else targeted is reported (or an error under ``strict``).
"""

from __future__ import annotations

import functools
import logging
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from compress.core import (
    CompressionState,
    PassConfig,
    PassReport,
    raise_or_report_skips,
    register_pass,
    set_submodule,
    target_modules,
)
from compress.gptq import finish_quant_report, run_calibrated
from compress.modules import QuantLinear, WeightScheme
from compress.sequential import LayerInputs, OffloadMode, run_layer

log = logging.getLogger(__name__)

MAPPINGS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.up_proj", ("mlp.down_proj",)),
)
# compressed-tensors description of the activations of a W8A8Linear
INPUT_ACTIVATIONS = {
    "num_bits": 8,
    "type": "int",
    "symmetric": True,
    "group_size": None,
    "strategy": "token",
    "dynamic": True,
    "actorder": None,
    "observer": None,
    "observer_kwargs": {},
}


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(x_q int8 [M, K], scales fp32 [M, 1])``, symmetric, per row."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True).to(torch.float32)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    x_q = torch.clamp(torch.round(x.to(torch.float32) / scales), -127, 127).to(torch.int8)
    return x_q, scales


def int8_int8_reference(x_q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """``x_q [M, K] @ w_q [N, K]^T`` exactly, as int32 (float64 holds every partial sum)."""
    return (x_q.to(torch.float64) @ w_q.to(torch.float64).T).to(torch.int32)


# float32 represents every integer below 2^24 exactly; |a*b| <= 127^2, so a dot product over at
# most 2^24 // 127^2 = 1040 terms has exact partial sums whatever the summation order.
FLOAT_EXACT_CHUNK = (1 << 24) // (127 * 127)


def int8_int8_float_exact(x_q: torch.Tensor, w_q_float: torch.Tensor) -> torch.Tensor:
    """``x_q [M, K] int8 @ w_q_float [N, K]^T`` (int8 values held as float32), exactly, as
    int32: float32 GEMMs over K-chunks too short for any partial sum to round, added in int32."""
    k = x_q.shape[-1]
    acc = None
    for start in range(0, k, FLOAT_EXACT_CHUNK):
        stop = min(start + FLOAT_EXACT_CHUNK, k)
        part = (x_q[:, start:stop].to(torch.float32) @ w_q_float[:, start:stop].T).to(torch.int32)
        acc = part if acc is None else acc + part
    assert acc is not None, "K must be positive"
    return acc


@functools.cache
def cpu_has_vnni() -> bool:
    """The CPU advertises int8 dot-product instructions (AVX512-VNNI / AVX-VNNI / AMX), the only
    case where ``torch._int_mm`` on CPU beats ``float_exact`` (Linux: /proc/cpuinfo flags)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    return bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"})


@functools.cache
def _triton_w8a8() -> bool:
    """kernels.triton_ops provides int8_int8_linear (built by the kernels engineer)."""
    try:
        from compress.kernels import triton_ops
    except ImportError:
        return False
    return hasattr(triton_ops, "int8_int8_linear")


class W8A8Linear(QuantLinear):
    """int8 per-channel weights (stored like an int8 ``QuantLinear``) x dynamic per-token int8
    activations. backend: auto | reference | float_exact | cpu | triton (module docstring)."""

    input_activations = INPUT_ACTIVATIONS

    def __init__(self, in_features: int, out_features: int, scheme: WeightScheme, **kwargs) -> None:
        if scheme.n_bits != 8 or scheme.group_size is not None or not scheme.symmetric:
            raise ValueError(
                f"W8A8Linear needs symmetric per-channel int8 weights, got {scheme.describe()}"
            )
        super().__init__(in_features, out_features, scheme, **kwargs)

    def resolved_backend(self, device: torch.device) -> str:
        if self.backend != "auto":
            if self.backend == "triton" and not (device.type == "cuda" and _triton_w8a8()):
                raise RuntimeError(
                    "W8A8 backend 'triton' needs CUDA and kernels.triton_ops.int8_int8_linear"
                )
            return self.backend
        if device.type == "cuda" and _triton_w8a8():
            return "triton"
        if device.type == "cpu" and hasattr(torch, "_int_mm") and cpu_has_vnni():
            return "cpu"
        return "float_exact"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        backend = self.resolved_backend(x.device)
        x2 = x.reshape(-1, self.in_features)  # [..., K] -> [M, K]
        w_scales = self.weight_scale.to(torch.float32).reshape(1, -1)  # [1, N]
        if backend == "triton":
            from compress.kernels import triton_ops

            y = triton_ops.int8_int8_linear(x2, self.weight, self.weight_scale.reshape(-1, 1))
        else:
            x_q, x_scales = quantize_per_token(x2)
            if backend == "cpu":
                if "w_t" not in self._prepared:  # _int_mm wants B as [K, N]
                    self._prepared["w_t"] = self.weight.T.contiguous()
                acc = torch._int_mm(x_q, self._prepared["w_t"])  # type: ignore[arg-type]
            elif backend == "float_exact":
                if "w_float" not in self._prepared:
                    self._prepared["w_float"] = self.weight.to(torch.float32)
                acc = int8_int8_float_exact(x_q, self._prepared["w_float"])
            else:
                acc = int8_int8_reference(x_q, self.weight)
            y = (acc.to(torch.float32) * x_scales * w_scales).to(x.dtype)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", activations=int8 per-token dynamic"


class SmoothquantConfig(PassConfig):
    """alpha: migration strength (0 = none, 1 = all into weights); smooth_down: also migrate
    down_proj's input into up_proj; smooth: false gives plain W8A8 (no migration)."""

    alpha: float = Field(0.5, ge=0.0, le=1.0)
    smooth: bool = True
    smooth_down: bool = True
    scale_dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    backend: Literal["auto", "reference", "float_exact", "cpu", "triton"] = "auto"
    offload: OffloadMode = "none"


class _MaxHooks:
    """Running per-channel max|x| of each hooked module's input."""

    def __init__(self, layer: nn.Module, points: list[str]) -> None:
        self.amax: dict[str, torch.Tensor] = {}
        self._handles = [
            layer.get_submodule(p).register_forward_hook(self._hook(p)) for p in points
        ]

    def _hook(self, point: str):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            if not torch.isfinite(x).all():
                raise ValueError(f"{point}: calibration activations contain NaN/Inf")
            amax = x.abs().amax(0).to(torch.float32)
            self.amax[point] = torch.maximum(self.amax[point], amax) if point in self.amax else amax

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@torch.no_grad()
def smooth_scales(x_amax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """SmoothQuant scale per input channel ``[K]`` for consumers ``weights`` (each ``[N_i, K]``)."""
    w_amax = torch.cat([w.abs() for w in weights]).amax(0).to(torch.float32)
    s = x_amax.clamp(min=1e-5).pow(alpha) / w_amax.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


@torch.no_grad()
def migrate_scales(
    prev: nn.Module, lins: list[nn.Module], s_prev: torch.Tensor, s: torch.Tensor
) -> None:
    """Divide the outputs of ``prev`` by ``s_prev`` (rows of a Linear, or the weight of an
    RMSNorm-style norm) and multiply the consumers' input columns by ``s [K]``, the same scale as
    the consumers see it (AWQ repeats it per head under GQA): the float model is unchanged."""
    if isinstance(prev, nn.Linear):
        prev.weight.div_(s_prev.unsqueeze(1).to(prev.weight.dtype))  # rows = its outputs
        if prev.bias is not None:
            prev.bias.div_(s_prev.to(prev.bias.dtype))
    else:  # RMSNorm-style: y = w * normalize(x)
        prev.weight.div_(s_prev.to(prev.weight.dtype))
    for lin in lins:
        lin.weight.mul_(s.to(lin.weight.dtype))


def w8a8_from_linear(linear: nn.Linear, scale_dtype: torch.dtype, backend: str) -> W8A8Linear:
    """Per-channel symmetric RTN of the weight into a ``W8A8Linear``."""
    scheme = WeightScheme(8, None, True, scale_dtype)
    return W8A8Linear.from_linear(linear, scheme, backend=backend)  # type: ignore[return-value]


@register_pass("quantize.smoothquant", SmoothquantConfig, needs_calibration=True)
def smoothquant(model: nn.Module, cfg: SmoothquantConfig, state: CompressionState) -> PassReport:
    """Smooth (per layer, on the already-W8A8 previous layers' outputs), then W8A8 every target."""
    report = PassReport("quantize.smoothquant")
    plan = []
    for name, module in target_modules(model, cfg):
        if type(module) is nn.Linear:
            plan.append(name)
        elif isinstance(module, nn.Module) and hasattr(module, "weight"):
            report.skipped[name] = f"{type(module).__name__} cannot run W8A8 (only nn.Linear can)"
    raise_or_report_skips(cfg, report, "quantize.smoothquant")
    scale_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[
        cfg.scale_dtype
    ]
    migrated: dict[str, float] = {}

    def process(index: int, layer: nn.Module, inputs: LayerInputs) -> None:
        prefix = f"model.layers.{index}."
        mappings = [
            m for m in MAPPINGS if cfg.smooth and (cfg.smooth_down or m[0] != "mlp.up_proj")
        ]
        mappings = [m for m in mappings if all(prefix + c in plan for c in m[1])]
        hooks = _MaxHooks(layer, [c[0] for _, c in mappings])
        try:
            run_layer(layer, inputs)
        finally:
            hooks.remove()
        for producer, consumers in mappings:
            lins = [layer.get_submodule(c) for c in consumers]
            s = smooth_scales(hooks.amax[consumers[0]], [lin.weight for lin in lins], cfg.alpha)
            migrate_scales(layer.get_submodule(producer), lins, s, s)
            migrated[prefix + producer] = float(s.max() / s.min())
        for name in [n for n in plan if n.startswith(prefix)]:
            # exact int8 x int8 on every backend, so calibration may use the fast one
            set_submodule(
                model, name, w8a8_from_linear(model.get_submodule(name), scale_dtype, cfg.backend)
            )
            report.changed.append(name)

    memory = run_calibrated(model, state, process, "quantize.smoothquant", offload=cfg.offload)
    for name in plan:
        if name not in report.changed:  # outside the decoder stack (e.g. a targeted lm_head)
            set_submodule(
                model, name, w8a8_from_linear(model.get_submodule(name), scale_dtype, cfg.backend)
            )
            report.changed.append(name)
    finish_quant_report(model, report, cfg.backend, memory)
    report.metrics["scale_spread_max_over_min"] = migrated
    return report
