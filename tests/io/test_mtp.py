"""Multi-token-prediction (MTP) modules stored beside the causal LM (GLM-4.5/4.6: decoder layers
after the last, ``num_nextn_predict_layers``; ERNIE-4.5-MoE: ``mtp_*`` modules): every loader
reads the causal LM without them, and the export carries them as stored, float, so vLLM's MTP
speculative decoding still finds them (``compress.io.wrapped``).

References: the same checkpoint without its MTP shard (the loaders' model and the export's
causal LM tensors, byte for byte), the MTP shard itself (the exported tensors, byte for byte),
plain transformers reloading the export, and the config's count (a layer past it is refused).
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from compress.arch import mtp_tensors
from compress.core.errors import ModelLoadError, RecipeError
from compress.io.checkpoint import CheckpointReader
from compress.io.load import load_model
from compress.pipeline.job import run_job
from compress.recipe import parse_recipe
from compress.testing import make_char_tokenizer, make_tiny_moe

IDS = [[1, 5, 17, 33, 60, 61, 7, 90, 91, 3, 200, 201]]
HIDDEN = 64  # make_tiny_moe's


def _mtp_shard(model_type: str, num_layers: int) -> dict[str, torch.Tensor]:
    """MTP tensors under the names the released checkpoints store them under."""
    g = torch.Generator().manual_seed(7)
    if model_type == "ernie4_5_moe":  # ERNIE-4.5-21B-A3B's mtp_* modules
        names = {"model.mtp_block.0.self_attn.q_proj.weight": (HIDDEN, HIDDEN),
                 "model.mtp_block.0.input_layernorm.weight": (HIDDEN,),
                 "model.mtp_emb_norm.0.weight": (HIDDEN,),
                 "model.mtp_hidden_norm.0.weight": (HIDDEN,),
                 "model.mtp_linear_proj.0.weight": (HIDDEN, 2 * HIDDEN)}
    else:  # GLM-4.5's layer 46 of 46: a decoder layer with eh_proj, enorm, hnorm, shared_head
        layer = f"model.layers.{num_layers}."
        names = {layer + "eh_proj.weight": (HIDDEN, 2 * HIDDEN), layer + "enorm.weight": (HIDDEN,),
                 layer + "hnorm.weight": (HIDDEN,), layer + "shared_head.norm.weight": (HIDDEN,),
                 layer + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
                 layer + "mlp.experts.0.down_proj.weight": (HIDDEN, HIDDEN)}
    return {n: torch.randn(*shape, generator=g).to(torch.bfloat16) for n, shape in names.items()}


def _write(folder, model_type: str, *, with_mtp: bool = True, **overrides):
    """A tiny float MoE checkpoint in two shards, the second holding MTP tensors (with_mtp)."""
    extra = {"num_nextn_predict_layers": 1} if model_type == "glm4_moe" else {}
    model = make_tiny_moe(model_type, tie_word_embeddings=False, **extra, **overrides)
    model.save_pretrained(folder)
    make_char_tokenizer().save_pretrained(folder)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    shards = {"model-00001-of-00002.safetensors":
              load_file(folder / "model-00001-of-00002.safetensors")}
    if with_mtp:
        shards["model-00002-of-00002.safetensors"] = _mtp_shard(
            model_type, model.config.num_hidden_layers)
        save_file(shards["model-00002-of-00002.safetensors"],
                  folder / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    weight_map = {n: file for file, tensors in shards.items() for n in tensors}
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def _recipe(tmp_path, passes: str):
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    return parse_recipe({
        "name": "tiny-mtp",
        "calibration": {"source": str(tmp_path / "text.txt"), "num_samples": 3, "seq_len": 24,
                        "seed": 0},
        "passes": yaml.safe_load(textwrap.dedent(passes)),
        "export": {"dtype": "auto"},
        "eval": {"baseline": False, "perplexity": None},
    })


def _tensors(folder) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(folder)
    return {name: reader.read(name) for name in reader.names()}


def test_mtp_tensors_are_the_declared_layers_and_the_mtp_modules():
    config = {"model_type": "glm4_moe", "num_hidden_layers": 2, "num_nextn_predict_layers": 1}
    names = ["model.layers.1.mlp.gate.weight", "model.layers.2.eh_proj.weight",
             "model.layers.3.eh_proj.weight", "model.layers.20.x.weight",
             "model.mtp_block.0.self_attn.q_proj.weight", "lm_head.weight"]
    assert mtp_tensors(config, names) == ("model.layers.2.eh_proj.weight",
                                          "model.mtp_block.0.self_attn.q_proj.weight")
    assert mtp_tensors({**config, "num_nextn_predict_layers": 0}, names) == (
        "model.mtp_block.0.self_attn.q_proj.weight",)
    assert mtp_tensors({**config, "model_type": "unknown"}, names) == ()


@pytest.mark.parametrize("model_type", ["glm4_moe", "ernie4_5_moe"])
def test_loaders_read_the_causal_lm_and_the_export_carries_the_mtp_modules(model_type, tmp_path):
    pytest.importorskip("compressed_tensors")
    from compress.core.matcher import matches

    source = _write(tmp_path / "source", model_type)
    plain = _write(tmp_path / "plain", model_type, with_mtp=False)
    with torch.no_grad():
        expected = load_model(str(plain)).model(torch.tensor(IDS)).logits
        got = load_model(str(source)).model(torch.tensor(IDS)).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)

    recipe = _recipe(tmp_path, "- {pass: quantize.gptq, group_size: 32}")
    for folder, stream in ((source, True), (source, False), (plain, True)):
        out = tmp_path / f"{folder.name}-{stream}"
        run_job(recipe, model=str(folder), out_dir=out, stream=stream, progress=False)
    streamed, whole = _tensors(tmp_path / "source-True"), _tensors(tmp_path / "source-False")
    without = _tensors(tmp_path / "plain-True")
    mtp = _mtp_shard(model_type, 2)
    assert streamed.keys() == whole.keys() == without.keys() | mtp.keys()
    for name, tensor in streamed.items():  # the causal LM as without MTP; MTP as stored
        reference = mtp[name] if name in mtp else without[name]
        assert tensor.dtype == reference.dtype and torch.equal(tensor, reference), name
        assert torch.equal(whole[name], tensor), name

    config = json.loads((tmp_path / "source-True" / "config.json").read_text())
    ignore = config["quantization_config"]["ignore"]
    modules = {n.rsplit(".", 1)[0] for n in mtp}
    assert all(any(matches(m, None, p) for p in ignore) for m in modules), (modules, ignore)
    quantized = [n.removesuffix(".weight_packed") for n in streamed if n.endswith("_packed")]
    assert quantized and not any(matches(m, None, p) for m in quantized for p in ignore
                                 if p.startswith("re:"))
    with torch.no_grad():
        reloaded = load_model(str(tmp_path / "source-True")).model(torch.tensor(IDS)).logits
        reference = load_model(str(tmp_path / "plain-True")).model(torch.tensor(IDS)).logits
    torch.testing.assert_close(reloaded, reference, rtol=0, atol=0)
    if model_type == "glm4_moe":  # transformers skips them (its own unexpected-name list)
        from compress.testing import plain_transformers_logits

        (theirs,) = plain_transformers_logits([tmp_path / "source-True"], IDS, tmp_path)
        assert float((theirs - reloaded).norm() / reloaded.norm()) < 1e-2


def test_dropped_layers_move_the_mtp_layer_after_the_last(tmp_path):
    source = _write(tmp_path / "source", "glm4_moe", num_hidden_layers=3)
    run_job(_recipe(tmp_path, "- {pass: prune.layers, num_layers: 2}"), model=str(source),
            out_dir=tmp_path / "out", progress=False)
    exported = _tensors(tmp_path / "out")
    mtp = _mtp_shard("glm4_moe", 3)
    for name, tensor in mtp.items():
        assert torch.equal(exported[name.replace("layers.3.", "layers.2.")], tensor)
    assert not any(n.startswith("model.layers.3.") for n in exported)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["num_nextn_predict_layers"] == 1
    assert len(load_model(str(tmp_path / "out")).model.model.layers) == 2  # read back as such


def test_a_layer_past_the_declared_mtp_layers_is_refused(tmp_path):
    source = _write(tmp_path / "source", "glm4_moe")
    file = source / "model-00002-of-00002.safetensors"
    tensors = load_file(file)
    tensors["model.layers.3.enorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    save_file(tensors, file, metadata={"format": "pt"})
    index = json.loads((source / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.3.enorm.weight"] = file.name
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"unexpected \['model\.layers\.3\.enorm\.weight'\]"):
        load_model(str(source))


def test_bitsandbytes_of_a_checkpoint_with_mtp_modules_is_refused_before_any_work(tmp_path):
    source = _write(tmp_path / "source", "glm4_moe")
    recipe = _recipe(tmp_path, "- {pass: quantize.bnb}")
    with pytest.raises(RecipeError, match="multi-token-prediction modules beside its causal LM"):
        run_job(recipe, model=str(source), out_dir=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
