"""The runtime's output head: the final norm, the head linear (quantized on request:
``LM_HEAD_SCHEMES``) as one of the runtime's linear holders, and the family's logit scaling and
softcap (``RuntimeSpec``).
"""

from __future__ import annotations

import torch
from torch import nn

from compress.arch import Arch, RuntimeSpec
from compress.quant.linear import QuantLinear
from compress.runtime.families import config_value
from compress.runtime.layers import LM_HEAD_SCHEMES, _convert_linear, _IntKernels
from compress.runtime.norms import _norm, _norm_bias, _norm_eps, _norm_weight


class _Head(nn.Module):
    def __init__(
        self,
        model: nn.Module,
        decode,
        notes: list[str],
        kernels: _IntKernels,
        bits: int | None,
        arch: Arch,
        *,
        spec: RuntimeSpec,
        release: bool = False,
    ) -> None:
        super().__init__()
        final_norm = model.get_submodule(arch.final_norm)
        self.norm = _norm_weight(final_norm, arch.norm_form)
        self.norm_bias, self.centered = _norm_bias(final_norm), arch.norm_kind == "layer"
        self.eps = _norm_eps(model.config, spec.norm_eps_key, final_norm)
        self.divisor = config_value(model.config, spec.logits_divisor)
        self.multiplier = config_value(model.config, spec.logits_multiplier)
        self.softcap = config_value(model.config, spec.final_softcap)
        head = model.get_submodule(arch.lm_head)
        if bits is not None and not isinstance(head, QuantLinear):
            # A quantized copy for the head only: tied input embeddings stay as they are.
            head = QuantLinear.from_linear(head, LM_HEAD_SCHEMES[bits])
        # Only the last position's logits are needed, so both phases use the decode weights.
        # Named lm_head whatever the family calls it: the runtime's own name for its head.
        # ``release`` touches only a quantized head of the model's own (a float head may be
        # tied to the embedding, which the runtime reads).
        self.lm_head = _convert_linear(
            head, arch.lm_head, decode, decode, notes, kernels, release=release
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _norm(x, self.norm, self.eps, self.norm_bias, self.centered)
        logits = self.lm_head(h, True)  # [B, V] fp32
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.multiplier is not None:
            logits = logits * self.multiplier
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
