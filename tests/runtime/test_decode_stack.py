"""A decode step's layers as one C++ call (``compress/runtime/decode_stack.py``).

Reference: the scheduler's Python loop over the same layers (``Scheduler(decode_stack=False)``),
itself held to the contiguous runtime and transformers in test_scheduler.py. Both runs take the
same requests; every hidden state that reaches the head must be equal bit for bit."""

from __future__ import annotations

import random

import pytest
import torch

from compress.kernels import cpu_q8
from compress.quant.rtn import Int4RtnConfig, Int8RtnConfig, quantize_linears
from compress.runtime import decode_stack, float_linear
from compress.runtime.engine import Runtime
from compress.runtime.scheduler import Scheduler

from .test_scheduler import ALL_FAMILIES, drive, family_model, random_requests

pytestmark = pytest.mark.skipif(cpu_q8.unavailable_reason() is not None,
                                reason=f"no CPU kernels here: {cpu_q8.unavailable_reason()}")

# the families whose decode steps stay in the Python loop (MoE blocks, latent attention, an
# activation module); every other one must run in C++
LEFT_IN_PYTHON = {"mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "minimax_m2", "phimoe",
                  "exaone_moe", "hunyuan_v1_moe", "granitemoe", "solar_open", "gpt_oss",
                  "deepseek_v3", "deepseek_v3_q_proj", "deepseek_v3_dense_first",
                  "glm4_moe_lite", "deepseek_v2", "deepseek_v3_yarn", "apertus"}  # fmt: skip


def heads_seen(runtime: Runtime, scheduler: Scheduler, requests, seed: int = 0):
    """The head's inputs of every forward (and the tokens) with ``requests`` driven in."""
    seen = []
    hook = runtime.head.register_forward_pre_hook(lambda _m, args: seen.append(args[0].clone()))
    try:
        tokens = drive(scheduler, requests, random.Random(seed))
    finally:
        hook.remove()
    return seen, tokens


def stack_runs(scheduler: Scheduler) -> list[int]:
    """Row counts of the C++ loop's calls (recorded from now on)."""
    rows = []
    run = scheduler.decode_stack.run

    def counted(x, *args):
        rows.append(x.shape[0])
        return run(x, *args)

    scheduler.decode_stack.run = counted
    return rows


