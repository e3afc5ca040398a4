"""What every structured-pruning pass shares: the family's decoder layers checked to hold the
float modules the passes rewrite, slicing of linears, norms and fused parts, calibration with
hooks, the number of units to keep, and the report (see the package docstring).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from compress.arch import Arch, arch_for, check_paths, decoder_layers, layer_arch
from compress.core.errors import ConfigError
from compress.core.registry import CompressionState, PassReport
from compress.prune.config import (
    PruneConfig,
)
from compress.quant.linear import QuantLinear

log = logging.getLogger(__name__)


def checked_layers(
    model: nn.Module, what: str, *, whole_layers: bool = False
) -> tuple[Arch, nn.ModuleList]:
    """The family's entry and decoder layers, checked to hold the float modules the prune passes
    rewrite, or a ConfigError naming the pass and what is missing. ``whole_layers``: the pass
    drops decoder layers and slices nothing (then MoE models are fine)."""
    arch = arch_for(model, what)
    layers = decoder_layers(model, what)
    if arch.moe is not None and not whole_layers:
        raise ConfigError(
            f"{what}: {arch.model_type} is a mixture-of-expert model; slicing its fused expert "
            "weights (3-D tensors over every expert E) is not implemented, so this pass "
            "refuses it. prune.layers (whole decoder layers) works on it"
        )
    paths = arch.linears + arch.layer_norms + arch.qk_norms + (arch.attention,)
    check_paths(model, arch, paths, what)
    for layer in layers[:1] if arch.moe is None else layers:  # an MoE model's dense layers too
        own = layer_arch(arch, layer)
        for name in own.linears:
            if own.moe is not None and name == own.moe.fused:
                continue  # dropped whole with its layer
            _check_float_linear(layer.get_submodule(name), name, what)
    return arch, layers


def _check_float_linear(module: nn.Module, name: str, what: str) -> None:
    if type(module) is not nn.Linear:
        raise ConfigError(
            f"{what}: {name} is a {type(module).__name__}, not nn.Linear: prune before "
            "quantize (put prune.* passes first in the recipe)"
        )


def submodules(layer: nn.Module, names: tuple[str, ...]) -> list[nn.Module]:
    return [layer.get_submodule(n) for n in names]


def count_params(model: nn.Module) -> int:
    """Logical parameter count: float parameters (tied weights once) plus the weights that
    quantized layers hold as integer buffers (a QuantLinear of [N, K] counts N x K)."""
    quantized = sum(
        m.out_features * m.in_features for m in model.modules() if isinstance(m, QuantLinear)
    )
    return sum(p.numel() for p in model.parameters()) + quantized


def slice_linear(linear: nn.Linear, *, out_idx=None, in_idx=None) -> None:
    """Keep rows ``out_idx`` and columns ``in_idx`` of a Linear, in place (same module object)."""
    w = linear.weight.data
    if out_idx is not None:
        w = w[out_idx]
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias.data[out_idx].clone())
        linear.out_features = len(out_idx)
    if in_idx is not None:
        w = w[:, in_idx]
        linear.in_features = len(in_idx)
    linear.weight = nn.Parameter(w.contiguous().clone())


def slice_norm(norm: nn.Module, idx: torch.Tensor) -> None:
    norm.weight = nn.Parameter(norm.weight.data[idx].clone())
    if getattr(norm, "bias", None) is not None:  # LayerNorm's
        norm.bias = nn.Parameter(norm.bias.data[idx].clone())
    if hasattr(norm, "normalized_shape"):  # nn.LayerNorm normalizes over this, not the weight's
        norm.normalized_shape = (len(idx),)


def fused_rows(parts: list[int], idx: list[torch.Tensor]) -> torch.Tensor:
    """Rows to keep of a fused linear whose rows stack parts of ``parts[i]`` rows each
    (``[q; k; v]`` or ``[gate; up]``), keeping rows ``idx[i]`` of part i."""
    offsets = [0, *torch.tensor(parts).cumsum(0).tolist()[:-1]]
    return torch.cat([off + i for off, i in zip(offsets, idx, strict=True)])


def calibrate(model: nn.Module, state: CompressionState, hooks: list, what: str) -> None:
    """Run the calibration batches through the model with the given (module, hook) pairs."""
    if state.calibration_batches is None:
        raise ConfigError(
            f"{what} with importance: activation needs calibration data: add a `calibration:` "
            "section to the recipe, or set importance: magnitude"
        )
    handles = []
    try:
        for module, fn, kind in hooks:
            if kind == "pre":
                handles.append(module.register_forward_pre_hook(fn, with_kwargs=True))
            else:
                handles.append(module.register_forward_hook(fn, with_kwargs=True))
        device = next(model.parameters()).device
        with torch.no_grad():
            batches = state.calibration_batches()
            desc = f"{what}: calibration forwards"
            for batch in tqdm(batches, desc=desc, disable=not state.progress):
                model(batch.to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()


def hidden_input(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def resolve_keep(
    cfg: PruneConfig,
    current: int,
    allowed: list[int],
    params_after: Callable[[int], int],
    what: str,
) -> int:
    """How many units to keep, from whichever target the config gives."""
    size = getattr(cfg, cfg.size_field)
    if size is not None:
        if size not in allowed and size != current:
            shown = ", ".join(map(str, allowed[:20])) + (" ..." if len(allowed) > 20 else "")
            raise ConfigError(
                f"{what}: {cfg.size_field}={size} is not expressible (currently {current}); "
                f"allowed values: {shown}"
            )
        return size
    if cfg.sparsity is not None:
        want = current * (1 - cfg.sparsity)
        return min(allowed, key=lambda k: (abs(k - want), -k))
    fits = [k for k in allowed if params_after(k) <= cfg.target_params]
    if not fits:
        smallest = min(allowed)
        raise ConfigError(
            f"{what}: target_params={cfg.target_params:,} is below what this structure allows: "
            f"the smallest {what} ({cfg.size_field}={smallest}) leaves "
            f"{params_after(smallest):,} parameters. Raise target_params or add another "
            "prune.* pass."
        )
    return max(fits)


def multiples_of(current: int, multiple_of: int, what: str) -> list[int]:
    allowed = list(range(multiple_of, current, multiple_of))
    if not allowed:
        raise ConfigError(
            f"{what}: multiple_of={multiple_of} leaves nothing to prune below {current}"
        )
    return allowed


def check_reloadable(
    model: nn.Module, arch: Arch, what: str, config_changes: dict, shapes: dict[str, tuple]
) -> None:
    """A ConfigError unless the family's own modeling, built (on meta) from the config with
    ``config_changes``, gives decoder layer 0's linears ``shapes`` ({path: (out, in)}): some
    families size a projection from a config field the pass does not change (Helium's o_proj is
    hidden x hidden, not hidden x heads * head_dim), and their pruned checkpoint would not
    reload. Checked before anything is sliced."""
    config = copy.deepcopy(model.config)
    for key, value in config_changes.items():
        setattr(config, key, value)
    with torch.device("meta"):
        fresh = type(model)(config)
    layer = decoder_layers(fresh, what)[0]
    wrong = []
    for path, (out, inp) in shapes.items():
        linear = layer.get_submodule(path)
        if (linear.out_features, linear.in_features) != (out, inp):
            wrong.append(f"{path} is {linear.out_features}x{linear.in_features}, not {out}x{inp}")
    if wrong:
        changes = ", ".join(f"{k}={v}" for k, v in config_changes.items())
        raise ConfigError(
            f"{what}: model_type {arch.model_type!r} builds its layers from {changes} with other "
            f"shapes than the pruned ones ({'; '.join(wrong)}): the pruned checkpoint would not "
            "reload, so this pass refuses the family. Prune MLP channels or layers instead"
        )


def finish_report(model: nn.Module, report: PassReport, params_before: int) -> PassReport:
    """Check the pruned model against a fresh model built from its config, then report."""
    with torch.device("meta"):
        fresh = type(model)(model.config)
    expected = {k: tuple(v.shape) for k, v in fresh.state_dict().items()}
    actual = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    diff = set(expected.items()) ^ set(actual.items())
    assert not diff, f"pruned model disagrees with its config: {sorted(diff)[:10]}"
    report.metrics.update(params_before=params_before, params_after=count_params(model))
    log.info(
        "%s: %s -> %s parameters",
        report.name,
        f"{params_before:,}",
        f"{report.metrics['params_after']:,}",
    )
    return report
