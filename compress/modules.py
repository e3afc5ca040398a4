"""Runtime modules the passes swap into a model: ``QuantLinear``.

A ``QuantLinear`` holds exactly the tensors the compressed-tensors checkpoint stores, under the
same names, so export is ``state_dict()`` and reload is ``load_state_dict()``:

* int4 (``pack-quantized``): ``weight_packed`` int32 ``[N, ceil(K/8)]``, ``weight_shape`` int64
  ``[2]``, ``weight_scale [N, K/g]``, and for asymmetric ``weight_zero_point`` int32 packed on
  dim 0 ``[ceil(N/8), K/g]``;
* int8 (``int-quantized``): ``weight`` int8 ``[N, K]``, ``weight_scale [N, K/g]`` (``[N, 1]``
  per channel), asymmetric ``weight_zero_point`` int8 ``[N, K/g]``.

The forward runs on a backend chosen per device by ``compress.kernels.dispatch``; backend
specific repacks (the native CPU int4 layout) are made once, on first use, and not saved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from compress import quant_primitives
from compress.kernels import cpu_native, dispatch, reference


@dataclass(frozen=True)
class WeightScheme:
    """How one linear layer's weight is quantized."""

    n_bits: int  # 4 or 8
    group_size: int | None  # input channels per scale; None = one scale per output channel
    symmetric: bool = True
    scale_dtype: torch.dtype = torch.float16
    full_range: bool = False  # symmetric grid amax / 7.5 instead of amax / 7 (quant_primitives)

    def resolved_group(self, in_features: int) -> int:
        return in_features if self.group_size is None else self.group_size

    @property
    def format(self) -> str:
        """compressed-tensors format name of this scheme."""
        return "pack-quantized" if self.n_bits == 4 else "int-quantized"

    def describe(self) -> str:
        group = "channel" if self.group_size is None else f"g{self.group_size}"
        return f"W{self.n_bits}{group}{'' if self.symmetric else '-asym'}"


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
            dtype=w.dtype,
            backend=backend,
        )
        group = scheme.resolved_group(linear.in_features)
        if w_q is None:
            scales, zeros = quant_primitives.compute_qparams(
                w,
                n_bits=scheme.n_bits,
                group_size=group,
                symmetric=scheme.symmetric,
                full_range=scheme.full_range,
            )
            # Codes are computed against the scales as stored, so that stored = used.
            scales = scales.to(scheme.scale_dtype)
            w_q = quant_primitives.quantize(
                w, scales, zeros, n_bits=scheme.n_bits, group_size=group
            )
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
            self.weight_packed = reference.pack_int4(w_q.to(torch.int8).cpu()).to(w_q.device)
            if zeros is not None:
                zp = reference.pack_int4(zeros.to(torch.int8).cpu(), dim=0)
                self.weight_zero_point = zp.to(w_q.device)
        else:
            self.weight = w_q.to(torch.int8)
            if zeros is not None:
                self.weight_zero_point = zeros.to(torch.int8)
        self.weight_scale = scales.to(self.scheme.scale_dtype)
        self._prepared.clear()

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
        """The float ``[N, K]`` weight this layer computes with (reference definition)."""
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
    def resolved_backend(self, device: torch.device) -> str:
        key = f"backend:{device}"
        if key not in self._prepared:
            self._prepared[key] = dispatch.resolve_backend(
                self.backend,
                "int4" if self.scheme.n_bits == 4 else "int8",
                device=device,
                n=self.out_features,
                k=self.in_features,
                group_size=self.group_size,
                symmetric=self.scheme.symmetric,
            )
        return self._prepared[key]  # type: ignore[return-value]

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

    def _forward_triton(self, x: torch.Tensor) -> torch.Tensor:
        from compress.kernels import triton_ops

        x2 = x.reshape(-1, self.in_features)
        if self.scheme.n_bits == 4:
            zp = None if self.scheme.symmetric else self.weight_zero_point
            y = triton_ops.int4_linear(
                x2, self.weight_packed, self.weight_scale, zp, group_size=self.group_size
            )
        else:
            zp = None if self.scheme.symmetric else self.weight_zero_point
            y = triton_ops.int8_linear(x2, self.weight, self.weight_scale, zp)
        return y.reshape(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        backend = self.resolved_backend(x.device)
        if backend == "cpu":
            y = self._forward_cpu(x)
        elif backend == "triton":
            y = self._forward_triton(x)
        else:
            y = torch.nn.functional.linear(x, self.dequantized_weight(x.dtype))
        return y if self.bias is None else y + self.bias.to(y.dtype)


def model_bytes(model: nn.Module) -> dict[str, int]:
    """Stored bytes of a model: ``total`` (every persistent tensor, tied ones once) and
    ``linear`` (the Linear/QuantLinear/bitsandbytes weights inside the decoder, i.e. what
    quantization shrinks; lm_head excluded; bnb weights counted with their absmax/code maps)."""
    from compress.bnb import bnb_weight_bytes, is_bnb_module  # lazy: compress.bnb imports us

    seen: set[int] = set()
    total = 0
    for tensor in model.state_dict().values():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    linear = 0
    for name, module in model.named_modules():
        if name.endswith("lm_head"):
            continue
        if isinstance(module, QuantLinear):
            linear += module.weight_bytes()
        elif is_bnb_module(module) and isinstance(module, nn.Linear):
            linear += bnb_weight_bytes(module)  # before nn.Linear: Linear8bitLt subclasses it
        elif isinstance(module, nn.Linear):
            linear += module.weight.numel() * module.weight.element_size()
    return {"total": total, "linear": linear}


def set_backend(model: nn.Module, backend: str) -> int:
    """Switch every QuantLinear in ``model`` to ``backend``; returns how many were switched."""
    count = 0
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.backend = backend
            module._prepared.clear()
            count += 1
    return count
