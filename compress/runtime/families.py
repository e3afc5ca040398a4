"""The arithmetic that differs between the families the runtime runs (``runtime/engine.py``),
driven by each family's ``compress.arch.RuntimeSpec`` and its transformers config: which
configs it can run, sliding-window masks, per-layer-type rope tables, Gemma 2's softcapped
attention, embedding multipliers. Everything here matches transformers' own computation in
fp32 (``tests/runtime/test_runtime_families.py``); it knows no module names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compress.arch import Arch, RuntimeSpec


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# MLP activations by the names transformers' configs use (gelu_pytorch_tanh: Gemma's).
ACTIVATIONS = {  # transformers' ACT2FN names
    "silu": F.silu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,  # the same function, an older name
    "gelu": F.gelu,
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),
}
LAYER_TYPES = ("full_attention", "sliding_attention")


def config_unsupported_reason(config, spec: RuntimeSpec,
                              max_seq_len: int | None = None) -> str | None:
    """Why the runtime cannot run a supported family with this ``config``, or None; with
    ``max_seq_len``, also what it cannot run at that many positions (None: not checked)."""
    act = getattr(config, spec.activation_key, "silu")
    if act not in ACTIVATIONS and not spec.activation_module:
        return f"{spec.activation_key} {act!r} is not one of {tuple(ACTIVATIONS)}"
    for rope in rope_settings(config):
        kind = rope.get("rope_type", rope.get("type"))
        if kind == "dynamic" and spec.dynamic_alpha_is_static and rope.get("alpha"):
            continue  # the family's NTK-alpha: tables fixed by alpha (RuntimeSpec says)
        if kind in ("dynamic", "longrope"):
            return f"rope_type {kind!r} depends on the sequence length"
        beta, limit = rope.get("llama_4_scaling_beta"), rope.get("original_max_position_embeddings")
        if beta and max_seq_len is not None and (limit is None or max_seq_len > limit):
            # Ministral 3 multiplies queries by 1 + beta * log(1 + floor(position / limit)):
            # exactly 1 below the limit, which a runtime of at most that many positions keeps
            return (f"llama_4_scaling_beta={beta}: queries at positions {limit} and beyond are "
                    f"scaled by position, which the runtime does not apply (max_seq_len "
                    f"{max_seq_len} reaches them)")
    d, r = head_dim_of_config(config), rotary_dim(config)
    if not (0 < r <= d and r % 2 == 0):  # (factor 2 indexed past the head: an IndexError)
        return (f"partial_rotary_factor rotates {r} channels of a {d}-channel head (an even "
                f"number in 2..{d} runs)")
    other = set(getattr(config, "layer_types", None) or ()) - set(LAYER_TYPES)
    if other:
        return f"layer_types {sorted(other)} (only {LAYER_TYPES} are run)"
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention=True (the runtime's attention is causal)"
    variant = "(a variant of the family the runtime does not run)"
    for flag in spec.required_flags:
        if not getattr(config, flag, True):
            return f"{flag}={getattr(config, flag)!r} {variant}"
    for key in spec.hidden_size_keys:
        value = getattr(config, key, None)
        if value is not None and value != config.hidden_size:
            return (f"{key}={value} differs from hidden_size={config.hidden_size} (a projection "
                    "into and out of the decoder stack, which the runtime does not run)")
    for flag in spec.unsupported_flags:
        if getattr(config, flag, False):
            value = getattr(config, flag)
            return f"{flag}={value!r} {variant}"
    return None


def rope_settings(config) -> list[dict]:
    """Every rope settings dict of ``config``: ``rope_scaling``, and ``rope_parameters`` either
    flat or per layer type (Gemma 3)."""
    found = [getattr(config, "rope_scaling", None) or {}]
    params = getattr(config, "rope_parameters", None) or {}
    found += [v for v in params.values() if isinstance(v, dict)] or [params]
    return found


def explicit_attention(q, k, v, mask, scale: float, cap: float | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with what SDPA cannot do: ``cap * tanh(scores / cap)`` before masking (Gemma
    2), and ``sinks`` [H], a logit per head that joins each softmax and is dropped after it
    (GPT-OSS: the weights over the keys sum to less than 1). q [B, H, T, D], k/v
    [B, Hkv, S, D], mask bool broadcastable to [B, H, T, S]."""
    groups = q.shape[1] // k.shape[1]
    # [B, Hkv, S, D] -> [B, H, S, D]: query head h reads KV head h // groups
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3))
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(scores.softmax(-1).to(v.dtype), v)
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    weights = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    return torch.matmul(weights.to(v.dtype), v)


