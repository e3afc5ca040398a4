"""The pass registry, pass configs and reports, and the recipe runner (``compress.core``).

A pass is a registered function ``fn(model, cfg, state) -> PassReport`` that changes the model
in place. ``register_pass`` fills the module-level ``PASSES`` dict; ``run_recipe`` is one loop
over the recipe's passes. There is no session or event system: a recipe entry reaches the code
that changes the weights in two hops (recipe -> registry -> pass function).
"""

from __future__ import annotations

import difflib
import logging
import time
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, field_validator
from torch import nn

from compress.arch import DEFAULT_IGNORE
from compress.core.errors import RecipeError
from compress.core.matcher import check_pattern
from compress.memory import peak_memory_bytes

log = logging.getLogger(__name__)


# dtype names as configs write them (scale_dtype, compute_dtype, export dtype) -> torch dtypes
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Longest sequence any setting may ask for: beyond every supported model's context, and the
# activations of one such sequence already take gigabytes.
MAX_TOKENS = 131072


def check_text(value: Any, *, allow: str = "") -> Any:
    """``value`` itself; ValueError when it holds a string (also inside lists, tuples and dict
    keys or values) with a control character (NUL, newline, escape...) other than ``allow``."""
    if isinstance(value, str):
        for index, char in enumerate(value):
            if unicodedata.category(char) == "Cc" and char not in allow:
                raise ValueError(
                    f"{value!r} contains the control character {char!r} at position {index}; "
                    "names, model ids, paths and patterns must be plain text"
                )
    elif isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            check_text(item, allow=allow)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, allow=allow)
            check_text(item, allow=allow)
    return value


def at_most(limit: int | float, reason: str) -> AfterValidator:
    """A field bound that says why: ``Annotated[int, Field(ge=1), at_most(4096, "...")]``.
    The limit is readable as ``.func.limit`` (the recipe reference prints it)."""

    def check(value: Any) -> Any:
        if value is not None and value > limit:
            raise ValueError(f"{value:,} is too large: at most {limit:,} ({reason})")
        return value

    check.limit = limit  # type: ignore[attr-defined]
    return AfterValidator(check)


class StrictConfig(BaseModel):
    """Base of every model a recipe is validated with: unknown keys, NaN or infinite floats and
    control characters in strings are errors (their messages name the key)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _plain_text(cls, value: Any) -> Any:
        return check_text(value)


class PassConfig(StrictConfig):
    """Settings shared by every pass; subclasses add their own fields.

    targets: module class names (``Linear``), exact module names or ``re:<regex>`` (matched from
    the start of the module name: ``re:.*down_proj``; see ``matches``).
    ignore: the same kinds of pattern, for modules never touched; default ``lm_head``.
    strict: if true, a targeted layer the pass must skip is an error instead of a report line.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = DEFAULT_IGNORE  # the output head
    strict: bool = False

    @field_validator("targets", "ignore")
    @classmethod
    def _check_patterns(cls, patterns: tuple[str, ...]) -> tuple[str, ...]:
        for pattern in patterns:
            check_pattern(pattern)
        return patterns


@dataclass
class PassReport:
    """What a pass did: counts, per-layer skips with reasons, metrics, time and memory."""

    name: str
    changed: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # layer -> reason
    metrics: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    peak_memory_bytes: int | None = None

    def summary(self) -> str:
        return (
            f"{self.name}: changed {len(self.changed)} modules, skipped {len(self.skipped)}, "
            f"{self.seconds:.1f}s"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "changed": self.changed,
            "skipped": self.skipped,
            "metrics": self.metrics,
            "seconds": round(self.seconds, 3),
            "peak_memory_bytes": self.peak_memory_bytes,
        }


@dataclass
class CompressionState:
    """What passes may read besides the model: tokenizer, data, teacher, device, reports."""

    tokenizer: Any = None
    calibration_batches: Callable[[], list[torch.Tensor]] | None = None
    teacher: nn.Module | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    reports: list[PassReport] = field(default_factory=list)
    progress: bool = True
    data_dir: str | None = None  # root of the local datasets (../shared/data by default)
    # compress.io.stream.StreamedModel when the model's layers live on disk until a pass
    # reaches them (layer-wise passes only, PassSpec.layerwise); None: the model is in memory
    stream: Any = None
    # a folder: calibrated passes keep the hidden states between decoder layers in files
    # beside it (``calibration.activations: disk``); None: in memory
    activations_near: Any = None


