"""Native kernels get operands they accept, wherever the weights sit in memory.

``torch._weight_int8pack_mm`` dies with SIGSEGV on AVX-512 CPUs when its weight or activations
are not 16-byte aligned, and safetensors aligns tensors only to 8 bytes. Each case runs in a
subprocess (alignment_worker.py) so a crash fails the test instead of killing the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compress.kernels import cpu_native

WORKER = Path(__file__).with_name("alignment_worker.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("offset", range(0, 64, 8), ids=lambda o: f"offset{o}")
def test_aligned_gives_a_64_byte_aligned_equal_copy(offset):
    base = torch.empty(4096 + 128, dtype=torch.uint8)
    start = -base.data_ptr() % 64 + offset
    t = base[start : start + 64 * 32].view(torch.int8).view(64, 32)
    t.copy_(torch.randint(-128, 127, (64, 32), dtype=torch.int8))
    out = cpu_native.aligned(t)
    assert out.data_ptr() % 64 == 0 and torch.equal(out, t) and out.is_contiguous()
    assert (out is t) == (offset == 0)  # no copy when already aligned


@pytest.mark.parametrize("scheme", ["int8", "int4", "w8a8"])
def test_forward_and_generation_with_weights_at_every_offset(scheme):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(WORKER), scheme],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, (
        f"worker died at offset {len(results) * 8} with return code {proc.returncode} "
        f"(negative: killed by that signal)\n{proc.stderr[-3000:]}"
    )
    assert [r["offset"] for r in results] == list(range(0, 64, 8))
    for r in results:
        assert r["moved"] >= 14, r  # every quantized linear of both layers was moved
        assert r["same_as_aligned"] and r["tokens_equal"], r
        assert max(r["relative_error"].values()) < 5e-2, r  # bf16 activations vs fp32
