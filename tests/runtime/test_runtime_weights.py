"""The runtime holds one copy of a quantized model's weights: each quantized linear's own tensors
are released from the model once the runtime holds its layout (``layers.release_weights``),
tokens equal those of a runtime that kept the model whole, and a caller who needs both asks
(``keep_model_weights=True``). A runtime for the scheduler allocates no contiguous KV cache."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from compress.quant.linear import QuantLinear
from compress.quant.rtn import Int4RtnConfig, Int8RtnConfig, quantize_linears
from compress.runtime.engine import Runtime
from compress.runtime.scheduler import Scheduler
from compress.testing import hf_greedy, make_tiny_llama

PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8, 21, 64, 3], [1, 40, 50]]
SETTINGS = dict(max_seq_len=64, max_batch_size=2, compile=False)


def quantized_model(bits: int = 4):
    model = make_tiny_llama(initializer_range=0.3)  # not degenerate: tokens vary
    cfg = Int4RtnConfig(group_size=32) if bits == 4 else Int8RtnConfig()
    quantize_linears(model, cfg, bits, "test")
    return model


def quant_layers(model) -> list[QuantLinear]:
    return [m for m in model.modules() if isinstance(m, QuantLinear)]


def _kernels(kernel: str) -> dict[str, str]:
    from compress.kernels import cpu_q8

    if kernel == "ours" and cpu_q8.unavailable_reason() is not None:
        pytest.skip(f"integer-dot kernels not available here: {cpu_q8.unavailable_reason()}")
    return dict(int4_kernel="q4q8", int8_kernel="q8q8") if kernel == "ours" else {}


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("kernel", ["torch", "ours"])
def test_building_the_runtime_releases_the_models_quantized_tensors(bits, kernel):
    kernels = _kernels(kernel)
    model = quantized_model(bits)
    # the previous behaviour: a runtime over an untouched copy that keeps its weights
    kept = copy.deepcopy(model)
    expected = Runtime(kept, **SETTINGS, **kernels, keep_model_weights=True).generate(PROMPTS, 12)
    names = ("weight_packed", "weight", "weight_scale", "weight_zero_point")
    tensors = [getattr(m, n) for m in quant_layers(model) for n in names if hasattr(m, n)]
    alive = [weakref.ref(t) for t in tensors]
    del tensors
    rt = Runtime(model, **SETTINGS, **kernels)
    gc.collect()
    # nothing keeps the model's codes and scales (an aligned int8 weight that torch's kernel
    # shares would stay alive through the runtime: only its q8 path copies)
    if bits == 4 or kernel == "ours":
        assert alive and all(ref() is None for ref in alive)
    assert all(m.weight_scale.is_meta for m in quant_layers(model))
    assert rt.generate(PROMPTS, 12) == expected
    # the kept model is whole: its layers still hold real tensors
    assert not any(m.weight_scale.is_meta for m in quant_layers(kept))


def test_released_bytes_bound_what_the_runtime_and_model_hold_together():
    # the runtime's decode-phase weights plus whatever real tensors the model still holds
    # stay within one copy of the weights: the model's float parts plus the int4 layers'
    # runtime layout, not the model's packed int4 tensors on top
    model = quantized_model(4)
    packed = sum(m.weight_bytes() for m in quant_layers(model))
    before = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    rt = Runtime(model, **SETTINGS)
    left = sum(t.numel() * t.element_size() for t in model.state_dict().values() if not t.is_meta)
    assert left <= before - packed
    assert rt.generate([PROMPTS[1]], 4)  # the runtime runs on what it holds


def test_a_released_model_refuses_to_run_and_to_build_a_second_runtime():
    model = quantized_model(4)
    Runtime(model, **SETTINGS)
    with pytest.raises(RuntimeError, match="keep_model_weights=True"):
        model(torch.tensor([PROMPTS[0]]))
    with pytest.raises(RuntimeError, match="keep_model_weights=True"):
        Runtime(model, **SETTINGS)


def test_keep_model_weights_leaves_the_model_runnable_and_equal():
    model = quantized_model(4)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        logits = model(ids).logits
    reference = hf_greedy(model, PROMPTS[0], 12)
    rt = Runtime(model, **SETTINGS, decode_dtype=torch.float32, keep_model_weights=True)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)
    assert rt.generate([PROMPTS[0]], 12) == [reference]
    # a second runtime from the same kept model works, and releases it
    second = Runtime(model, **SETTINGS, decode_dtype=torch.float32)
    assert second.generate([PROMPTS[0]], 12) == [reference]


def test_a_float_model_keeps_its_weights():
    # float linears are shared with the runtime where the dtypes match, never released
    model = make_tiny_llama(initializer_range=0.3)
    Runtime(model, **SETTINGS)
    assert hf_greedy(model, PROMPTS[0], 4)  # runs


def test_a_runtime_without_static_cache_serves_the_scheduler_only():
    model = quantized_model(4)
    expected = Runtime(copy.deepcopy(model), **SETTINGS).generate(PROMPTS, 10)
    rt = Runtime(model, **SETTINGS, static_cache=False)
    assert rt.k_cache == [] and rt.v_cache == [] and rt.decode_bytes()["kv_cache"] == 0
    with pytest.raises(RuntimeError, match="static_cache"):
        rt.generate(PROMPTS, 4)
    with pytest.raises(RuntimeError, match="static_cache"):
        rt.prefill(PROMPTS[0])
    scheduler = Scheduler(rt, num_blocks=16, block_size=16, max_batch=2)
    ids = {scheduler.add(p, 10): i for i, p in enumerate(PROMPTS)}
    out: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    while scheduler.has_work:
        for event in scheduler.step():
            out[ids[event.id]].append(event.token)
    assert [out[i] for i in range(len(PROMPTS))] == expected
