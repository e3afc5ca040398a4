"""``compress sweep``: several recipes against one baseline give the rows ``compress run`` gives
each recipe alone, finished rows are saved and read back on a rerun, and recipes that cannot
share a baseline are refused before any work."""

from __future__ import annotations

import copy
import gc
import json

import pytest
import torch
import yaml

from compress.cli import main
from compress.core.errors import RecipeError
from compress.pipeline import job as job_module
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

    monkeypatch.setattr(job_module, "run_passes", must_not_run)  # jobs run the passes
    again = run_sweep(recipes, out_dir=tmp_path / "sweep", progress=False)
    assert [r["perplexity"] for r in again.rows] == [r["perplexity"] for r in first.rows]
    assert [r["kl"] for r in again.rows] == [r["kl"] for r in first.rows]
    # a changed recipe is a new row: it runs (and here hits the spy)
    changed = [recipes[0], load_recipe(paths[1], ["passes.0.symmetric=false"])]
    with pytest.raises(AssertionError, match="ran its passes again"):
        run_sweep(changed, out_dir=tmp_path / "sweep", progress=False)


def test_rows_from_another_device_are_not_reused(inputs, monkeypatch):
    """``device: auto`` is the CPU on one host and the GPU on another: a row computed on the
    CPU is recomputed where the recipes now resolve to a GPU (the settings name the devices)."""
    import torch

    from compress.pipeline import sweep as sweep_module

    _, paths, tmp_path = inputs
    recipes = [load_recipe(p) for p in paths]
    run_sweep(recipes, out_dir=tmp_path / "sweep", progress=False)

    def must_not_run(*args, **kwargs):
        raise AssertionError("a row ran its passes again")

    monkeypatch.setattr(job_module, "run_passes", must_not_run)
    monkeypatch.setattr(sweep_module, "resolve_device", lambda spec: torch.device("cuda", 0))
    with pytest.raises(AssertionError, match="ran its passes again"):
        run_sweep(recipes, out_dir=tmp_path / "sweep", progress=False)


def test_recipes_that_cannot_share_a_baseline_are_refused_before_work(inputs, monkeypatch):
    _, paths, tmp_path = inputs
    w4, w8 = load_recipe(paths[0]), load_recipe(paths[1], ["eval.perplexity.limit=2"])
    monkeypatch.setattr(job_module, "load_model", lambda *a, **k: pytest.fail("loaded"))
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


# ---- one orchestration (issue 31): each row is a job of compress.pipeline.job -------------
def _bf16_checkpoint(tmp_path):
    """The tiny model stored in bf16: its jobs stream (the export keeps the checkpoint's dtype,
    so the streamed job scores what the whole-model path scores)."""
    from compress.testing import make_char_tokenizer, make_tiny_llama

    folder = tmp_path / "tiny-bf16"
    make_tiny_llama().to(torch.bfloat16).save_pretrained(folder)
    make_char_tokenizer().save_pretrained(folder)
    return folder


def _live_models() -> list:
    """Causal LMs alive in this process with real (not meta) weights (GenerationMixin: the
    LlamaModel inside each is a PreTrainedModel too, not a second copy)."""
    from transformers import GenerationMixin

    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, GenerationMixin)
            and any(p.device.type != "meta" for p in o.parameters())]


