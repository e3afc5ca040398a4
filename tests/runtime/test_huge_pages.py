"""The runtime's weights on 2 MB pages: ``memory.HugePageArena`` copies tensors exactly, on
64-byte boundaries, and refuses what does not fit; ``hold_in_huge_pages`` moves each plain
weight once (freeing the original), leaves shared storage and oneDNN's opaque tensors where they
are, and a runtime that holds its weights there decodes the same tokens as one that does not."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from compress import memory
from compress.memory import hold_in_huge_pages
from compress.quant.rtn import Int4RtnConfig, quantize_linears
from compress.runtime import engine
from compress.runtime.engine import Runtime
from compress.testing import make_tiny_llama


def test_arena_copies_exactly_on_64_byte_boundaries_and_refuses_overflow():
    tensors = [
        torch.randn(3, 5),
        torch.arange(7, dtype=torch.int64),
        torch.randint(0, 256, (33,), dtype=torch.uint8),
        torch.randn(4).to(torch.bfloat16),
    ]
    arena = memory.HugePageArena(sum(t.numel() * t.element_size() + 64 for t in tensors))
    base = arena.buffer.data_ptr()
    for t in tensors:
        copy = arena.take(t)
        assert copy.dtype == t.dtype and copy.shape == t.shape and torch.equal(copy, t)
        assert copy.data_ptr() % 64 == 0
        assert base <= copy.data_ptr() < base + arena.buffer.numel()
    assert (arena.offset - (-base) % memory.HUGE_PAGE_BYTES) >= sum(
        t.numel() * t.element_size() for t in tensors
    )
    with pytest.raises(ValueError, match="do not fit"):
        arena.take(torch.zeros(memory.HUGE_PAGE_BYTES, dtype=torch.uint8))


def test_arena_is_advised_where_the_kernel_has_transparent_huge_pages():
    mode = memory.huge_page_mode()
    if mode not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {mode!r} here (need always or madvise)")
    arena = memory.HugePageArena(4 * memory.HUGE_PAGE_BYTES)
    assert arena.advised
    assert (arena.buffer.data_ptr() + arena.offset) % memory.HUGE_PAGE_BYTES == 0


def test_hold_moves_each_plain_weight_once_and_leaves_shared_and_small_ones():
    big, twice, param = torch.randn(64, 64), torch.randn(32, 32), torch.randn(16, 64)
    small = torch.randn(4)  # 16 bytes: under min_bytes
    owner = torch.randn(128, 32)
    view = owner[:64]  # shares owner's storage: moving it would not free anything
    a, b = nn.Module(), nn.Module()
    a.register_buffer("big", big)
    a.register_buffer("twice", twice)
    b.register_buffer("twice", twice)  # the same tensor object in two modules: one copy
    a.register_buffer("small", small)
    a.register_buffer("view", view)
    a.weight = nn.Parameter(param.clone(), requires_grad=False)
    originals = {name: value.clone() for name, value in
                 [("big", big), ("twice", twice), ("param", param), ("view", view)]}  # fmt: skip
    gone = weakref.ref(a._buffers["big"])
    del big
    out = hold_in_huge_pages([a, b], min_bytes=1024)
    gc.collect()
    assert gone() is None  # the original was freed once its copy replaced it
    assert out["moved"] == 3 and out["left"] == 1
    assert out["moved_bytes"] == (64 * 64 + 32 * 32 + 16 * 64) * 4
    assert torch.equal(a.big, originals["big"]) and torch.equal(a.weight, originals["param"])
    assert a.twice is b.twice and torch.equal(a.twice, originals["twice"])
    assert isinstance(a.weight, nn.Parameter) and not a.weight.requires_grad
    assert a.small is small and a.view is view  # left where they were
    assert torch.equal(a.view, originals["view"])
    assert a.big.untyped_storage().data_ptr() == a.twice.untyped_storage().data_ptr()  # one arena


def test_hold_leaves_opaque_onednn_and_quantized_tensors():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch was built without oneDNN")
    m = nn.Module()
    m.register_buffer("packed", torch.randn(64, 64).to_mkldnn())
    m.register_buffer("q", torch.quantize_per_tensor(torch.randn(64, 64), 0.1, 0, torch.qint8))
    out = hold_in_huge_pages([m])
    assert out == {"moved": 0, "moved_bytes": 0, "left": 2, "advised": False}
    assert m.packed.is_mkldnn and m.q.is_quantized


def test_runtime_on_huge_pages_decodes_the_same_tokens(monkeypatch):
    from compress.kernels import cpu_q8

    if cpu_q8.unavailable_reason() is not None:
        pytest.skip(f"integer-dot kernels not available here: {cpu_q8.unavailable_reason()}")
    model = make_tiny_llama(initializer_range=0.3)
    quantize_linears(model, Int4RtnConfig(group_size=32), 4, "test")
    kwargs = dict(max_seq_len=64, decode_dtype=torch.float32, compile=False, int4_kernel="q4q8",
                  keep_model_weights=True)  # fmt: skip
    held = Runtime(model, **kwargs)
    # the tiny model's codes of at least hold_in_huge_pages' 4 KB, all in the one arena
    codes = [m.codes for m in held.layers.modules() if isinstance(m, engine._Q8Kernel)]
    codes = [c for c in codes if c.numel() >= 4096]
    assert held.huge_pages["moved"] >= len(codes) > 0
    arena_ptr = codes[0].untyped_storage().data_ptr()
    assert all(c.untyped_storage().data_ptr() == arena_ptr for c in codes)
    monkeypatch.setattr(engine, "hold_in_huge_pages", lambda modules: None)
    plain = Runtime(model, **kwargs)
    assert plain.huge_pages is None
    prompts = [[1, 5, 9, 33, 70, 100, 7], [1, 40, 50]]
    for prompt in prompts:
        assert held.generate([prompt], 10) == plain.generate([prompt], 10)


def test_hold_leaves_everything_in_place_when_the_arena_cannot_be_reserved(monkeypatch, caplog):
    def refuse(nbytes):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(memory, "HugePageArena", refuse)
    m = nn.Module()
    weight = torch.randn(64, 64)
    m.register_buffer("w", weight)
    out = hold_in_huge_pages([m])
    assert out == {"moved": 0, "moved_bytes": 0, "left": 1, "advised": False}
    assert m.w is weight
    assert "4 KB pages" in caplog.text
