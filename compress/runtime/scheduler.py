"""Continuous batching over the paged KV cache: requests join the running batch at token
boundaries and leave when they finish.

Each ``step``:
1. every running request that is decoding gets the slot for its next token; when no block is
   left, the most recently admitted request is preempted (its blocks released, its tokens kept;
   it re-enters the queue at the front and recomputes its cache, mostly from the prefix cache);
2. prompts are prefilled in chunks under a token budget per step (``prefill_budget``, the
   decode rows included when they share the forward), oldest first, so a long prompt delays
   running decodes by one chunk rather than by its whole length;
   waiting requests are admitted while a batch slot, budget and blocks for their first chunk
   are there (admission control: never more than memory allows, never a crash);
3. one forward for the decode rows and the prefill chunks together: every projection reads
   its weights once per step (attention per request). Where the phases compute differently
   (other matmul dtypes, or a chunk long enough to leave our integer kernels for a float GEMM)
   they run as two forwards, so a request's tokens do not depend on what it was batched with
   beyond float rounding (except on CPUs with AMX-BF16, whose int4 layers take bf16 activations
   in steps of 10 rows or more: ``cpu_q8.bf16_amx_min_rows``);
4. each request samples with its own settings and seeded generator; a stop token or its
   length limit retires it, and its full blocks stay in the prefix cache.

A failing step does not stop the others' requests. Where one request's own work raised (its
sampling, logit adjustments, log-probs or prompt scores) only that request finishes, with
``finish_reason="error"`` and the message on its event; where the batched forward raised, every
request of that forward does, their blocks freed (the cache they wrote is never read: nothing
of that forward is counted as computed or registered in the prefix cache). Either way the
exception is logged with its traceback and the next step runs as on a fresh scheduler.
``forward_failures`` counts failed forwards since the last one that ran, for a caller that gives
up on a broken model (the server does after a few).

A request's cache holds ``num_computed`` of its ``tokens`` (prompt + output); the last output
token is fed by the next decode step. Prefix caching: on admission the full blocks of its tokens
(all but the last token, which must be computed for logits) are looked up by content key
(``runtime/blocks.py``) and held instead of recomputed. The model of this design is nano-vllm.

Not done: speculative decoding through the scheduler, swapping preempted caches to memory
elsewhere (preemption recomputes), a paged-attention kernel for prefill chunks that follow
cached keys (they gather, ``runtime/paged.py``).
"""

from __future__ import annotations

import itertools
import logging
import math
import sys
from dataclasses import dataclass, field

import torch

from compress.kernels import cpu_attention
from compress.runtime.blocks import ROOT_KEY, BlockPool, block_key
from compress.runtime.decode_stack import build as build_decode_stack
from compress.runtime.engine import Runtime
from compress.runtime.paged import (
    FP8,
    KV_DTYPES,
    PagedKVCache,
    Segment,
    forward_step,
    kv_bytes_per_token,
)
from compress.runtime.sampling import (
    Adjustments,
    _greedy_fused,
    _make_sampling,
    _sample,
    _Sampling,
    adjust_logits,
    check_finite,
    make_adjustments,
)

log = logging.getLogger(__name__)

ATTENTION = ("auto", "kernel", "reference")  # how decode steps attend (Scheduler)


class RequestError(ValueError):
    """A request that cannot run, naming the request field at fault (``param``, as OpenAI's
    errors do; ``compress serve`` answers it with a 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(eq=False)  # identity: the scheduler's list lookups compare objects, not fields
class Sequence:
    """One request's state in the scheduler."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    sampling: _Sampling
    stop: frozenset[int]
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)  # block table, token order
    keys: list[bytes] = field(default_factory=list)  # content keys of the full blocks
    num_computed: int = 0  # tokens whose K/V are in the cache
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    admitted: int = -1  # admission order (preemption takes the newest)
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    preemptions: int = 0
    logprobs: int | None = None  # None: none asked; k: each token's log-prob and the top k
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (after the first)
    # prompt position p (1..P-1) -> (log-prob of prompt[p], its top k), as prefill computes them
    prompt_scores: dict[int, tuple[float, tuple[tuple[int, float], ...]]] = field(
        default_factory=dict)
    adjustments: Adjustments = Adjustments()  # penalties, logit bias, minimum length

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def scores_prompt(self) -> bool:
        """Whether prefill must still score this request's prompt positions (so none of them
        may come from the prefix cache)."""
        return self.prompt_logprobs is not None and len(self.prompt_scores) < len(self.prompt) - 1


