"""The calibrated passes' two hot loops on a CPU in C++ (``csrc/gptq_walk.cpp``, built with the
integer-dot kernels of ``cpu_q8``), each beside the torch code it replaces, which stays the
reference and the fallback where the ops do not build:

- ``walk``: GPTQ's column walk over one block, every row on its own (rows split over the
  threads); reference ``compress.quant.gptq._walk_block``. Same rounding and division; the
  error update may contract to FMA as torch's ``addr_`` may, so a code can differ in a rare tie.
- ``dequantize_int4``: an int4 layer's float32 weight ``(code - zero) * scale``, bit-equal to
  ``compress.kernels.reference.dequantize`` of ``reference.unpack_int4``'s codes: what every
  calibration forward through a quantized layer computes with.

Measured on a Xeon with 2 threads, GPTQ of a 7B-shaped layer (16 x 512 tokens): the torch walk
and the reference dequantization were 24% and 16% of the layer's time (py-spy;
scripts/bench_calibrated_layer.py times the layer before and after).
"""

from __future__ import annotations

import torch

from compress.kernels import cpu_q8


def unavailable_reason(device: torch.device) -> str | None:
    """Why the ops cannot run on ``device``, or None."""
    if device.type != "cpu":
        return f"the tensors are on {device.type}, the ops are CPU-only"
    return cpu_q8.unavailable_reason()


def walk(w1: torch.Tensor, hinv1: torch.Tensor, scales: torch.Tensor,
         zeros: torch.Tensor | None, codes: torch.Tensor, err1: torch.Tensor,
         losses: torch.Tensor, cols: torch.Tensor, groups: torch.Tensor, start: int, stop: int,
         qmin: int, qmax: int) -> None:
    """Columns ``start..stop-1`` of the block ``w1 [N, width]`` in place, as the Triton walk's
    arguments (``compress.kernels.gptq_walk``): ``hinv1`` contiguous ``[width, width]``,
    ``cols``/``groups`` int32 ``[width]``."""
    cpu_q8.ops().gptq_walk(w1, hinv1, scales, zeros, codes, err1, losses, cols, groups, start,
                           stop, qmin, qmax)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor,
                    zeros_packed: torch.Tensor | None, in_features: int,
                    group_size: int) -> torch.Tensor:
    """fp32 ``[N, in_features]`` from int4 codes packed ``[N, K/8]`` int32, fp32 scales
    ``[N, K/g]`` and zero points packed along N ``[N/8, K/g]`` (or None)."""
    return cpu_q8.ops().dequantize_int4_exact(packed.contiguous(), scales.float().contiguous(),
                                              None if zeros_packed is None
                                              else zeros_packed.contiguous(),
                                              in_features, group_size)
