"""Pure tensor math for integer weight quantization: parameters, quantize, fake-quantize.

Conventions (shared with ``compress/kernels/reference.py``, which owns packing and dequantization):
signed codes ``w_q`` in ``[-2**(b-1), 2**(b-1) - 1]``, scales ``[N, K // group_size]``,
signed zero points of the same shape (asymmetric only), ``w = (w_q - zeros) * scales``.

* symmetric, three grids (``grid``):
  - ``restricted``: ``scale = max|w_group| / (2**(b-1) - 1)``, zero point 0; the code -2**(b-1)
    is unused, so the largest magnitude is never clipped;
  - ``full``: ``scale = max|w_group| / ((2**b - 1) / 2)`` (amax / 7.5 at 4 bits, as
    compressed-tensors and AutoGPTQ do): all 2**b codes are used, every step is 7% finer at
    4 bits, and the largest positive weight lands on code 7 with error exactly scale/2;
  - ``signed`` (llama.cpp's Q4_0 and auto-round's choice): ``scale = ±max|w_group| / 2**(b-1)``
    with the sign chosen so that the largest magnitude lands exactly on code -2**(b-1)
    (negative scale when it is a positive weight): steps 14% finer than ``restricted`` at 4
    bits; a weight of the other sign as large as it is clipped by at most one step. Scales may
    be negative; ``w = w_q * scale`` holds as for the others.
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


GRIDS = ("restricted", "full", "signed")  # the symmetric grids of the module docstring


def symmetric_scales(
    wmax: torch.Tensor, wmin: torch.Tensor, n_bits: int, grid: str
) -> torch.Tensor:
    """Symmetric scales from each group's ``wmax >= 0`` and ``wmin <= 0`` under ``grid`` (module
    docstring); 1 for an all-zero group. Differentiable in wmax/wmin (AutoRound's clipping)."""
    qmin, qmax = code_range(n_bits)
    amax = torch.maximum(wmax, -wmin)
    if grid == "restricted":
        scales = amax / qmax
    elif grid == "full":
        scales = amax / ((qmax - qmin) / 2)
    elif grid == "signed":  # the largest magnitude on code qmin: negative when it is positive
        scales = torch.where(wmax < -wmin, amax, -amax) / -qmin
    else:
        raise ValueError(f"grid {grid!r}: expected one of {GRIDS}")
    return torch.where(scales != 0, scales, torch.ones_like(scales))


def compute_qparams(
    w: torch.Tensor, *, n_bits: int, group_size: int, symmetric: bool, grid: str = "restricted"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min/max quantization parameters for ``w [N, K]`` -> ``(scales fp32, zeros int8 | None)``;
    ``grid``: the symmetric grid (module docstring)."""
    groups = _grouped(w, group_size)
    qmin, qmax = code_range(n_bits)
    if symmetric:
        wmax = groups.amax(dim=-1).clamp(min=0.0)
        wmin = groups.amin(dim=-1).clamp(max=0.0)
        return symmetric_scales(wmax, wmin, n_bits, grid), None
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
    w: torch.Tensor, *, n_bits: int, group_size: int, symmetric: bool, grid: str = "restricted"
) -> torch.Tensor:
    """Quantize then dequantize (RTN with min/max parameters), in w's dtype."""
    scales, zeros = compute_qparams(
        w, n_bits=n_bits, group_size=group_size, symmetric=symmetric, grid=grid
    )
    w_q = quantize(w, scales, zeros, n_bits=n_bits, group_size=group_size)
    return reference.dequantize(w_q, scales, zeros, group_size, w.dtype)
