"""Quality: token perplexity over a text (WikiText-2 raw test by default).

Protocol (stated in every result): the whole file is read as one string and tokenized once
without special tokens; windows of ``context_length`` tokens start every ``stride`` tokens
(default: stride = context_length, i.e. non-overlapping windows). In each window only the tokens
not already scored by the previous window are scored, each conditioned on everything before it
in the window; the first token of the text is never scored. Token perplexity =
exp(total negative log-likelihood / number of scored tokens). ``limit`` keeps the first N windows.
Published numbers differ (some use 2048-token windows, some word-level perplexity): compare only
results whose protocol matches.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm


@dataclass
class PerplexityResult:
    perplexity: float
    nll_mean: float
    scored_tokens: int
    windows: int
    protocol: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def window_spans(n_tokens: int, context_length: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) for each window; tokens [first_scored, end) are scored."""
    spans = []
    prev_end = 0
    for begin in range(0, n_tokens - 1, stride):
        end = min(begin + context_length, n_tokens)
        first_scored = max(prev_end, begin + 1)
        if first_scored < end:
            spans.append((begin, end, first_scored))
        prev_end = end
        if end == n_tokens:
            break
    return spans


@torch.no_grad()
def perplexity(
    model: nn.Module,
    tokenizer: Any,
    text: str,
    *,
    context_length: int = 512,
    stride: int | None = None,
    limit: int | None = None,
    source: str = "text",
    progress: bool = True,
) -> PerplexityResult:
    """Token perplexity of ``model`` on ``text`` under the protocol in the module docstring."""
    stride = stride or context_length
    if stride > context_length:
        raise ValueError(f"stride {stride} > context_length {context_length} would skip tokens")
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    spans = window_spans(len(ids), context_length, stride)
    if limit is not None:
        spans = spans[:limit]
    if not spans:
        raise ValueError(f"{source}: text too short to score ({len(ids)} tokens)")
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    for begin, end, first_scored in tqdm(spans, desc="perplexity", disable=not progress):
        window = ids[begin:end].unsqueeze(0).to(device)
        logits = model(window).logits[0].float()  # [T, V]
        # logits at position t predict token t+1
        targets = window[0, first_scored - begin :]
        preds = logits[first_scored - begin - 1 : end - begin - 1]
        nll = torch.nn.functional.cross_entropy(preds, targets, reduction="sum")
        total_nll += float(nll)
        total_tokens += targets.numel()
    nll_mean = total_nll / total_tokens
    protocol = {
        "source": source,
        "tokenization": "whole text, one pass, no special tokens",
        "context_length": context_length,
        "stride": stride,
        "windows": len(spans),
        "limit": limit,
        "total_tokens_in_text": len(ids),
        "metric": "token perplexity = exp(mean NLL over scored tokens)",
    }
    return PerplexityResult(math.exp(nll_mean), nll_mean, total_tokens, len(spans), protocol)
