"""``prune.hidden_size``: drop residual (hidden) channels everywhere they appear, scored by the
mean |activation| after every RMSNorm; Gemma's embedding factor and post-norms follow.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from compress.arch import Arch, head_dim_of, set_embedding_scale
from compress.core.errors import ConfigError
from compress.core.registry import CompressionState, PassReport, register_pass
from compress.prune.config import (
    HiddenSizeConfig,
)
from compress.prune.slicing import (
    calibrate,
    check_reloadable,
    checked_layers,
    count_params,
    finish_report,
    multiples_of,
    resolve_keep,
    slice_linear,
    slice_norm,
    submodules,
)


def _norms(model: nn.Module, arch: Arch, layers: nn.ModuleList) -> list[nn.Module]:
    out = [m for layer in layers for m in submodules(layer, arch.layer_norms)]
    return out + [model.get_submodule(arch.final_norm)]


def _hidden_scores(model, arch, layers, cfg, state) -> torch.Tensor:
    embed = model.get_input_embeddings().weight.detach()
    if cfg.importance == "magnitude":
        total = embed.pow(2).sum(0)
        for layer in layers:
            for lin in submodules(layer, arch.hidden_readers):
                total = total + lin.weight.detach().pow(2).sum(0)
            for lin in submodules(layer, arch.hidden_writers):
                total = total + lin.weight.detach().pow(2).sum(1)
        return total.sqrt()
    total = torch.zeros(embed.shape[1], dtype=torch.float64)

    def hook(module, args, kwargs, output):
        nonlocal total
        total += output.detach().float().abs().mean(dim=(0, 1)).double().cpu()  # [B, T, H] -> [H]

    calibrate(
        model, state, [(n, hook, "post") for n in _norms(model, arch, layers)], "prune.hidden_size"
    )
    return total


@torch.no_grad()
def scale_post_norms(layers: nn.ModuleList, arch: Arch, ratio: float) -> None:
    """Multiply every post-norm's output by ``ratio``. With the embedding factor changed by the
    same ratio, the whole residual stream is scaled by it (in Gemma every block writes through a
    post-norm), and the pre-norms and the final norm are invariant to that scale (up to eps), so
    the pruned model keeps its function with the factor a reload computes from hidden_size."""
    for norm in (n for layer in layers for n in submodules(layer, arch.post_norms)):
        if arch.norm_form == "1+w":
            norm.weight.copy_((1 + norm.weight.float()) * ratio - 1)
        else:
            norm.weight.mul_(ratio)


@register_pass("prune.hidden_size", HiddenSizeConfig)
def prune_hidden_size(
    model: nn.Module, cfg: HiddenSizeConfig, state: CompressionState
) -> PassReport:
    arch, layers = checked_layers(model, "prune.hidden_size")
    if arch.embed_scaling != "none" and len(arch.post_norms) != 2:
        raise ConfigError(
            f"prune.hidden_size: model_type {arch.model_type!r} scales its embedding by "
            "sqrt(hidden_size) but not every block writes through a post-norm, so the changed "
            "factor cannot be compensated; prune heads, MLP channels or layers instead"
        )
    config = model.config
    current = config.hidden_size
    before = count_params(model)
    # parameters per hidden channel in one layer: its norms, and one column of every reader and
    # one row of every writer
    per_layer = (
        len(arch.layer_norms)
        + sum(lin.out_features for lin in submodules(layers[0], arch.hidden_readers))
        + sum(lin.in_features for lin in submodules(layers[0], arch.hidden_writers))
    )
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    vocab = config.vocab_size
    per_channel = per_layer * len(layers) + 1 + vocab * (1 if tied else 2)
    # hidden_size must stay a multiple of num_attention_heads (LlamaConfig's validation).
    step = math.lcm(cfg.multiple_of, config.num_attention_heads)
    allowed = multiples_of(current, step, "prune.hidden_size")
    keep = resolve_keep(
        cfg, current, allowed, lambda k: before - (current - k) * per_channel, "prune.hidden_size"
    )
    report = PassReport("prune.hidden_size", metrics={"importance": cfg.importance})
    if keep == current:
        return finish_report(model, report, before)
    head_dim = head_dim_of(layers[0])
    shapes = {p: (lin.out_features, keep) for p, lin in
              zip(arch.hidden_readers, submodules(layers[0], arch.hidden_readers), strict=True)}
    shapes |= {p: (keep, lin.in_features) for p, lin in
               zip(arch.hidden_writers, submodules(layers[0], arch.hidden_writers), strict=True)}
    check_reloadable(model, arch, "prune.hidden_size", dict(hidden_size=keep, head_dim=head_dim),
                     shapes)  # fmt: skip
    idx = _hidden_scores(model, arch, layers, cfg, state).topk(keep).indices.sort().values
    embed = model.get_input_embeddings()
    embed.weight = nn.Parameter(embed.weight.data[:, idx].contiguous().clone())
    embed.embedding_dim = keep
    head = model.get_output_embeddings()
    if tied:
        head.weight = embed.weight  # keep the tie: one Parameter object
    else:
        slice_linear(head, in_idx=idx)
    head.in_features = keep
    for norm in _norms(model, arch, layers):
        slice_norm(norm, idx)
    for layer in layers:
        for lin in submodules(layer, arch.hidden_readers):
            slice_linear(lin, in_idx=idx)
        for lin in submodules(layer, arch.hidden_writers):
            slice_linear(lin, out_idx=idx)
    config.head_dim = head_dim  # attention width is independent of the residual width now
    config.hidden_size = keep
    ratio = set_embedding_scale(model, arch)  # Gemma: sqrt(hidden_size), what a reload builds
    if ratio != 1.0:
        scale_post_norms(layers, arch, ratio)
        report.metrics["embedding_scale_ratio"] = ratio
    report.changed.append("all hidden-size tensors")
    report.metrics.update(hidden_before=current, hidden_after=keep)
    return finish_report(model, report, before)
