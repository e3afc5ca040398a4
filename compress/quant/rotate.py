"""``rotate.hadamard``: incoherence processing by orthogonal rotations folded into the weights.

QuaRot / SpinQuant observe that a few residual channels carry most of the activation and
weight outliers, and that an orthogonal change of basis spreads them over every channel, so a
4-bit grid fits the rotated weights better. This pass applies the rotations that fold exactly
into the weights, so the result is a plain float model of its family (any later pass, the
export and every loader see an ordinary checkpoint):

* **Residual stream (R1).** With ``Q`` [H, H] orthogonal the model is rewritten to carry
  ``x Q`` instead of ``x`` in the residual stream: the embedding rows become ``E Q``, every
  linear that writes to the stream (attention output, MLP down; MoE experts' down) gets
  ``Q^T W`` (and ``b Q``), every linear that reads it gets ``W Q`` (an MoE model's layers with
  a dense MLP, DeepSeek-V3's and GLM-4.5's first ones, as a dense family's: ``layer_arch``).
  RMSNorm commutes with ``Q`` only without its per-channel weight, so each norm's weight is
  first folded into the columns of the linears it feeds (the norm then keeps weight 1, or 0 in
  the ``(1 + w)`` form), the final norm's into the output head. A tied head must then be untied
  (the embedding is ``E Q``, the head ``E diag(w) Q``): the checkpoint gains one float
  ``[vocab, H]`` matrix, which the report states; keep the head tied only when the final
  norm's weight is exactly 1.
* **Values to output, per head (R2, ``value_output``).** Each value head's rows get ``R^T W``
  and the output projection's columns of each query head ``W R`` with one ``R`` [D, D]: the
  attention mixes value vectors linearly, so the product is unchanged.

``Q`` is a randomized Hadamard matrix ``H diag(s) / sqrt(n)`` (random signs ``s`` from
``seed``) where a Hadamard matrix of that order is built here (Sylvester 2^k, Paley I and II,
and Kronecker products of them: every multiple of 4 up to a few thousand that LLMs use, 576 =
12 x 48 included), else a random orthogonal matrix (QR of a Gaussian), named in the report.

Left out, with the reason: the *online* rotations of QuaRot/SpinQuant (a Hadamard on the MLP's
intermediate activations before ``down_proj``, and on the queries/keys for a rotated KV cache)
cannot be folded into weights. They need a transform at inference in every engine that loads
the checkpoint, which a plain model of the family does not have: the checkpoint would no longer
be one that transformers loads as is. They also matter mostly for activation (W4A4) and KV
quantization, which this project does not do.

Streamed (``state.stream``, a meta skeleton): each decoder layer is read, rotated by the same
per-layer code as a model in memory and handed on (to the next pass's scratch file or the
export); then the final norm, embedding and head are read, rotated and kept resident (a later
pass and the export read them from memory). The result is the in-memory run's, bit for bit.

Families whose norms sit between a block and the residual add (Gemma's and OLMo2's post-norms)
are refused: a per-channel norm weight there does not commute with ``Q`` and no linear can
absorb it. The rotation must run before any quantization pass (it needs float weights).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import model_validator
from torch import nn

from compress.arch import (
    DEFAULT_IGNORE,
    Arch,
    Mapping,
    Moe,
    arch_for,
    check_paths,
    decoder_layers,
    head_dim_of,
    layer_arch,
    producer_rows,
)
from compress.core.errors import ConfigError
from compress.core.registry import CompressionState, PassConfig, PassReport, register_pass
from compress.quant.linear import QuantExperts, QuantLinear, W8A8Linear, is_bnb_module

NAME = "rotate.hadamard"
CHUNK_ROWS = 8192  # rows per float64 product: bounds the temporary of a large embedding


class RotateConfig(PassConfig):
    """kind: ``hadamard`` (randomized Hadamard where one of that order is built here, else a
    random orthogonal matrix, reported) or ``orthogonal`` (always random orthogonal).
    seed: the random signs / Gaussian. value_output: also rotate each value head and the output
    projection's columns (R2). The rotation covers the whole model: ``targets`` and ``ignore``
    cannot select layers (a partial residual rotation would change the model's outputs)."""

    kind: Literal["hadamard", "orthogonal"] = "hadamard"
    seed: int = 0
    value_output: bool = True

    @model_validator(mode="after")
    def _whole_model(self):
        if self.targets != ("Linear",) or tuple(self.ignore) != DEFAULT_IGNORE:
            raise ValueError(
                "rotate.hadamard rotates the whole residual stream and cannot select layers: "
                "remove `targets` / `ignore` from this pass (a later quantization pass selects "
                "what is quantized)"
            )
        return self


# ---- orthogonal matrices --------------------------------------------------------------------
def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """[q, q] matrix chi(j - i) of the quadratic character mod the prime ``q``."""
    residues = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if a in residues else -1.0 for a in range(1, q)],
                       dtype=torch.float64)
    index = torch.arange(q)
    return chi[(index[None, :] - index[:, None]) % q]


