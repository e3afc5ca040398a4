"""YAML recipe -> validated ``Recipe``: parsing, strict config building, ordering rules.

Everything is checked before any work starts, and every problem is reported at once, each with
the file, the location (``passes[2] (quantize.int4_rtn): group_size``), the bad value, the
allowed values and a did-you-mean for misspelt keys and pass names. ``load_recipe`` takes a path
only; ``parse_recipe`` takes text or a dict. ``--set a.b.0.c=value`` overrides are applied to the
raw mapping and go through the same checks. Importing this module registers every pass.
"""

from __future__ import annotations

import copy
import difflib
import re
import typing
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

# Every pass module, imported here for its @register_pass side effect: a recipe may name any
# registered pass, so parsing or printing one needs them all (STYLE 5.3: explicit, no discovery).
from compress import distill  # noqa: F401
from compress.core.device import DEVICE_FORMS, check_device_spec
from compress.core.errors import RecipeError
from compress.core.registry import (
    MAX_TOKENS,
    PASSES,
    PassConfig,
    StrictConfig,
    at_most,
    check_text,
    get_pass,
    pass_name_of,
)
from compress.prune import depth, heads, hidden, mlp  # noqa: F401
from compress.quant import (  # noqa: F401
    autoround,
    awq,
    bnb,  # imports bitsandbytes only when run
    gptq,
    kv_cache,
    rotate,
    rtn,
    smoothquant,
)

# Bounds on settings that cost memory or time linearly (see each `at_most` reason).
_TOKENS = at_most(MAX_TOKENS, "longer than the context of any supported model")
MAX_CALIBRATION_TOKENS = 2**24  # num_samples * seq_len
NAME_MAX_BYTES = 100  # the default output folder is out/<name>; file names stop at 255 bytes


class _Section(StrictConfig):
    """A recipe section: strict like pass configs (``compress.core.StrictConfig``)."""


