"""Decode steps replayed from CUDA graphs (``compress/runtime/graphs.py``, issue 34).

Without a GPU the graphs are emulated: ``_checked_capture`` replays the step eagerly and holds
it to what a CUDA graph needs. A graph bakes in addresses, so every tensor the step reads from
outside itself (weights, KV cache, cache slot, static inputs) must be the same storage at every
replay; a graph cannot run host syncs or data-dependent shapes, nor copy a host tensor made
inside the step. The mode below records, per call, the storages of the tensors the step's ATen
ops read that no earlier op of the same call made, and fails on the ops a capture refuses. The
tokens must equal those of the same runtime without graphs. The model on the GPU's path is a
float model (``_FloatLinear``) or one of Triton W4 layers (interpreted here).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from compress.quant.linear import QuantLinear, WeightScheme
from compress.runtime.engine import Runtime
from compress.runtime.float_linear import _FloatLinear
from compress.runtime.graphs import Captured, CaptureFailed, GraphedSteps
from compress.testing import (
    TINY_MODEL_TYPES,
    TINY_MOE_TYPES,
    make_tiny_llama,
    make_tiny_model,
    make_tiny_moe,
)

if not torch.cuda.is_available():  # the Triton W4 layers run in the interpreter (read at import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

aten = torch.ops.aten
# ops a CUDA graph capture refuses or gets wrong: host syncs, data-dependent output shapes, and
# a host tensor made inside the step (its copy to the GPU is baked into the graph)
CAPTURE_REFUSES = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.equal.default,
    aten.lift_fresh.default,
}


class _Reads(TorchDispatchMode):
    """Storages an op read that no earlier op of this call made; ops a capture refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.made: set[int] = set()
        self.outside: set[int] = set()
        self.refused: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in CAPTURE_REFUSES:
            self.refused.append(str(func))
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.numel():
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.made:
                    self.outside.add(ptr)
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.made.add(t.untyped_storage().data_ptr())
        return out


@pytest.fixture(autouse=True)
def _no_cpu_weight_layouts(monkeypatch):
    """Keep weights in the layout a GPU runtime holds them in. ``_FloatLinear.pack`` returns
    False off the CPU, but the emulation runs on the CPU, where it would put a bf16 head into
    oneDNN's blocked layout on a CPU with AVX512-BF16 and no AMX: an opaque tensor whose
    storage no capture (and no check here) can read."""
    monkeypatch.setattr(_FloatLinear, "pack", lambda self, *args, **kwargs: False)


def _checked_capture(calls: list[str]):
    """A ``GraphedSteps`` capture that replays eagerly on the CPU with a graph's rules checked;
    appends "capture" / "replay" to ``calls``."""

    def capture(fn, pool) -> Captured:
        assert pool == "pool"
        fn()  # the warm-up of ``cuda_capture``: lazy caches fill before the capture
        with _Reads() as reads:
            output = fn()
        assert not reads.refused, f"a CUDA graph cannot capture {reads.refused}"
        calls.append("capture")

        def replay() -> None:
            with _Reads() as again:
                fresh = fn()
            assert not again.refused, f"a CUDA graph cannot capture {again.refused}"
            # a graph reads the addresses it was captured with: nothing new from outside
            assert again.outside <= reads.outside, "the step read a tensor the capture did not"
            output.copy_(fresh)
            calls.append("replay")

        return Captured(output, replay)

    return capture


def _graphs(calls: list[str]) -> GraphedSteps:
    return GraphedSteps(_checked_capture(calls), pool_factory=lambda: "pool")


def _w4_triton(model):
    for name, linear in list(model.named_modules()):
        if isinstance(linear, torch.nn.Linear) and "lm_head" not in name:
            parent, _, child = name.rpartition(".")
            q = QuantLinear.from_linear(linear, WeightScheme(4, 32), backend="triton")
            setattr(model.get_submodule(parent), child, q)
    return model


def _model(kind: str):
    model = make_tiny_llama(seed=1)
    if kind == "w4-triton":
        from compress.kernels import int4_gemm

        if not int4_gemm.is_interpreted():  # the emulation runs the layers on the CPU
            pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1")
        model = _w4_triton(model)
    return model


