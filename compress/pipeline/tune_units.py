"""What ``compress tune`` gives a format to (a *unit*): each decoder ``nn.Linear`` the passes
target, and each sparse layer's fused experts module of an MoE model, all its experts' gate, up
and down in one format. One format per experts module because that is what a recipe can say:
a pass's ``ignore`` keeps the whole module float, and its per-layer ``overrides`` name the
module's ``<experts>.<gate_up>`` and ``<experts>.<down>`` (``compress.quant.experts``).

The sensitivity of an experts module is the sum of its experts' linears' (measured through
``FloatExpertsView``: one ``nn.Linear`` per expert and projection, views of the fused weights,
so the hooks of ``compress.pipeline.tune.measure_sensitivity`` see each expert's inputs and
output gradients), its stored bytes the sum of theirs; a format fits when its group size
divides both input widths (hidden and intermediate). MoE routers and shared-expert gates are
never quantized (``compress.arch.float_only_modules``) and are no unit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from compress.arch import (
    ARCHS,
    DEFAULT_IGNORE,
    expert_shape,
    float_only_modules,
    model_type,
    sparse_layers,
)
from compress.core.matcher import matches
from compress.quant.linear import QuantLinear

FLOAT_BITS = 16  # kept-float layers are exported in a 16-bit dtype (export dtype auto)


@dataclass(frozen=True)
class Unit:
    name: str  # the module's path: a Linear, or a fused experts module
    numel: int  # weights it holds
    input_widths: tuple[int, ...]  # what a format's group size must divide
    scheme_names: tuple[str, ...]  # the names the pass's per-layer overrides match
    weight_keys: tuple[str, ...]  # its weights' state-dict keys
    expert_count: int = 0  # experts in the module (0: a Linear)


def tune_units(model: nn.Module) -> dict[str, Unit]:
    """The units of ``model`` in module order: every ``nn.Linear`` outside the default-ignored
    head and the float-only modules, and every sparse layer's experts module."""
    arch = ARCHS.get(model_type(model))
    experts = {}
    if arch is not None and arch.moe is not None:
        moe = arch.moe
        for index in sparse_layers(model, arch):
            name = f"{arch.layer_prefix}{index}.{moe.fused}"
            module = model.get_submodule(name)
            count, hidden, inter = expert_shape(module, moe)
            keys = (f"{name}.{moe.gate_up}", f"{name}.{moe.down}")
            experts[name] = Unit(name, 3 * count * hidden * inter, (hidden, inter), keys, keys,
                                 count)  # fmt: skip
    fixed = float_only_modules(model)
    units = {}
    for name, module in model.named_modules():
        if name in experts:
            units[name] = experts[name]
        elif (isinstance(module, nn.Linear) and name not in fixed
              and not any(name.startswith(f"{e}.") for e in experts)
              and not any(matches(name, module, p) for p in DEFAULT_IGNORE)):  # fmt: skip
            units[name] = Unit(name, module.weight.numel(), (module.in_features,), (name,),
                               (f"{name}.weight",))  # fmt: skip
    return units


# ---- measurement -------------------------------------------------------------------------
def quantized_variants(linear: nn.Linear, formats: list) -> tuple[dict[str, int], dict]:
    """Stored bytes per format (``compress.pipeline.tune.Format``) that fits ``linear``, and its
    RTN ``QuantLinear`` per integer format (what the pass would store)."""
    sizes, quants = {}, {}
    for fmt in formats:
        if not fmt.fits(linear):
            continue
        if fmt.is_float:
            sizes[fmt.name] = linear.weight.numel() * FLOAT_BITS // 8
            continue
        quants[fmt.name] = QuantLinear.from_linear(linear, fmt.scheme(), backend="reference")
        sizes[fmt.name] = quants[fmt.name].weight_bytes()
    return sizes, quants


