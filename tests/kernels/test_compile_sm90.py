"""Offline compilation for Hopper (sm_90) without a GPU: the main configs build, do not spill
and fit in the 232448 bytes of shared memory an H100/H200 block can have.

It runs in a subprocess because this test session interprets the kernels (TRITON_INTERPRET=1),
and interpreted kernels cannot be compiled. ``-m slow`` compiles every config of every list.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

SM90_SHARED_MEMORY = 232448
# variant -> the config list its main configs come from; the first two of each are the defaults
MAIN_CONFIGS = {"int4_gemm": 2, "int4_decode": 1, "int8_gemm": 1, "int8_decode": 1}

_SCRIPT = """
import json, sys
from compress.kernels import triton_ops
from compress.kernels.int8_gemm import quantize_config
lists = triton_ops.load_tuned_configs("NVIDIA H100")
plan = json.loads(sys.argv[1])
rows = []
for variant, count in plan.items():
    for config in lists[variant][:count]:
        usage = triton_ops.compile_offline(variant, config, group_size=128, arch=90)
        rows.append({"variant": variant, "config": str(config), **usage})
config = quantize_config(4096)
rows.append({"variant": "quantize_per_token", "config": str(config),
             **triton_ops.compile_offline("quantize_per_token", config)})
print(json.dumps(rows))
"""


_GEMV_SCRIPT = """
import json, sys
from compress.kernels import gemv, triton_ops
count = int(sys.argv[1])
rows = []
for variant in ("int4_gemv", "int8_gemv", "w8a8_gemv"):
    for block_m in (1, 4):
        min_k = 8 if variant == "int4_gemv" else 16
        configs = gemv.valid_configs(gemv._configs(), m=block_m, n=4096, k=4096, group_size=128,
                                     min_block_k=min_k)[:count]
        for config in configs:
            usage = triton_ops.compile_offline(variant, config, group_size=128, block_m=block_m)
            rows.append({"variant": variant, "block_m": block_m, "config": str(config), **usage})
print(json.dumps(rows))
"""


def _compile(plan, script: str = _SCRIPT) -> list[dict]:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when it is unset
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(plan)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _check(rows: list[dict]) -> None:
    bad = [
        r for r in rows
        if r["spill_bytes"] or r["stack_bytes"] or r["shared_bytes"] > SM90_SHARED_MEMORY
    ]  # fmt: skip
    assert not bad, f"configs that spill or overflow shared memory on sm_90: {bad}"
    assert all(r["registers"] > 0 for r in rows)
    # prefill tiles with BLOCK_M >= 64 must use Hopper's wgmma, or the build is not sm_90a
    assert all(r["wgmma"] for r in rows if r["variant"] in ("int4_gemm", "int8_gemm"))


def test_main_configs_compile_for_sm90():
    rows = _compile(MAIN_CONFIGS)
    assert len(rows) == sum(MAIN_CONFIGS.values()) + 1
    _check(rows)


@pytest.mark.slow
def test_every_tuned_config_compiles_for_sm90():
    _check(_compile(dict.fromkeys(MAIN_CONFIGS, 100)))


EVERY = pytest.param(100, id="every", marks=pytest.mark.slow)


@pytest.mark.parametrize("count", [pytest.param(1, id="first"), EVERY])
def test_gemv_configs_compile_for_sm90_without_spills(count):
    """The decode GEMVs at M = 1 and 4 (the configs ``valid_configs`` keeps for 4096 x 4096,
    g128): no local memory, no stack (a stack frame is where registers spill first)."""
    rows = _compile(count, _GEMV_SCRIPT)
    assert len(rows) >= 6
    _check(rows)
