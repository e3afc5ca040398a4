"""The pass registry, pass configs and reports, and the recipe runner.

A pass is a registered function ``fn(model, cfg, state) -> PassReport`` that changes the model
in place. ``register_pass`` fills the module-level ``PASSES`` dict; ``run_recipe`` is one loop
over the recipe's passes. There is no session or event system: a recipe entry reaches the code
that changes the weights in two hops (recipe -> registry -> pass function).
"""

from __future__ import annotations

import difflib
import logging
import re
import time
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, field_validator
from torch import nn

from compress.arch import ARCHS, DEFAULT_IGNORE, model_type
from compress.errors import RecipeError
from compress.memory import peak_memory_bytes
from compress.modules import QuantExperts, quantization_coverage

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


def check_pattern(pattern: str) -> str:
    """``pattern`` itself; ValueError when it is a ``re:<regex>`` that does not compile."""
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as exc:
            raise ValueError(f"invalid regular expression {pattern!r}: {exc}") from exc
    return pattern


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


PassFn = Callable[[nn.Module, PassConfig, CompressionState], PassReport]


@dataclass(frozen=True)
class PassSpec:
    name: str
    config_cls: type[PassConfig]
    fn: PassFn
    needs_calibration: bool = False
    needs_teacher: bool = False


PASSES: dict[str, PassSpec] = {}


def register_pass(
    name: str,
    config_cls: type[PassConfig],
    *,
    needs_calibration: bool = False,
    needs_teacher: bool = False,
) -> Callable[[PassFn], PassFn]:
    """Decorator that registers a pass function under a dotted ``family.variant`` name."""

    def decorate(fn: PassFn) -> PassFn:
        if name in PASSES:
            raise RuntimeError(f"pass {name!r} is registered twice")
        PASSES[name] = PassSpec(name, config_cls, fn, needs_calibration, needs_teacher)
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


# ---- targeting ----------------------------------------------------------------------------
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
    """Modules selected by ``cfg.targets`` minus ``cfg.ignore`` (``matches``), in model order."""
    for name, module in model.named_modules():
        if not name:
            continue
        if any(matches(name, module, p) for p in cfg.ignore):
            continue
        if any(matches(name, module, p) for p in cfg.targets):
            yield name, module


def target_experts(model: nn.Module, cfg: PassConfig) -> list[tuple[str, nn.Module]]:
    """The float fused-experts modules of an MoE model (``compress.arch.Moe``) that ``cfg``
    targets, in layer order. Experts are the MLP's linear layers in fused form, so a pass
    that targets ``Linear`` targets them too; otherwise a target must name them (exact name,
    class name or ``re:``). ``ignore`` applies to the experts module's name."""
    arch = ARCHS.get(model_type(model))
    if arch is None or arch.moe is None:
        return []
    found = []
    for index in range(len(model.get_submodule(arch.layers))):
        name = f"{arch.layer_prefix}{index}.{arch.moe.fused}"
        module = model.get_submodule(name)
        if isinstance(module, QuantExperts) or any(matches(name, module, p) for p in cfg.ignore):
            continue
        if "Linear" in cfg.targets or any(matches(name, module, p) for p in cfg.targets):
            found.append((name, module))
    return found


def report_coverage(model: nn.Module, cfg: PassConfig, report: PassReport) -> None:
    """Put the quantization coverage of ``model`` (``modules.quantization_coverage``) into the
    report after a quantization pass: ``quantized_share`` of the targets' weight elements,
    ``bits_per_weight`` and ``weight_bytes_after`` over every weight matrix, quantized or
    not. Targets left in float that ``cfg.ignore`` does not name: a WARNING naming them, or
    under ``strict`` a RecipeError (the router and norms are never targets)."""
    coverage = quantization_coverage(model)
    left = {n: k for n, k in coverage.pop("unquantized").items()  # type: ignore[union-attr]
            if not any(matches(n, None, p) or matches(n.rpartition(".")[0], None, p)
                       for p in cfg.ignore)}
    report.metrics.update(coverage)
    report.metrics["weight_bytes_after"] = report.metrics.pop("weight_bytes")
    report.metrics["unquantized"] = left
    if not left:
        return
    share = coverage["quantized_share"] or 0.0
    listing = "; ".join(f"{n} ({k:,} elements)" for n, k in list(left.items())[:20])
    more = f" (and {len(left) - 20} more)" if len(left) > 20 else ""
    message = (
        f"{report.name}: quantized {share:.1%} of the decoder's weight elements; left in "
        f"float: {listing}{more}"
    )
    if cfg.strict:
        raise RecipeError(
            f"{message}. Fix: use a pass that quantizes them, add them to `ignore`, or set "
            "strict: false."
        )
    log.warning("%s", message)


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


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
def run_passes(model: nn.Module, passes: list[PassConfig], state: CompressionState) -> nn.Module:
    """Run each pass in order; a failing pass's exception gets its index and name attached."""
    for index, cfg in enumerate(passes):
        spec = PASSES[pass_name_of(cfg)]
        if spec.needs_calibration and state.calibration_batches is None:
            raise RecipeError(
                f"passes[{index}] ({spec.name}) needs calibration data: add a `calibration:` "
                "section to the recipe"
            )
        log.info("pass %d/%d %s starting", index + 1, len(passes), spec.name)
        start = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        try:
            report = spec.fn(model, cfg, state)
        except Exception as exc:
            exc.add_note(f"while running passes[{index}] ({spec.name})")
            raise
        if spec.name.startswith("quantize.") and "quantized_share" not in report.metrics:
            report_coverage(model, cfg, report)  # every quantization pass reports its coverage
        report.seconds = time.perf_counter() - start
        if report.peak_memory_bytes is None:
            peaks = peak_memory_bytes()
            cuda = peaks["peak_cuda_allocated_bytes"]
            report.peak_memory_bytes = cuda if cuda is not None else peaks["peak_rss_bytes"]
        state.reports.append(report)
        log.info("%s", report.summary())
    return model
