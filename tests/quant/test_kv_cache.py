"""fp8 KV-cache scales (``quantize.kv_cache_fp8``): calibrated against transformers' own KV
cache, written in the form vLLM reads, loaded back, and used by the scheduler's fp8 pages."""

from __future__ import annotations

import json
import random

import pytest
import torch
from pydantic import ValidationError
from safetensors import safe_open

from compress.core.errors import ModelLoadError
from compress.core.registry import CompressionState, run_passes
from compress.io.export import export_checkpoint, load_compressed
from compress.quant.kv_cache import KvCacheFp8Config
from compress.quant.kv_scales import KV_CACHE_SCHEME, kv_cache_scales
from compress.quant.rtn import Int4RtnConfig
from compress.runtime.engine import Runtime
from compress.runtime.paged import FP8, dequantize_fp8, kv_bytes_per_token, quantize_fp8
from compress.runtime.scheduler import Scheduler

from ..runtime.test_runtime_families import arch_of
from ..runtime.test_scheduler import ALL_FAMILIES, family_model, kl_against_contiguous


def calibration(seed: int = 0) -> tuple[torch.Tensor, CompressionState]:
    ids = torch.randint(1, 300, (3, 20), generator=torch.Generator().manual_seed(seed))
    return ids, CompressionState(calibration_batches=lambda: list(ids.split(1)), progress=False)


def cache_amax(model, ids: torch.Tensor) -> list[tuple[float, float]]:
    """max|k| and max|v| per layer from transformers' own DynamicCache after each sequence's
    forward: what a KV cache holds (keys after RoPE and any key norm). Built without the config,
    so sliding-window layers keep every key too."""
    from transformers import DynamicCache

    from compress.eval.latency import model_forward

    amax: list[list[float]] = []
    with torch.no_grad():
        for row in ids.split(1):
            cache = DynamicCache()
            model_forward(model, row, cache)
            for i, layer in enumerate(cache.layers):
                pair = [float(layer.keys.abs().max()), float(layer.values.abs().max())]
                if i == len(amax):
                    amax.append(pair)
                amax[i] = [max(a, b) for a, b in zip(amax[i], pair, strict=True)]
    return [(k, v) for k, v in amax]


# latent attention caches a latent, not keys and values: the pass refuses it (its own test in
# tests/quant/test_latent_attention.py)
@pytest.mark.parametrize("family", [f for f in ALL_FAMILIES
                                    if not arch_of(f).latent_attention])
def test_scales_map_the_largest_cached_key_and_value_onto_448(family):
    model = family_model(family)
    ids, state = calibration()
    want = cache_amax(model, ids)
    run_passes(model, [KvCacheFp8Config()], state)
    got = kv_cache_scales(model)
    assert got is not None and len(got) == len(want)
    for (k_scale, v_scale), (k_amax, v_amax) in zip(got, want, strict=True):
        assert k_scale * 448 == pytest.approx(k_amax, rel=1e-5)
        assert v_scale * 448 == pytest.approx(v_amax, rel=1e-5)
    report = state.reports[-1]
    assert len(report.changed) == len(want) and report.metrics["kv_cache_scheme"]["type"] == "float"


def test_margin_widens_the_scale_and_selections_are_refused():
    model = family_model("llama")
    ids, state = calibration()
    run_passes(model, [KvCacheFp8Config()], state)
    plain = kv_cache_scales(model)
    run_passes(model, [KvCacheFp8Config(margin=2.0)], state)
    assert kv_cache_scales(model) == pytest.approx([(2 * k, 2 * v) for k, v in plain], rel=1e-6)
    with pytest.raises(ValidationError, match="scales every decoder layer's cache"):
        KvCacheFp8Config(targets=("re:.*k_proj",))
    with pytest.raises(ValidationError, match="margin"):
        KvCacheFp8Config(margin=0.5)


def test_the_export_carries_the_scheme_and_scales_and_loads_back(tmp_path, tiny_tokenizer):
    """W4 weights then fp8 KV scales: config ``kv_cache_scheme`` as llm-compressor writes it,
    one fp32 ``self_attn.k_scale`` / ``v_scale`` per layer (vLLM's names), read back by the
    loader and the runtime; without weight quantization the config is compressed-tensors'
    dense format with the scheme alone."""
    model = family_model("llama")
    ids, state = calibration()
    run_passes(model, [Int4RtnConfig(group_size=32), KvCacheFp8Config()], state)
    scales = kv_cache_scales(model)
    out = export_checkpoint(model, tiny_tokenizer, tmp_path / "w4-fp8kv", dtype="bfloat16")
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["kv_cache_scheme"] == KV_CACHE_SCHEME and quant["config_groups"]
    with safe_open(out / "model.safetensors", "pt") as f:
        for i, (k_scale, v_scale) in enumerate(scales):
            for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
                tensor = f.get_tensor(f"model.layers.{i}.self_attn.{name}")
                assert tensor.dtype == torch.float32 and tensor.shape == (1,)
                assert float(tensor) == value
    loaded = load_compressed(out)
    assert kv_cache_scales(loaded) == scales
    from compress.io.inspect import inspect_checkpoint

    report = inspect_checkpoint(out)
    assert "KV cache: float8 per tensor" in report["markdown"]
    kv_rows = [r for r in report["layers"] if r["format"] == "fp8 KV-cache scales"]
    assert [r["module"] for r in kv_rows] == [f"model.layers.{i}.self_attn"
                                              for i in range(len(scales))]  # fmt: skip
    assert all(r["bytes"] == 8 for r in kv_rows)
    assert Runtime(loaded, max_seq_len=32, compile=False).kv_scales == scales

    plain = family_model("llama")
    run_passes(plain, [KvCacheFp8Config()], calibration()[1])
    out = export_checkpoint(plain, tiny_tokenizer, tmp_path / "fp8kv", dtype="float32")
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["format"] == "dense" and quant["config_groups"] == {}
    assert quant["kv_cache_scheme"] == KV_CACHE_SCHEME
    assert kv_cache_scales(load_compressed(out)) == kv_cache_scales(plain)


