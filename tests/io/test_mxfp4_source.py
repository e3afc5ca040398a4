"""MXFP4 source checkpoints (``quant_method: mxfp4``: GPT-OSS 20B/120B as released, each
layer's experts as ``*_blocks`` of e2m1 codes and ``*_scales`` of e8m0 exponents) are read as
their dequantized 16-bit weights by every loader.

References: transformers' own MXFP4 dequantization (``convert_moe_packed_tensors``) of the same
blocks, and the same model written as an ordinary bf16 checkpoint holding those values (its
logits, and the export of the same job on it, tensor for tensor). Every MXFP4 value is exact in
bf16, so the comparisons are exact.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from compress.core.errors import ModelLoadError
from compress.io.checkpoint import CheckpointReader
from compress.io.inspect import inspect_checkpoint
from compress.io.load import load_model
from compress.testing import make_char_tokenizer, make_tiny_moe
from tests.io.io_helpers import assert_same_exports_as_the_twin, tiny_job_recipe

IDS = [[1, 5, 17, 33, 60, 61, 7, 90, 91, 3, 200, 201]]
EXPERTS = ("gate_up_proj", "down_proj")


def _mxfp4_pair(folder):
    """(MXFP4 checkpoint, bf16 checkpoint of its dequantized values) of a tiny GPT-OSS: each
    layer's experts as random e2m1 codes with exponents around 2^-6 (the released weights'
    range), the bf16 one holding transformers' dequantization of them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = make_tiny_moe("gpt_oss", tie_word_embeddings=False).to(torch.bfloat16)
    model.save_pretrained(folder / "source")
    make_char_tokenizer().save_pretrained(folder / "source")
    plain, mxfp4 = folder / "bf16", folder / "mxfp4"
    for target in (plain, mxfp4):
        shutil.copytree(folder / "source", target)
    generator = torch.Generator().manual_seed(0)
    tensors = load_file(folder / "source" / "model.safetensors")
    packed, dequantized = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(EXPERTS)]:
        count, inputs, outputs = tensors[name].shape  # the module's [E, in, out]
        blocks = torch.randint(0, 256, (count, outputs, inputs // 32, 16), generator=generator,
                               dtype=torch.uint8)  # fmt: skip
        scales = torch.randint(118, 124, (count, outputs, inputs // 32), generator=generator,
                               dtype=torch.uint8)  # fmt: skip
        del packed[name]
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
        assert dequantized[name].shape == tensors[name].shape
    save_file(packed, mxfp4 / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, plain / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((mxfp4 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (mxfp4 / "config.json").write_text(json.dumps(config))
    return mxfp4, plain


def _logits(folder) -> torch.Tensor:
    with torch.no_grad():
        return load_model(str(folder)).model(torch.tensor(IDS)).logits


def test_an_mxfp4_source_reads_as_transformers_dequantizes_it(tmp_path):
    mxfp4, plain = _mxfp4_pair(tmp_path)
    reader, reference = CheckpointReader(mxfp4), CheckpointReader(plain)
    assert not any(n.endswith(("_blocks", "_scales")) for n in reader.names())
    assert sorted(reader.names()) == sorted(reference.names())
    for name in reference.names():
        assert reader.shape(name) == reference.shape(name)
        assert reader.dtype(name) == reference.dtype(name) == torch.bfloat16
        assert reader.nbytes(name) == reference.nbytes(name)
        assert torch.equal(reader.read(name), reference.read(name)), name
    torch.testing.assert_close(_logits(mxfp4), _logits(plain), rtol=0, atol=0)
    report = inspect_checkpoint(mxfp4)
    assert report["markdown"].splitlines()[2] == "quantization: mxfp4"
    experts = [r for r in report["layers"] if r["module"].endswith("mlp.experts")]
    assert experts and all(r["format"] == "MXFP4 source (dequantized on read)" for r in experts)


def test_a_job_on_an_mxfp4_source_exports_what_it_exports_from_the_bf16_one(tmp_path):
    mxfp4, plain = _mxfp4_pair(tmp_path)
    recipe = tiny_job_recipe(tmp_path, "- {pass: quantize.int4_rtn, group_size: 32}", "mxfp4")
    config = assert_same_exports_as_the_twin(tmp_path, recipe, mxfp4, plain)
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"


def _edit(folder, change) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_mxfp4_blocks_that_do_not_make_a_weight_are_named(tmp_path):
    """Blocks without scales, scales without blocks, wrong shapes, a weight stored both ways,
    blocks under a config that does not say MXFP4: each refused, naming the tensor."""
    mxfp4, _ = _mxfp4_pair(tmp_path)
    name = "model.layers.0.mlp.experts.down_proj"
    original = load_file(mxfp4 / "model.safetensors")
    _edit(mxfp4, lambda t: t.pop(f"{name}_scales"))
    with pytest.raises(ModelLoadError, match=rf"MXFP4 tensor {name}_blocks has no {name}_scales"):
        load_model(str(mxfp4))
    save_file(original, mxfp4 / "model.safetensors", metadata={"format": "pt"})
    _edit(mxfp4, lambda t: t.update({f"{name}_scales": t[f"{name}_scales"][:, :-1].clone()}))
    with pytest.raises(ModelLoadError, match=r"are not uint8 \[E, R, G, 16\] blocks"):
        load_model(str(mxfp4))
    save_file(original, mxfp4 / "model.safetensors", metadata={"format": "pt"})
    _edit(mxfp4, lambda t: t.pop(f"{name}_blocks"))
    with pytest.raises(ModelLoadError, match=rf"MXFP4 scales {name}_scales have no {name}_blocks"):
        load_model(str(mxfp4))
    save_file(original, mxfp4 / "model.safetensors", metadata={"format": "pt"})
    _edit(mxfp4, lambda t: t.update({name: torch.zeros(4, 64, 64, dtype=torch.bfloat16)}))
    with pytest.raises(ModelLoadError, match=rf"tensor {name} is stored twice, as itself and as "
                                             r"MXFP4 blocks"):
        load_model(str(mxfp4))
    save_file(original, mxfp4 / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((mxfp4 / "config.json").read_text())
    del config["quantization_config"]
    (mxfp4 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"_blocks and its _scales are MXFP4 blocks, but "
                                             r"config.json's quantization_config.quant_method is "
                                             r"None, not 'mxfp4'"):
        load_model(str(mxfp4))
