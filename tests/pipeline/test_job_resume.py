"""``compress run`` on the tiny model: the baseline's perplexity is saved before the compressed
model is evaluated, a rerun skips it and gives the same table; the shipped recipes score a
sample of windows unless ``--full-eval``; exports write dense tensors in bfloat16 by default."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

import compress.pipeline.job
from compress.cli import main
from compress.io.export import load_compressed, resolve_export_dtype
from compress.pipeline.job import run_job, with_full_eval
from compress.recipe import load_recipe, parse_recipe

RECIPE = {
    "name": "tiny-w4",
    "passes": [{"pass": "quantize.int4_rtn", "group_size": 32}],
}


@pytest.fixture
def job_inputs(tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    """(model dir, recipe) with an 8-window text; the cache (perplexity states) under tmp_path."""
    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = tmp_path / "tiny"
    tiny_model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 10)
    recipe = parse_recipe({
        **RECIPE, "eval": {"perplexity": {"dataset": str(text), "context_length": 64, "limit": 4}}
    })
    return model_dir, recipe


def _scored(monkeypatch) -> list[str]:
    """Record which evaluations actually ran the model (by progress-bar label)."""
    from compress.eval import quality

    ran: list[str] = []
    real = quality._score_windows

    def spy(*args, desc, **kwargs):
        ran.append(desc.split(" (")[0])
        return real(*args, desc=desc, **kwargs)

    monkeypatch.setattr(quality, "_score_windows", spy)
    return ran


def test_baseline_is_saved_before_the_compressed_eval_and_reused(job_inputs, tmp_path,
                                                                 monkeypatch):
    model_dir, recipe = job_inputs
    fresh = run_job(recipe, model=str(model_dir), out_dir=tmp_path / "fresh", progress=False)
    shutil.rmtree(tmp_path / "cache" / "perplexity")  # start again from nothing saved

    def crash(*args, **kwargs):
        raise RuntimeError("killed during the passes")

    with monkeypatch.context() as patch:
        patch.setattr(compress.pipeline.job, "run_passes", crash)
        with pytest.raises(RuntimeError, match="killed"):
            run_job(recipe, model=str(model_dir), out_dir=tmp_path / "out", progress=False)
    states = [json.loads(p.read_text()) for p in (tmp_path / "cache" / "perplexity").glob("*")]
    assert [len(s["window_nll"]) for s in states] == [4]  # the baseline, complete

    ran = _scored(monkeypatch)
    rerun = run_job(recipe, model=str(model_dir), out_dir=tmp_path / "out", progress=False)
    assert ran == ["compressed perplexity"]  # the baseline was not recomputed
    assert rerun.payload["eval"]["baseline"]["reused_windows"] == 4
    assert [r["perplexity"] for r in rerun.rows] == [r["perplexity"] for r in fresh.rows]
    assert rerun.payload["eval"]["baseline"]["protocol"] == fresh.payload["eval"]["baseline"][
        "protocol"]
    again = run_job(recipe, model=str(model_dir), out_dir=tmp_path / "out", progress=False)
    assert ran == ["compressed perplexity"]  # the third run recomputed nothing
    assert again.rows[1]["perplexity"] == fresh.rows[1]["perplexity"]


def test_table_states_the_sample(job_inputs, tmp_path):
    model_dir, recipe = job_inputs
    result = run_job(recipe, model=str(model_dir), out_dir=tmp_path / "out", progress=False)
    assert "the first 4 of its 8 windows (a sample; `--full-eval` scores them all)" in (
        result.markdown)
    assert "252 scored tokens" in result.markdown  # 4 windows x 63 scored tokens
    baseline = result.payload["eval"]["baseline"]
    assert baseline["windows"] == 4 and baseline["scored_tokens"] == 252
    full = run_job(with_full_eval(recipe), model=str(model_dir), out_dir=tmp_path / "full",
                   progress=False)
    assert "all 8 windows" in full.markdown
    assert full.payload["eval"]["compressed"]["protocol"]["limit"] is None


def test_shipped_recipes_score_a_sample_and_export_auto():
    from pathlib import Path

    for path in sorted(Path("recipes").glob("*.yaml")):
        recipe = load_recipe(path)
        assert recipe.eval.perplexity.limit is not None, path
        assert recipe.export.dtype == ("float32" if "bnb" in path.name else "auto"), path
    main_recipe = "recipes/smollm2-w4g128-rtn.yaml"
    assert load_recipe(main_recipe).eval.perplexity.limit == 16
    assert with_full_eval(load_recipe(main_recipe)).eval.perplexity.limit is None
    unset = load_recipe(main_recipe, ["eval.perplexity.limit=null"])
    assert unset.eval.perplexity.limit is None
    assert "limit: null" in with_full_eval(load_recipe(main_recipe)).to_yaml()


def test_cli_full_eval_flag(job_inputs, tmp_path, capsys):
    model_dir, recipe = job_inputs
    path = tmp_path / "r.yaml"
    path.write_text(recipe.to_yaml())
    out = tmp_path / "out"
    assert main(["run", str(path), "--model", str(model_dir), "--out", str(out), "--no-progress",
                 "--full-eval"]) == 0
    assert "all 8 windows" in capsys.readouterr().out
    assert yaml.safe_load((out / "recipe.yaml").read_text())["eval"]["perplexity"]["limit"] is None


def test_export_writes_dense_tensors_in_bfloat16_by_default(job_inputs, tmp_path):
    model_dir, recipe = job_inputs
    assert recipe.export.dtype == "auto"
    out = run_job(recipe, model=str(model_dir), out_dir=tmp_path / "out", progress=False).out_dir
    tensors = load_file(out / "model.safetensors")
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert tensors["model.norm.weight"].dtype == torch.bfloat16
    scale = tensors["model.layers.0.mlp.down_proj.weight_scale"]
    assert scale.dtype == torch.float16  # quantization scales keep their own dtype
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = load_compressed(out)
    assert reloaded.model.embed_tokens.weight.dtype == torch.float32  # upcast on load


@pytest.mark.parametrize(
    "stored, asked, expected",
    [("float16", "auto", "float16"), ("bfloat16", "auto", "bfloat16"),
     ("float32", "auto", "bfloat16"), (None, "auto", "bfloat16"),
     ("float16", "float32", "float32")],
)
def test_resolve_export_dtype(tmp_path, stored, asked, expected):
    if stored:
        (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": stored}))
    assert resolve_export_dtype(asked, tmp_path) == expected
    assert resolve_export_dtype("auto", "HuggingFaceTB/some-hub-id") == "bfloat16"


def test_interrupted_run_says_how_to_resume(job_inputs, tmp_path, capsys, monkeypatch):
    model_dir, recipe = job_inputs
    path = tmp_path / "r.yaml"
    path.write_text(recipe.to_yaml())

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(compress.pipeline.job, "run_job", interrupted)
    assert main(["run", str(path), "--model", str(model_dir), "--no-progress"]) == 130
    assert "run the same command again to resume" in capsys.readouterr().err