def _old_loop_rows(recipes):
    """What sweep computed before it ran each recipe as a job: one model loaded, the baseline
    scored on it, each recipe's passes on a deep copy (the reference for the numbers)."""
    from compress.core.registry import run_passes
    from compress.io.load import load_model
    from compress.pipeline.job import evaluate_perplexity, recipe_state
    from compress.quant.linear import bits_per_weight, model_bytes

    loaded = load_model(recipes[0].model)
    text = recipes[0].eval.perplexity.dataset
    base = evaluate_perplexity(loaded.model, loaded.tokenizer, recipes[0], open(text).read(), text,
                               False, label="baseline perplexity", resume=False, top_k=32)
    rows = {}
    for recipe in recipes:
        variant = copy.deepcopy(loaded.model)
        run_passes(variant, recipe.passes, recipe_state(recipe, loaded.tokenizer, progress=False))
        result = evaluate_perplexity(variant, loaded.tokenizer, recipe, open(text).read(), text,
                                     False, label="x", resume=False, kl_base=base.top_k_path)
        rows[recipe.name] = {"perplexity": result.perplexity, "kl": result.kl.kl_mean,
                             "top1_changed_pct": result.kl.top1_changed_pct,
                             "bits_per_weight": bits_per_weight(variant),
                             "weight_mb": model_bytes(variant)["total"] / 1e6}
    return base.perplexity, rows


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
def test_rows_equal_the_old_shared_model_loop_exactly(inputs, stored, one_thread):
    """Each row a job (loaded afresh, streamed from the bf16 checkpoint) gives the numbers the
    old loop over deep copies of one loaded model gave, exactly; a calibrated GPTQ row too."""
    from compress.io import stream as stream_module

    model_dir, paths, tmp_path = inputs
    if stored == "bfloat16":
        model_dir = _bf16_checkpoint(tmp_path)
    cal = json.dumps({"source": str(tmp_path / "text.txt"), "num_samples": 2, "seq_len": 24})
    overrides = [f"model={model_dir}"]
    recipes = [load_recipe(p, overrides) for p in paths]
    recipes.append(load_recipe(paths[0], [*overrides, "name=gptq", f"calibration={cal}",
                                          'passes=[{"pass": "quantize.gptq", "group_size": 32}]']))
    layers = []
    original = stream_module.StreamedModel.load_layer

    def counted(self, index, *args, **kwargs):
        layers.append(index)
        return original(self, index, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stream_module.StreamedModel, "load_layer", counted)
        result = run_sweep(recipes, out_dir=tmp_path / "sweep", progress=False, resume=False)
    assert bool(layers) == (stored == "bfloat16")  # streamed exactly where a job can stream
    base, expected = _old_loop_rows(recipes)
    assert result.rows[0]["perplexity"] == base
    for row in result.rows[1:]:
        assert {k: row[k] for k in expected[row["variant"]]} == expected[row["variant"]]
    # a streamed row's scratch export is gone; only the tables were written
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir()) == [
        ".compress-output", "sweep.json", "sweep.md"]
    assert not list(tmp_path.glob(".sweep.*"))


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
def test_sweep_never_holds_two_copies_of_the_model(inputs, stored, monkeypatch, one_thread):
    """While a row's passes run and while it is scored, one model with real weights is alive
    (the old loop kept the loaded model beside each row's deep copy: two)."""
    model_dir, paths, tmp_path = inputs
    if stored == "bfloat16":
        model_dir = _bf16_checkpoint(tmp_path)
    recipes = [load_recipe(p, [f"model={model_dir}"]) for p in paths]
    seen = []
    run_passes, evaluate = job_module.run_passes, job_module.evaluate_perplexity
    before = {id(m) for m in _live_models()}  # the fixture's model, earlier tests' leftovers

    def count() -> int:
        return sum(1 for m in _live_models() if id(m) not in before)

    def passes(model, *args, **kwargs):
        seen.append(("passes", count()))
        return run_passes(model, *args, **kwargs)

    def scored(*args, **kwargs):
        seen.append(("eval", count()))
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(job_module, "run_passes", passes)
    monkeypatch.setattr(job_module, "evaluate_perplexity", scored)
    run_sweep(recipes, out_dir=tmp_path / "sweep", progress=False)
    assert {what for what, _ in seen} == {"passes", "eval"}
    # streamed, the passes run on a meta skeleton and scoring reads one layer at a time: no
    # model with real weights at all
    assert max(n for _, n in seen) == (1 if stored == "float32" else 0)


def test_preflight_refuses_an_impossible_sweep_before_any_work(inputs, monkeypatch):
    import compress.pipeline.preflight as preflight
    from compress.pipeline.preflight import InsufficientMemoryError

    _, paths, tmp_path = inputs
    monkeypatch.setattr(preflight, "available_memory_bytes", lambda: 10 * 2**20)
    monkeypatch.setattr(job_module, "load_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(InsufficientMemoryError, match=r"needs about .* GiB in its phase .* is "
                                                      r"available; nothing was written"):
        run_sweep([load_recipe(p) for p in paths], out_dir=tmp_path / "sweep", progress=False)
    assert not (tmp_path / "sweep").exists() and not list(tmp_path.glob(".sweep*"))


@pytest.mark.parametrize("document", [
    [{"settings": {"k": 1}, "rows": []}],
    {"settings": {"k": 1}, "rows": [5, "x"]},
    {"settings": {"k": 1}, "rows": [{"recipe": "r", "perplexity": float("nan")}]},
], ids=["not_an_object", "rows_not_objects", "nan_perplexity"])
def test_a_damaged_sweep_json_is_run_again_not_reported(document, tmp_path):
    # were an AttributeError, a TypeError, and a NaN row reported as measured
    from compress.pipeline.sweep import _load_previous

    (tmp_path / "sweep.json").write_text(json.dumps(document))
    assert _load_previous(tmp_path / "sweep.json", {"k": 1}) == {}
    good = {"settings": {"k": 1}, "rows": [{"recipe": "r", "perplexity": 3.5, "kl": None}]}
    (tmp_path / "sweep.json").write_text(json.dumps(good))
    assert _load_previous(tmp_path / "sweep.json", {"k": 1}) == {"r": good["rows"][0]}
