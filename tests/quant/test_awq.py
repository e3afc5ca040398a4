"""AWQ: the scale search never does worse than RTN (its grid starts there), folding keeps the
float model unchanged (GQA included), clipping lowers the group error, the pass on the tiny
model."""

from __future__ import annotations

import pytest
import torch

from compress.core.registry import run_passes
from compress.quant.awq import (
    AwqConfig,
    _expand,
    _InputStats,
    _scale_group,
    search_clip,
    search_scale,
)
from compress.quant.calibrated import capture_first_layer_inputs, run_layer
from compress.quant.linear import QuantLinear, WeightScheme
from compress.quant.primitives import fake_quantize
from compress.testing import make_tiny_llama
from tests.quant.quant_helpers import (
    layer0_output_errors,
    output_error,
    real_slice,
    real_state,
    tiny_state,
)


def test_search_scale_beats_rtn_with_outlier_channels():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=gen)
    x[:, :4] *= 20  # activation outliers: the case AWQ is for
    w = torch.randn(32, 64, generator=gen)
    h = x.T @ x
    scheme = WeightScheme(4, 32, True, torch.float16)
    s, rtn_err, best_err = search_scale([w], [scheme], h, x.abs().mean(0), AwqConfig(group_size=32))
    direct = fake_quantize(w, n_bits=4, group_size=32, symmetric=True)
    assert rtn_err == pytest.approx(float(((x @ (direct - w).T) ** 2).sum()), rel=1e-3)
    assert best_err < 0.9 * rtn_err
    assert s.shape == (64,) and torch.all(s > 0)


def test_expand_matches_repeat_kv():
    from transformers.models.llama.modeling_llama import repeat_kv

    s = torch.arange(2 * 8, dtype=torch.float32)  # 2 KV heads x head_dim 8
    per_head = repeat_kv(s.reshape(1, 2, 1, 8), 3).reshape(-1)  # [6 heads * 8]
    assert torch.equal(_expand(s, 3, 8), per_head)


@torch.no_grad()
def test_folding_keeps_the_float_layer_unchanged():
    model = make_tiny_llama(num_attention_heads=4, num_key_value_heads=2)  # GQA: tie 2
    state = tiny_state()
    inputs = capture_first_layer_inputs(model, state.calibration_batches(), torch.device("cpu"))
    layer = model.model.layers[0]
    before = run_layer(layer, inputs)
    groups = [
        ("input_layernorm", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
        ("self_attn.v_proj", ["self_attn.o_proj"]),
        ("post_attention_layernorm", ["mlp.gate_proj", "mlp.up_proj"]),
        ("mlp.up_proj", ["mlp.down_proj"]),
    ]
    stats = _InputStats(layer, [c[0] for _, c in groups])
    run_layer(layer, inputs)
    stats.remove()
    for producer, consumers in groups:
        schemes = [WeightScheme(4, 32, True, torch.float16)] * len(consumers)
        result = _scale_group(layer, producer, consumers, stats, schemes, AwqConfig(group_size=32))
        assert isinstance(result, dict) and result["awq_error"] <= result["rtn_error"]
    after = run_layer(layer, inputs)
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_clip_search_does_not_increase_group_error():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 64, generator=gen)
    w = torch.randn(16, 64, generator=gen)
    w[0, 3] = 12.0  # a weight outlier that wastes the group's range
    scheme = WeightScheme(4, 32, True, torch.float16)
    h = x.T @ x
    clipped = search_clip(w, scheme, h, AwqConfig(group_size=32))

    def err(v):
        return float(
            ((x @ (fake_quantize(v, n_bits=4, group_size=32, symmetric=True) - w).T) ** 2).sum()
        )

    assert err(clipped) <= err(w)


def test_pass_on_tiny_model():
    model, reference_model = make_tiny_llama(), make_tiny_llama()
    state = tiny_state()
    run_passes(model, [AwqConfig(group_size=32, n_grid=5, clip_grid=5)], state)
    report = state.reports[-1]
    assert len(report.changed) == 14
    assert all(isinstance(model.get_submodule(n), QuantLinear) for n in report.changed)
    assert len(report.metrics["per_group"]) == 8  # 4 groups x 2 layers
    # sanity only (plain RTN meets it too); the comparison with RTN is the test below
    assert output_error(model, reference_model, torch.randint(3, 300, (2, 16))) < 1e-2


def _tiny_llama_with_outlier_channels(seed: int):
    """The tiny Llama with 4 of 64 channels of every RMSNorm weight scaled x10: activation
    outlier channels, as LLMs have them and as AWQ is designed for (a random model has none)."""
    model = make_tiny_llama(seed=seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[:4] *= 10
            layer.post_attention_layernorm.weight[:4] *= 10
    return model


@pytest.mark.parametrize("seed", [0, 1, 2], ids=lambda s: f"seed{s}")
def test_pass_beats_rtn_on_layer_output_error(seed):
    """AWQ's layer 0 against RTN's, same layer, same calibration inputs (the ones AWQ saw), with
    activation outlier channels. Measured ratio over seeds 0-29: 0.35-0.60. (Without outliers
    AWQ gains 0-25% and, with the coarse n_grid/clip_grid 5, is sometimes 7% worse.)"""
    awq_err, rtn_err = layer0_output_errors(
        _tiny_llama_with_outlier_channels(seed), AwqConfig(group_size=32), group_size=32,
        seed=seed,
    )
    assert awq_err < 0.75 * rtn_err, (awq_err, rtn_err)


@pytest.mark.real
def test_awq_not_worse_than_rtn_on_real_slice(smollm2, data_dir):
    from compress.quant.rtn import Int4RtnConfig

    state = real_state(smollm2, data_dir)
    ids = state.calibration_batches()[0][:, :64]
    model = real_slice(smollm2, n_layers=1)
    rtn, awq = real_slice(smollm2, n_layers=1), real_slice(smollm2, n_layers=1)
    run_passes(rtn, [Int4RtnConfig(group_size=64)], state)
    run_passes(awq, [AwqConfig(group_size=64, n_grid=10, clip_grid=10)], state)
    assert output_error(awq, model, ids) < output_error(rtn, model, ids)


@pytest.mark.parametrize("n,k", [(48, 700), (300, 1100), (8, 512)])
def test_output_error_is_the_float64_trace(n, k):
    """The search's error ``tr(D H D^T)``, summed over the upper triangle of ``D^T D`` a block
    at a time (blocks that do not divide K, a single block), against float64."""
    from compress.quant.awq import _output_error

    g = torch.Generator().manual_seed(k)
    d = torch.randn(n, k, generator=g) * 1e-2
    x = torch.randn(3 * k, k, generator=g) * torch.rand(k, generator=g)
    h = x.T @ x / x.shape[0]
    want = float(torch.trace(d.double() @ h.double() @ d.double().T))
    assert _output_error(d, h) == pytest.approx(want, rel=1e-5)