@pytest.mark.parametrize("kind", ["float", "w4-triton"])
def test_graphed_decode_gives_the_same_tokens_and_reads_only_static_tensors(kind):
    model = _model(kind)
    # left padding, two rows; 4 tokens: 3 decode steps at key lengths 15-17 (the Triton
    # interpreter runs each kernel slowly: 7 tokens of a 12-token prompt took 52 s)
    prompts = [[5, 9, 2, 7, 1, 4, 4, 6, 2, 11, 3, 8, 6, 9], [3, 8]]
    plain = Runtime(model, max_seq_len=32, max_batch_size=2, compile=False,
                    keep_model_weights=True, cuda_graphs=False)  # fmt: skip
    sampled = dict(temperature=1.0, seed=3)  # tokens that follow the logits closely
    want = plain.generate(prompts, 4, **sampled)
    calls: list[str] = []
    graphed = Runtime(model, max_seq_len=32, max_batch_size=2, compile=False,
                      keep_model_weights=True)  # fmt: skip
    assert graphed._graphs is None  # the CPU default: no graphs
    graphed.use_graphs(_graphs(calls))
    assert graphed.generate(prompts, 4, **sampled) == want
    # keys (rows, power-of-two key length): prompt 14 + 3 decode steps -> lengths 15..17
    assert sorted(graphed._graphs.graphs) == [(2, 16), (2, 32)]
    assert calls.count("capture") == 2 and calls.count("replay") == 3
    assert graphed.generate([prompts[1]], 3) == plain.generate([prompts[1]], 3)  # one row
    assert (1, 16) in graphed._graphs.graphs


@pytest.mark.parametrize("family", [*(f for f in TINY_MODEL_TYPES if f != "llama"),
                                    *TINY_MOE_TYPES])  # fmt: skip
def test_every_runtime_family_decodes_the_same_from_graphs(family):
    """Sliding-window masks, q/k norms, multipliers, softcaps, routed experts: each family's
    step keeps to what a graph holds and gives the logits it gives without graphs (a 12-token
    prompt and 8 steps cross the 16 -> 32 key-length boundary; Mistral's and Gemma's windows of
    8 cut keys)."""
    from compress.runtime.engine import unsupported_reason

    moe = family in TINY_MOE_TYPES
    model = make_tiny_moe(family, seed=2) if moe else make_tiny_model(family, seed=2)
    if unsupported_reason(model) is not None:
        pytest.skip(f"the runtime does not run {family}: {unsupported_reason(model)}")
    prompt = [(7 * i + 3) % 200 + 1 for i in range(12)]
    plain = Runtime(model, max_seq_len=32, compile=False, keep_model_weights=True)
    graphed = Runtime(model, max_seq_len=32, compile=False, keep_model_weights=True)
    graphed.use_graphs(_graphs([]))
    torch.testing.assert_close(graphed.prefill(prompt), plain.prefill(prompt), rtol=0, atol=0)
    for token in (5, 9, 14, 2, 8, 8, 1, 30):
        torch.testing.assert_close(graphed.score([token]), plain.score([token]))
    assert sorted(graphed._graphs.graphs) == [(1, 16), (1, 32)]


def test_score_returns_a_copy_and_forks_capture_their_own_graphs():
    model = _model("float")
    plain = Runtime(model, max_seq_len=40, compile=False, keep_model_weights=True)
    calls: list[str] = []
    graphed = Runtime(model, max_seq_len=40, compile=False, keep_model_weights=True)
    graphed.use_graphs(_graphs(calls))
    prompt = [4, 1, 8, 3, 9, 9, 2, 5, 7, 1, 6, 3, 2]
    torch.testing.assert_close(graphed.prefill(prompt), plain.prefill(prompt), rtol=0, atol=0)
    scored = [graphed.score([t]) for t in (6, 2, 7, 7, 1)]  # key lengths 14..18: two graphs
    assert sorted(graphed._graphs.graphs) == [(1, 16), (1, 32)]
    # fp32 rounding apart (the graphs attend over 16 or 32 key slots, the plain runtime over
    # 14..18), the logits of each token: a copy, not the graph's output rewritten by later steps
    for t, logits in zip((6, 2, 7, 7, 1), scored, strict=True):
        torch.testing.assert_close(logits, plain.score([t]))
    assert (scored[0] - scored[1]).abs().max() > 1e-3
    fork = graphed.fork()
    assert fork._graphs is not graphed._graphs and not fork._graphs.graphs
    assert fork.generate([prompt], 5) == plain.generate([prompt], 5)
    assert fork._graphs.graphs and fork._graphs.pool == "pool"


