"""Speculative decoding evaluation: a small draft model proposes, the target verifies.

Greedy speculative decoding (Leviathan et al. 2023; Chen et al. 2023, with greedy acceptance):
the draft proposes ``k`` tokens one at a time with its own KV cache; the target scores the last
accepted token plus the ``k`` proposals in one forward; proposals are accepted while they equal
the target's own argmax, and the target's argmax at the first mismatch (or after the last
proposal) is appended, so every target forward yields at least one token. Both caches are cropped
back to the accepted prefix. The output is the target's greedy output by construction (up to
floating-point differences between one-token and k-token forwards: ``evaluate`` checks it).
Draft and target must share a tokenizer. Sampling-based acceptance is not implemented.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from compress.eval.latency import Clock, distribution, greedy_stream, model_forward, new_cache
from torch import nn


@dataclass
class SpeculativeStats:
    proposed: int = 0
    accepted: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0


def _crop(cache: Any, length: int) -> None:
    # A negative argument removes that many tokens in every transformers version; a positive
    # one (the old absolute length) is rejected by transformers 5.
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def _extend(model: nn.Module, cache: Any, seq: list[int], upto: int, device) -> torch.Tensor | None:
    """Bring ``cache`` to exactly ``upto`` tokens of ``seq`` (crop or feed); logits if fed."""
    have = cache.get_seq_length()
    if have > upto:
        _crop(cache, upto)
        return None
    if have < upto:
        ids = torch.tensor([seq[have:upto]], dtype=torch.long, device=device)
        return model_forward(model, ids, cache)
    return None


@torch.no_grad()
def speculative_generate(
    target: nn.Module,
    draft: nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    *,
    k: int = 4,
    stats: SpeculativeStats | None = None,
    on_tokens=None,
) -> list[int]:
    """Greedy tokens of ``target`` after ``prompt``, drafted ``k`` at a time by ``draft``.

    ``on_tokens(n)`` is called each time n tokens become available (for timing).
    """
    if k < 1:
        raise ValueError(f"k (draft tokens per step) must be >= 1, got {k}")
    stats = stats if stats is not None else SpeculativeStats()
    device = next(target.parameters()).device
    t_cache, d_cache = new_cache(target), new_cache(draft)
    logits = model_forward(target, torch.tensor([prompt], device=device), t_cache)
    stats.target_forwards += 1
    out = [int(logits[0, -1].argmax())]
    if on_tokens:
        on_tokens(1)
    while len(out) < max_new_tokens:
        seq = prompt + out
        # Invariant: both caches hold seq[:-1]; the last accepted token is not yet fed.
        d_logits = _extend(draft, d_cache, seq, len(seq) - 1, device)
        stats.draft_forwards += d_logits is not None
        proposals, last = [], seq[-1]
        for _ in range(min(k, max_new_tokens - len(out))):
            d_logits = model_forward(draft, torch.tensor([[last]], device=device), d_cache)
            stats.draft_forwards += 1
            last = int(d_logits[0, -1].argmax())
            proposals.append(last)
        ids = torch.tensor([[seq[-1], *proposals]], device=device)  # [1, 1 + k]
        verdict = model_forward(target, ids, t_cache)[0].argmax(-1).tolist()  # [1 + k]
        stats.target_forwards += 1
        accepted = 0
        while accepted < len(proposals) and proposals[accepted] == verdict[accepted]:
            accepted += 1
        stats.proposed += len(proposals)
        stats.accepted += accepted
        new = proposals[:accepted] + [verdict[accepted]]
        new = new[: max_new_tokens - len(out)]
        out.extend(new)
        _crop(t_cache, len(prompt) + len(out) - 1)
        if on_tokens:
            on_tokens(len(new))
    return out


def evaluate(
    target: nn.Module,
    draft: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    k: int = 4,
    clock: Clock = time.perf_counter,
) -> dict[str, Any]:
    """Acceptance rate, tokens per target forward, TPOT of plain vs speculative greedy decoding,
    and whether the outputs are identical, over ``prompts`` (run interleaved, one each)."""
    if max_new_tokens < 2:
        raise ValueError("max_new_tokens must be >= 2 to measure TPOT")
    stats = SpeculativeStats()
    plain_tpot, spec_tpot, mismatches = [], [], []
    stream = greedy_stream(target)
    for index, prompt in enumerate(prompts):
        stamps = []
        plain = []
        for token in stream(prompt, max_new_tokens):
            stamps.append(clock())
            plain.append(token)
        plain_tpot.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
        marks: list[tuple[float, int]] = []
        spec = speculative_generate(
            target,
            draft,
            prompt,
            max_new_tokens,
            k=k,
            stats=stats,
            on_tokens=lambda n, marks=marks: marks.append((clock(), n)),
        )
        spec_tpot.append((marks[-1][0] - marks[0][0]) / (len(spec) - 1))
        if spec != plain:
            first = next(i for i, (a, b) in enumerate(zip(spec, plain, strict=False)) if a != b)
            mismatches.append({"prompt": index, "first_mismatch_at": first})
    p50_plain = distribution(plain_tpot, 1e3)["p50"]
    p50_spec = distribution(spec_tpot, 1e3)["p50"]
    return {
        "k": k,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "acceptance_rate": stats.accepted / stats.proposed if stats.proposed else None,
        "tokens_per_target_forward": len(prompts) * max_new_tokens / stats.target_forwards,
        "target_forwards": stats.target_forwards,
        "draft_forwards": stats.draft_forwards,
        "plain_tpot_ms": distribution(plain_tpot, 1e3),
        "speculative_tpot_ms": distribution(spec_tpot, 1e3),
        "tpot_speedup_p50": p50_plain / p50_spec,
        "outputs_identical": not mismatches,
        "mismatches": mismatches,
    }
