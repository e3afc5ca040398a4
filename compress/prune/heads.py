"""``prune.attention_heads``: drop whole KV groups (with their query heads) or query heads,
scored by the per-head L2 norm of the attention output before the output projection.
"""

from __future__ import annotations

import torch
from torch import nn

from compress.arch import Arch
from compress.core.errors import ConfigError
from compress.core.registry import CompressionState, PassReport, register_pass
from compress.prune.config import (
    AttentionHeadsConfig,
)
from compress.prune.slicing import (
    calibrate,
    check_reloadable,
    checked_layers,
    count_params,
    finish_report,
    fused_rows,
    hidden_input,
    resolve_keep,
    slice_linear,
    slice_norm,
    submodules,
)


def _head_scores(model, arch, layers, cfg, state, n_heads, head_dim) -> list[torch.Tensor]:
    """[n_heads] importance per layer: magnitude of the per-query-head rows and columns, or the
    norm of each head's output at the input of the output projection."""
    (o_name,) = arch.heads.cols
    if cfg.importance == "magnitude":
        scores = []
        for layer in layers:
            # q rows: the q projection, or the first H * D rows of a fused [q; k; v]
            q_w = layer.get_submodule((arch.heads.rows + arch.heads.fused)[0]).weight
            q_w, o_w = q_w[: n_heads * head_dim], layer.get_submodule(o_name).weight
            q = q_w.detach().view(n_heads, head_dim, -1).pow(2).sum((1, 2))
            o = o_w.detach().view(-1, n_heads, head_dim).pow(2).sum((0, 2))
            scores.append((q + o).sqrt())
        return scores
    sums = [torch.zeros(n_heads, dtype=torch.float64) for _ in layers]

    def hook_for(i):
        def hook(module, args, kwargs):
            x = hidden_input(args, kwargs).detach().float()  # [B, T, H*D]
            x = x.view(*x.shape[:-1], n_heads, head_dim)  # -> [B, T, H, D]
            sums[i] += x.norm(dim=-1).mean(dim=(0, 1)).double().cpu()

        return hook

    hooks = [(layer.get_submodule(o_name), hook_for(i), "pre") for i, layer in enumerate(layers)]
    calibrate(model, state, hooks, "prune.attention_heads")
    return sums


def _slice_heads(
    layer: nn.Module,
    arch: Arch,
    q_rows: torch.Tensor,
    kv_rows: torch.Tensor,
    *,
    q_dim: int,
    kv_dim: int,
) -> None:
    """Keep q rows ``q_rows`` (of ``q_dim`` = H * D) and k/v rows ``kv_rows`` (of ``kv_dim``) in
    every part of the layer's attention, and the attention module's head counts in step."""
    for lin in submodules(layer, arch.heads.rows):
        slice_linear(lin, out_idx=q_rows)
    for lin in submodules(layer, arch.heads.kv_rows):
        slice_linear(lin, out_idx=kv_rows)
    for lin in submodules(layer, arch.heads.fused):  # [q; k; v]
        slice_linear(lin, out_idx=fused_rows([q_dim, kv_dim, kv_dim], [q_rows, kv_rows, kv_rows]))
    for lin in submodules(layer, arch.heads.cols):
        slice_linear(lin, in_idx=q_rows)
    if arch.qk_norm_span == "heads":  # OLMo2: q_norm over all H * D, k_norm over KVH * D
        q_norm, k_norm = submodules(layer, arch.qk_norms)
        slice_norm(q_norm, q_rows)
        slice_norm(k_norm, kv_rows)
    # per-head q/k norms ([head_dim], Qwen3, Gemma3) are shared by the heads: unchanged
    attention = layer.get_submodule(arch.attention)
    head_dim = attention.head_dim
    if arch.attention_sinks:  # one logit per query head: the kept heads' (GPT-OSS, Granite SWA)
        owner, _, name = arch.attention_sinks.rpartition(".")
        module = layer.get_submodule(owner)
        sinks = getattr(module, name)
        heads = q_rows.reshape(-1, head_dim)[:, 0] // head_dim
        setattr(module, name, nn.Parameter(sinks.detach()[heads.to(sinks.device)].clone(),
                                           requires_grad=sinks.requires_grad))
    attention.num_key_value_groups = len(q_rows) // len(kv_rows)
    if hasattr(attention, "num_key_value_heads"):  # Phi-3 splits its fused output with it
        attention.num_key_value_heads = len(kv_rows) // head_dim


