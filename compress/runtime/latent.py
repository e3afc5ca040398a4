"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Moonlight: ``Arch.latent_attention``)
in the runtime's layer.

The reference is transformers' attention of the family, which expands the cached latent into
per-head keys and values at every step. This layer does the same expansion once per token, when
the token is projected, and caches the expanded keys and values: each head's key is its
``qk_nope`` channels from the latent's expansion followed by the ``qk_rope`` channels of the one
rotary key all heads share; its value, ``v_head_dim`` channels, is padded with zeros to the key's
width so that one cache layout, the contiguous and paged attention and the paged decode kernel
serve it unchanged (the padded output channels are dropped before the output projection). The
cache thus holds ``heads x (nope + rope)`` per token for keys and as much for values, not the
``kv_lora_rank + rope`` of the latent: correct, and larger than MLA's own cache by that ratio
(DeepSeek-V3: 2 x 128 x 192 against 576 values per token); caching the latent and absorbing
the expansion into the query and output projections is the known way to shrink it, not done
here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compress.runtime.layers import _convert_linear, _FloatLinear, _Layer, _rotate
from compress.runtime.norms import _norm, _norm_weight, _rms_norm


def latent_widths(config, arch) -> tuple[int, int, int, int]:
    """(key channels without RoPE, with RoPE, value channels, latent width) per head."""
    return tuple(int(getattr(config, key)) for key in arch.latent_attention.widths)


def cached_head_dim(config, arch) -> int:
    """The width of one head's cached key (and padded value)."""
    nope, rope, _, _ = latent_widths(config, arch)
    return nope + rope


class LatentLayer(_Layer):
    """``_Layer`` with latent attention's projections (``project_qkv``) and the value padding
    dropped before the output projection (``finish``); the MLP or sparse block is the base's."""

    def __init__(self, layer: nn.Module, config, prefill, decode, notes: list[str], i: int,
                 kernels, arch, *, spec, release: bool = False):
        super().__init__(layer, config, prefill, decode, notes, i, kernels, arch, spec=spec,
                         release=release)
        latent = arch.latent_attention
        self.nope, self.rope, self.v_dim, self.kv_rank = latent_widths(config, arch)
        self.n_kv = self.n_heads  # every head its own expanded key and value
        self.head_dim = self.nope + self.rope
        self.rope_perm = None  # the rotary channels are handled here (interleaved or not)
        key = spec.rope_interleave_key
        self.deinterleave = bool(getattr(config, key, True)) if key else spec.rope_interleaved
        self.q_b = None if not latent.q_b else _convert_linear(
            layer.get_submodule(latent.q_b), f"layers.{i}.{latent.q_b}", prefill, decode, notes,
            kernels, release=release)  # fmt: skip
        norms = {"q_a_norm": latent.q_latent_norm, "kv_a_norm": latent.kv_latent_norm}
        for name, path in norms.items():
            module = layer.get_submodule(path) if path else None
            setattr(self, name, None if module is None else _norm_weight(module, arch.norm_form))
            # transformers builds the latent norms with their class's default epsilon
            setattr(self, f"{name}_eps", float(getattr(module, "variance_epsilon", 1e-6)))

    def _stack(self, *names: str) -> nn.Module | None:
        return None  # the query, the KV latent and its expansion read different inputs

    def pack_float(self, fp32: bool = True) -> None:
        """Each bf16 projection packed for oneDNN on its own (``_Layer.pack_float`` without
        the q/k/v stack, for the reason of ``_stack``)."""
        for module in self.modules():
            if isinstance(module, _FloatLinear):
                module.pack(fp32)

    def project_qkv(self, x, cos, sin, decode: bool):
        """x [B, T, H] fp32 -> q, k and v [B, heads, T, nope + rope] (v zero-padded from
        ``v_dim``); cos/sin [B, T, rope]."""
        b, t, _ = x.shape
        h = _norm(x, self.norm_in, self.eps, self.norm_in_bias, self.centered)
        q = self.q(h, decode)
        if self.q_b is not None:
            q = self.q_b(_rms_norm(q.float(), self.q_a_norm, self.q_a_norm_eps), decode)
        q_nope, q_rope = q.view(b, t, self.n_heads, self.head_dim).split([self.nope, self.rope],
                                                                           -1)
        latent, k_rope = self.k(h, decode).split([self.kv_rank, self.rope], -1)
        kv = self.v(_rms_norm(latent.float(), self.kv_a_norm, self.kv_a_norm_eps), decode)
        k_nope, v = kv.view(b, t, self.n_heads, self.nope + self.v_dim).split(
            [self.nope, self.v_dim], -1)
        k_rope = k_rope.reshape(b, t, 1, self.rope)
        if self.deinterleave:  # pairs (2i, 2i + 1) -> (i, i + rope/2): _rotate's halves
            q_rope, k_rope = (y.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
                              for y in (q_rope, k_rope))
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        q_rope, k_rope = _rotate(q_rope.float(), cos, sin), _rotate(k_rope.float(), cos, sin)
        q = torch.cat([q_nope.float(), q_rope], -1)
        k = torch.cat([k_nope.float(), k_rope.expand(b, t, self.n_heads, self.rope)], -1)
        v = F.pad(v.float(), (0, self.head_dim - self.v_dim))
        return tuple(y.transpose(1, 2) for y in (q, k, v))

    def finish(self, x, a, decode: bool) -> torch.Tensor:
        """``_Layer.finish`` on the attention's value channels (the padding dropped)."""
        b, t, _ = a.shape
        a = a.view(b, t, self.n_heads, self.head_dim)[..., :self.v_dim].reshape(b, t, -1)
        return super().finish(x, a, decode)
