"""GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"): ``quantize.gptq``.

For each linear layer, the Hessian of the layer-wise squared error, ``H = 2/n X^T X`` over the
calibration inputs, drives a column-by-column quantization in which each column's rounding error
is spread onto the not-yet-quantized columns through the upper Cholesky factor of ``H^-1``
(optimal-brain-surgeon update), in blocks of ``block_size`` columns with lazy updates of the rest.
Dampening adds ``dampening * mean(diag H)`` to the diagonal; if the Cholesky still fails, the
damping is raised x10 (with a warning) up to ``max_dampening``, then the layer is reported as
singular (skipped, or an error under ``strict``). Group scales are computed when the walk reaches
the group (from the already-updated weights); with ``act_order`` columns are visited in order of
decreasing ``diag(H)`` and the group parameters are computed up front from the original weights
("static groups"), so the export stays a plain contiguous group layout with no ``g_idx``.
Layers are processed one decoder layer at a time (``compress.quant.calibrated``). The result is an
ordinary ``QuantLinear`` (int4 or int8, symmetric or not), so export and reload are unchanged.

Attention sinks: in SmolLM2 (as in most LLMs; Xiao et al. 2023, Sun et al. 2024) the first
token of every sequence becomes an attention sink: from decoder layer 12 on its hidden state is
~100x larger than any other token's and points in its own few directions. Plain GPTQ weighs it
as 1 of T tokens, so it pushes rounding error into exactly those directions (cheap for ordinary
tokens): measured on layer 12 of SmolLM2-135M, q/k/v outputs of the sink token were 30x worse
than RTN's (relative error 0.5-4), every later token attended to a broken sink, and GPTQ W4
ended up no better than RTN (WikiText-2 ppl 45.0 vs 44.7, 8 windows). ``sink_token_weight``
counts the first token of each calibration sequence that many times in H (default: the sequence
length, since every one of the T tokens attends to it); the sink's error then drops below RTN's
while the other tokens keep most of GPTQ's gain (ppl 40.8; `scripts/diag_gptq_layers.py`).
"""

from __future__ import annotations

import logging
import tempfile
from typing import Literal

import torch
from pydantic import Field, field_validator
from torch import nn

from compress.arch import arch_for, expert_weights
from compress.core.device import float_dtype
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
from compress.quant.experts import ExpertPlan, plan_experts, replace_experts
from compress.quant.linear import QuantExperts, QuantLinear, WeightScheme, rtn_codes
from compress.quant.scheme import CalibratedWeightConfig

log = logging.getLogger(__name__)


class GptqConfig(CalibratedWeightConfig):
    """GPTQ settings (plus ``symmetric``, ``scale_dtype``, ``backend``, ``overrides`` of RTN).

    group_size: input channels per scale (None: per output channel); fallback_group_size: for
    layers group_size does not divide (576 with 128 -> 64). dampening: fraction of the mean
    Hessian diagonal added to it (0 < d <= 1). block_size: columns per lazy-update block.
    """

    block_size: int = Field(128, ge=1)
    dampening: float = Field(0.01, gt=0.0, le=1.0)
    max_dampening: float = Field(1.0, gt=0.0)  # give up (singular Hessian) above this
    act_order: bool = False  # visit columns by decreasing diag(H), static groups
    # Weight of each sequence's first token (the attention sink) in H relative to the others;
    # "seq_len": the sequence length T. 1.0 = plain GPTQ. See "Attention sinks" above.
    sink_token_weight: float | Literal["seq_len"] = "seq_len"

    @field_validator("sink_token_weight")
    @classmethod
    def _sink(cls, value: float | str) -> float | str:
        if not isinstance(value, str) and value < 1.0:
            raise ValueError(f"must be >= 1 (1 = plain GPTQ) or 'seq_len', got {value}")
        return value
    offload: OffloadMode = "none"  # where not-yet-processed decoder layers wait


class SingularHessianError(ValueError):
    pass


