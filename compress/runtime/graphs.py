"""Decode steps replayed from CUDA graphs: one launch per token instead of one per kernel.

At batch 1 on a GPU a decode step is a few hundred small kernels (SmolLM2's 30 layers: norms,
projections, rope, attention, the MLP), and launching them from Python costs more than running
them (issue 34: the runtime's bf16 and W4 decode were both launch-bound on an H200). A CUDA graph
records the step's kernels once and replays them with one call (gpt-fast's
``reduce-overhead``, vLLM's captured decode batches).

A graph replays fixed memory addresses, so everything the step reads from outside must sit in
the same tensors every time: ``GraphedSteps`` keeps, per key (the runtime's batch rows and
power-of-two key length), static copies of the step's tensor inputs (token ids, positions, the
key mask), copies each call's inputs into them and replays. The KV cache, the cache slot
(``Runtime._slot``, filled before each step) and the weights are the runtime's own tensors,
which never move. The logits are the graph's output tensor, overwritten by the next replay:
read them before the next step (``Runtime.score`` returns a copy).

``capture(fn)`` makes the replayable step. ``cuda_capture`` is the real one: a warm-up call on a
side stream (Triton kernels compile, GEMV configs are tuned, lazy caches fill, as torch's docs
ask), then the capture into a memory pool the runtime's graphs share (replays never overlap:
one runtime runs one step at a time, and every graph's output stays referenced). The warm-up
and the replay each write the step's cache slot from the same inputs, which is idempotent.
Tests pass another ``capture`` that replays eagerly and checks the same discipline on the CPU
(tests/runtime/test_cuda_graphs.py).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import NamedTuple

import torch


class Captured(NamedTuple):
    """A captured step: ``replay()`` reruns it on the static inputs and leaves its result in
    ``output`` (the same tensor every time)."""

    output: torch.Tensor
    replay: Callable[[], None]


Capture = Callable[[Callable[[], torch.Tensor], object], Captured]


class CaptureFailed(RuntimeError):
    """Capturing a step failed; the caller runs it without graphs (``__cause__`` says why)."""


def cuda_capture(fn: Callable[[], torch.Tensor], pool) -> Captured:
    """``fn`` (which reads only static tensors) captured in a CUDA graph, in ``pool``."""
    device = torch.cuda.current_device()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture: compiles, tunes and allocates what stays
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = fn()
    return Captured(output, graph.replay)


def cuda_pool():
    return torch.cuda.graph_pool_handle()


class GraphedSteps:
    """The graphs of one runtime's decode steps, one per key, captured on first use."""

    def __init__(self, capture: Capture = cuda_capture, pool_factory=cuda_pool) -> None:
        self.capture, self.pool_factory = capture, pool_factory
        self.pool = pool_factory()
        self.graphs: dict[Hashable, tuple[tuple[torch.Tensor, ...], Captured]] = {}

    def fresh(self) -> GraphedSteps:
        """No graphs, the same way of capturing, its own pool (for a runtime's fork: its graphs
        read another KV cache)."""
        return GraphedSteps(self.capture, self.pool_factory)

    def __call__(
        self, key: Hashable, step: Callable[..., torch.Tensor], *inputs: torch.Tensor
    ) -> torch.Tensor:
        """``step(*inputs)`` replayed from the graph of ``key`` (captured from ``step`` on the
        first call of that key; ``step`` must compute the same function for every call of a
        key). The result is the graph's output tensor: valid until the next call."""
        entry = self.graphs.get(key)
        if entry is None:
            static = tuple(t.clone() for t in inputs)
            try:
                captured = self.capture(lambda: step(*static), self.pool)
            except Exception as exc:  # noqa: BLE001  (any capture failure: the caller decides)
                raise CaptureFailed(f"capturing the decode step {key} failed: {exc}") from exc
            entry = self.graphs[key] = (static, captured)
        static, captured = entry
        for target, value in zip(static, inputs, strict=True):
            if target.shape != value.shape:
                raise ValueError(
                    f"graph {key}: input of shape {tuple(value.shape)} where the capture had "
                    f"{tuple(target.shape)}"
                )
            target.copy_(value)
        captured.replay()
        return captured.output
