"""Sequential calibration on a device other than the CPU, checked without a GPU (issue 34).

The stand-in device is ``meta`` under ``FakeTensorMode``: fake tensors carry a device and raise
``FakeTensorDeviceMismatchError`` when an op mixes two, as CUDA does, but hold no values. So the
capture forward and each layer really run with their tensors where ``run_sequential`` put them;
a module left on the CPU (the embedding, the rotary tables, the final norm) fails the forward.
Two things are swapped for the fake run only: the NaN checks (they read values, which fake
tensors do not have) and ``_send``'s ``nn.Module.to`` (it cannot swap fake parameters), by a
move that replaces the tensors the same way. On the CPU the path is checked bit for bit against
the same run with every move disabled.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import compress.quant.calibrated as calibrated
from compress.core.device import move_tensors, on_device
from compress.core.registry import run_passes
from compress.quant.gptq import GptqConfig
from compress.testing import make_tiny_llama
from tests.quant.quant_helpers import tiny_state

DEVICE = torch.device("meta")  # stands in for cuda:0


def _devices(module: nn.Module) -> set[str]:
    return {t.device.type for t in (*module.parameters(), *module.buffers())}


def _swap_to(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` by replacing each tensor (fake parameters cannot be swapped)."""
    for owner in module.modules():
        for table in (owner._parameters, owner._buffers):
            for name, tensor in list(table.items()):
                if tensor is not None:
                    moved = tensor.detach().to(device)
                    is_param = isinstance(tensor, nn.Parameter)
                    table[name] = nn.Parameter(moved, requires_grad=False) if is_param else moved


@pytest.fixture
def fake_device(monkeypatch):
    monkeypatch.setattr(calibrated, "_all_finite", lambda x: True)
    monkeypatch.setattr(calibrated, "_send", _swap_to)
    with FakeTensorMode(allow_non_fake_inputs=True):
        yield DEVICE


def test_capture_and_layers_run_on_the_device_and_come_back(fake_device):
    model = make_tiny_llama()
    inner = model.model
    outside = {"embed": inner.embed_tokens, "rotary": inner.rotary_emb, "norm": inner.norm}
    originals = {name: list(m.state_dict(keep_vars=True).values()) for name, m in outside.items()}
    at_capture: dict[str, set[str]] = {}

    def record(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            at_capture.setdefault(name, _devices(module))

        return hook

    for name, module in outside.items():
        module.register_forward_pre_hook(record(name))
    seen = []

    def process(index, layer, inputs):
        others = [other for other in inner.layers if other is not layer]
        kwarg_devices = {v.device.type for kw in inputs.kwargs for v in kw.values()
                         if isinstance(v, torch.Tensor)}
        kwarg_devices |= {t.device.type for kw in inputs.kwargs for v in kw.values()
                          if isinstance(v, tuple) for t in v}  # (cos, sin)
        seen.append((index, _devices(layer), {h.device.type for h in inputs.hidden},
                     kwarg_devices, set().union(*map(_devices, others)),
                     _devices(model.lm_head)))

    calibrated.run_sequential(model, tiny_state().calibration_batches(), process,
                              device=fake_device, progress=False)
    # the capture forward ran with the embedding, rotary tables and final norm on the device
    assert at_capture == {"embed": {"meta"}, "rotary": {"meta"}, "norm": {"meta"}}
    for index, (i, layer, hidden, kwargs, others, head) in enumerate(seen):
        assert i == index
        assert layer == hidden == kwargs == {"meta"}, "the layer, its inputs and rotary tables"
        assert others == {"cpu"}, "only one decoder layer on the device at a time"
        assert head == {"cpu"}, "the output head is not needed by the capture"
    assert len(seen) == len(inner.layers)
    assert _devices(model) == {"cpu"}, "every layer and the capture's modules came back"
    for name, module in outside.items():  # the very tensors they held: nothing was copied back
        assert all(a is b for a, b in zip(module.state_dict(keep_vars=True).values(),
                                          originals[name], strict=True))


def test_capture_without_the_onload_fails_on_the_device(fake_device, monkeypatch):
    """The check above can fail: with the modules outside the stack left on the CPU (the bug
    of issue 34), the capture forward mixes devices."""
    monkeypatch.setattr(calibrated, "_capture_on", lambda *a: contextlib.nullcontext())
    model = make_tiny_llama()
    with pytest.raises(RuntimeError, match="device"):
        calibrated.run_sequential(model, tiny_state().calibration_batches(), lambda *a: None,
                                  device=fake_device, progress=False)


def test_on_device_casts_parameters_keeps_buffers_ties_and_restores():
    model = make_tiny_llama()
    embed, inv_freq = model.model.embed_tokens.weight, model.model.rotary_emb.inv_freq
    assert model.lm_head.weight is embed  # tied
    with on_device(model, DEVICE, torch.bfloat16):
        moved = model.model.embed_tokens.weight
        assert moved.device.type == "meta" and moved.dtype == torch.bfloat16
        assert model.lm_head.weight is moved, "a tied weight gets one copy"
        buffer = model.model.rotary_emb.inv_freq
        assert buffer.device.type == "meta" and buffer.dtype == torch.float32
    assert model.model.embed_tokens.weight is embed and model.lm_head.weight is embed
    assert model.model.rotary_emb.inv_freq is inv_freq
    assert move_tensors(model, torch.device("cpu"), torch.float32) == [], "CPU: nothing moves"


def test_send_moves_a_layer_and_drops_cached_kernel_layouts():
    layer = make_tiny_llama().model.layers[0]
    layer.mlp.down_proj._prepared = {"w_t": torch.zeros(1)}
    calibrated._send(layer, DEVICE)
    assert _devices(layer) == {"meta"} and layer.mlp.down_proj._prepared == {}
    layer.self_attn.q_proj._prepared = {"kept": 1}
    calibrated._send(layer, DEVICE)  # already there: untouched
    assert layer.self_attn.q_proj._prepared == {"kept": 1}


def test_cpu_numbers_equal_the_path_without_moves(monkeypatch, one_thread):
    """On the CPU the device plumbing changes nothing: GPTQ (act order, Hessians, the column
    walk) gives the same bytes as the same run with every move disabled."""

    def quantized(disable: bool) -> dict[str, torch.Tensor]:
        with monkeypatch.context() as patch:
            if disable:
                patch.setattr(calibrated, "_capture_on", lambda *a: contextlib.nullcontext())
                patch.setattr(calibrated, "_send", lambda layer, device: None)
            model = make_tiny_llama()
            run_passes(model, [GptqConfig(group_size=32, act_order=True)], tiny_state())
            return model.state_dict()

    moved, fixed = quantized(False), quantized(True)
    assert moved.keys() == fixed.keys()
    for name in moved:
        assert torch.equal(moved[name], fixed[name]), name
