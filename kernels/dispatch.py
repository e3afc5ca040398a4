"""Backend choice for the quantized linear ops: ``auto | reference | cpu | triton``.

``auto`` picks the Triton kernels on CUDA when triton imports and the shape fits, the native
CPU kernels on CPU when the shape fits, and the plain-torch reference otherwise. Falling back
from ``auto`` is logged once per (op, reason) at DEBUG; an explicit backend that cannot run
raises ``KernelConstraintError`` with the shapes. Capability probes are cached functions called
on first use, never at import.
"""

from __future__ import annotations

import functools
import logging
from typing import Literal

import torch

from . import cpu_native
from .errors import KernelConstraintError

log = logging.getLogger(__name__)

Backend = Literal["auto", "reference", "cpu", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "reference", "cpu", "triton")
Op = Literal["int4", "int8"]


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _cpu_reason(op: Op, *, n: int, k: int, group_size: int, symmetric: bool) -> str | None:
    if op == "int4":
        return cpu_native.int4_unsupported_reason(n, k, group_size)
    if not symmetric:
        return "native int8 CPU kernel is symmetric-only"
    if group_size != k:
        return "native int8 CPU kernel takes per-channel scales only"
    return None


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
def _log_fallback_once(op: str, reason: str) -> None:
    log.debug("auto backend for %s falls back to the reference: %s", op, reason)


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
    """The backend that will run a layer of this shape on ``device``."""
    if requested not in BACKENDS:
        raise ValueError(f"unknown backend {requested!r}; choose one of {BACKENDS}")
    shape = f"{op} layer N={n} K={k} group_size={group_size} symmetric={symmetric}"
    if requested == "reference":
        return "reference"
    if requested == "cpu":
        reason = (
            "not on CPU"
            if device.type != "cpu"
            else _cpu_reason(op, n=n, k=k, group_size=group_size, symmetric=symmetric)
        )
        if reason:
            raise KernelConstraintError(f"backend='cpu' cannot run {shape}: {reason}")
        return "cpu"
    if requested == "triton":
        reason = _triton_reason(
            op, device=device, n=n, k=k, group_size=group_size, symmetric=symmetric
        )
        if reason:
            raise KernelConstraintError(f"backend='triton' cannot run {shape}: {reason}")
        return "triton"
    # auto
    if device.type == "cuda":
        reason = _triton_reason(
            op, device=device, n=n, k=k, group_size=group_size, symmetric=symmetric
        )
        if reason is None:
            return "triton"
    elif device.type == "cpu":
        reason = _cpu_reason(op, n=n, k=k, group_size=group_size, symmetric=symmetric)
        if reason is None:
            return "cpu"
    else:
        reason = f"no fast path on {device.type}"
    _log_fallback_once(op, reason)
    return "reference"
