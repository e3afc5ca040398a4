"""Recipes can request tasks and latency; defaults keep existing recipes unchanged."""

from __future__ import annotations

import pytest

from compress.core.errors import RecipeError
from compress.recipe import load_recipe, parse_recipe


def test_shipped_recipes_have_no_tasks_or_latency_by_default():
    recipe = load_recipe("recipes/smollm2-w8-rtn.yaml")
    assert recipe.eval.tasks is None and recipe.eval.latency is None
    assert parse_recipe(recipe.to_yaml()).to_dict() == recipe.to_dict()


def test_tasks_and_latency_sections_parse():
    recipe = parse_recipe(
        {
            "passes": [],
            "eval": {
                "tasks": {"names": ["piqa_local"], "limit": 10},
                "latency": {"prompts": 2, "slo_ttft_ms": 500},
            },
        }
    )
    assert recipe.eval.tasks.names == ["piqa_local"] and recipe.eval.latency.slo_ttft_ms == 500


@pytest.mark.parametrize(
    "section, match",
    [
        ({"tasks": {"names": []}}, "names"),
        ({"latency": {"output_tokens": 1}}, "output_tokens"),
        ({"latency": {"slo_ttft": 5}}, "unknown key 'slo_ttft'"),
    ],
    ids=["no-tasks", "too-few-tokens", "misspelt"],
)
def test_bad_eval_sections(section, match):
    with pytest.raises(RecipeError, match=match):
        parse_recipe({"passes": [], "eval": section})


def test_run_table_shows_requested_tasks_and_latency(tmp_path, tiny_model, tiny_tokenizer,
                                                     data_dir):
    pytest.importorskip("lm_eval")
    from compress.pipeline.job import run_job

    model_dir = tmp_path / "tiny"
    tiny_model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    recipe = parse_recipe({
        "name": "tiny-w8",
        "passes": [{"pass": "quantize.int8_rtn"}],
        "export": {"enabled": False},
        "eval": {
            "perplexity": None,
            "tasks": {"names": ["piqa_local"], "limit": 2},
            "latency": {"prompts": 1, "prompt_tokens": 4, "output_tokens": 2},
        },
    })
    result = run_job(recipe, model=str(model_dir), out_dir=tmp_path / "out",
                     data_dir=str(data_dir), progress=False)
    base, comp = result.rows
    for row in (base, comp):  # cells from the eval section, for both rows
        assert row["piqa_local"].count("±") == 1 and row["ttft_p50_ms"] > 0
        assert row["engine"] == "runtime"  # timed on what `compress generate` serves
    header = result.markdown.splitlines()[2]
    assert "piqa_local acc" in header and "TTFT p50 ms" in header and "TPOT p50 ms" in header
    assert "engine" in header


def test_recipe_latency_tokens_come_from_the_runtime(tiny_tokenizer, data_dir):
    import torch

    from compress.eval.compare import evaluate_extras
    from compress.testing import make_tiny_llama

    model = make_tiny_llama(initializer_range=0.3)
    lat = {"prompts": 2, "prompt_tokens": 6, "output_tokens": 5}
    cfg = parse_recipe({"passes": [], "eval": {"latency": lat}}).eval
    with torch.no_grad():
        out = evaluate_extras(model, tiny_tokenizer, cfg, data_dir=str(data_dir))
    assert out["latency"]["engine"] == "runtime"
    assert out["latency"]["summary"]["requests"] == 2
    assert out["latency"]["summary"]["tpot_ms"]["n"] == 2


@pytest.mark.parametrize(
    "workload, runs",
    [({"workload": "batch", "batch_sizes": [1, 3]}, [1, 3]),
     ({"workload": "poisson", "rate": 50, "requests": 3, "max_batch": 2, "kv_dtype": "int8"},
      [None])],
)
def test_recipe_latency_workloads_run_through_the_scheduler(tiny_tokenizer, data_dir, workload,
                                                             runs):
    from compress.eval.compare import evaluate_extras
    from compress.testing import make_tiny_llama

    model = make_tiny_llama(initializer_range=0.3)
    lat = {"prompt_tokens": 6, "output_tokens": 4, **workload}
    cfg = parse_recipe({"passes": [], "eval": {"latency": lat}}).eval
    out = evaluate_extras(model, tiny_tokenizer, cfg, data_dir=str(data_dir))["latency"]
    assert [r.get("batch_size") for r in out["runs"]] == runs
    assert out["engine"].startswith("runtime scheduler (continuous batching")
    kv = workload.get("kv_dtype", "float32")  # auto: fp32 pages for an fp32 model on a CPU
    assert f"paged {kv} KV" in out["engine"]
    for run in out["runs"]:
        assert run["summary"]["requests"] == run.get("batch_size", 3)
        assert run["summary"]["tpot_ms"]["n"] == run["summary"]["requests"]
        assert run["kv_cache"]["kv_bytes_peak"] > 0


def test_a_poisson_latency_section_needs_a_rate():
    with pytest.raises(RecipeError, match="poisson needs rate"):
        parse_recipe({"passes": [], "eval": {"latency": {"workload": "poisson"}}})