def layer_window(config, i: int) -> int | None:
    """Layer ``i``'s sliding window (keys at most window - 1 slots behind the query), or None.
    Without ``layer_types`` (Mistral) a set ``sliding_window`` holds for every layer."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if window is None or (types is not None and types[i] != "sliding_attention"):
        return None
    return int(window)


def config_value(config, key: str | None) -> float | None:
    value = None if key is None else getattr(config, key, None)
    return None if value is None else float(value)


def embed_factor(
    config, arch: Arch, spec: RuntimeSpec, dtype: torch.dtype
) -> torch.Tensor | float | None:
    """The embedding multiplier as transformers applies it: Gemma's sqrt(hidden) as a tensor
    rounded to the model dtype first, Granite's config float as a Python scalar."""
    if arch.embed_scaling == "sqrt_hidden":
        return torch.tensor(config.hidden_size**0.5).to(dtype)
    return config_value(config, spec.embed_multiplier)


NO_ROPE = "no_rope"  # the rope key of a layer whose q/k are not rotated (SmolLM3's NoPE)


def layer_rope_key(config, arch: Arch, spec: RuntimeSpec, i: int) -> str | None:
    """Which rope table layer ``i`` takes: ``NO_ROPE`` (every layer of a family without a
    rotary module: OPT), its layer type where each type has its own base (Gemma 3's local vs
    global), its own base where the config lists one per layer (Granite SWA), else None (the
    model's one table)."""
    if not arch.rotary:
        return NO_ROPE
    if spec.rope_layers is not None and not getattr(config, spec.rope_layers)[i]:
        return NO_ROPE
    if spec.rope_theta_layers is not None:  # its own base, or none
        theta = getattr(config, spec.rope_theta_layers)[i]
        return _theta_key(theta) if theta else NO_ROPE
    sliding = getattr(config, "sliding_window", None) is not None
    if spec.rope_only_sliding and sliding and config.layer_types[i] != "sliding_attention":
        return NO_ROPE
    return config.layer_types[i] if spec.rope_per_layer_type else None


def _theta_key(theta) -> str:
    """The rope table key of a layer whose RoPE base is ``theta`` (Granite SWA)."""
    return f"rope_theta={float(theta)}"