@contextlib.contextmanager
def fisher_hooks(modules: dict[str, nn.Linear], delta: Callable[[str, str], torch.Tensor],
                 scores: dict[str, dict[str, float]]) -> Iterator[None]:
    """Within: each backward through a linear of ``modules`` adds, for each integer format of
    ``scores[name]``, ``sum_t sum_n (dL/dy_tn * dy_tn)^2`` with ``dy = x delta(name, fmt)^T``
    (the output change of quantizing that layer alone) to ``scores[name][fmt]``."""
    inputs: dict[str, torch.Tensor] = {}

    def keep_input(name):
        def hook(module, args):
            inputs[name] = args[0].detach()

        return hook

    def score_output_grad(name):
        def hook(module, grad_input, grad_output):
            grad = grad_output[0].detach().float().flatten(0, -2)  # [tokens, N]
            x = inputs.pop(name).float().flatten(0, -2)  # [tokens, K]
            for fmt in scores[name]:
                if fmt == "float":
                    continue
                dy = x @ delta(name, fmt).t()  # [tokens, N]: output change of this layer alone
                scores[name][fmt] += float((grad * dy).square().sum(dtype=torch.float64))

        return hook

    handles = []
    try:
        for name, linear in modules.items():
            handles.append(linear.register_forward_pre_hook(keep_input(name)))
            handles.append(linear.register_full_backward_hook(score_output_grad(name)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def measured_names(model: nn.Module, units: dict[str, Unit]) -> dict[str, list[str]]:
    """``{unit: the nn.Linear names measured for it}``: a Linear's own, an experts module's
    ``<experts>.<e>.<projection>`` (``FloatExpertsView``'s children)."""
    names = {}
    for name, unit in units.items():
        if not unit.expert_count:
            names[name] = [name]
            continue
        projections = ARCHS[model_type(model)].moe.checkpoint_projections
        names[name] = [f"{name}.{e}.{p}" for e in range(unit.expert_count) for p in projections]
    return names


@contextlib.contextmanager
def measured_linears(model: nn.Module, units: dict[str, Unit]) -> Iterator[dict[str, list[str]]]:
    """Within: each experts unit of ``model`` is its ``FloatExpertsView`` (the same function,
    per-expert ``nn.Linear`` views); yields ``{unit: the nn.Linear names measured for it}``.
    The fused modules are put back on exit."""
    from compress.quant.experts import viewed_experts

    with viewed_experts(model, [name for name, unit in units.items() if unit.expert_count]):
        yield measured_names(model, units)


def unit_tables(
    scores: dict[str, dict[str, float]], sizes: dict[str, dict[str, int]],
    members: dict[str, list[str]],
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, int]]]:
    """Per-linear (scores, sizes) summed into per-unit ones over the formats every member
    linear fits."""
    unit_scores, unit_sizes = {}, {}
    for unit, names in members.items():
        fits = [f for f in sizes[names[0]] if all(f in sizes[n] for n in names)]
        unit_scores[unit] = {f: sum(scores[n][f] for n in names) for f in fits}
        unit_sizes[unit] = {f: sum(sizes[n][f] for n in names) for f in fits}
    return unit_scores, unit_sizes


def stored_owners(model: nn.Module, units: dict[str, Unit]) -> dict[str, str]:
    """``{stored linear name: unit}``: the names the export of ``model`` stores each unit's
    linears under (``checkpoint_renamer``; an experts module's per expert and projection)."""
    from compress.io.names import checkpoint_renamer

    rename = checkpoint_renamer(model)
    return {rename(linear): unit for unit, linears in measured_names(model, units).items()
            for linear in linears}


# A header entry is '"<name>":{"dtype":"BF16","shape":[..],"data_offsets":[a,b]},': the name
# plus at most this much for shapes of up to three dimensions under 10^6 and offsets under 10^13
HEADER_ENTRY_BYTES = 96
# per file: the 8-byte length, the metadata entry, the padding to 8 bytes; and shards beyond one
HEADER_FILE_BYTES = 4096
# what a quantized linear stores besides its name (compressed-tensors' packed layout)
QUANTIZED_LEAVES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


def header_bytes_bound(model: nn.Module, units: dict[str, Unit], others: list[str]) -> int:
    """An upper bound on the safetensors headers of ``model``'s export: every unit's linears
    with all of a quantized linear's tensors (``QUANTIZED_LEAVES``), the state-dict keys
    ``others`` as stored. Measured: a tiny MoE export's header was 7.4 KB of a 200 KB file,
    which a checkpoint-bytes target missed by before it was counted."""
    from compress.io.names import checkpoint_renamer

    rename = checkpoint_renamer(model)
    linears = sum(len(name) + len(leaf) + 1 + HEADER_ENTRY_BYTES
                  for name in stored_owners(model, units) for leaf in QUANTIZED_LEAVES)
    return (linears + sum(len(rename(key)) + HEADER_ENTRY_BYTES for key in others)
            + HEADER_FILE_BYTES)


def checkpoint_unit_bytes(folder: Path, owners: dict[str, str], units) -> dict[str, int]:
    """Bytes the exported safetensors in ``folder`` hold for each unit's weights (codes,
    scales, zero points, or the float weights; an experts module's linears summed), read from
    the files' headers (``read_header``); ``owners`` from ``stored_owners``."""
    from compress.io.checkpoint import read_header

    stored = dict.fromkeys(units, 0)
    leaves = {"weight", "weight_packed", "weight_scale", "weight_zero_point"}
    for path in sorted(folder.glob("*.safetensors")):
        for key, entry in read_header(path)[1].items():
            layer, _, leaf = key.rpartition(".")
            if layer in owners and leaf in leaves:
                begin, end = entry["data_offsets"]
                stored[owners[layer]] += end - begin
    return stored