def test_a_nan_scale_in_the_checkpoint_is_refused(tmp_path, tiny_tokenizer):
    from safetensors.torch import load_file, save_file

    model = family_model("llama")
    run_passes(model, [KvCacheFp8Config()], calibration()[1])
    out = export_checkpoint(model, tiny_tokenizer, tmp_path / "fp8kv")
    tensors = load_file(out / "model.safetensors")
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor([float("nan")])
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="v_scale holds NaN"):
        load_compressed(out)


def test_fp8_pages_take_half_of_bf16_and_follow_the_fp32_model():
    """Calibrated fp8 pages: head_dim bytes per token and head, values within half an fp8 step
    of what was written, and a request's logits close to the contiguous fp32 runtime's."""
    model = family_model("llama")
    run_passes(model, [KvCacheFp8Config()], calibration()[1])
    runtime = Runtime(model, max_seq_len=64, compile=False)
    layers, n_kv, d = len(runtime.layers), runtime.layers[0].n_kv, runtime.layers[0].head_dim
    assert kv_bytes_per_token(layers, n_kv, d, FP8) == 2 * layers * n_kv * d
    assert 2 * kv_bytes_per_token(layers, n_kv, d, FP8) == kv_bytes_per_token(
        layers, n_kv, d, torch.bfloat16)
    x = torch.randn(50, 2, 16) * 3
    scale = torch.tensor([0.01])
    back = dequantize_fp8(quantize_fp8(x, scale), scale)
    inside = x.abs() <= 448 * 0.01
    # e4m3: 3 mantissa bits, so at most 2^-4 relative (normals) or half of 2^-9 x scale
    err = (back - x).abs()
    assert (err[inside] <= torch.maximum(x[inside].abs() / 16, torch.tensor(2**-10 * 0.01))).all()
    assert torch.equal(back[~inside], x[~inside].sign() * 4.48)  # saturated, never NaN
    scheduler = Scheduler(runtime, num_blocks=32, block_size=4, kv_dtype="fp8")
    assert [float(s) for s in scheduler.cache.k_scale] == [k for k, _ in runtime.kv_scales]
    tokens, exact, kl = kl_against_contiguous(scheduler, [3, 17, 29, 41, 5, 60, 7, 80], 8)
    # e4m3 keeps 3 mantissa bits (int8 per token: 7), on a random model whose activations are
    # wide (init 0.3); a real model's cost is measured by compress.eval.kv_quality
    assert max(kl) < 0.2 and sum(kl) / len(kl) < 0.05, kl
    assert tokens[0] == int(exact[0].argmax())


def test_fp8_pages_without_scales_use_one_and_bad_scales_are_refused(caplog):
    runtime = Runtime(family_model("llama"), max_seq_len=64, compile=False)
    assert runtime.kv_scales is None
    with caplog.at_level("WARNING"):
        scheduler = Scheduler(runtime, num_blocks=8, block_size=4, kv_dtype="fp8")
    assert "every scale is 1.0" in caplog.text
    assert all(float(s) == 1.0 for s in scheduler.cache.k_scale + scheduler.cache.v_scale)
    runtime.kv_scales = [(0.0, 1.0)] * len(runtime.layers)
    with pytest.raises(ValueError, match="finite and > 0"):
        Scheduler(runtime, num_blocks=8, block_size=4, kv_dtype="fp8")


def test_fp8_decode_kernel_computes_the_gathered_attention():
    """fp8 pages through decode steps that attend in the pool (the C++ kernel) and through the
    gather + the runtime's attention: the same greedy tokens (the randomized driver of the
    int8/fp32 test, calibrated scales)."""
    from compress.kernels import cpu_attention

    reason = cpu_attention.unavailable_reason(FP8, torch.device("cpu"))
    if reason is not None:
        pytest.skip(f"the paged-attention kernel does not run here: {reason}")
    from ..runtime.test_scheduler import drive, random_requests

    model = family_model("qwen3")
    run_passes(model, [KvCacheFp8Config()], calibration()[1])
    runtime = Runtime(model, max_seq_len=96, compile=False)
    requests = random_requests(random.Random(7), 8)
    tokens = {}
    for attention in ("kernel", "reference"):
        scheduler = Scheduler(runtime, num_blocks=40, block_size=4, max_batch=4, prefill_budget=24,
                              kv_dtype="fp8", attention=attention)  # fmt: skip
        assert (scheduler.attention_reason is None) == (attention == "kernel")
        tokens[attention] = drive(scheduler, requests)
    assert tokens["kernel"] == tokens["reference"]
