"""Perplexity against independent references: models whose next-token distribution is known in
closed form (uniform logits, a bigram table), and a float64 NLL from the tiny model's logits."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from compress.eval.quality import exp_nll, perplexity

TEXT = "The quick brown fox jumps over the lazy dog. " * 12  # 540 characters = 540 tokens
VOCAB = 320

# (context_length, stride) -> the token positions the protocol scores (module docstring of
# quality.py): with overlapping windows every token but the text's first; with disjoint windows
# also not a window's first token (it has no context inside its window).
WINDOWS = [(64, 64), (64, 32), (100, 17), (77, 77)]
WINDOW_IDS = ["disjoint", "half-overlap", "odd-stride", "disjoint-last-token-opens-a-window"]


def _scored_positions(n: int, context: int, stride: int) -> list[int]:
    if stride < context:
        return list(range(1, n))
    return [t for t in range(1, n) if t % context]  # 77: 539 = 7 x 77, the last token unscored


class BigramModel(nn.Module):
    """Logits at position t are ``table[ids[t]]`` whatever the context: the NLL of every scored
    token is known without running any window loop."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = nn.Parameter(table, requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.table[input_ids])  # [B, T, V]


def _ids(tokenizer) -> torch.Tensor:
    return torch.tensor(tokenizer(TEXT, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize(("context", "stride"), WINDOWS, ids=WINDOW_IDS)
def test_uniform_logits_give_the_vocabulary_size(tiny_tokenizer, context, stride):
    model = BigramModel(torch.zeros(VOCAB, VOCAB))
    result = perplexity(
        model, tiny_tokenizer, TEXT, context_length=context, stride=stride, progress=False
    )
    assert result.perplexity == pytest.approx(VOCAB, rel=1e-6)
    assert result.nll_mean == pytest.approx(math.log(VOCAB), rel=1e-6)
    assert result.scored_tokens == len(_scored_positions(len(_ids(tiny_tokenizer)), context,
                                                         stride))


@pytest.mark.parametrize(("context", "stride"), WINDOWS, ids=WINDOW_IDS)
def test_bigram_model_perplexity_matches_closed_form(tiny_tokenizer, context, stride):
    """Scoring the logits of position t against token t (instead of t + 1), a window's overlap
    scored twice or a token skipped all change the value."""
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    result = perplexity(
        BigramModel(table), tiny_tokenizer, TEXT, context_length=context, stride=stride,
        progress=False,
    )
    ids = _ids(tiny_tokenizer)
    positions = _scored_positions(len(ids), context, stride)
    log_probs = torch.log_softmax(table.double(), dim=-1)
    nll = -sum(float(log_probs[ids[t - 1], ids[t]]) for t in positions) / len(positions)
    assert result.scored_tokens == len(positions)
    assert result.nll_mean == pytest.approx(nll, rel=1e-6)
    assert result.perplexity == pytest.approx(math.exp(nll), rel=1e-6)
    assert result.protocol["stride"] == stride and "token perplexity" in result.protocol["metric"]


def test_one_window_equals_float64_nll_of_the_tiny_models_logits(tiny_model, tiny_tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    ids = torch.tensor(tiny_tokenizer(text, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        logits = tiny_model(ids[None]).logits[0].double()  # one forward: [T, V]
    log_probs = torch.log_softmax(logits, dim=-1)
    expected = -log_probs[torch.arange(len(ids) - 1), ids[1:]].mean().item()
    result = perplexity(tiny_model, tiny_tokenizer, text, context_length=64, progress=False)
    assert result.windows == 1 and result.scored_tokens == len(ids) - 1
    assert result.nll_mean == pytest.approx(expected, rel=1e-6)
    assert result.perplexity == pytest.approx(math.exp(expected), rel=1e-6)


def test_windows_past_the_models_positions_are_refused(tiny_model, tiny_tokenizer):
    """They were scored: a learned position table has no rows there, a RoPE model scores
    extrapolation; 256 positions, the model's own, still run."""
    from compress.core.errors import ConfigError

    positions = tiny_model.config.max_position_embeddings
    with pytest.raises(ConfigError, match=f"context_length {positions + 1} exceeds the "
                                          f"{positions} positions"):
        perplexity(tiny_model, tiny_tokenizer, TEXT * 2, context_length=positions + 1,
                   progress=False)
    result = perplexity(tiny_model, tiny_tokenizer, TEXT * 2, context_length=positions,
                        progress=False, limit=1)
    assert result.windows == 1


def test_a_perplexity_past_floats_range_is_inf_not_an_overflow():
    """A broken model's mean NLL over ~709.8 nats raised OverflowError in math.exp and lost a
    whole ``compress run``."""
    assert exp_nll(2.0) == math.exp(2.0)
    assert exp_nll(709.0) == math.exp(709.0)
    assert exp_nll(710.0) == math.inf and exp_nll(9103.7) == math.inf
