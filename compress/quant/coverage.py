"""Quantization coverage: what a quantization pass reached.

``report_coverage`` writes into a pass report the share of the targets' weight elements
that is quantized and the bits per weight over every weight matrix (quantized or not, experts and
routers included), and names every target left in float: a WARNING, or under ``strict`` an
error. Every ``quantize.*`` pass calls it last, so no report can claim 4.5 bits/weight for a
model that is mostly float.
"""

from __future__ import annotations

import logging

from torch import nn

from compress.core.errors import RecipeError
from compress.core.matcher import matches
from compress.core.registry import PassConfig, PassReport
from compress.quant.linear import quantization_coverage

log = logging.getLogger(__name__)


def report_coverage(model: nn.Module, cfg: PassConfig, report: PassReport) -> None:
    """Put the quantization coverage of ``model`` (``modules.quantization_coverage``) into the
    report after a quantization pass: ``quantized_share`` of the targets' weight elements,
    ``bits_per_weight`` and ``weight_bytes_after`` over every weight matrix, quantized or
    not. Targets left in float that ``cfg.ignore`` does not name: a WARNING naming them, or
    under ``strict`` a RecipeError (the router and norms are never targets)."""
    coverage = quantization_coverage(model)
    left = {n: k for n, k in coverage.pop("unquantized").items()  # type: ignore[union-attr]
            if not any(matches(n, None, p) or matches(n.rpartition(".")[0], None, p)
                       for p in cfg.ignore)}
    report.metrics.update(coverage)
    report.metrics["weight_bytes_after"] = report.metrics.pop("weight_bytes")
    report.metrics["unquantized"] = left
    if not left:
        return
    share = coverage["quantized_share"] or 0.0
    listing = "; ".join(f"{n} ({k:,} elements)" for n, k in list(left.items())[:20])
    more = f" (and {len(left) - 20} more)" if len(left) > 20 else ""
    message = (
        f"{report.name}: quantized {share:.1%} of the decoder's weight elements; left in "
        f"float: {listing}{more}"
    )
    if cfg.strict:
        raise RecipeError(
            f"{message}. Fix: use a pass that quantizes them, add them to `ignore`, or set "
            "strict: false."
        )
    log.warning("%s", message)
