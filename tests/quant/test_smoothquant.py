"""SmoothQuant + W8A8: per-token quantization vs float64, the int8 x int8 CPU path vs the float64
reference (exact), the pass on the tiny model, export/reload as int-quantized with dynamic
per-token input activations, and a W8A8 request on a layer type that cannot run it."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from compress.core.errors import RecipeError
from compress.core.registry import run_passes
from compress.io.export import export_checkpoint, load_compressed
from compress.kernels import dispatch
from compress.kernels.reference import quantize_per_token_int8
from compress.quant.linear import (
    W8A8Linear,
    int8_int8_float_exact,
    int8_int8_reference,
    w8a8_from_linear,
)
from compress.quant.smoothquant import SmoothquantConfig, smooth_scales
from compress.testing import make_tiny_llama
from tests.quant.quant_helpers import output_error, real_slice, real_state, tiny_state


def test_quantize_per_token_error_is_within_half_a_step():
    x = (
        torch.randn(7, 96, dtype=torch.float64)
        * torch.logspace(-2, 1, 7, dtype=torch.float64)[:, None]
    )
    x_q, scales = quantize_per_token_int8(x)
    assert x_q.dtype == torch.int8 and scales.shape == (7, 1)
    assert torch.all((x_q.double() * scales.double() - x).abs() <= scales.double() / 2 + 1e-9)


def test_float_exact_product_is_exact_where_one_float32_gemm_rounds():
    # worst case: all partial sums large and odd, K past the 1040-term exactness bound
    k = 2100
    x_q = torch.full((3, k), 127, dtype=torch.int8)
    w_q = torch.full((2, k), 127, dtype=torch.int8)
    w_q[1, ::2] = 1
    x_q[2, ::3] = -127
    expected = int8_int8_reference(x_q, w_q)
    assert expected.abs().max() > 2**24  # beyond float32's exact integers
    # A float32 sum taken term by term rounds here (whether one BLAS GEMM does depends on the
    # library's blocking and accumulator width, so the precondition is shown without BLAS).
    products = x_q.float()[:, None, :] * w_q.float()[None]  # [M, N, K], exact in float32
    running = torch.zeros(products.shape[:2])
    for i in range(k):
        running = running + products[..., i]
    assert not torch.equal(running.to(torch.int32), expected)
    assert torch.equal(int8_int8_float_exact(x_q, w_q.float()), expected)
    if dispatch.cpu_int_mm_fast():  # the backend the dispatcher would pick for it is exact too
        assert torch.equal(torch._int_mm(x_q, w_q.T.contiguous()), expected)


@pytest.mark.parametrize("backend", ["cpu", "float_exact", "auto"])
@pytest.mark.parametrize("m", [1, 7, 33])
def test_int8_cpu_paths_equal_float64_reference(m, backend):
    exact_int_mm = dispatch.cpu_int_mm_reason()
    if backend == "cpu" and exact_int_mm is not None:
        pytest.skip(f"backend='cpu' refuses here (tests/kernels/test_dispatch.py): {exact_int_mm}")
    torch.manual_seed(m)
    linear = nn.Linear(96, 40, bias=True)
    module = w8a8_from_linear(linear, torch.float32, backend=backend)
    x = torch.randn(m, 96)
    ref = w8a8_from_linear(linear, torch.float32, backend="reference")
    torch.testing.assert_close(module(x), ref(x), rtol=0, atol=0)
    x_q, sx = quantize_per_token_int8(x)
    acc = int8_int8_reference(x_q, module.weight)
    if exact_int_mm is None:
        assert torch.equal(torch._int_mm(x_q, module.weight.T.contiguous()), acc)
    expected = (acc.double() * sx.double() * module.weight_scale.double().T).float() + linear.bias
    torch.testing.assert_close(module(x), expected.detach(), rtol=1e-5, atol=1e-5)


def test_smooth_scales_formula():
    x_amax = torch.tensor([1.0, 100.0, 4.0])
    w = torch.tensor([[1.0, 0.5, 2.0], [0.5, 0.25, -4.0]])
    s = smooth_scales(x_amax, [w], alpha=0.5)
    torch.testing.assert_close(s, torch.sqrt(x_amax) / torch.sqrt(torch.tensor([1.0, 0.5, 4.0])))


def test_pass_on_tiny_model_and_export_round_trip(tmp_path, tiny_tokenizer):
    model, reference_model = make_tiny_llama(), make_tiny_llama()
    state = tiny_state()
    run_passes(model, [SmoothquantConfig(alpha=0.5)], state)
    report = state.reports[-1]
    assert len(report.changed) == 14
    assert all(type(model.get_submodule(n)) is W8A8Linear for n in report.changed)
    ids = torch.randint(3, 300, (2, 16))
    assert output_error(model, reference_model, ids) < 1e-4
    export_checkpoint(model, tiny_tokenizer, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    group = config["config_groups"]["group_0"]
    assert group["format"] == "int-quantized"
    assert (
        group["input_activations"]["strategy"] == "token" and group["input_activations"]["dynamic"]
    )
    reloaded = load_compressed(tmp_path / "ckpt")
    assert type(reloaded.model.layers[0].mlp.down_proj) is W8A8Linear
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)


def test_non_linear_target_is_reported_or_strict_error():
    model = make_tiny_llama()
    cfg = SmoothquantConfig(targets=("Linear", "re:.*embed_tokens"), strict=True)
    with pytest.raises(RecipeError, match="cannot run W8A8"):
        run_passes(model, [cfg], tiny_state())
    assert not any(isinstance(m, W8A8Linear) for m in model.modules())


@pytest.mark.real
def test_smoothquant_on_real_slice(smollm2, data_dir):
    state = real_state(smollm2, data_dir)
    ids = state.calibration_batches()[0][:, :64]
    model, plain, smooth = (real_slice(smollm2, n_layers=1) for _ in range(3))
    run_passes(plain, [SmoothquantConfig(smooth=False)], state)
    run_passes(smooth, [SmoothquantConfig(alpha=0.5)], state)
    assert output_error(smooth, model, ids) < output_error(plain, model, ids)
