"""Corrupted and inconsistent checkpoints that used to get past loading (beside
test_load_checks.py): each is now one ``ModelLoadError`` line naming the file and the fix, where
before the user saw a traceback from safetensors, transformers or a kernel, or worse a model
different from the one on disk."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from compress.cli import main
from compress.core.errors import ModelLoadError
from compress.core.registry import CompressionState, run_passes
from compress.io.export import export_checkpoint, layerwise_model
from compress.io.inspect import inspect_checkpoint
from compress.io.load import load_model
from compress.quant.rtn import Int4RtnConfig, Int8RtnConfig
from compress.testing import make_tiny_llama

DOWN = "model.layers.0.mlp.down_proj"


def _exported(model, tokenizer, folder, config):
    run_passes(model, [config], CompressionState(progress=False))
    return export_checkpoint(model, tokenizer, folder)


def _edit_header(edit):
    """A safetensors file whose JSON header ``edit`` changed, the data bytes as they were."""
    def brk(folder):
        file = folder / "model.safetensors"
        data = file.read_bytes()
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
        edit(header)
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        file.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length :])
    return brk


def _overlap(header):  # k_proj's bytes pointed into q_proj's
    q, k = header["model.layers.0.self_attn.q_proj.weight"], header[
        "model.layers.0.self_attn.k_proj.weight"]
    size = k["data_offsets"][1] - k["data_offsets"][0]
    k["data_offsets"] = [q["data_offsets"][0], q["data_offsets"][0] + size]


def _negative_offset(header):
    entry = header["model.layers.0.self_attn.q_proj.weight"]
    begin, end = entry["data_offsets"]
    entry["data_offsets"] = [-16, end - begin - 16]


def _trailing_bytes(folder):
    with open(folder / "model.safetensors", "ab") as f:
        f.write(b"garbage" * 10)


# safetensors (so transformers) refuses these with a traceback; our header check let them by
HEADER_BREAKS = {
    "overlapping_tensors": (_edit_header(_overlap), "tensors overlap or leave a gap"),
    "negative_offset": (_edit_header(_negative_offset), r"data offsets \[-16"),
    "metadata_not_strings": (_edit_header(lambda h: h.update(__metadata__={"format": 5})),
                             "__metadata__ is not a mapping of strings"),
    "bytes_after_the_data": (_trailing_bytes, "70 bytes after the last tensor"),
}


@pytest.mark.parametrize("kind", list(HEADER_BREAKS))
def test_a_header_safetensors_refuses_is_refused_in_one_line(kind, plain):
    brk, message = HEADER_BREAKS[kind]
    brk(plain)
    with pytest.raises(ModelLoadError, match=f"corrupt or partially written .*{message}") as info:
        load_model(str(plain))
    assert "\n" not in str(info.value) and "model.safetensors" in str(info.value)


def _split_in_two(folder, *, index_edit=None, duplicate=False):
    """The checkpoint as two shards with an index; ``duplicate``: the second shard also holds
    a changed copy of a tensor the index puts in the first."""
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    first = {n: tensors[n] for n in names[: len(names) // 2]}
    second = {n: tensors[n] for n in names[len(names) // 2 :]}
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {n: shards[0] for n in first} | {n: shards[1] for n in second}
    if duplicate:
        second[names[0]] = first[names[0]] * 2
    save_file(first, folder / shards[0], metadata={"format": "pt"})
    save_file(second, folder / shards[1], metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_edit(index) if
                                                                   index_edit else index))
    return names[0]


def test_a_tensor_in_two_shards_is_refused_not_picked(plain):
    # transformers took the second shard's copy: a different model than the index describes
    name = _split_in_two(plain, duplicate=True)
    with pytest.raises(ModelLoadError, match=f"tensor {name} is stored twice, in model-00001"):
        load_model(str(plain))


def test_a_single_file_beside_an_index_of_other_shards_is_refused(plain):
    """transformers loaded model.safetensors, the index's readers (inspect, layer by layer,
    streamed jobs) the shards: two commands scored two different models from one folder."""
    (plain / "stale.safetensors").write_bytes((plain / "model.safetensors").read_bytes())
    _split_in_two(plain)
    (plain / "stale.safetensors").rename(plain / "model.safetensors")
    for read in (load_model, inspect_checkpoint, layerwise_model):
        with pytest.raises(ModelLoadError, match="holds both model.safetensors and model."
                                                 "safetensors.index.json with other shards"):
            read(plain)


def test_activation_quantization_that_is_not_applied_is_said(tiny_tokenizer, tmp_path, caplog):
    """Static per-tensor int8 inputs (no input_scale even) loaded as weight-only, silently."""
    folder = _exported(make_tiny_llama(), tiny_tokenizer, tmp_path / "int4",
                       Int4RtnConfig(group_size=32))
    static = {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}
    _quant(lambda q: q["config_groups"]["group_0"].update(input_activations=static))(folder)
    load_model(str(folder))
    assert "quantizes input activations as" in caplog.text
    assert "which compress does not apply" in caplog.text


@pytest.mark.parametrize("weight_map", [["a", "b"], {"model.norm.weight": 5}],
                         ids=["list", "not_a_file_name"])
def test_a_malformed_shard_index_is_refused(weight_map, plain):
    _split_in_two(plain, index_edit=lambda index: {**index, "weight_map": weight_map})
    with pytest.raises(ModelLoadError, match="weight_map is not a mapping of tensor names"):
        load_model(str(plain))


def _config(**changes):
    def brk(folder):
        config = json.loads((folder / "config.json").read_text())
        config.update(changes)
        (folder / "config.json").write_text(json.dumps(config))
    return brk


CONFIG_BREAKS = {  # each was a ZeroDivisionError, AttributeError, ImportError... traceback
    "zero_heads": (_config(num_attention_heads=0), "config.json cannot be read .*by zero"),
    "zero_kv_heads": (_config(num_key_value_heads=0), "config.json does not describe .*zero"),
    "unknown_dtype": (_config(dtype="float7"), "config.json cannot be read .*float7"),
    "nested_too_deep": (lambda f: (f / "config.json").write_text("[" * 100_000),
                        "config.json cannot be read .*recursion"),
    "foreign_quant_method": (_config(quantization_config={"quant_method": "gptq", "bits": 4}),
                             "transformers cannot load this checkpoint .*optimum"),
    "quant_method_missing": (_config(quantization_config={}),
                             "transformers cannot load this checkpoint .*quant_method"),
    # built a meta model of a million layers for minutes before the names were compared
    "layers_past_the_tensors": (_config(num_hidden_layers=10**6),
                                "num_hidden_layers: 1000000, but the shards hold"),
    # was blamed on transformers' default of 32 as if the file said it
    "layer_count_missing": (lambda f: _drop(f, "num_hidden_layers"),
                            "no num_hidden_layers, so transformers takes its default, 32, but"),
    # every logit NaN at the first forward, blamed on the weights
    "rope_factor_zero": (_config(rope_parameters={"rope_type": "linear", "factor": 0.0,
                                                  "rope_theta": 10000.0}),
                         "rope_parameters.factor is 0.0; a RoPE scaling factor must be"),
    "rope_factor_inf": (_config(rope_parameters={"rope_type": "dynamic", "factor": 1e400,
                                                 "rope_theta": 10000.0}),
                        "rope_parameters.factor is inf; a RoPE scaling factor must be"),
}


def _drop(folder, key):
    config = json.loads((folder / "config.json").read_text())
    del config[key]
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("kind", list(CONFIG_BREAKS))
def test_a_config_transformers_chokes_on_is_one_line(kind, plain):
    brk, message = CONFIG_BREAKS[kind]
    brk(plain)
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model(str(plain))
    assert "\n" not in str(info.value)


def _weights(**changes):
    def edit(quant):
        for group in quant["config_groups"].values():
            group["weights"].update(changes)
    return edit


def _targets(targets):
    def edit(quant):
        for group in quant["config_groups"].values():
            group["targets"] = targets
    return edit


def _quant(edit):
    def brk(folder):
        config = json.loads((folder / "config.json").read_text())
        edit(config["quantization_config"])
        (folder / "config.json").write_text(json.dumps(config))
    return brk


def _tensor(name, change):
    def brk(folder):
        tensors = load_file(folder / "model.safetensors")
        tensors[name] = change(tensors[name])
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return brk


# our own exports, edited: a kernel crashed on the wrong dtype, or silently computed with it
INT4_BREAKS = {
    "group_size_zero": (_quant(_weights(group_size=0)), "group_size must be a positive"),
    "group_size_negative": (_quant(_weights(group_size=-32)), "group_size must be a positive"),
    "symmetric_a_string": (_quant(_weights(symmetric="false")), "symmetric must be true or"),
    "target_bad_regex": (_quant(_targets(["re:(("])), r"targets: invalid regular expression"),
    "target_not_a_string": (_quant(_targets([5])), "targets is not a list of module names"),
    "kv_scheme_a_string": (_quant(lambda q: q.update(kv_cache_scheme="fp8")),
                           "kv_cache_scheme is a str, not an object"),
    "packed_as_int8": (_tensor(f"{DOWN}.weight_packed", lambda t: t.to(torch.int8)),
                       "weight_packed is stored as torch.int8 but the model holds torch.int32"),
    "packed_as_float": (_tensor(f"{DOWN}.weight_packed", lambda t: t.float()),
                        "weight_packed is stored as torch.float32 but the model holds"),
    "scale_as_int": (_tensor(f"{DOWN}.weight_scale", lambda t: t.to(torch.int32)),
                     "weight_scale is stored as torch.int32 but scales are floating point"),
    "nan_dense_weight": (_tensor("model.norm.weight", lambda t: t * float("nan")),
                         "model.norm.weight holds NaN or Inf"),
    # was blamed on the scales' shape
    "strategy_unknown": (_quant(_weights(strategy="foo")), "strategy 'foo'; compress loads"),
}


@pytest.mark.parametrize("kind", list(INT4_BREAKS))
def test_a_broken_int4_export_is_refused_in_one_line(kind, tiny_tokenizer, tmp_path):
    folder = _exported(make_tiny_llama(), tiny_tokenizer, tmp_path / "int4",
                       Int4RtnConfig(group_size=32))
    brk, message = INT4_BREAKS[kind]
    brk(folder)
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model(str(folder))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float32])
def test_int8_codes_in_another_dtype_are_refused(dtype, tiny_tokenizer, tmp_path):
    # asymmetric: written int-quantized, the int8 `weight` as stored (symmetric int8 is
    # packed: tests/io/test_int8_packing.py)
    folder = _exported(make_tiny_llama(), tiny_tokenizer, tmp_path / "int8",
                       Int8RtnConfig(symmetric=False, group_size=32))
    _tensor(f"{DOWN}.weight", lambda t: t.to(dtype))(folder)
    with pytest.raises(ModelLoadError, match=f"weight is stored as {dtype} but the model holds "
                                             "torch.int8"):
        load_model(str(folder))


def test_a_nan_weight_is_named_by_every_loader(plain):
    _tensor("model.layers.1.self_attn.o_proj.weight", lambda t: t.index_fill(0, torch.tensor(
        [3]), float("inf")))(plain)
    message = "tensor model.layers.1.self_attn.o_proj.weight holds NaN or Inf"
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(plain))  # transformers read it: checked after
    with pytest.raises(ModelLoadError, match=message):
        stream = layerwise_model(plain)  # our reader: checked as it reads
        stream.load_layer(1)


def test_layer_by_layer_reading_refuses_a_config_with_fewer_layers(plain):
    _config(num_hidden_layers=1)(plain)
    with pytest.raises(ModelLoadError, match=r"unexpected \['model.layers.1"):
        layerwise_model(plain)  # it scored a 1-layer model


def test_a_job_on_a_config_with_no_layers_names_the_setting(plain, tmp_path, capsys):
    _config(num_hidden_layers=0)(plain)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("passes:\n  - {pass: quantize.int4_rtn, group_size: 32}\n"
                      "eval: {baseline: false, perplexity: null}\n")
    code = main(["run", str(recipe), "--model", str(plain), "--out", str(tmp_path / "out")])
    assert code == 2 and not (tmp_path / "out").exists()
    assert "num_hidden_layers: 0; set it to the number" in capsys.readouterr().err


@pytest.mark.parametrize("section, setting", [
    ("eval: {baseline: false, perplexity: {context_length: 300}}",
     "eval.perplexity.context_length"),
    ("calibration: {num_samples: 2, seq_len: 300}\neval: {baseline: false, perplexity: null}",
     "calibration.seq_len"),
])
def test_a_job_asking_past_the_models_positions_is_refused_before_any_work(
        plain, tmp_path, capsys, section, setting):
    """It ran its passes, then failed (or, with RoPE, scored extrapolation) at 300 of 256."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("passes:\n  - {pass: quantize.int4_rtn, group_size: 32}\n" + section + "\n")
    code = main(["run", str(recipe), "--model", str(plain), "--out", str(tmp_path / "out")])
    assert code == 2 and not (tmp_path / "out").exists()
    assert f"{setting} 300 exceeds the 256 positions" in capsys.readouterr().err


