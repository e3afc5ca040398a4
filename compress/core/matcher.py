"""The one module matcher: which modules a pass's ``targets`` / ``ignore``, a per-layer
override or a checkpoint's ``quantization_config`` select (``matches``), and the validation of
those patterns at recipe-parse time (``check_pattern``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from compress.core.registry import PassConfig


def check_pattern(pattern: str) -> str:
    """``pattern`` itself; ValueError when it is a ``re:<regex>`` that does not compile."""
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as exc:
            raise ValueError(f"invalid regular expression {pattern!r}: {exc}") from exc
    return pattern


def matches(name: str, module: nn.Module | None, pattern: str) -> bool:
    """The one module matcher, for pass ``targets``/``ignore``, per-layer ``overrides`` and the
    targets of a compressed-tensors ``quantization_config`` when a checkpoint is loaded.

    ``re:<regex>``: ``re.match`` on the full module name, i.e. anchored at the start of the name
    and not at its end, as compressed-tensors and llm-compressor read ``re:`` targets (write
    ``re:.*down_proj`` for a name that ends in ``down_proj``, and add ``$`` to anchor the end).
    Anything else: the exact module name, or the exact class name of ``module``
    (``type(module).__name__``; unlike compressed-tensors, base classes do not match, so a
    bitsandbytes ``Linear4bit`` is not a ``Linear``). ``module`` None: names only.
    """
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name or (module is not None and pattern == type(module).__name__)


def target_modules(model: nn.Module, cfg: PassConfig) -> Iterator[tuple[str, nn.Module]]:
    """Modules selected by ``cfg.targets`` minus ``cfg.ignore`` (``matches``), in model order;
    never the family's float-only modules (``compress.arch.float_only_modules``: MoE routers and
    shared-expert gates)."""
    from compress.arch import float_only_modules

    fixed = float_only_modules(model)
    for name, module in model.named_modules():
        if not name or name in fixed:
            continue
        if any(matches(name, module, p) for p in cfg.ignore):
            continue
        if any(matches(name, module, p) for p in cfg.targets):
            yield name, module


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)
