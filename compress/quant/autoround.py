"""AutoRound (Cheng et al., 2023, "Optimize Weight Rounding via Signed Gradient Descent for the
Quantization of LLMs"; Intel auto-round): ``quantize.autoround``.

Instead of rounding each weight to the nearest grid point, learn for every weight a rounding
offset ``V`` in [-0.5, 0.5] and for every group two clipping multipliers ``alpha`` (on the max)
and ``beta`` (on the min) in [0.5, 1]:

    wmax = alpha * max(w_g, 0), wmin = beta * min(w_g, 0)       (asymmetric, zero in range)
    amax = max(alpha * wmax, -beta * wmin)                        (symmetric; the scale from
                                                                   amax per ``symmetric_grid``)
    w_q  = clamp(round(w / s + V) + z, qmin, qmax),  w~ = (w_q - z) * s

with ``s`` and ``z`` the min/max parameters of ``compress.quant.primitives`` computed from the
clipped range (``s`` rounded to the stored scale dtype, so stored = used). All targeted linears of
one decoder layer are tuned together to minimise the MSE between the float layer's output and the
fake-quantized layer's output on the calibration inputs (by default each token's squared error
relative to its target's squared norm, ``loss``, so an attention sink's massive state does not
take the loss), by signed gradient descent
(``p -= lr_t * sign(grad)``, ``round`` with a straight-through estimator, ``lr`` decaying linearly
from ``1/iters`` to 0, a minibatch of ``batch_size`` sequences per step, shuffled passes over
the calibration set), keeping the parameters
with the lowest minibatch loss seen; the step rule and lr follow the paper and auto-round. With
``V = 0, alpha = beta = 1`` (``iters: 0``) the result is RTN, code for code.

Layers are processed one decoder layer at a time (``compress.quant.calibrated``): the inputs of
layer i are the outputs of the already quantized layers 0..i-1. The target (``target``) is, by
default as in auto-round, the float model's own output of layer i (``float_model``: the float
layers 0..i on float inputs, carried as a second set of hidden states), so tuning also pulls
back the error the earlier quantized layers let in; ``quantized_inputs`` targets the float
layer i on the quantized inputs instead (the block's own error only). The result is an ordinary
``QuantLinear``, so export is the standard compressed-tensors int4/int8 layout. Memory: the
targets and the float trajectory are kept beside the inputs (up to three sets of hidden states
``[n, T, hidden]``), plus one minibatch's activations and gradients. Cost: ``iters *
batch_size`` forward and backward passes of each decoder layer (GPTQ needs one forward), so on
CPU it is slow: SmolLM2-135M took 82 s for its 30 layers at only 20 steps x 1 sequence of 512
(8 calibration sequences) on 2 idle Xeon cores (19 min on 2 busy ones); the defaults (200 steps
x 8 sequences) are ~80x that work.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Literal

import torch
from pydantic import Field
from torch import nn
from torch.func import functional_call

from compress.arch import arch_for
from compress.core.matcher import set_submodule
from compress.core.registry import (
    CompressionState,
    PassReport,
    raise_or_report_skips,
    register_pass,
)
from compress.quant import primitives as quant_primitives
from compress.quant.calibrated import (
    LayerInputs,
    OffloadMode,
    finish_quant_report,
    plan_layers,
    run_calibrated,
    run_layer,
)
from compress.quant.coverage import report_coverage
from compress.quant.experts import plan_experts, rtn_layer_experts
from compress.quant.linear import QuantLinear, WeightScheme
from compress.quant.scheme import CalibratedWeightConfig

log = logging.getLogger(__name__)


class AutoroundConfig(CalibratedWeightConfig):
    """AutoRound settings (plus the bits/groups/symmetric/overrides of ``GptqConfig``).

    iters: sign-SGD steps per decoder layer (0: plain RTN). lr: step size of ``V`` (None:
    ``1/iters``, the paper's choice), decayed linearly to 0; clipping_lr: step size of alpha/beta
    (None: the same as lr). batch_size: calibration sequences per step. tune_clipping: false keeps
    alpha = beta = 1 (rounding only). seed: minibatch order. target: what each block's output
    is pulled towards, ``float_model`` (the float model's hidden states, auto-round's choice) or
    ``quantized_inputs`` (the float block on the quantized model's inputs).
    """

    iters: int = Field(200, ge=0, le=100_000)
    lr: float | None = Field(None, gt=0.0, le=1.0)
    clipping_lr: float | None = Field(None, gt=0.0, le=1.0)
    batch_size: int = Field(8, ge=1, le=4096)
    tune_clipping: bool = True
    seed: int = Field(0, ge=0)
    offload: OffloadMode = "none"  # where not-yet-processed decoder layers wait
    target: Literal["float_model", "quantized_inputs"] = "float_model"
    # "random": each step draws batch_size sequences afresh; "cyclic": auto-round's order, a
    # shuffled pass over all sequences batch_size at a time (each seen once per pass). Default
    # cyclic with loss token_relative: docs/notes/2026-12-01-autoround-sink-loss.md
    sampling: Literal["random", "cyclic"] = "cyclic"
    # also learn the block's 1-d parameters (norm weights, biases), each element moved by at
    # most half a 4-bit step of its tensor's range (auto-round's enable_norm_bias_tuning)
    tune_norms: bool = False
    # "mse": the plain squared error of the block's output, as auto-round; "token_relative":
    # each token's squared error over its target's squared norm. The next block (and the final
    # norm) sees each token's state after an RMSNorm, so a token's relative error is what
    # reaches it; with plain MSE the attention-sink token (SmolLM2: 10^3-10^4 x the median
    # token's squared norm from layer 11 on) carries 55-97% of layers 11-26's loss and gets the
    # tuning.
    loss: Literal["mse", "token_relative"] = "token_relative"


@dataclass
class RoundingParams:
    """Learned parameters of one linear ``w [N, K]`` with G = K / group groups."""

    v: torch.Tensor  # [N, K] fp32 rounding offsets in [-0.5, 0.5]
    alpha: torch.Tensor  # [N, G] fp32 multiplier of the group max, in [0.5, 1]
    beta: torch.Tensor  # [N, G] fp32 multiplier of the group min, in [0.5, 1]

    @classmethod
    def initial(cls, w: torch.Tensor, group: int) -> RoundingParams:
        """``V = 0, alpha = beta = 1``: plain RTN."""
        n, k = w.shape
        ones = torch.ones(n, k // group, device=w.device)
        return cls(torch.zeros(n, k, device=w.device), ones, ones.clone())

    def tensors(self) -> list[torch.Tensor]:
        return [self.v, self.alpha, self.beta]

    def copy(self) -> RoundingParams:
        return RoundingParams(*(t.detach().clone() for t in self.tensors()))


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    """round() forward, identity backward (straight-through estimator)."""
    return x + (torch.round(x) - x).detach()


def _learned_qparams(
    groups: torch.Tensor, p: RoundingParams, scheme: WeightScheme
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Differentiable ``(scales [N, G, 1] as stored, zeros [N, G, 1] float | None)`` of the
    clipped range; with alpha = beta = 1 exactly ``quant_primitives.compute_qparams``."""
    qmin, qmax = quant_primitives.code_range(scheme.n_bits)
    wmax = groups.amax(dim=-1).clamp(min=0.0) * p.alpha  # [N, G]
    wmin = groups.amin(dim=-1).clamp(max=0.0) * p.beta
    if scheme.symmetric:
        scales = quant_primitives.symmetric_scales(wmax, wmin, scheme.n_bits, scheme.grid)
        zeros = None
    else:
        scales = (wmax - wmin) / (qmax - qmin)
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    if not scheme.symmetric:
        # zero point from the unrounded scale, as compute_qparams does
        zeros = torch.clamp(_round_ste(qmin - wmin / scales), qmin, qmax).unsqueeze(-1)
    stored = scales.to(scheme.scale_dtype).to(torch.float32)  # codes use the stored scale
    return stored.unsqueeze(-1), zeros


def _codes(
    w: torch.Tensor, p: RoundingParams, scheme: WeightScheme
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Float codes ``[N, G, g]``, scales ``[N, G, 1]`` and zeros of ``w [N, K]`` (differentiable
    in ``p`` through the straight-through round)."""
    n, k = w.shape
    group = scheme.resolved_group(k)
    groups = w.to(torch.float32).reshape(n, k // group, group)  # [N, K] -> [N, G, g]
    scales, zeros = _learned_qparams(groups, p, scheme)
    qmin, qmax = quant_primitives.code_range(scheme.n_bits)
    codes = _round_ste(groups / scales + p.v.reshape(groups.shape))
    if zeros is not None:
        codes = codes + zeros
    return torch.clamp(codes, qmin, qmax), scales, zeros


def fake_quantize_learned(w: torch.Tensor, p: RoundingParams, scheme: WeightScheme) -> torch.Tensor:
    """Dequantized ``w~ [N, K]`` (fp32) under the learned parameters, differentiable in ``p``."""
    codes, scales, zeros = _codes(w, p, scheme)
    if zeros is not None:
        codes = codes - zeros
    return (codes * scales).reshape(w.shape)


@torch.no_grad()
def quantize_learned(
    w: torch.Tensor, p: RoundingParams, scheme: WeightScheme
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(w_q int8 [N, K], scales fp32 [N, G], zeros int8 [N, G] | None)`` for ``QuantLinear``."""
    codes, scales, zeros = _codes(w, p, scheme)
    w_q = codes.to(torch.int8).reshape(w.shape)
    return w_q, scales.squeeze(-1), None if zeros is None else zeros.squeeze(-1).to(torch.int8)


def _sample_losses(
    layer: nn.Module,
    weights: dict[str, torch.Tensor],
    inputs: LayerInputs,
    targets: list[torch.Tensor],
    indices: list[int],
    loss: Literal["mse", "token_relative"],
) -> list[torch.Tensor]:
    """Per index, the error between ``layer`` run with ``weights`` (parameter name -> tensor)
    and the float layer's output ``targets[i]``: the MSE, or (``token_relative``) the mean over
    tokens of each token's squared error over its target's squared norm."""
    losses = []
    for i in indices:
        out = functional_call(layer, weights, (inputs.hidden[i],), inputs.kwargs[i])
        out = out[0] if isinstance(out, tuple) else out
        target = targets[i].float()
        squared = (out.float() - target).pow(2)
        if loss == "token_relative":
            # a token whose target is exactly zero is divided by 1 (its plain squared error)
            norm2 = target.pow(2).mean(dim=-1, keepdim=True)
            squared = squared / torch.where(norm2 > 0, norm2, torch.ones_like(norm2))
        losses.append(squared.mean())
    return losses


def _weights(
    linears: dict[str, tuple[nn.Linear, WeightScheme]], params: dict[str, RoundingParams]
) -> dict[str, torch.Tensor]:
    return {
        f"{name}.weight": fake_quantize_learned(lin.weight, params[name], scheme).to(
            lin.weight.dtype
        )
        for name, (lin, scheme) in linears.items()
    }


def _minibatches(
    n_samples: int, cfg: AutoroundConfig, generator: torch.Generator
) -> Iterator[list[int]]:
    """Endless minibatch indices in ``cfg.sampling``'s order."""
    size = min(cfg.batch_size, n_samples)
    while True:
        order = torch.randperm(n_samples, generator=generator).tolist()
        if cfg.sampling == "random":
            yield order[:size]
            continue
        for start in range(0, n_samples - size + 1, size):  # the remainder waits a pass
            yield order[start : start + size]


@dataclass
class NormOffsets:
    """Offsets of a block's 1-d parameters: ``t~ = t + v * step``, ``v`` in [-0.5, 0.5] and
    ``step`` a 4-bit step of ``t``'s range (zero included), so nothing moves far."""

    v: dict[str, torch.Tensor]
    step: dict[str, float]

    @classmethod
    def of(cls, layer: nn.Module, skip: set[str]) -> NormOffsets:
        v, step = {}, {}
        for name, t in layer.named_parameters():
            width = float(t.detach().clamp(min=0).max() - t.detach().clamp(max=0).min())
            if t.dim() == 1 and name not in skip and width > 0:
                v[name], step[name] = torch.zeros_like(t, dtype=torch.float32), width / 15
        return cls(v, step)

    def weights(self, layer: nn.Module) -> dict[str, torch.Tensor]:
        own = dict(layer.named_parameters())
        return {n: (own[n].float() + v * self.step[n]).to(own[n].dtype) for n, v in self.v.items()}

    def copy(self) -> NormOffsets:
        return NormOffsets({n: v.detach().clone() for n, v in self.v.items()}, self.step)

    @torch.no_grad()
    def apply(self, layer: nn.Module) -> None:
        """Write the offset parameters into ``layer``."""
        for name, value in self.weights(layer).items():
            layer.get_parameter(name).copy_(value)


def _sign_step(
    params: dict[str, RoundingParams], norms: NormOffsets, lr: float, clip_lr: float
) -> None:
    """One signed-gradient step, then projection onto the allowed boxes."""
    with torch.no_grad():
        for v in norms.v.values():
            if v.grad is not None:
                v.sub_(lr * v.grad.sign()).clamp_(-0.5, 0.5)
                v.grad = None
        for p in params.values():
            p.v.sub_(lr * p.v.grad.sign()).clamp_(-0.5, 0.5)
            for t in (p.alpha, p.beta):
                if t.grad is not None:
                    t.sub_(clip_lr * t.grad.sign()).clamp_(0.5, 1.0)
            for t in p.tensors():
                t.grad = None


def tune_block(
    layer: nn.Module,
    linears: dict[str, tuple[nn.Linear, WeightScheme]],
    inputs: LayerInputs,
    targets: list[torch.Tensor],
    cfg: AutoroundConfig,
    generator: torch.Generator,
) -> tuple[dict[str, RoundingParams], dict[str, float]]:
    """Learn ``RoundingParams`` for ``linears`` (names relative to ``layer``) against the float
    layer's ``targets`` (one ``[1, T, hidden]`` per input sample). Returns the parameters with
    the lowest minibatch loss seen (RTN's included) and the losses on all samples."""
    params = _initial(linears)
    weight_names = {f"{name}.weight" for name in linears}
    norms = NormOffsets.of(layer, weight_names) if cfg.tune_norms else NormOffsets({}, {})
    trained = [p.v for p in params.values()] + list(norms.v.values())
    if cfg.tune_clipping:
        trained += [t for p in params.values() for t in (p.alpha, p.beta)]
    lr = cfg.lr if cfg.lr is not None else 1.0 / max(cfg.iters, 1)
    clip_lr = cfg.clipping_lr if cfg.clipping_lr is not None else lr
    n_samples = len(inputs.hidden)
    everything = list(range(n_samples))
    with torch.no_grad():  # RTN's loss per sequence, for the check at the end
        rtn = _sample_losses(
            layer, _weights(linears, params), inputs, targets, everything, cfg.loss
        )
    rtn_losses = [float(v) for v in rtn]
    best, best_score = {n: p.copy() for n, p in params.items()}, float("inf")
    best_norms = norms.copy()
    batches = _minibatches(n_samples, cfg, generator)
    frozen = [(t, t.requires_grad) for t in layer.parameters()]
    try:
        for t, _ in frozen:
            t.requires_grad_(False)  # only V/alpha/beta get gradients
        for t in trained:
            t.requires_grad_(True)
        for step in range(cfg.iters):
            batch = next(batches)
            with torch.enable_grad():
                weights = _weights(linears, params) | norms.weights(layer)
                loss = torch.stack(
                    _sample_losses(layer, weights, inputs, targets, batch, cfg.loss)
                ).mean()
                loss.backward()
            # the parameters before this step; ranked by their raw minibatch loss, as auto-round
            # does. Ranking by the ratio to RTN's loss on the same sequences instead (so that
            # easy minibatches do not win) fitted the calibration set better (block loss 0.628
            # vs 0.633 of RTN's) and scored worse: 32.70 ppl vs 32.30-32.44 over two seeds
            # (recipes/smollm2-w4g64-autoround.yaml, full WikiText-2 test split, 2026-12-01).
            score = float(loss.detach())
            if score < best_score:
                best, best_score = {n: p.copy() for n, p in params.items()}, score
                best_norms = norms.copy()
            decay = 1.0 - step / cfg.iters  # linear decay to 0
            _sign_step(params, norms, lr * decay, clip_lr * decay)
    finally:
        for t, flag in frozen:
            t.requires_grad_(flag)
    best, info = _checked_against_rtn(
        layer, linears, best, best_norms, inputs, targets, rtn_losses, cfg.loss
    )
    if not info["kept_rtn"]:
        best_norms.apply(layer)
    return best, info


def _checked_against_rtn(
    layer: nn.Module,
    linears: dict[str, tuple[nn.Linear, WeightScheme]],
    best: dict[str, RoundingParams],
    best_norms: NormOffsets,
    inputs: LayerInputs,
    targets: list[torch.Tensor],
    rtn_losses: list[float],
    loss: Literal["mse", "token_relative"],
) -> tuple[dict[str, RoundingParams], dict[str, float]]:
    """``best`` with its loss and RTN's (``rtn_losses``, per sequence) on every calibration
    sample, or RTN if ``best`` lost there: the pick was made on minibatches, so it is checked."""
    everything = list(range(len(inputs.hidden)))
    loss_rtn = sum(rtn_losses) / len(rtn_losses)
    with torch.no_grad():
        weights = _weights(linears, best) | best_norms.weights(layer)
        per_sample = _sample_losses(layer, weights, inputs, targets, everything, loss)
    loss_best = sum(float(v) for v in per_sample) / len(per_sample)  # summed as loss_rtn is
    if loss_best > loss_rtn:
        return _initial(linears), {"loss_rtn": loss_rtn, "loss_tuned": loss_rtn, "kept_rtn": 1.0}
    return best, {"loss_rtn": loss_rtn, "loss_tuned": loss_best, "kept_rtn": 0.0}


def _initial(linears: dict[str, tuple[nn.Linear, WeightScheme]]) -> dict[str, RoundingParams]:
    return {
        n: RoundingParams.initial(lin.weight, s.resolved_group(lin.in_features))
        for n, (lin, s) in linears.items()
    }


@register_pass("quantize.autoround", AutoroundConfig, needs_calibration=True, layerwise=True)
def autoround(model: nn.Module, cfg: AutoroundConfig, state: CompressionState) -> PassReport:
    """Quantize every targeted decoder Linear with learned rounding and clipping, one decoder
    layer at a time; the report gives each layer's block loss before (RTN) and after tuning."""
    report = PassReport("quantize.autoround")
    plan = plan_layers(model, cfg, cfg.n_bits, report)
    experts = plan_experts(model, cfg, cfg.n_bits, report)
    raise_or_report_skips(cfg, report, "quantize.autoround")  # before any work
    per_block: dict[str, dict[str, float]] = {}
    # routed experts: no block-output tuning through the router here; RTN, said per expert
    per_expert: dict[str, str] = {}
    why = "AutoRound: a routed expert is not tuned"
    layer_prefix = arch_for(model, "quantize.autoround").layer_prefix

    float_hidden: list[list[torch.Tensor]] = []  # the float model's states entering the layer

    def process(index: int, layer: nn.Module, inputs: LayerInputs) -> None:
        prefix = f"{layer_prefix}{index}."
        names = [name for name in plan if name.startswith(prefix)]
        if cfg.target == "float_model":
            # the float layer on the float model's states (layer 0: the same inputs), before
            # any swap; advanced for every layer, tuned or not
            entering = float_hidden.pop() if float_hidden else inputs.hidden
            targets = run_layer(layer, replace(inputs, hidden=entering))
            float_hidden.append(targets)
        if not names:
            per_expert.update(rtn_layer_experts(model, experts, prefix, why, cfg.backend))
            return
        linears = {n[len(prefix) :]: (model.get_submodule(n), plan[n]) for n in names}
        if cfg.target == "quantized_inputs":
            targets = run_layer(layer, inputs)  # the float layer, before any swap
        generator = torch.Generator().manual_seed(cfg.seed * 100_003 + index)
        params, info = tune_block(layer, linears, inputs, targets, cfg, generator)
        for rel, (linear, scheme) in linears.items():
            w_q, scales, zeros = quantize_learned(linear.weight, params[rel], scheme)
            quant = QuantLinear.from_linear(
                linear, scheme, w_q=w_q, scales=scales, zeros=zeros, backend="reference"
            )
            set_submodule(model, prefix + rel, quant)
            report.changed.append(prefix + rel)
        log.debug(
            "quantize.autoround: layer %d block loss %.4g (RTN) -> %.4g",
            index,
            info["loss_rtn"],
            info["loss_tuned"],
        )
        per_block[f"{layer_prefix}{index}"] = info
        per_expert.update(rtn_layer_experts(model, experts, prefix, why, cfg.backend))

    # the experts are only run and rounded: streamed, they stay bf16 (one expert widened at once)
    memory = run_calibrated(model, state, process, "quantize.autoround", offload=cfg.offload,
                            narrow="routed")
    finish_quant_report(model, report, cfg.backend, memory)
    report.metrics["per_block"] = per_block
    ratios = [v["loss_tuned"] / v["loss_rtn"] for v in per_block.values() if v["loss_rtn"] > 0]
    report.metrics["mean_loss_ratio_vs_rtn"] = sum(ratios) / len(ratios) if ratios else None
    report.metrics["blocks_kept_rtn"] = int(sum(v["kept_rtn"] for v in per_block.values()))
    report.metrics["per_expert"] = per_expert
    report.changed += list(per_expert)
    report_coverage(model, cfg, report)
    return report
