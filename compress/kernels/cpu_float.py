"""Float linears over bf16 weights on the CPU (``csrc/bf16_linear.cpp``, built with the
integer-dot kernels of ``cpu_q8``): ``bf16_weight_linear`` computes ``x @ w.T`` in fp32 from
weights held in bf16, reading half the bytes of an fp32 copy. Not oneDNN's bf16 path: x is not
rounded to bf16, so the result is the fp32 product of the same weights, within fp32 rounding
(``bf16_weight_linear_reference`` is the definition).

The runtime holds a float linear this way (``runtime.float_linear._FloatLinear.pack``) where its
weights are bf16 on a CPU without bf16 matmuls (oneDNN has no bf16 path and ATen's bf16 GEMM is
several times slower than fp32), and where they are fp32 of bf16 values (a bf16 checkpoint served
in fp32: the copy is lossless). Measured on an AVX2-only AMD EPYC (Zen 3), 2 threads, weights
from DRAM, us per call, ATen fp32 / oneDNN fp32 packed for 32 rows / ours
(``scripts/bench_float_linears.py --bf16-weights --shapes 49152x576 3072x576 576x1536 --rows 1
8 32 128 256 --copies 4 --pack-rows 32 --rounds 9``; ATen's bf16 GEMM: 3.2-3.7 ms at 1 row of
the head, 98 ms at 32 rows):

| rows | 49152x576 (head) | 3072x576 | 576x1536 |
|---:|---:|---:|---:|
| 1 | 8981 / 5164 / 2712 | 536 / 293 / 95 | 135 / 145 / 53 |
| 8 | 19998 / 6986 / 5630 | 844 / 478 / 356 | 285 / 226 / 157 |
| 32 | 34388 / 17555 / 16044 | 1412 / 971 / 1019 | 691 / 595 / 469 |
| 128 | 75551 / 49063 / 47836 | 4568 / 3113 / 3446 | 1888 / 1821 / 1469 |
| 256 | 150236 / 118593 / 130214 | 7907 / 7620 / 9634 | 4943 / 3749 / 3356 |

Under 24 rows the op runs dot-product tiles, from there a blocked GEMM (the csrc file says why);
at 128-256 rows both are within the run's noise of oneDNN (10-30% on that VM).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compress.kernels import cpu_q8

# rows of fp32 weights checked at a time by ``bf16_exact`` (bounds its temporary)
_EXACT_CHUNK_ELEMENTS = 1 << 22


def cpu_bf16_matmuls() -> bool:
    """Whether this CPU multiplies bf16 natively (oneDNN's bf16 path: AVX512-BF16 or AMX)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bf16_weights_fast() -> bool:
    """Whether bf16 weights multiply on this CPU about as fast as fp32 ones: oneDNN's bf16 path
    (bf16 matmuls), or ``bf16_weight_linear`` (it builds here). Where neither, ATen's bf16 GEMM
    is what is left: 1.9-8x slower than fp32 on an AVX2-only EPYC."""
    return cpu_bf16_matmuls() or unavailable_reason(torch.device("cpu")) is None


def unavailable_reason(device: torch.device) -> str | None:
    """Why ``bf16_weight_linear`` cannot run on ``device``, or None."""
    if device.type != "cpu":
        return f"the tensors are on {device.type}, the op is CPU-only"
    return cpu_q8.unavailable_reason()


def bf16_weight_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] fp32 or bf16, w [N, K] bf16 contiguous -> x @ w.T in fp32 [..., N]."""
    out = cpu_q8.ops().bf16_weight_linear(x.reshape(-1, x.shape[-1]), w)
    return out.view(*x.shape[:-1], w.shape[0])


def bf16_weight_linear_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), w.float())


def holds_bf16_copy(w: torch.Tensor) -> bool:
    """Whether the runtime holds a float linear of weights ``w`` as a bf16 copy run by
    ``bf16_weight_linear``: on a CPU without bf16 matmuls where the op builds, bf16 weights
    (ATen's bf16 GEMM is the other way there) and fp32 weights of bf16 values (half the bytes
    a decode step streams; prompt chunks run about as fast as oneDNN's fp32 GEMM: the module
    docstring). Not on CPUs with bf16 matmuls: oneDNN's bf16 path is their fast one, and this
    op was not measured there."""
    if w.device.type != "cpu" or cpu_bf16_matmuls():
        return False
    if w.dtype not in (torch.bfloat16, torch.float32):
        return False
    return unavailable_reason(w.device) is None and (w.dtype == torch.bfloat16 or bf16_exact(w))


def bf16_exact(w: torch.Tensor) -> bool:
    """Whether every value of the fp32 tensor ``w`` is a bf16 value (its low 16 bits zero), so
    that a bf16 copy loses nothing."""
    if w.dtype != torch.float32:
        return False
    bits = w.detach().contiguous().view(-1).view(torch.int32)
    for start in range(0, bits.numel(), _EXACT_CHUNK_ELEMENTS):
        if torch.any(bits[start:start + _EXACT_CHUNK_ELEMENTS] & 0xFFFF):
            return False
    return True
