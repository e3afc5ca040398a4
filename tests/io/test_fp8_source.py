"""Block-scaled fp8 source checkpoints (``quant_method: fp8``, a ``weight_scale_inv`` per
``weight_block_size`` block: how DeepSeek-V3/R1, Kimi K2 and the FP8 releases of Qwen3 and
others are published) are read as their dequantized 16-bit weights by every loader; they were
called corrupt files before.

References: the same model written as an ordinary bf16 checkpoint holding the dequantized values
(its logits, and the export of the same job on it, tensor for tensor). The scales are powers of
two, so codes x scale is exact in any float type and the comparisons are exact; a scale read
for the wrong block would change the values.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from compress.core.errors import ModelLoadError
from compress.io.checkpoint import CheckpointReader
from compress.io.inspect import inspect_checkpoint
from compress.io.load import load_model
from compress.testing import make_char_tokenizer, make_tiny_model, make_tiny_moe
from tests.io.io_helpers import assert_same_exports_as_the_twin, tiny_job_recipe

IDS = [[1, 5, 17, 33, 60, 61, 7, 90, 91, 3, 200, 201]]
BLOCK = [24, 48]  # blocks that do not divide 64 or 128: ragged last blocks


def _fp8_pair(source, folder, block=BLOCK):
    """(fp8 checkpoint, bf16 checkpoint of its dequantized values) made from the saved
    checkpoint ``source``, every shard converted: each 2-D projection weight as fp8 codes and
    power-of-two scales."""
    import shutil

    plain, fp8 = folder / "bf16", folder / "fp8"
    generator = torch.Generator().manual_seed(0)
    for target in (plain, fp8):
        shutil.copytree(source, target)
    for file in sorted(source.glob("*.safetensors")):
        stored, dequantized = {}, {}
        for name, tensor in load_file(file).items():
            tensor = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
            if tensor.dim() != 2 or not name.endswith("proj.weight"):
                stored[name] = dequantized[name] = tensor
                continue
            rows, cols = tensor.shape
            grid = [-(-rows // block[0]), -(-cols // block[1])] if block else [1]
            scale = torch.pow(2.0, torch.randint(-9, -3, grid, generator=generator).float())
            full = scale.reshape(1, 1).expand(rows, cols) if not block else \
                scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
            codes = (tensor.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
            stored[name], stored[f"{name}_scale_inv"] = codes, scale
            dequantized[name] = (codes.float() * full).to(torch.bfloat16)
        save_file(stored, fp8 / file.name, metadata={"format": "pt"})
        save_file(dequantized, plain / file.name, metadata={"format": "pt"})
        index = fp8 / "model.safetensors.index.json"
        if index.is_file():  # the scales live in their weight's shard
            entries = json.loads(index.read_text())
            entries["weight_map"] |= {n: file.name for n in stored if n.endswith("_scale_inv")}
            index.write_text(json.dumps(entries))
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic", "weight_block_size": block}
    (fp8 / "config.json").write_text(json.dumps(config))
    return fp8, plain


def _write(folder, kind: str, block=BLOCK):
    """``_fp8_pair`` of a tiny ``kind`` model."""
    model = make_tiny_moe(kind, tie_word_embeddings=False) if kind.startswith("deepseek") \
        else make_tiny_model(kind, tie_word_embeddings=False)
    model.save_pretrained(folder / "source")
    make_char_tokenizer().save_pretrained(folder / "source")
    return _fp8_pair(folder / "source", folder, block)


def _logits(folder) -> torch.Tensor:
    with torch.no_grad():
        return load_model(str(folder)).model(torch.tensor(IDS)).logits


@pytest.mark.parametrize("kind,block", [("llama", BLOCK), ("llama", None),
                                        ("deepseek_v3", [128, 128])],
                         ids=["llama-blocks", "llama-per-tensor", "deepseek_v3-experts"])
def test_an_fp8_source_loads_as_its_dequantized_weights(kind, block, tmp_path):
    fp8, plain = _write(tmp_path, kind, block)
    reader = CheckpointReader(fp8)
    assert not any(n.endswith("_scale_inv") for n in reader.names())  # read with the weight
    torch.testing.assert_close(_logits(fp8), _logits(plain), rtol=0, atol=0)
    formats = {r["format"] for r in inspect_checkpoint(fp8)["layers"]}
    assert "fp8 block-scaled source (dequantized on read)" in formats


def test_a_job_on_an_fp8_source_exports_what_it_exports_from_the_bf16_one(tmp_path):
    fp8, plain = _write(tmp_path, "llama")
    recipe = tiny_job_recipe(tmp_path, "- {pass: quantize.gptq, group_size: 32}", "fp8-source")
    config = assert_same_exports_as_the_twin(tmp_path, recipe, fp8, plain)
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert config["dtype"] == "bfloat16"


def test_fp8_sources_with_mtp_modules_or_a_vision_tower_load_their_causal_lm(tmp_path):
    """DeepSeek-V3's release: fp8 with its MTP layer; an FP8 multimodal release: the text model
    (MTP and vision tensors are carried by the export, read as stored or dequantized)."""
    from compress.testing import add_mtp_modules, write_tiny_multimodal

    model = make_tiny_moe("deepseek_v3", tie_word_embeddings=False)
    model.save_pretrained(tmp_path / "ds")
    make_char_tokenizer().save_pretrained(tmp_path / "ds")
    add_mtp_modules(tmp_path / "ds")
    fp8, plain = _fp8_pair(tmp_path / "ds", tmp_path / "ds-pair", [128, 128])
    assert any(n.startswith("model.layers.2.") and CheckpointReader(fp8).dtype(n) ==
               torch.bfloat16 for n in CheckpointReader(fp8).names())  # MTP, dequantized
    torch.testing.assert_close(_logits(fp8), _logits(plain), rtol=0, atol=0)
    inspect_checkpoint(fp8)  # the MTP tensors are the checkpoint's, not a mismatch
    write_tiny_multimodal(tmp_path / "mm", "gemma3")
    fp8, plain = _fp8_pair(tmp_path / "mm", tmp_path / "mm-pair")
    torch.testing.assert_close(_logits(fp8), _logits(plain), rtol=0, atol=0)
    inspect_checkpoint(fp8)  # nor the vision tower's


def _edit(fp8, change) -> None:
    tensors = load_file(fp8 / "model.safetensors")
    change(tensors)
    save_file(tensors, fp8 / "model.safetensors", metadata={"format": "pt"})


def test_fp8_without_its_scale_or_with_the_wrong_grid_is_named(tmp_path):
    fp8, _ = _write(tmp_path, "llama")
    name = "model.layers.0.mlp.down_proj.weight"
    _edit(fp8, lambda t: t.pop(f"{name}_scale_inv"))
    with pytest.raises(ModelLoadError, match=rf"fp8 tensor {name} has no {name}_scale_inv"):
        load_model(str(fp8))
    fp8, _ = _write(tmp_path / "again", "llama")
    _edit(fp8, lambda t: t.update({f"{name}_scale_inv": torch.ones(1, 1)}))
    with pytest.raises(ModelLoadError, match=r"has shape \[1, 1\] but weight_block_size"):
        load_model(str(fp8))


def test_fp8_weights_under_another_scheme_are_refused_with_the_fix(tmp_path):
    fp8, _ = _write(tmp_path, "llama")
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float"}
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="stored in fp8 under quantization_config.quant_method "
                                             "'compressed-tensors'.*start from the 16-bit"):
        load_model(str(fp8))


@pytest.mark.parametrize("block", [[0, 128], [128], "128x128", [True, 128], [128.0, 128]])
def test_a_fuzzed_block_size_is_named(block, tmp_path):
    fp8, _ = _write(tmp_path, "llama")
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = block
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="weight_block_size .* is not two positive integers"):
        load_model(str(fp8))
