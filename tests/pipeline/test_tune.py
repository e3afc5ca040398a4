"""``compress tune``: the knapsack solver against brute force, the Fisher sensitivity against an
independent float64 computation, the written recipe against the assignment, and one end-to-end
run on the tiny model whose budget is checked on the exported safetensors."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
import yaml

from compress.core.errors import ConfigError, RecipeError
from compress.pipeline.tune import (
    TuneTarget,
    assign_formats,
    check_recipe_matches,
    decoder_linears,
    measure_sensitivity,
    parse_format,
    recipe_dict,
    run_tune,
    solve_assignment,
)
from compress.recipe import parse_recipe


def _brute_force(scores, costs, budget):
    best = None
    for pick in itertools.product(*(range(len(s)) for s in scores)):
        if sum(costs[i][j] for i, j in enumerate(pick)) <= budget:
            total = sum(scores[i][j] for i, j in enumerate(pick))
            best = total if best is None else min(best, total)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_solver_is_optimal_on_small_instances(seed):
    rng = random.Random(seed)
    layers = rng.randint(2, 5)
    costs = [[rng.randint(1, 40) for _ in range(3)] for _ in range(layers)]
    scores = [[rng.random() for _ in range(3)] for _ in range(layers)]
    budget = rng.randint(min(map(min, costs)) * layers, max(map(max, costs)) * layers)
    picked = solve_assignment(scores, costs, budget)
    expected = _brute_force(scores, costs, budget)
    if expected is None:
        assert picked is None
        return
    assert sum(costs[i][j] for i, j in enumerate(picked)) <= budget
    assert sum(scores[i][j] for i, j in enumerate(picked)) == pytest.approx(expected, abs=1e-12)


def test_solver_rounds_costs_up_so_the_answer_fits():
    rng = random.Random(0)
    costs = [[rng.randint(10**5, 10**7) for _ in range(4)] for _ in range(60)]
    scores = [[rng.random() for _ in range(4)] for _ in range(60)]
    budget = sum(sorted(c)[1] for c in costs)  # between the cheapest and the dearest
    picked = solve_assignment(scores, costs, budget, resolution=512)
    assert sum(costs[i][j] for i, j in enumerate(picked)) <= budget
    cheapest = [min(range(4), key=lambda j, c=c: c[j]) for c in costs]
    assert sum(scores[i][j] for i, j in enumerate(picked)) <= sum(
        scores[i][j] for i, j in enumerate(cheapest)
    )


def test_a_budget_equal_to_the_cheapest_formats_is_met_despite_rounding():
    """Every layer's cost rounded up to the budget unit overshoots a budget that is exactly the
    cheapest total (a uniform format's size): the answer is that uniform format, not a refusal."""
    rng = random.Random(3)
    costs = [[rng.randint(10**5, 10**6) + 7, 10**7] for _ in range(200)]
    scores = [[1.0, 0.0] for _ in range(200)]
    budget = sum(c[0] for c in costs)
    assert solve_assignment(scores, costs, budget, resolution=4096) == [0] * 200
    # and leftover budget after the rounding is spent: one upgrade fits exactly
    upgrade = costs[5][1] - costs[5][0]
    picked = solve_assignment(scores, costs, budget + upgrade, resolution=4096)
    assert sum(costs[i][j] for i, j in enumerate(picked)) <= budget + upgrade
    assert sum(picked) == 1


def test_a_budget_below_the_smallest_formats_is_refused():
    scores = {"a": {"int4-g32": 1.0, "float": 0.0}}
    sizes = {"a": {"int4-g32": 100, "float": 400}}
    with pytest.raises(ConfigError, match="smallest candidate formats need 100"):
        assign_formats(scores, sizes, 99)
    assert assign_formats(scores, sizes, 400) == {"a": "float"}
    assert assign_formats(scores, sizes, 399) == {"a": "int4-g32"}


def test_format_names():
    assert parse_format("int4-g128-asym") == parse_format("int4-g128-asym")
    fmt = parse_format("int4-g32-asym")
    assert (fmt.n_bits, fmt.group_size, fmt.symmetric) == (4, 32, False)
    assert parse_format("int8").group_size is None and parse_format("float").is_float
    for bad in ("int4", "int3-g32", "int4-g48", "fp8"):
        with pytest.raises(ConfigError):
            parse_format(bad)


def test_sensitivity_equals_an_independent_float64_fisher(tiny_model):
    formats = [parse_format(f) for f in ("float", "int8", "int4-g32")]
    torch.manual_seed(0)
    batch = torch.randint(3, 300, (2, 24))
    names = decoder_linears(tiny_model)
    assert len(names) == 14  # 2 layers x 7 projections; the tied head is left out
    scores, sizes = measure_sensitivity(tiny_model, names, formats, [batch])

    # independent: float64 model, output gradients by retain_grad, the RTN weights rebuilt
    model = tiny_model.double()
    outputs, inputs = {}, {}
    hooks = []
    for name in names[:4]:
        module = model.get_submodule(name)

        def keep(mod, args, out, name=name):
            inputs[name] = args[0].detach()
            out.retain_grad()
            outputs[name] = out

        hooks.append(module.register_forward_hook(keep))
    hidden = model.get_input_embeddings()(batch).detach().requires_grad_(True)
    model(inputs_embeds=hidden, labels=batch).loss.backward()
    for hook in hooks:
        hook.remove()
    from compress.quant.linear import QuantLinear

    for name in names[:4]:
        linear = tiny_model.get_submodule(name).float()
        for fmt in formats[1:]:
            quant = QuantLinear.from_linear(linear, fmt.scheme(), backend="reference")
            delta = quant.dequantized_weight(torch.float32).double() - linear.weight.double()
            dy = inputs[name] @ delta.t()
            expected = float((outputs[name].grad * dy).square().sum().detach())
            assert scores[name][fmt.name] == pytest.approx(expected, rel=2e-3)
            assert sizes[name][fmt.name] == quant.weight_bytes()
        assert scores[name]["float"] == 0.0
    assert sum(s["int4-g32"] for s in scores.values()) > sum(s["int8"] for s in scores.values())


def test_the_written_recipe_gives_every_layer_its_format(tiny_model):
    names = decoder_linears(tiny_model)
    choices = ["float", "int8", "int4-g32", "int4-g64", "int4-g32-asym"]
    rng = random.Random(1)
    assignment = {n: rng.choice(choices) for n in names}
    assignment[names[0]] = "int4-g32"  # at least one integer format
    raw = recipe_dict(
        name="t", model="tiny", assignment=assignment, calibration={"num_samples": 2},
        perplexity={"dataset": "wikitext2", "limit": 1}, description="test",
    )  # fmt: skip
    recipe = parse_recipe(yaml.safe_load(yaml.safe_dump(raw)))  # survives a YAML round trip
    check_recipe_matches(recipe, tiny_model, assignment)
    wrong = dict(assignment)
    flip = next(n for n, f in assignment.items() if f == "int8")
    wrong[flip] = "int4-g64"
    with pytest.raises(AssertionError, match=flip.replace(".", r"\.")):
        check_recipe_matches(recipe, tiny_model, wrong)
    # a tune on the signed grid writes it into the recipe; the check holds the recipe to it
    signed = recipe_dict(
        name="t", model="tiny", assignment=assignment, calibration={"num_samples": 2},
        perplexity={"dataset": "wikitext2", "limit": 1}, description="test",
        symmetric_grid="signed",
    )  # fmt: skip
    recipe = parse_recipe(yaml.safe_load(yaml.safe_dump(signed)))
    assert recipe.passes[0].symmetric_grid == "signed"
    check_recipe_matches(recipe, tiny_model, assignment, "signed")
    with pytest.raises(AssertionError, match="signed"):
        check_recipe_matches(recipe, tiny_model, assignment)  # the tune's grid was restricted
    # the rounding pass as the tune's algorithm: its own settings land in the pass and are
    # checked by its config (a bad one fails when the recipe is parsed, before any work)
    rounded = recipe_dict(
        name="t", model="tiny", assignment=assignment, calibration={"num_samples": 2},
        perplexity={"dataset": "wikitext2", "limit": 1}, description="test",
        algorithm="autoround", pass_options={"iters": 7, "batch_size": 2},
    )  # fmt: skip
    recipe = parse_recipe(yaml.safe_load(yaml.safe_dump(rounded)))
    assert (recipe.passes[0].iters, recipe.passes[0].batch_size) == (7, 2)
    check_recipe_matches(recipe, tiny_model, assignment)
    bad = recipe_dict(
        name="t", model="tiny", assignment=assignment, calibration={"num_samples": 2},
        perplexity={"dataset": "wikitext2", "limit": 1}, description="test",
        algorithm="autoround", pass_options={"iters": -1},
    )  # fmt: skip
    with pytest.raises(RecipeError, match="iters"):
        parse_recipe(bad)


def test_target_needs_exactly_one_size():
    with pytest.raises(ConfigError, match="exactly one target"):
        TuneTarget().check()
    with pytest.raises(ConfigError, match="exactly one target"):
        TuneTarget(bits_per_weight=4.5, tpot_ms=10).check()
    with pytest.raises(ConfigError, match="positive"):
        TuneTarget(bits_per_weight=-1).check()


def test_tune_end_to_end_meets_the_bits_budget(tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = tmp_path / "tiny"
    tiny_model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    text = tmp_path / "text.txt"
    text.write_text(
        "".join(
            f"Line {i}: the quick brown fox {i * 7 % 13} jumps over {i % 5}.\n" for i in range(80)
        )
    )
    report = run_tune(
        str(model_dir), TuneTarget(bits_per_weight=6.0, max_dppl_pct=1000.0, max_kl=100.0),
        formats=("float", "int8", "int4-g32", "int4-g64"), num_samples=4, seq_len=32,
        calibration_mix={str(text): 1.0}, limit=2, eval_dataset=str(text), context_length=64,
        out_dir=tmp_path / "out", progress=False,
    )  # fmt: skip
    assert report["measured_bits_per_weight"] <= 6.0
    assert report["measured_bits_per_weight"] == pytest.approx(
        report["predicted_bits_per_weight"], rel=1e-6
    )
    assert len(set(report["assignment"].values())) >= 2  # a real mix, not one uniform format
    assert all(check["ok"] for check in report["checks"])
    assert {c["what"].split()[0] for c in report["checks"]} == {"bits/weight", "Δppl", "KL"}
    written = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert written["format_counts"] == report["format_counts"]
    # the recipe a person edits and reruns with `compress run`: same formats per layer
    rerun = parse_recipe((tmp_path / "out" / "recipe.yaml").read_text())
    check_recipe_matches(rerun, tiny_model, report["assignment"])


# ---- one orchestration (issue 31): the verification is a planned job of compress.pipeline.job
def _tiny_dir(tmp_path, tiny_model, tiny_tokenizer, monkeypatch):
    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = tmp_path / "tiny"
    tiny_model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    text = tmp_path / "text.txt"
    text.write_text("".join(f"Line {i}: the quick brown fox {i * 7 % 13} jumps over {i % 5}.\n"
                            for i in range(80)))
    return model_dir, text


def _tune(model_dir, text, out, **target):
    return run_tune(
        str(model_dir), TuneTarget(**target), formats=("float", "int8", "int4-g32"),
        num_samples=4, seq_len=32, calibration_mix={str(text): 1.0}, limit=2,
        eval_dataset=str(text), context_length=64, out_dir=out, progress=False,
    )  # fmt: skip


def test_tune_refuses_an_impossible_job_before_loading_and_writes_nothing(
        tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    import compress.io.load
    import compress.pipeline.preflight as preflight
    from compress.pipeline import tune as tune_module
    from compress.pipeline.preflight import InsufficientMemoryError

    model_dir, text = _tiny_dir(tmp_path, tiny_model, tiny_tokenizer, monkeypatch)
    monkeypatch.setattr(compress.io.load, "load_model", lambda *a, **k: pytest.fail("loaded"))
    with monkeypatch.context() as patch:  # the verification job cannot fit
        patch.setattr(preflight, "available_memory_bytes", lambda: 10 * 2**20)
        with pytest.raises(InsufficientMemoryError, match="nothing was written"):
            _tune(model_dir, text, tmp_path / "out", bits_per_weight=6.0)
    # the job fits, the sensitivity measurement (the model and every format's error) does not,
    # whole (then it goes layer by layer) nor layer by layer
    monkeypatch.setattr(tune_module, "sensitivity_bytes", lambda *a: 2**60)
    monkeypatch.setattr(tune_module, "layerwise_sensitivity_bytes", lambda *a: 2**60)
    with pytest.raises(InsufficientMemoryError,
                       match=r"phase 'sensitivity \(layer by layer\)'.*--formats"):
        _tune(model_dir, text, tmp_path / "out", bits_per_weight=6.0)
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache" / "tune").exists()


def test_sensitivity_estimate_counts_each_format_error_of_each_linear(tiny_model, tmp_path):
    from compress.pipeline.tune import sensitivity_bytes

    tiny_model.save_pretrained(tmp_path / "tiny")
    fmts = [parse_format(f) for f in ("float", "int8", "int4-g32")]
    float_only = sensitivity_bytes(tmp_path / "tiny", fmts[:1], 64)
    linears = sum(tiny_model.get_submodule(n).weight.numel() for n in decoder_linears(tiny_model))
    assert sensitivity_bytes(tmp_path / "tiny", fmts, 64) - float_only == 2 * 4 * linears
    assert sensitivity_bytes("HuggingFaceTB/some-hub-id", fmts, 64) is None  # nothing to read


def test_tune_frees_its_model_before_the_job_and_reports_what_run_gives(
        tiny_model, tiny_tokenizer, tmp_path, monkeypatch, one_thread):
    """The job loads the model while no other copy is alive (tune used to keep its measured
    copy through the whole verification), and its rows are what `compress run` gives for the
    recipe tune wrote."""
    import gc

    from transformers import GenerationMixin

    from compress.pipeline import job as job_module
    from compress.pipeline.job import run_job

    def live() -> set[int]:
        gc.collect()
        return {id(o) for o in gc.get_objects() if isinstance(o, GenerationMixin)}

    model_dir, text = _tiny_dir(tmp_path, tiny_model, tiny_tokenizer, monkeypatch)
    before, alive_at_load = live(), []
    load = job_module.load_model

    def counted(*args, **kwargs):
        alive_at_load.append(len(live() - before))
        return load(*args, **kwargs)

    monkeypatch.setattr(job_module, "load_model", counted)
    report = _tune(model_dir, text, tmp_path / "out", bits_per_weight=6.0)
    assert alive_at_load == [0]  # one load: the job's (baseline and passes on the same model)
    recipe = parse_recipe((tmp_path / "out" / "recipe.yaml").read_text())
    alone = run_job(recipe, model=str(model_dir), out_dir=tmp_path / "run", progress=False)
    keys = ("perplexity", "ppl_delta_pct", "kl", "top1_changed_pct", "linear_weight_mb")
    assert [{k: r.get(k) for k in keys} for r in report["rows"]] == [
        {k: r.get(k) for k in keys} for r in alone.rows]


@pytest.mark.parametrize("text", [
    '{"scores": {"a": {"int4": 0.5}}',  # cut short
    '{"scores": {"a": {"int4": NaN}}, "sizes": {"a": {"int4": 10}}}',
    '{"scores": {"b": {"int4": 0.5}}, "sizes": {"b": {"int4": 10}}}',  # other layers
    '[]',
], ids=["cut_short", "nan_score", "other_layers", "not_an_object"])
def test_a_damaged_sensitivity_cache_is_measured_again(text, tmp_path):
    # was a JSONDecodeError / KeyError traceback, or a plan made from NaN scores
    from compress.pipeline.tune import read_sensitivities

    cache = tmp_path / "key.json"
    cache.write_text(text)
    assert read_sensitivities(cache, ["a"]) is None
    cache.write_text('{"scores": {"a": {"int4": 0.5}}, "sizes": {"a": {"int4": 10}}}')
    assert read_sensitivities(cache, ["a"]) == ({"a": {"int4": 0.5}}, {"a": {"int4": 10}})


def test_tune_meets_a_checkpoint_bytes_target_on_disk(tiny_model, tiny_tokenizer, tmp_path,
                                                      monkeypatch):
    """The files' sizes hold the headers too (JSON of every tensor's name, dtype, shape and
    offsets): the budget leaves room for them (it missed by the header before)."""
    model_dir, text = _tiny_dir(tmp_path, tiny_model, tiny_tokenizer, monkeypatch)
    float_bytes = sum(t.numel() * 2 for t in tiny_model.state_dict().values())
    target = int(0.6 * float_bytes)
    report = _tune(model_dir, text, tmp_path / "out", max_bytes=target)
    (check,) = report["checks"]
    files = sum(p.stat().st_size for p in (tmp_path / "out").glob("*.safetensors"))
    assert check["ok"] and check["got"] == files <= target, check
    assert "int4-g32" in report["format_counts"] or "int8" in report["format_counts"]


@pytest.mark.parametrize("family", ["llama", "mixtral", "deepseek_v3"])
def test_layer_by_layer_measures_what_the_whole_model_measures(family, tmp_path):
    """The layer-by-layer Fisher (forward through each layer read from the checkpoint, the
    gradient pushed back one layer at a time) against the whole model's: the same scores
    (dense, MoE experts, latent attention with a dense first layer) and sizes."""
    from compress.io.export import layerwise_model
    from compress.pipeline.tune_layerwise import measure_sensitivity_layerwise
    from compress.pipeline.tune_units import measured_linears, measured_names, tune_units
    from compress.testing import make_tiny_llama, make_tiny_moe

    model = (make_tiny_llama(seed=0) if family == "llama" else make_tiny_moe(
        family, seed=0, **({"first_k_dense_replace": 1} if family == "deepseek_v3" else {})))
    model.save_pretrained(tmp_path / "model")
    formats = [parse_format(f) for f in ("float", "int8", "int4-g32")]
    batches = list(torch.randint(3, 300, (4, 24), generator=torch.Generator().manual_seed(0))
                   .split(2))  # fmt: skip
    stream = layerwise_model(tmp_path / "model")
    units = tune_units(stream.model)
    scores, sizes = measure_sensitivity_layerwise(stream, units, formats, batches,
                                                  spill_near=tmp_path / "spill")  # fmt: skip
    assert not list((tmp_path / "spill").iterdir())  # the layers' inputs are removed
    model.float().eval()
    with measured_linears(model, tune_units(model)) as members:
        names = [n for group in members.values() for n in group]
        want_scores, want_sizes = measure_sensitivity(model, names, formats, batches)
    assert members == measured_names(stream.model, units)
    assert sizes == want_sizes and set(scores) == set(want_scores)
    for name, row in want_scores.items():
        assert scores[name] == pytest.approx(row, rel=1e-5), name
    assert all(param.device.type == "meta" for param in stream.model.model.layers.parameters())


def test_tune_layer_by_layer_writes_the_recipe_the_whole_model_gives(
        tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    model_dir, text = _tiny_dir(tmp_path, tiny_model, tiny_tokenizer, monkeypatch)
    whole = _tune(model_dir, text, tmp_path / "whole", bits_per_weight=6.0)
    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache2"))  # measured again
    layered = run_tune(
        str(model_dir), TuneTarget(bits_per_weight=6.0), formats=("float", "int8", "int4-g32"),
        num_samples=4, seq_len=32, calibration_mix={str(text): 1.0}, limit=2,
        eval_dataset=str(text), context_length=64, out_dir=tmp_path / "layered",
        progress=False, layer_by_layer=True,
    )  # fmt: skip
    assert layered["assignment"] == whole["assignment"]
    assert (whole["sensitivity"], layered["sensitivity"]) == ("model loaded whole",
                                                              "layer by layer")
    assert "measured with the layer by layer" in (tmp_path / "layered" / "tune.md").read_text()
    assert layered["measured_bits_per_weight"] == whole["measured_bits_per_weight"]
    with pytest.raises(ConfigError, match="TPOT"):
        run_tune(str(model_dir), TuneTarget(tpot_ms=5.0), out_dir=tmp_path / "t",
                 calibration_mix={str(text): 1.0}, eval_dataset=str(text), progress=False,
                 layer_by_layer=True, seq_len=32, context_length=64)  # fmt: skip


def test_layer_by_layer_is_chosen_when_the_whole_measurement_does_not_fit(tmp_path, monkeypatch):
    import compress.memory
    from compress.pipeline.tune_layerwise import use_layer_by_layer

    monkeypatch.setattr(compress.memory, "available_memory_bytes", lambda: 10 * 2**30)
    assert use_layer_by_layer(tmp_path, 11 * 2**30, None)  # over: layer by layer
    assert not use_layer_by_layer(tmp_path, 9 * 2**30, None)
    assert not use_layer_by_layer(tmp_path, None, None)  # unknown: whole, as before
    assert not use_layer_by_layer("org/hub-id", 11 * 2**30, None)  # nothing to read a layer of
    assert not use_layer_by_layer(tmp_path, 11 * 2**30, False)  # asked
    with pytest.raises(ConfigError, match="layer by layer reads a checkpoint folder"):
        use_layer_by_layer("org/hub-id", None, True)


def test_a_cut_layer_by_layer_measurement_resumes_where_it_stopped(tmp_path, monkeypatch):
    """Cut during the backward of the third layer from the top: the rerun reads the save,
    redoes the forward up to that layer only, and gives the uninterrupted run's scores; a
    save made for other tokens is not used; the save is gone once the measurement is done."""
    from compress.io.export import layerwise_model
    from compress.pipeline import tune_layerwise
    from compress.pipeline.tune_layerwise import measure_sensitivity_layerwise
    from compress.pipeline.tune_units import tune_units
    from compress.testing import make_tiny_llama

    make_tiny_llama(seed=0, num_hidden_layers=4).save_pretrained(tmp_path / "model")
    formats = [parse_format(f) for f in ("float", "int8", "int4-g32")]
    batches = list(torch.randint(3, 300, (4, 16), generator=torch.Generator().manual_seed(0))
                   .split(2))  # fmt: skip

    def measure(resume, batches=batches):
        stream = layerwise_model(tmp_path / "model")
        result = measure_sensitivity_layerwise(stream, tune_units(stream.model), formats,
                                               batches, spill_near=tmp_path / "spill",
                                               resume=resume)  # fmt: skip
        return result, stream.loads

    (want, _), full_loads = measure(None)
    assert full_loads == 8  # 4 layers forward, 4 backward
    save = tmp_path / "partial.safetensors"
    through, calls = tune_layerwise._backward_through, []

    def cut(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return through(*args)

    monkeypatch.setattr(tune_layerwise, "_backward_through", cut)
    with pytest.raises(KeyboardInterrupt):
        measure(save)
    assert save.is_file()
    monkeypatch.setattr(tune_layerwise, "_backward_through", through)
    other = [b.flip(0) for b in batches]  # another measurement: its save is not this one's
    stream = layerwise_model(tmp_path / "model")
    assert tune_layerwise._read_progress(save, tune_layerwise._fingerprint(
        tune_units(stream.model), formats, other)) is None
    (got, _), loads = measure(save)
    assert loads == 1 + 2  # saved after layer 2: layer 0 forward, then 1 and 0 back
    assert got == want and not save.exists()
