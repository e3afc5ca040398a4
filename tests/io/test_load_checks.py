"""Loading checks what it reads: a NaN quantization scale, a truncated shard and a config.json
that no longer matches its tensors are each refused with one line naming the file, the tensor
and the fix, by ``load``, ``inspect``, ``eval`` and ``generate`` alike; the runtime refuses to
decode non-finite logits."""

from __future__ import annotations

import json
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


BREAKS = {"nan_scale": _nan_scale, "truncated": _truncated, "wrong_hidden": _wrong_hidden}


@pytest.mark.parametrize("kind", list(BREAKS))
def test_load_and_inspect_refuse_a_broken_checkpoint(kind, exported):
    message = BREAKS[kind](exported)
    with pytest.raises(ModelLoadError, match=message) as raised:
        load_model(str(exported))
    assert "\n" not in str(raised.value) and str(exported) in str(raised.value)
    with pytest.raises(ModelLoadError, match=message):
        inspect_checkpoint(exported)


def test_plain_checkpoint_with_a_mismatched_config_is_one_line(tiny_model, tmp_path):
    folder = tmp_path / "plain"
    tiny_model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"model.safetensors: tensor model.layers.0.mlp"
                                             r".* but config.json implies .*96"):
        load_model(str(folder))


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_cli_refuses_a_nan_scale_with_one_line(command, exported, tmp_path):
    message = _nan_scale(exported)
    argv = (["eval", str(exported), "--limit", "1"] if command == "eval"
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
