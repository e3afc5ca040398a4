"""The recipe's ``device`` key and where a job puts it (issue 34): validation and round trip,
``run_job`` setting ``CompressionState.device``, results naming the device and dtype."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import compress.core.device as device_mod
from compress.core.errors import RecipeError
from compress.pipeline.job import evaluate_perplexity, recipe_state, run_job
from compress.quant.rtn import Int4RtnConfig
from compress.recipe import PerplexityConfig, Recipe, parse_recipe

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answers")


@pytest.mark.parametrize("spec", ["auto", "cpu", "cuda", "cuda:1"])
def test_device_key_parses_and_round_trips(spec):
    recipe = parse_recipe(f"name: r\ndevice: '{spec}'\npasses: []\n")
    assert recipe.device == spec
    assert parse_recipe(recipe.to_yaml()) == recipe
    assert ("device" in recipe.to_dict()) == (spec != "auto"), "the default stays out of YAML"


def test_bad_device_is_a_recipe_error_naming_the_forms():
    with pytest.raises(RecipeError, match=r"<recipe>: device='gpu' is not a device: write auto"):
        parse_recipe("name: r\ndevice: gpu\n")
    with pytest.raises(RecipeError, match="device='gpu'"):
        Recipe(device="gpu")


def test_the_job_state_gets_the_recipe_device(monkeypatch):
    """run_job's passes run on the recipe's device (it used to be the CPU whatever the host)."""
    monkeypatch.setattr(device_mod, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert recipe_state(Recipe(device="auto"), None).device == torch.device("cuda", 0)
    assert recipe_state(Recipe(device="cpu"), None).device == torch.device("cpu")


@no_gpu
def test_cuda_on_a_cpu_host_fails_before_any_work(tmp_path):
    out = tmp_path / "out"
    recipe = Recipe(name="r", device="cuda", passes=[Int4RtnConfig()])
    with pytest.raises(RecipeError, match="CUDA is not available"):
        run_job(recipe, model=str(tmp_path / "no-such-model"), out_dir=out)
    assert not out.exists()


def test_perplexity_result_names_its_device_and_dtype(tiny_model, tiny_tokenizer, tmp_path,
                                                      monkeypatch):
    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path))
    recipe = Recipe(device="cpu")
    recipe = dataclasses.replace(recipe, eval=recipe.eval.model_copy(
        update={"perplexity": PerplexityConfig(context_length=16, limit=2)}))
    result = evaluate_perplexity(tiny_model, tiny_tokenizer, recipe, "hello world " * 20, "text",
                                 False, label="ppl", resume=False)
    assert result.protocol["device"] == "cpu" and result.protocol["dtype"] == "float32"


@pytest.mark.parametrize("command", ["run", "sweep", "tune", "eval", "compare", "generate"])
def test_every_command_that_computes_takes_device(command, capsys):
    from compress.cli import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "--device DEVICE" in capsys.readouterr().out


def test_device_flag_replaces_the_recipes_key():
    from compress.cli import _with_device

    recipe = Recipe(device="cpu")
    assert _with_device(recipe, None) is recipe
    assert _with_device(recipe, "cuda:1").device == "cuda:1"
    with pytest.raises(RecipeError, match="device='gpu'"):
        _with_device(recipe, "gpu")


@no_gpu
@pytest.mark.parametrize("argv", [
    ["eval", "no-such-model", "--device", "cuda"],
    ["generate", "hi", "--model", "no-such-model", "--device", "cuda:0"],
    ["compare", "no-such-model", "other", "--device", "cuda", "--no-latency"],
], ids=["eval", "generate", "compare"])
def test_cuda_flag_on_a_cpu_host_fails_before_loading(argv, capsys, tmp_path, monkeypatch):
    from compress.cli import main

    monkeypatch.chdir(tmp_path)
    assert main([*argv, *(["--out", str(tmp_path / "o")] if argv[0] == "compare" else [])]) == 2
    err = capsys.readouterr().err
    assert "--device: cuda" in err and "CUDA is not available" in err
    assert "no-such-model" not in err, "the device is checked before the model is looked up"