def test_a_failed_capture_warns_once_and_decodes_without_graphs():
    model = _model("float")
    want = Runtime(model, max_seq_len=32, compile=False, keep_model_weights=True).generate(
        [[1, 2, 3]], 8
    )

    def refuse(fn, pool):
        fn()  # the warm-up ran (and wrote its cache slot) before the capture failed
        raise RuntimeError("operation not permitted when stream is capturing")

    runtime = Runtime(model, max_seq_len=32, compile=False, keep_model_weights=True)
    runtime.use_graphs(GraphedSteps(refuse, pool_factory=lambda: None))
    with pytest.warns(RuntimeWarning, match=r"capturing the decode step .*not permitted.*"
                                            r"without CUDA graphs"):  # fmt: skip
        assert runtime.generate([[1, 2, 3]], 8) == want
    assert runtime._graphs is None


def test_a_step_that_syncs_the_host_is_caught_by_the_emulation():
    """The emulated capture is a real check: a step with ``.item()`` fails it."""
    calls: list[str] = []
    graphs = _graphs(calls)
    x = torch.ones(3)
    with pytest.raises(CaptureFailed, match="cannot capture"):
        graphs("k", lambda t: t * float(t.sum().item()), x)
    other = torch.ones(3)
    reads = {"tensor": torch.ones(3)}
    out = graphs("k2", lambda t: t + reads["tensor"], other)
    reads["tensor"] = torch.full((3,), 2.0)  # a new tensor where the graph read the old one
    with pytest.raises(AssertionError, match="did not"):
        graphs("k2", lambda t: t + reads["tensor"], other)
    torch.testing.assert_close(out, torch.full((3,), 2.0))
    with pytest.raises(ValueError, match=r"input of shape \(4,\) where the capture had \(3,\)"):
        graphs("k2", lambda t: t, torch.ones(4))


def test_cuda_graphs_are_refused_off_the_gpu():
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device"):
        Runtime(make_tiny_llama(), max_seq_len=16, compile=False, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs='yes': expected None, True or False"):
        Runtime(make_tiny_llama(), max_seq_len=16, compile=False, cuda_graphs="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the real capture")
@pytest.mark.parametrize("kind", ["float", "w4"])
def test_real_cuda_graphs_give_the_launched_logits(kind):
    """On a GPU: the real capture and replay (warm-up on a side stream, a shared pool, static
    inputs), float layers or W4 layers on the kernels ``backend="auto"`` picks there; no capture
    may fail (a failure only warns in use, so warnings are errors here). fp32 weights: the
    graphed and launched steps differ only by the key lengths they attend over."""
    import warnings

    from compress.testing import make_tiny_llama as tiny

    model = tiny(seed=1).to("cuda")
    if kind == "w4":
        for name, linear in list(model.named_modules()):
            if isinstance(linear, torch.nn.Linear) and "lm_head" not in name:
                parent, _, child = name.rpartition(".")
                q = QuantLinear.from_linear(linear, WeightScheme(4, 32), backend="auto")
                setattr(model.get_submodule(parent), child, q)
    launched = Runtime(model, max_seq_len=48, compile=False, keep_model_weights=True,
                       cuda_graphs=False)  # fmt: skip
    graphed = Runtime(model, max_seq_len=48, compile=False, keep_model_weights=True)
    assert graphed._graphs is not None
    prompt = [(5 * i + 1) % 200 + 1 for i in range(14)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(graphed.prefill(prompt), launched.prefill(prompt))
        for token in (3, 7, 7, 12, 40, 2):  # key lengths 15..20: graphs of 16 and 32
            torch.testing.assert_close(graphed.score([token]), launched.score([token]),
                                       rtol=1e-4, atol=1e-4)  # fmt: skip
        assert graphed.generate([prompt], 8) == launched.generate([prompt], 8)
    assert sorted(graphed._graphs.graphs) == [(1, 16), (1, 32)]