@register_pass("prune.attention_heads", AttentionHeadsConfig)
def prune_attention_heads(
    model: nn.Module, cfg: AttentionHeadsConfig, state: CompressionState
) -> PassReport:
    arch, layers = checked_layers(model, "prune.attention_heads")
    if arch.qkv_per_head:
        raise ConfigError(
            f"prune.attention_heads: model_type {arch.model_type!r} fuses q/k/v per head in one "
            f"linear ({arch.q}); slicing that layout is not implemented. Prune MLP channels or "
            "layers instead"
        )
    config = model.config
    n_heads, n_kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = layers[0].get_submodule(arch.attention).head_dim
    group = n_heads // n_kv
    hidden, n_layers = config.hidden_size, len(layers)
    before = count_params(model)
    per_q = 2 * hidden * head_dim * n_layers  # q rows + o columns of one query head, all layers
    if cfg.mode == "kv_groups":
        allowed = [g * group for g in range(1, n_kv)]

        def params_after(k):
            return before - (n_heads - k) * per_q - (n_kv - k // group) * per_q
    else:
        allowed = [m * n_kv for m in range(1, group)]

        def params_after(k):
            return before - (n_heads - k) * per_q

    # transformers' LlamaConfig rejects hidden_size % num_attention_heads != 0 even with an
    # explicit head_dim, so only such head counts give a loadable checkpoint.
    allowed = [k for k in allowed if hidden % k == 0]
    if not allowed:
        raise ConfigError(
            f"prune.attention_heads: mode {cfg.mode} cannot prune {n_heads} heads / {n_kv} KV "
            f"heads (group size {group}, hidden {hidden}); try the other mode (kv_groups or "
            "query_heads)"
        )
    keep = resolve_keep(cfg, n_heads, allowed, params_after, "prune.attention_heads")
    kv_after = keep // group if cfg.mode == "kv_groups" else n_kv
    if keep != n_heads:
        layer = layers[0]
        shapes = {p: (keep * head_dim, hidden) for p in arch.heads.rows}
        shapes |= {p: (kv_after * head_dim, hidden) for p in arch.heads.kv_rows}
        shapes |= {p: ((keep + 2 * kv_after) * head_dim, hidden) for p in arch.heads.fused}
        shapes |= {p: (layer.get_submodule(p).out_features, keep * head_dim)
                   for p in arch.heads.cols}  # fmt: skip
        changes = dict(head_dim=head_dim, num_attention_heads=keep, num_key_value_heads=kv_after)
        check_reloadable(model, arch, "prune.attention_heads", changes, shapes)
    report = PassReport(
        "prune.attention_heads", metrics={"importance": cfg.importance, "mode": cfg.mode}
    )
    if keep == n_heads:
        return finish_report(model, report, before)
    scores = _head_scores(model, arch, layers, cfg, state, n_heads, head_dim)
    for i, layer in enumerate(layers):
        by_group = scores[i].view(n_kv, group)  # query heads h = g * group + j share KV head g
        if cfg.mode == "kv_groups":
            kv_keep = by_group.sum(1).topk(keep // group).indices.sort().values
            q_keep = (kv_keep[:, None] * group + torch.arange(group)).flatten()
        else:
            kv_keep = torch.arange(n_kv)
            within = by_group.topk(keep // n_kv, dim=1).indices.sort(dim=1).values
            q_keep = (torch.arange(n_kv)[:, None] * group + within).flatten()
        q_rows = (q_keep[:, None] * head_dim + torch.arange(head_dim)).flatten()
        kv_rows = (kv_keep[:, None] * head_dim + torch.arange(head_dim)).flatten()
        _slice_heads(layer, arch, q_rows, kv_rows, q_dim=n_heads * head_dim, kv_dim=n_kv * head_dim)
        report.changed.append(f"{arch.layer_prefix}{i}.{arch.attention}")
    config.head_dim = head_dim  # explicit, so hidden_size // num_attention_heads is never used
    config.num_attention_heads = keep
    config.num_key_value_heads = kv_after
    report.metrics.update(
        heads_before=n_heads, heads_after=keep, kv_heads_after=config.num_key_value_heads
    )
    return finish_report(model, report, before)
