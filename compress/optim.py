"""Optimizers for training passes: plain AdamW or bitsandbytes' 8-bit AdamW, and state bytes.

AdamW keeps two fp32 moments per parameter (8 bytes/param). bitsandbytes' 8-bit AdamW
(Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization") stores each moment as
uint8 codes with one fp32 absmax per block of 256 values (~2.03 bytes/param); tensors smaller
than 4096 elements keep fp32 moments. On CUDA the paged variant is used (its states can be
evicted to host memory under pressure). bitsandbytes 0.50 also runs the 8-bit optimizer on CPU;
where it has no backend for the device, ``make_optimizer`` logs a WARNING saying so and returns
plain AdamW. Not done here: other optimizers, 4-bit states, fused/foreach choices.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import Literal

import torch

log = logging.getLogger(__name__)

OptimizerName = Literal["adamw", "adamw8bit"]
OPTIMIZERS = ("adamw", "adamw8bit")


def check_optimizer_name(name: str) -> str:
    """Validate ``name`` for a config field validator: unknown names and ``adamw8bit`` without
    bitsandbytes installed raise ValueError with the fix (no import happens)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer={name!r} is not supported; allowed values: {list(OPTIMIZERS)}")
    if name == "adamw8bit":
        from compress.quant.bnb import INSTALL, bitsandbytes_available

        if not bitsandbytes_available():
            raise ValueError(
                f"optimizer adamw8bit needs the bitsandbytes package, which is not installed. "
                f"Install it: {INSTALL}  (or use optimizer: adamw)"
            )
    return name


@functools.cache
def adamw8bit_unsupported_reason(device_type: str) -> str | None:
    """Why bitsandbytes' 8-bit AdamW cannot run on ``device_type`` (None when it can).

    A capability probe run once per device type on first use: one step on a 4096-element
    parameter (the smallest size that gets 8-bit states)."""
    from compress.quant.bnb import import_bitsandbytes

    bnb = import_bitsandbytes()
    param = torch.nn.Parameter(torch.zeros(4096, device=device_type))
    param.grad = torch.ones_like(param)
    try:
        bnb.optim.AdamW8bit([param], lr=1e-3).step()
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        return f"bitsandbytes {bnb.__version__} has no 8-bit AdamW backend for {device_type}: {exc}"
    return None


def make_optimizer(
    name: OptimizerName,
    params: Iterable[torch.nn.Parameter] | list[dict],
    lr: float,
    *,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.optim.Optimizer:
    """AdamW (``adamw``) or bitsandbytes 8-bit AdamW (``adamw8bit``; paged on CUDA).

    ``params`` is a list of parameters or of torch param-group dicts (``{"params": [...],
    "weight_decay": ...}``). The device is taken from the first parameter. ``adamw8bit`` on a
    device bitsandbytes has no backend for falls back to ``torch.optim.AdamW`` with a WARNING
    naming the reason.
    """
    check_optimizer_name(name)
    params = list(params)
    if params and isinstance(params[0], dict):
        params = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in params]
        params = [g for g in params if g["params"]]
        first = params[0]["params"][0] if params else None
    else:
        params = [p for p in params if p.requires_grad]
        first = params[0] if params else None
    if first is None:
        raise ValueError("make_optimizer: no parameter requires grad; nothing to optimize")
    kwargs = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if name == "adamw8bit":
        device_type = first.device.type
        reason = adamw8bit_unsupported_reason(device_type)
        if reason is None:
            from compress.quant.bnb import import_bitsandbytes

            bnb = import_bitsandbytes()
            cls = bnb.optim.PagedAdamW8bit if device_type == "cuda" else bnb.optim.AdamW8bit
            return cls(params, **kwargs)
        log.warning("%s; falling back to torch.optim.AdamW (fp32 states, 8 bytes/param)", reason)
    return torch.optim.AdamW(params, **kwargs)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer's per-parameter state tensors (moments, absmax, code maps,
    step counters), each storage counted once. Zero before the first ``step()``."""
    seen: set[int] = set()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if not torch.is_tensor(value) or value.data_ptr() in seen:
                continue
            seen.add(value.data_ptr())
            total += value.numel() * value.element_size()
    return total