class HessianHooks:
    """Accumulates ``H = 2/n sum_t w_t x_t x_t^T`` for the given linears (inputs shared by
    several linears, like q/k/v, are multiplied once); ``w_t`` is ``sink_weight`` for the first
    token of each sequence ``[B, T, K]`` ("seq_len": T) and 1 for the others."""

    def __init__(
        self, linears: dict[str, nn.Linear], sink_weight: float | Literal["seq_len"] = 1.0
    ) -> None:
        # Allocated at a linear's first call, on the device where the layer runs (the GPU).
        # Linears fed the very same input tensor (q/k/v, gate/up) share one Hessian object:
        # their sums are identical, so one [K, K] serves them all.
        self.h: dict[str, torch.Tensor] = {}
        self.count = dict.fromkeys(linears, 0)
        self.sink_weight = sink_weight
        self._last: tuple[torch.Tensor | None, str | None] = (None, None)  # (input, its owner)
        self._handles = [m.register_forward_hook(self._hook(n)) for n, m in linears.items()]

    def _hook(self, name: str):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            x = args[0]
            self.count[name] += x.numel() // x.shape[-1]
            last, owner = self._last
            if last is x and owner is not None:
                if name not in self.h:
                    self.h[name] = self.h[owner]  # the same input: the same sum, one tensor
                if self.h[name] is self.h[owner]:
                    return
            x3 = x.detach().to(torch.float32)
            if not torch.isfinite(x3).all():
                raise ValueError(f"{name}: calibration activations contain NaN/Inf")
            weight = x3.shape[1] if self.sink_weight == "seq_len" else self.sink_weight
            if weight != 1.0 and x3.dim() == 3:
                x3 = x3.clone()
                x3[:, 0] *= float(weight) ** 0.5
            x2 = x3.reshape(-1, x.shape[-1])  # [tokens, K]
            if name not in self.h:
                self.h[name] = torch.zeros(x2.shape[1], x2.shape[1], device=x.device)
            _add_gram(self.h[name], x2)
            self._last = (x, name)

        return hook

    def hessian(self, name: str) -> torch.Tensor:
        return self.h[name] * (2.0 / max(self.count[name], 1))

    def take_hessian(self, name: str) -> torch.Tensor:
        """``hessian(name)`` handed over (the hooks forget it): scaled in place when no other
        linear shares it, so one [K, K] is alive instead of two, and none once its linears are
        quantized; a copy while another linear still needs the shared sum."""
        h = self.h.pop(name)
        scale = 2.0 / max(self.count[name], 1)
        if any(other is h for other in self.h.values()):
            return h * scale
        return h.mul_(scale)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._last = (None, None)


# Elements of one row block of the Gram product added to a Hessian (64 MiB in float32).
GRAM_BLOCK_ELEMENTS = 16 << 20