PassFn = Callable[[nn.Module, PassConfig, CompressionState], PassReport]


@dataclass(frozen=True)
class PassSpec:
    name: str
    config_cls: type[PassConfig]
    fn: PassFn
    needs_calibration: bool = False
    needs_teacher: bool = False
    # works one decoder layer at a time through CompressionState.stream (the model a meta
    # skeleton, layers read from the checkpoint as the pass reaches them)
    layerwise: bool = False


PASSES: dict[str, PassSpec] = {}


def register_pass(
    name: str,
    config_cls: type[PassConfig],
    *,
    needs_calibration: bool = False,
    needs_teacher: bool = False,
    layerwise: bool = False,
) -> Callable[[PassFn], PassFn]:
    """Decorator that registers a pass function under a dotted ``family.variant`` name."""

    def decorate(fn: PassFn) -> PassFn:
        if name in PASSES:
            raise RuntimeError(f"pass {name!r} is registered twice")
        PASSES[name] = PassSpec(name, config_cls, fn, needs_calibration, needs_teacher, layerwise)
        return fn

    return decorate


def get_pass(name: str) -> PassSpec:
    """The registered pass, or a ``RecipeError`` with close matches and the full list."""
    if name in PASSES:
        return PASSES[name]
    close = difflib.get_close_matches(name, PASSES, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise RecipeError(f"unknown pass {name!r}.{hint} Known passes: {', '.join(sorted(PASSES))}")


def pass_name_of(cfg: PassConfig) -> str:
    for spec in PASSES.values():
        if type(cfg) is spec.config_cls:
            return spec.name
    raise RecipeError(f"config {type(cfg).__name__} belongs to no registered pass")


def raise_or_report_skips(cfg: PassConfig, report: PassReport, where: str) -> None:
    """Skipped layers: an error under ``strict``, else a WARNING summary."""
    if not report.skipped:
        return
    items = list(report.skipped.items())
    listing = "; ".join(f"{n}: {r}" for n, r in items[:20])
    more = f" (and {len(items) - 20} more)" if len(items) > 20 else ""
    if cfg.strict:
        raise RecipeError(
            f"{where}: {len(items)} targeted layers cannot be processed: {listing}{more}. "
            "Fix: change group_size/targets, add them to `ignore`, or set strict: false."
        )
    log.warning("%s skipped %d layers: %s%s", where, len(items), listing, more)


# ---- running ------------------------------------------------------------------------------
def run_passes(
    model: nn.Module, passes: list[PassConfig], state: CompressionState, *, first_index: int = 0
) -> nn.Module:
    """Run each pass in order; a failing pass's exception gets its index and name attached
    (``first_index``: the recipe index of ``passes[0]``)."""
    for index, cfg in enumerate(passes, start=first_index):
        spec = PASSES[pass_name_of(cfg)]
        if spec.needs_calibration and state.calibration_batches is None:
            raise RecipeError(
                f"passes[{index}] ({spec.name}) needs calibration data: add a `calibration:` "
                "section to the recipe"
            )
        log.info("pass %d/%d %s starting", index + 1, first_index + len(passes), spec.name)
        start = time.perf_counter()
        if state.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(state.device)
        try:
            report = spec.fn(model, cfg, state)
        except Exception as exc:
            exc.add_note(f"while running passes[{index}] ({spec.name})")
            raise
        report.seconds = time.perf_counter() - start
        if report.peak_memory_bytes is None:
            # the peak of the device the pass ran on: a CPU pass on a GPU host is not 0 bytes
            peaks = peak_memory_bytes()
            cuda = peaks["peak_cuda_allocated_bytes"]
            on_cuda = state.device.type == "cuda" and cuda is not None
            report.peak_memory_bytes = cuda if on_cuda else peaks["peak_rss_bytes"]
        state.reports.append(report)
        log.info("%s", report.summary())
    return model
