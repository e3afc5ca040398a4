"""The device a recipe or ``--device`` names (issue 34): specs, resolution, and evaluation's
placement. Without a GPU the CUDA side runs under ``FakeTensorMode`` with ``cuda:0`` (fake
tensors carry the device and refuse to mix it with the CPU, as CUDA does, but hold no values)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import compress.core.device as device_mod
from compress.core.device import move_tensors, on_eval_device, resolve_device
from compress.core.errors import RecipeError
from compress.testing import make_tiny_llama

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answers")


@no_gpu
@pytest.mark.parametrize("spec, want", [("cpu", "cpu"), ("auto", "cpu")])
def test_cpu_and_auto_without_a_gpu(spec, want):
    assert resolve_device(spec) == torch.device(want)


@no_gpu
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_a_gpu_is_a_recipe_error_with_the_fix(spec):
    with pytest.raises(RecipeError, match=rf"--device: {spec} was asked for.*Fix: use device: cpu"):
        resolve_device(spec, where="--device")


@pytest.mark.parametrize("spec", ["gpu", "CUDA", "cuda:x", "cuda:", "", 0], ids=repr)
def test_malformed_spec_names_the_forms(spec):
    with pytest.raises(RecipeError, match=r"device: device=.* write auto, cpu, cuda or cuda:N"):
        resolve_device(spec)  # type: ignore[arg-type]


def test_auto_is_the_first_gpu_and_an_index_beyond_the_machine_is_refused(monkeypatch):
    monkeypatch.setattr(device_mod, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)  # with an index: one device name
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(RecipeError, match=r"has 2 GPU\(s\) \(cuda:0 to cuda:1\)"):
        resolve_device("cuda:2")


def test_eval_on_the_cpu_moves_and_casts_nothing():
    model = make_tiny_llama()
    before = {k: v for k, v in model.state_dict(keep_vars=True).items()}
    with on_eval_device(model, torch.device("cpu")) as placed:
        assert placed == {"device": "cpu", "dtype": "float32"}
        now = model.state_dict(keep_vars=True)
        assert all(now[k] is v for k, v in before.items())
    assert move_tensors(model, torch.device("cpu")) == []


def test_eval_on_a_gpu_runs_there_in_bf16_and_puts_the_model_back(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    model = make_tiny_llama()
    before = dict(model.state_dict(keep_vars=True))
    cuda = torch.device("cuda", 0)
    # (a forward through transformers' rotary code asks the CPU-only build for CUDA itself, so
    # the device-mismatch check of a forward is done on meta, tests/quant/test_calibrated_device)
    with FakeTensorMode(allow_non_fake_inputs=True):
        with on_eval_device(model, cuda) as placed:
            assert placed == {"device": "cuda:0 (Fake GPU)", "dtype": "bfloat16"}
            assert {(p.device, p.dtype) for p in model.parameters()} == {(cuda, torch.bfloat16)}
            assert {(b.device, b.dtype) for b in model.buffers()} == {(cuda, torch.float32)}
    now = model.state_dict(keep_vars=True)
    assert all(now[k] is v for k, v in before.items()), "the very CPU tensors are back"


def test_current_device_makes_an_indexed_gpu_current_and_leaves_the_cpu_alone(cuda_scopes):
    """Triton kernels launch on the current GPU: work on cuda:1 runs inside
    ``torch.cuda.device(1)``; the CPU and an unindexed ``cuda`` need nothing."""
    from compress.core.device import current_device

    for spec in ("cpu", "cuda", "cuda:1"):
        with current_device(torch.device(spec)):
            cuda_scopes.append(f"in {spec}")
    assert cuda_scopes == ["in cpu", "in cuda", 1, "in cuda:1", "exit"]
