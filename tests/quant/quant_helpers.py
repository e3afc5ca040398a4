"""Helpers shared by the calibrated-quantization tests: calibration batches for the tiny model
and a small slice (first layers) of the real SmolLM2 model."""

from __future__ import annotations

import torch

from compress.core.registry import CompressionState


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


def layer0_output_errors(base, cfg, *, group_size: int, seed: int = 0) -> tuple[float, float]:
    """(error after ``cfg``, error after plain int4 RTN with the same group size): the summed
    squared error of decoder layer 0's output against ``base``'s, on the calibration inputs the
    calibrated pass saw (``tiny_state(seed=seed)``). Layer 0's inputs come from the embeddings
    alone, so every variant's layer 0 sees exactly the float model's inputs."""
    import copy

    from compress.core.registry import run_passes
    from compress.quant.calibrated import capture_first_layer_inputs, run_layer
    from compress.quant.rtn import Int4RtnConfig

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # microsecond ops on a shared 2-core box: 1 thread is faster
    try:
        inputs = capture_first_layer_inputs(
            base, tiny_state(seed=seed).calibration_batches(), torch.device("cpu")
        )
        expected = run_layer(base.model.layers[0], inputs)
        errors = []
        for config in (cfg, Int4RtnConfig(group_size=group_size)):
            model = copy.deepcopy(base)
            run_passes(model, [config], tiny_state(seed=seed))
            got = run_layer(model.model.layers[0], inputs)
            errors.append(
                sum(float((a - b).pow(2).sum()) for a, b in zip(got, expected, strict=True))
            )
    finally:
        torch.set_num_threads(threads)
    return errors[0], errors[1]
