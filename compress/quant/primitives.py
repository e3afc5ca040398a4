"""Pure tensor math for integer weight quantization: parameters, quantize, fake-quantize.

Conventions (shared with ``compress/kernels/reference.py``, which owns packing and dequantization):
signed codes ``w_q`` in ``[-2**(b-1), 2**(b-1) - 1]``, scales ``[N, K // group_size]``,
signed zero points of the same shape (asymmetric only), ``w = (w_q - zeros) * scales``.

* symmetric: ``scale = max|w_group| / (2**(b-1) - 1)``, zero point 0; the code -2**(b-1) is
  unused, so the largest magnitude is never clipped. With ``full_range`` the scale is
  ``max|w_group| / ((2**b - 1) / 2)`` (amax / 7.5 at 4 bits, as compressed-tensors and AutoGPTQ
  do): all 2**b codes are used, every step is 7% finer at 4 bits, and the largest positive
  weight lands on code 7 with error exactly scale/2 (still the rounding bound).
* asymmetric: the group's [min, max] range is widened to contain 0 (so the zero point is an
  in-range integer, as compressed-tensors requires), ``scale = (max - min) / (2**b - 1)``,
  ``zero = round(qmin - min / scale)``.
"""

from __future__ import annotations

import torch

from compress.kernels import reference


def code_range(n_bits: int) -> tuple[int, int]:
    """Signed code range ``(qmin, qmax)`` for ``n_bits``."""
    return -(2 ** (n_bits - 1)), 2 ** (n_bits - 1) - 1


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group_size {group_size} does not divide in_features {k}")
    return w.to(torch.float32).reshape(n, k // group_size, group_size)  # [N, K/g, g]


def compute_qparams(
    w: torch.Tensor, *, n_bits: int, group_size: int, symmetric: bool, full_range: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min/max quantization parameters for ``w [N, K]`` -> ``(scales fp32, zeros int8 | None)``;
    ``full_range``: the symmetric grid of the module docstring that uses every code."""
    groups = _grouped(w, group_size)
    qmin, qmax = code_range(n_bits)
    if symmetric:
        amax = groups.abs().amax(dim=-1)
        scales = amax / ((qmax - qmin) / 2 if full_range else qmax)
        return torch.where(scales > 0, scales, torch.ones_like(scales)), None
    wmin = groups.amin(dim=-1).clamp(max=0.0)
    wmax = groups.amax(dim=-1).clamp(min=0.0)
    scales = (wmax - wmin) / (qmax - qmin)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    zeros = torch.clamp(torch.round(qmin - wmin / scales), qmin, qmax).to(torch.int8)
    return scales, zeros


def quantize(
    w: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    *,
    n_bits: int,
    group_size: int,
) -> torch.Tensor:
    """Integer codes (int8 holder) for ``w [N, K]`` under the given parameters."""
    groups = _grouped(w, group_size)
    qmin, qmax = code_range(n_bits)
    codes = torch.round(groups / scales.to(torch.float32).unsqueeze(-1))
    if zeros is not None:
        codes = codes + zeros.to(torch.float32).unsqueeze(-1)
    return torch.clamp(codes, qmin, qmax).to(torch.int8).reshape(w.shape)


def fake_quantize(
    w: torch.Tensor, *, n_bits: int, group_size: int, symmetric: bool, full_range: bool = False
) -> torch.Tensor:
    """Quantize then dequantize (RTN with min/max parameters), in w's dtype."""
    scales, zeros = compute_qparams(
        w, n_bits=n_bits, group_size=group_size, symmetric=symmetric, full_range=full_range
    )
    w_q = quantize(w, scales, zeros, n_bits=n_bits, group_size=group_size)
    return reference.dequantize(w_q, scales, zeros, group_size, w.dtype)
