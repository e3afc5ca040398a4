"""Sequential calibration: layer-by-layer propagation reproduces the model's own hidden states,
disk offload gives the same result, memory is measured, NaN inputs fail clearly; calibration
mixes are deterministic and split by weight."""

from __future__ import annotations

import pytest
import torch

from compress.calibration import calibration_mix, split_counts
from compress.core.errors import DataError
from compress.quant.calibrated import run_layer, run_sequential
from compress.testing import make_tiny_llama
from tests.quant.quant_helpers import tiny_state


@torch.no_grad()
@pytest.mark.parametrize("offload", ["none", "cpu", "disk"])
def test_layer_by_layer_outputs_match_full_forward(offload):
    model = make_tiny_llama()
    batches = tiny_state().calibration_batches()
    seen: list[int] = []
    last: list[torch.Tensor] = []

    def process(index, layer, inputs):
        seen.append(index)
        if index == len(model.model.layers) - 1:
            last.extend(run_layer(layer, inputs))

    metrics = run_sequential(
        model, batches, process, device=torch.device("cpu"), offload=offload, progress=False
    )
    assert seen == [0, 1]
    assert metrics["peak_memory_bytes"] >= metrics["memory_at_start_bytes"] > 0
    for ids, out in zip(batches, last, strict=True):
        hidden = model(ids, output_hidden_states=True).hidden_states[-1]  # after the final norm
        torch.testing.assert_close(model.model.norm(out), hidden, rtol=1e-5, atol=1e-5)


def test_nan_activations_are_a_clear_error():
    model = make_tiny_llama()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="decoder layer 0.*NaN"):
        run_sequential(
            model,
            tiny_state().calibration_batches(),
            lambda *a: None,
            device=torch.device("cpu"),
            progress=False,
        )


def test_split_counts():
    assert split_counts({"a": 3, "b": 1}, 8) == {"a": 6, "b": 2}
    assert sum(split_counts({"a": 1, "b": 1, "c": 1}, 10).values()) == 10
    with pytest.raises(DataError, match="positive"):
        split_counts({"a": 0}, 4)


def test_calibration_mix_is_deterministic_and_mixes(tmp_path, tiny_tokenizer):
    (tmp_path / "a.txt").write_text("alpha beta gamma " * 200)
    (tmp_path / "b.jsonl").write_text(
        "\n".join(f'{{"text": "delta epsilon {i}"}}' for i in range(300))
    )
    mix = {str(tmp_path / "a.txt"): 0.5, str(tmp_path / "b.jsonl"): 0.5}
    one = calibration_mix(mix, tiny_tokenizer, num_samples=6, seq_len=16, seed=3)
    two = calibration_mix(mix, tiny_tokenizer, num_samples=6, seq_len=16, seed=3)
    assert one.shape == (6, 16) and torch.equal(one, two)
    texts = [tiny_tokenizer.decode(row) for row in one]
    assert sum("alpha" in t or "gamma" in t for t in texts) == 3
    with pytest.raises(DataError, match="num_samples"):
        calibration_mix(mix, tiny_tokenizer, num_samples=500, seq_len=16, seed=0)
