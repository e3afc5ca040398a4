"""``prune.layers``: drop whole decoder layers by ShortGPT's block influence (mean
``1 - cos(input, output)``), or by weight magnitude.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from compress.arch import (
    PER_LAYER_CONFIG_KEYS,
    Arch,
    arch_for,
    decoder_layers,
    dense_layer_settings,
    is_sparse,
    layer_arch,
)
from compress.core.errors import ConfigError
from compress.core.registry import CompressionState, PassReport, register_pass
from compress.prune.config import (
    LayersConfig,
)
from compress.prune.slicing import (
    calibrate,
    checked_layers,
    count_params,
    finish_report,
    hidden_input,
    resolve_keep,
    submodules,
)


def layer_scores(
    model: nn.Module, layers: nn.ModuleList, cfg: LayersConfig, state: CompressionState
) -> torch.Tensor:
    """[n_layers] importance; low = the layer changes its input least (safest to drop)."""
    if cfg.importance == "magnitude":
        return torch.stack([_writer_norm(layer, arch_for(model, "prune.layers"))
                            for layer in layers]).double()
    sums = torch.zeros(len(layers), dtype=torch.float64)

    def hook_for(i):
        def hook(module, args, kwargs, output):
            x = hidden_input(args, kwargs).detach().float()
            y = (output[0] if isinstance(output, tuple) else output).detach().float()
            cos = nn.functional.cosine_similarity(x, y, dim=-1)  # [B, T]
            sums[i] += float((1 - cos).mean())

        return hook

    hooks = [(layer, hook_for(i), "post") for i, layer in enumerate(layers)]
    calibrate(model, state, hooks, "prune.layers")
    return sums


def _writer_norm(layer: nn.Module, arch: Arch) -> torch.Tensor:
    """Frobenius norm of everything ``layer`` writes to the residual stream with: its
    (``layer_arch``'s) writers' weights, an MoE block's every expert's down projection."""
    arch = layer_arch(arch, layer)
    total = torch.zeros((), dtype=torch.float64)
    for path, module in zip(arch.hidden_writers, submodules(layer, arch.hidden_writers),
                            strict=True):
        weight = getattr(module, arch.moe.down) if arch.moe and path == arch.moe.fused \
            else module.weight
        total += weight.detach().double().pow(2).sum()
    return total.sqrt()


def _kept_config(model: nn.Module, arch: Arch, blocks: nn.ModuleList,
                 kept: list[int]) -> dict[str, object]:
    """The config changes that describe the ``kept`` layers: their per-layer entries
    (``PER_LAYER_CONFIG_KEYS``), their count and, for an MoE model, the settings that say which
    of them are dense (``dense_layer_settings``). A ConfigError before anything changes when
    the family's own modeling, built from them (on meta), would make other layers dense."""
    changes: dict[str, object] = {"num_hidden_layers": len(kept)}
    for key in PER_LAYER_CONFIG_KEYS:
        values = getattr(model.config, key, None)
        if values:
            changes[key] = [values[i] for i in kept]
    if arch.moe is None:
        return changes
    wanted = [is_sparse(blocks[i], arch) for i in kept]
    changes.update(dense_layer_settings(model.config, wanted))
    config = copy.deepcopy(model.config)
    for key, value in changes.items():
        setattr(config, key, value)
    with torch.device("meta"):
        built = [is_sparse(layer, arch) for layer in decoder_layers(type(model)(config))]
    if built != wanted:
        dense = [i for i, s in zip(kept, wanted, strict=True) if not s]
        raise ConfigError(
            f"prune.layers: keeping layers {kept} leaves dense layers {dense} in an order that "
            f"this {arch.model_type!r} config cannot describe (its layers would be rebuilt with "
            "other MLPs and the checkpoint would not reload). Drop other layers (a smaller "
            "sparsity, or importance: magnitude) or keep its dense layers"
        )
    return changes


@register_pass("prune.layers", LayersConfig)
def prune_layers(model: nn.Module, cfg: LayersConfig, state: CompressionState) -> PassReport:
    arch, blocks = checked_layers(model, "prune.layers", whole_layers=True)
    current = len(blocks)
    before = count_params(model)
    per_layer = sum(p.numel() for p in blocks[0].parameters())
    keep = resolve_keep(
        cfg,
        current,
        list(range(1, current)),
        lambda k: before - (current - k) * per_layer,
        "prune.layers",
    )
    report = PassReport("prune.layers", metrics={"importance": cfg.importance})
    if keep == current:
        return finish_report(model, report, before)
    scores = layer_scores(model, blocks, cfg, state)
    kept = scores.topk(keep).indices.sort().values.tolist()
    removed = [i for i in range(current) if i not in kept]
    changes = _kept_config(model, arch, blocks, kept)  # every refusal before any change
    new_blocks = [blocks[i] for i in kept]
    for new_idx, block in enumerate(new_blocks):
        block.get_submodule(arch.attention).layer_idx = new_idx  # KV-cache slot
    parent, _, child = arch.layers.rpartition(".")
    setattr(model.get_submodule(parent), child, nn.ModuleList(new_blocks))
    for key, value in changes.items():
        setattr(model.config, key, value)
    report.changed.extend(f"{arch.layer_prefix}{i}" for i in removed)
    report.metrics.update(
        layers_before=current,
        layers_after=keep,
        removed_layers=removed,
        scores=[round(float(s), 6) for s in scores],
    )
    return finish_report(model, report, before)
