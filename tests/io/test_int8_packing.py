"""Weight-only int8 in compressed-tensors' ``pack-quantized`` layout (four codes an int32):
what compress writes for symmetric int8, what llm-compressor writes for W8A16 (asymmetric with
zero points packed along rows), and the ``int-quantized`` layout older exports hold; every one
reads back to the same int8 codes. The packing reference is compressed-tensors' own."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from compress.core.errors import ModelLoadError
from compress.core.registry import CompressionState, run_passes
from compress.io.export import export_checkpoint, load_compressed
from compress.io.inspect import inspect_checkpoint
from compress.io.load import load_model
from compress.quant.rtn import Int8RtnConfig
from compress.testing import make_tiny_llama

ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
DOWN = "model.layers.0.mlp.down_proj"
IDS = torch.randint(3, 200, (2, 10), generator=torch.Generator().manual_seed(0))


def _export(folder, **cfg):
    model = make_tiny_llama()
    run_passes(model, [Int8RtnConfig(**cfg)], CompressionState(progress=False))
    with torch.no_grad():
        logits = model(IDS).logits
    return export_checkpoint(model, None, folder, dtype="float32"), logits


def _rewrite(folder, edit_tensors, fmt):
    tensors = load_file(folder / "model.safetensors")
    edit_tensors(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["format"] = fmt
    config["quantization_config"]["format"] = fmt
    (folder / "config.json").write_text(json.dumps(config))


def _modules(tensors, leaf):
    return [k.removesuffix("." + leaf) for k in list(tensors) if k.endswith("." + leaf)]


def test_symmetric_int8_is_written_packed_as_compressed_tensors_packs_it(tmp_path):
    folder, logits = _export(tmp_path / "w8")
    tensors = load_file(folder / "model.safetensors")
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert quant["format"] == "pack-quantized" and not any(
        t.dtype == torch.int8 for t in tensors.values())
    shape = tuple(tensors[f"{DOWN}.weight_shape"].tolist())
    codes = ct.unpack_from_int32(tensors[f"{DOWN}.weight_packed"], 8, torch.Size(shape))
    model = load_compressed(folder)
    assert torch.equal(model.get_submodule(DOWN).weight, codes)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, logits)
    rows = {r["module"]: r for r in inspect_checkpoint(folder)["layers"]}
    assert rows[DOWN]["format"] == "int8 pack-quantized" and rows[DOWN]["scheme"] == "W8channel"


def test_an_older_int_quantized_export_reads_as_before(tmp_path):
    folder, logits = _export(tmp_path / "old")

    def unpack(tensors):
        for module in _modules(tensors, "weight_packed"):
            shape = torch.Size(tensors.pop(f"{module}.weight_shape").tolist())
            tensors[f"{module}.weight"] = ct.unpack_from_int32(
                tensors.pop(f"{module}.weight_packed"), 8, shape)

    _rewrite(folder, unpack, "int-quantized")
    with torch.no_grad():
        assert torch.equal(load_compressed(folder)(IDS).logits, logits)


def test_asymmetric_int8_packed_as_llm_compressor_writes_it_reads_exactly(tmp_path):
    """compress writes asymmetric int8 int-quantized (transformers' skeleton wants its zero
    point unpacked); llm-compressor packs it, zero points along rows: compress reads both."""
    folder, logits = _export(tmp_path / "asym", symmetric=False, group_size=32)
    assert json.loads((folder / "config.json").read_text())["quantization_config"][
        "format"] == "int-quantized"

    def pack(tensors):
        for module in _modules(tensors, "weight_zero_point"):
            codes = tensors.pop(f"{module}.weight")
            tensors[f"{module}.weight_packed"] = ct.pack_to_int32(codes, 8)
            tensors[f"{module}.weight_shape"] = torch.tensor(codes.shape)
            zero = f"{module}.weight_zero_point"
            tensors[zero] = ct.pack_to_int32(tensors[zero], 8, packed_dim=0)

    _rewrite(folder, pack, "pack-quantized")
    assert load_file(folder / "model.safetensors")[f"{DOWN}.weight_zero_point"].dtype == torch.int32
    with torch.no_grad():
        assert torch.equal(load_compressed(folder)(IDS).logits, logits)


def _edit(name, change):
    def edit(tensors):
        tensors[name] = change(tensors[name])
    return edit


@pytest.mark.parametrize("edit, message", [
    (_edit(f"{DOWN}.weight_packed", lambda t: t[:, :-1].contiguous()),
     "under an 8-bit config group, which packs four codes an int32"),
    (_edit(f"{DOWN}.weight_shape", lambda t: t * 2), "under an 8-bit config group"),
    (_edit(f"{DOWN}.weight_shape", lambda t: t * 0), "not two positive integers"),
    (lambda tensors: tensors.pop(f"{DOWN}.weight_shape"), "has no " + DOWN + ".weight_shape"),
], ids=["packed-narrow", "shape-wider", "shape-zero", "shape-missing"])  # fmt: skip
def test_a_broken_packed_int8_layer_is_refused_in_one_line(tmp_path, edit, message):
    folder, _ = _export(tmp_path / "w8")
    _rewrite(folder, edit, "pack-quantized")
    for read in (load_model, inspect_checkpoint):
        with pytest.raises(ModelLoadError, match=message) as info:
            read(folder)
        assert "\n" not in str(info.value)
