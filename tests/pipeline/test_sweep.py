"""``compress sweep``: several recipes against one baseline give the rows ``compress run`` gives
each recipe alone, finished rows are saved and read back on a rerun, and recipes that cannot
share a baseline are refused before any work."""

from __future__ import annotations

import json

import pytest
import yaml

from compress.cli import main
from compress.core.errors import RecipeError
from compress.pipeline import sweep as sweep_module
from compress.pipeline.job import run_job
from compress.pipeline.sweep import run_sweep
from compress.recipe import load_recipe


@pytest.fixture
def inputs(tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = tmp_path / "tiny"
    tiny_model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    evaluation = {"perplexity": {"dataset": str(text), "context_length": 64, "limit": 4}}
    recipes = []
    for name, step in [("w4", {"pass": "quantize.int4_rtn", "group_size": 32}),
                       ("w8", {"pass": "quantize.int8_rtn"})]:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"name": name, "model": str(model_dir),
                                        "passes": [step], "eval": evaluation}))
        recipes.append(path)
    return model_dir, recipes, tmp_path


def test_rows_equal_each_recipe_run_alone(inputs):
    model_dir, paths, tmp_path = inputs
    recipes = [load_recipe(p) for p in paths]
    result = run_sweep(recipes, out_dir=tmp_path / "sweep", progress=False)
    rows = {row["variant"]: row for row in result.rows}
    for recipe in recipes:
        alone = run_job(recipe, out_dir=tmp_path / f"run-{recipe.name}", progress=False)
        base, compressed = alone.rows
        assert rows[recipe.name]["perplexity"] == pytest.approx(compressed["perplexity"], rel=1e-6)
        assert rows[recipe.name]["ppl_delta_pct"] == pytest.approx(compressed["ppl_delta_pct"])
        assert result.rows[0]["perplexity"] == pytest.approx(base["perplexity"], rel=1e-6)
        assert rows[recipe.name]["kl"] == pytest.approx(compressed["kl"], rel=1e-6)
        assert rows[recipe.name]["top1_changed_pct"] == compressed["top1_changed_pct"]
        assert base["kl"] == 0.0 and alone.payload["eval"]["compressed"]["kl"]["top_k"] == 32
    assert result.rows[0]["kl"] == 0.0 and result.rows[0]["top1_changed_pct"] == 0.0
    assert 0 < rows["w8"]["kl"] < rows["w4"]["kl"]  # 8-bit rounding moves the outputs less
    assert rows["w4"]["bits_per_weight"] == pytest.approx(4.5)  # int4 + one fp16 scale per 32
    assert rows["w8"]["bits_per_weight"] > 8
    saved = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [r["variant"] for r in saved["rows"]] == [r["variant"] for r in result.rows]
    assert "| w4 |" in (tmp_path / "sweep" / "sweep.md").read_text()


def test_finished_rows_are_read_back_not_recomputed(inputs, monkeypatch):
    _, paths, tmp_path = inputs
    recipes = [load_recipe(p) for p in paths]
    first = run_sweep(recipes, out_dir=tmp_path / "sweep", progress=False)

    def must_not_run(*args, **kwargs):
        raise AssertionError("a finished row ran its passes again")

    monkeypatch.setattr(sweep_module, "run_passes", must_not_run)
    again = run_sweep(recipes, out_dir=tmp_path / "sweep", progress=False)
    assert [r["perplexity"] for r in again.rows] == [r["perplexity"] for r in first.rows]
    assert [r["kl"] for r in again.rows] == [r["kl"] for r in first.rows]
    # a changed recipe is a new row: it runs (and here hits the spy)
    changed = [recipes[0], load_recipe(paths[1], ["passes.0.symmetric=false"])]
    with pytest.raises(AssertionError, match="ran its passes again"):
        run_sweep(changed, out_dir=tmp_path / "sweep", progress=False)


def test_recipes_that_cannot_share_a_baseline_are_refused_before_work(inputs, monkeypatch):
    _, paths, tmp_path = inputs
    w4, w8 = load_recipe(paths[0]), load_recipe(paths[1], ["eval.perplexity.limit=2"])
    monkeypatch.setattr(sweep_module, "load_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(RecipeError, match="same settings"):
        run_sweep([w4, w8], out_dir=tmp_path / "sweep", progress=False)
    with pytest.raises(RecipeError, match="names must differ"):
        run_sweep([w4, w4], out_dir=tmp_path / "sweep", progress=False)


def test_cli_sweep_prints_the_table(inputs, capsys):
    _, paths, tmp_path = inputs
    out = tmp_path / "cli-sweep"
    assert main(["sweep", *map(str, paths), "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "| baseline" in printed and "| w4 |" in printed and "| w8 |" in printed
    assert "| KL | top-1 changed % |" in printed and "top-32 log-probs" in printed
    assert main(["sweep", *map(str, paths), "--out", str(out), "--no-progress",
                 "--kl-top-k", "0"]) == 0
    assert "top-32" not in capsys.readouterr().out  # no KL: no footnote, empty columns


def test_latency_columns_come_from_the_runtime_for_every_row(inputs, monkeypatch):
    """A recipe's eval.latency adds TTFT/TPOT columns, timed through the runtime (the engine
    column says so), for the baseline and each row: what scripts/bench_quant.py used to add."""
    model_dir, paths, tmp_path = inputs
    latency = {"prompts": 1, "prompt_tokens": 8, "output_tokens": 4}
    recipes = [load_recipe(p, [f"eval.latency={json.dumps(latency)}"]) for p in paths]
    result = run_sweep(recipes, out_dir=tmp_path / "sweep-latency", progress=False)
    for row in result.rows:
        assert row["engine"] == "runtime"
        assert row["tpot_p50_ms"] > 0 and row["ttft_p50_ms"] > 0
    assert "TPOT p50 ms" in result.markdown
    # a rerun reads the rows back and still shows their latency columns
    again = run_sweep(recipes, out_dir=tmp_path / "sweep-latency", progress=False)
    assert "TPOT p50 ms" in again.markdown
    assert again.rows[1]["tpot_p50_ms"] == result.rows[1]["tpot_p50_ms"]