@dataclass(frozen=True)
class Event:
    """A token for request ``id``; ``finish_reason`` set on its last event (``"error"``: no
    token, and ``error`` says what failed)."""

    id: int
    token: int | None
    finish_reason: str | None = None
    # the model's log-probability of ``token`` and its top-k (token, log-prob) alternatives,
    # where the request asked for them (``Scheduler.add(logprobs=k)``)
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    # on a request's first event, where it asked (``Scheduler.add(prompt_logprobs=k)``): each
    # prompt token's after the first, (log-prob, top k), in prompt order
    prompt_logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] | None = None
    # with finish_reason "error" (and no token): what failed, for the request's client
    error: str | None = None


def _logprobs(seqs: list[Sequence], logits: torch.Tensor,
              tokens: dict[int, int]) -> dict[int, tuple[float, tuple[tuple[int, float], ...]]]:
    """Row -> (log-prob of its token, its top-k (token, log-prob)) for the rows whose request
    asked (``Sequence.logprobs``) and have a token in ``tokens``: one log-softmax over those
    rows only."""
    rows = [i for i, s in enumerate(seqs) if s.logprobs is not None and i in tokens]
    if not rows:
        return {}
    logp = logits[rows].float().log_softmax(-1)
    out = {}
    for r, i in enumerate(rows):
        k = seqs[i].logprobs
        top = torch.topk(logp[r], k) if k else None
        pairs = () if top is None else tuple(zip(top.indices.tolist(), top.values.tolist(),
                                                 strict=True))
        out[i] = (float(logp[r, tokens[i]]), pairs)
    return out


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    return _sample(logits, _Sampling())


@dataclass
class SchedulerStats:
    steps: int = 0
    decode_rows: int = 0  # sum over steps of the decode batch size
    prefill_tokens: int = 0  # tokens computed by prefill chunks
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission)
    cached_prompt_tokens: int = 0  # of those, served by the prefix cache
    preemptions: int = 0
    peak_blocks: int = 0
    mixed_steps: int = 0  # steps whose decode rows and prefill chunks ran as one forward
    failed_requests: int = 0  # requests finished with an error (``Event.error``)
    failed_forwards: int = 0  # batched forwards that raised (their requests among the above)

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else None


