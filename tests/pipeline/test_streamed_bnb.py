"""quantize.bnb streamed layer by layer (``run_job(stream=...)``): the export is the in-memory
run's (``save_pretrained`` with the bitsandbytes quantizer) tensor for tensor and bit for bit,
with the same config.json and report, on every tiny family and in NF4 (with and without double
quantization), FP4 and LLM.int8; it reloads with transformers and ``compress.load`` with the
in-memory export's logits; a streamed job scores it like the in-memory job; one float linear is
resident at a time; a rotation before it streams too; the memory preflight estimates the
streamed pass and the export's evaluation; and a recipe that would hand bnb layers to another
pass is refused before any work.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from compress.core.errors import RecipeError
from compress.io.stream import CheckpointReader
from compress.pipeline.job import run_job
from compress.recipe import parse_recipe
from compress.testing import TINY_MODEL_TYPES, make_char_tokenizer, make_tiny_llama, make_tiny_model

pytest.importorskip("bitsandbytes")

TEXT = "".join(f"Line {i}: the quick brown fox number {i * 7 % 13} jumps over {i % 5} dogs.\n"
               for i in range(80))
FORMATS = {
    "nf4": {"format": "nf4"},
    "nf4-double-quant": {"format": "nf4", "double_quant": True},
    "fp4": {"format": "fp4", "compute_dtype": "bfloat16"},
    "int8": {"format": "int8"},
    "int8-no-outliers": {"format": "int8", "threshold": 0.0},
}


def _checkpoint(tmp_path, model) -> object:
    """``model`` stored in bf16 (the case 7B checkpoints are) with the char tokenizer."""
    folder = tmp_path / "src"
    model.to(torch.bfloat16).save_pretrained(folder)
    make_char_tokenizer().save_pretrained(folder)
    (tmp_path / "text.txt").write_text(TEXT)
    return folder


def _recipe(settings: dict, evaluate: dict | None = None, **export) -> object:
    return parse_recipe({
        "name": "tiny-bnb",
        "device": "cpu",  # scored layer by layer: on the CPU only
        "passes": [{"pass": "quantize.bnb", **settings}],
        "export": {"dtype": "auto", **export},
        "eval": evaluate or {"baseline": False, "perplexity": None},
    })


def _both(recipe, folder, tmp_path):
    """(in-memory result, streamed result), exported into tmp_path/mem and tmp_path/stream."""
    memory = run_job(recipe, model=str(folder), out_dir=tmp_path / "mem", stream=False,
                     progress=False)
    streamed = run_job(recipe, model=str(folder), out_dir=tmp_path / "stream", stream=True,
                       progress=False)
    assert streamed.payload["memory"]["streamed"] and not memory.payload["memory"]["streamed"]
    return memory, streamed


def _assert_same_export(tmp_path, memory, streamed) -> None:
    a, b = CheckpointReader(tmp_path / "mem"), CheckpointReader(tmp_path / "stream")
    assert sorted(a.names()) == sorted(b.names())
    for name in a.names():
        x, y = a.read(name), b.read(name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    for file in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "mem" / file).read_text()) == json.loads(
            (tmp_path / "stream" / file).read_text()), file
    assert streamed.payload["passes"] == [
        {**p, "seconds": s["seconds"], "peak_memory_bytes": s["peak_memory_bytes"]}
        for p, s in zip(memory.payload["passes"], streamed.payload["passes"], strict=True)]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_streamed_bnb_equals_in_memory_bit_for_bit(fmt, tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    folder = _checkpoint(tmp_path, make_tiny_llama(num_hidden_layers=3,
                                                   tie_word_embeddings=False))
    memory, streamed = _both(_recipe(FORMATS[fmt]), folder, tmp_path)
    _assert_same_export(tmp_path, memory, streamed)
    config = json.loads((tmp_path / "stream" / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["quant_method"] == "bitsandbytes" and quant["llm_int8_skip_modules"] == [
        "lm_head"]
    assert quant["load_in_8bit" if fmt.startswith("int8") else "load_in_4bit"]
    reader = CheckpointReader(tmp_path / "stream")
    weight = "model.layers.2.mlp.down_proj.weight"
    if fmt.startswith("int8"):
        assert reader.dtype(weight) == torch.int8 and "model.layers.2.mlp.down_proj.SCB" in reader
    else:
        assert reader.dtype(weight) == torch.uint8 and reader.shape(weight) == (128 * 64 // 2, 1)
        assert (f"{weight}.nested_absmax" in reader) == (fmt == "nf4-double-quant")
    # dense tensors in the compute dtype, as save_pretrained keeps the model's (asked: auto)
    assert reader.dtype("model.embed_tokens.weight") == torch.float32


@pytest.mark.parametrize("family", TINY_MODEL_TYPES)
def test_streamed_bnb_equals_in_memory_on_every_family(family, tmp_path, monkeypatch,
                                                       one_thread):
    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    folder = _checkpoint(tmp_path, make_tiny_model(family, tie_word_embeddings=False))
    memory, streamed = _both(_recipe(FORMATS["nf4-double-quant"]), folder, tmp_path)
    _assert_same_export(tmp_path, memory, streamed)


def test_streamed_bnb_of_a_tied_head_and_a_layer_subset(tmp_path, monkeypatch, one_thread):
    """The head tied to the embedding, quantized on its own (save_pretrained then writes it
    and the embedding), and targets in one layer only: the other layers come from the source,
    and llm_int8_skip_modules lists every float linear."""
    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    folder = _checkpoint(tmp_path, make_tiny_llama(num_hidden_layers=3))
    recipe = _recipe({"format": "nf4", "targets": ["re:model.layers.1.mlp", "lm_head"],
                      "ignore": []})
    memory, streamed = _both(recipe, folder, tmp_path)
    _assert_same_export(tmp_path, memory, streamed)
    reader = CheckpointReader(tmp_path / "stream")
    assert reader.dtype("lm_head.weight") == torch.uint8
    skip = json.loads((tmp_path / "stream" / "config.json").read_text())[
        "quantization_config"]["llm_int8_skip_modules"]
    assert len(skip) == 3 * 7 - 3 and "model.layers.1.self_attn.q_proj" in skip
    assert "model.layers.1.mlp.up_proj" not in skip and "lm_head" not in skip


@pytest.mark.parametrize("tied", [False, True])
def test_streamed_rotation_then_bnb_equals_in_memory(tied, tmp_path, monkeypatch, one_thread):
    """The one pass that may come before quantize.bnb (a float rewrite): bnb reads each rotated
    layer from its scratch file and the rotated (untied) head from memory."""
    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    folder = _checkpoint(tmp_path, make_tiny_llama(num_hidden_layers=3,
                                                   tie_word_embeddings=tied))
    recipe = parse_recipe({
        "name": "tiny-rotate-bnb", "device": "cpu",
        "passes": [{"pass": "rotate.hadamard", "seed": 0}, {"pass": "quantize.bnb", **FORMATS[
            "nf4-double-quant"]}],
        "export": {"dtype": "auto"}, "eval": {"baseline": False, "perplexity": None},
    })
    memory, streamed = _both(recipe, folder, tmp_path)
    _assert_same_export(tmp_path, memory, streamed)


@pytest.mark.parametrize("fmt", ["nf4-double-quant", "int8"])
def test_streamed_bnb_export_reloads_with_the_in_memory_logits(fmt, tmp_path, monkeypatch,
                                                               one_thread):
    from transformers import AutoModelForCausalLM

    import compress
    from compress.quant.linear import is_bnb_module, portable_cpu_layout

    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    folder = _checkpoint(tmp_path, make_tiny_llama(num_hidden_layers=3,
                                                   tie_word_embeddings=False))
    _both(_recipe(FORMATS[fmt]), folder, tmp_path)
    ids = torch.tensor([[5, 17, 33, 2, 60, 61, 7, 40, 41]])
    logits = {}
    for variant in ("mem", "stream"):
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / variant).eval()
        portable_cpu_layout(plain)  # the numerics of every CPU class, as compress.load sets
        ours = compress.load(str(tmp_path / variant)).model
        assert sum(is_bnb_module(m) for m in ours.modules()) == 3 * 7
        with torch.no_grad():
            logits[variant] = (plain(ids).logits, ours(ids).logits)
    for got, want in zip(logits["stream"], logits["mem"], strict=True):
        assert torch.isfinite(got).all() and torch.equal(got, want)
    from compress.io.inspect import inspect_checkpoint

    assert inspect_checkpoint(tmp_path / "stream")["total_bytes"] > 0  # its own names match


def test_streamed_bnb_job_scores_like_the_in_memory_job(tmp_path, monkeypatch, one_thread):
    """The baseline is scored layer by layer, the bnb export loaded whole (transformers builds
    its layers): perplexity, KL and sizes are the in-memory job's."""
    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    folder = _checkpoint(tmp_path, make_tiny_llama(num_hidden_layers=3,
                                                   tie_word_embeddings=False))
    recipe = _recipe(FORMATS["nf4"], {
        "baseline": True,
        "perplexity": {"dataset": str(tmp_path / "text.txt"), "context_length": 32, "limit": 6},
    })
    memory, streamed = _both(recipe, folder, tmp_path)
    _assert_same_export(tmp_path, memory, streamed)
    a, b = memory.payload, streamed.payload
    phases = b["memory"]["estimate"]["phases_bytes"]
    assert "eval (layer by layer)" in phases and "eval of the export (loaded whole)" in phases
    assert b["eval"]["baseline"]["protocol"]["scored"] == "layer by layer"
    assert "scored" not in b["eval"]["compressed"]["protocol"]
    for variant in ("baseline", "compressed"):
        assert b["eval"][variant]["perplexity"] == a["eval"][variant]["perplexity"], variant
    kl_a, kl_b = a["eval"]["compressed"]["kl"], b["eval"]["compressed"]["kl"]
    kl_a.pop("baseline"), kl_b.pop("baseline")  # the baseline's top-k file, named by its scorer
    assert kl_b == kl_a
    assert a["eval"]["compressed"]["perplexity"] != a["eval"]["baseline"]["perplexity"]
    for row_a, row_b in zip(a["rows"], b["rows"], strict=True):
        assert {k: v for k, v in row_a.items() if k != "disk_mb"} == {
            k: v for k, v in row_b.items() if k != "disk_mb"}


