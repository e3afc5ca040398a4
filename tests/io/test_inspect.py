"""``compress inspect``: natural layer order, and each quantized layer's scheme and group size."""

from __future__ import annotations

import json

import pytest

from compress.cli import main
from compress.core.errors import ModelLoadError
from compress.core.registry import CompressionState, run_passes
from compress.io.export import export_checkpoint
from compress.io.inspect import inspect_checkpoint, natural_key
from compress.quant.rtn import Int4RtnConfig
from compress.testing import make_tiny_llama


def test_natural_key_orders_numbers_by_value():
    names = ["model.layers.10.mlp", "model.layers.2.mlp", "lm_head", "model.layers.1.mlp"]
    assert sorted(names, key=natural_key) == [
        "lm_head", "model.layers.1.mlp", "model.layers.2.mlp", "model.layers.10.mlp"]


def test_layers_are_listed_in_natural_order(tmp_path):
    make_tiny_llama(num_hidden_layers=12).save_pretrained(tmp_path)
    modules = [r["module"] for r in inspect_checkpoint(tmp_path)["layers"]
               if r["module"].endswith("up_proj")]
    assert modules == [f"model.layers.{i}.mlp.up_proj" for i in range(12)]


@pytest.mark.parametrize("layers", [0, 1, 3])
def test_a_config_with_another_layer_count_than_the_shards_is_refused(tmp_path, layers):
    """Shapes alone pass: only the names show that config.json's model has more or fewer
    layers than were written (a truncated download, a config.json from a sibling model)."""
    make_tiny_llama(num_hidden_layers=2).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    with pytest.raises(ModelLoadError, match="does not match its config") as err:
        inspect_checkpoint(tmp_path)
    named = "missing ['model.layers.2." if layers == 3 else f"'model.layers.{layers}."
    assert named in str(err.value)
    assert main(["inspect", str(tmp_path)]) == 2  # an input error, named


def test_a_layer_count_past_the_stored_tensors_is_refused_before_building_it(tmp_path):
    """num_hidden_layers: 1000000 built a meta model for minutes before the names could be
    compared; more layers than tensors cannot be stored."""
    make_tiny_llama(num_hidden_layers=2).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**6}))
    with pytest.raises(ModelLoadError, match="num_hidden_layers: 1000000, but the shards hold"):
        inspect_checkpoint(tmp_path)


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
