"""The native int4 CPU kernel's repack (``cpu_native.prepack_int4``): the bytes it writes from
our packed words equal torch's own repack of the int32 codes (``prepack_int4_reference``) at
every ATen CPU level this machine has, including shapes the fast path leaves to torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compress.kernels import cpu_native, reference

# (N, K, group, symmetric): N a multiple of 64 (both fast layouts), of 32 only (AVX2's fast
# layout, torch's repack at AVX-512), of 16 only (torch's repack everywhere)
SHAPES = [(128, 256, 64, True), (192, 128, 32, False), (96, 256, 128, True),
          (48, 128, 32, False), (64, 1024, 256, False)]  # fmt: skip


def packed_weight(n: int, k: int, group: int, symmetric: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w_packed = reference.pack_int4(torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=g))
    scales = torch.rand(n, k // group, generator=g).to(torch.float16) + 0.01
    zp = None
    if not symmetric:
        zeros = torch.randint(-8, 8, (n, k // group), dtype=torch.int8, generator=g)
        zp = reference.pack_int4(zeros, dim=0)
    return w_packed, scales, zp


def check_shapes(seed: int) -> None:
    """Every shape of SHAPES: the repack's bytes, its scales and zeros, and a product with it
    equal torch's repack (``prepack_int4_reference``)."""
    for n, k, group, symmetric in SHAPES:
        w_packed, scales, zp = packed_weight(n, k, group, symmetric, seed)
        got = cpu_native.prepack_int4(w_packed, scales, zp, group_size=group, k=k)
        want = cpu_native.prepack_int4_reference(w_packed, scales, zp, group_size=group, k=k)
        assert torch.equal(got.packed, want.packed), (n, k, group, symmetric)
        assert torch.equal(got.scale_and_zero, want.scale_and_zero), (n, k, group, symmetric)
        assert got.packed.data_ptr() % cpu_native.ALIGNMENT == 0
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(cpu_native.int4_mm(x, got), cpu_native.int4_mm(x, want))


def test_repack_equals_torchs_repack():
    check_shapes(seed=0)


def test_the_fast_layout_is_found_on_vector_levels():
    # torch writes a blocked layout at its AVX2 and AVX-512 levels; if a torch release changes
    # it, the probe returns None and the repack falls back to torch's (slow, still correct):
    # this test says so instead of letting the repack get slow unnoticed
    level = torch.backends.cpu.get_cpu_capability()
    if level not in ("AVX2", "AVX512"):
        pytest.skip(f"ATen runs its {level} level here")
    assert cpu_native.int4_layout_block() == {"AVX2": 32, "AVX512": 64}[level]


_CHILD = (
    "import sys, torch; sys.path.insert(0, 'tests/kernels'); import test_cpu_native as t; "
    "from compress.kernels import cpu_native; t.check_shapes(seed=1); "
    "print(torch.backends.cpu.get_cpu_capability(), cpu_native.int4_layout_block())"
)


def test_repack_equals_torchs_at_every_lower_aten_level():
    # ATen's level is fixed per process (ATEN_CPU_CAPABILITY), and so is torch's layout: one
    # child per level below this CPU's (its own level ran above)
    lower = {"AVX512": ["default", "avx2"], "AVX2": ["default"]}
    levels = lower.get(torch.backends.cpu.get_cpu_capability(), [])
    if not levels:
        pytest.skip("no lower ATen level to run")
    root = Path(__file__).resolve().parents[2]
    for level in levels:
        env = {**os.environ, "ATEN_CPU_CAPABILITY": level}
        proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                              text=True, cwd=root)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.split()[0] == level.upper()


# Run apart: before the fix torch's int8 kernel killed the process at these shapes.
_INT8_ODD_K = """
import torch
from torch import nn
from compress.quant.rtn import Int8RtnConfig, quantize_linears
for k in (8, 24, 40, 72, 136, 200):
    for rows in (1, 4):
        lin = nn.Linear(k, 64, bias=False)
        holder = nn.Sequential(lin)
        quantize_linears(holder, Int8RtnConfig(targets=["re:.*"], ignore=[]), 8, "test")
        q = holder[0]
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k))
        want = x @ q.dequantized_weight(torch.float32).T
        err = float((q(x).float() - want).abs().max() / want.abs().max())
        assert err < 2e-2, (k, rows, err, q.plan(x.device))
print("ok")
"""


def test_int8_layers_with_k_not_a_multiple_of_16_compute_their_weights():
    """torch's ``_weight_int8pack_mm`` returns garbage or dies (SIGSEGV) when K is not a
    multiple of 16 (measured on AVX-512); such layers must take another path and still equal
    their dequantized weights (the bf16 activations' rounding apart)."""
    assert cpu_native.int8_unsupported_reason(64, 72, 72, True) is not None
    assert cpu_native.int8_unsupported_reason(64, 80, 80, True) is None
    proc = subprocess.run([sys.executable, "-c", _INT8_ODD_K], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode,
                                                                   proc.stderr[-2000:])
