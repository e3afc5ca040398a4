"""Loading checks what it reads: a NaN quantization scale, a truncated shard and a config.json
that no longer matches its tensors are each refused with one line naming the file, the tensor
and the fix, by ``load``, ``inspect``, ``eval`` and ``generate`` alike; the runtime refuses to
decode non-finite logits."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from compress.core.errors import ModelLoadError, NumericsError
from compress.core.registry import CompressionState, run_passes
from compress.io.export import export_checkpoint
from compress.io.inspect import inspect_checkpoint
from compress.io.load import load_model
from compress.quant.rtn import Int4RtnConfig


@pytest.fixture
def exported(tiny_model, tiny_tokenizer, tmp_path):
    run_passes(tiny_model, [Int4RtnConfig(group_size=32)], CompressionState(progress=False))
    return export_checkpoint(tiny_model, tiny_tokenizer, tmp_path / "ckpt")


def _nan_scale(folder):
    file = folder / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.1.mlp.down_proj.weight_scale"][0, 0] = float("nan")
    save_file(tensors, file, metadata={"format": "pt"})
    return "model.layers.1.mlp.down_proj.weight_scale holds NaN"


def _truncated(folder):
    file = folder / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) * 2 // 3])
    return "model.safetensors: corrupt or partially written"


def _wrong_hidden(folder):
    config = json.loads((folder / "config.json").read_text())
    config["hidden_size"] = 96
    config["head_dim"] = 24
    (folder / "config.json").write_text(json.dumps(config))
    return r"has shape \[.*\] but config.json implies \[.*\]; the config does not match"


def _group_size(folder):
    config = json.loads((folder / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["weights"]["group_size"] = 100
    (folder / "config.json").write_text(json.dumps(config))
    return "quantization_config does not fit layer .*group_size 100 does not divide"


def _groups_malformed(folder):
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["config_groups"] = {"group_0": ["Linear"]}
    (folder / "config.json").write_text(json.dumps(config))
    return "config_groups.group_0 needs a targets list and a weights object"


def _int_dense(folder):  # a float tensor of a compressed checkpoint stored as integers
    file = folder / "model.safetensors"
    tensors = load_file(file)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int8)
    save_file(tensors, file, metadata={"format": "pt"})
    return "model.norm.weight is stored as torch.int8 .* nothing beside it scales"


BREAKS = {"nan_scale": _nan_scale, "truncated": _truncated, "wrong_hidden": _wrong_hidden,
          "groups_malformed": _groups_malformed, "integer_dense": _int_dense}


@pytest.mark.parametrize("kind", list(BREAKS))
def test_load_and_inspect_refuse_a_broken_checkpoint(kind, exported):
    message = BREAKS[kind](exported)
    with pytest.raises(ModelLoadError, match=message) as raised:
        load_model(str(exported))
    assert "\n" not in str(raised.value) and str(exported) in str(raised.value)
    with pytest.raises(ModelLoadError, match=message):
        inspect_checkpoint(exported)


def test_a_group_size_the_layers_cannot_take_is_refused_at_load(exported):
    # (inspect reads the headers only and reports the group size as configured)
    with pytest.raises(ModelLoadError, match=_group_size(exported)):
        load_model(str(exported))


def test_plain_checkpoint_with_a_mismatched_config_is_one_line(tiny_model, tmp_path):
    folder = tmp_path / "plain"
    tiny_model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"model.safetensors: tensor model.layers.0.mlp"
                                             r".* but config.json implies .*96"):
        load_model(str(folder))


CONFIG_VALUES = [  # (a change to a saved tiny Llama's config.json, what the refusal names)
    (lambda c: c["rope_parameters"].update(rope_theta=0.0), "rope_parameters.rope_theta is 0.0"),
    (lambda c: c["rope_parameters"].update(rope_theta=-5e5), "rope_theta is -500000.0"),
    (lambda c: c.update(rms_norm_eps=-1e-6), "rms_norm_eps is -1e-06"),
    (lambda c: c.update(rms_norm_eps=float("nan")), "rms_norm_eps is nan"),
    (lambda c: c.update(sliding_window=0), "sliding_window is 0.0"),
    (lambda c: c.update(swiglu_limit=float("nan")), "swiglu_limit is nan"),  # GPT-OSS's clamp
]


@pytest.mark.parametrize(("change", "named"), CONFIG_VALUES,
                         ids=["theta-zero", "theta-negative", "eps-negative", "eps-nan",
                              "window-zero", "clamp-nan"])
def test_a_config_value_no_model_computes_with_is_named_at_load(change, named, plain):
    """A RoPE base of 0 or below, or a negative or NaN norm epsilon, is refused where the
    config is read, by the whole load and the header-only inspect alike, naming the key; it
    used to reach the first forward and be reported as NaN logits blamed on the weights."""
    config = json.loads((plain / "config.json").read_text())
    change(config)
    (plain / "config.json").write_text(json.dumps(config))  # json writes nan as NaN
    for read in (load_model, inspect_checkpoint):
        with pytest.raises(ModelLoadError, match=re.escape(named)):
            read(str(plain) if read is load_model else plain)


def test_a_window_of_zero_that_is_switched_off_is_not_refused(plain):
    """Qwen2-MoE's default config holds sliding_window 0 under use_sliding_window false."""
    config = json.loads((plain / "config.json").read_text())
    config.update(sliding_window=0, use_sliding_window=False)
    (plain / "config.json").write_text(json.dumps(config))
    assert load_model(str(plain)).model is not None


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_cli_refuses_a_nan_scale_with_one_line(command, exported, tmp_path):
    message = _nan_scale(exported)
    argv = (["eval", str(exported), "--limit", "1", "--context-length", "64"] if command == "eval"
            else ["generate", "hello", "--model", str(exported), "--max-new-tokens", "2"])
    proc = subprocess.run([sys.executable, "-m", "compress.cli", *argv], capture_output=True,
                          text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in proc.stderr
    assert "tokens/s" not in proc.stdout


def test_runtime_refuses_non_finite_logits(tiny_model):
    from compress.runtime.engine import Runtime

    with torch.no_grad():
        tiny_model.model.norm.weight[3] = float("nan")  # every logit becomes NaN
    runtime = Runtime(tiny_model, max_seq_len=32, max_batch_size=1)
    with pytest.raises(NumericsError, match="logits hold NaN or Inf"):
        runtime.generate([[1, 5, 9]], 4)


def _plain_tensors(edit):
    def brk(folder):
        file = folder / "model.safetensors"
        tensors = load_file(file)
        message = edit(tensors)
        save_file(tensors, file, metadata={"format": "pt"})
        return message
    return brk


def _config_text(text, message):
    def brk(folder):
        (folder / "config.json").write_text(text(json.loads((folder / "config.json").read_text())))
        return message
    return brk


def _drop(tensors):
    del tensors["model.layers.1.mlp.down_proj.weight"]
    return r"missing \['model.layers.1.mlp.down_proj.weight'\]"


def _extra(tensors):
    tensors["model.layers.7.mlp.extra.weight"] = torch.zeros(3)
    return r"unexpected \['model.layers.7.mlp.extra.weight'\]"


def _int_norm(tensors):
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int8)
    return "model.norm.weight is stored as torch.int8 but the model's parameter is floating"


