"""The layers and the runtime take their backend from ``kernels.dispatch.plan_linear``: the
plan a layer reports is the dispatcher's, W8A8 raises on an explicit backend that cannot run,
and the runtime holds each layer the way its plan says (explicit ``reference`` included)."""

from __future__ import annotations

import pytest
import torch

from compress.core.errors import KernelConstraintError
from compress.kernels import dispatch
from compress.quant.linear import QuantLinear, WeightScheme, w8a8_from_linear
from compress.runtime.layers import _convert_linear

CPU = torch.device("cpu")
INT4_G32 = WeightScheme(4, 32, True)


def _layer(n=64, k=128, scheme=INT4_G32, backend="auto"):
    torch.manual_seed(0)
    return QuantLinear.from_linear(torch.nn.Linear(k, n), scheme, backend=backend)


def test_quant_linear_reports_the_dispatchers_plan():
    layer = _layer(n=24)
    expected = dispatch.plan_linear(
        "int4", "auto", device=CPU, n=24, k=128, group_size=32, symmetric=True
    )
    assert layer.plan(CPU) == expected and expected.backend == "reference"
    assert "N=24" in expected.reason
    assert layer.resolved_backend(CPU) == "reference"


def test_w8a8_layer_plans_through_the_dispatcher_and_explicit_triton_raises():
    layer = w8a8_from_linear(torch.nn.Linear(128, 64), torch.float32, "auto")
    assert layer.kind == "w8a8"
    assert layer.plan(CPU) == dispatch.plan_linear("w8a8", device=CPU, n=64, k=128)
    layer.backend = "triton"
    layer._prepared.clear()
    with pytest.raises(KernelConstraintError, match="backend='triton'"):
        layer(torch.randn(2, 128, device="meta"))


@pytest.mark.parametrize(
    ("backend", "holder", "noted"),
    [("auto", "_Int4Linear", False), ("cpu", "_Int4Linear", False),
     ("reference", "_FloatLinear", True)],
)  # fmt: skip
def test_runtime_holds_a_layer_as_its_plan_says(backend, holder, noted):
    notes: list[str] = []
    held = _convert_linear(_layer(backend=backend), "l", torch.float32, torch.float32, notes)
    assert type(held).__name__ == holder
    assert bool(notes) == noted
    if noted:
        assert "backend='reference'" in notes[0]


def test_runtime_notes_the_fallback_reason_of_an_unsupported_shape():
    notes: list[str] = []
    held = _convert_linear(_layer(n=24), "l", torch.float32, torch.bfloat16, notes)
    assert type(held).__name__ == "_FloatLinear" and "N=24 not divisible by 16" in notes[0]
    assert held.w_decode.dtype == torch.bfloat16


def test_runtime_int8_and_float_layers():
    notes: list[str] = []
    int8 = _layer(scheme=WeightScheme(8, None, True))
    assert type(_convert_linear(int8, "l", torch.float32, torch.float32, notes)).__name__ == (
        "_Int8Linear"
    )
    linear = torch.nn.Linear(128, 64)
    assert type(_convert_linear(linear, "l", torch.float32, torch.float32, notes)).__name__ == (
        "_FloatLinear"
    )
    assert not notes


@pytest.mark.parametrize("kernel", ["auto", "triton"])
@pytest.mark.parametrize("kind", ["int4", "int8", "w8a8"])
def test_triton_layers_hand_the_plans_kernel_set_to_the_glue(kind, kernel, monkeypatch):
    """A ``triton`` plan's ``kernel`` reaches ``triton_ops`` (issue 34: the layers dropped it,
    so ``backend="auto"`` on CUDA could never pick torch's int4 kernel from the measured table).
    The plan and the glue are stood in for: on the CPU no plan is ``triton`` with ``auto``."""
    from compress.kernels import triton_ops

    if kind == "w8a8":
        layer = w8a8_from_linear(torch.nn.Linear(128, 64), torch.float32, "auto")
    else:
        layer = _layer(scheme=INT4_G32 if kind == "int4" else WeightScheme(8, None, True))
    calls = []

    def glue(x, *args, **kwargs):
        calls.append(kwargs)
        return torch.zeros(x.shape[0], 64)

    glue_name = {"int4": "int4_linear", "int8": "int8_linear", "w8a8": "int8_int8_linear"}[kind]
    monkeypatch.setattr(triton_ops, glue_name, glue)
    layer.plan = lambda device, **_: dispatch.Plan("triton", kernel=kernel)
    assert layer(torch.randn(3, 128)).shape == (3, 64)
    assert calls[0]["kernel"] == kernel
    if kind == "int4":  # torch's repacked weight is made once per layer, into its own cache
        assert calls[0]["cache"] is layer._prepared
