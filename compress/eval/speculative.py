"""Speculative decoding evaluation: a small draft model proposes, the target verifies.

Greedy speculative decoding (Leviathan et al. 2023; Chen et al. 2023, with greedy acceptance), laid
out as gpt-fast does it: draft and target each run on their own ``compress.runtime.engine.Runtime``
static cache. The draft proposes ``k`` tokens one decode step at a time; the target scores the last
accepted token plus the ``k`` proposals in one forward (``Runtime.score``); proposals are accepted
while they equal the target's own argmax, and the target's argmax at the first mismatch (or after
the last proposal) is appended, so every target forward yields at least one token. Both caches are
rewound to the accepted prefix (``Runtime.rewind``: the rejected slots are simply overwritten
later). The output is the target's greedy output by construction (up to floating-point differences
between one-token and k-token forwards: ``evaluate`` checks it against the target runtime's plain
greedy decoding). Draft and target must share a tokenizer and be models the runtime runs (no
transformers fallback here). Sampling-based acceptance is not implemented. """

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from torch import nn

from compress.eval.latency import Clock, distribution, seq_len_for


@dataclass
class SpeculativeStats:
    proposed: int = 0
    accepted: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0


def speculative_generate(
    target,
    draft,
    prompt: list[int],
    max_new_tokens: int,
    *,
    k: int = 4,
    stats: SpeculativeStats | None = None,
    on_tokens=None,
) -> list[int]:
    """Greedy tokens of the ``target`` runtime after ``prompt``, drafted ``k`` at a time by the
    ``draft`` runtime (both ``compress.runtime.engine.Runtime``, ``max_seq_len`` >= prompt +
    max_new_tokens + k). ``on_tokens(n)`` is called each time n tokens become available."""
    if k < 1:
        raise ValueError(f"k (draft tokens per step) must be >= 1, got {k}")
    stats = stats if stats is not None else SpeculativeStats()
    out = [int(target.prefill(prompt).argmax())]
    draft.prefill(prompt)
    stats.target_forwards += 1
    stats.draft_forwards += 1
    if on_tokens:
        on_tokens(1)
    while len(out) < max_new_tokens:
        seq = prompt + out
        # Invariant: both caches hold seq[:-1]; the last accepted token is not yet fed.
        if draft.position > len(seq) - 1:
            draft.rewind(len(seq) - 1)
        elif draft.position < len(seq) - 1:  # every proposal accepted: feed the last one
            draft.score(seq[draft.position : len(seq) - 1])
            stats.draft_forwards += 1
        proposals, last = [], seq[-1]
        for _ in range(min(k, max_new_tokens - len(out))):
            last = int(draft.score([last])[-1].argmax())
            stats.draft_forwards += 1
            proposals.append(last)
        verdict = target.score([seq[-1], *proposals]).argmax(-1).tolist()  # [1 + k]
        stats.target_forwards += 1
        accepted = 0
        while accepted < len(proposals) and proposals[accepted] == verdict[accepted]:
            accepted += 1
        stats.proposed += len(proposals)
        stats.accepted += accepted
        new = (proposals[:accepted] + [verdict[accepted]])[: max_new_tokens - len(out)]
        out.extend(new)
        target.rewind(len(prompt) + len(out) - 1)
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
    compile: bool = False,
) -> dict[str, Any]:
    """Acceptance rate, tokens per target forward, TPOT of plain vs speculative greedy decoding,
    and whether the outputs are identical, over ``prompts`` (run interleaved, one each). Plain
    and speculative both run on the runtime (``engine`` in the result)."""
    from compress.runtime.engine import Runtime, unsupported_reason

    if max_new_tokens < 2:
        raise ValueError("max_new_tokens must be >= 2 to measure TPOT")
    for role, model in (("target", target), ("draft", draft)):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(
                f"speculative decoding runs on the compress runtime only; the "
                f"{role} cannot run there: {reason}"
            )
    seq = seq_len_for(max(map(len, prompts)) + max_new_tokens + k)
    # the caller's models stay usable (keep_model_weights): a second copy while this runs
    t_runtime = Runtime(target, max_seq_len=seq, compile=compile, keep_model_weights=True)
    d_runtime = Runtime(draft, max_seq_len=seq, compile=compile, keep_model_weights=True)
    stats = SpeculativeStats()
    plain_tpot, spec_tpot, mismatches = [], [], []
    for index, prompt in enumerate(prompts):
        stamps = []
        plain = []
        for token in t_runtime.stream(prompt, max_new_tokens):
            stamps.append(clock())
            plain.append(token)
        plain_tpot.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
        marks: list[tuple[float, int]] = []
        spec = speculative_generate(
            t_runtime,
            d_runtime,
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
        "engine": "runtime",
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