def test_float32_export_of_a_bf16_checkpoint_streams_and_scores_like_in_memory(
        tmp_path, monkeypatch, one_thread):
    """The rule the bnb export relies on (it keeps float32): float32 holds every bf16 value,
    so a job exporting a bf16 checkpoint in float32 still streams when it evaluates, with the
    in-memory numbers (it was refused, as a bf16 export of a float32 source still is)."""
    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    folder = _checkpoint(tmp_path, make_tiny_llama(num_hidden_layers=3,
                                                   tie_word_embeddings=False))
    recipe = parse_recipe({
        "name": "tiny-rtn", "device": "cpu", "passes": [{"pass": "quantize.int4_rtn",
                                                         "group_size": 32}],
        "export": {"dtype": "float32"},
        "eval": {"baseline": True, "perplexity": {"dataset": str(tmp_path / "text.txt"),
                                                  "context_length": 32, "limit": 6}},
    })
    memory, streamed = _both(recipe, folder, tmp_path)
    for variant in ("baseline", "compressed"):
        assert (streamed.payload["eval"][variant]["perplexity"]
                == memory.payload["eval"][variant]["perplexity"]), variant
    assert CheckpointReader(tmp_path / "stream").dtype("model.norm.weight") == torch.float32


def test_streamed_bnb_holds_one_float_linear_at_a_time(tmp_path, monkeypatch, one_thread):
    """Each target is read alone: when a linear is converted it is the only float nn.Linear of
    the decoder stack in memory, and the converted layers are freed once written."""
    from compress.io import stream as stream_module
    from compress.quant import bnb as bnb_pass

    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    folder = _checkpoint(tmp_path, make_tiny_llama(num_hidden_layers=3,
                                                   tie_word_embeddings=False))
    skeletons, seen = [], []
    skeleton = stream_module.meta_skeleton
    monkeypatch.setattr(stream_module, "meta_skeleton",
                        lambda path: skeletons.append(skeleton(path)) or skeletons[-1])
    convert = bnb_pass._convert

    def counting(linear, cfg, bnb):
        layers = skeletons[-1].model.layers
        seen.append((
            sum(type(m) is nn.Linear and m.weight.device.type != "meta" for m in layers.modules()),
            sum(stream_module.is_resident(layer) for layer in layers)))
        return convert(linear, cfg, bnb)

    monkeypatch.setattr(bnb_pass, "_convert", counting)
    run_job(_recipe(FORMATS["nf4-double-quant"]), model=str(folder), out_dir=tmp_path / "out",
            stream=True, progress=False)
    assert len(seen) == 3 * 7 and {float_linears for float_linears, _ in seen} == {1}
    assert max(resident for _, resident in seen) == 1  # the layer being converted, at its end
    left = [n for n, t in skeletons[-1].model.layers.state_dict().items()
            if t.device.type != "meta" and ".quant_state." not in n]  # bnb packs these anew
    assert not left, left  # each finished layer was freed once written


