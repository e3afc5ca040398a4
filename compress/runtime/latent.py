"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Moonlight: ``Arch.latent_attention``)
in the runtime's layer, with the latent in the cache.

The reference is transformers' attention of the family: per head, a key ``[k_nope_h; k_rope]``
and a value ``v_h`` expanded from the token's normed latent ``c`` by kv_b_proj
(``k_nope_h = W_k,h c``, ``v_h = W_v,h c``), one rotary key ``k_rope`` shared by all heads.
Here the expansion is absorbed instead (DeepSeek-V2's own inference form): the query's
``q_nope_h`` becomes ``W_k,h^T q_nope_h``, so its score against ``[c; k_rope]`` is the score
against the expanded key, exactly; the attention-weighted sum of ``c`` then goes through
``W_v,h``, which equals weighting the expanded values. So each token caches ``[c; k_rope]``
once for all heads, as one KV head (``kv_lora_rank + qk_rope_head_dim`` values: 576 at V3's
widths, against 2 x 128 x 192 expanded), and the cache is both the keys and the values: one
tensor per layer (``values_in_keys``), whose last ``rope`` channels the values read and drop.
The contiguous and paged caches, the paged decode kernel (one KV head shared by every query
head) and the int8 pages take it as any GQA layer's. ``W_k`` and ``W_v`` are kv_b_proj's weight
in the model's float dtype (a quantized kv_b_proj's dequantized once); the two products run in
it.
"""

from __future__ import annotations

import torch
from torch import nn

from compress.quant.linear import QuantLinear
from compress.runtime.float_linear import _FloatLinear
from compress.runtime.layers import (
    _convert_linear,
    _Layer,
    _rotate,
    release_weights,
)
from compress.runtime.norms import _norm, _norm_weight, _rms_norm


def latent_widths(config, arch) -> tuple[int, int, int, int]:
    """(key channels without RoPE, with RoPE, value channels, latent width) per head."""
    return tuple(int(getattr(config, key)) for key in arch.latent_attention.widths)


def cached_head_dim(config, arch) -> int:
    """The width of the one cached KV head: the latent and the rotary key."""
    _, rope, _, rank = latent_widths(config, arch)
    return rank + rope


class LatentLayer(_Layer):
    """``_Layer`` with latent attention's projections (``project_qkv``: the absorbed query and
    the cached ``[latent; rotary key]``) and the value expansion after attention (``finish``);
    the MLP or sparse block is the base's."""

    values_in_keys = True  # the cache holds [latent; rotary key] once: keys and values
    absorbed = ("v",)  # kv_b_proj: w_k and w_v below, no holder of its own

    def __init__(self, layer: nn.Module, config, prefill, decode, notes: list[str], i: int,
                 kernels, arch, *, spec, release: bool = False):
        latent = arch.latent_attention
        nope, rope, v_dim, rank = latent_widths(config, arch)
        expand = layer.get_submodule(arch.v)  # read before the base releases its weights
        # in the model's float dtype: fp32, or half the bytes for a bf16 model (V3: 67 MB a
        # layer in fp32)
        dtype = next(p.dtype for p in layer.parameters() if p.is_floating_point())
        weight = (expand.dequantized_weight(dtype) if isinstance(expand, QuantLinear)
                  else expand.weight.detach().to(dtype))
        heads = config.num_attention_heads
        weight = weight.view(heads, nope + v_dim, rank)
        super().__init__(layer, config, prefill, decode, notes, i, kernels, arch, spec=spec,
                         release=release)
        self.v = None  # the expansion is absorbed (w_k, w_v): no projection of its own
        if release and isinstance(expand, QuantLinear):  # its float copy is w_k and w_v
            release_weights(expand, f"layers.{i}.{arch.v}")
        self.w_k = nn.Buffer(weight[:, :nope].contiguous(), persistent=False)  # [H, nope, rank]
        self.w_v = nn.Buffer(weight[:, nope:].contiguous(), persistent=False)  # [H, v, rank]
        self.nope, self.rope, self.v_dim, self.kv_rank = nope, rope, v_dim, rank
        self.n_kv, self.head_dim = 1, rank + rope  # one cached head: [latent; rotary key]
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
        """x [B, T, H] fp32 -> q [B, heads, T, rank + rope] (the absorbed query), k = v
        [B, 1, T, rank + rope] (the normed latent and the rotary key); cos/sin [B, T, rope]."""
        b, t, _ = x.shape
        h = _norm(x, self.norm_in, self.eps, self.norm_in_bias, self.centered)
        q = self.q(h, decode)
        if self.q_b is not None:
            q = self.q_b(_rms_norm(q.float(), self.q_a_norm, self.q_a_norm_eps), decode)
        q_nope, q_rope = q.float().view(b, t, self.n_heads, self.nope + self.rope).split(
            [self.nope, self.rope], -1)
        latent, k_rope = self.k(h, decode).float().split([self.kv_rank, self.rope], -1)
        latent = _rms_norm(latent, self.kv_a_norm, self.kv_a_norm_eps)
        k_rope = k_rope.view(b, t, 1, self.rope)
        if self.deinterleave:  # pairs (2i, 2i + 1) -> (i, i + rope/2): _rotate's halves
            q_rope, k_rope = (y.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
                              for y in (q_rope, k_rope))
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        q_rope, k_rope = _rotate(q_rope, cos, sin), _rotate(k_rope, cos, sin)
        q_latent = torch.einsum("bthn,hnr->bthr", q_nope.to(self.w_k.dtype), self.w_k).float()
        q = torch.cat([q_latent, q_rope], -1).transpose(1, 2)
        k = torch.cat([latent.view(b, t, 1, self.kv_rank), k_rope], -1).transpose(1, 2)
        return q, k, k

    def finish(self, x, a, decode: bool) -> torch.Tensor:
        """``_Layer.finish`` on each head's value: its attention-weighted latent [B, T, heads *
        (rank + rope)] (the rotary channels dropped) through ``w_v``."""
        b, t, _ = a.shape
        weighted = a.view(b, t, self.n_heads, self.head_dim)[..., :self.kv_rank]
        values = torch.einsum("bthr,hvr->bthv", weighted.to(self.w_v.dtype), self.w_v).float()
        return super().finish(x, values.reshape(b, t, -1), decode)