class CalibrationConfig(_Section):
    """Calibration text. source: a file or folder of .txt/.jsonl/.json.gz (relative paths are
    looked up under the data dir) or ``wikitext2-valid``; never the split you report."""

    source: str = "wikitext2-valid"
    num_samples: Annotated[  # sequences
        int, Field(ge=1), at_most(65536, "calibrated passes keep every sample's activations")
    ] = 128
    seq_len: Annotated[int, Field(ge=8), _TOKENS] = 512  # tokens per sequence
    seed: int = Field(0, ge=0, le=2**32 - 1)  # the range every random generator accepts
    mix: dict[str, float] | None = None  # source -> weight (> 0); when set, replaces `source`
    # where calibrated passes keep the hidden states between decoder layers (every sample's,
    # float32): memory; disk (files beside the output, paged by the kernel: same numbers);
    # auto: disk only when the memory preflight finds they would not fit in memory
    activations: Literal["auto", "memory", "disk"] = "auto"

    @field_validator("mix")
    @classmethod
    def _mix(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        bad = {k: v for k, v in (value or {}).items() if not v > 0}
        if value is not None and (not value or bad):
            raise ValueError(
                f"weights must be positive numbers, got {bad or value}; write e.g. "
                "mix: {train_text/web: 0.75, wikitext2-valid: 0.25}"
            )
        return value

    @model_validator(mode="after")
    def _total_tokens(self) -> CalibrationConfig:
        tokens = self.num_samples * self.seq_len
        if tokens > MAX_CALIBRATION_TOKENS:
            raise ValueError(
                f"num_samples * seq_len = {tokens:,} calibration tokens is too many: at most "
                f"{MAX_CALIBRATION_TOKENS:,} (calibrated passes hold every token's activations "
                "of a layer in memory); lower num_samples or seq_len"
            )
        return self


class PerplexityConfig(_Section):
    """Token perplexity over non-overlapping (or strided) windows of the joined text."""

    dataset: str = "wikitext2"  # "wikitext2" (raw test split) or a path to a text file
    context_length: Annotated[int, Field(ge=8), _TOKENS] = 512  # tokens per window
    stride: Annotated[int | None, Field(ge=1), _TOKENS] = None  # default: context_length
    limit: int | None = Field(None, ge=1)  # at most this many windows (fast runs); no upper bound


class TasksConfig(_Section):
    """Zero-shot lm-eval tasks from the offline task folder (see compress.eval.lm_eval_tasks)."""

    names: list[str] = Field(min_length=1)  # e.g. [piqa_local, arc_easy_local]
    limit: int | None = Field(None, ge=1)  # examples per task (fast runs)
    tasks_dir: str | None = None  # default: <data dir>/lm_eval_tasks


class LatencyConfig(_Section):
    """Greedy latency on real prompts (see compress.eval.compare): ``single`` times one request
    at a time on the runtime's static cache; ``batch`` (all of a batch arriving together, one
    run per ``batch_sizes`` entry) and ``poisson`` (``requests`` arrivals at ``rate`` per second,
    up to ``max_batch`` decoded together) run through the runtime's continuous-batching
    scheduler, what ``compress serve`` runs."""

    workload: Literal["single", "batch", "poisson"] = "single"
    batch_sizes: list[Annotated[int, Field(ge=1, le=256)]] | None = None  # batch: default 1,4,8
    rate: float | None = Field(None, gt=0)  # poisson: requests per second (required there)
    requests: Annotated[int, Field(ge=1), at_most(4096, "each is a full request")] = 16
    max_batch: Annotated[int, Field(ge=1, le=256)] = 8  # poisson: decoded together at most
    # batch/poisson: the paged KV cache's storage (auto: the runtime's, fp32 on a CPU; int8:
    # per token and head scales, about half of bf16's bytes; fp8: e4m3 with the checkpoint's
    # per-layer scales from quantize.kv_cache_fp8, 1.0 without), as `compress serve --kv-dtype`
    kv_dtype: Literal["auto", "float32", "bfloat16", "int8", "fp8"] = "auto"

    prompts: Annotated[  # requests per round
        int, Field(ge=1), at_most(1024, "requests are timed one after another")
    ] = 4
    prompt_tokens: Annotated[int, Field(ge=1), _TOKENS] = 64
    output_tokens: Annotated[int, Field(ge=2), _TOKENS] = 32
    rounds: Annotated[int, Field(ge=1), at_most(100, "each round times every request again")] = 1
    slo_ttft_ms: float | None = Field(None, gt=0)  # goodput bound on time to first token
    slo_tpot_ms: float | None = Field(None, gt=0)  # goodput bound on time per output token
    usd_per_hour: float = Field(1.0, ge=0)  # machine price, for cost per 1M tokens

    @model_validator(mode="after")
    def _rate_for_poisson(self):
        if self.workload == "poisson" and self.rate is None:
            raise ValueError("workload poisson needs rate (requests per second), e.g. rate: 2")
        return self


class EvalConfig(_Section):
    baseline: bool = True  # also evaluate the uncompressed model, in the same run
    perplexity: PerplexityConfig | None = PerplexityConfig()
    tasks: TasksConfig | None = None  # lm-eval accuracy; off by default
    latency: LatencyConfig | None = None  # timing; off by default


class ExportConfig(_Section):
    """dtype: of the dense tensors (embeddings, norms, biases, layers left unquantized); quantized
    weights and their scales keep their own. ``auto``: the source checkpoint's dtype when it is
    stored in 16 bits (its config.json), else bfloat16."""

    enabled: bool = True
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # the largest safetensors shard (5GB, 500MB, 2GiB); more tensors go to further shards,
    # named model-0000k-of-0000n.safetensors with a model.safetensors.index.json
    max_shard_size: str = "5GB"

    @field_validator("max_shard_size")
    @classmethod
    def _shard_size(cls, value: str) -> str:
        from compress.io.stream import parse_size

        parse_size(value)  # ValueError names the accepted forms
        return value


TOP_LEVEL = {
    "name": str,
    "description": str,
    "model": str,
    "device": str,
    "calibration": CalibrationConfig,
    "passes": list,
    "export": ExportConfig,
    "eval": EvalConfig,
}


def check_recipe_name(name: str) -> str:
    """``name`` itself; ValueError unless it is safe as one folder name: the default output
    folder of a recipe is ``out/<name>``."""
    problem = ""
    if not name.strip():
        problem = "is empty"
    elif "/" in name or "\\" in name:
        problem = "contains a path separator (/ or \\)"
    elif name.startswith("."):
        problem = "starts with '.' (a hidden folder, or '..': a parent folder)"
    elif ".." in name:
        problem = "contains '..'"
    elif any(unicodedata.category(char) == "Cc" for char in name):
        problem = "contains a control character"
    elif len(name.encode("utf-8")) > NAME_MAX_BYTES:
        problem = f"is longer than {NAME_MAX_BYTES} bytes"
    if problem:
        raise ValueError(
            f"name={name!r} {problem}: the default output folder is out/<name>, so the name must "
            "be one plain folder name such as smollm2-w4g128-rtn"
        )
    return name


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
    # where the passes and the evaluation run: auto (the first GPU when there is one) | cpu |
    # cuda | cuda:N; resolved by run_job (compress.core.device.resolve_device), not here
    device: str = "auto"

    def __post_init__(self) -> None:
        try:
            check_recipe_name(self.name)
            check_text(self.model)
            check_device_spec(self.device)
        except ValueError as exc:
            raise RecipeError(f"invalid recipe: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.description:
            out["description"] = self.description
        out["model"] = self.model
        if self.device != "auto":  # the default stays out: older recipes' YAML is unchanged
            out["device"] = self.device
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
@dataclass(frozen=True)
class _Problem:
    loc: tuple[str, ...]  # where in the raw mapping, e.g. ("passes", "2", "group_size")
    text: str  # the message, without its origin (the file or a --set override)


def _did_you_mean(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (``X``, ``X | None``, ``tuple[X, ...]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _model_at(model: type[BaseModel], path: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model that validates the mapping at ``path`` (a pydantic error location) below
    ``model``; list indices keep the item model."""
    for part in path:
        if isinstance(part, int):
            continue
        info = model.model_fields.get(str(part))
        found = _model_in(info.annotation) if info is not None else None
        if found is None:
            return None
        model = found
    return model


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _pydantic_problems(
    exc: ValidationError, model: type[BaseModel], loc: tuple[str, ...], label: str | None
) -> list[_Problem]:
    """One problem per pydantic error. label: how a pass is named (``passes[2] (quantize.gptq)``);
    None for sections, whose keys are shown as full dotted paths (``eval.perplexity.limit``)."""
    problems = []
    for err in exc.errors():
        parts = tuple(err["loc"])
        full = loc + tuple(str(p) for p in parts)
        shown = full if label is None else full[len(loc):]
        prefix = "" if label is None else f"{label}: "
        if err["type"] == "extra_forbidden":
            key = str(parts[-1])
            owner = _model_at(model, parts[:-1])
            fields = list(owner.model_fields) if owner is not None else []
            level = ".".join(shown[:-1])
            allowed = f"Keys allowed in {level}" if level else "Allowed keys"
            text = (
                f"{prefix}{level + ': ' if level else ''}unknown key {key!r}."
                f"{_did_you_mean(key, fields)} {allowed}: {', '.join(fields)}"
            )
        elif err["type"] == "missing":
            text = f"{prefix}{'.'.join(shown)} is required"
        else:
            msg = err["msg"].removeprefix("Value error, ")
            if not parts:  # a model-level check (several fields together, or a wrong type)
                text = f"{prefix or '.'.join(shown) + ': '}{msg}"
            else:
                text = f"{prefix}{'.'.join(shown)}={_shown(err.get('input'))}: {msg}"
        problems.append(_Problem(full, text))
    return problems


# ---- parsing ------------------------------------------------------------------------------
def _validate_passes(raw: Any, problems: list[_Problem], names: list[str]) -> list[PassConfig]:
    if not isinstance(raw, list):
        problems.append(
            _Problem(("passes",), "passes must be a list of mappings with a `pass:` key, got "
                     f"{_shown(raw)}")
        )
        return []
    passes: list[PassConfig] = []
    for index, entry in enumerate(raw):
        where, loc = f"passes[{index}]", ("passes", str(index))
        if not isinstance(entry, dict) or "pass" not in entry:
            problems.append(_Problem(
                loc, f"{where}: each pass is a mapping with a `pass:` key, got {_shown(entry)}"
            ))
            continue
        settings = dict(entry)
        name = str(settings.pop("pass"))
        if name not in PASSES:
            close = difflib.get_close_matches(name, list(PASSES), n=1, cutoff=0.5)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            problems.append(_Problem(
                (*loc, "pass"),
                f"{where}: unknown pass {_shown(name)}.{hint} Known: {', '.join(sorted(PASSES))}",
            ))
            continue
        names.append(name)
        spec = get_pass(name)
        try:
            passes.append(spec.config_cls.model_validate(settings))
        except ValidationError as exc:
            problems += _pydantic_problems(exc, spec.config_cls, loc, f"{where} ({name})")
    return passes


def check_order(names: list[str]) -> list[str]:
    """Ordering rules over the pass names, each with its message."""
    return [text for _, text in _order_problems(names)]


def _order_problems(names: list[str]) -> list[tuple[int, str]]:
    problems = []
    for i, name in enumerate(names):
        family = name.split(".")[0]
        later = [n for n in names[i + 1 :] if n.split(".")[0] in ("prune", "distill")]
        if family == "quantize" and later:
            problems.append((i, (
                f"passes[{i}] ({name}) comes before {later[0]}: prune.* and distill.* passes must "
                "come before quantize.* passes (quantized layers are not pruned or trained)"
            )))
        if family == "distill" and not any(n.startswith("prune.") for n in names[:i]):
            problems.append((i, f"passes[{i}] ({name}) needs an earlier prune.* pass to recover "
                                "from"))
        if name == "quantize.bnb":
            problems += _bnb_problems(i, names)
        earlier = [n for n in names[:i] if n.startswith("quantize.")]
        if family == "rotate" and earlier:
            problems.append((i, f"passes[{i}] ({name}) comes after {earlier[0]}: the rotation "
                                "rewrites float weights (and would void calibrated scales); move "
                                "it before the quantize.* passes"))
    return problems


def _bnb_problems(i: int, names: list[str]) -> list[tuple[int, str]]:
    """quantize.bnb's rules: no other quantize.* pass (one checkpoint format per model:
    bitsandbytes' or compressed-tensors'), and nothing after it (its layers are final; a
    streamed run could not hand them to a later pass through its scratch files)."""
    problems = []
    other = [n for n in names if n.startswith("quantize.") and n != "quantize.bnb"]
    if other:
        problems.append((i, f"passes[{i}] (quantize.bnb) cannot be combined with {other[0]}: "
                            "one checkpoint format per model (bitsandbytes' or "
                            "compressed-tensors'); use quantize.bnb alone or drop it"))
    elif names[i + 1:]:
        problems.append((i, f"passes[{i}] (quantize.bnb) comes before {names[i + 1]}: "
                            "quantize.bnb must be the last pass (its bitsandbytes layers are "
                            "final); move it last"))
    return problems


def _top_level_string(key: str, raw: Any) -> str:
    """A top-level string value; ValueError naming ``key`` when it is not plain text."""
    if not isinstance(raw, str):
        raise ValueError(f"{key} must be a string, got {_shown(raw)}")
    if key == "name":
        return check_recipe_name(raw)  # its message starts with name=...
    if key == "device":
        return check_device_spec(raw)  # its message starts with device=...
    try:
        return check_text(raw, allow="\n\t\r" if key == "description" else "")
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


def _origin(loc: tuple[str, ...], source: str, overrides: list[tuple[tuple[str, ...], str]]) -> str:
    """What a problem at ``loc`` came from: the --set override that wrote there, else the file."""
    for path, item in overrides:
        if loc[: len(path)] == path:
            return f"--set {item}"
    for path, item in overrides:
        if path[: len(loc)] == loc:
            return f"{source} (with --set {item})"
    return source


def parse_recipe(
    data: str | dict[str, Any], source: str = "<recipe>", *, overrides: list[str] | None = None
) -> Recipe:
    """Validate a recipe given as YAML text or an already-parsed mapping, after applying
    ``key.path=value`` overrides (``apply_overrides``). Problems caused by an override are
    reported against it (``--set eval.perplexity.limt=20: ...``), the rest against ``source``."""
    if isinstance(data, str):
        data = _yaml(data, source)
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: a recipe is a YAML mapping with keys {', '.join(TOP_LEVEL)}")
    if overrides:
        data = apply_overrides(copy.deepcopy(data), overrides)
    problems: list[_Problem] = []
    values: dict[str, Any] = {}
    names: list[str] = []
    for key, raw in data.items():
        if key not in TOP_LEVEL:
            problems.append(_Problem((str(key),), (
                f"unknown top-level key {_shown(key)}.{_did_you_mean(str(key), list(TOP_LEVEL))}"
                f" Allowed keys: {', '.join(TOP_LEVEL)}"
            )))
            continue
        kind = TOP_LEVEL[key]
        if kind is str:
            try:
                values[key] = _top_level_string(key, raw)
            except ValueError as exc:
                problems.append(_Problem((key,), str(exc)))
        elif kind is list:
            values[key] = _validate_passes(raw, problems, names)
        else:
            try:
                values[key] = kind.model_validate(raw if raw is not None else {})
            except ValidationError as exc:
                problems += _pydantic_problems(exc, kind, (key,), None)
    problems += [_Problem(("passes", str(i)), text) for i, text in _order_problems(names)]
    if problems:
        set_paths = [
            (tuple(item.partition("=")[0].strip().split(".")), item) for item in overrides or []
        ]
        lines = [f"{_origin(p.loc, source, set_paths)}: {p.text}" for p in problems]
        count = f"{len(lines)} problem{'s' if len(lines) > 1 else ''}"
        raise RecipeError(f"invalid recipe ({count}):\n  - " + "\n  - ".join(lines))
    return Recipe(**values)


# ---- reference ----------------------------------------------------------------------------
def _type_text(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return re.sub(r"\b(?:typing|compress(?:\.\w+)*)\.", "", str(annotation))


def _bounds_text(info: Any) -> str:
    bounds = []
    for meta in info.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"),
                           ("min_length", "length >=")):
            if getattr(meta, attr, None) is not None:
                bounds.append(f"{sign} {getattr(meta, attr):,}")
        limit = getattr(getattr(meta, "func", None), "limit", None)
        if limit is not None:
            bounds.append(f"<= {limit:,}")
    return ", ".join(bounds)


def _yaml_value(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix(
        "\n..."
    ).removesuffix(" ...").strip()


def _model_reference(model: type[BaseModel], indent: int) -> list[str]:
    pad, lines = " " * indent, []
    for name, info in model.model_fields.items():
        default = info.get_default(call_default_factory=True)
        required = info.is_required()
        if isinstance(default, BaseModel):
            lines.append(f"{pad}{name}:  # {_type_text(info.annotation)}; null turns it off")
            lines += _model_reference(type(default), indent + 2)
            continue
        bounds = _bounds_text(info)
        comment = ("required; " if required else "") + _type_text(info.annotation)
        comment += f", {bounds}" if bounds else ""
        shown = "" if required else f" {_yaml_value(default)}"
        nested = _model_in(info.annotation)
        if nested is not None and nested is not model:
            comment += "; fields: " + ", ".join(nested.model_fields)
        lines.append(f"{pad}{name}:{shown}  # {comment}")
    return lines


def _summary(cls: type) -> str:
    """The first sentence of a class docstring, at most ~90 characters."""
    text = " ".join((cls.__doc__ or "").split())
    sentence = re.split(r"(?<=[.;])\s", text, maxsplit=1)[0].rstrip(";")
    return sentence if len(sentence) <= 90 else sentence[:87] + "..."


def recipe_reference() -> str:
    """Every recipe key with its type, default and bounds, as commented YAML: what
    ``compress validate --show`` prints without a recipe."""
    lines = [
        "# compress recipe reference: every key with its default, type and bounds.",
        "# `compress validate RECIPE --show` prints one recipe resolved in this form.",
        "name: recipe  # str: one folder name (the default output is out/<name>)",
        "description: ''  # str",
        f"model: {Recipe().model}  # embedded name, model directory or hub id",
        f"device: {Recipe().device}  # {DEVICE_FORMS}: where passes and evaluation run "
        "(auto: the first GPU when there is one)",
        f"calibration:  # optional; {_summary(CalibrationConfig)}",
        *_model_reference(CalibrationConfig, 2),
        "passes:  # ordered list; each entry is `pass: <name>` plus that pass's settings",
    ]
    for name in sorted(PASSES):
        cls = PASSES[name].config_cls
        lines.append(f"  - pass: {name}  # {_summary(cls)}")
        lines += _model_reference(cls, 4)
    lines += ["export:", *_model_reference(ExportConfig, 2)]
    lines += ["eval:", *_model_reference(EvalConfig, 2)]
    for section in (TasksConfig, LatencyConfig):
        lines.append(f"# eval.{section.__name__.removesuffix('Config').lower()} "
                     f"(off by default): {_summary(section)}")
        lines += ["#" + line for line in _model_reference(section, 2)]
    return "\n".join(lines) + "\n"


def load_raw(path: str | Path) -> dict[str, Any]:
    """Read a recipe file into a mapping; a missing or non-YAML path is a clear error."""
    path = Path(path)
    if path.suffix not in (".yaml", ".yml"):
        raise RecipeError(f"{path}: a recipe file must end in .yaml or .yml")
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}. Check the path (ls recipes/).")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{path}: cannot be read as UTF-8 text ({exc}); save the recipe as "
                          "a UTF-8 YAML file") from exc
    data = _yaml(text, str(path))
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a YAML mapping with keys {', '.join(TOP_LEVEL)}")
    return data


class _RecipeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping: PyYAML keeps the last
    one silently, so a pass with two ``group_size`` lines would run with the second."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`, flattened below
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                again = key in seen
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if again:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"found the key {key!r} twice; keep one", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _yaml(text: str, source: str) -> Any:
    """``text`` parsed, or a RecipeError naming ``source`` (not YAML, a key given twice, or
    nested so deeply that the parser runs out of stack)."""
    try:
        return yaml.load(text, Loader=_RecipeLoader)  # a SafeLoader: no Python tags
    except yaml.YAMLError as exc:
        raise RecipeError(f"{source}: not valid YAML: {exc}") from exc
    except RecursionError:
        raise RecipeError(f"{source}: nested too deeply to be a recipe") from None


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
        for level, key in enumerate(keys[:-1]):
            where = ".".join(keys[: level + 1])
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
        value = _yaml(text, f"--set {item!r}")
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
    return parse_recipe(load_raw(path), source=str(path), overrides=overrides)
