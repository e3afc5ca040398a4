"""The one backend choice for every linear layer: ``plan_linear`` returns a frozen ``Plan``.

Callers: ``QuantLinear`` and ``W8A8Linear`` (their forward), and the generation runtime (per
phase, when it re-holds a layer). Layer kinds and their backends:

- ``float`` (plain ``nn.Linear``): ``torch``, always (``F.linear`` in the phase's dtype);
- ``int4`` / ``int8`` (``QuantLinear``): ``auto | reference | cpu | triton``. ``auto`` picks the
  Triton kernels on CUDA when triton imports and the shape fits, the native CPU kernels on CPU
  when the shape fits, the plain-torch reference otherwise. In the runtime's ``decode`` phase,
  ``int4_kernel="q4q8"`` asks for our integer-dot Q4 x Q8 kernel (``cpu_q8``, at the ISA level
  the CPU has) where the native int4 kernel would run, and ``int8_kernel="q8q8"`` for its
  Q8 x Q8 kernel where the native int8 kernel would run, in the ``prefill`` phase too (from 8
  rows on the kernel runs as a row-tile GEMM); the runtime holds the other layers as
  dequantized floats in both phases; a layer it cannot take keeps the plan it had;
- ``w8a8`` (``W8A8Linear``): ``auto | reference | float_exact | cpu | triton``. ``auto`` picks
  triton on CUDA (below), ``cpu`` (``torch._int_mm``) on CPUs that report int8 dot products
  (VNNI/AMX) when ``ONEDNN_MAX_CPU_ISA`` does not keep oneDNN below them, ``float_exact``
  otherwise; an explicit ``cpu`` raises there (oneDNN's int8 without VNNI saturates: wrong
  int32 products).

On CUDA a ``triton`` plan is a family, not one kernel: per call the glue (``triton_ops``) takes
the kernel for this (N, K, group, M) from the GPU's measured table, ``kernel_table.choose``
(``cuda_kernel`` here answers the same question for a report): our split-K GEMV (M <= 4) or
GEMM, and for ``auto`` also torch's ``_weight_int4pack_mm`` / ``_int_mm``. ``Plan.kernel`` says
which set (``"auto"`` or ``"triton"``); the layer passes it on as ``kernel=``. Without a
measured table the choice is ``kernel_table.default_kernel`` (documented there, from the
2026-11-30 H200 numbers: torch's int4 kernel at decode, our GEMMs for prefill).

Shape and group-size constraints live in one ``*_unsupported_reason`` function per kernel, in
the kernel's module; only this module asks them. Falling back from ``auto`` (or from the q4q8
preference) is logged once per (kind, backend, reason) at DEBUG and kept in ``Plan.reason``; an
explicit backend that cannot run raises ``KernelConstraintError`` with the shape. Capability
probes (triton importable, CPU flags, the AVX2 kernel's build) are cached and run on first use,
never at import.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Literal

import torch

from . import cpu_native, cpu_q8, cpuinfo, kernel_table
from .errors import KernelConstraintError

log = logging.getLogger(__name__)

Backend = Literal["auto", "reference", "cpu", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "reference", "cpu", "triton")
W8A8_BACKENDS: tuple[str, ...] = ("auto", "reference", "float_exact", "cpu", "triton")
Kind = Literal["float", "int4", "int8", "w8a8"]
Op = Literal["int4", "int8"]
Phase = Literal["any", "prefill", "decode"]
INT4_KERNELS: tuple[str, ...] = ("torch", "q4q8")  # the runtime's decode preference for int4
INT8_KERNELS: tuple[str, ...] = ("torch", "q8q8")  # ... and for int8


@dataclass(frozen=True)
class Plan:
    """What runs a layer: ``backend`` (a name from the kind's list above, or ``q4q8``/``torch``)
    and, when ``auto`` or a preference fell back to something slower, ``reason`` why. For a
    ``triton`` backend ``kernel`` is the ``triton_ops`` ``kernel=`` argument: ``"auto"`` (our
    kernels or torch's, per the measured table) or ``"triton"`` (ours only); else None."""

    backend: str
    reason: str | None = None
    kernel: str | None = None


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def cpu_int_mm_reason() -> str | None:
    """None when ``torch._int_mm`` runs on CPU here, exact and fast: it exists and oneDNN uses
    int8 dot products (without them it is slow, 261 ms vs 8 ms for ``float_exact`` at
    [512,1536]x[1536,576] on an AVX2-only CPU, and its int16 pair sums saturate); else why not."""
    if not cpu_native.int_mm_available():
        return "torch._int_mm is missing (torch >= 2.2)"
    return cpu_native.int_mm_inexact_reason(
        cpuinfo.cpu_flags(), os.environ.get("ONEDNN_MAX_CPU_ISA")
    )


def cpu_int_mm_fast() -> bool:
    """``torch._int_mm`` is exact and fast on this CPU (``cpu_int_mm_reason``)."""
    return cpu_int_mm_reason() is None


def q8_unavailable_reason() -> str | None:
    """Why our integer-dot kernels cannot run on this machine (no AVX2, no compiler, build
    error), or None once a level is built and loaded (cached in ``cpu_q8``: builds once)."""
    return cpu_q8.unavailable_reason()


def _cpu_reason(op: Op, *, n: int, k: int, group_size: int, symmetric: bool) -> str | None:
    if op == "int4":
        return cpu_native.int4_unsupported_reason(n, k, group_size)
    return cpu_native.int8_unsupported_reason(n, k, group_size, symmetric)


def _triton_reason(
    op: Op, *, device: torch.device, n: int, k: int, group_size: int, symmetric: bool
) -> str | None:
    if not triton_importable():
        return "triton is not installed (pip install 'compress[triton]')"
    from . import triton_ops

    return triton_ops.unsupported_reason(
        op, device=device, n=n, k=k, group_size=group_size, symmetric=symmetric
    )


@functools.cache
def _log_fallback_once(kind: str, backend: str, reason: str) -> None:
    log.debug("auto backend for %s layers falls back to %s: %s", kind, backend, reason)


def _fallback(kind: str, backend: str, reason: str) -> Plan:
    _log_fallback_once(kind, backend, reason)
    return Plan(backend, reason)


def plan_linear(
    kind: Kind,
    requested: str = "auto",
    *,
    device: torch.device,
    n: int,
    k: int,
    group_size: int | None = None,
    symmetric: bool = True,
    phase: Phase = "any",
    int4_kernel: str = "torch",
    int8_kernel: str = "torch",
) -> Plan:
    """The backend that runs a ``kind`` layer ``[N, K]`` (``group_size`` along K, None or K =
    per channel) on ``device``; ``phase``/``int4_kernel`` are the runtime's (module docstring).
    Raises ``KernelConstraintError`` when an explicit ``requested`` backend cannot run it."""
    group = k if group_size is None else group_size
    if kind == "float":
        return Plan("torch")
    if kind == "w8a8":
        return _plan_w8a8(requested, device=device, n=n, k=k)
    if kind not in ("int4", "int8"):
        raise ValueError(f"unknown layer kind {kind!r}; expected float, int4, int8 or w8a8")
    if int4_kernel not in INT4_KERNELS:
        raise ValueError(f"int4_kernel={int4_kernel!r}: expected one of {INT4_KERNELS}")
    if int8_kernel not in INT8_KERNELS:
        raise ValueError(f"int8_kernel={int8_kernel!r}: expected one of {INT8_KERNELS}")
    plan = _plan_weight_only(
        requested, kind, device=device, n=n, k=k, group_size=group, symmetric=symmetric
    )
    wanted = "q4q8" if kind == "int4" and int4_kernel == "q4q8" else None
    if kind == "int8" and int8_kernel == "q8q8":
        wanted = "q8q8"
    # the integer-dot kernels replace the native CPU kernel in both of the runtime's phases
    # (prefill through their row-tile GEMM), so the runtime holds one layout per layer
    if wanted and phase in ("prefill", "decode") and plan.backend == "cpu":
        reason = cpu_q8.unsupported_reason(n, k, group) or q8_unavailable_reason()
        if reason is None:
            return Plan(wanted)
        return _fallback(f"{kind} decode ({wanted})", plan.backend, reason)
    return plan


def _plan_weight_only(
    requested: str,
    op: Op,
    *,
    device: torch.device,
    n: int,
    k: int,
    group_size: int,
    symmetric: bool,
) -> Plan:
    if requested not in BACKENDS:
        raise ValueError(f"unknown backend {requested!r}; choose one of {BACKENDS}")
    shape = f"{op} layer N={n} K={k} group_size={group_size} symmetric={symmetric}"
    sizes = dict(n=n, k=k, group_size=group_size, symmetric=symmetric)
    if requested == "reference":
        return Plan("reference")
    if requested == "cpu":
        reason = "not on CPU" if device.type != "cpu" else _cpu_reason(op, **sizes)
        if reason:
            raise KernelConstraintError(f"backend='cpu' cannot run {shape}: {reason}")
        return Plan("cpu")
    if requested == "triton":
        reason = _triton_reason(op, device=device, **sizes)
        if reason:
            raise KernelConstraintError(f"backend='triton' cannot run {shape}: {reason}")
        return Plan("triton", kernel="triton")
    # auto
    if device.type == "cuda":
        reason = _triton_reason(op, device=device, **sizes)
        if reason is None:
            return Plan("triton", kernel="auto")
    elif device.type == "cpu":
        reason = _cpu_reason(op, **sizes)
        if reason is None:
            return Plan("cpu")
    else:
        reason = f"no fast path on {device.type}"
    return _fallback(op, "reference", reason)


def _plan_w8a8(requested: str, *, device: torch.device, n: int, k: int) -> Plan:
    """W8A8's weights are symmetric per channel (``W8A8Linear`` checks), so only the device and
    the capability probes decide."""
    if requested not in W8A8_BACKENDS:
        raise ValueError(f"unknown W8A8 backend {requested!r}; choose one of {W8A8_BACKENDS}")
    shape = f"w8a8 layer N={n} K={k}"
    if requested in ("reference", "float_exact"):
        return Plan(requested)
    if requested == "cpu":
        if device.type != "cpu":
            raise KernelConstraintError(
                f"backend='cpu' cannot run {shape}: needs a CPU tensor, got device {device}"
            )
        reason = cpu_int_mm_reason()
        if reason is not None:  # wrong int32 products are not a slower path: refuse
            raise KernelConstraintError(
                f"backend='cpu' cannot run {shape} exactly: {reason}; use backend='auto' "
                "(float_exact here)"
            )
        return Plan("cpu")
    triton_reason = _triton_reason(device=device, op="int8", n=n, k=k, group_size=k, symmetric=True)
    if requested == "triton":
        if triton_reason:
            raise KernelConstraintError(f"backend='triton' cannot run {shape}: {triton_reason}")
        return Plan("triton", kernel="triton")
    # auto
    if device.type == "cuda":
        if triton_reason is None:
            return Plan("triton", kernel="auto")
        return _fallback("w8a8", "float_exact", triton_reason)
    if device.type == "cpu" and cpu_int_mm_fast():
        return Plan("cpu")
    reason = (
        f"torch._int_mm would be slow and inexact: {cpu_int_mm_reason()}"
        if device.type == "cpu"
        else f"no int8 x int8 kernel on {device.type}"
    )
    return _fallback("w8a8", "float_exact", reason)


def resolve_backend(
    requested: str,
    op: Op,
    *,
    device: torch.device,
    n: int,
    k: int,
    group_size: int,
    symmetric: bool,
) -> str:
    """``plan_linear(op, requested, ...).backend``: the backend name alone."""
    return plan_linear(
        op, requested, device=device, n=n, k=k, group_size=group_size, symmetric=symmetric
    ).backend


def cuda_kernel(
    kind: Kind,
    plan: Plan,
    *,
    gpu_name: str,
    n: int,
    k: int,
    group_size: int | None,
    m: int,
    x_dtype: torch.dtype = torch.bfloat16,
) -> kernel_table.Choice | None:
    """The kernel a ``triton`` ``plan`` of a ``kind`` layer runs at M rows on the GPU called
    ``gpu_name`` (the choice ``triton_ops`` makes per call); None for other plans."""
    if plan.backend != "triton" or kind not in ("int4", "int8", "w8a8"):
        return None
    allowed = kernel_table.KERNELS if plan.kernel == "auto" else kernel_table.TRITON_KERNELS
    if kind == "int8":  # torch has no CUDA int8 weight-only GEMM
        allowed = kernel_table.TRITON_KERNELS
    return kernel_table.choose(
        kernel_table.load_table(gpu_name), op=kind, n=n, k=k,
        group_size=k if group_size is None else group_size, m=m, x_dtype=x_dtype,
        allowed=allowed,
    )  # fmt: skip