def test_a_tokenizer_from_a_bigger_model_is_refused(tiny_tokenizer, tmp_path):
    folder = tmp_path / "small-vocab"
    make_tiny_llama(vocab_size=64).save_pretrained(folder)  # the char tokenizer has more ids
    tiny_tokenizer.save_pretrained(folder)
    with pytest.raises(ModelLoadError, match="token ids up to [0-9]+ but the model.s embedding "
                                             "has 64 rows"):
        load_model(str(folder))


@pytest.mark.parametrize("file,text", [("tokenizer.json", '{"version": "1.0"}'),
                                       ("tokenizer_config.json", "[1]")],
                         ids=["tokenizer_json_without_model", "tokenizer_config_a_list"])
def test_a_tokenizer_file_the_libraries_choke_on_is_refused(file, text, plain):
    (plain / file).write_text(text)  # a bare Exception from tokenizers; an AttributeError
    with pytest.raises(ModelLoadError, match="its tokenizer cannot be loaded"):
        load_model(str(plain))


@pytest.mark.parametrize("edit", ["model_max_length", "empty_vocab"])
def test_a_tokenizer_that_loads_but_cannot_encode_is_refused_at_load(edit, plain):
    """Both loaded, then failed on every text (a traceback in eval and generate, a 500 for
    every request of a server that started)."""
    if edit == "model_max_length":
        config = json.loads((plain / "tokenizer_config.json").read_text())
        (plain / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                 "model_max_length": "big"}))
    else:
        spec = json.loads((plain / "tokenizer.json").read_text())
        spec["model"]["vocab"] = {}
        (plain / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ModelLoadError, match="its tokenizer loads but cannot encode text"):
        load_model(str(plain))