def _paley(m: int) -> torch.Tensor | None:
    """A Hadamard matrix of order ``m`` from Paley's constructions, or None: I for ``m - 1`` a
    prime = 3 mod 4, II for ``m / 2 - 1`` a prime = 1 mod 4."""
    q = m - 1
    if _is_prime(q) and q % 4 == 3:
        s = torch.zeros(m, m, dtype=torch.float64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, _jacobsthal(q)
        return s + torch.eye(m, dtype=torch.float64)
    q = m // 2 - 1
    if m % 2 == 0 and _is_prime(q) and q % 4 == 1:
        c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
        c[0, 1:], c[1:, 0], c[1:, 1:] = 1.0, 1.0, _jacobsthal(q)
        plus = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        minus = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        return torch.kron(c, plus) + torch.kron(torch.eye(q + 1, dtype=torch.float64), minus)
    return None


def hadamard_matrix(n: int) -> torch.Tensor | None:
    """A Hadamard matrix of order ``n`` (entries +-1, ``H H^T = n I``; float64), or None when
    none of Sylvester's, Paley's or their Kronecker products gives that order."""
    if n < 1:
        return None
    power = n & -n  # largest power of two dividing n
    for base in range(n // power, n + 1):  # the smallest odd-part factor that works
        if n % base or (n // base) & (n // base - 1):
            continue
        core = torch.ones(1, 1, dtype=torch.float64) if base == 1 else _paley(base)
        if core is None:
            continue
        sylvester = torch.ones(1, 1, dtype=torch.float64)
        block = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        for _ in range(int(math.log2(n // base))):
            sylvester = torch.kron(sylvester, block)
        return torch.kron(core, sylvester)
    return None


def rotation_matrix(n: int, kind: str, generator: torch.Generator) -> tuple[torch.Tensor, str]:
    """An orthogonal [n, n] float64 matrix and a description of what it is."""
    if kind == "hadamard":
        h = hadamard_matrix(n)
        if h is not None:
            signs = torch.randint(0, 2, (n,), generator=generator, dtype=torch.float64) * 2 - 1
            return h * signs / math.sqrt(n), f"randomized Hadamard of order {n}"
    gaussian = torch.randn(n, n, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    q = q * torch.sign(torch.diagonal(r))  # Haar-distributed (QR's sign convention removed)
    why = "" if kind == "orthogonal" else f" (no Hadamard matrix of order {n} is built here)"
    return q, f"random orthogonal of order {n}{why}"


# ---- folding --------------------------------------------------------------------------------
@torch.no_grad()
def _rotate_last(weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """``weight[..., H] <- (weight * scale) @ q`` in float64, in place, a chunk of rows at a
    time (an embedding of 150k rows would need gigabytes at once)."""
    if weight.dim() > 2 and not weight.is_contiguous():  # a transposed view: per matrix
        for matrix in weight:
            _rotate_last(matrix, q, scale)
        return
    flat = weight if weight.dim() == 2 else weight.view(-1, weight.shape[-1])
    for start in range(0, flat.shape[0], CHUNK_ROWS):
        rows = flat[start : start + CHUNK_ROWS].double()
        if scale is not None:
            rows = rows * scale
        flat[start : start + CHUNK_ROWS] = (rows @ q).to(weight.dtype)


@torch.no_grad()
def _rotate_rows(weight: torch.Tensor, q: torch.Tensor) -> None:
    """``weight[..., H, K] <- q^T @ weight`` (a writer's output rows), in place."""
    weight.copy_(torch.matmul(q.T, weight.double()).to(weight.dtype))

def _check_norm(norm: nn.Module, where: str) -> None:
    """ConfigError unless ``norm`` is an RMSNorm-style norm without bias (its type is known
    on the meta device too: checked for every norm before any weight changes)."""
    if "rmsnorm" not in type(norm).__name__.lower() or getattr(norm, "bias", None) is not None:
        raise ConfigError(
            f"{NAME}: {where} is a {type(norm).__name__}, not an RMSNorm without bias; a norm "
            "that subtracts the mean or adds a bias does not commute with a rotation"
        )


def _norm_weight(norm: nn.Module, arch: Arch) -> torch.Tensor:
    """The effective per-channel weight (float64) of an RMSNorm-style norm."""
    w = norm.weight.detach().double()
    return w + 1 if arch.norm_form == "1+w" else w


@torch.no_grad()
def _reset_norm(norm: nn.Module, arch: Arch) -> None:
    norm.weight.fill_(0.0 if arch.norm_form == "1+w" else 1.0)


def _readers_after(layer: nn.Module, arch: Arch, norm: str) -> list[torch.Tensor]:
    """Weights whose last dimension reads the output of the pre-norm ``norm``."""
    if norm == arch.attn_norm:
        paths = arch.heads.rows + arch.heads.kv_rows + arch.heads.fused
    elif arch.moe is not None:
        experts = layer.get_submodule(arch.moe.fused)
        shared = [layer.get_submodule(p).weight for p in arch.moe.shared_readers]
        return [layer.get_submodule(arch.moe.router_weights).weight,
                _as_rows(getattr(experts, arch.moe.gate_up), arch.moe),
                *shared]  # fmt: skip
    else:
        paths = arch.mlp_channels.rows + arch.mlp_channels.fused
    return [layer.get_submodule(p).weight for p in dict.fromkeys(paths)]


def _as_rows(fused: torch.Tensor, moe: Moe) -> torch.Tensor:
    """A fused experts parameter as ``[E, out, in]`` (a view): GPT-OSS's are ``[E, in, out]``."""
    return fused if moe.fused_layout == "rows" else fused.transpose(1, 2)


def _writers(layer: nn.Module, arch: Arch) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight [..., H, K], bias [H] or None) of what writes to the residual stream."""
    out = []
    for path in arch.heads.cols + (() if arch.moe is not None else arch.mlp_channels.cols):
        module = layer.get_submodule(path)
        out.append((module.weight, module.bias))
    if arch.moe is not None:
        experts = layer.get_submodule(arch.moe.fused)
        bias = getattr(experts, arch.moe.down_bias) if arch.moe.down_bias else None
        out.append((_as_rows(getattr(experts, arch.moe.down), arch.moe), bias))
        if arch.moe.shared_down:
            down = layer.get_submodule(arch.moe.shared_down)
            out.append((down.weight, down.bias))
    return out


def _check_supported(model: nn.Module, arch: Arch) -> None:
    """Every refusal, from module types and shapes only (a streamed model's meta skeleton
    gets the same ones as a model in memory, before any layer is read)."""
    if arch.norm_kind == "layer":
        raise ConfigError(
            f"{NAME}: model_type {arch.model_type!r} uses LayerNorms: a norm that subtracts the "
            "mean or adds a bias does not commute with a rotation. Remove this pass for this family"
        )
    if arch.parallel:
        raise ConfigError(
            f"{NAME}: model_type {arch.model_type!r} runs attention and MLP in parallel on one "
            "norm; rotating such blocks is not implemented. Remove this pass for this family"
        )
    if arch.post_norms or arch.attn_norm is None or arch.mlp_norm is None:
        raise ConfigError(
            f"{NAME}: model_type {arch.model_type!r} has norms after its attention/MLP blocks "
            f"({', '.join(arch.post_norms) or 'and none before them'}): a per-channel norm "
            "weight between a block and the residual add does not commute with a rotation and "
            "no linear can absorb it. Remove this pass for this family"
        )
    # Gemma's sqrt(hidden) embedding factor is a scalar: (E Q) c = (E c) Q, nothing to do.
    quantized = [n for n, m in model.named_modules()
                 if isinstance(m, (QuantLinear, W8A8Linear, QuantExperts)) or is_bnb_module(m)]
    if quantized:
        raise ConfigError(
            f"{NAME}: {len(quantized)} layers are already quantized ({quantized[0]}, ...): the "
            "rotation needs float weights. Put rotate.hadamard before the quantization passes"
        )
    paths = (arch.attn_norm, arch.mlp_norm) + arch.linears
    if arch.moe is not None:
        paths += (arch.moe.router_weights, arch.moe.fused, *arch.moe.shared_readers,
                  arch.moe.shared_down)
    check_paths(model, arch, tuple(p for p in paths if p), NAME)
    for index, layer in enumerate(decoder_layers(model, NAME)):
        for norm_path in (arch.attn_norm, arch.mlp_norm):
            _check_norm(layer.get_submodule(norm_path), f"layer {index} {norm_path}")
    _check_norm(model.get_submodule(arch.final_norm), arch.final_norm)


@torch.no_grad()
def _untie_head(model: nn.Module) -> bool:
    """Give the output head its own Parameter (a copy of the embedding); True if it was tied.
    Both must be resident (two meta tensors share data_ptr 0)."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight is not embed.weight and head.weight.data_ptr() != embed.weight.data_ptr():
        return False
    head.weight = nn.Parameter(embed.weight.detach().clone())
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = False
    return True


@torch.no_grad()
def _rotate_layer(layer: nn.Module, arch: Arch, q: torch.Tensor, r: torch.Tensor | None) -> None:
    """One decoder layer, in place: each pre-norm's weight folded into the linears it feeds,
    their input columns rotated by ``q``, the writers' output rows by ``q^T``; then with
    ``r`` the value heads' rows and the output projection's columns (R2). The one code path of
    the per-layer math, for a model in memory and for a streamed layer."""
    for norm_path in (arch.attn_norm, arch.mlp_norm):
        norm = layer.get_submodule(norm_path)
        scale = _norm_weight(norm, arch)
        for weight in _readers_after(layer, arch, norm_path):
            _rotate_last(weight.data, q, scale)
        _reset_norm(norm, arch)
    for weight, bias in _writers(layer, arch):
        _rotate_rows(weight.data, q)
        if bias is not None:
            _rotate_last(bias.data, q)
    if r is not None:
        _rotate_value_output(layer, arch, r)


@torch.no_grad()
def _rotate_outside(model: nn.Module, arch: Arch, q: torch.Tensor, report: PassReport) -> None:
    """The embedding (``E Q``), the output head (``W diag(w) Q`` with the final norm's weight
    ``w``, untied first when ``w`` is not all ones) and the final norm reset, in place."""
    final = model.get_submodule(arch.final_norm)
    scale = _norm_weight(final, arch)
    untie = not bool(torch.all(scale == 1))
    untied = _untie_head(model) if untie else False
    _rotate_last(model.get_input_embeddings().weight.data, q)
    head = model.get_output_embeddings()
    # a bias on the logits is in vocabulary space: the rotation leaves it as it is
    if head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        _rotate_last(head.weight.data, q, scale)
    _reset_norm(final, arch)
    if untied:
        vocab, hidden = head.weight.shape
        report.metrics["untied_head"] = {
            "elements": vocab * hidden,
            "why": "the final norm's weight folds into the head but not into the embedding: "
                   "the checkpoint stores a separate output matrix",
        }


def _value_output_rows(layer: nn.Module, arch: Arch) -> tuple[nn.Module, slice | None]:
    """The linear holding the value rows and which of its rows they are (fused: Phi-3)."""
    mapping = next((m for m in arch.awq_mappings if m.producer == arch.v
                    and m.consumers == (arch.o,)), Mapping(arch.v, (arch.o,)))
    return layer.get_submodule(arch.v), producer_rows(layer, mapping)


@torch.no_grad()
def _rotate_value_output(layer: nn.Module, arch: Arch, r: torch.Tensor) -> None:
    head_dim = r.shape[0]
    value, rows = _value_output_rows(layer, arch)
    part = slice(None) if rows is None else rows
    w = value.weight.data[part]  # [KVH * D, H]
    w.copy_(torch.einsum("de,kdh->keh", r, w.double().view(-1, head_dim, w.shape[1]))
            .reshape(w.shape).to(w.dtype))
    if value.bias is not None:
        b = value.bias.data[part]
        b.copy_((b.double().view(-1, head_dim) @ r).reshape(b.shape).to(b.dtype))
    out = layer.get_submodule(arch.o).weight.data  # [H, NH * D]
    out.copy_((out.double().view(out.shape[0], -1, head_dim) @ r).reshape(out.shape)
              .to(out.dtype))


def _load_outside(stream, arch: Arch) -> None:
    """A streamed model's final norm, embedding and output head (tied: the embedding's weight)
    read from the checkpoint; they stay resident, rotated: a later pass (the calibration
    capture) and the export take them from memory, never from the unrotated source."""
    head = stream.model.get_output_embeddings()
    head_name = next(n for n, m in stream.model.named_modules() if m is head)
    for name in (arch.final_norm, arch.embed, head_name):
        stream.load_module(name)


@register_pass(NAME, RotateConfig, layerwise=True)
def rotate_hadamard(model: nn.Module, cfg: RotateConfig, state: CompressionState) -> PassReport:
    """Rotate ``model`` in place. With ``state.stream`` (a meta skeleton) each decoder layer is
    read, rotated and handed back in turn, then the modules outside the stack are read and
    rotated (kept resident); the result is the in-memory run's, bit for bit."""
    arch = arch_for(model, NAME)
    _check_supported(model, arch)  # every refusal before any weight is read or changed
    if cfg.value_output and getattr(model.config, "clip_qkv", None):
        raise ConfigError(
            f"{NAME}: clip_qkv={model.config.clip_qkv} clamps the values between {arch.v} and "
            f"{arch.o}, so rotating the value heads (value_output) would change the model. Set "
            "value_output: false to rotate the residual stream only")
    if cfg.value_output and arch.latent_attention:
        raise ConfigError(
            f"{NAME}: model_type {arch.model_type!r} uses multi-head latent attention: its "
            f"values come out of {arch.v} interleaved per head with the keys, and rotating "
            "them (value_output) is not implemented. Set value_output: false to rotate the "
            "residual stream only")
    stream = state.stream
    report = PassReport(NAME)
    generator = torch.Generator().manual_seed(cfg.seed)
    layers = decoder_layers(model, NAME)
    hidden = model.get_input_embeddings().weight.shape[1]
    q, residual = rotation_matrix(hidden, cfg.kind, generator)
    report.metrics["residual_rotation"] = residual
    r = None
    if cfg.value_output:  # drawn after q from the same generator
        r, per_head = rotation_matrix(head_dim_of(layers[0]), cfg.kind, generator)
        report.metrics["value_output_rotation"] = per_head
    for index, layer in enumerate(layers):
        if stream is not None:
            stream.load_layer(index)
        _rotate_layer(layer, layer_arch(arch, layer), q, r)
        report.changed.append(f"{arch.layer_prefix}{index}")
        if stream is not None:
            stream.finish_layer(index)
    if stream is not None:
        _load_outside(stream, arch)
    _rotate_outside(model, arch, q, report)
    report.metrics["online_rotations"] = "none (not foldable; see compress.quant.rotate)"
    return report
