"""Corrupted and inconsistent mixture-of-experts checkpoints (beside test_corrupt_inputs.py).
A float MoE checkpoint stores one weight per expert and projection, which transformers fuses as
it loads and ``MoeTreeReader`` stacks as a streamed layer is read. A missing, extra, misshapen or
integer expert weight, an expert count config.json does not match, or a router that picks none
or more than all of its experts is one ``ModelLoadError`` line naming the tensor or setting, the
same for a whole load, a layer-by-layer read and a streamed job. Before, the whole load stopped
with transformers' RuntimeError, the streamed read with torch.stack's, an integer expert was
silently cast to zeros, and a router picking none was accepted."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from compress.core.errors import ModelLoadError
from compress.io.export import layerwise_model
from compress.io.load import load_model
from compress.pipeline.job import run_job
from compress.recipe import parse_recipe
from compress.testing import make_char_tokenizer, make_tiny_moe


def _first_expert(tensors):
    return sorted(n for n in tensors if ".experts.0." in n)[0]


def _drop(tensors, config):
    del tensors[_first_expert(tensors)]


def _shorter(tensors, config):
    name = _first_expert(tensors)
    tensors[name] = tensors[name][:-1].clone()


def _extra(tensors, config):
    name = _first_expert(tensors)
    tensors[name.replace(".experts.0.", ".experts.99.")] = tensors[name].clone()


def _integer(tensors, config):
    name = _first_expert(tensors)
    tensors[name] = tensors[name].to(torch.int8)


def _count_key(config):
    return "num_local_experts" if "num_local_experts" in config else "num_experts"


def _more(tensors, config):
    config[_count_key(config)] += 1


def _fewer(tensors, config):
    config[_count_key(config)] -= 1


BREAKS = {
    "missing_expert_weight": (_drop, r"experts\.0\.\w+\.weight is missing: config.json implies 4"),
    "expert_weight_shape": (_shorter, r"experts\.0\.\w+\.weight has shape \[\d+, 64\] but "),
    "expert_beyond_the_count": (_extra, r"experts\.99\.\w+\.weight'\] are per-expert weights "
                                        r"beyond the 4"),
    "integer_expert_weight": (_integer, r"stored as torch.int8 but the model's weight is floating"),
    # a router stored under its tree name (Qwen2-MoE) is the first tensor found to disagree
    "config_with_more": (_more, r"experts\.4\.\w+\.weight is missing: config.json implies 5"
                                r"|gate.weight has shape \[4, 64\] but config.json implies \[5"),
    "config_with_fewer": (_fewer, r"experts\.3\.\w+\.weight', .*beyond the 3"
                                  r"|gate.weight has shape \[4, 64\] but config.json implies \[3"),
    "routed_to_none": (lambda t, c: c.update(num_experts_per_tok=0),
                       r"config.json: each token is routed to 0 of 4 experts"),
    "routed_to_more_than_all": (lambda t, c: c.update(num_experts_per_tok=5),
                                r"routed to 5 of 4 experts; the number per token must be 1 to 4"),
}


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def moe_checkpoint(request, tmp_path_factory):
    """A tiny bf16 MoE checkpoint (4 experts a layer, per-expert weights as on the hub):
    Mixtral (its block under another name in checkpoints) and Qwen2-MoE (a shared expert)."""
    folder = tmp_path_factory.mktemp(request.param) / "ck"
    make_tiny_moe(request.param, tie_word_embeddings=False).to(torch.bfloat16).save_pretrained(
        folder)
    make_char_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", list(BREAKS))
def test_a_broken_moe_checkpoint_is_one_line_for_every_reader(kind, moe_checkpoint, tmp_path,
                                                               monkeypatch):
    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    tensors = load_file(moe_checkpoint / "model.safetensors")
    config = json.loads((moe_checkpoint / "config.json").read_text())
    assert config["num_experts_per_tok"] == 2 and config[_count_key(config)] == 4
    brk, message = BREAKS[kind]
    brk(tensors, config)
    folder = tmp_path / "broken"
    folder.mkdir()
    for file in moe_checkpoint.iterdir():
        if file.name not in ("model.safetensors", "config.json"):
            (folder / file.name).write_bytes(file.read_bytes())
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    _every_reader_refuses(folder, message, tmp_path / "out")


def _every_reader_refuses(folder, message: str, out) -> None:
    """A whole load, a layer-by-layer read and a streamed job of ``folder`` each stop with one
    ModelLoadError line matching ``message`` that says what to do, writing nothing at ``out``."""
    recipe = parse_recipe({"name": "broken-moe",
                           "passes": [{"pass": "quantize.int4_rtn", "group_size": 32}],
                           "eval": {"baseline": False, "perplexity": None}})
    readers = {
        "whole load": lambda: load_model(str(folder)),
        "layer by layer": lambda: layerwise_model(folder),
        "streamed job": lambda: run_job(recipe, model=str(folder), out_dir=out, stream=True,
                                        progress=False),
    }
    for name, read in readers.items():
        with pytest.raises(ModelLoadError, match=message) as caught:
            read()
        assert "\n" not in str(caught.value), name
        assert re.search(r"fix|fetch|re-export|write it again", str(caught.value)), name
    assert not out.exists()  # refused before anything was written


def test_an_intact_moe_checkpoint_reads_as_transformers_loads_it(moe_checkpoint):
    # the checks pass the checkpoint they were written for: the layer-by-layer read stacks the
    # same fused experts transformers builds on load (the parts copied into their rows)
    whole = load_model(str(moe_checkpoint)).model
    stream = layerwise_model(moe_checkpoint)
    fused = [n for n, _ in whole.named_parameters() if n.endswith("experts.gate_up_proj")]
    fused += [n for n, _ in whole.named_parameters() if n.endswith("experts.down_proj")]
    assert len(fused) == 4
    reference = dict(whole.named_parameters())
    for name in fused:
        got = stream.reader.read(name, dtype=torch.float32)
        assert tuple(got.shape) == stream.reader.shape(name)
        assert torch.equal(got, reference[name].detach()), name


def _scale_of_expert_0(tensors, config):
    del tensors[sorted(n for n in tensors if ".experts.0." in n and "weight_scale" in n)[0]]


def _codes_width(tensors, config):
    name = sorted(n for n in tensors if ".experts.0." in n and n.endswith("weight_shape"))[0]
    tensors[name] = torch.tensor([int(tensors[name][0]), int(tensors[name][1]) // 2])


QUANTIZED_BREAKS = {
    # before: the layer was taken for a float one, and its expert 0 named as missing a float
    # weight the export never had
    "scale_of_expert_0": (_scale_of_expert_0, r"missing \['model\.layers\.0\.mlp\.experts\.0\."
                                              r"\w+\.weight_scale'\]"),
    # before: loaded, the stored shape disagreeing with the codes and config.json unnoticed
    "weight_shape_against_the_codes": (_codes_width, r"weight_shape says \[\d+, 32\] but "
                                                     r"\S+weight_packed is \[\d+, 8\]"),
}


@pytest.fixture(scope="module")
def moe_w4_export(tmp_path_factory):
    """The tiny Mixtral's W4 RTN g32 export (per-expert packed codes, scales and shapes)."""
    from compress.core.registry import CompressionState, run_passes
    from compress.io.export import export_checkpoint
    from compress.quant.rtn import Int4RtnConfig

    model = make_tiny_moe("mixtral", tie_word_embeddings=False)
    run_passes(model, [Int4RtnConfig(group_size=32)], CompressionState(progress=False))
    return export_checkpoint(model, make_char_tokenizer(), tmp_path_factory.mktemp("w4") / "ck")