# A float checkpoint broken as downloads and hand edits break them: transformers would fill a
# missing weight with random values or drop an unknown one with a warning, and convert integer
# weights; each is one line naming the file and the fix instead.
PLAIN_BREAKS = {
    "missing_tensor": _plain_tensors(_drop),
    "unexpected_tensor": _plain_tensors(_extra),
    "integer_weight": _plain_tensors(_int_norm),
    "config_not_json": _config_text(lambda c: "{not json", "config.json cannot be read"),
    "quantization_config_not_object": _config_text(
        lambda c: json.dumps({**c, "quantization_config": "int4"}),
        "quantization_config is a str, not an object"),
    "heads_do_not_divide": _config_text(  # transformers 5: a strict-dataclass validator's error
        lambda c: json.dumps({**c, "num_attention_heads": 3}), "config.json"),
    "negative_vocab": _config_text(  # an assertion inside the embedding's constructor
        lambda c: json.dumps({**c, "vocab_size": -5}), "config.json"),
}


@pytest.mark.parametrize("kind", list(PLAIN_BREAKS))
def test_a_broken_float_checkpoint_is_refused_in_one_line(kind, tiny_model, tiny_tokenizer,
                                                          tmp_path):
    folder = tmp_path / "plain"
    tiny_model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    load_model(str(folder))  # loads before the break
    message = PLAIN_BREAKS[kind](folder)
    with pytest.raises(ModelLoadError, match=message) as raised:
        load_model(str(folder))
    assert "\n" not in str(raised.value) and str(folder) in str(raised.value)


def test_a_folder_without_a_usable_tokenizer_is_refused(tiny_model, tiny_tokenizer, tmp_path):
    folder = tmp_path / "plain"
    tiny_model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    (folder / "tokenizer.json").write_bytes(b"\x00\xff not json")
    with pytest.raises(ModelLoadError, match="its tokenizer cannot be loaded .* copy them in"):
        load_model(str(folder))


def test_perplexity_of_a_model_computing_nan_is_an_error(tiny_model, tiny_tokenizer):
    from compress.eval.quality import perplexity

    text = "the quick brown fox jumps over the lazy dog. " * 8
    assert perplexity(tiny_model, tiny_tokenizer, text, context_length=32, progress=False)
    with torch.no_grad():
        tiny_model.model.norm.weight[3] = float("inf")
    with pytest.raises(NumericsError, match="window 0: the model's loss is nan"):
        perplexity(tiny_model, tiny_tokenizer, text, context_length=32, progress=False)
