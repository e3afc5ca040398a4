"""Perplexity against a direct computation with the model's own loss (tiny model)."""

from __future__ import annotations

import math

import pytest
import torch
from compress.eval.quality import perplexity

TEXT = "The quick brown fox jumps over the lazy dog. " * 12


@pytest.mark.parametrize(
    "context, stride",
    [(64, 64), (64, 32), (100, 17)],
    ids=["disjoint", "half-overlap", "odd-stride"],
)
def test_perplexity_matches_model_loss(tiny_model, tiny_tokenizer, context, stride):
    result = perplexity(
        tiny_model, tiny_tokenizer, TEXT, context_length=context, stride=stride, progress=False
    )
    ids = torch.tensor(tiny_tokenizer(TEXT, add_special_tokens=False)["input_ids"])
    # Direct: each window's HF loss (mean over labels != -100), labels masked to the new tokens.
    total, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids) - 1, stride):
        end = min(begin + context, len(ids))
        window = ids[begin:end][None]
        labels = window.clone()
        labels[0, : max(prev_end, begin + 1) - begin] = -100
        n = int((labels[0, 1:] != -100).sum())
        if n:
            with torch.no_grad():
                loss = tiny_model(window, labels=labels).loss.double()
            total += float(loss) * n
            count += n
        prev_end = end
        if end == len(ids):
            break
    assert result.scored_tokens == count
    # Overlapping windows score every token but the first; disjoint ones also lose each
    # window's first token (it has no context inside the window).
    expected = len(ids) - 1 if stride < context else len(ids) - result.windows
    assert count == expected
    assert result.perplexity == pytest.approx(math.exp(total / count), rel=1e-5)
    assert result.protocol["stride"] == stride and "token perplexity" in result.protocol["metric"]
