"""Multimodal checkpoints (Gemma 3 4B+, Mistral 3, LLaVA): their text model is loaded, compressed
and served, and the export is the multimodal model again (``compress.io.wrapped``).

References: transformers' own multimodal model on the same text (logits), the source shards
(the vision tensors, byte for byte), plain transformers loading the export in a child process
(every stored tensor placed), and the whole job against the streamed one (the same bytes)."""

from __future__ import annotations

import json

import pytest
import torch

from compress.core.errors import ModelLoadError, RecipeError
from compress.io.load import load_model
from compress.pipeline.job import run_job
from compress.testing import TINY_WRAPPER_TYPES, write_tiny_multimodal
from tests.io.io_helpers import stored_tensors, tiny_job_recipe

IDS = [[1, 5, 17, 33, 60, 61, 7, 90, 91, 3, 200, 201]]


def _wrapper_logits(folder) -> torch.Tensor:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(IDS)).logits


def _recipe(tmp_path, passes: str):
    return tiny_job_recipe(tmp_path, passes, "tiny-multimodal")


_tensors = stored_tensors


@pytest.mark.parametrize("legacy_names", [False, True], ids=["saved", "legacy-names"])
@pytest.mark.parametrize("kind", [*TINY_WRAPPER_TYPES, "qwen2_5_vl-flat"])
def test_the_text_model_computes_what_the_multimodal_model_computes(kind, legacy_names, tmp_path):
    folder = write_tiny_multimodal(tmp_path / kind, kind.removesuffix("-flat"),
                                   legacy_names=legacy_names, flat_config=kind.endswith("-flat"))
    loaded = load_model(str(folder))
    assert not hasattr(loaded.model.config, "vision_config")  # the text model alone
    with torch.no_grad():
        ours = loaded.model(torch.tensor(IDS)).logits
    torch.testing.assert_close(ours, _wrapper_logits(folder), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["gemma3", "mistral3", "qwen2_5_vl", "qwen3_vl",
                                  "qwen2_5_vl-flat"])
def test_w4_export_is_the_multimodal_model_with_its_vision_tower_as_stored(kind, tmp_path):
    pytest.importorskip("compressed_tensors")
    from compress.io.wrapped import ignore_patterns, wrapped_text
    from compress.testing import plain_transformers_logits

    source = write_tiny_multimodal(tmp_path / "source", kind.removesuffix("-flat"),
                                   tie_word_embeddings=False, flat_config=kind.endswith("-flat"))
    for name in ("preprocessor_config.json", "chat_template.jinja"):
        (source / name).write_text(json.dumps({"marker": name}))
    recipe = _recipe(tmp_path, "- {pass: quantize.gptq, group_size: 32}")
    streamed, whole = tmp_path / "streamed", tmp_path / "whole"
    run_job(recipe, model=str(source), out_dir=streamed, stream=True, progress=False)
    run_job(recipe, model=str(source), out_dir=whole, stream=False, progress=False)
    ours, theirs = _tensors(streamed), _tensors(whole)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)  # the same job, the same bytes

    stored, wrapped = _tensors(source), wrapped_text(source)
    vision = wrapped.passthrough
    assert len(vision) > 10 and all(torch.equal(ours[n], stored[n]) for n in vision)
    assert ours[vision[0]].dtype == stored[vision[0]].dtype
    packed = [n for n in ours if n.endswith("weight_packed")]
    assert len(packed) == 2 * 7  # every text linear of the 2 layers, no vision one
    assert all(wrapped.text_name(n).startswith("model.layers.") for n in packed)
    assert all(wrapped.text_name(n) is not None for n in set(ours) - set(vision))
    from compress.io.inspect import inspect_checkpoint

    assert {r["module"] for r in inspect_checkpoint(streamed)["layers"]
            if r["format"] == "int4 pack-quantized"} == {n.rsplit(".", 1)[0] for n in packed}

    config = json.loads((streamed / "config.json").read_text())
    source_config = json.loads((source / "config.json").read_text())
    assert config["architectures"] == source_config["architectures"]
    assert config["vision_config"] == source_config["vision_config"]
    assert config.get("text_config") == source_config.get("text_config")  # no pass changed it
    assert {k: config[k] for k in source_config if k != "dtype"} == {
        k: source_config[k] for k in source_config if k != "dtype"}  # nor the rest
    assert set(ignore_patterns(wrapped.passthrough)) < set(config["quantization_config"]["ignore"])
    for name in ("preprocessor_config.json", "chat_template.jinja"):
        assert json.loads((streamed / name).read_text()) == {"marker": name}

    with torch.no_grad():
        reloaded = load_model(str(streamed)).model(torch.tensor(IDS)).logits
    (plain,) = plain_transformers_logits([streamed], IDS, tmp_path)  # a child without compress
    assert float((plain - reloaded).norm() / reloaded.norm()) < 1e-2
    if kind == "gemma3":  # an image goes through the export's vision tower as through the source's
        from transformers import AutoModelForImageTextToText

        pixels = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(0))
        features = []
        for folder in (source, streamed):
            model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
            with torch.no_grad():
                found = model.model.get_image_features(pixel_values=pixels)
            features.append(getattr(found, "pooler_output", found))
        torch.testing.assert_close(features[1], features[0], rtol=0, atol=0)


