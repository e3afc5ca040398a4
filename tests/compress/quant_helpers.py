"""Helpers shared by the calibrated-quantization tests: calibration batches for the tiny model
and a small slice (first layers) of the real SmolLM2 model."""

from __future__ import annotations

import torch

from compress.core import CompressionState


def tiny_state(n: int = 4, seq_len: int = 32, seed: int = 0) -> CompressionState:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 300, (n, 1, seq_len), generator=gen)
    return CompressionState(calibration_batches=lambda: list(ids), progress=False)


def real_slice(loaded, n_layers: int = 2):
    """A fresh LlamaForCausalLM with the first ``n_layers`` decoder layers of the real model."""
    from transformers import LlamaForCausalLM

    config = loaded.model.config.__class__.from_dict(loaded.model.config.to_dict())
    config.num_hidden_layers = n_layers
    model = LlamaForCausalLM(config).eval()
    state = {
        k: v
        for k, v in loaded.model.state_dict().items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < n_layers
    }
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model


def real_state(loaded, data_dir, n: int = 4, seq_len: int = 128) -> CompressionState:
    from compress.calibration import calibration_sequences

    ids = calibration_sequences(
        "wikitext2-valid",
        loaded.tokenizer,
        num_samples=n,
        seq_len=seq_len,
        seed=0,
        data_dir=str(data_dir),
    )
    return CompressionState(calibration_batches=lambda: list(ids.split(1)), progress=False)


def output_error(model, reference, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(ids).logits - reference(ids).logits).pow(2).mean())
