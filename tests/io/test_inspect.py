"""``compress inspect``: natural layer order, and each quantized layer's scheme and group size."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from compress.cli import main
from compress.core.registry import CompressionState, run_passes
from compress.io.export import export_checkpoint
from compress.io.inspect import inspect_checkpoint, natural_key
from compress.quant.rtn import Int4RtnConfig


def test_natural_key_orders_numbers_by_value():
    names = ["model.layers.10.mlp", "model.layers.2.mlp", "lm_head", "model.layers.1.mlp"]
    assert sorted(names, key=natural_key) == [
        "lm_head", "model.layers.1.mlp", "model.layers.2.mlp", "model.layers.10.mlp"]


def test_layers_are_listed_in_natural_order(tmp_path):
    tensors = {f"model.layers.{i}.mlp.up_proj.weight": torch.zeros(2, 2) for i in range(12)}
    save_file(tensors, tmp_path / "model.safetensors")
    config = {"model_type": "llama", "hidden_size": 2, "intermediate_size": 2,
              "num_hidden_layers": 12, "num_attention_heads": 1, "vocab_size": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))  # the shapes must match it
    modules = [r["module"] for r in inspect_checkpoint(tmp_path)["layers"]]
    assert modules == [f"model.layers.{i}.mlp.up_proj" for i in range(12)]


def test_quantized_layers_show_scheme_and_group_size(tiny_model, tiny_tokenizer, tmp_path,
                                                     capsys):
    cfg = Int4RtnConfig(group_size=32, symmetric=False, overrides=[
        {"layers": "re:.*layers\\.1\\.mlp\\.down_proj", "n_bits": 8, "group_size": "channel"}])
    run_passes(tiny_model, [cfg], CompressionState(progress=False))
    out = export_checkpoint(tiny_model, tiny_tokenizer, tmp_path / "ckpt")
    rows = {r["module"]: r for r in inspect_checkpoint(out)["layers"]}
    q = rows["model.layers.0.self_attn.q_proj"]
    assert (q["scheme"], q["group_size"]) == ("W4g32-asym", 32)
    down = rows["model.layers.1.mlp.down_proj"]
    assert (down["format"], down["scheme"], down["group_size"]) == (
        "int8 int-quantized", "W8channel-asym", "channel")
    assert rows["model.norm"]["scheme"] is None  # dense tensors have no scheme
    assert main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "| scheme | group |" in shown
    assert "| model.layers.0.mlp.down_proj | int4 pack-quantized | W4g32-asym | 32 |" in shown
