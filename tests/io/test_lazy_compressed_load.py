"""``load_compressed`` reads a compressed checkpoint module by module from its shards and keeps
the large dense tensors (embedding, unquantized output head) in the checkpoint's bf16, widening
them only while their module runs. Against the reference that reads every tensor at once and
casts it to float32 (``_load_whole``): the same logits bit for bit, in every tiny family
(Gemma's scaled embedding included), tied and untied heads, through transformers' forward and
through our runtime, and on a GPU-style cast to bf16 and back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from compress.core.device import float_dtype, move_tensors, restore_tensors
from compress.core.registry import CompressionState, run_passes
from compress.io import export as export_module
from compress.io import stream as stream_module
from compress.io.export import _load_whole, export_checkpoint, load_compressed
from compress.quant.linear import QuantLinear
from compress.quant.rtn import Int4RtnConfig
from compress.testing import TINY_MODEL_TYPES, make_char_tokenizer, make_tiny_model

IDS = torch.tensor([[1, 40, 41, 42, 43, 50, 60, 70, 80, 90, 3, 4, 5, 6, 7, 8, 9, 10],
                    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]])


@pytest.fixture
def keep_small_tensors_stored(monkeypatch):
    """The tiny models' embeddings are 40 KB: lower the size rule so they take the stored path."""
    monkeypatch.setattr(stream_module, "KEEP_STORED_BYTES", 0)


def _export(model, tmp_path, name="ckpt", **kwargs):
    run_passes(model, [Int4RtnConfig(group_size=32, **kwargs)], CompressionState(progress=False))
    return export_checkpoint(model, make_char_tokenizer(), tmp_path / name, dtype="bfloat16")


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("model_type", TINY_MODEL_TYPES)
def test_module_by_module_load_matches_the_whole_fp32_read(model_type, tmp_path,
                                                           keep_small_tensors_stored):
    folder = _export(make_tiny_model(model_type), tmp_path)
    lazy = load_compressed(folder).eval()
    whole = _load_whole(folder, export_module._quantization_config(folder), torch.float32,
                        "auto").eval()
    embed = lazy.get_input_embeddings().weight
    assert embed.dtype == torch.bfloat16  # kept as stored, not widened
    assert whole.get_input_embeddings().weight.dtype == torch.float32
    assert float_dtype(lazy) == torch.float32  # what reports say it computes in
    assert any(isinstance(m, QuantLinear) for m in lazy.modules())
    reference = _logits(whole)
    got = _logits(lazy)
    assert got.dtype == torch.float32
    assert torch.equal(got, reference)
    # nothing widened stays behind after a forward call
    assert all(p.dtype == torch.bfloat16 for m in lazy.modules() if hasattr(m, "_compute_dtype")
               for p in m._parameters.values() if p is not None and p.is_floating_point())


def test_untied_dense_head_stays_bf16_and_matches(tmp_path, keep_small_tensors_stored):
    """An untied output head left out of quantization: a dense bf16 Linear widened per call."""
    model = make_tiny_model("qwen2", tie_word_embeddings=False)
    folder = _export(model, tmp_path, ignore=["lm_head"])
    lazy = load_compressed(folder).eval()
    head = lazy.get_output_embeddings()
    assert type(head) is nn.Linear and head.weight.dtype == torch.bfloat16
    whole = _load_whole(folder, export_module._quantization_config(folder), torch.float32, "auto")
    assert torch.equal(_logits(lazy), _logits(whole.eval()))


def test_runtime_decodes_the_same_tokens(tmp_path, keep_small_tensors_stored):
    from compress.runtime.engine import Runtime

    folder = _export(make_tiny_model("llama"), tmp_path)
    runs = []
    for model in (load_compressed(folder), _load_whole(
            folder, export_module._quantization_config(folder), torch.float32, "auto")):
        runtime = Runtime(model.eval(), max_seq_len=64, compile=False)
        assert runtime.prefill_dtype == torch.float32  # the compute dtype, not the stored one
        runs.append(runtime.generate(IDS[:1].tolist(), 12))
    assert runs[0] == runs[1]


def test_gpu_style_cast_follows_and_restores(tmp_path, keep_small_tensors_stored):
    """``move_tensors(..., dtype=bf16)`` (what a GPU evaluation does) makes the model compute in
    bf16; ``restore_tensors`` puts float32 compute back, bit for bit."""
    folder = _export(make_tiny_model("llama"), tmp_path)
    lazy = load_compressed(folder).eval()
    before = _logits(lazy)
    replaced = move_tensors(lazy, torch.device("cpu"), torch.bfloat16)
    assert float_dtype(lazy) == torch.bfloat16
    assert _logits(lazy).dtype == torch.bfloat16
    restore_tensors(replaced)
    assert float_dtype(lazy) == torch.float32
    assert torch.equal(_logits(lazy), before)