def assert_same_steps(runtime: Runtime, requests, **kwargs) -> list[int]:
    """The same requests through the C++ loop and the Python one: equal head inputs; -> the
    row counts the C++ loop ran."""
    reference = Scheduler(runtime, num_blocks=64, block_size=4, max_batch=5, prefill_budget=24,
                          decode_stack=False, **kwargs)  # fmt: skip
    expected = heads_seen(runtime, reference, requests)
    scheduler = Scheduler(runtime, num_blocks=64, block_size=4, max_batch=5, prefill_budget=24,
                          **kwargs)  # fmt: skip
    assert scheduler.decode_stack is not None, scheduler.decode_stack_reason
    rows = stack_runs(scheduler)
    got = heads_seen(runtime, scheduler, requests)
    assert got[1] == expected[1]
    assert len(got[0]) == len(expected[0])
    for a, b in zip(got[0], expected[0], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert rows and max(rows) > 1  # one-row and batched steps both ran in C++
    return rows


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_every_family_either_runs_its_python_steps_bit_for_bit_or_says_why_not(family):
    runtime = Runtime(family_model(family), max_seq_len=96, compile=False)
    requests = random_requests(random.Random(len(family)), 7)
    probe = Scheduler(runtime, num_blocks=64, block_size=4)
    if probe.decode_stack is None:
        assert family in LEFT_IN_PYTHON, probe.decode_stack_reason
        assert probe.decode_stack_reason.startswith("layer ")  # names the layer and the cause
        return
    assert family not in LEFT_IN_PYTHON
    assert_same_steps(runtime, requests)


@pytest.mark.parametrize("scheme", ["int4-tiles", "int4-rows", "int8"])
def test_int_layers_through_our_kernels(scheme, monkeypatch):
    model = family_model("qwen2")  # q/k/v biases on the int layers, sliding window
    if scheme == "int8":
        quantize_linears(model, Int8RtnConfig(), 8, "test")
    else:
        quantize_linears(model, Int4RtnConfig(group_size=32), 4, "test")
    if scheme == "int4-rows":
        monkeypatch.setattr(cpu_q8, "TILE_WIDTHS", {})
    runtime = Runtime(model, max_seq_len=96, compile=False, int4_kernel="q4q8",
                      int8_kernel="q8q8")  # fmt: skip
    q8 = runtime.layers[0].qkv.q8
    tiled = cpu_q8.tile_width(cpu_q8.selected_isa()) is not None
    assert q8.tiles == (scheme == "int4-tiles" and tiled)
    assert q8.bits == (8 if scheme == "int8" else 4)
    assert_same_steps(runtime, random_requests(random.Random(1), 8))


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_layers_of_mixed_precision(family):
    """Each linear its own kind, as a ``compress tune`` export leaves them: layer 0's MLP int4
    (Gemma 3: its gate alone, so gate and up stay two calls, through torch's GELU), layer 1's
    attention int8, the rest float."""
    model = family_model(family)
    mlp = r"re:.*layers\.0\.mlp" + (r"\.gate_proj" if family != "llama" else "")
    quantize_linears(model, Int4RtnConfig(group_size=32, targets=(mlp,)), 4, "test")
    quantize_linears(model, Int8RtnConfig(targets=(r"re:.*layers\.1\.self_attn",)), 8, "test")
    runtime = Runtime(model, max_seq_len=96, compile=False, int4_kernel="q4q8",
                      int8_kernel="q8q8")  # fmt: skip
    kinds = [[type(getattr(layer, n)).__name__ for n in decode_stack.LINEARS[:6]]
             for layer in runtime.layers]  # fmt: skip
    if family == "llama":
        assert kinds[0] == ["_FloatLinear", "_FloatLinear", "_Int4Linear", "_Int4Linear",
                            "NoneType", "NoneType"]  # fmt: skip
    else:
        assert kinds[0] == ["_FloatLinear", "_FloatLinear", "NoneType", "_FloatLinear",
                            "_Int4Linear", "_FloatLinear"]  # fmt: skip
    assert kinds[1][:2] == ["_Int8Linear", "_Int8Linear"]
    assert_same_steps(runtime, random_requests(random.Random(6), 8), kv_dtype="int8")


def test_bf16_runtime_and_bf16_pages():
    runtime = Runtime(family_model("qwen3"), max_seq_len=96, compile=False,
                      prefill_dtype=torch.bfloat16, decode_dtype=torch.bfloat16)  # fmt: skip
    assert_same_steps(runtime, random_requests(random.Random(2), 8), kv_dtype="bfloat16")


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_pages(kv_dtype):
    """int8 pages (codes and a scale per token and head) and fp8 ones (a scale per layer, here
    not 1.0): the C++ loop writes the Python loop's bytes and attends over them alike."""
    runtime = Runtime(family_model("mistral"), max_seq_len=96, compile=False)
    if kv_dtype == "fp8":
        runtime.kv_scales = [(0.5 + i, 0.25 + i) for i in range(len(runtime.layers))]
    assert_same_steps(runtime, random_requests(random.Random(5), 8), kv_dtype=kv_dtype)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
@pytest.mark.parametrize("min_elements", [0, 1 << 62])
def test_onednn_packed_fp32_weights(min_elements, monkeypatch):
    """fp32 weights of values off the bf16 grid: oneDNN-packed only (min_elements 0), or
    packed with their plain copy for steps under FP32_PACKED_MIN_ROWS rows (the default for
    small weights), where the row count picks the GEMM."""
    monkeypatch.setattr(float_linear, "FP32_PACK_MIN_ELEMENTS", min_elements)
    runtime = Runtime(family_model("llama"), max_seq_len=96, compile=False)
    qkv = runtime.layers[0].qkv
    assert qkv.packed is not None and (qkv.w_decode is None) == (min_elements == 0)
    rows = assert_same_steps(runtime, random_requests(random.Random(3), 9))
    if min_elements:
        assert min(rows) < float_linear.FP32_PACKED_MIN_ROWS <= max(rows)


def test_steps_from_max_rows_stay_in_python():
    runtime = Runtime(family_model("llama"), max_seq_len=96, compile=False)
    scheduler = Scheduler(runtime, num_blocks=64, block_size=4, max_batch=5)
    scheduler.decode_stack.max_rows = 3  # as an int layer's AMX or float GEMM switch sets it
    rows = stack_runs(scheduler)
    requests = random_requests(random.Random(4), 6)
    reference = Scheduler(runtime, num_blocks=64, block_size=4, max_batch=5, decode_stack=False)
    assert drive(scheduler, requests) == drive(reference, requests)
    assert rows and max(rows) < 3


def test_reasons_it_stays_in_python():
    runtime = Runtime(family_model("llama"), max_seq_len=96, compile=False)
    for kwargs, reason in [
        (dict(attention="reference"), "decode attention gathers (asked for)"),
        (dict(decode_stack=False), "asked for"),
    ]:
        scheduler = Scheduler(runtime, num_blocks=16, block_size=4, **kwargs)
        assert scheduler.decode_stack is None and reason in scheduler.decode_stack_reason
    runtime.layers[1].fused = False
    stack, reason = decode_stack.build(runtime)
    assert stack is None and reason == "layer 1: the fused CPU ops are off"


def test_the_native_object_refuses_bad_descriptions():
    native = cpu_q8.classes().DecodeStack()
    w = torch.zeros(8, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="linear kind 9 unknown"):
        native.add_linear(9, w, None, None, 0, None, 0, 0)
    with pytest.raises(RuntimeError, match="scales go with int codes only"):
        native.add_linear(decode_stack.KINDS["bf16_weight"], w, w, None, 0, None, 0, 0)
    with pytest.raises(RuntimeError, match="a bias is a contiguous fp32"):
        native.add_linear(decode_stack.KINDS["bf16_weight"], w, None, None, 0, w[0], 0, 0)
    i = native.add_linear(decode_stack.KINDS["bf16_weight"], w, None, None, 0, None, 0, 0)
    norms = [torch.ones(8), torch.ones(8)] + [None] * 8
    ints, floats = [1, 1, 8, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0], [1e-6, 1.0, 0.0, float("nan")]
    linears = [i, i, i, i, -1, -1, -1, -1, -1]
    with pytest.raises(RuntimeError, match="linear 5 was not added"):
        native.add_layer(norms, [i, i, i, 5, -1, -1, -1, -1, -1], [0, 0, 0], ints, floats)
    with pytest.raises(RuntimeError, match="a layer has qkv or q, k and v"):
        native.add_layer(norms, [i, i, -1, i, -1, -1, -1, -1, -1], [0, 0, 0], ints, floats)
    with pytest.raises(RuntimeError, match="a layer has qkv or q, k and v"):
        native.add_layer(norms, [i, i, i, i, -1, -1, i, i, i], [0, 0, 0], ints, floats)
    with pytest.raises(RuntimeError, match="activation 7 unknown"):
        native.add_layer(norms, linears, [0, 0, 0], [*ints[:5], 7, 0, *ints[7:]], floats)
    with pytest.raises(RuntimeError, match="the fused finish is SiLU"):
        native.add_layer(norms, linears, [0, 0, 0], [*ints[:5], 1, 1, *ints[7:]], floats)
    with pytest.raises(RuntimeError, match="the fused projection is RMSNorm"):
        native.add_layer(norms, linears, [0, 0, 0], [*ints[:8], 1, *ints[9:]], floats)
    with pytest.raises(RuntimeError, match="rope_perm is an int64"):
        native.add_layer([*norms[:9], torch.ones(8)], linears, [0, 0, 0], ints, floats)
    with pytest.raises(RuntimeError, match="q and k norms come together"):
        native.add_layer([*norms[:5], torch.ones(8), *norms[6:]], linears, [0, 0, 0], ints,
                         floats)  # fmt: skip
    with pytest.raises(RuntimeError, match="a layer takes 10 norm slots"):
        native.add_layer(norms[:2], linears, [0, 0, 0], ints, floats)
    native.add_layer(norms, linears, [0, 0, 0], ints, floats)
    x, rope, pages = torch.zeros(1, 8), [torch.ones(1, 8)], [torch.zeros(4, 1, 8)]
    rows = torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="1 layers, 0 key and 0 value pools"):
        native.run(x, rope, rope, *rows, torch.ones(1, dtype=torch.long), [], [], [], [], 4)
    with pytest.raises(RuntimeError, match="a key and a value scale tensor per layer"):
        native.run(x, rope, rope, *rows, torch.ones(1, dtype=torch.long), pages, pages,
                   [torch.ones(1)], [], 4)  # fmt: skip