def head_dim_of_config(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_heads_of(config, arch: Arch) -> int:
    """Key/value heads per layer: the config's ``Arch.kv_heads_key`` (unset: as many as query
    heads); every head's own where the family has no GQA (GPT-NeoX, OPT: a
    ``num_key_value_heads`` in their configs is not read by their modeling)."""
    heads = config.num_attention_heads
    key = arch.kv_heads_key
    return (getattr(config, key, None) if key else None) or heads


def rotary_dim(config) -> int:
    """How many channels of a head RoPE rotates: ``partial_rotary_factor`` of them (Phi-4-mini
    0.75, GLM 0.5), the first ones; all by default."""
    factors = [r["partial_rotary_factor"] for r in rope_settings(config)
               if r.get("partial_rotary_factor") is not None]
    factor = factors[0] if factors else getattr(config, "partial_rotary_factor", None)
    return int(head_dim_of_config(config) * (1.0 if factor is None else factor))


def rope_permutation(config, spec: RuntimeSpec) -> torch.Tensor | None:
    """The order of a head's q/k channels in which the runtime's rotation (pairs ``(i, i + D/2)``
    over the whole head, ``_rotate``) is the family's RoPE, or None where it already is.

    The family rotates pairs ``(i, i + r/2)`` of its first ``r`` channels (``rotary_dim``), or
    ``(2i, 2i + 1)`` where interleaved (ERNIE 4.5, GLM), and passes the rest through. Slots
    ``i`` and ``D/2 + i`` get pair ``i``; the passed channels fill the other slots, whose table
    entries are cos 1, sin 0 (``rope_tables``). q and k take the same order, so their dot
    products, the attention, are the family's; v keeps its own."""
    d, r = head_dim_of_config(config), rotary_dim(config)
    firsts = range(0, r, 2) if spec.rope_interleaved else range(r // 2)
    seconds = range(1, r, 2) if spec.rope_interleaved else range(r // 2, r)
    passed = list(range(r, d))
    pad = d // 2 - r // 2
    order = torch.tensor([*firsts, *passed[:pad], *seconds, *passed[pad:]])
    return None if torch.equal(order, torch.arange(d)) else order


class UnsupportedRope(ValueError):
    """The model's rotary module and its config disagree on the rotated channels (a Llama
    config with ``partial_rotary_factor``, which Llama's module does not read)."""


def rope_reason(model: nn.Module, arch: Arch, spec: RuntimeSpec) -> str | None:
    """Why ``rope_tables`` cannot lay out this model's rotary tables, or None (one position is
    built: cheap, and before the runtime takes any layer's weights)."""
    try:
        rope_tables(model, arch, spec, 1)
    except UnsupportedRope as exc:
        return str(exc)
    return None


def rope_tables(model: nn.Module, arch: Arch, spec: RuntimeSpec, max_seq_len: int) -> dict:
    """cos/sin tables [S, D] fp32 for every cache position, from the model's own rotary module
    so that its rope type and attention scaling carry over; keyed by ``layer_rope_key``.
    ``NO_ROPE``'s table is cos 1, sin 0: rotating by it returns q and k exactly. A module's
    table over ``r < D`` channels (partial RoPE) is laid out for ``rope_permutation``: its
    pair ``i`` at slots ``i`` and ``D/2 + i``, cos 1 and sin 0 on the other slots."""
    device = model.get_input_embeddings().weight.device
    pos = torch.arange(max_seq_len, device=device)[None]
    x = torch.zeros(1, device=device)
    config = model.config
    d, r = head_dim_of_config(config), rotary_dim(config)
    keys = {layer_rope_key(config, arch, spec, i) for i in range(config.num_hidden_layers)}
    tables = {}
    for key in keys:
        if key == NO_ROPE:
            ones = torch.ones(max_seq_len, d, device=device)
            tables[key] = (ones, torch.zeros_like(ones))
            continue
        rotary, kind = model.get_submodule(arch.rotary), key
        if spec.rope_theta_layers is not None:  # the module of this key's base
            rotary = next(m for m in rotary
                          if _theta_key(m.config.rope_parameters["rope_theta"]) == key)
            kind = None
        angles = rotary(x, pos) if kind is None else rotary(x, pos, kind)
        if isinstance(angles, torch.Tensor) and angles.is_complex():
            # one complex number per pair (DeepSeek-V2's freqs_cis, attention scaling included):
            # its real and imaginary parts are cos and sin, laid out as cat(f, f)
            angles = tuple(torch.cat([part] * 2, -1) for part in (angles.real, angles.imag))
        cos, sin = angles
        cos, sin = cos[0].float(), sin[0].float()
        if spec.rope_table_interleaved:  # [f0, f0, f1, f1, ...] -> cat(f, f)
            cos, sin = (torch.cat([t[:, 0::2]] * 2, 1) for t in (cos, sin))
        elif cos.shape[-1] * 2 == r:  # one angle per pair (GPT-OSS's tables): f -> cat(f, f)
            cos, sin = (torch.cat([t] * 2, 1) for t in (cos, sin))
        if cos.shape[-1] != r:
            raise UnsupportedRope(
                f"the rotary module's tables cover {cos.shape[-1]} channels of a head, the "
                f"config's partial_rotary_factor says {r} (head_dim {d})"
            )
        if r < d:  # the module's [cat(f, f)] halves (f: the r/2 pair angles) -> D slots
            half, full = r // 2, torch.ones(max_seq_len, d, device=device)
            cos = full.index_copy(1, _slots(d, half), torch.cat([cos[:, :half]] * 2, 1))
            sin = torch.zeros_like(full).index_copy(1, _slots(d, half),
                                                    torch.cat([sin[:, :half]] * 2, 1))
        tables[key] = (cos, sin)
    return tables


def _slots(d: int, half: int) -> torch.Tensor:
    """The slots of ``rope_permutation``'s rotated pairs: 0..half-1 and D/2..D/2+half-1."""
    return torch.cat([torch.arange(half), torch.arange(d // 2, d // 2 + half)])


def window_mask(mask: torch.Tensor | None, slots: torch.Tensor, window: int) -> torch.Tensor:
    """``mask`` [B, 1, T, L] (or [B, 1, 1, L]; None: causal over the queries' own keys, L = T,
    as ``_Layer.attend`` reads it) with keys ``window`` or more slots behind their query cut
    (transformers' ``kv_idx > q_idx - sliding_window``). Slot distance is token distance for
    every row: left padding shifts a row's queries and keys alike."""
    keys = torch.arange(len(slots) if mask is None else mask.shape[-1], device=slots.device)
    near = keys[None, :] > slots[:, None] - window  # [T, L]
    if mask is None:
        return (near & (keys[None, :] <= slots[:, None]))[None, None]
    return mask & near