def test_preflight_estimates_the_streamed_pass_and_the_whole_export_eval(tmp_path):
    from compress.io.stream import meta_skeleton
    from compress.pipeline import preflight

    model = make_tiny_llama(num_hidden_layers=3, tie_word_embeddings=False, hidden_size=256,
                            intermediate_size=512, num_attention_heads=4, num_key_value_heads=4)
    folder = _checkpoint(tmp_path, model)
    evaluate = {"baseline": True, "perplexity": {"dataset": "wikitext2", "context_length": 64}}
    skeleton = meta_skeleton(folder)
    for settings, per_weight, per_block in (({"format": "nf4"}, 0.5, 4),
                                            ({"format": "nf4", "double_quant": True}, 0.5, 1)):
        recipe = _recipe(settings, evaluate)
        phases = preflight.estimate(recipe, folder, streamed=True,
                                    skeleton=skeleton)["phases_bytes"]
        largest = 512 * 256  # gate/up/down
        assert phases["pass 0 quantize.bnb"] == preflight.BASE_BYTES + preflight.BNB_BASE_BYTES \
            + int(preflight.LINEAR_SLACK * preflight.BNB_BYTES_PER_PARAM * largest)
        linears = 3 * (4 * 256 * 256 + 3 * 256 * 512)
        dense = sum(p.numel() for p in model.parameters()) - linears
        stored = int(linears * per_weight + linears // 64 * per_block) + 4 * dense
        window = 64 * 320 * 4 * 3  # a window's logits, three float32 copies
        assert phases["eval of the export (loaded whole)"] == (
            preflight.BASE_BYTES + stored + window)
        assert "eval (layer by layer)" in phases  # the baseline
    run_job(_recipe({"format": "nf4"}), model=str(folder), out_dir=tmp_path / "out",
            stream=True, progress=False)
    reader = CheckpointReader(tmp_path / "out")
    written = sum(reader.nbytes(n) for n in reader.names())
    # the estimate leaves out the 16-entry code maps and the packed quant-state headers
    assert 0.97 < written / preflight._bnb_export_bytes(_recipe({"format": "nf4"}),
                                                        skeleton) < 1.03


@pytest.mark.parametrize(("passes", "match"), [
    (["quantize.bnb", "quantize.int8_rtn"], r"cannot be combined with quantize.int8_rtn"),
    (["quantize.int4_rtn", "quantize.bnb"], r"cannot be combined with quantize.int4_rtn"),
    (["quantize.bnb", "rotate.hadamard"], r"quantize.bnb must be the last pass"),
    (["quantize.bnb", "quantize.bnb"], r"quantize.bnb must be the last pass"),
])
def test_recipes_that_hand_bnb_layers_on_are_refused_before_any_work(passes, match):
    with pytest.raises(RecipeError, match=match):
        parse_recipe({"name": "t", "passes": [{"pass": p} for p in passes]})


def test_streamed_bnb_before_another_pass_is_refused_by_the_pass(tmp_path):
    """A direct caller streaming quantize.bnb with no export sink (a later pass would read the
    layers from scratch files) is refused before any layer is read."""
    from compress.core.registry import CompressionState
    from compress.io.stream import StreamedModel, meta_skeleton
    from compress.quant.bnb import bnb_quantize

    folder = _checkpoint(tmp_path, make_tiny_llama())
    skeleton = meta_skeleton(folder)
    stream = StreamedModel(skeleton, CheckpointReader(folder), torch.float32,
                           skeleton.model.layers, "model.layers.", tmp_path / "scratch")
    with pytest.raises(RecipeError, match="must be the recipe's last pass.*move it last"):
        bnb_quantize(skeleton, _recipe({"format": "nf4"}).passes[0],
                     CompressionState(progress=False, stream=stream))
    assert stream.loads == 0


@pytest.mark.real
def test_streamed_smollm2_nf4_recipe_equals_in_memory(smollm2, tmp_path, one_thread):
    """The shipped recipe on the real model (tied head, float32 cache), evaluation left out."""
    from compress.recipe import load_recipe
    from tests.conftest import REPO

    recipe = load_recipe(REPO / "recipes" / "smollm2-nf4-bnb.yaml",
                         ["eval.baseline=false", "eval.perplexity=null"])
    memory = run_job(recipe, out_dir=tmp_path / "mem", stream=False, progress=False)
    streamed = run_job(recipe, out_dir=tmp_path / "stream", stream=True, progress=False)
    assert streamed.payload["memory"]["streamed"]
    _assert_same_export(tmp_path, memory, streamed)
    assert len(streamed.payload["passes"][0]["changed"]) == 30 * 7
