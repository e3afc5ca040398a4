"""Quantized linear ops and their backends; installs as ``compress.kernels``.

Public names: the backend choice (``plan_linear`` -> ``Plan``; ``resolve_backend``), the
Triton glue used by ``QuantLinear``
(``int4_linear``, ``int8_linear``, ``int8_int8_linear``, ``load_tuned_configs``) and
``KernelConstraintError``. Importing this package imports torch only: triton and the kernel
modules (``int4_gemm``, ``int8_gemm``) load on first use.
"""

from .dispatch import BACKENDS, Plan, plan_linear, resolve_backend
from .errors import KernelConstraintError
from .triton_ops import int4_linear, int8_int8_linear, int8_linear, load_tuned_configs

__all__ = [
    "BACKENDS",
    "KernelConstraintError",
    "Plan",
    "int4_linear",
    "int8_int8_linear",
    "int8_linear",
    "load_tuned_configs",
    "plan_linear",
    "resolve_backend",
]