def test_size_rule_casts_small_tensors(tmp_path):
    """With the shipped threshold (1 MiB) the tiny model's 40 KB embedding is cast once."""
    folder = _export(make_tiny_model("llama"), tmp_path)
    lazy = load_compressed(folder)
    assert lazy.get_input_embeddings().weight.dtype == torch.float32
    assert not any(hasattr(m, "_compute_dtype") for m in lazy.modules())


def test_a_stray_tensor_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from compress.core.errors import ModelLoadError

    folder = _export(make_tiny_model("llama"), tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"unexpected \['model.layers.0.extra.weight'\]"):
        load_compressed(folder)


@pytest.mark.parametrize("stored_rule", ["shipped", "all_stored"])
def test_preflight_counts_what_the_load_holds(tmp_path, monkeypatch, stored_rule):
    """``whole_load_bytes`` (the eval/generate memory preflight) from the headers alone equals
    the bytes of the tensors the loaded model holds (each storage once: tied weights share)."""
    from compress.pipeline import preflight

    if stored_rule == "all_stored":
        monkeypatch.setattr(stream_module, "KEEP_STORED_BYTES", 0)
    folder = _export(make_tiny_model("qwen2", tie_word_embeddings=False), tmp_path,
                     ignore=["lm_head"])
    model = load_compressed(folder)
    held = {}
    for tensor in model.state_dict().values():
        held[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    want = preflight.BASE_BYTES + int(sum(held.values()) * preflight.LOAD_FACTOR)
    assert preflight.whole_load_bytes(folder) == want


@pytest.mark.real
def test_smollm2_w4_bf16_export_loads_narrow_with_the_same_logits(smollm2, tmp_path):
    """The real model: its tied 49152 x 576 embedding stays bf16 (56 MB instead of 113 MB in
    float32) and the loaded W4 export gives the whole-fp32 read's logits bit for bit."""
    import copy

    from compress.quant.linear import QuantLinear as QL  # noqa: N817

    model = copy.deepcopy(smollm2.model)
    run_passes(model, [Int4RtnConfig(group_size=64)], CompressionState(progress=False))
    folder = export_checkpoint(model, smollm2.tokenizer, tmp_path / "w4", dtype="bfloat16")
    del model
    lazy = load_compressed(folder).eval()
    assert lazy.get_input_embeddings().weight.dtype == torch.bfloat16
    assert sum(isinstance(m, QL) for m in lazy.modules()) == 30 * 7
    ids = smollm2.tokenizer("The capital of France is Paris. The capital of Italy is",
                            return_tensors="pt").input_ids
    with torch.no_grad():
        got = lazy(ids).logits
        whole = _load_whole(folder, export_module._quantization_config(folder), torch.float32,
                            "auto").eval()
        assert torch.equal(got, whole(ids).logits)


@pytest.mark.parametrize("experts", ["quantized", "float"])
@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_an_moe_export_loads_module_by_module_as_the_whole_read(model_type, experts, tmp_path,
                                                                monkeypatch):
    """An MoE export stores one weight per expert (Mixtral's block renamed): quantized experts
    load as ``QuantExperts``, float ones stacked into the fused tensors one module at a time,
    with the logits of the whole read (``_load_whole``, which fused every layer at once)."""
    from compress.quant.linear import QuantExperts
    from compress.testing import make_tiny_moe

    ignore = ["lm_head"] + (["re:.*mlp\\.experts$"] if experts == "float" else [])
    folder = _export(make_tiny_moe(model_type, tie_word_embeddings=False), tmp_path,
                     ignore=ignore)
    def whole_read(*args):
        raise AssertionError("load_compressed read the MoE export whole")

    monkeypatch.setattr(export_module, "_load_whole", whole_read)
    lazy = load_compressed(folder).eval()
    held = [m for m in lazy.modules() if isinstance(m, QuantExperts)]
    assert len(held) == (2 if experts == "quantized" else 0)
    whole = _load_whole(folder, export_module._quantization_config(folder), torch.float32,
                        "auto").eval()
    assert torch.equal(_logits(lazy), _logits(whole))


def test_models_built_from_a_config_come_back_in_eval_mode(tmp_path):
    """The streamed job's skeleton and both readers of an export build the model from its
    config, which transformers builds training: OPT's dropout 0.1 then changed every forward
    (streamed calibration, the reloaded model's logits). Each comes back in eval mode, as
    from_pretrained's does, and two forwards agree."""
    model = make_tiny_model("opt", dropout=0.1)
    assert model.config.dropout == 0.1
    folder = _export(model, tmp_path)
    skeleton = stream_module.meta_skeleton(folder)
    for built in (skeleton, load_compressed(folder), _load_whole(
            folder, export_module._quantization_config(folder), torch.float32, "auto")):
        assert not any(m.training for m in built.modules())
    loaded = load_compressed(folder)
    torch.testing.assert_close(_logits(loaded), _logits(loaded), rtol=0, atol=0)
