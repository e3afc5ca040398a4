"""The synthetic Llamas of ``compress.testing`` that the benchmark scripts run (bench_memory,
bench_serving, bench_e2e): both inits write a bf16 checkpoint that transformers loads, the
"transformers" one holds ``make_synthetic_llama``'s weights, and a complete folder is reused.
A tiny shape stands in for the public ones (the code path is the same)."""

from __future__ import annotations

import pytest
import torch

from compress import testing
from compress.testing import make_synthetic_llama, write_synthetic_llama

TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=320)  # fmt: skip


@pytest.fixture(autouse=True)
def tiny_shape(monkeypatch):
    monkeypatch.setitem(testing.LLAMA_SHAPES, "tiny", TINY)


def _load(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)


def test_transformers_init_writes_make_synthetic_llamas_weights(tmp_path):
    folder = write_synthetic_llama(tmp_path / "m", "tiny", init="transformers", vocab_size=400)
    loaded = _load(folder).state_dict()
    expected = make_synthetic_llama("tiny", vocab_size=400).to(torch.bfloat16).state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    assert not (tmp_path / "m.part").exists()


def test_stream_init_writes_shards_tensor_by_tensor(tmp_path):
    folder = write_synthetic_llama(tmp_path / "m", "tiny", shard_size="100KB")
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    model = _load(folder)
    assert model.config.vocab_size == 320 and not model.config.tie_word_embeddings
    norms = [p for name, p in model.named_parameters() if p.dim() == 1]
    assert norms and all(bool((p == 1).all()) for p in norms)
    std = float(model.model.layers[0].mlp.up_proj.weight.detach().float().std())
    assert 0.018 < std < 0.022


def test_a_complete_folder_is_reused_and_a_bad_init_refused(tmp_path):
    folder = write_synthetic_llama(tmp_path / "m", "tiny")
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert write_synthetic_llama(folder, "tiny", init="transformers") == folder
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before
    with pytest.raises(ValueError, match="init='hf'"):
        write_synthetic_llama(tmp_path / "other", "tiny", init="hf")
    assert not (tmp_path / "other.part").exists()
