"""The quantized layer types the passes swap into a model: ``QuantLinear`` and ``W8A8Linear``.

This module imports no pass: loading a checkpoint (``compress.io.export.load_compressed``) builds
these layers without importing any quantization algorithm.

A ``QuantLinear`` holds the tensors the compressed-tensors checkpoint stores, under the same
names, so export is ``state_dict()`` and reload is ``load_state_dict()`` (but for the packing
of symmetric weight-only int8, below):

* int4 (``pack-quantized``): ``weight_packed`` int32 ``[N, ceil(K/8)]``, ``weight_shape`` int64
  ``[2]``, ``weight_scale [N, K/g]``, and for asymmetric ``weight_zero_point`` int32 packed on
  dim 0 ``[ceil(N/8), K/g]``;
* int8 (``int-quantized``): ``weight`` int8 ``[N, K]``, ``weight_scale [N, K/g]`` (``[N, 1]``
  per channel), asymmetric ``weight_zero_point`` int8 ``[N, K/g]``; symmetric weight-only int8
  is written ``pack-quantized`` (four codes an int32) and read back so
  (``compress.io.quant_config``).

The forward runs on a backend chosen per device by ``compress.kernels.dispatch``; backend
specific repacks (the native CPU int4 layout) are made once, on first use, and not saved.

``W8A8Linear`` (SmoothQuant's layer, Xiao et al. 2022) stores its weight like a symmetric
per-channel int8 ``QuantLinear`` and also quantizes its input per token at run time:
``y = (x_q @ w_q^T) * sx * sw``, the int8 x int8 product accumulated in int32. Backends, all
bit-identical: ``cpu`` ``torch._int_mm`` (int8 x int8 -> int32, CPU since torch 2.2; fast only
with VNNI int8 dot products: on an AVX2-only CPU it measured 261 ms vs 8 ms for ``float_exact``
at [512,1536]x[1536,576]), ``float_exact`` (the int8 values widened to float32 and multiplied in
K-chunks of at most 1040, so every partial sum is an integer below 2^24 and exact; chunks summed
in int32), ``triton`` (``kernels.triton_ops.int8_int8_linear`` on CUDA), ``reference`` (float64,
exact for K < 2^38 / 127^2). ``auto`` picks triton on CUDA, ``cpu`` on CPUs that report VNNI,
else ``float_exact``. Exported as compressed-tensors ``int-quantized`` with dynamic per-token
``input_activations``.

``model_bytes`` / ``bits_per_weight`` count what the layers store, bitsandbytes layers included
(recognised by duck typing: this module never imports bitsandbytes or the bnb pass).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from compress.arch import (
    Moe,
    expert_bias_names,
    expert_biases,
    expert_shape,
    expert_weights,
    float_only_modules,
)
from compress.core.device import float_dtype
from compress.kernels import cpu_native, dispatch, reference
from compress.memory import available_memory_bytes
from compress.quant import primitives as quant_primitives

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightScheme:
    """How one linear layer's weight is quantized."""

    n_bits: int  # 4 or 8
    group_size: int | None  # input channels per scale; None = one scale per output channel
    symmetric: bool = True
    scale_dtype: torch.dtype = torch.float16
    grid: str = "restricted"  # symmetric grid: restricted | full | signed (quant_primitives)

    def resolved_group(self, in_features: int) -> int:
        return in_features if self.group_size is None else self.group_size

    def describe(self) -> str:
        group = "channel" if self.group_size is None else f"g{self.group_size}"
        return f"W{self.n_bits}{group}{'' if self.symmetric else '-asym'}"


