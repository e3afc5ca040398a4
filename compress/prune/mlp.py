"""``prune.mlp_channels``: drop MLP channels (gate/up rows and down columns), scored by the
mean |activation| at the input of the down projection.
"""

from __future__ import annotations

import torch
from torch import nn

from compress.core.registry import CompressionState, PassReport, register_pass
from compress.prune.config import (
    MlpChannelsConfig,
)
from compress.prune.slicing import (
    calibrate,
    checked_layers,
    count_params,
    finish_report,
    fused_rows,
    hidden_input,
    multiples_of,
    resolve_keep,
    slice_linear,
    submodules,
)


def _channel_scores(model, arch, layers, cfg, state) -> list[torch.Tensor]:
    group = arch.mlp_channels
    (down,) = group.cols
    if cfg.importance == "magnitude":
        scores = []
        for layer in layers:
            rows = [lin.weight.detach().pow(2).sum(1) for lin in submodules(layer, group.rows)]
            # a fused [gate; up]: the two halves' rows of one channel add up
            rows += [
                lin.weight.detach().pow(2).sum(1).view(2, -1).sum(0)
                for lin in submodules(layer, group.fused)
            ]
            cols = [lin.weight.detach().pow(2).sum(0) for lin in submodules(layer, group.cols)]
            scores.append(sum(rows + cols).sqrt())
        return scores
    sums = [
        torch.zeros(layer.get_submodule(down).in_features, dtype=torch.float64) for layer in layers
    ]

    def hook_for(i):
        def hook(module, args, kwargs):
            x = hidden_input(args, kwargs).detach().float()  # [B, T, I]
            sums[i] += x.abs().mean(dim=(0, 1)).double().cpu()

        return hook

    hooks = [(layer.get_submodule(down), hook_for(i), "pre") for i, layer in enumerate(layers)]
    calibrate(model, state, hooks, "prune.mlp_channels")
    return sums


@register_pass("prune.mlp_channels", MlpChannelsConfig)
def prune_mlp_channels(
    model: nn.Module, cfg: MlpChannelsConfig, state: CompressionState
) -> PassReport:
    arch, layers = checked_layers(model, "prune.mlp_channels")
    current, hidden = model.config.intermediate_size, model.config.hidden_size
    before = count_params(model)
    allowed = multiples_of(current, cfg.multiple_of, "prune.mlp_channels")
    keep = resolve_keep(
        cfg,
        current,
        allowed,
        lambda k: before - (current - k) * 3 * hidden * len(layers),
        "prune.mlp_channels",
    )
    report = PassReport("prune.mlp_channels", metrics={"importance": cfg.importance})
    if keep == current:
        return finish_report(model, report, before)
    scores = _channel_scores(model, arch, layers, cfg, state)
    for i, layer in enumerate(layers):
        idx = scores[i].topk(keep).indices.sort().values
        for lin in submodules(layer, arch.mlp_channels.rows):
            slice_linear(lin, out_idx=idx)
        for lin in submodules(layer, arch.mlp_channels.fused):  # [gate; up]
            slice_linear(lin, out_idx=fused_rows([current, current], [idx, idx]))
        for lin in submodules(layer, arch.mlp_channels.cols):
            slice_linear(lin, in_idx=idx)
        mlp = arch.mlp_channels.cols[0].rpartition(".")[0]  # the MLP module holding them
        report.changed.append(f"{arch.layer_prefix}{i}.{mlp}")
    model.config.intermediate_size = keep
    report.metrics.update(intermediate_before=current, intermediate_after=keep)
    return finish_report(model, report, before)