class Scheduler:
    """Continuous batching for one ``Runtime`` (its layers, head and rope tables; not its
    contiguous cache). ``kv_memory``: bytes for the paged cache (or ``num_blocks``);
    ``max_batch``: requests running at once; ``prefill_budget``: tokens computed per step,
    prompt tokens plus the decode rows where both run as one forward (at least a block of
    prompt tokens a step; see ``mixed_reason``); ``mix``: False runs decode rows and chunks as
    two forwards always; ``kv_dtype``: ``None`` (the runtime's KV dtype), ``"float32"``,
    ``"bfloat16"``, ``"int8"`` or ``"fp8"`` (e4m3 with the runtime's ``kv_scales``, from the
    checkpoint; 1.0 each without, with a warning); ``attention``: how decode steps attend,
    ``"kernel"`` (read each row's slots in the pool: ``kernels.cpu_attention``, CPU),
    ``"reference"`` (gather the rows' blocks, then the contiguous runtime's attention: its
    numbers bit for bit; int8 and fp8 pages dequantized to the runtime's KV dtype first) or
    ``"auto"`` (the kernel where it runs); ``decode_stack``: decode-only steps run their layers
    as one C++ call where it computes what the Python loop does (``runtime/decode_stack.py``;
    ``decode_stack_reason`` says why not), False: always the Python loop."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        kv_memory: int | None = None,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_batch: int = 32,
        prefill_budget: int = 256,
        kv_dtype: str | None = None,
        prefix_caching: bool = True,
        attention: str = "auto",
        mix: bool = True,
        decode_stack: bool = True,
    ) -> None:
        if runtime.fallback_reason is not None:
            raise ValueError(f"the runtime does not run this model: {runtime.fallback_reason}")
        if block_size < 1 or max_batch < 1 or prefill_budget < 1:
            raise ValueError(
                f"block_size={block_size}, max_batch={max_batch} and prefill_budget="
                f"{prefill_budget} must be >= 1"
            )
        if kv_dtype is not None and kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype={kv_dtype!r}: expected one of {list(KV_DTYPES)}")
        self.runtime = runtime
        first = runtime.layers[0]
        dtype = runtime.kv_dtype if kv_dtype is None else KV_DTYPES[kv_dtype]
        per_block = block_size * kv_bytes_per_token(
            len(runtime.layers), first.n_kv, first.head_dim, dtype, first.values_in_keys
        )
        if num_blocks is None:
            if kv_memory is None:
                raise ValueError("give the paged cache kv_memory (bytes) or num_blocks")
            num_blocks = kv_memory // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_memory={kv_memory} bytes holds no block of {block_size} tokens "
                f"({per_block} bytes each); give more KV memory"
            )
        # int8 and fp8 pages dequantize to the dtype the contiguous runtime would attend in
        compute = runtime.kv_dtype if dtype in (torch.int8, FP8) else dtype
        kv_scales = None
        if dtype == FP8:
            kv_scales = runtime.kv_scales
            if kv_scales is None:
                log.warning("fp8 KV pages without calibrated scales: every scale is 1.0 and keys "
                            "or values beyond +-448 saturate; run quantize.kv_cache_fp8 on the "
                            "checkpoint")
        self.cache = PagedKVCache(
            n_layers=len(runtime.layers),
            num_blocks=num_blocks,
            block_size=block_size,
            n_kv=first.n_kv,
            head_dim=first.head_dim,
            dtype=dtype,
            compute_dtype=compute,
            device=runtime.device,
            kv_scales=kv_scales,
            values_in_keys=first.values_in_keys,
        )
        self.cache.fused_writes = (
            runtime.layers[0].fused and dtype in (torch.float32, torch.bfloat16, torch.int8)
        )
        if attention not in ATTENTION:
            raise ValueError(f"attention={attention!r}: expected one of {ATTENTION}")
        why_not = cpu_attention.unavailable_reason(dtype, runtime.device,
                                                   runtime.layers[0].head_dim)
        if attention == "kernel" and why_not is not None:
            raise ValueError(f"attention='kernel' cannot run: {why_not}")
        # the reason the decode steps gather instead (None: they run the kernel)
        self.attention_reason = "asked for" if attention == "reference" else why_not
        # decode-only steps' layers in one C++ call (None: the Python loop, for the reason)
        self.decode_stack, self.decode_stack_reason = None, "asked for"
        if decode_stack and self.attention_reason is not None:
            self.decode_stack_reason = f"decode attention gathers ({self.attention_reason})"
        elif decode_stack:
            self.decode_stack, self.decode_stack_reason = build_decode_stack(runtime)
        # Why a step's decode rows and prefill chunks run as two forwards (None: one, below
        # ``mixed_rows`` rows). One forward reads the weights once: measured on a Xeon (2
        # threads, 1.1B shape, bf16) a step of 8 decode rows and a 128-token chunk took 378 ms
        # as two forwards, 104 + 271 alone. Mixing needs both phases to compute alike: the same
        # matmul dtype, and rows under the count from which a layer of our integer kernels
        # leaves them for a float GEMM (``_Q8Kernel.float_rows``): decode rows mixed into a long
        # chunk would otherwise skip the activation rounding, and their tokens would then
        # depend on what they were batched with. (Not so for the AMX-BF16 op, which takes every
        # step of ``cpu_q8.bf16_amx_min_rows()`` rows, decode-only ones too: there a request's
        # rounding follows its step's row count whether or not the step mixes.)
        self.mixed_reason = None if mix else "asked for"
        if mix and runtime.prefill_dtype != runtime.decode_dtype:
            self.mixed_reason = (
                f"prefill matmuls in {runtime.prefill_dtype}, decode in {runtime.decode_dtype}"
            )
        self.mixed_rows = runtime.float_gemm_rows or sys.maxsize
        self.pool = BlockPool(num_blocks, prefix_caching=prefix_caching)
        # The default budget of 256 rows: oneDNN's bf16 GEMM on a Xeon with AMX (2 threads, the
        # 1.1B shape's 22 layers, weights from memory) takes 276 ms at 256 rows and 513 at 257,
        # 421 at 384 and 510 at 512: more rows per step than 256 buy no throughput there.
        self.block_size, self.max_batch, self.prefill_budget = block_size, max_batch, prefill_budget
        self.watermark = max(1, num_blocks // 100)  # blocks kept free at admission
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()
        self.forward_failures = 0  # forwards that raised since the last one that ran
        self._ids = itertools.count()
        self._admissions = itertools.count()

    # ---- requests --------------------------------------------------------------------------
    def add(
        self,
        prompt: list[int],
        max_new_tokens: int,
        *,
        stop_tokens=(),
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        min_p: float | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: dict[int, float] | None = None,
        min_tokens: int = 0,
    ) -> int:
        """Queue a request; returns its id. Raises ValueError for a request that can never run
        (empty, out-of-vocabulary, longer than the runtime's positions or the whole cache).
        ``logprobs``: k >= 0 puts each token's log-probability under the model (its logits
        before temperature, top-k or top-p, as vLLM's default) and the k likeliest tokens'
        on its events. The penalties, ``logit_bias`` (token id -> added logit) and ``min_tokens``
        adjust the logits before sampling (``sampling.Adjustments``). ``prompt_logprobs``: k >= 0
        scores the prompt's tokens after the first alike, on the request's first event (its
        prompt is then computed whole, not read from the prefix cache)."""
        prompt = [int(t) for t in prompt]
        adjustments = make_adjustments(presence_penalty, frequency_penalty, repetition_penalty,
                                       logit_bias, min_tokens)
        self._check_adjusted(prompt, max_new_tokens, (logprobs, prompt_logprobs), adjustments)
        sampling = _make_sampling(temperature, top_k, top_p, seed, device=self.runtime.device,
                                  min_p=min_p)
        seq = Sequence(next(self._ids), prompt, max_new_tokens, sampling, frozenset(stop_tokens),
                       logprobs=logprobs, adjustments=adjustments,
                       prompt_logprobs=prompt_logprobs)
        self.waiting.append(seq)
        return seq.id

    def check(self, prompt: list[int], max_new_tokens: int, logprobs: int | None = None,
              prompt_logprobs: int | None = None, **adjust) -> None:
        """The ValueError ``add`` would raise for this request, if any (``adjust``: ``add``'s
        penalty, bias and minimum-length keywords)."""
        self._check_adjusted(prompt, max_new_tokens, (logprobs, prompt_logprobs),
                             make_adjustments(**adjust))

    def _check_adjusted(self, prompt: list[int], max_new_tokens: int,
                        logprobs: tuple[int | None, ...], adjustments: Adjustments) -> None:
        self.runtime._check([prompt], max_new_tokens)
        vocab = self.runtime.embed.shape[0]
        for k in logprobs:
            if k is not None and not 0 <= k <= vocab:
                raise RequestError(f"logprobs={k} must be in 0..{vocab} (the vocabulary)",
                                   "logprobs")
        a = adjustments
        if not (a.repetition_penalty > 0 and 0 <= a.min_tokens <= max_new_tokens
                and all(map(math.isfinite, (a.presence_penalty, a.frequency_penalty,
                                            a.repetition_penalty)))):
            raise ValueError(
                f"repetition_penalty={a.repetition_penalty} must be > 0, min_tokens="
                f"{a.min_tokens} in 0..max_tokens ({max_new_tokens}), penalties finite"
            )
        bad = [t for t, b in a.logit_bias if not 0 <= t < vocab or not math.isfinite(b)]
        if bad:
            raise RequestError(f"logit_bias names tokens outside the vocabulary 0..{vocab - 1} "
                               f"or non-finite biases: {bad[:5]}", "logit_bias")
        need = -(-(len(prompt) + max_new_tokens) // self.block_size)
        if need > self.pool.num_blocks:
            raise ValueError(
                f"{len(prompt)} prompt + {max_new_tokens} new tokens need {need} KV blocks of "
                f"{self.block_size}; the cache has {self.pool.num_blocks}: give it more KV "
                "memory or ask for fewer tokens"
            )

    def abort(self, seq_id: int) -> bool:
        """Drop a request (a client that went away); its blocks are freed. False if unknown."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.id == seq_id:
                    queue.remove(seq)
                    seq.finish_reason = "abort"
                    self._release(seq)
                    return True
        return False

    def reset(self, message: str) -> list[Event]:
        """Finish every request with ``message`` (an error event each) and forget the cached
        prefixes, keeping the cache's memory: after an exception escaped ``step`` its
        bookkeeping is unknown, a fresh one is not (the pages hold no state a new block table
        reads before writing)."""
        events = [Event(seq.id, None, "error", error=message)
                  for seq in self.running + self.waiting]  # fmt: skip
        self.stats.failed_requests += len(events)
        self.pool = BlockPool(self.pool.num_blocks, prefix_caching=self.pool.prefix_caching)
        self.waiting, self.running = [], []
        self.forward_failures = 0
        return events

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def kv_bytes_in_use(self) -> int:
        return self.pool.in_use * self.cache.bytes_per_block

    # ---- one step --------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """Schedule and run one step; the tokens it produced (see the module docstring)."""
        decode, chunks = self._schedule()
        while not decode and not chunks and self.running:
            # prompts in progress hold every block between them: the newest makes way
            self._preempt(max(self.running, key=lambda s: s.admitted))
            decode, chunks = self._schedule()
        if not decode and not chunks:
            return []
        self.stats.peak_blocks = max(self.stats.peak_blocks, self.pool.in_use)
        self.stats.steps += 1
        events: list[Event] = []
        kernel = self.attention_reason is None
        rows = len(decode) + sum(n for _, n in chunks)
        if decode and chunks and (self.mixed_reason is not None or rows >= self.mixed_rows):
            # the phases compute differently: a forward each (the weights are read twice)
            events += self._run(decode, [], kernel)
            events += self._run([], chunks, kernel)
        else:
            self.stats.mixed_steps += bool(decode and chunks)
            events += self._run(decode, chunks, kernel)
        return events

    def _run(
        self, decode: list[Sequence], chunks: list[tuple[Sequence, int]], kernel: bool
    ) -> list[Event]:
        """One forward of decode rows and prefill chunks; their events (error events for the
        requests whose work raised: see the module docstring)."""
        segments = [self._segment(seq, 1) for seq in decode]
        chunk_segments = [self._segment(seq, n) for seq, n in chunks]
        scoring = frozenset(j for j, (seq, _) in enumerate(chunks) if seq.scores_prompt)
        try:
            logits = forward_step(self.runtime, self.cache, segments, chunk_segments,
                                  kernel=kernel, every_row_of=scoring, stack=self.decode_stack)
        except Exception as exc:  # one call for every row: no one request to blame
            return self._fail_forward([*decode, *(seq for seq, _ in chunks)], exc)
        self.forward_failures = 0
        failed = None  # error events of requests whose prompt scoring raised
        if scoring:  # keep the prompt scores; each chunk's last row stays for sampling
            logits, failed = self._score_prompts(chunks, scoring, logits, len(decode))
        self.stats.decode_rows += len(decode)
        for seq in decode:
            seq.num_computed += 1
            self._register_full_blocks(seq)
        done, rows = list(decode), list(range(len(decode)))
        for row, (seq, n) in enumerate(chunks, len(decode)):
            if seq.finish_reason is not None:  # failed in _score_prompts, its blocks freed
                continue
            seq.num_computed += n
            self.stats.prefill_tokens += n
            self._register_full_blocks(seq)
            if seq.num_computed == len(seq.tokens):  # the whole prompt is in: sample
                done.append(seq)
                rows.append(row)
        if not done:
            return failed or []
        # every row sampled (a decode-only step): the logits as they are, no indexed copy of
        # [B, V] (0.67 ms a step at 32 x 49152, Xeon)
        events = self._emit(done, logits if len(rows) == logits.shape[0] else logits[rows])
        return failed + events if failed else events

    def _score_prompts(
        self, chunks: list[tuple[Sequence, int]], scoring: frozenset[int], logits: torch.Tensor,
        b: int,
    ) -> tuple[torch.Tensor, list[Event] | None]:
        """Store the prompt scores of the ``scoring`` chunks from their every-row ``logits``
        (``forward_step(every_row_of=...)``) -> the logits with one row per chunk (its last),
        and the error events of the requests whose scoring raised (None: none did)."""
        rows, at = list(range(b)), b
        failed = None
        for j, (seq, n) in enumerate(chunks):
            if j not in scoring:
                rows.append(at)
                at += 1
                continue
            try:
                self._score_prompt(seq, logits[at : at + n])
            except Exception as exc:
                failed = [*(failed or ()), self._fail(seq, "scoring its prompt", exc)]
            at += n
            rows.append(at - 1)
        return logits[rows], failed

    def _score_prompt(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Store the scores of ``seq``'s prompt positions that its chunk's ``logits`` [n, V]
        (every row) predict."""
        start, k = seq.num_computed, seq.prompt_logprobs
        logp = logits.float().log_softmax(-1)
        for r in range(logits.shape[0]):
            target = start + r + 1  # the token row r predicts
            if target < len(seq.prompt):
                top = torch.topk(logp[r], k) if k else None
                pairs = () if top is None else tuple(zip(
                    top.indices.tolist(), top.values.tolist(), strict=True))
                seq.prompt_scores[target] = (float(logp[r, seq.prompt[target]]), pairs)

    def _fail_forward(self, seqs: list[Sequence], exc: Exception) -> list[Event]:
        """The batched forward raised: every request in it finishes with the error. Nothing of
        that forward was counted as computed or registered in the prefix cache, so the slots
        it may have written are read by no one once the blocks are freed."""
        self.forward_failures += 1
        self.stats.failed_forwards += 1
        log.error("the forward of %d requests failed (%d in a row); they finish with the "
                  "error, the others go on", len(seqs), self.forward_failures, exc_info=exc)
        message = (f"the model's forward failed for every request in its step: "
                   f"{type(exc).__name__}: {exc}")
        return [self._finish_with_error(seq, message) for seq in seqs]

    def _fail(self, seq: Sequence, what: str, exc: Exception) -> Event:
        """Finish ``seq`` alone because its own work (``what``) raised ``exc``."""
        log.error("request %d failed while %s; it finishes with the error, the others go on",
                  seq.id, what, exc_info=exc)
        return self._finish_with_error(seq, f"the request failed while {what}: "
                                            f"{type(exc).__name__}: {exc}")

    def _finish_with_error(self, seq: Sequence, message: str) -> Event:
        self.running.remove(seq)
        self._release(seq)
        seq.finish_reason = "error"
        self.stats.failed_requests += 1
        return Event(seq.id, None, "error", error=message)

    def _schedule(self) -> tuple[list[Sequence], list[tuple[Sequence, int]]]:
        """This step's decoding requests and prefill chunks (request, tokens), blocks held."""
        decode = self._reserve_decodes()
        budget = self.prefill_budget
        if self.mixed_reason is None:  # one forward: the decode rows count against the budget
            budget = max(budget - len(decode), min(budget, self.block_size))
        chunks: list[tuple[Sequence, int]] = []
        for seq in [s for s in self.running if s not in decode]:  # prompts in progress
            n = self._reserve_chunk(seq, budget)
            if n == 0:
                break
            chunks.append((seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            n = self._admit(seq, budget)
            if n == 0:
                break
            chunks.append((seq, n))
            budget -= n
        return decode, chunks

    def _reserve_decodes(self) -> list[Sequence]:
        """Running requests with one token to feed, each given the slot for it (preempting the
        newest requests while blocks run out)."""
        decode = []
        for seq in sorted(self.running, key=lambda s: s.admitted):
            if seq not in self.running or len(seq.tokens) - seq.num_computed != 1:
                continue  # preempted meanwhile, or still prefilling
            while not self._grow(seq, seq.num_computed + 1):
                victim = max(self.running, key=lambda s: s.admitted)
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                decode.append(seq)
        return [s for s in decode if s in self.running]

    def _reserve_chunk(self, seq: Sequence, budget: int, reserve: int = 0) -> int:
        """Tokens of ``seq``'s prompt to prefill this step (0: no budget or no blocks), leaving
        ``reserve`` blocks available."""
        n = min(budget, len(seq.tokens) - seq.num_computed)
        while n > 0 and not self._grow(seq, seq.num_computed + n, reserve):
            n = (seq.num_computed + n - 1) // self.block_size * self.block_size - seq.num_computed
        return max(n, 0)

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Move the first waiting request into the batch with its prefix-cache hits and a first
        chunk; 0 (and nothing held) when the blocks for that chunk are not there."""
        tokens = seq.tokens
        parent = ROOT_KEY
        hits = []
        last = -1 if seq.scores_prompt else len(tokens) - 1 - self.block_size + 1
        for start in range(0, last, self.block_size):
            key = block_key(parent, tokens[start : start + self.block_size])
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append((block, key))
            parent = key
        for block, key in hits:
            self.pool.acquire(block)
            seq.blocks.append(block)
            seq.keys.append(key)
        seq.num_computed = len(hits) * self.block_size
        # Keep a few blocks free for the running requests' next tokens when admitting: else a
        # request admitted into the last blocks is preempted at the next decode step.
        reserve = self.watermark if self.running else 0
        n = self._reserve_chunk(seq, budget, reserve)
        if n == 0:
            self._release(seq)
            return 0
        self.waiting.pop(0)
        self.running.append(seq)
        seq.admitted = next(self._admissions)
        if seq.preemptions == 0:
            seq.cached_tokens = seq.num_computed
            self.stats.prompt_tokens += len(seq.prompt)
            self.stats.cached_prompt_tokens += seq.num_computed
        return n

    def _grow(self, seq: Sequence, tokens: int, reserve: int = 0) -> bool:
        """Hold blocks for ``tokens`` slots of ``seq``; False (nothing more held) if the pool
        cannot and still keep ``reserve`` available."""
        need = -(-tokens // self.block_size) - len(seq.blocks)
        if need > self.pool.available - reserve:
            return False
        seq.blocks += [self.pool.allocate() for _ in range(need)]
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.insert(0, seq)

    def _release(self, seq: Sequence) -> None:
        for block in seq.blocks:
            self.pool.release(block)
        seq.blocks, seq.keys, seq.num_computed = [], [], 0

    def _register_full_blocks(self, seq: Sequence) -> None:
        tokens = seq.tokens
        while (len(seq.keys) + 1) * self.block_size <= seq.num_computed:
            i = len(seq.keys)
            parent = seq.keys[-1] if seq.keys else ROOT_KEY
            key = block_key(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            self.pool.register(seq.blocks[i], key)
            seq.keys.append(key)

    def _segment(self, seq: Sequence, n: int) -> Segment:
        start, bs = seq.num_computed, self.block_size
        slots = [seq.blocks[p // bs] * bs + p % bs for p in range(start, start + n)]
        return Segment(start, seq.tokens[start : start + n], slots, list(seq.blocks))

    def _emit(self, seqs: list[Sequence], logits: torch.Tensor) -> list[Event]:
        """Sample each row with its request's settings; retire finished requests, and finish
        with an error those whose row raised (the others' tokens are what they would be)."""
        tokens, errors = self._pick(seqs, logits)
        try:
            scored = _logprobs(seqs, logits, tokens)
        except Exception:  # one call for every row asking: find the rows it fails on
            scored = {}
            for i in [i for i in tokens if seqs[i].logprobs is not None]:
                try:
                    scored.update(_logprobs(seqs, logits, {i: tokens[i]}))
                except Exception as exc:
                    errors = {**(errors or {}), i: ("computing its log-probabilities", exc)}
        events = []
        for i, seq in enumerate(seqs):
            if errors and i in errors:
                events.append(self._fail(seq, *errors[i]))
                continue
            token = tokens[i]
            seq.output.append(token)
            reason = None
            if token in seq.stop:
                reason = "stop"
            elif len(seq.output) >= seq.max_new_tokens:
                reason = "length"
            if reason is not None:
                seq.finish_reason = reason
                self.running.remove(seq)
                self._release(seq)
            prompt_scores = None
            if seq.prompt_logprobs is not None and len(seq.output) == 1:
                prompt_scores = tuple(seq.prompt_scores[p] for p in range(1, len(seq.prompt)))
            events.append(Event(seq.id, token, reason, *scored.get(i, (None, None)),
                                prompt_logprobs=prompt_scores))
        return events

    def _pick(self, seqs: list[Sequence], logits: torch.Tensor
              ) -> tuple[dict[int, int], dict[int, tuple[str, Exception]] | None]:
        """Each row's next token -> (row -> token, row -> (what failed, the exception) for the
        rows that raised instead, None when none did)."""
        greedy = [i for i, s in enumerate(seqs)
                  if s.sampling.temperature <= 0 and not s.adjustments.active]
        tokens: dict[int, int] = {}
        errors = None
        if greedy:
            # every row greedy (the usual case): no copy of the [B, V] logits (an indexed copy
            # took 0.5 ms a step at 32 x 49152, Xeon)
            rows = logits if len(greedy) == len(seqs) else logits[greedy]
            fused = self.runtime.layers[0].fused and rows.dtype == torch.float32
            pick = _greedy_fused if fused else _greedy
            try:
                tokens.update(zip(greedy, pick(rows).tolist(), strict=True))
            except Exception:  # one call for every greedy row: pick them one by one instead
                for i in greedy:
                    try:
                        tokens[i] = int(pick(logits[i : i + 1])[0])
                    except Exception as exc:
                        errors = {**(errors or {}), i: ("picking its next token", exc)}
        for i, seq in enumerate(seqs):
            if i in tokens or (errors and i in errors):
                continue
            try:
                if seq.adjustments.active:
                    check_finite(logits[i])  # the model's; the adjusted row may hold -inf
                    row = adjust_logits(logits[i], seq.adjustments, seq.prompt, seq.output,
                                        seq.stop)
                    tokens[i] = int(_sample(row[None], seq.sampling, checked=True)[0])
                else:
                    tokens[i] = int(_sample(logits[i : i + 1], seq.sampling)[0])
            except Exception as exc:  # its settings, adjustments or logits: this request's
                errors = {**(errors or {}), i: ("sampling its next token", exc)}
        return tokens, errors