def test_inspect_reads_the_shards_the_index_names(plain):
    _split_in_two(plain)
    total = inspect_checkpoint(plain)["total_bytes"]
    save_file({"stray": torch.zeros(1000)}, plain / "stray.safetensors")  # not in the index
    assert inspect_checkpoint(plain)["total_bytes"] == total


def test_cli_layer_by_layer_eval_reports_nan_activations_in_one_line(plain, tmp_path, capsys):
    # finite weights whose attention scores overflow fp32 (q.k ~ 1e62): NaN activations in
    # layer 0 (a NaN norm epsilon did this before the loader refused that config value)
    for proj in ("q_proj", "k_proj"):
        _tensor(f"model.layers.0.self_attn.{proj}.weight", lambda w: w * 1e30)(plain)
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    argv = ["eval", str(plain), "--dataset", str(text), "--context-length", "32", "--limit",
            "1", "--no-progress", "--layer-by-layer"]
    assert main(argv) == 2
    assert "decoder layer 0: activations became NaN/Inf" in capsys.readouterr().err


@pytest.mark.parametrize("name, edit, message", [
    ("weight_packed", lambda t: t[:, :-1].contiguous(), "weight_packed has shape"),
    ("weight_scale", lambda t: t[:, :1].contiguous(), "weight_scale has shape"),
    ("weight_packed", lambda t: t.long(), "stored as torch.int64 but the model holds torch.int32"),
], ids=["packed-shape", "scale-of-another-group-size", "packed-int64"])  # fmt: skip
def test_inspect_refuses_what_every_loader_refuses(name, edit, message, tiny_tokenizer, tmp_path):
    """inspect printed its table (a scale of another group size shown as the config's W4g)
    for exports that every loader refused."""
    folder = _exported(make_tiny_llama(), tiny_tokenizer, tmp_path / "int4",
                       Int4RtnConfig(group_size=32))
    _tensor(f"{DOWN}.{name}", edit)(folder)
    for read in (inspect_checkpoint, load_model):
        with pytest.raises(ModelLoadError, match=message):
            read(folder)