def test_vision_patterns_leave_every_vision_module_float_under_both_trees(tmp_path):
    from compress.core.matcher import matches
    from compress.io.wrapped import ignore_patterns, wrapped_text

    wrapped = wrapped_text(write_tiny_multimodal(tmp_path / "m", "gemma3"))
    patterns = ignore_patterns(wrapped.passthrough)
    names = ["vision_tower.vision_model.encoder.layers.0.self_attn.q_proj",  # vLLM's tree
             "model.vision_tower.vision_model.encoder.layers.0.mlp.fc1",  # transformers 5's
             "multi_modal_projector.mm_input_projection", "model.multi_modal_projector.x"]
    assert all(any(matches(n, None, p) for p in patterns) for n in names)
    text = ["model.language_model.layers.0.mlp.down_proj", "language_model.model.layers.0.x",
            "lm_head", "model.layers.0.self_attn.q_proj"]
    assert not any(matches(n, None, p) for n in text for p in patterns)


@pytest.mark.parametrize("kind", ["gemma3", "qwen2_5_vl"])
def test_pruned_layers_are_the_exported_text_config(kind, tmp_path):
    types = ["sliding_attention"] * 2 + ["full_attention"] if kind == "gemma3" else None
    source = write_tiny_multimodal(tmp_path / "source", kind, num_hidden_layers=3,
                                   **({"layer_types": types} if types else {}))
    recipe = _recipe(tmp_path, "- {pass: prune.layers, num_layers: 2}")
    run_job(recipe, model=str(source), out_dir=tmp_path / "out", progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    before = json.loads((source / "config.json").read_text())["text_config"]
    assert config["text_config"]["num_hidden_layers"] == 2
    assert len(config["text_config"]["layer_types"]) == 2  # the kept layers' entries
    # the rest as stored: the wrapper's text model type, its M-RoPE sections
    assert {k: v for k, v in config["text_config"].items()
            if k not in ("num_hidden_layers", "layer_types")} == {
        k: v for k, v in before.items() if k not in ("num_hidden_layers", "layer_types")}
    from transformers import AutoModelForImageTextToText

    model, info = AutoModelForImageTextToText.from_pretrained(
        tmp_path / "out", output_loading_info=True)
    assert len(model.model.language_model.layers) == 2
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_runtime_greedy_tokens_equal_the_multimodal_models(tmp_path):
    from transformers import AutoModelForImageTextToText

    from compress.runtime.engine import Runtime

    folder = write_tiny_multimodal(tmp_path / "m", "gemma3")
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model.generate(torch.tensor(IDS), max_new_tokens=8, do_sample=False,
                                  eos_token_id=None, pad_token_id=2)[0, len(IDS[0]):].tolist()
    runtime = Runtime(load_model(str(folder)).model, max_seq_len=64, max_batch_size=1)
    assert runtime.generate(IDS, 8)[0] == expected


def test_a_multimodal_model_whose_text_family_is_unsupported_is_named(tmp_path):
    folder = write_tiny_multimodal(tmp_path / "m", "gemma3")
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["model_type"] = "unknown_text"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"multimodal model \('gemma3'\) whose text model "
                                             r"\('unknown_text'\) is not a supported family"):
        load_model(str(folder))


def test_a_multimodal_model_quantized_by_another_tool_is_named(tmp_path):
    folder = write_tiny_multimodal(tmp_path / "m", "gemma3")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quantized with 'bitsandbytes'; compress reads"):
        load_model(str(folder))


def test_shards_without_a_text_model_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = write_tiny_multimodal(tmp_path / "m", "gemma3")
    tensors = load_file(folder / "model.safetensors")
    save_file({f"other.{n}": t for n, t in tensors.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="no tensor is stored under 'language_model.model.'"):
        load_model(str(folder))


def test_a_text_only_checkpoint_under_a_multimodal_config_is_named(tmp_path):
    from compress.testing import make_tiny_model

    folder = write_tiny_multimodal(tmp_path / "m", "gemma3")
    (folder / "model.safetensors").unlink()
    make_tiny_model("gemma3_text").save_pretrained(tmp_path / "text")  # model.* names
    (tmp_path / "text" / "model.safetensors").rename(folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match="no tensor is stored under 'language_model.model.' "
                                             "or 'model.language_model.'"):
        load_model(str(folder))


def test_a_missing_text_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = write_tiny_multimodal(tmp_path / "m", "gemma3")
    tensors = load_file(folder / "model.safetensors")
    del tensors["language_model.model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(folder))


def test_bitsandbytes_of_a_multimodal_model_is_refused_before_any_work(tmp_path):
    folder = write_tiny_multimodal(tmp_path / "m", "gemma3")
    recipe = _recipe(tmp_path, "- {pass: quantize.bnb}")
    with pytest.raises(RecipeError, match="stores a vision tower beside its causal LM: quantize"):
        run_job(recipe, model=str(folder), out_dir=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
