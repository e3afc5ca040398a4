"""Our int4 x int8 CPU kernel for AVX2 (``csrc/int4_q8_avx2.cpp``), built on first use.

llama.cpp's Q4 x Q8 scheme: the activations are rounded to int8 per block of 32 columns
(scale = amax / 127) and each block's dot product with the int4 codes is done in integers.

Why it exists (measured on this project's 2-core AVX2 machine, see docs/results.md):
torch's ``_weight_int4pack_mm_for_cpu`` reads only ~1.4-2.5 GB/s of int4 weights per thread,
bound by unpacking to bf16, and an fp32-FMA kernel of ours (commit ec455b4) was no faster; the
integer dot product was 1.5-1.8x faster per decode layer. The price is the activation rounding:
+0.2% WikiText-2 perplexity on SmolLM2 W4 (``scripts/bench_q8_activations.py``), and outputs no
longer bit-identical to the bf16 path, so the runtime uses it only when asked
(``Runtime(..., int4_kernel="q4q8")``) and only in decode (one to a few rows).

Layout (``prepack``, once per layer): codes uint8 [N, K/2], in each 32-column block byte i holds
column i (low nibble) and column 16+i (high nibble), codes 0..15; ``w = q * scale + offset`` per
row and group, fp32 scales and offsets [N, K/g]. Symmetric and asymmetric weights both fit
(offset = -(8 + zero) * scale for our signed codes and zero points). Group sizes: multiples of 32.

Built with torch.utils.cpp_extension (a C++ compiler and the ``ninja`` package, in the ``dev``
and ``cpu-kernels`` extras; ~1 minute the first time, cached under torch's extensions directory
after). ``unavailable_reason()`` says why it cannot run here (no AVX2, no compiler or ninja,
build error); callers fall back to torch's kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from . import cpuinfo, reference

SOURCE = Path(__file__).with_name("csrc") / "int4_q8_avx2.cpp"
BLOCK = 32  # activation block (and code block) width


@dataclass(frozen=True)
class Int4Q8Weight:
    """A layer's int4 weight in this kernel's layout."""

    codes: torch.Tensor  # uint8 [N, K/2]
    scales: torch.Tensor  # fp32 [N, K/g]
    offsets: torch.Tensor  # fp32 [N, K/g]
    group_size: int

    @property
    def n(self) -> int:
        return self.codes.shape[0]


@functools.cache
def unavailable_reason() -> str | None:
    """None when the op is built and loaded, else why not (cached: builds at most once)."""
    if not cpuinfo.has_avx2(cpuinfo.cpu_flags()):
        return "the CPU does not report AVX2 (or /proc/cpuinfo is unreadable)"
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(
            name="compress_int4_q8_avx2",
            sources=[str(SOURCE)],
            # -fopenmp: at::parallel_for only spreads over threads when the op is built with
            # OpenMP (measured: without it 2 threads ran no faster than 1)
            extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001  (no compiler, no ninja, build error: fall back)
        return f"building {SOURCE.name} failed: {type(exc).__name__}: {str(exc)[:300]}"

    @torch.library.register_fake("compress_cpu::int4_linear_q8")
    def _(x, codes, scales, offsets, group):  # shapes only, so torch.compile keeps the call
        return x.new_empty(x.shape[0], codes.shape[0])

    return None


def unsupported_reason(n: int, k: int, group_size: int) -> str | None:
    """Why this kernel cannot take a layer's shape, or None if it can (asked by ``dispatch``)."""
    if group_size % BLOCK:
        return f"group_size {group_size} is not a multiple of {BLOCK}"
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
) -> Int4Q8Weight:
    """Our packed int4 weight (signed codes, ``w = (w_q - zeros) * scales``) -> kernel layout."""
    n = w_packed.shape[0]
    reason = unsupported_reason(n, k, group_size)
    if reason is not None:
        raise ValueError(f"AVX2 int4 kernel cannot take this layer: {reason}")
    codes, scales32, zeros = reference.int4_unsigned_parts(w_packed, scales, zeros_packed, k)
    halves = codes.to(torch.uint8).view(n, k // BLOCK, 2, BLOCK // 2)  # [N, blocks, lo/hi, 16]
    nibble_pairs = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    offsets = (-(8.0 + zeros) * scales32).contiguous()
    return Int4Q8Weight(nibble_pairs, scales32.contiguous(), offsets, group_size)


def int4_linear_q8(x: torch.Tensor, weight: Int4Q8Weight) -> torch.Tensor:
    """``x [..., K] @ W.T`` with x rounded to int8 per block, fp32 out (x's dtype outside)."""
    reason = unavailable_reason()  # builds and loads the op on first use
    if reason is not None:
        raise RuntimeError(f"AVX2 int4 kernel unavailable: {reason}")
    x2 = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()
    y = torch.ops.compress_cpu.int4_linear_q8(
        x2, weight.codes, weight.scales, weight.offsets, weight.group_size
    )
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.n)


def round_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (int8-valued codes [M, K/32, 32], scales [M, K/32, 1]) as the kernel
    rounds them: scale = amax / 127 in fp32 (1 for an all-zero block), round half to even."""
    blocks = x.to(torch.float32).reshape(x.shape[0], -1, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(blocks / scale), scale


def int4_linear_q8_reference(x: torch.Tensor, weight: Int4Q8Weight) -> torch.Tensor:
    """The kernel's product in float64 from its layout, plain torch (for tests)."""
    n, half = weight.codes.shape
    k, g = half * 2, weight.group_size
    x2 = x.reshape(-1, k).to(torch.float32)
    xq, xscale = round_activations(x2)  # [M, B, 32], [M, B, 1]
    c = weight.codes.view(n, k // BLOCK, BLOCK // 2)
    q = torch.cat([c & 0xF, c >> 4], dim=-1).to(torch.float64)  # [N, B, 32]
    dots = torch.einsum("mbt,nbt->mnb", xq.double(), q)  # exact integers
    w_scale = weight.scales.double().repeat_interleave(g // BLOCK, dim=1)  # [N, B]
    y = (dots * xscale.double()[:, None, :, 0] * w_scale[None]).sum(-1)
    xsum = x2.double().view(x2.shape[0], k // g, g).sum(-1)  # [M, K/g], from the exact x
    return y + xsum @ weight.offsets.double().T
