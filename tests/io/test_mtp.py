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

import pytest
import torch
from safetensors.torch import load_file, save_file

from compress.arch import mtp_tensors
from compress.core.errors import ModelLoadError, RecipeError
from compress.io.load import load_model
from compress.pipeline.job import run_job
from compress.testing import add_mtp_modules, make_char_tokenizer, make_tiny_moe
from tests.io.io_helpers import stored_tensors, tiny_job_recipe

IDS = [[1, 5, 17, 33, 60, 61, 7, 90, 91, 3, 200, 201]]
HIDDEN = 64  # make_tiny_moe's


def _write(folder, model_type: str, *, with_mtp: bool = True, **overrides):
    """A tiny float MoE checkpoint; with_mtp: MTP modules in a shard of their own, as released
    (``add_mtp_modules``). Returns the folder and the MTP tensors."""
    extra = {"num_nextn_predict_layers": 1} if model_type == "glm4_moe" else {}
    model = make_tiny_moe(model_type, tie_word_embeddings=False, **extra, **overrides)
    model.save_pretrained(folder)
    make_char_tokenizer().save_pretrained(folder)
    return folder, (add_mtp_modules(folder) if with_mtp else {})


def _recipe(tmp_path, passes: str):
    return tiny_job_recipe(tmp_path, passes, "tiny-mtp")


_tensors = stored_tensors


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
    # a fuzzed count: the names decide, nothing is enumerated (10**12 layers would be)
    assert mtp_tensors({**config, "num_nextn_predict_layers": 10**12}, names)[:3] == (
        "model.layers.2.eh_proj.weight", "model.layers.3.eh_proj.weight",
        "model.layers.20.x.weight")
    assert mtp_tensors({**config, "num_nextn_predict_layers": "1"}, names) == (
        "model.mtp_block.0.self_attn.q_proj.weight",)


@pytest.mark.parametrize("model_type", ["glm4_moe", "ernie4_5_moe", "deepseek_v3"])
def test_loaders_read_the_causal_lm_and_the_export_carries_the_mtp_modules(model_type, tmp_path):
    pytest.importorskip("compressed_tensors")
    from compress.core.matcher import matches

    source, mtp = _write(tmp_path / "source", model_type)
    plain, _ = _write(tmp_path / "plain", model_type, with_mtp=False)
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
    from compress.io.inspect import inspect_checkpoint

    assert {r["module"] for r in inspect_checkpoint(tmp_path / "source-True")["layers"]} >= modules
    with torch.no_grad():
        reloaded = load_model(str(tmp_path / "source-True")).model(torch.tensor(IDS)).logits
        reference = load_model(str(tmp_path / "plain-True")).model(torch.tensor(IDS)).logits
    torch.testing.assert_close(reloaded, reference, rtol=0, atol=0)
    if model_type == "glm4_moe":  # transformers skips them (its own unexpected-name list)
        from compress.testing import plain_transformers_logits

        (theirs,) = plain_transformers_logits([tmp_path / "source-True"], IDS, tmp_path)
        assert float((theirs - reloaded).norm() / reloaded.norm()) < 1e-2


def test_dropped_layers_move_the_mtp_layer_after_the_last(tmp_path):
    source, mtp = _write(tmp_path / "source", "glm4_moe", num_hidden_layers=3)
    run_job(_recipe(tmp_path, "- {pass: prune.layers, num_layers: 2}"), model=str(source),
            out_dir=tmp_path / "out", progress=False)
    exported = _tensors(tmp_path / "out")
    for name, tensor in mtp.items():
        assert torch.equal(exported[name.replace("layers.3.", "layers.2.")], tensor)
    assert not any(n.startswith("model.layers.3.") for n in exported)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["num_nextn_predict_layers"] == 1
    assert len(load_model(str(tmp_path / "out")).model.model.layers) == 2  # read back as such


def test_a_layer_past_the_declared_mtp_layers_is_refused(tmp_path):
    source, _ = _write(tmp_path / "source", "glm4_moe")
    file = source / "model-mtp.safetensors"
    tensors = load_file(file)
    tensors["model.layers.3.enorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    save_file(tensors, file, metadata={"format": "pt"})
    index = json.loads((source / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.3.enorm.weight"] = file.name
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"unexpected \['model\.layers\.3\.enorm\.weight'\]"):
        load_model(str(source))


def test_bitsandbytes_of_a_checkpoint_with_mtp_modules_is_refused_before_any_work(tmp_path):
    source, _ = _write(tmp_path / "source", "glm4_moe")
    recipe = _recipe(tmp_path, "- {pass: quantize.bnb}")
    with pytest.raises(RecipeError, match="multi-token-prediction modules beside its causal LM"):
        run_job(recipe, model=str(source), out_dir=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
