"""Next-token sampling for the runtime and the scheduler: greedy, or temperature with optional
top-k and top-p (nucleus) filtering and a seeded generator. Non-finite logits are an error, never
a silently decoded token. The scheduler's requests may also adjust their logits first
(``Adjustments``: OpenAI's presence/frequency penalties, the repetition penalty, a logit bias,
a minimum length), with vLLM's definitions. No beam search.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compress.core.errors import NumericsError
from compress.kernels import cpu_elementwise

_NON_FINITE = (
    "the model's next-token logits hold NaN or Inf, so there is nothing to decode; the "
    "checkpoint's weights or scales are corrupt, or the model overflowed in this dtype "
    "(try float32)"
)


def refuse_nan_scores(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """A transformers logits processor (the runtime's fallback, ``generate``): NaN or +inf
    scores are refused as ``_sample`` refuses them (transformers drew token 0 from NaN and the
    text came out empty, exit 0); -inf is a processor's mask (top-k), not a fault."""
    if bool(torch.isnan(scores).any()) or bool(torch.isposinf(scores).any()):
        raise NumericsError(_NON_FINITE)
    return scores


# the largest temperature: past float32's max, logits / T in the logits' float32 are all 0 (every
# token ties; top-k, top-p and min-p then select nothing)
MAX_TEMPERATURE = float(torch.finfo(torch.float32).max)


@dataclass
class _Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None
    min_p: float | None = None  # drop tokens under min_p x the likeliest one's probability


def check_finite(logits: torch.Tensor) -> None:
    """NumericsError unless every logit is finite."""
    # max and min propagate NaN and hold any Inf: two reductions, not a [B, V] bool mask
    # (measured 1.8 ms vs 0.1 ms for 32 x 49152 logits on 2 cores)
    if not (bool(torch.isfinite(logits.amax()).all()) and bool(torch.isfinite(logits.amin()))):
        raise NumericsError(_NON_FINITE)


def _sample(logits: torch.Tensor, s: _Sampling, *, checked: bool = False) -> torch.Tensor:
    """Next tokens [B] from logits [B, V] (greedy when temperature is 0). Non-finite logits are
    refused: argmax of NaN is token 0 and multinomial of NaN fails, both silent garbage.
    ``checked``: the caller checked the model's logits already and these may hold -inf on
    purpose (``adjust_logits``' masked tokens)."""
    # Greedy takes its tokens from max: max(-1) returns the first maximal index as argmax
    # does, and ran in 23 against argmax's 68 us for 1 x 49152 (Xeon, 2026-12-03).
    top, tokens = logits.max(-1)
    if not checked and not (bool(torch.isfinite(top).all())
                            and bool(torch.isfinite(logits.amin()))):
        raise NumericsError(_NON_FINITE)
    if s.temperature <= 0:
        return tokens
    # Shift by the top logit first (softmax does not change): the top becomes 0 and the rest
    # <= 0, so a tiny temperature (1e-300) sends them to -inf rather than overflowing to inf;
    # and divide by no less than the dtype's smallest normal, which 1e-300 would round to 0
    # (0 / 0). Either made softmax NaN, and multinomial raise in the engine thread.
    logits = (logits - top[:, None]) / max(s.temperature, torch.finfo(logits.dtype).tiny)
    if s.top_k is not None:
        kth = torch.topk(logits, min(s.top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p is not None:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = probs.cumsum(-1) - probs >= s.top_p
        # a top_p under float32's smallest (1e-300) compares as 0 and would drop the first too
        drop[:, 0] = False
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if s.min_p is not None:  # after temperature, as vLLM; the likeliest token always stays
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < s.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=s.generator).squeeze(-1)


@dataclass(frozen=True)
class Adjustments:
    """What a request changes in its logits before sampling, as vLLM defines each:
    ``repetition_penalty`` divides the positive logits and multiplies the negative ones of every
    token in the prompt or the output so far; ``frequency_penalty`` subtracts itself times each
    token's count in the output, ``presence_penalty`` itself from each token the output holds;
    ``logit_bias`` adds to the named tokens; until the output has ``min_tokens`` tokens, the
    stop tokens cannot be drawn."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0

    @property
    def active(self) -> bool:
        return self != Adjustments()


def make_adjustments(presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                     repetition_penalty: float = 1.0, logit_bias: dict[int, float] | None = None,
                     min_tokens: int = 0) -> Adjustments:
    return Adjustments(float(presence_penalty), float(frequency_penalty),
                       float(repetition_penalty),
                       tuple(sorted((int(t), float(b)) for t, b in (logit_bias or {}).items())),
                       int(min_tokens))


# make_adjustments' keywords: what a request may pass beside the sampling settings
ADJUSTMENT_KEYS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                   "min_tokens")


def adjust_logits(row: torch.Tensor, a: Adjustments, prompt: list[int], output: list[int],
                  stop_tokens: frozenset[int]) -> torch.Tensor:
    """``row`` [V] adjusted by ``a`` for a request with ``prompt`` and ``output`` so far (a new
    tensor; ``row`` is left as it is)."""
    row = row.float().clone()
    if a.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=row.device)
        values = row[seen]
        # clamped: a penalty near 0 (1e-308) would make positive logits inf, and softmax NaN
        big = torch.finfo(row.dtype).max
        row[seen] = torch.where(values > 0, values / a.repetition_penalty,
                                values * a.repetition_penalty).clamp(-big, big)
    if output and (a.frequency_penalty or a.presence_penalty):
        counts = torch.bincount(torch.tensor(output, device=row.device),
                                minlength=row.numel())[: row.numel()]
        row -= a.frequency_penalty * counts + a.presence_penalty * (counts > 0)
    for token, bias in a.logit_bias:
        row[token] += bias
    if len(output) >= a.min_tokens:  # (sorting a large stop set every token took seconds)
        return row
    masked = sorted(t for t in stop_tokens if 0 <= t < row.numel())
    # stop tokens naming the whole vocabulary leave nothing to draw (softmax of -inf is NaN):
    # then min_tokens cannot hold, and the request stops at its first token
    if 0 < len(masked) < row.numel():
        row[torch.tensor(masked, device=row.device)] = float("-inf")
    return row


def _greedy_fused(logits: torch.Tensor) -> torch.Tensor:
    """``_sample``'s greedy tokens of fp32 CPU logits [B, V] in one C++ pass, the argmax and
    the finite check together (``cpu_elementwise.greedy_tokens``), for callers whose ops are
    built (eager CPU runtimes). Measured on a Xeon, 2 threads, 32 x 49152: max + amin took
    1.1 ms a step."""
    tokens = cpu_elementwise.greedy_tokens(logits)
    if bool((tokens < 0).any()):
        raise NumericsError(_NON_FINITE)
    return tokens


def _make_sampling(
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    device: torch.device | None = None,
    min_p: float | None = None,
) -> _Sampling:
    """Sampling settings; a seed makes a generator on ``device`` (the model's: multinomial on
    CUDA refuses a CPU generator; None: the CPU)."""
    if (
        not 0 <= temperature <= MAX_TEMPERATURE
        or (top_k is not None and top_k < 1)
        or not (top_p is None or 0 < top_p <= 1)
        or not (min_p is None or 0 <= min_p <= 1)
    ):
        raise ValueError(
            f"temperature={temperature} must be finite and >= 0 (at most "
            f"{MAX_TEMPERATURE:.4g}), top_k={top_k} >= 1, top_p={top_p} in (0, 1], "
            f"min_p={min_p} in [0, 1]"
        )
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device or "cpu").manual_seed(seed)
    return _Sampling(temperature, top_k, top_p, generator, min_p or None)