def rtn_codes(
    w: torch.Tensor, scheme: WeightScheme
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest ``(codes int8 [N, K], scales [N, K/g] in the stored dtype, zeros)`` of
    ``w [N, K]`` under ``scheme``, the min/max parameters of ``quant_primitives``."""
    group = scheme.resolved_group(w.shape[1])
    n, k = w.shape
    # Rows in blocks (each row's groups are independent, so the result is the same): the fp32
    # temporaries of a whole 13B-sized linear would be several times its size.
    rows = max(1, reference.ROW_BLOCK_ELEMENTS // max(k, 1))
    w_q = torch.empty(n, k, dtype=torch.int8, device=w.device)
    scales_parts, zeros_parts = [], []
    for r0 in range(0, max(n, 1), rows):  # once for an empty weight
        block = w[r0 : r0 + rows]
        scales, zeros = quant_primitives.compute_qparams(
            block, n_bits=scheme.n_bits, group_size=group, symmetric=scheme.symmetric,
            grid=scheme.grid,
        )
        # Codes are computed against the scales as stored, so that stored = used.
        scales = scales.to(scheme.scale_dtype)
        w_q[r0 : r0 + rows] = quant_primitives.quantize(
            block, scales, zeros, n_bits=scheme.n_bits, group_size=group)
        scales_parts.append(scales)
        zeros_parts.append(zeros)
    scales = torch.cat(scales_parts) if len(scales_parts) > 1 else scales_parts[0]
    if zeros_parts[0] is None:
        return w_q, scales, None
    return w_q, scales, torch.cat(zeros_parts) if len(zeros_parts) > 1 else zeros_parts[0]


class QuantLinear(nn.Module):
    """A linear layer with integer weights; see the module docstring for the stored tensors."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        scheme: WeightScheme,
        *,
        bias: bool,
        dtype: torch.dtype = torch.float32,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        if scheme.n_bits not in (4, 8):
            raise ValueError(f"QuantLinear supports 4 or 8 bits, not {scheme.n_bits}")
        group = scheme.resolved_group(in_features)
        if in_features % group:
            raise ValueError(f"group_size {group} does not divide in_features {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.backend = scheme, backend
        n, k, n_groups = out_features, in_features, in_features // group
        if scheme.n_bits == 4:
            self.register_buffer("weight_packed", torch.zeros(n, (k + 7) // 8, dtype=torch.int32))
            self.register_buffer("weight_shape", torch.tensor([n, k], dtype=torch.int64))
        else:
            self.register_buffer("weight", torch.zeros(n, k, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(n, n_groups, dtype=scheme.scale_dtype))
        if not scheme.symmetric:
            zp = (
                torch.zeros((n + 7) // 8, n_groups, dtype=torch.int32)
                if scheme.n_bits == 4
                else torch.zeros(n, n_groups, dtype=torch.int8)
            )
            self.register_buffer("weight_zero_point", zp)
        self.bias = nn.Parameter(torch.zeros(n, dtype=dtype), requires_grad=False) if bias else None
        self._prepared: dict[str, object] = {}

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        scheme: WeightScheme,
        *,
        w_q: torch.Tensor | None = None,
        scales: torch.Tensor | None = None,
        zeros: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> QuantLinear:
        """Quantize ``linear`` with RTN, or store given codes/scales/zeros (GPTQ, AWQ...)."""
        w = linear.weight.detach()
        module = cls(
            linear.in_features,
            linear.out_features,
            scheme,
            bias=linear.bias is not None,
            dtype=float_dtype(linear) or w.dtype,  # its compute dtype: a bf16-stored weight
            backend=backend,                       # widened per call computes in float32
        )
        if w_q is None:
            w_q, scales, zeros = rtn_codes(w, scheme)
        assert scales is not None
        module.set_quantized(w_q, scales, zeros)
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.detach())
        return module.to(w.device)

    def set_quantized(
        self, w_q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None
    ) -> None:
        """Store signed codes ``w_q [N, K]``, ``scales [N, K/g]`` and zeros in the packed layout."""
        if (zeros is None) != self.scheme.symmetric:
            raise ValueError("zeros must be given exactly when the scheme is asymmetric")
        if self.scheme.n_bits == 4:
            self._store("weight_packed",
                        reference.pack_int4(w_q.to(torch.int8).cpu()).to(w_q.device))
            if zeros is not None:
                zp = reference.pack_int4(zeros.to(torch.int8).cpu(), dim=0)
                self._store("weight_zero_point", zp.to(w_q.device))
        else:
            self._store("weight", w_q.to(torch.int8))
            if zeros is not None:
                self._store("weight_zero_point", zeros.to(torch.int8))
        self._store("weight_scale", scales.to(self.scheme.scale_dtype))
        self._prepared.clear()

    def _store(self, name: str, value: torch.Tensor) -> None:
        """Buffer ``name`` := ``value``, copied into the buffer already there when it matches
        (shape, dtype, device): a layer built empty and then filled (``QuantExperts.like``)
        would otherwise free its empty buffers between the new ones, holes the allocator
        keeps (a GPT-OSS-20B layer's RTN held 0.7 GB more than its 0.43 GB of codes)."""
        held = self._buffers.get(name)
        if (held is not None and held.shape == value.shape and held.dtype == value.dtype
                and held.device == value.device and held.data_ptr() != value.data_ptr()):
            held.copy_(value)
        else:
            setattr(self, name, value)

    # ---- views --------------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        return self.scheme.resolved_group(self.in_features)

    def codes(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Signed codes ``[N, K]`` and unpacked zero points ``[N, K/g]`` (or None)."""
        if self.scheme.n_bits == 4:
            w_q = reference.unpack_int4(self.weight_packed, self.in_features)
            zeros = None
            if not self.scheme.symmetric:
                zeros = reference.unpack_int4(self.weight_zero_point, self.out_features, dim=0)
            return w_q, zeros
        return self.weight, (None if self.scheme.symmetric else self.weight_zero_point)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float ``[N, K]`` weight this layer computes with (reference definition; an int4
        layer on a CPU in one C++ pass, bit-equal: ``compress.kernels.cpu_gptq``)."""
        if self.scheme.n_bits == 4 and _exact_int4_on(self.weight_packed.device):
            from compress.kernels import cpu_gptq

            zeros = None if self.scheme.symmetric else self.weight_zero_point
            return cpu_gptq.dequantize_int4(self.weight_packed, self.weight_scale, zeros,
                                            self.in_features, self.group_size).to(dtype)
        w_q, zeros = self.codes()
        return reference.dequantize(w_q, self.weight_scale, zeros, self.group_size, dtype)

    def weight_bytes(self) -> int:
        """Bytes of the stored weight tensors (codes, scales, zero points; not bias)."""
        names = ("weight_packed", "weight", "weight_scale", "weight_zero_point")
        return sum(
            t.numel() * t.element_size()
            for name, t in self.named_buffers(recurse=False)
            if name in names
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"scheme={self.scheme.describe()}, backend={self.backend}"
        )

    # ---- forward ------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        """The layer kind ``kernels.dispatch.plan_linear`` takes: ``int4`` or ``int8``."""
        return "int4" if self.scheme.n_bits == 4 else "int8"

    def plan(
        self,
        device: torch.device,
        *,
        phase: str = "any",
        int4_kernel: str = "torch",
        int8_kernel: str = "torch",
    ) -> dispatch.Plan:
        """This layer's backend on ``device`` (cached until ``set_quantized``/``set_backend``);
        ``phase``/``int4_kernel``/``int8_kernel`` are the generation runtime's
        (``compress.kernels.dispatch``)."""
        key = f"plan:{device}:{phase}:{int4_kernel}:{int8_kernel}"
        if key not in self._prepared:
            self._prepared[key] = dispatch.plan_linear(
                self.kind,  # type: ignore[arg-type]
                self.backend,
                device=device,
                n=self.out_features,
                k=self.in_features,
                group_size=self.group_size,
                symmetric=self.scheme.symmetric,
                phase=phase,  # type: ignore[arg-type]
                int4_kernel=int4_kernel,
                int8_kernel=int8_kernel,
            )
        return self._prepared[key]  # type: ignore[return-value]

    def resolved_backend(self, device: torch.device) -> str:
        return self.plan(device).backend

    def _forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme.n_bits == 4:
            if "cpu_int4" not in self._prepared:
                zp = None if self.scheme.symmetric else self.weight_zero_point
                self._prepared["cpu_int4"] = cpu_native.prepack_int4(
                    self.weight_packed,
                    self.weight_scale,
                    zp,
                    group_size=self.group_size,
                    k=self.in_features,
                )
            return cpu_native.int4_mm(x, self._prepared["cpu_int4"])  # type: ignore[arg-type]
        if "cpu_int8_scales" not in self._prepared:
            scales = self.weight_scale[:, 0].to(torch.bfloat16)
            self._prepared["cpu_int8_scales"] = cpu_native.aligned(scales)
            # A copy only when the loaded weight is misaligned (safetensors aligns to 8 bytes).
            self._prepared["cpu_int8_weight"] = cpu_native.aligned(self.weight)
        return cpu_native.int8_mm(
            x, self._prepared["cpu_int8_weight"], self._prepared["cpu_int8_scales"]  # type: ignore[arg-type]
        )

    def _forward_triton(self, x: torch.Tensor, plan: dispatch.Plan) -> torch.Tensor:
        """``plan.kernel`` is the set the per-call choice may pick from: ``auto`` (the plan of
        ``backend="auto"``: the measured table, torch's int4 kernel included, its repacked weight
        cached in ``_prepared``) or ``triton`` (ours only, an explicit ``backend="triton"``)."""
        from compress.kernels import triton_ops

        x2 = x.reshape(-1, self.in_features)
        zp = None if self.scheme.symmetric else self.weight_zero_point
        kernel = plan.kernel or "triton"
        if self.scheme.n_bits == 4:
            y = triton_ops.int4_linear(
                x2, self.weight_packed, self.weight_scale, zp, group_size=self.group_size,
                kernel=kernel, cache=self._prepared,
            )
        else:
            y = triton_ops.int8_linear(x2, self.weight, self.weight_scale, zp, kernel=kernel)
        return y.reshape(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dense = self._prepared.get("scoring_weight")  # inside ``dequantized_for_scoring``
        if dense is not None:
            y = torch.nn.functional.linear(x, dense.to(x.dtype))  # type: ignore[union-attr]
            return y if self.bias is None else y + self.bias.to(y.dtype)
        plan = self.plan(x.device)
        backend = plan.backend
        if backend == "cpu":
            y = self._forward_cpu(x)
        elif backend == "triton":
            y = self._forward_triton(x, plan)
        else:
            y = torch.nn.functional.linear(x, self.dequantized_weight(x.dtype))
        return y if self.bias is None else y + self.bias.to(y.dtype)


def _exact_int4_on(device: torch.device) -> bool:
    """Whether ``dequantized_weight`` takes the C++ pass: on a CPU where the ops build, outside
    a torch.compile trace (whose graph keeps the reference's ops)."""
    if device.type != "cpu" or torch.compiler.is_compiling():
        return False
    from compress.kernels import cpu_gptq

    return cpu_gptq.unavailable_reason(device) is None


@contextlib.contextmanager
def dequantized_for_scoring(model: nn.Module) -> Iterator[int]:
    """Inside the block every weight-only ``QuantLinear`` of ``model`` computes with its
    dequantized float32 weight, held once for the whole block: the reference definition of the
    layer (``dequantized_weight``), run as one float GEMM. Yields the bytes held.

    Why: perplexity scores 512-token windows, where a float GEMM beats the int4/int8 kernels and
    re-dequantizing per call (measured 2026-11-30, SmolLM2 W4, one 512-token forward on 2 Xeon
    cores: 2.2 s through either, 1.3 s for the float model). The kernels' own numerics (bf16
    activations) differ from this by ~0.05% perplexity. W8A8 layers keep their int8 activations
    (part of the format). Costs one float32 copy of the quantized weights while scoring (on a
    GPU one in the model's compute dtype, ``scoring_dtype``); when that exceeds half the memory
    available where the layers are (host or GPU), the layers run as they are and a warning says
    so."""
    layers = [m for m in model.modules() if type(m) is QuantLinear]
    dtype = scoring_dtype(layers[0].weight_scale.device, float_dtype(model)) if layers else None
    element = torch.empty((), dtype=dtype).element_size() if dtype is not None else 0
    need = sum(element * m.in_features * m.out_features for m in layers)
    where = layers[0].weight_scale.device if layers else torch.device("cpu")
    available = available_memory_bytes(where)
    if available is not None and need > available // 2:
        log.warning("scoring through the quantized kernels: a dequantized copy needs %.1f GB, "
                    "more than half the %.1f GB available on %s", need / 1e9, available / 1e9,
                    where)
        layers, need = [], 0
    try:
        for module in layers:
            module._prepared["scoring_weight"] = module.dequantized_weight(dtype)
        yield need
    finally:
        for module in layers:
            module._prepared.pop("scoring_weight", None)


def scoring_dtype(device: torch.device, compute: torch.dtype | None) -> torch.dtype:
    """The dtype of the dequantized weights scoring holds: float32 on the CPU (the reference
    definition); on a GPU the model's compute dtype (bf16 in evaluation there), since the
    forward casts the weight to the activations' dtype per call anyway: the same products
    from half the memory (a 70B model's float32 copy would not fit one GPU)."""
    if device.type == "cpu" or compute is None:
        return torch.float32
    return compute


# ---- W8A8 ---------------------------------------------------------------------------------
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

# float32 represents every integer below 2^24 exactly; |a*b| <= 127^2, so a dot product over at
# most 2^24 // 127^2 = 1040 terms has exact partial sums whatever the summation order.
FLOAT_EXACT_CHUNK = (1 << 24) // (127 * 127)


def int8_int8_reference(x_q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """``x_q [M, K] @ w_q [N, K]^T`` exactly, as int32 (float64 holds every partial sum)."""
    return (x_q.to(torch.float64) @ w_q.to(torch.float64).T).to(torch.int32)


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

    @property
    def kind(self) -> str:
        return "w8a8"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan = self.plan(x.device)
        backend = plan.backend
        x2 = x.reshape(-1, self.in_features)  # [..., K] -> [M, K]
        w_scales = self.weight_scale.to(torch.float32).reshape(1, -1)  # [1, N]
        if backend == "triton":
            from compress.kernels import triton_ops

            y = triton_ops.int8_int8_linear(x2, self.weight, self.weight_scale.reshape(-1, 1),
                                            kernel=plan.kernel or "triton")
        else:
            x_q, x_scales = reference.quantize_per_token_int8(x2)
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


def w8a8_from_linear(linear: nn.Linear, scale_dtype: torch.dtype, backend: str) -> W8A8Linear:
    """Per-channel symmetric RTN of ``linear``'s weight into a ``W8A8Linear``."""
    scheme = WeightScheme(8, None, True, scale_dtype)
    return W8A8Linear.from_linear(linear, scheme, backend=backend)  # type: ignore[return-value]


# ---- mixture-of-experts -------------------------------------------------------------------
class QuantExperts(nn.Module):
    """Quantized sparse-MoE experts: a drop-in for transformers 5's fused experts module
    (``gate_up [E, 2I, H]``, ``down [E, H, I]`` parameters), holding for each expert ``e`` three
    ``QuantLinear`` children ``<e>.<gate>``, ``<e>.<up>`` (``[I, H]``) and ``<e>.<down>``
    (``[H, I]``), named as checkpoints name them (``names``, from ``compress.arch``), so the
    state dict is the per-expert compressed-tensors layout. Gate and up are the two row halves
    of the fused ``gate_up``: group-wise scales run along the input dimension, so quantizing
    them apart is the same as quantizing ``gate_up`` row by row.

    ``forward(x [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` computes what
    transformers' eager experts forward computes with the dequantized weights:
    ``sum_j w_j * down_e(act(gate_e(x)) * up_e(x))`` over the k experts ``e`` picked per token.
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        schemes: tuple[WeightScheme, WeightScheme],  # (gate and up, down)
        names: tuple[str, str, str],  # (gate, up, down) child names
        activation: nn.Module,  # the gated unit: activation(gate, up) (``expert_activation``)
        *,
        bias: bool = False,  # every projection has one (GPT-OSS)
        dtype: torch.dtype = torch.float32,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.names, self.activation = names, activation
        gate, up, down = names
        for e in range(num_experts):
            self.add_module(str(e), nn.ModuleDict({
                gate: QuantLinear(hidden, intermediate, schemes[0], bias=bias, dtype=dtype,
                                  backend=backend),
                up: QuantLinear(hidden, intermediate, schemes[0], bias=bias, dtype=dtype,
                                backend=backend),
                down: QuantLinear(intermediate, hidden, schemes[1], bias=bias, dtype=dtype,
                                  backend=backend),
            }))

    @classmethod
    def like(cls, experts: nn.Module, moe: Moe, schemes: tuple[WeightScheme, WeightScheme],
             dtype: torch.dtype, backend: str = "auto") -> QuantExperts:
        """An empty one for the float fused ``experts`` of ``moe``'s family (its shape, names,
        gated unit and biases, copied), on their device."""
        count, hidden, inter = expert_shape(experts, moe)
        with torch.device(getattr(experts, moe.down).device):
            module = cls(count, hidden, inter, schemes, moe.checkpoint_projections,
                         expert_activation(experts, moe), bias=bool(moe.gate_up_bias),
                         dtype=dtype, backend=backend)
        for e in range(count) if moe.gate_up_bias else ():
            for layer, b in zip(module.projections(e), expert_biases(experts, moe, e),
                                strict=True):
                if b.device.type != "meta":
                    layer.bias.data.copy_(b.detach())
        return module

    @classmethod
    def from_fused(cls, experts: nn.Module, moe: Moe, schemes: tuple[WeightScheme, WeightScheme],
                   *, backend: str = "auto") -> QuantExperts:
        """RTN of the float fused ``experts`` of ``moe``'s family (in their compute dtype:
        stored bf16 and widened per call, they build what their float32 copy would)."""
        module = cls.like(experts, moe, schemes, float_dtype(experts), backend)
        for e in range(module.num_experts):
            weights = expert_weights(experts, moe, e)
            for layer, w in zip(module.projections(e), weights, strict=True):
                layer.set_quantized(*rtn_codes(w.detach(), layer.scheme))
        return module

    def projections(self, e: int) -> tuple[QuantLinear, QuantLinear, QuantLinear]:
        """Expert ``e``'s (gate, up, down) layers."""
        block = self.get_submodule(str(e))
        return tuple(block[n] for n in self.names)  # type: ignore[return-value]

    def quant_linears(self) -> list[QuantLinear]:
        return [q for e in range(self.num_experts) for q in self.projections(e)]

    @property
    def numel(self) -> int:
        return self.num_experts * 3 * self.hidden * self.intermediate

    def weight_bytes(self) -> int:
        return sum(q.weight_bytes() for q in self.quant_linears())

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return routed_experts_forward(self, hidden, top_k_index, top_k_weights)

    def extra_repr(self) -> str:
        q = self.projections(0)
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden}, "
            f"intermediate={self.intermediate}, schemes=({q[0].scheme.describe()}, "
            f"{q[2].scheme.describe()})"
        )


class GatedActivation(nn.Module):
    """``act(gate) * up``: the gated unit of most MoE families' experts (``Moe.glu`` "act")."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.act = act

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act(gate) * up


class ClampedSwiGLU(nn.Module):
    """GPT-OSS's gated unit (``Moe.glu`` "clamped_swiglu"): gate clamped above at ``limit``, up
    to ``[-limit, limit]``, then ``gate * sigmoid(alpha * gate) * (up + 1)``."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = float(alpha), float(limit)

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)


def expert_activation(experts: nn.Module, moe: Moe) -> nn.Module:
    """The gated unit ``(gate, up) -> input of down`` of a float fused experts module."""
    if moe.glu == "clamped_swiglu":
        return ClampedSwiGLU(experts.alpha, experts.limit)
    return GatedActivation(getattr(experts, moe.act))


def routed_experts_forward(
    experts: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """``sum_j w_j * down_e(glu(gate_e(x), up_e(x)))`` over the k experts ``e`` each token
    picked, for a module with ``num_experts``, ``activation`` (the gated unit ``glu``) and
    ``projections(e)`` (the
    (gate, up, down) layers of expert ``e``): ``QuantExperts``, and the float per-expert view
    ``compress.pipeline.tune`` measures through."""
    out = torch.zeros_like(hidden)
    for e in range(experts.num_experts):
        token_idx, pos = torch.where(top_k_index == e)
        if token_idx.numel() == 0:
            continue
        gate, up, down = experts.projections(e)
        x = hidden[token_idx]
        y = down(experts.activation(gate(x), up(x))) * top_k_weights[token_idx, pos, None]
        # index_put_ (a token meets each expert once): index_add_ measured 0.15 s per call
        # on CPU threads here, index_put_ 0.02 ms; the sums are the same.
        out.index_put_((token_idx,), y.to(out.dtype), accumulate=True)
    return out


# ---- sizes --------------------------------------------------------------------------------
def linear_weight_bytes(module: nn.Module) -> int | None:
    """Stored bytes of a linear layer's weight (bias excluded), None for anything else:
    a QuantLinear's codes, scales and zero points; for any other ``nn.Linear`` the tensors its
    state_dict holds, i.e. the weight, plus the absmax / code maps of a bitsandbytes layer (what
    ``save_pretrained`` writes for it)."""
    if isinstance(module, QuantLinear):
        return module.weight_bytes()
    if isinstance(module, nn.Linear):
        return sum(
            t.numel() * t.element_size()
            for k, t in module.state_dict().items()
            if not k.startswith("bias") and torch.is_tensor(t)
        )
    return None


def model_bytes(model: nn.Module) -> dict[str, int]:
    """Stored bytes of a model: ``total`` (every persistent tensor, tied ones once) and
    ``linear`` (every weight matrix ``weight_matrices`` counts: what quantization shrinks)."""
    seen: set[int] = set()
    total = 0
    for tensor in model.state_dict(keep_vars=True).values():
        # tied tensors share storage; meta tensors (a streamed skeleton) have none: the object
        key = id(tensor) if tensor.device.type == "meta" else tensor.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += tensor.numel() * tensor.element_size()
    linear = sum(w.stored_bytes for w in weight_matrices(model).values())
    return {"total": total, "linear": linear}


@dataclass(frozen=True)
class WeightMatrix:
    """One weight matrix of a model as ``weight_matrices`` counts it."""

    numel: int  # weight elements it stands for (an int4 [N, K] layer: N * K)
    stored_bytes: int  # codes + scales + zero points, or the float tensor
    quantized: bool
    target: bool  # a quantization target; False: the MoE router (kept in float on purpose)


def weight_matrices(model: nn.Module) -> dict[str, WeightMatrix]:
    """Every weight matrix of ``model`` but the embeddings and the output head, by name:
    linear layers (float, quantized or bitsandbytes), quantized experts (``QuantExperts``), and
    any other parameter of two or more dimensions (fused float experts ``<experts>.gate_up``,
    the MoE router): whatever a pass left alone is counted, so nothing can hide from the
    bits/weight and coverage numbers. Vectors (norms, biases, GPT-OSS's fused experts' [E, 2I]
    and [E, H] biases: a vector per expert) are not weight matrices."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    routers, biases = _router_names(model), expert_bias_names(model)
    found: dict[str, WeightMatrix] = {}
    inside: tuple[str, ...] = ()  # names of QuantExperts already counted whole
    for name, module in model.named_modules():
        if (head is not None and module is head) or isinstance(module, nn.Embedding):
            continue
        if inside and name.startswith(inside):
            continue
        if isinstance(module, QuantExperts):
            found[name] = WeightMatrix(module.numel, module.weight_bytes(), True, True)
            inside += (name + ".",)
            continue
        size = linear_weight_bytes(module)
        if size is not None:
            quantized = isinstance(module, QuantLinear) or is_bnb_module(module)
            n = module.in_features * module.out_features
            found[name] = WeightMatrix(n, size, quantized, name not in routers)
            continue
        # a router's own parameters, or its submodules' (ERNIE-4.5-MoE's [1, E] selection
        # bias under the router), are kept float as the router is
        in_router = name in routers or any(name.startswith(r + ".") for r in routers)
        for pname, p in module.named_parameters(recurse=False):
            full = f"{name}.{pname}" if name else pname
            if p.dim() >= 2 and full not in biases:
                found[full] = WeightMatrix(
                    p.numel(), p.numel() * p.element_size(), False, not in_router
                )
    return found


def _router_names(model: nn.Module) -> set[str]:
    """Module names of the MoE routers (and shared-expert gates) of ``model``: never targets."""
    return float_only_modules(model)


def bits_per_weight(model: nn.Module, names: list[str] | None = None) -> float | None:
    """Average stored bits per weight element (codes + scales + zero points, or float bits):
    over every weight matrix of ``weight_matrices`` (quantized or not: what a pass reports and
    the bits/weight column of comparison tables), or over the named entries only."""
    found = weight_matrices(model)
    if names is not None:
        found = {n: w for n, w in found.items() if n in set(names)}
    numel = sum(w.numel for w in found.values())
    return 8 * sum(w.stored_bytes for w in found.values()) / numel if numel else None


def quantization_coverage(model: nn.Module) -> dict[str, object]:
    """What share of the quantization targets' weight elements is quantized, and what is not:
    ``quantized_share`` (0..1, None without targets), ``quantized_elements``,
    ``target_elements``, ``router_elements`` (never targets), ``unquantized`` ({name: elements}
    of targets left in float), ``bits_per_weight`` and ``weight_bytes`` over every weight matrix
    (``weight_matrices``)."""
    found = weight_matrices(model)
    targets = {n: w for n, w in found.items() if w.target}
    done = sum(w.numel for w in targets.values() if w.quantized)
    total = sum(w.numel for w in targets.values())
    numel = sum(w.numel for w in found.values())
    stored = sum(w.stored_bytes for w in found.values())
    return {
        "quantized_share": done / total if total else None,
        "quantized_elements": done,
        "target_elements": total,
        "router_elements": sum(w.numel for w in found.values() if not w.target),
        "unquantized": {n: w.numel for n, w in targets.items() if not w.quantized},
        "bits_per_weight": 8 * stored / numel if numel else None,
        "weight_bytes": stored,
    }


def is_bnb_module(module: nn.Module) -> bool:
    """True for bitsandbytes modules; checks the class's module path so nothing gets imported."""
    return type(module).__module__.startswith("bitsandbytes")


def portable_cpu_layout(model: nn.Module) -> int:
    """Keep every bitsandbytes 4-bit layer of ``model`` in the portable layout on CPU; returns
    how many layers were set (duck-typed: bitsandbytes is not imported).

    bitsandbytes repacks a Linear4bit in place on its first CPU forward where the CPU has
    AVX512-BF16 (absmax cast to bf16), and its inverse on save does not restore the fp32
    absmax: measured (bitsandbytes 0.50.2), exporting after one forward changed the reloaded
    logits by 3.5%, and the same checkpoint computed different logits on AVX2 and AVX-512
    CPUs. We store, export, count and compute with the portable layout on every CPU class."""
    count = 0
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
            count += 1
    return count


def set_backend(model: nn.Module, backend: str) -> int:
    """Switch every QuantLinear in ``model`` to ``backend``; returns how many were switched."""
    count = 0
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.backend = backend
            module._prepared.clear()
            count += 1
    return count
