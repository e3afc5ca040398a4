"""The engine loop under ``compress serve``: one thread owns the model and runs
``Scheduler.step`` while there is work, handing each token to its request's asyncio queue.
Handlers on the event loop add and abort requests through a short lock on a hand-over list that
the loop applies between steps, so the event loop never waits for a step.

A request that fails in a step (its own sampling raised, or the batched forward it was part of:
``scheduler.py``) hears why on its queue, an ``Event`` with ``error`` set, and the loop goes on
serving the others. An exception that escapes ``Scheduler.step`` (a bug in its bookkeeping,
whose state is then unknown) fails every request the scheduler holds and resets it
(``Scheduler.reset``); later requests are served. Only ``MAX_FAILED_FORWARDS`` failed forwards
in a row, or as many failed steps in a row, stop the loop: every request in flight gets the
exception, and every later one is refused (``error``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any

from compress.runtime.sampling import ADJUSTMENT_KEYS, _make_sampling
from compress.runtime.scheduler import Event, RequestError, Scheduler

log = logging.getLogger(__name__)

# Forwards that may fail in a row, none running between, before the engine stops. Each failure
# fails only the requests of its forward and the next step starts clean (``scheduler.py``), so
# one bad batch or a transient error (an out-of-memory) costs those requests alone; but a model
# that fails every forward would fail each request after a step of work. Stopping then, as any
# failure did before (the requests in flight a 500, later ones and /health a 503; ``serve``
# shuts down), is acceptable: the model or the machine is broken, and a restart is the fix.
MAX_FAILED_FORWARDS = 3


@dataclass
class _Open:
    """A request in flight: where its tokens go."""

    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop


class Engine:
    """Steps the scheduler: in a thread of its own (``thread=True``) or in the caller's thread
    through ``run`` (``serve`` runs it in the main thread: measured on 2 cores, a decode step
    of SmolLM2 W4 with 2 torch threads took 10 ms from the main thread and 21 ms from any
    other, whose OpenMP team fought the main one). Handlers add and abort requests through a
    short lock on a hand-over list that the loop applies between steps, so the event loop
    never waits for a step."""

    def __init__(self, scheduler: Scheduler, *, max_waiting: int = 256, thread: bool = True):
        self.scheduler, self.max_waiting = scheduler, max_waiting
        self._lock = threading.Lock()  # guards the three below, never held during a step
        self._incoming: list[tuple[int, list[int], int, dict[str, Any]]] = []
        self._aborts: list[int] = []
        self._open: dict[int, _Open] = {}  # request key -> where its events go
        self._keys = itertools.count()
        self._seq_of: dict[int, int] = {}  # request key -> scheduler id (engine thread only)
        self._key_of: dict[int, int] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._failed_steps = 0  # scheduler steps that raised, none running between
        self.error: BaseException | None = None
        self.snapshot: dict[str, Any] = self._stats()
        self._thread = None
        if thread:
            self._thread = threading.Thread(target=self.run, name="compress-engine", daemon=True)
            self._thread.start()

    def add(self, prompt: list[int], max_new_tokens: int, **sampling) -> tuple[int, asyncio.Queue]:
        """Queue a request from the event loop; its events arrive on the returned queue.
        Raises RequestError (400) for a request that cannot run, OverflowError (503) when
        ``max_waiting`` requests wait already."""
        try:
            adjust = {k: v for k, v in sampling.items() if k in ADJUSTMENT_KEYS}
            self.scheduler.check(prompt, max_new_tokens, sampling.get("logprobs"),
                                 sampling.get("prompt_logprobs"), **adjust)
            _make_sampling(**{k: v for k, v in sampling.items() if k not in (
                "stop_tokens", "logprobs", "prompt_logprobs", *ADJUSTMENT_KEYS)})
        except RequestError:
            raise
        except ValueError as exc:  # the prompt's tokens, or its length with the tokens asked
            raise RequestError(str(exc), "prompt") from None
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self.error is not None:
                raise RuntimeError(f"the engine stopped: {self.error}")
            waiting = self.snapshot["waiting"] + len(self._incoming)
            if waiting >= self.max_waiting:
                raise OverflowError(
                    f"{waiting} requests are waiting already (the bound is {self.max_waiting}); "
                    "retry later"
                )
            key = next(self._keys)
            self._incoming.append((key, prompt, max_new_tokens, sampling))
            self._open[key] = _Open(queue, asyncio.get_running_loop())
        self._wake.set()
        return key, queue

    def abort(self, key: int) -> None:
        """Drop a request (finished ones too: then nothing happens)."""
        with self._lock:
            if self._open.pop(key, None) is not None:
                self._aborts.append(key)
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    def run(self, until=lambda: False) -> None:
        """Step while there is work, wait for requests otherwise, until ``stop`` or ``until()``
        (checked at least every half second)."""
        try:
            while not self._stopping and not until():
                self._wake.clear()  # before the hand-over: an add after this wakes the wait
                self._apply_handover()
                if self.scheduler.has_work:
                    try:
                        events = self.scheduler.step()
                        self._failed_steps = 0
                    except Exception as exc:  # noqa: BLE001  (fails its requests only)
                        events = self._reset_after(exc)
                    self._deliver(events)  # the failed requests hear why first
                    if self.scheduler.forward_failures >= MAX_FAILED_FORWARDS:
                        last = next((e.error for e in reversed(events) if e.error), "see the log")
                        raise RuntimeError(f"the model's forward failed {MAX_FAILED_FORWARDS} "
                                           f"times in a row; the last: {last}")
                self.snapshot = self._stats()
                if not self.scheduler.has_work:
                    self._wake.wait(0.5)
        except BaseException as exc:  # noqa: BLE001  (every waiter must hear of it)
            self._fail(exc)

    def _reset_after(self, exc: Exception) -> list:
        """Error events for every request of a scheduler whose step raised ``exc``, which is
        then reset; the exception itself once ``MAX_FAILED_FORWARDS`` steps in a row raised."""
        self._failed_steps += 1
        if self._failed_steps >= MAX_FAILED_FORWARDS:
            raise exc
        log.error("a scheduler step raised; its %d requests finish with the error and the "
                  "scheduler starts afresh", len(self.scheduler.running) +
                  len(self.scheduler.waiting), exc_info=exc)  # fmt: skip
        return self.scheduler.reset(f"the server's scheduler failed ({type(exc).__name__}: "
                                    f"{exc}); retry the request")

    def _apply_handover(self) -> None:
        with self._lock:
            incoming, self._incoming = self._incoming, []
            aborts, self._aborts = self._aborts, []
        for key, prompt, max_new_tokens, sampling in incoming:
            seq_id = self.scheduler.add(prompt, max_new_tokens, **sampling)
            self._seq_of[key], self._key_of[seq_id] = seq_id, key
        for key in aborts:
            seq_id = self._seq_of.pop(key, None)
            if seq_id is not None:
                self._key_of.pop(seq_id, None)
                self.scheduler.abort(seq_id)

    def _deliver(self, events: list[Event]) -> None:
        # one hand-over per event loop per step, not one per token: each call_soon_threadsafe
        # wakes the loop through its self-pipe (SmolLM2 bf16, 32-request bursts served: 445-469
        # tok/s with one per token, 458-480 with one per step; docs/notes/2026-12-05-amx-overlap.md)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Event]]] = {}
        for event in events:
            key = self._key_of.get(event.id)
            if event.finish_reason is not None and key is not None:
                del self._key_of[event.id], self._seq_of[key]
            with self._lock:
                target = self._open.get(key)
                if target is not None and event.finish_reason is not None:
                    del self._open[key]
            if target is not None:
                by_loop.setdefault(target.loop, []).append((target.queue, event))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            self.error = exc
            targets, self._open = list(self._open.values()), {}
        for target in targets:
            target.loop.call_soon_threadsafe(target.queue.put_nowait, exc)

    def _stats(self) -> dict[str, Any]:
        s = self.scheduler
        return {
            "running": len(s.running),
            "waiting": len(s.waiting),
            "kv_blocks": s.pool.num_blocks,
            "kv_blocks_in_use": s.pool.in_use,
            "kv_bytes_in_use": s.kv_bytes_in_use(),
            "kv_bytes_peak": s.stats.peak_blocks * s.cache.bytes_per_block,
            "kv_dtype": str(s.cache.dtype).removeprefix("torch."),
            # why decode steps gather the keys instead of attending in the pool (None: they don't)
            "decode_attention_gathered": s.attention_reason,
            # why decode-only steps run the Python layer loop, not one C++ call (None: C++)
            "decode_layers_in_python": s.decode_stack_reason,
            "block_size": s.block_size,
            "steps": s.stats.steps,
            "decode_rows": s.stats.decode_rows,
            "prefill_tokens": s.stats.prefill_tokens,
            "prompt_tokens": s.stats.prompt_tokens,
            "cached_prompt_tokens": s.stats.cached_prompt_tokens,
            "prefix_hit_rate": s.stats.prefix_hit_rate,
            "preemptions": s.stats.preemptions,
            # steps whose decode rows and prefill chunks ran as one forward, and why they run
            # as two forwards instead (None: they do not, below ``mixed_rows`` rows)
            "mixed_steps": s.stats.mixed_steps,
            "phases_in_two_forwards": s.mixed_reason,
            # requests finished with an error (a 500 each), and the forwards that failed
            "failed_requests": s.stats.failed_requests,
            "failed_forwards": s.stats.failed_forwards,
        }


def _put_all(items: list[tuple[asyncio.Queue, Event]]) -> None:
    """The event loop's side of ``Engine._deliver``: a step's events, in order."""
    for queue, event in items:
        queue.put_nowait(event)
