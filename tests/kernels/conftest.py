"""Kernel tests run the Triton kernels on CPU under the interpreter when there is no GPU.

TRITON_INTERPRET is read when ``@triton.jit`` decorates a kernel, i.e. when
``compress.kernels.int4_gemm`` is first imported: it must be set here, before any test module
imports a kernel module (they import them inside the tests).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# after TRITON_INTERPRET: this package imports torch only (triton loads on first use)
from compress.kernels import cpu_q8, cpuinfo  # noqa: E402


@pytest.fixture(scope="module", params=list(cpu_q8.ISA_LEVELS))
def isa(request) -> str:
    """Each ISA level of our C++ CPU kernels this CPU has and builds; the others skip with the
    reason."""
    level = request.param
    if level not in cpu_q8.supported_levels(cpuinfo.cpu_flags()):
        pytest.skip(f"this CPU lacks {level} (flags: {sorted(cpu_q8.ISA_LEVELS[level][0])})")
    reason = cpu_q8.build_reason(level)  # ~15 s to compile a level on first use
    if reason is not None:
        pytest.skip(f"{level} kernels not available here: {reason}")
    return level


@pytest.fixture
def device() -> torch.device:
    """Where kernel inputs live: the GPU when there is one, else CPU for the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _interpreter_incompatibility() -> str | None:
    """The one measured bad pair: triton < 3.8 interprets ``range`` over runtime bounds wrongly
    with numpy >= 2.4 ("only 0-dimensional arrays can be converted to Python scalars")."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    try:
        import numpy
        import triton
    except ImportError:
        return None

    def major_minor(version: str) -> tuple[int, int]:
        major, minor = version.split(".")[:2]
        return int(major), int(minor)

    if major_minor(triton.__version__) < (3, 8) and major_minor(numpy.__version__) >= (2, 4):
        return (
            f"triton {triton.__version__} cannot interpret these kernels with numpy "
            f"{numpy.__version__}: install triton>=3.8 (CI uses 3.9) or numpy<2.4"
        )
    return None


@pytest.fixture(autouse=True, scope="session")
def _interpreter_versions_work() -> None:
    problem = _interpreter_incompatibility()
    if problem:
        pytest.fail(problem, pytrace=False)
