"""``prune.layers``: drop whole decoder layers by ShortGPT's block influence (mean
``1 - cos(input, output)``), or by weight magnitude.
"""

from __future__ import annotations

import torch
from torch import nn

from compress.arch import PER_LAYER_CONFIG_KEYS, arch_for
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
        writers = arch_for(model, "prune.layers").hidden_writers
        return torch.stack(
            [
                sum(lin.weight.detach().pow(2).sum() for lin in submodules(layer, writers)).sqrt()
                for layer in layers
            ]
        ).double()
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
    new_blocks = [blocks[i] for i in kept]
    for new_idx, block in enumerate(new_blocks):
        block.get_submodule(arch.attention).layer_idx = new_idx  # KV-cache slot
    parent, _, child = arch.layers.rpartition(".")
    setattr(model.get_submodule(parent), child, nn.ModuleList(new_blocks))
    config = model.config
    for key in PER_LAYER_CONFIG_KEYS:
        values = getattr(config, key, None)
        if values:
            setattr(config, key, [values[i] for i in kept])
    config.num_hidden_layers = keep
    report.changed.extend(f"{arch.layer_prefix}{i}" for i in removed)
    report.metrics.update(
        layers_before=current,
        layers_after=keep,
        removed_layers=removed,
        scores=[round(float(s), 6) for s in scores],
    )
    return finish_report(model, report, before)
