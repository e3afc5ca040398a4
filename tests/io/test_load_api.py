"""``compress.load``, the public entry point: an exported tiny checkpoint loads with its quantized
layers and tokenizer, computes the same logits as the in-memory quantized model it was exported
from, and takes the kernel backend it is given."""

from __future__ import annotations

import pytest
import torch

import compress
from compress.core.registry import run_passes
from compress.io.export import export_checkpoint
from compress.quant.linear import QuantLinear
from compress.recipe import parse_recipe
from tests.quant.quant_helpers import tiny_state

IDS = torch.tensor([[1, 40, 41, 42, 43, 50, 60, 70, 80, 90], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]])

# pass settings by recipe name, so that the test does not depend on where each pass lives
SCHEMES = {
    "int4-g32-asym": {"pass": "quantize.int4_rtn", "group_size": 32, "symmetric": False},
    "int8-per-channel": {"pass": "quantize.int8_rtn"},
    "w8a8-smoothquant": {"pass": "quantize.smoothquant"},
}


def _quantized(tiny_model, settings):
    cfg = parse_recipe({"name": "t", "passes": [settings]}).passes[0]
    state = tiny_state()
    run_passes(tiny_model, [cfg], state)
    return tiny_model, state.reports[-1]


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_load_gives_the_exported_models_logits(tiny_model, tiny_tokenizer, tmp_path, scheme):
    model, report = _quantized(tiny_model, SCHEMES[scheme])
    expected = _logits(model)
    out = export_checkpoint(model, tiny_tokenizer, tmp_path / "ckpt")

    loaded = compress.load(str(out))
    assert isinstance(loaded, compress.LoadedModel) and loaded.path == str(out)
    swapped = {n: type(m) for n, m in loaded.model.named_modules() if isinstance(m, QuantLinear)}
    assert swapped == {n: type(model.get_submodule(n)) for n in report.changed}
    assert loaded.tokenizer.get_vocab() == tiny_tokenizer.get_vocab()
    assert not loaded.model.training
    # same stored codes and scales, same (auto) backend: the same numbers, bit for bit
    assert torch.equal(_logits(loaded.model), expected)


def test_load_passes_the_backend_on(tiny_model, tiny_tokenizer, tmp_path):
    model, _ = _quantized(tiny_model, SCHEMES["int4-g32-asym"])
    out = export_checkpoint(model, tiny_tokenizer, tmp_path / "ckpt")
    loaded = compress.load(str(out), backend="reference")
    layers = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 14 and {m.backend for m in layers} == {"reference"}
    # the reference backend computes x @ dequantized(W).T in fp32: check against that directly
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    q = loaded.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        torch.testing.assert_close(q(x), x @ q.dequantized_weight().T, rtol=1e-5, atol=1e-6)


def test_the_embedded_model_is_converted_once_when_two_start_at_once(tmp_path, monkeypatch):
    """Two processes (or test workers) asking for the embedded model at once: one converts, the
    other waits on the lock and finds the folder made (it would convert again and replace the
    folder under the first one's reads without it). flock locks of two open() calls conflict
    within one process too, so two threads stand in for two processes."""
    import threading
    import time

    from compress.io import load as load_module

    calls = []

    def slow_convert(name, target):
        calls.append(name)
        time.sleep(0.3)
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        (target / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(load_module, "_convert_embedded", slow_convert)
    found = []
    workers = [threading.Thread(target=lambda: found.append(
        load_module.embedded_model_dir("smollm2-135m", tmp_path))) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert calls == ["smollm2-135m"]
    assert found == [tmp_path / "models" / "smollm2-135m"] * 2
