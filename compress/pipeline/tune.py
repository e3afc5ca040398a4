"""``compress tune``: a recipe from a budget (measure -> solve -> write -> verify).

1. **Sensitivity.** For every decoder linear and every candidate format, the loss increase that
   quantizing that layer alone to that format is expected to cause, from the empirical Fisher:
   ``sum_t sum_n (dL/dy_tn)^2 (dy_tn)^2`` with ``dy = x (W_q - W)^T`` over calibration tokens, L
   the next-token loss. One forward and backward per calibration batch measures every layer and
   format at once (the second-order, diagonal-Fisher estimate of HAWQ-v2 and of the "gradient"
   score of NVIDIA ModelOpt's ``auto_quantize``). ``W_q`` is the RTN weight of the format.
2. **Cost.** The stored bytes of each layer in each format: the codes, scales and zero points of
   the ``QuantLinear`` the pass builds, or the float weight in the export dtype (16 bits).
3. **Solve** the multiple-choice knapsack "minimum total sensitivity under the byte budget"
   exactly by dynamic programming over the budget cut into ``resolution`` units, each layer's
   cost rounded *up* to whole units (so the answer always fits the budget).
4. **Write** a recipe a person can read and edit: one weight-quantization pass (GPTQ by default,
   or AWQ, or the AutoRound rounding pass with its own ``iters``/``batch_size``) whose default
   is the most chosen format, per-layer ``overrides`` grouped into one regex per projection and
   format, float layers in ``ignore``. Then **verify**: the recipe runs as one job of
   ``compress.pipeline.job`` (what ``compress run`` does, streamed when it can be), the
   bits per weight are read back from the exported safetensors (scales and zero points
   included), the quality is the run's perplexity on the test split, and a TPOT target is
   measured through the runtime. That job is planned, and it and the measurement are checked
   against the available memory, before the model is loaded; the measurement's copy of the
   model is freed before the job loads its own.

Budgets: average bits per decoder linear weight; checkpoint bytes (everything that is not a
decoder linear weight is counted at the export dtype and subtracted); or TPOT on this machine
(decode is bandwidth-bound, so TPOT is modelled as ``a + b * linear bytes``, fitted from two
uniform models measured through the runtime, then checked on the result). A quality ceiling
(Δppl) is checked on the result, not searched for: a miss is reported with the numbers.
MoE models: each sparse layer's fused experts module is one unit with one format for all its
experts (``compress.pipeline.tune_units``). Not done: searching the algorithm per layer (one
pass for all), activation quantization.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from compress.arch import DEFAULT_IGNORE
from compress.core.errors import ConfigError
from compress.core.matcher import matches, set_submodule
from compress.pipeline.tune_layerwise import (
    layerwise_sensitivity_bytes,
    measure_sensitivity_layerwise,
    use_layer_by_layer,
)
from compress.pipeline.tune_units import (
    FLOAT_BITS,
    Unit,
    checkpoint_unit_bytes,
    fisher_hooks,
    header_bytes_bound,
    measured_linears,
    measured_names,
    quantized_variants,
    stored_owners,
    tune_units,
    unit_tables,
)
from compress.quant.linear import QuantLinear, WeightScheme
from compress.quant.primitives import GRIDS

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class Format:
    """One candidate format of a layer: ``float`` (kept), or integer bits with a group size
    (None: one scale per output channel) and symmetric or asymmetric grid."""

    name: str
    n_bits: int | None = None
    group_size: int | None = None
    symmetric: bool = True
    grid: str = "restricted"  # symmetric grid (compress.quant.primitives), one per tune run

    @property
    def is_float(self) -> bool:
        return self.n_bits is None

    def scheme(self) -> WeightScheme:
        # float16 scales: what the passes store by default (scale_dtype)
        return WeightScheme(self.n_bits, self.group_size, self.symmetric, torch.float16, self.grid)

    def fits(self, linear: nn.Linear) -> bool:
        return self.fits_widths((linear.in_features,))

    def fits_widths(self, widths: tuple[int, ...]) -> bool:
        return self.is_float or self.group_size is None or all(
            w % self.group_size == 0 for w in widths)


def parse_format(name: str) -> Format:
    """``float``, ``int8`` (per channel), ``int8-g128``, ``int4-g32``, ``int4-g128-asym``..."""
    if name == "float":
        return Format("float")
    match = re.fullmatch(r"int([48])(?:-g(32|64|128|256))?(-asym)?", name)
    if match is None:
        raise ConfigError(
            f"tune: unknown format {name!r}; write float, int8, int8-g128, int4-g32, "
            "int4-g64, int4-g128 or int4-g256, with -asym for zero points"
        )
    bits, group, asym = match.groups()
    if bits == "4" and group is None:
        raise ConfigError(f"tune: format {name!r} needs a group size (int4-g32/g64/g128/g256)")
    return Format(name, int(bits), int(group) if group else None, asym is None)


DEFAULT_FORMATS = (
    "float", "int8", "int4-g32", "int4-g64", "int4-g128", "int4-g32-asym", "int4-g128-asym",
)  # fmt: skip
ALGORITHMS = ("gptq", "awq", "autoround")  # the weight pass the written recipe runs


# ---- 1. sensitivity -----------------------------------------------------------------------
def layer_costs(linear: nn.Linear, formats: list[Format]) -> tuple[dict[str, int], dict]:
    """Stored bytes per format that fits ``linear``, and the RTN weight error ``W_q - W``
    (float32) per integer format."""
    sizes, quants = quantized_variants(linear, formats)
    weight = linear.weight.detach().float()
    return sizes, {f: q.dequantized_weight(torch.float32) - weight for f, q in quants.items()}


def measure_sensitivity(
    model: nn.Module,
    names: list[str],
    formats: list[Format],
    batches: list[torch.Tensor],
    progress: bool = False,
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, int]]]:
    """Fisher estimate of the loss increase (``scores[layer][format]``, float format 0) and the
    stored bytes (``sizes[layer][format]``) of each named linear of ``model`` (module docstring,
    step 1). ``batches``: token ids ``[B, T]``; the loss is their next-token cross-entropy.
    ``compress.pipeline.tune_layerwise`` computes the same one decoder layer at a time."""
    modules = {name: model.get_submodule(name) for name in names}
    sizes, deltas = {}, {}
    for name, linear in modules.items():
        sizes[name], deltas[name] = layer_costs(linear, formats)
    scores = {name: dict.fromkeys(sizes[name], 0.0) for name in names}
    requires = {p: p.requires_grad for p in model.parameters()}
    try:
        for p in model.parameters():
            p.requires_grad_(False)  # gradients w.r.t. activations only
        embed = model.get_input_embeddings()
        with fisher_hooks(modules, lambda name, fmt: deltas[name][fmt], scores):
            for index, ids in enumerate(batches):
                hidden = embed(ids).detach().requires_grad_(True)
                loss = model(inputs_embeds=hidden, labels=ids).loss
                loss.backward()
                if progress:
                    log.info("tune: sensitivity batch %d/%d (loss %.3f)", index + 1,
                             len(batches), loss.item())  # fmt: skip
    finally:
        for p, flag in requires.items():
            p.requires_grad_(flag)
    return scores, sizes


def sensitivity_bytes(where, formats: list[Format], batch_tokens: int) -> int | None:
    """Estimated peak resident bytes of ``measure_sensitivity`` on the checkpoint folder
    ``where`` (None where it cannot be read without loading: a hub id, a compressed
    checkpoint), from its meta skeleton: the model loaded whole in float32, the RTN error
    ``W_q - W`` (float32) of every decoder linear in every integer format that fits it, all
    alive through the measurement, and the activations autograd keeps for one batch of
    ``batch_tokens`` tokens. The activation term is a guess from the tensors a Llama layer
    saves for its backward (about 8 hidden-sized and 4 intermediate-sized per token and layer,
    and the logits three times), not a measurement; it is small beside the errors."""
    from compress.io.load import is_compressed_checkpoint
    from compress.io.stream import meta_skeleton
    from compress.pipeline.preflight import BASE_BYTES, FLOAT32, LOAD_FACTOR

    if not isinstance(where, Path) or is_compressed_checkpoint(where):
        return None
    skeleton = meta_skeleton(where)
    params = sum(p.numel() for p in skeleton.parameters())
    errors = 0
    for unit in tune_units(skeleton).values():
        fits = sum(1 for f in formats if not f.is_float and f.fits_widths(unit.input_widths))
        errors += fits * unit.numel * FLOAT32
    cfg = skeleton.config
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    intermediate = int(getattr(cfg, "intermediate_size", 0) or 4 * hidden)
    per_token = (int(getattr(cfg, "num_hidden_layers", 0) or 0) * (8 * hidden + 4 * intermediate)
                 + 3 * int(getattr(cfg, "vocab_size", 0) or 0))
    return (BASE_BYTES + int(params * FLOAT32 * LOAD_FACTOR) + errors
            + batch_tokens * per_token * FLOAT32)


# ---- 2./3. budget and solver -------------------------------------------------------------
def solve_assignment(
    scores: list[list[float]], costs: list[list[int]], budget: int, resolution: int = 1 << 16
) -> list[int] | None:
    """Index of the chosen option per layer minimising the summed score with summed cost
    <= ``budget``, or None when even the cheapest options do not fit. Exact for costs that are
    multiples of ``budget / resolution``; otherwise costs are rounded up to that unit (feasible,
    optimal up to the rounding) and the budget the rounding left is then spent greedily."""
    unit = max(budget / resolution, 1.0)
    units = int(budget // unit)
    inf = float("inf")
    best = np.full(units + 1, inf)  # best[b]: least score with exactly b units spent so far
    best[0] = 0.0
    choices = np.zeros((len(scores), units + 1), dtype=np.int16)
    for layer, (layer_scores, layer_costs_) in enumerate(zip(scores, costs, strict=True)):
        nxt = np.full(units + 1, inf)
        for option, (score, cost) in enumerate(zip(layer_scores, layer_costs_, strict=True)):
            c = math.ceil(cost / unit - 1e-9)
            if c > units:
                continue
            candidate = best[: units + 1 - c] + score
            better = candidate < nxt[c:]
            nxt[c:][better] = candidate[better]
            choices[layer, c:][better] = option
        best = nxt
    if np.isfinite(best).any():
        spent = int(np.argmin(best))
        picked = []
        for layer in range(len(scores) - 1, -1, -1):
            option = int(choices[layer, spent])
            picked.append(option)
            spent -= math.ceil(costs[layer][option] / unit - 1e-9)
        picked = picked[::-1]
    else:  # the rounding up made it infeasible: start from the cheapest options, if they fit
        picked = [min(range(len(c)), key=c.__getitem__) for c in costs]
        if sum(c[i] for c, i in zip(costs, picked, strict=True)) > budget:
            return None
    return _spend_the_rest(scores, costs, budget, picked)


def _spend_the_rest(
    scores: list[list[float]], costs: list[list[int]], budget: int, picked: list[int]
) -> list[int]:
    """Upgrade layers while the exact (unrounded) costs leave budget: each step takes the change
    with the largest score drop per byte that still fits (what the rounding up left unused)."""
    left = budget - sum(c[i] for c, i in zip(costs, picked, strict=True))
    while True:
        best_gain, best_move = 0.0, None
        for layer, (layer_scores, layer_costs) in enumerate(zip(scores, costs, strict=True)):
            now = picked[layer]
            for option, (score, cost) in enumerate(zip(layer_scores, layer_costs, strict=True)):
                extra, drop = cost - layer_costs[now], layer_scores[now] - score
                if drop <= 0 or extra > left:
                    continue
                gain = drop / max(extra, 1)
                if gain > best_gain:
                    best_gain, best_move = gain, (layer, option, extra)
        if best_move is None:
            return picked
        layer, option, extra = best_move
        picked[layer], left = option, left - extra


def assign_formats(
    scores: dict[str, dict[str, float]], sizes: dict[str, dict[str, int]], budget_bytes: int
) -> dict[str, str]:
    """Layer -> format name under ``budget_bytes`` of decoder linear weights (``solve_assignment``);
    a ConfigError naming the smallest possible size when the budget is below it."""
    names = list(scores)
    options = [sorted(sizes[n], key=lambda f: sizes[n][f]) for n in names]
    picked = solve_assignment(
        [[scores[n][f] for f in opts] for n, opts in zip(names, options, strict=True)],
        [[sizes[n][f] for f in opts] for n, opts in zip(names, options, strict=True)],
        budget_bytes,
    )
    if picked is None:
        smallest = sum(sizes[n][opts[0]] for n, opts in zip(names, options, strict=True))
        raise ConfigError(
            f"tune: the budget allows {budget_bytes:,} bytes of decoder linear weights, but the "
            f"smallest candidate formats need {smallest:,}: raise the budget or add smaller "
            "formats (--formats)"
        )
    return {n: opts[i] for n, opts, i in zip(names, options, picked, strict=True)}


def bits_per_weight(assignment: dict[str, str], sizes, numels: dict[str, int]) -> float:
    stored = sum(sizes[n][f] for n, f in assignment.items())
    return 8 * stored / sum(numels[n] for n in assignment)


# ---- 4. the recipe ------------------------------------------------------------------------
def _grouped_patterns(names: list[str]) -> list[str]:
    """Few patterns matching exactly ``names``: ``re:<prefix>\\.(0|5|9)\\.<suffix>$`` per
    (prefix, suffix) around the layer index, exact names otherwise."""
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    exact = []
    for name in names:
        found = re.fullmatch(r"(.*)\.(\d+)\.(.*)", name)
        if found is None:
            exact.append(name)
            continue
        prefix, index, suffix = found.groups()
        groups[(prefix, suffix)].append(index)
    patterns = []
    for (prefix, suffix), indices in sorted(groups.items()):
        ordered = sorted(indices, key=int)
        patterns.append(f"re:{re.escape(prefix)}\\.({'|'.join(ordered)})\\.{re.escape(suffix)}$")
    return patterns + exact


def recipe_dict(
    *,
    name: str,
    model: str,
    assignment: dict[str, str],
    algorithm: str = "gptq",
    calibration: dict[str, Any],
    perplexity: dict[str, Any],
    description: str,
    symmetric_grid: str = "restricted",
    pass_options: dict[str, Any] | None = None,
    scheme_names: dict[str, tuple[str, ...]] | None = None,
) -> dict[str, Any]:
    """The recipe (as a dict, for ``parse_recipe`` / YAML) that quantizes each layer of
    ``assignment`` to its format: the most chosen integer format is the pass default, the other
    integer formats are per-layer overrides, float layers are added to ``ignore``.
    ``pass_options``: more keys of the pass (e.g. AutoRound's ``iters``), checked by the
    pass's config when the recipe is parsed. ``scheme_names``: the names an override must
    match to reach a unit (``Unit.scheme_names``; default the unit's own name)."""
    scheme_names = scheme_names or {}
    formats = {n: parse_format(f) for n, f in assignment.items()}
    integer = Counter(f.name for f in formats.values() if not f.is_float)
    if not integer:
        raise ConfigError("tune: every layer was kept float: the budget needs no quantization")
    default = parse_format(integer.most_common(1)[0][0])
    by_format: dict[str, list[str]] = defaultdict(list)
    for layer, fmt in formats.items():
        by_format[fmt.name].append(layer)
    overrides = []
    for fmt_name, layers in sorted(by_format.items()):
        fmt = parse_format(fmt_name)
        if fmt.is_float or fmt == default:
            continue
        named = [n for layer in layers for n in scheme_names.get(layer, (layer,))]
        for pattern in _grouped_patterns(named):
            entry: dict[str, Any] = {"layers": pattern, "n_bits": fmt.n_bits,
                                     "group_size": fmt.group_size or "channel"}  # fmt: skip
            if fmt.symmetric != default.symmetric:
                entry["symmetric"] = fmt.symmetric
            overrides.append(entry)
    ignore = list(DEFAULT_IGNORE) + _grouped_patterns(by_format.get("float", []))
    step: dict[str, Any] = {"pass": f"quantize.{algorithm}", "n_bits": default.n_bits,
                            "group_size": default.group_size, "symmetric": default.symmetric,
                            "ignore": ignore, "strict": True}  # fmt: skip
    if symmetric_grid != "restricted":
        step["symmetric_grid"] = symmetric_grid
    if algorithm == "gptq":
        step["act_order"] = True  # as the shipped GPTQ recipes: better on SmolLM2 (results.md)
    step.update(pass_options or {})
    if overrides:
        step["overrides"] = overrides
    return _recipe_frame(name=name, model=model, calibration=calibration,
                         perplexity=perplexity, description=description, step=step)


def _recipe_frame(*, name: str, model: str, calibration: dict[str, Any],
                  perplexity: dict[str, Any], description: str,
                  step: dict[str, Any]) -> dict[str, Any]:
    """Everything of a tune recipe but its pass's formats: what the verification job is
    planned (and its memory checked) with before the formats are known."""
    return {
        "name": name,
        "description": description,
        "model": model,
        "calibration": calibration,
        "passes": [step],
        "export": {"dtype": "auto"},
        "eval": {"baseline": True, "perplexity": perplexity},
    }


def check_recipe_matches(
    recipe, model: nn.Module, assignment: dict[str, str], grid: str = "restricted"
) -> None:
    """The written recipe gives every layer exactly its assigned format, on the tune's
    symmetric ``grid`` (a guard against a pattern that catches the wrong layer)."""
    from compress.quant.scheme import scheme_for_layer

    cfg = recipe.passes[0]
    units = tune_units(model)
    for layer, fmt_name in assignment.items():
        fmt = parse_format(fmt_name)
        ignored = any(matches(layer, None, p) for p in cfg.ignore)
        if fmt.is_float != ignored:
            raise AssertionError(f"tune wrote a recipe that {'ignores' if ignored else 'keeps'} "
                                 f"{layer} (assigned {fmt_name})")  # fmt: skip
        if fmt.is_float:
            continue
        unit = units[layer]
        for name, width in zip(unit.scheme_names, unit.input_widths, strict=True):
            # scheme_for_layer reads the input width; an experts module's as plan_experts does
            probe = nn.Linear(width, 1, bias=False, device="meta")
            scheme = scheme_for_layer(probe, cfg, cfg.n_bits, name)
            got = (scheme.n_bits, scheme.group_size, scheme.symmetric, scheme.grid)
            if got != (fmt.n_bits, fmt.group_size, fmt.symmetric, grid):
                raise AssertionError(f"tune wrote a recipe giving {name} {got}, assigned "
                                     f"{fmt_name}")  # fmt: skip


# ---- measurement of what was written ------------------------------------------------------
def _cache_key(**parts: Any) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def sensitivity_cache(key: str) -> Path:
    root = Path(os.environ.get("COMPRESS_CACHE_DIR", Path.home() / ".cache" / "compress"))
    return root / "tune" / f"{key}.json"


def read_sensitivities(cache: Path, names: list[str]) -> tuple[dict, dict] | None:
    """``measure_sensitivity``'s (scores, sizes) stored in ``cache`` for layers ``names``, or
    None when there is none or it is damaged (cut short, edited, a NaN score): measured again
    rather than planned from, since a NaN compares false with every budget."""
    if not cache.is_file():
        return None
    try:
        stored = json.loads(cache.read_text())
        scores, sizes = stored["scores"], stored["sizes"]
        values = [v for table in (scores, sizes) for n in names for v in table[n].values()]
        if not all(isinstance(v, int | float) and math.isfinite(v) for v in values):
            raise ValueError("a score or size is not a finite number")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        log.warning("tune: ignoring the damaged sensitivity cache %s (%s); measuring again",
                    cache, exc)
        return None
    return scores, sizes


def decoder_linears(model: nn.Module) -> list[str]:
    """Every ``nn.Linear`` unit of the model (``tune_units``): all but the default-ignored
    output head and the MoE routers."""
    return [name for name, unit in tune_units(model).items() if not unit.expert_count]


def copy_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


# ---- orchestration ------------------------------------------------------------------------
@dataclass(frozen=True)
class TuneTarget:
    """Exactly one size target (bits per decoder linear weight, checkpoint bytes, or decode TPOT
    in ms on this machine) and optional quality ceilings (Δ perplexity in %, mean KL in nats
    from the baseline's top-k, a lower bound of the full KL: see ``compress.eval.quality``)."""

    bits_per_weight: float | None = None
    max_bytes: int | None = None
    tpot_ms: float | None = None
    max_dppl_pct: float | None = None
    max_kl: float | None = None

    def check(self) -> None:
        given = [v for v in (self.bits_per_weight, self.max_bytes, self.tpot_ms) if v is not None]
        if len(given) != 1:
            raise ConfigError(
                "tune: give exactly one target: --bits-per-weight, --max-bytes or --tpot-ms"
            )
        ceilings = [v for v in (self.max_dppl_pct, self.max_kl) if v is not None]
        if any(v <= 0 for v in given) or any(v < 0 for v in ceilings):
            raise ConfigError("tune: targets must be positive numbers")


def other_export_bytes(model: nn.Module, units: dict[str, Unit]) -> int:
    """Bytes of everything the export's safetensors hold besides the weights of the tune's
    ``units`` (embedding, norms, biases, routers, an untied head: floats at 16 bits, tied
    tensors once), and a bound on their JSON headers (``header_bytes_bound``: the file sizes
    the target is checked on include them)."""
    skip = {k for unit in units.values() for k in unit.weight_keys}
    seen, total, others = set(), 0, []
    for key, tensor in model.state_dict(keep_vars=True).items():
        # tied tensors share storage; a layer-by-layer tune's skeleton is on meta: the object
        same = id(tensor) if tensor.device.type == "meta" else tensor.data_ptr()
        if key in skip or same in seen:
            continue
        seen.add(same)
        others.append(key)
        bits = FLOAT_BITS if tensor.is_floating_point() else 8 * tensor.element_size()
        total += tensor.numel() * bits // 8
    return total + header_bytes_bound(model, units, others)


def _uniform_variant(model: nn.Module, names: list[str], formats: list[Format], sizes) -> tuple:
    """A copy with every unit in its smallest candidate format, and its linear bytes."""
    from compress.quant.experts import rtn_experts

    variant = copy.deepcopy(model)
    units = tune_units(variant)
    total = 0
    for name in names:
        smallest = min(sizes[name], key=lambda f: sizes[name][f])
        total += sizes[name][smallest]
        fmt = parse_format(smallest)
        if fmt.is_float:
            continue
        module = variant.get_submodule(name)
        if units[name].expert_count:
            rtn_experts(variant, name, module, (fmt.scheme(), fmt.scheme()), "auto")
        else:
            set_submodule(variant, name, QuantLinear.from_linear(module, fmt.scheme()))
    return variant, total


def fit_tpot(model, names, formats, sizes, prompt: list[int], new_tokens: int = 32) -> dict:
    """TPOT (ms) through the runtime of the float model (bf16) and of the smallest uniform
    model, and the line ``tpot = a + b * linear_bytes`` through the two points."""
    from compress.eval.latency import decode_speed

    float_bytes = sum(sizes[n]["float"] for n in names if "float" in sizes[n])
    points = []
    # one variant beside the model at a time: each is built, timed and freed before the next
    for build in (lambda: (copy.deepcopy(model).to(torch.bfloat16), float_bytes),
                  lambda: _uniform_variant(model, names, formats, sizes)):  # fmt: skip
        variant, nbytes = build()
        speed = decode_speed(variant, prompt, new_tokens, repeats=3)
        del variant
        points.append({"linear_bytes": nbytes, "tpot_ms": 1e3 / speed["decode_tok_s"],
                       "engine": speed["engine"]})  # fmt: skip
    (b0, t0), (b1, t1) = ((p["linear_bytes"], p["tpot_ms"]) for p in points)
    slope = (t0 - t1) / (b0 - b1) if b0 != b1 else 0.0
    return {"points": points, "a_ms": t1 - slope * b1, "b_ms_per_byte": slope}


def run_tune(
    model_id: str,
    target: TuneTarget,
    *,
    formats: tuple[str, ...] = DEFAULT_FORMATS,
    algorithm: str = "gptq",
    pass_options: dict[str, Any] | None = None,
    symmetric_grid: str = "restricted",
    num_samples: int = 32,
    seq_len: int = 512,
    calibration_mix: dict[str, float] | None = None,
    limit: int | None = 16,
    eval_dataset: str = "wikitext2",
    context_length: int = 512,
    out_dir: str | Path | None = None,
    name: str | None = None,
    data_dir: str | None = None,
    progress: bool = True,
    overwrite: bool = False,
    device: str = "auto",
    layer_by_layer: bool | None = None,
) -> dict[str, Any]:
    """Measure, solve, write the recipe, run it and verify (module docstring). Returns the tune
    report (also written as ``tune.json`` / ``tune.md`` beside the run's results). ``device``:
    the written recipe's (its passes and evaluation); the sensitivities are measured on the
    CPU, with the model loaded whole or, ``layer_by_layer`` (None: when the whole model's
    measurement would not fit in memory), one decoder layer at a time
    (``compress.pipeline.tune_layerwise``: the same numbers)."""
    import gc

    from compress.calibration import calibration_mix as draw_calibration
    from compress.eval.report import environment, write_results
    from compress.io.export import layerwise_model
    from compress.io.load import load_model, load_tokenizer
    from compress.output_dir import check_output_dir
    from compress.pipeline.job import JobOptions, model_folders, plan_job, run_planned, with_recipe
    from compress.pipeline.preflight import check_phase
    from compress.recipe import parse_recipe

    target.check()
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"tune: algorithm {algorithm!r}: choose one of {ALGORITHMS}")
    if symmetric_grid not in GRIDS:
        raise ConfigError(f"tune: symmetric grid {symmetric_grid!r}: choose one of {GRIDS}")
    # the grid applies to every symmetric candidate, in the sensitivity and the written recipe
    candidates = [replace(parse_format(f), grid=symmetric_grid) for f in formats]
    mix = calibration_mix or {"wikitext2-valid": 1.0}
    calibration = {"num_samples": num_samples, "seq_len": seq_len, "seed": 0, "mix": mix}
    perplexity = {"dataset": eval_dataset, "context_length": context_length, "limit": limit}
    tag = name or f"tune-{model_id.replace('/', '-')}"[:80]
    out = Path(out_dir or Path("out") / tag)
    # Before any work: the verification job is planned (output folder, data, streaming, the
    # memory preflight) with the recipe tune will write, less its per-layer formats, which
    # change none of those checks (``with_recipe`` holds the written one to that).
    frame = _recipe_frame(name=tag, model=model_id, calibration=calibration,
                          perplexity=perplexity, description=f"compress tune: {target}",
                          step={"pass": f"quantize.{algorithm}", **(pass_options or {})})
    planned = replace(parse_recipe(frame, source="compress tune"), device=device)
    check_output_dir(out, overwrite=overwrite, protect=model_folders(planned, model_id))
    plan = plan_job(planned, model=model_id, data_dir=data_dir)
    batch_tokens = min(num_samples, 4) * seq_len
    whole = sensitivity_bytes(plan.where, candidates, batch_tokens)
    if use_layer_by_layer(plan.where, whole, layer_by_layer):
        if target.tpot_ms is not None:
            raise ConfigError("tune: a TPOT target times the model in memory, which the layer-by-"
                              "layer measurement avoids; give --bits-per-weight or --max-bytes")
        check_phase("sensitivity (layer by layer)", layerwise_sensitivity_bytes(
            plan.where, candidates, batch_tokens, num_samples * seq_len),
            "fewer candidate formats (--formats) or fewer, shorter calibration samples")
        stream = layerwise_model(plan.where)
        model, tokenizer = stream.model, load_tokenizer(plan.where)
    else:
        check_phase("sensitivity (model loaded whole)", whole,
                    "fewer candidate formats (--formats) or a shorter --seq-len")
        stream, loaded = None, load_model(model_id)
        model, tokenizer = loaded.model.float().eval(), loaded.tokenizer
        del loaded
    units = tune_units(model)
    names = list(units)
    numels = {n: unit.numel for n, unit in units.items()}
    grid_key = {} if symmetric_grid == "restricted" else {"grid": symmetric_grid}
    key = _cache_key(model=str(plan.where), formats=formats, calibration=calibration,
                     layers=names, version=1, **grid_key)  # fmt: skip
    cache = sensitivity_cache(key)
    stored = read_sensitivities(cache, names)
    if stored is not None:
        scores, sizes = stored
        log.info("tune: sensitivities read back from %s", cache)
    else:
        ids = draw_calibration(mix, tokenizer, num_samples=num_samples, seq_len=seq_len,
                               seed=0, data_dir=data_dir)  # fmt: skip
        if stream is not None:
            scores, sizes = measure_sensitivity_layerwise(
                stream, units, candidates, list(ids.split(4)), progress=progress,
                spill_near=cache.parent, resume=cache.with_suffix(".partial.safetensors"))
            members = measured_names(model, units)  # what measured_linears names
        else:
            with measured_linears(model, units) as members:
                linears = [n for group in members.values() for n in group]
                scores, sizes = measure_sensitivity(model, linears, candidates,
                                                    list(ids.split(4)), progress)  # fmt: skip
        scores, sizes = unit_tables(scores, sizes, members)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.tmp-{os.getpid()}")  # two runs: two files
        tmp.write_text(json.dumps({"scores": scores, "sizes": sizes}))
        os.replace(tmp, cache)  # the measurement survives an interrupted run

    tpot_fit = None
    if target.bits_per_weight is not None:
        budget = int(target.bits_per_weight * sum(numels.values()) / 8)
    elif target.max_bytes is not None:
        budget = target.max_bytes - other_export_bytes(model, units)
    else:
        prompt = tokenizer("The history of the city", return_tensors=None)["input_ids"]
        tpot_fit = fit_tpot(model, names, candidates, sizes, prompt)
        if tpot_fit["b_ms_per_byte"] <= 0:
            raise ConfigError(f"tune: TPOT did not grow with bytes on this machine ({tpot_fit}); "
                              "a TPOT target cannot be turned into a size here")  # fmt: skip
        budget = int((target.tpot_ms - tpot_fit["a_ms"]) / tpot_fit["b_ms_per_byte"])
    if budget <= 0:
        raise ConfigError(f"tune: the target leaves no bytes for the decoder weights ({budget})")
    assignment = assign_formats(scores, sizes, budget)
    predicted_bits = bits_per_weight(assignment, sizes, numels)

    raw = recipe_dict(
        name=tag, model=model_id, assignment=assignment, algorithm=algorithm,
        calibration=calibration, perplexity=perplexity, description=f"compress tune: {target}",
        symmetric_grid=symmetric_grid, pass_options=pass_options,
        scheme_names={n: unit.scheme_names for n, unit in units.items()},
    )  # fmt: skip
    recipe = replace(parse_recipe(raw, source="compress tune"), device=device)
    check_recipe_matches(recipe, model, assignment, symmetric_grid)
    owners = stored_owners(model, units)
    how = "layer by layer" if stream is not None else "model loaded whole"
    # the job loads the model itself (whole or layer by layer): this copy goes first
    del model, stream
    gc.collect()
    result = run_planned(with_recipe(plan, recipe), out,
                         JobOptions(data_dir=data_dir, progress=progress, overwrite=overwrite))
    stored = checkpoint_unit_bytes(out, owners, units)
    measured_bits = 8 * sum(stored.values()) / sum(numels.values())
    report: dict[str, Any] = {
        "target": target.__dict__, "algorithm": algorithm, "pass_options": pass_options or {},
        "formats": list(formats),
        "sensitivity": how,
        "symmetric_grid": symmetric_grid,
        "budget_linear_bytes": budget, "predicted_bits_per_weight": predicted_bits,
        "measured_bits_per_weight": measured_bits,
        "measured_linear_bytes": sum(stored.values()),
        "format_counts": dict(Counter(assignment.values())),
        "assignment": assignment, "scores": scores, "sizes": sizes, "tpot_fit": tpot_fit,
        "rows": result.rows, "environment": environment(),
    }  # fmt: skip
    compressed = result.rows[-1]
    checks = _verify(target, report, compressed, out, prompt_tokens=tokenizer)
    report["checks"] = checks
    write_results(out, "tune", tune_markdown(report), report, overwrite=True)
    return report


def _verify(target: TuneTarget, report: dict, row: dict, out: Path, prompt_tokens) -> list[dict]:
    """Each target compared with what was measured on the result."""
    checks = []
    bits = report["measured_bits_per_weight"]
    if target.bits_per_weight is not None:
        checks.append({"what": "bits/weight", "target": target.bits_per_weight, "got": bits,
                       "ok": bits <= target.bits_per_weight + 1e-9})  # fmt: skip
    if target.max_bytes is not None:
        disk = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        checks.append({"what": "checkpoint bytes (safetensors)", "target": target.max_bytes,
                       "got": disk, "ok": disk <= target.max_bytes})  # fmt: skip
    if target.tpot_ms is not None:
        from compress.eval.latency import decode_speed
        from compress.io.load import load_model

        served = load_model(str(out))
        prompt = prompt_tokens("The history of the city", return_tensors=None)["input_ids"]
        speed = decode_speed(served.model, prompt, 32, repeats=3)
        tpot = 1e3 / speed["decode_tok_s"]
        checks.append({"what": f"TPOT ms ({speed['engine']})", "target": target.tpot_ms,
                       "got": tpot, "ok": tpot <= target.tpot_ms})  # fmt: skip
    if target.max_dppl_pct is not None:
        delta = row.get("ppl_delta_pct")
        checks.append({"what": "Δppl %", "target": target.max_dppl_pct, "got": delta,
                       "ok": delta is not None and delta <= target.max_dppl_pct})  # fmt: skip
    if target.max_kl is not None:
        kl = row.get("kl")
        checks.append({"what": "KL (nats, top-k lower bound)", "target": target.max_kl,
                       "got": kl, "ok": kl is not None and kl <= target.max_kl})  # fmt: skip
    return checks


def tune_markdown(report: dict) -> str:
    lines = [
        "## compress tune", "",
        f"target: {report['target']}; algorithm {report['algorithm']}; symmetric grid "
        f"{report.get('symmetric_grid', 'restricted')}; candidates "
        f"{', '.join(report['formats'])}; sensitivity measured with the "
        f"{report.get('sensitivity', 'model loaded whole')}", "",
        "| check | target | measured | ok |", "|---|---:|---:|---|",
    ]  # fmt: skip
    for check in report["checks"]:
        got = check["got"]
        cell = f"{got:.4g}" if isinstance(got, float) else str(got)
        lines.append(f"| {check['what']} | {check['target']} | {cell} | "
                     f"{'yes' if check['ok'] else '**no**'} |")  # fmt: skip
    lines += ["", f"predicted bits/weight {report['predicted_bits_per_weight']:.4f}, measured "
              f"from the checkpoint {report['measured_bits_per_weight']:.4f} (codes, scales and "
              "zero points; kept-float layers at 16 bits)", "",
              "| format | layers |", "|---|---:|"]  # fmt: skip
    for fmt, count in sorted(report["format_counts"].items()):
        lines.append(f"| {fmt} | {count} |")
    return "\n".join(lines) + "\n"