def _add_gram(h: torch.Tensor, x: torch.Tensor) -> None:
    """``h += x^T x`` for ``x [tokens, K]``, a block of rows of the product at a time: the whole
    product is a second [K, K] (764 MB at 13B's down_proj, the peak of its calibration forward).
    Blocks are even and a multiple of 64 rows: with MKL on AVX-512 and AVX2 their entries were
    the whole product's bit for bit at 7B/13B shapes (each is the same dot product over the
    tokens), while blocks of a few rows take other kernels and round differently. ``addmm_``
    would need no block, but it rounds ``h`` into the sum: other numbers than before."""
    k = x.shape[1]
    blocks = -(-k // max(64, GRAM_BLOCK_ELEMENTS // max(k, 1)))
    rows = -(-k // (blocks * 64)) * 64
    for r0 in range(0, k, rows):
        h[r0 : r0 + rows].add_(x[:, r0 : r0 + rows].T @ x)


def _all_finite_by_rows(t: torch.Tensor, rows: int = 1024) -> bool:
    """``torch.isfinite(t).all()`` a block of rows at a time: isfinite of a whole [K, K] makes
    float and bool temporaries of 1.75x its size (1.34 GB at 13B's down_proj, measured)."""
    return all(bool(torch.isfinite(t[i : i + rows]).all()) for i in range(0, t.shape[0], rows))


# A Hessian at least this large is backed up for a damping retry in an unlinked temporary file
# ($TMPDIR) instead of RAM, so that its Cholesky factor can take its place: one [K, K] alive,
# not two (764 MB each at 13B's down_proj). Smaller ones are cloned, as is one on a GPU.
FILE_BACKUP_BYTES = 256 << 20
# Elements of one slab of the lazy update of the later columns (64 MiB in float32).
UPDATE_SLAB_ELEMENTS = 16 << 20


class _Backup:
    """A copy of ``h`` to put back after a failed factorization that overwrote it."""

    def __init__(self, h: torch.Tensor) -> None:
        self.file = None
        if h.device.type != "cpu" or h.numel() * h.element_size() < FILE_BACKUP_BYTES:
            self.copy = h.clone()
            return
        self.copy = None
        self.file = tempfile.TemporaryFile()
        self.file.write(memoryview(h.contiguous().numpy()).cast("B"))

    def restore(self, h: torch.Tensor) -> None:
        if self.file is None:
            h.copy_(self.copy)
            return
        self.file.seek(0)
        if self.file.readinto(memoryview(h.numpy()).cast("B")) != h.numel() * h.element_size():
            raise OSError("gptq: the Hessian's backup file came back short")

    def close(self) -> None:
        self.copy = None
        if self.file is not None:
            self.file.close()


def _inverse_cholesky(h: torch.Tensor, cfg: GptqConfig, name: str) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of ``(H + damp I)^-1``; damping raised x10 on failure. ``h`` is
    the caller's contiguous scratch and becomes the factor: the Cholesky factor, its inverse
    and the inverse's factor are computed in ``h``'s own memory (torch's ``out=`` works in
    place on the column-major view ``h.mT``, which equals ``h``: H is symmetric), so one
    [K, K] is alive instead of four (485 MB each for a 7B down_proj, 764 MB at 13B). The
    result is the same, bit for bit, as factoring a copy. A try that fails puts H back from
    ``_Backup`` before the next."""
    damp = cfg.dampening
    diagonal = h.diagonal().clone()
    mean_diag = float(diagonal.mean())
    info = torch.empty((), dtype=torch.int32, device=h.device)
    factor = h.mT  # Fortran-contiguous, the layout torch's LAPACK calls work in
    backup = _Backup(h)
    try:
        while damp <= cfg.max_dampening:
            if damp != cfg.dampening:
                backup.restore(h)
            h.diagonal().copy_(diagonal).add_(damp * mean_diag)
            torch.linalg.cholesky_ex(factor, out=(factor, info))
            if int(info) == 0:
                torch.cholesky_inverse(factor, out=factor)
                torch.linalg.cholesky_ex(factor, upper=True, out=(factor, info))
                if int(info) == 0 and _all_finite_by_rows(factor):
                    return factor, damp
            log.warning("%s: Cholesky failed with dampening %g; raising it x10", name, damp)
            damp *= 10
    finally:
        backup.close()
    raise SingularHessianError(
        f"{name}: Hessian is singular even with dampening {cfg.max_dampening}; the calibration "
        "inputs of this layer are degenerate (use more/different calibration text, raise "
        "max_dampening, or add the layer to `ignore`)"
    )


def _qparams(w: torch.Tensor, scheme: WeightScheme) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min/max parameters of ``w [N, g]`` (one group) with scales rounded to the stored dtype."""
    scales, zeros = quant_primitives.compute_qparams(
        w,
        n_bits=scheme.n_bits,
        group_size=w.shape[1],
        symmetric=scheme.symmetric,
        grid=scheme.grid,
    )
    return scales.to(scheme.scale_dtype).to(torch.float32), zeros  # [N, 1] each


@torch.no_grad()
def gptq_quantize(
    w: torch.Tensor, h: torch.Tensor | list[torch.Tensor], scheme: WeightScheme, cfg: GptqConfig,
    name: str = "layer",
    *, h_is_scratch: bool = False, walk: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """GPTQ of ``w [N, K]`` given ``h [K, K]`` -> ``(w_q int8 [N, K], scales fp32 [N, K/g],
    zeros int8 [N, K/g] | None, info)``; see the module docstring. ``h_is_scratch``: ``h`` is
    a one-item list holding the caller's Hessian to lose (``HessianHooks.take_hessian``): it
    is taken out of the list, worked on in place instead of copied, and freed once factored
    (a tensor argument would stay alive through the call: the no_grad wrapper holds it).
    ``walk``: the column walk's implementation (``_walk_columns``)."""
    # one copy, from bf16 or float32 alike, rows contiguous (a transposed view, GPT-OSS's
    # experts held [in, out], would keep its strides: the C++ walk reads rows)
    w = w.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    if h_is_scratch:
        if not (isinstance(h, list) and len(h) == 1):
            raise TypeError("h_is_scratch: pass the Hessian as a one-item list, [h]")
        h = h.pop().to(torch.float32).contiguous()
    else:
        h = h.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    n, k = w.shape
    group = scheme.resolved_group(k)
    dead = torch.diag(h) == 0  # inputs that are always zero: any weight works, use 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    dev = w.device
    perm = (torch.argsort(torch.diag(h), descending=True) if cfg.act_order
            else torch.arange(k, device=dev))
    n_groups = k // group
    scales = torch.ones(n, n_groups, device=dev)
    zeros = None if scheme.symmetric else torch.zeros(n, n_groups, dtype=torch.int8, device=dev)
    static = cfg.act_order or scheme.group_size is None
    if static:  # parameters from the original weights, in the original column order
        for g in range(n_groups):
            s, z = _qparams(w[:, g * group : (g + 1) * group], scheme)
            scales[:, g : g + 1] = s
            if zeros is not None:
                zeros[:, g : g + 1] = z
    if cfg.act_order:  # without it the order is the identity: no permuted copies
        w, h = w[:, perm].contiguous(), h[perm][:, perm]
    hinv, damp = _inverse_cholesky(h, cfg, name)  # in h's memory
    del h
    codes = torch.zeros(n, k, dtype=torch.int8, device=dev)  # whole numbers: exact in int8
    block = max(cfg.block_size // group, 1) * group if not static else cfg.block_size
    order = perm.tolist()
    losses = torch.zeros(n, device=dev)
    _walk_columns(w, hinv, scales, zeros, codes, losses, order, block, group, static, scheme,
                  walk=walk)
    loss = float(losses.sum()) / 2
    return codes, scales, zeros, {"dampening": damp, "gptq_loss": loss}


def _walk_columns(
    w: torch.Tensor,
    hinv: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    codes: torch.Tensor,
    losses: torch.Tensor,
    order: list[int],
    block: int,
    group: int,
    static: bool,
    scheme: WeightScheme,
    *,
    walk: str = "auto",
) -> None:
    """The GPTQ column loop (in place on w, scales, zeros, codes, losses); w and hinv are in
    visiting order, ``order[j]`` is the original index of visited column j. Each block walks
    group by group (a dynamic group's parameters come from the block's updated columns when
    the walk reaches it), then the columns after the block take the block's errors at once.
    ``walk``: "torch" (``_walk_block``, the reference), "triton" (``kernels.gptq_walk``),
    "cpu" (``kernels.cpu_gptq``) or "auto" (Triton on a GPU where it runs, the C++ walk on a
    CPU where it builds, else torch)."""
    n, k = w.shape
    dev = w.device
    qmin, qmax = quant_primitives.code_range(scheme.n_bits)
    slab = max(block, UPDATE_SLAB_ELEMENTS // max(n, 1))
    kernel = _block_walker(w, min(block, k), walk)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, err1, hinv1 = (
            w[:, i1:i2].clone(),
            torch.zeros(n, i2 - i1, device=dev),
            hinv[i1:i2, i1:i2],
        )
        cols = order[i1:i2]
        starts = [i for i, col in enumerate(cols) if not static and col % group == 0]
        bounds = sorted({0, *starts, i2 - i1})
        walked = kernel(w1, hinv1, cols, group)
        for a, b in zip(bounds, bounds[1:], strict=False):
            if not static and cols[a] % group == 0:  # group starts here: params from updated w
                g = cols[a] // group
                s, z = _qparams(w1[:, a : a + group], scheme)
                scales[:, g : g + 1] = s
                if zeros is not None:
                    zeros[:, g : g + 1] = z
            walked(a, b, scales, zeros, codes, err1, losses, qmin, qmax)
        # the later columns in slabs: the product for all of them at once is a temporary as
        # large as w (283 MB at 13B's down_proj, the walk's peak)
        for c1 in range(i2, k, slab):
            c2 = min(c1 + slab, k)
            w[:, c1:c2] -= err1 @ hinv[i1:i2, c1:c2]


def _block_walker(w: torch.Tensor, width: int, walk: str):
    """``kernel(w1, hinv1, cols, group)`` -> ``walked(a, b, scales, zeros, codes, err1,
    losses, qmin, qmax)``, which walks columns a..b-1 of one block: the reference or Triton."""
    if walk not in ("auto", "torch", "triton", "cpu"):
        raise ValueError(f"walk={walk!r}: expected auto, torch, triton or cpu")
    use_triton = walk == "triton" or (walk == "auto" and _triton_walk_reason(w, width) is None)

    def torch_kernel(w1, hinv1, cols, group):
        diag = torch.diag(hinv1).tolist()

        def walked(a, b, *rest):
            if w1.device.type != "cpu":
                return _walk_block(w1, hinv1, diag, cols, group, a, b, *rest)
            # thousands of tiny ops: on a CPU, thread hand-offs cost more than they save
            # (measured ~3x slower with 2 threads on a loaded machine), so on one
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                _walk_block(w1, hinv1, diag, cols, group, a, b, *rest)
            finally:
                torch.set_num_threads(threads)

        return walked

    if walk == "cpu" or (walk == "auto" and not use_triton):
        from compress.kernels import cpu_gptq

        reason = cpu_gptq.unavailable_reason(w.device)
        if reason is None:
            return _cpu_walker
        if walk == "cpu":
            raise ValueError(f"walk='cpu': {reason}")
    if not use_triton:
        return torch_kernel
    from compress.kernels.gptq_walk import gptq_walk_triton

    failed: list[str] = []  # a kernel that does not build: the rest walks in torch

    def triton_kernel(w1, hinv1, cols, group):
        if failed:
            return torch_kernel(w1, hinv1, cols, group)
        index = torch.tensor(cols, dtype=torch.int32, device=w1.device)
        groups = index // group

        def walked(a, b, *rest):
            if not failed:
                try:
                    scales, zeros, codes, err1, losses, qmin, qmax = rest
                    return gptq_walk_triton(w1, hinv1, scales, zeros, codes, err1, losses,
                                            index, groups, a, b, qmin=qmin, qmax=qmax)
                except Exception as exc:  # noqa: BLE001  (a build failure: nothing written yet)
                    if walk == "triton":
                        raise
                    failed.append(f"{type(exc).__name__}: {exc}")
                    log.warning("GPTQ: the Triton column walk failed (%s); walking in torch",
                                failed[0][:300])
            return torch_kernel(w1, hinv1, cols, group)(a, b, *rest)

        return walked

    return triton_kernel


def _cpu_walker(w1, hinv1, cols, group):
    """``_block_walker``'s kernel through ``compress.kernels.cpu_gptq.walk`` (all threads: each
    takes whole rows)."""
    from compress.kernels import cpu_gptq

    index = torch.tensor(cols, dtype=torch.int32)
    groups = index // group
    hinv1 = hinv1.contiguous()  # a [width, width] view of the whole factor

    def walked(a, b, scales, zeros, codes, err1, losses, qmin, qmax):
        cpu_gptq.walk(w1, hinv1, scales, zeros, codes, err1, losses, index, groups, a, b, qmin,
                      qmax)

    return walked


def _triton_walk_reason(w: torch.Tensor, width: int) -> str | None:
    """Why ``walk="auto"`` walks this weight in torch: not on a GPU, no triton, too wide."""
    if w.device.type != "cuda":
        return f"on {w.device} the torch walk runs (the kernel is for GPUs)"
    from compress.kernels import dispatch

    if not dispatch.triton_importable():
        return "triton is not importable"
    from compress.kernels import gptq_walk

    return gptq_walk.unsupported_reason(w, width) or _walk_self_check(w.device)


# device -> why the Triton walk is not used there (None: it agreed with the torch walk)
_WALK_CHECKED: dict[str, str | None] = {}


def _walk_self_check(device: torch.device) -> str | None:
    """Once per device and process, before ``walk="auto"`` trusts the kernel with a model:
    GPTQ of a small random problem (48 x 256, groups of 32 and per channel, asymmetric) through
    both walks on ``device``; a disagreement beyond rounding ties turns the kernel off there
    with a warning (the reason), so a miscompiled kernel cannot quantize a model wrong
    silently. About 4k columns of the torch walk: well under a second on a GPU."""
    key = str(device)
    if key not in _WALK_CHECKED:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(48, 256, generator=g)
        x = torch.randn(512, 256, generator=g) * torch.rand(256, generator=g)
        h = (x.T @ x / 512).to(device)
        w = w.to(device)
        reason = None
        for scheme in (WeightScheme(4, 32, symmetric=False), WeightScheme(4, None)):
            try:
                ref = gptq_quantize(w, h, scheme, GptqConfig(), walk="torch")
                got = gptq_quantize(w, h, scheme, GptqConfig(), walk="triton")
            except Exception as exc:  # noqa: BLE001  (a kernel that does not build or run)
                reason = f"the kernel failed its self-check: {type(exc).__name__}: {exc}"[:300]
                break
            same = (got[0] == ref[0]).float().mean().item()
            loss, ref_loss = got[3]["gptq_loss"], ref[3]["gptq_loss"]
            if same < 0.999 or abs(loss - ref_loss) > 1e-4 * abs(ref_loss):
                reason = (f"the kernel disagreed with the torch walk on its self-check "
                          f"({100 * (1 - same):.2f}% of codes, loss {loss:.6g} against "
                          f"{ref_loss:.6g})")
                break
        if reason is not None:
            log.warning("GPTQ on %s: %s; walking in torch", device, reason)
        _WALK_CHECKED[key] = reason
    return _WALK_CHECKED[key]


def _walk_block(w1, hinv1, diag, cols, group, a, b, scales, zeros, codes, err1, losses,
                qmin, qmax) -> None:
    """Columns a..b-1 of one block, one at a time (the reference of ``kernels.gptq_walk``):
    round with the column's group parameters, then spread the scaled error onto the block's
    later columns through row i of ``hinv1``."""
    for i in range(a, b):
        col = cols[i]  # original column index
        g = col // group
        s = scales[:, g]
        z = zeros[:, g].to(torch.float32) if zeros is not None else 0.0
        wi = w1[:, i]
        q = torch.round(wi / s).add_(z).clamp_(qmin, qmax)
        codes[:, col] = q
        err = (wi - (q - z) * s).div_(diag[i])
        losses += err * err  # OBS loss of this column's rounding (x2)
        w1[:, i:].addr_(err, hinv1[i, i:], alpha=-1.0)  # spread the error onto later columns
        err1[:, i] = err


@register_pass("quantize.gptq", GptqConfig, needs_calibration=True, layerwise=True)
def gptq(model: nn.Module, cfg: GptqConfig, state: CompressionState) -> PassReport:
    """Quantize every targeted decoder Linear with GPTQ, one decoder layer at a time."""
    report = PassReport("quantize.gptq")
    plan = plan_layers(model, cfg, cfg.n_bits, report)
    experts = plan_experts(model, cfg, cfg.n_bits, report)
    expert_info: dict[str, dict[str, object]] = {}
    raise_or_report_skips(cfg, report, "quantize.gptq")  # before any work
    per_layer: dict[str, dict[str, float]] = {}

    layer_prefix = arch_for(model, "quantize.gptq").layer_prefix

    def process(index: int, layer: nn.Module, inputs: LayerInputs) -> None:
        prefix = f"{layer_prefix}{index}."
        linears = {name: model.get_submodule(name) for name in plan if name.startswith(prefix)}
        hooks = HessianHooks(linears, cfg.sink_token_weight)
        try:
            run_layer(layer, inputs, keep=False)
        finally:
            hooks.remove()
        # one linear at a time, each float weight and Hessian dropped once it is quantized:
        # the peak holds one linear's GPTQ state, not the layer's
        for name in list(linears):
            linear = linears.pop(name)
            try:
                w_q, scales, zeros, info = gptq_quantize(
                    linear.weight, [hooks.take_hessian(name)], plan[name], cfg, name,
                    h_is_scratch=True,
                )
            except SingularHessianError as exc:
                if cfg.strict:
                    raise
                log.warning("quantize.gptq: skipping %s (kept in float): %s", name, exc)
                report.skipped[name] = str(exc)
                continue
            quant = QuantLinear.from_linear(
                linear, plan[name], w_q=w_q, scales=scales, zeros=zeros, backend="reference"
            )
            set_submodule(model, name, quant)
            report.changed.append(name)
            per_layer[name] = info
        hooks.h.clear()
        expert_info.update(gptq_experts(model, index, layer, inputs, experts, cfg, report))

    # narrow: a streamed bf16 layer stays bf16 (GPTQ reads each weight as a float32 copy and
    # changes none in place), half a layer's float32 copy less at the peak
    memory = run_calibrated(model, state, process, "quantize.gptq", offload=cfg.offload,
                            narrow=True)
    finish_quant_report(model, report, cfg.backend, memory)
    finish_experts(model, list(experts), cfg.backend, report)
    report.metrics["per_layer"] = per_layer
    report.metrics["max_dampening_used"] = max(
        (v["dampening"] for v in per_layer.values()), default=None
    )
    report.metrics["per_expert"] = expert_info
    report_coverage(model, cfg, report)
    return report


# ---- mixture-of-experts -------------------------------------------------------------------
# Each expert is calibrated on the tokens its router sends it (as at inference), not on all
# tokens: forcing every token through every expert would fit experts to inputs they never see.
# An expert gets GPTQ only with at least as many routed calibration tokens as its inputs have
# channels (K): below that its Hessian X^T X is rank-deficient and only the dampening holds
# it up, so GPTQ fits the few tokens it saw; RTN is used instead, and the report says so
# (``per_expert``). ``sink_token_weight`` is not applied to experts (tokens are regrouped).
# Measured on the tiny random models (tests/quant/test_moe.py, 192 calibration tokens):
# gate/up output error on the routed tokens is 0.73-0.84x RTN's; the held-out logit error
# is the same as with RTN experts (Mixtral 0.0849 vs 0.0848, Qwen3-MoE 0.1181 vs 0.1175):
# random weights and tokens give near-isotropic Hessians, so a real MoE is needed to measure
# the end-to-end gain.
MIN_TOKENS_PER_CHANNEL = 1.0


def gptq_experts(
    model: nn.Module,
    index: int,
    layer: nn.Module,
    inputs: LayerInputs,
    plan: ExpertPlan,
    cfg: GptqConfig,
    report: PassReport,
) -> dict[str, dict[str, object]]:
    """GPTQ of every expert of decoder layer ``index`` (if planned) on the calibration tokens
    the router sends it: ``H_e = 2/n_e X_e^T X_e`` for gate and up, and, from those quantized,
    ``act(gate(X_e)) * up(X_e)`` for down. Experts with too few tokens (or a singular
    Hessian) are quantized with RTN instead. Returns ``{"<experts>.<e>": {tokens, method,
    reason?}}``."""
    arch = arch_for(model, "quantize.gptq")
    assert arch.moe is not None or not plan
    name = f"{arch.layer_prefix}{index}.{arch.moe.fused}" if arch.moe else ""
    if name not in plan:
        return {}
    fused, schemes = plan[name]
    chunks = _expert_inputs(layer, model.get_submodule(name), inputs)  # the view (narrow)
    quant = QuantExperts.like(fused, arch.moe, schemes, float_dtype(fused), backend="reference")
    info = {}
    for e in range(quant.num_experts):
        routed = [(x, (picks == e).any(dim=-1)) for x, picks in chunks]
        weights = tuple(w.detach() for w in expert_weights(fused, arch.moe, e))
        info[f"{name}.{e}"] = _gptq_expert(quant, e, routed, weights, cfg, f"{name}.{e}")
        if info[f"{name}.{e}"]["method"] == "rtn":
            log.warning("quantize.gptq: %s: %s", f"{name}.{e}", info[f"{name}.{e}"]["reason"])
    replace_experts(model, name, fused, quant)
    return info


def finish_experts(model: nn.Module, names: list[str], backend: str, report: PassReport) -> None:
    """The new QuantExperts to the configured backend (they calibrated on the reference path),
    listed as changed."""
    for name in names:
        for linear in model.get_submodule(name).quant_linears():
            linear.backend = backend
            linear._prepared.clear()
        report.changed.append(name)


def _expert_inputs(
    layer: nn.Module, experts: nn.Module, inputs: LayerInputs
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The tokens entering ``experts`` over the calibration set, per sample: ``(x [T_s, H]``
    float32, kept as the layer's inputs are (``LayerInputs.keep``: in files when they are),
    the router's picks ``[T_s, k])`` (one extra forward of the layer). Not concatenated: each
    expert takes its own rows of each, so all tokens never sit in memory twice."""
    chunks = []

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        x = args[0].detach().to(torch.float32).reshape(-1, args[0].shape[-1])
        if not torch.isfinite(x).all():
            raise ValueError(
                "quantize.gptq: calibration activations entering an MoE block are NaN/Inf")
        chunks.append((inputs.keep(x), args[1].detach().reshape(x.shape[0], -1)))

    handle = experts.register_forward_hook(hook)
    try:
        run_layer(layer, inputs, keep=False)
    finally:
        handle.remove()
    return chunks


def _gram(rows) -> torch.Tensor:
    """``X^T X`` of the row blocks ``rows`` (each ``[n_i, K]``) stacked, summed block by block
    so that the rows of all samples never sit in memory at once."""
    total = None
    for block in rows:
        total = block.T @ block if total is None else total.addmm_(block.T, block)
    return total


def _gptq_expert(
    quant: QuantExperts,
    e: int,
    routed: list[tuple[torch.Tensor, torch.Tensor]],
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cfg: GptqConfig,
    name: str,
) -> dict[str, object]:
    """Fill expert ``e`` of ``quant`` from ``weights`` (gate, up, down): GPTQ on its routed
    tokens (``routed``: per calibration sample, its tokens ``[T_s, H]`` and which go to ``e``)
    or RTN when there are too few; returns the report entry. The Hessians are summed sample by
    sample: a 2048-token x 128-sample calibration sends a Mixtral expert ~65k tokens, whose
    inputs and down's inputs (``[n, H + I]``) would be 4.8 GB at once."""
    gate, up, down = quant.projections(e)
    n = sum(int(mask.sum()) for _, mask in routed)
    entry: dict[str, object] = {"tokens": n, "method": "gptq"}
    need = MIN_TOKENS_PER_CHANNEL * max(quant.hidden, quant.intermediate)
    if n < need:
        reason = f"{n} calibration tokens (GPTQ needs >= {need:g}) -> RTN"
        return _rtn_expert(quant, e, weights, entry | {"reason": reason})
    def rows():
        return (x[mask] for x, mask in routed if mask.any())

    def down_inputs():  # from the quantized gate/up
        return (quant.activation(gate(xe), up(xe)) for xe in rows())

    try:
        h = _gram(rows()) * (2.0 / n)
        for layer, w in ((gate, weights[0]), (up, weights[1])):
            w_q, scales, zeros, _ = gptq_quantize(w, h, layer.scheme, cfg, name)
            layer.set_quantized(w_q, scales, zeros)
        del h
        w_q, scales, zeros, _ = gptq_quantize(
            weights[2], _gram(down_inputs()) * (2.0 / n), down.scheme, cfg, name
        )
        down.set_quantized(w_q, scales, zeros)
    except SingularHessianError as exc:
        return _rtn_expert(quant, e, weights, entry | {"reason": f"{exc} -> RTN"})
    return entry


def _rtn_expert(
    quant: QuantExperts, e: int, weights: tuple[torch.Tensor, ...], entry: dict[str, object]
) -> dict[str, object]:
    for layer, w in zip(quant.projections(e), weights, strict=True):
        layer.set_quantized(*rtn_codes(w.detach(), layer.scheme))
    return entry | {"method": "rtn"}
