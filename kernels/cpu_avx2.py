"""Our own int4 x fp32 CPU kernel for AVX2 + FMA (``csrc/int4_avx2.cpp``), built on first use.

Why it exists (measured on this project's 2-core AVX2 machine, 1 thread, one decode row):
torch's ``_weight_int4pack_mm_for_cpu`` reads only ~1.4 GB/s of int4 weights, no faster per
layer than the fp32 GEMV on the same shape, because it is bound by unpacking to bf16. This kernel
unpacks 32 codes with a handful of AVX2 instructions and multiplies them in fp32 registers, so
int4 can be as fast as its bytes allow. See scripts/bench_kernels.py --cpu for the numbers.

Layout (``prepack``, once per layer): codes uint8 [N, K/2], in each 32-column block byte i holds
column i (low nibble) and column 16+i (high nibble), codes 0..15; ``w = q * scale + offset`` per
row and group, fp32 scales and offsets [N, K/g]. Symmetric and asymmetric weights both fit
(offset = -(8 + zero) * scale for our signed codes and zero points). Group sizes: multiples of 32.

Built with torch.utils.cpp_extension (g++ and ninja; ~1 minute the first time, cached under
torch's extensions directory after). ``available()`` says whether it can run here and, if not,
``unavailable_reason()`` says why (no AVX2/FMA, no compiler, build error): callers fall back to
torch's kernel.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from . import reference

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("csrc") / "int4_avx2.cpp"


@dataclass(frozen=True)
class Int4Avx2Weight:
    """A layer's int4 weight in the AVX2 kernel's layout."""

    codes: torch.Tensor  # uint8 [N, K/2]
    scales: torch.Tensor  # fp32 [N, K/g]
    offsets: torch.Tensor  # fp32 [N, K/g]
    group_size: int

    @property
    def n(self) -> int:
        return self.codes.shape[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets))


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return set(f.read().split())
    except OSError:
        return set()


@functools.cache
def unavailable_reason() -> str | None:
    """None when the kernel is built and loaded, else why not (cached: builds at most once)."""
    flags = _cpu_flags()
    if not {"avx2", "fma"} <= flags:
        return "the CPU does not report AVX2 and FMA (or /proc/cpuinfo is unreadable)"
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(
            name="compress_int4_avx2",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-mavx2", "-mfma"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001  (no compiler, no ninja, build error: fall back)
        return f"building {SOURCE.name} failed: {type(exc).__name__}: {str(exc)[:300]}"
    _register_fake()
    return None


def available() -> bool:
    reason = unavailable_reason()
    if reason is not None:
        log.info("AVX2 int4 kernel unavailable: %s", reason)
    return reason is None


def _register_fake() -> None:
    """Shape function so torch.compile can keep the op in a graph as an extern call."""

    @torch.library.register_fake("compress_cpu::int4_linear")
    def _(x, codes, scales, offsets, group):
        return x.new_empty(x.shape[0], codes.shape[0])


def unsupported_reason(n: int, k: int, group_size: int) -> str | None:
    """Why this kernel cannot take a layer's shape, or None if it can."""
    if group_size % 32:
        return f"group_size {group_size} is not a multiple of 32"
    if k % group_size:
        return f"K={k} not divisible by group_size {group_size}"
    return None


def prepack(
    w_packed: torch.Tensor,
    scales: torch.Tensor,
    zeros_packed: torch.Tensor | None,
    *,
    group_size: int,
    k: int,
) -> Int4Avx2Weight:
    """Our packed int4 weight (signed codes, ``w = (w_q - zeros) * scales``) -> kernel layout."""
    n = w_packed.shape[0]
    reason = unsupported_reason(n, k, group_size)
    if reason is not None:
        raise ValueError(f"AVX2 int4 kernel cannot take this layer: {reason}")
    q = (reference.unpack_int4(w_packed, k).to(torch.int16) + 8).to(torch.uint8)  # [N, K] 0..15
    blocks = q.view(n, k // 32, 2, 16)  # [N, blocks, half, 16]
    codes = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    scales32 = scales.to(torch.float32)
    zeros = (
        torch.zeros_like(scales32)
        if zeros_packed is None
        else reference.unpack_int4(zeros_packed, n, dim=0).to(torch.float32)
    )
    offsets = (-(8.0 + zeros) * scales32).contiguous()
    return Int4Avx2Weight(codes, scales32.contiguous(), offsets, group_size)


def int4_linear(x: torch.Tensor, weight: Int4Avx2Weight) -> torch.Tensor:
    """``x [..., K] @ W.T`` in fp32 (x's dtype outside)."""
    reason = unavailable_reason()  # builds and loads the op on first use
    if reason is not None:
        raise RuntimeError(f"AVX2 int4 kernel unavailable: {reason}")
    x2 = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()
    y = torch.ops.compress_cpu.int4_linear(
        x2, weight.codes, weight.scales, weight.offsets, weight.group_size
    )
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.n)


def int4_linear_reference(x: torch.Tensor, weight: Int4Avx2Weight) -> torch.Tensor:
    """The same product in float64 from the kernel layout, plain torch (for tests)."""
    n, half = weight.codes.shape
    k = half * 2
    c = weight.codes.view(n, k // 32, 16)
    q = torch.stack([c & 0xF, c >> 4], dim=2).reshape(n, k).to(torch.float64)
    g = weight.group_size
    w = q.view(n, k // g, g) * weight.scales.double()[..., None] + weight.offsets.double()[..., None]
    return x.to(torch.float64) @ w.view(n, k).T
