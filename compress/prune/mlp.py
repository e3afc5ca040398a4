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
    check_reloadable,
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
    current = getattr(model.config, arch.mlp_width_key)
    before = count_params(model)
    # parameters of one channel in one layer: a row of each reader (two of a fused [gate; up])
    # and a column of each writer, with their biases
    group, first = arch.mlp_channels, layers[0]
    per_channel = sum(
        (2 if path in group.fused else 1) * (lin.in_features + (lin.bias is not None))
        for path, lin in zip(group.rows + group.fused, submodules(first, group.rows + group.fused),
                             strict=True)  # fmt: skip
    ) + sum(lin.out_features for lin in submodules(first, group.cols))
    allowed = multiples_of(current, cfg.multiple_of, "prune.mlp_channels")
    keep = resolve_keep(
        cfg,
        current,
        allowed,
        lambda k: before - (current - k) * per_channel * len(layers),
        "prune.mlp_channels",
    )
    report = PassReport("prune.mlp_channels", metrics={"importance": cfg.importance})
    if keep == current:
        return finish_report(model, report, before)
    shapes = {p: (keep * (2 if p in group.fused else 1), lin.in_features) for p, lin in
              zip(group.rows + group.fused, submodules(first, group.rows + group.fused),
                  strict=True)}  # fmt: skip
    shapes |= {p: (lin.out_features, keep) for p, lin in
               zip(group.cols, submodules(first, group.cols), strict=True)}  # fmt: skip
    check_reloadable(model, arch, "prune.mlp_channels", {arch.mlp_width_key: keep}, shapes)
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
    setattr(model.config, arch.mlp_width_key, keep)
    report.metrics.update(intermediate_before=current, intermediate_after=keep)
    return finish_report(model, report, before)