@pytest.mark.parametrize("kind", list(QUANTIZED_BREAKS))
def test_a_broken_quantized_moe_export_is_one_line(kind, moe_w4_export, tmp_path):
    tensors = load_file(moe_w4_export / "model.safetensors")
    config = json.loads((moe_w4_export / "config.json").read_text())
    brk, message = QUANTIZED_BREAKS[kind]
    brk(tensors, config)
    folder = tmp_path / "broken"
    folder.mkdir()
    for file in moe_w4_export.iterdir():
        if file.name != "model.safetensors":
            (folder / file.name).write_bytes(file.read_bytes())
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    for name, read in {"whole load": lambda: load_model(str(folder)),
                       "layer by layer": lambda: layerwise_model(folder)}.items():
        with pytest.raises(ModelLoadError, match=message) as caught:
            read()
        assert "\n" not in str(caught.value), name
    assert load_model(str(moe_w4_export)).model is not None  # the intact export loads


def test_a_per_layer_routing_setting_is_checked_in_every_layer(tmp_path):
    """HunYuan-MoE's moe_topk may be a list, one entry per layer: a later layer that routes to
    more than all of its experts is refused with the layer named (only layer 0 was checked)."""
    folder = tmp_path / "ck"
    make_tiny_moe("hunyuan_v1_moe", tie_word_embeddings=False).to(torch.bfloat16).save_pretrained(
        folder)
    make_char_tokenizer().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["moe_topk"] = [2, 5]
    (folder / "config.json").write_text(json.dumps(config))
    for read in (lambda: load_model(str(folder)), lambda: layerwise_model(folder)):
        with pytest.raises(ModelLoadError, match=r"routed to 5 of 4 experts.*\(layer 1\)"):
            read()
    config["moe_topk"] = [2, 3]  # within range in every layer: it loads
    (folder / "config.json").write_text(json.dumps(config))
    assert [layer.mlp.gate.top_k for layer in load_model(str(folder)).model.model.layers] == [2, 3]


def _fused_granite_checkpoint(folder):
    """A tiny bf16 GraniteMoE checkpoint: each layer's experts stored fused (input_linear,
    output_linear), as released."""
    make_tiny_moe("granitemoe", tie_word_embeddings=False).to(torch.bfloat16).save_pretrained(
        folder)
    make_char_tokenizer().save_pretrained(folder)
    return load_file(folder / "model.safetensors")


FUSED = "model.layers.0.block_sparse_moe.input_linear.weight"


@pytest.mark.parametrize("kind", ["missing", "shape"])
def test_a_broken_fused_expert_checkpoint_is_one_line_for_every_reader(kind, tmp_path,
                                                                      monkeypatch):
    """A checkpoint storing experts fused (GraniteMoE) with one layer's fused tensor missing
    or misshapen: every reader refuses with one line; the missing one is named as stored
    (it was reported as a per-expert weight of a layout the checkpoint does not use)."""
    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "ck"
    tensors = _fused_granite_checkpoint(folder)
    if kind == "missing":
        del tensors[FUSED]
        message = rf"tensor {re.escape(FUSED)} is missing: layer 1 stores its expert weights fused"
    else:
        tensors[FUSED] = tensors[FUSED][:, :100].contiguous()
        message = rf"tensor {re.escape(FUSED)} has shape \[4, 100, 64\] but config.json implies"
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    _every_reader_refuses(folder, message, tmp_path / "out")
