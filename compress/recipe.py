"""YAML recipe -> validated ``Recipe``: parsing, strict config building, ordering rules.

Everything is checked before any work starts, and every problem is reported at once, each with
the file, the location (``passes[2] (quantize.int4_rtn): group_size``), the bad value, the
allowed values and a did-you-mean for misspelt keys and pass names. ``load_recipe`` takes a path
only; ``parse_recipe`` takes text or a dict. ``--set a.b.0.c=value`` overrides are applied to the
raw mapping and go through the same checks.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from compress.core import PASSES, PassConfig, get_pass, pass_name_of
from compress.errors import RecipeError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CalibrationConfig(_Section):
    """Calibration text. source: a file or folder of .txt/.jsonl/.json.gz (relative paths are
    looked up under the data dir) or ``wikitext2-valid``; never the split you report."""

    source: str = "wikitext2-valid"
    num_samples: int = Field(128, ge=1)  # sequences
    seq_len: int = Field(512, ge=8)  # tokens per sequence
    seed: int = 0
    mix: dict[str, float] | None = None  # source -> weight; when set, replaces `source`


class PerplexityConfig(_Section):
    """Token perplexity over non-overlapping (or strided) windows of the joined text."""

    dataset: str = "wikitext2"  # "wikitext2" (raw test split) or a path to a text file
    context_length: int = Field(512, ge=8)  # tokens per window
    stride: int | None = Field(None, ge=1)  # default: context_length (no overlap)
    limit: int | None = Field(None, ge=1)  # at most this many windows (fast runs)


class TasksConfig(_Section):
    """Zero-shot lm-eval tasks from the offline task folder (see compress.eval.lm_eval_tasks)."""

    names: list[str] = Field(min_length=1)  # e.g. [piqa_local, arc_easy_local]
    limit: int | None = Field(None, ge=1)  # examples per task (fast runs)
    tasks_dir: str | None = None  # default: <data dir>/lm_eval_tasks


class LatencyConfig(_Section):
    """Single-stream greedy latency on real prompts (see compress.eval.compare)."""

    prompts: int = Field(4, ge=1)  # requests per round
    prompt_tokens: int = Field(64, ge=1)
    output_tokens: int = Field(32, ge=2)
    rounds: int = Field(1, ge=1)  # repetitions
    slo_ttft_ms: float | None = Field(None, gt=0)  # goodput bound on time to first token
    slo_tpot_ms: float | None = Field(None, gt=0)  # goodput bound on time per output token
    usd_per_hour: float = Field(1.0, ge=0)  # machine price, for cost per 1M tokens


class EvalConfig(_Section):
    baseline: bool = True  # also evaluate the uncompressed model, in the same run
    perplexity: PerplexityConfig | None = PerplexityConfig()
    tasks: TasksConfig | None = None  # lm-eval accuracy; off by default
    latency: LatencyConfig | None = None  # timing; off by default


class ExportConfig(_Section):
    enabled: bool = True
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # non-quantized tensors


TOP_LEVEL = {
    "name": str,
    "description": str,
    "model": str,
    "calibration": CalibrationConfig,
    "passes": list,
    "export": ExportConfig,
    "eval": EvalConfig,
}


@dataclass
class Recipe:
    """A validated recipe. Also buildable in Python: ``Recipe(passes=[Int4RtnConfig()])``."""

    passes: list[PassConfig] = field(default_factory=list)
    name: str = "recipe"
    description: str = ""
    model: str = "smollm2-135m"
    calibration: CalibrationConfig | None = None
    export: ExportConfig = field(default_factory=ExportConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.description:
            out["description"] = self.description
        out["model"] = self.model
        if self.calibration is not None:
            out["calibration"] = self.calibration.model_dump(mode="json")
        out["passes"] = [
            {"pass": pass_name_of(cfg), **cfg.model_dump(mode="json", exclude_unset=True)}
            for cfg in self.passes
        ]
        out["export"] = self.export.model_dump(mode="json")
        out["eval"] = self.eval.model_dump(mode="json")
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ---- error formatting ---------------------------------------------------------------------
def _did_you_mean(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def _format_pydantic(exc: ValidationError, where: str, model: type[BaseModel]) -> list[str]:
    messages = []
    fields = list(model.model_fields)
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            key = str(err["loc"][-1])
            messages.append(
                f"{where}: unknown key {key!r}.{_did_you_mean(key, fields)} "
                f"Allowed keys: {', '.join(fields)}"
            )
            continue
        msg = err["msg"].removeprefix("Value error, ")
        if not loc:  # a model-level check (several fields together)
            messages.append(f"{where}: {msg}")
        else:
            messages.append(f"{where}: {loc}={err.get('input')!r}: {msg}")
    return messages


# ---- parsing ------------------------------------------------------------------------------
def _validate_passes(
    raw: Any, source: str, errors: list[str], names: list[str]
) -> list[PassConfig]:
    if not isinstance(raw, list):
        errors.append(f"{source}: passes must be a list of mappings with a `pass:` key")
        return []
    passes: list[PassConfig] = []
    for index, entry in enumerate(raw):
        where = f"{source}: passes[{index}]"
        if not isinstance(entry, dict) or "pass" not in entry:
            errors.append(f"{where}: each pass is a mapping with a `pass:` key, got {entry!r}")
            continue
        settings = dict(entry)
        name = str(settings.pop("pass"))
        if name not in PASSES:
            close = difflib.get_close_matches(name, list(PASSES), n=1, cutoff=0.5)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            errors.append(
                f"{where}: unknown pass {name!r}.{hint} Known: {', '.join(sorted(PASSES))}"
            )
            continue
        names.append(name)
        spec = get_pass(name)
        try:
            passes.append(spec.config_cls.model_validate(settings))
        except ValidationError as exc:
            errors.extend(_format_pydantic(exc, f"{where} ({name})", spec.config_cls))
    return passes


def check_order(names: list[str]) -> list[str]:
    """Ordering rules over the pass names, each with its message."""
    problems = []
    for i, name in enumerate(names):
        family = name.split(".")[0]
        later = [n for n in names[i + 1 :] if n.split(".")[0] in ("prune", "distill")]
        if family == "quantize" and later:
            problems.append(
                f"passes[{i}] ({name}) comes before {later[0]}: prune.* and distill.* passes must "
                "come before quantize.* passes (quantized layers are not pruned or trained)"
            )
        if family == "distill" and not any(n.startswith("prune.") for n in names[:i]):
            problems.append(
                f"passes[{i}] ({name}) needs an earlier prune.* pass to recover from"
            )
    return problems


def parse_recipe(data: str | dict[str, Any], source: str = "<recipe>") -> Recipe:
    """Validate a recipe given as YAML text or an already-parsed mapping."""
    if isinstance(data, str):
        try:
            data = yaml.safe_load(data)
        except yaml.YAMLError as exc:
            raise RecipeError(f"{source}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: a recipe is a YAML mapping with keys {', '.join(TOP_LEVEL)}")
    errors: list[str] = []
    values: dict[str, Any] = {}
    names: list[str] = []
    for key, raw in data.items():
        if key not in TOP_LEVEL:
            errors.append(
                f"{source}: unknown top-level key {key!r}."
                f"{_did_you_mean(str(key), list(TOP_LEVEL))}"
                f" Allowed keys: {', '.join(TOP_LEVEL)}"
            )
            continue
        kind = TOP_LEVEL[key]
        if kind is str:
            if not isinstance(raw, str):
                errors.append(f"{source}: {key} must be a string, got {raw!r}")
            values[key] = str(raw)
        elif kind is list:
            values[key] = _validate_passes(raw, source, errors, names)
        else:
            try:
                values[key] = kind.model_validate(raw if raw is not None else {})
            except ValidationError as exc:
                errors.extend(_format_pydantic(exc, f"{source}: {key}", kind))
    errors.extend(f"{source}: {p}" for p in check_order(names))
    if errors:
        count = f"{len(errors)} problem{'s' if len(errors) > 1 else ''}"
        raise RecipeError(f"invalid recipe ({count}):\n  - " + "\n  - ".join(errors))
    return Recipe(**values)


def load_raw(path: str | Path) -> dict[str, Any]:
    """Read a recipe file into a mapping; a missing or non-YAML path is a clear error."""
    path = Path(path)
    if path.suffix not in (".yaml", ".yml"):
        raise RecipeError(f"{path}: a recipe file must end in .yaml or .yml")
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}. Check the path (ls recipes/).")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a YAML mapping with keys {', '.join(TOP_LEVEL)}")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.path=value`` overrides (values parsed as YAML; list items by index)."""
    for item in overrides:
        if "=" not in item:
            raise RecipeError(
                f"--set {item!r}: expected key.path=value, e.g. passes.0.group_size=64"
            )
        path, _, text = item.partition("=")
        keys = path.strip().split(".")
        target: Any = data
        for depth, key in enumerate(keys[:-1]):
            where = ".".join(keys[: depth + 1])
            if isinstance(target, list):
                if not key.isdigit() or int(key) >= len(target):
                    raise RecipeError(
                        f"--set {item!r}: {where} is not an index of a {len(target)}-item list"
                    )
                target = target[int(key)]
            elif isinstance(target, dict):
                target = target.setdefault(key, {})
            else:
                raise RecipeError(f"--set {item!r}: {where} is not a mapping or list")
        last = keys[-1]
        value = yaml.safe_load(text)
        if isinstance(target, list):
            if not last.isdigit() or int(last) >= len(target):
                raise RecipeError(
                    f"--set {item!r}: {last} is not an index of a {len(target)}-item list"
                )
            target[int(last)] = value
        elif isinstance(target, dict):
            target[last] = value
        else:
            raise RecipeError(f"--set {item!r}: cannot set {last} inside {target!r}")
    return data


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Load, override and validate a recipe file."""
    data = apply_overrides(load_raw(path), overrides or [])
    return parse_recipe(data, source=str(path))
