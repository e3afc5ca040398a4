"""``compress tune`` on MoE models: each sparse layer's fused experts module is one unit. Its
sensitivity is checked against an independent float64 Fisher of every expert's linears, its
formats against both input widths, and end to end the budget is met on the exported
safetensors (the per-expert tensors read back under their stored names)."""

from __future__ import annotations

import logging

import pytest
import torch
import yaml

from compress.arch import ARCHS, float_only_modules, sparse_layers
from compress.core.matcher import set_submodule
from compress.pipeline.tune import (
    TuneTarget,
    check_recipe_matches,
    measure_sensitivity,
    parse_format,
    recipe_dict,
    run_tune,
    sensitivity_bytes,
)
from compress.pipeline.tune_units import (
    checkpoint_unit_bytes,
    measured_linears,
    stored_owners,
    tune_units,
    unit_tables,
)
from compress.quant.experts import FloatExpertsView
from compress.quant.linear import QuantLinear
from compress.recipe import parse_recipe
from compress.testing import TINY_MOE_TYPES, make_char_tokenizer, make_tiny_moe


def _moe(family: str, **overrides):
    if family == "deepseek_v3":  # a dense first layer beside a sparse one
        overrides.setdefault("first_k_dense_replace", 1)
    return make_tiny_moe(family, seed=0, **overrides).eval()


@pytest.mark.parametrize("family", TINY_MOE_TYPES)
def test_the_per_expert_view_computes_what_the_fused_experts_compute(family):
    model = _moe(family)
    arch = ARCHS[model.config.model_type]
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    units = tune_units(model)
    fused = {n: model.get_submodule(n) for n, u in units.items() if u.expert_count}
    assert set(fused) == {f"{arch.layer_prefix}{i}.{arch.moe.fused}"
                          for i in sparse_layers(model, arch)}  # fmt: skip
    assert not float_only_modules(model) & set(units)  # routers and shared gates: never a unit
    with measured_linears(model, units) as members, torch.no_grad():
        got = model(ids).logits
        for name, names in members.items():
            assert all(isinstance(model.get_submodule(n), torch.nn.Linear) for n in names)
            if units[name].expert_count:  # views of the fused weights, not copies
                assert model.get_submodule(names[0]).weight.data_ptr() == getattr(
                    fused[name], arch.moe.gate_up).data_ptr()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert all(model.get_submodule(n) is m for n, m in fused.items())  # put back


def test_experts_sensitivity_equals_an_independent_float64_fisher():
    """Unit score = the sum over every expert's gate, up and down of sum_t (g_t * x_t dW^T)^2,
    recomputed in float64 with retain_grad; a format must fit both input widths (hidden 64,
    intermediate 96: int4-g64 fits the attention, not the experts)."""
    model = _moe("mixtral", intermediate_size=96)
    formats = [parse_format(f) for f in ("float", "int8", "int4-g32", "int4-g64")]
    batch = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    units = tune_units(model)
    with measured_linears(model, units) as members:
        linears = [n for group in members.values() for n in group]
        scores, sizes = measure_sensitivity(model, linears, formats, [batch])
    unit_scores, unit_sizes = unit_tables(scores, sizes, members)
    experts = [n for n, u in units.items() if u.expert_count]
    assert experts and all(set(unit_sizes[n]) == {"float", "int8", "int4-g32"} for n in experts)
    assert "int4-g64" in unit_sizes["model.layers.0.self_attn.q_proj"]
    assert all(unit_sizes[n]["float"] == 2 * units[n].numel for n in experts)

    # independent: a float64 copy whose experts are float64 per-expert Linears (the view's
    # function is checked against the fused module above), output gradients by retain_grad
    reference = _moe("mixtral", intermediate_size=96).double()
    moe = ARCHS["mixtral"].moe
    outputs, inputs = {}, {}
    for name in experts:
        set_submodule(reference, name, FloatExpertsView(reference.get_submodule(name), moe))
    for name in (linear for unit in experts for linear in members[unit]):
        def keep(mod, args, out, name=name):
            inputs[name] = args[0].detach()
            out.retain_grad()
            outputs[name] = out

        reference.get_submodule(name).register_forward_hook(keep)
    hidden = reference.get_input_embeddings()(batch).detach().requires_grad_(True)
    reference(inputs_embeds=hidden, labels=batch).loss.backward()
    for name in experts:
        for fmt in formats[1:3]:
            expected, stored = 0.0, 0
            for linear_name in members[name]:
                linear = model.get_submodule(name)  # the fused module again (context left)
                e, proj = linear_name.removeprefix(f"{name}.").split(".")
                weight = _expert_weight(linear, moe, int(e), proj)
                float_linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
                float_linear.weight.data = weight.float().clone()
                quant = QuantLinear.from_linear(float_linear, fmt.scheme(), backend="reference")
                stored += quant.weight_bytes()
                if linear_name not in outputs:  # the router sent this expert no token
                    continue
                delta = quant.dequantized_weight(torch.float32).double() - weight.double()
                dy = inputs[linear_name] @ delta.t()
                expected += float((outputs[linear_name].grad * dy).square().sum())
            assert unit_scores[name][fmt.name] == pytest.approx(expected, rel=2e-3)
            assert unit_sizes[name][fmt.name] == stored


def _expert_weight(fused, moe, e: int, projection: str) -> torch.Tensor:
    gate, up, down = moe.checkpoint_projections
    gate_up, inter = getattr(fused, moe.gate_up)[e], getattr(fused, moe.down).shape[2]
    return {gate: gate_up[:inter], up: gate_up[inter:], down: getattr(fused, moe.down)[e]}[
        projection].detach()


def test_sensitivity_estimate_counts_the_experts(tmp_path):
    model = _moe("qwen2_moe")
    model.save_pretrained(tmp_path / "moe")
    fmts = [parse_format(f) for f in ("float", "int8", "int4-g32")]
    weights = sum(u.numel for u in tune_units(model).values())
    assert weights > sum(m.weight.numel() for m in model.modules()
                         if isinstance(m, torch.nn.Linear)) - model.lm_head.weight.numel()
    assert (sensitivity_bytes(tmp_path / "moe", fmts, 64)
            - sensitivity_bytes(tmp_path / "moe", fmts[:1], 64)) == 2 * 4 * weights


def test_the_recipe_gives_an_experts_module_its_format_or_keeps_it_float():
    model = _moe("mixtral")
    units = tune_units(model)
    assignment = {n: "int8" for n in units}
    assignment["model.layers.0.mlp.experts"] = "float"
    assignment["model.layers.1.mlp.experts"] = "int4-g32"
    raw = recipe_dict(
        name="t", model="tiny", assignment=assignment, calibration={"num_samples": 2},
        perplexity={"dataset": "wikitext2", "limit": 1}, description="test",
        scheme_names={n: u.scheme_names for n, u in units.items()},
    )  # fmt: skip
    recipe = parse_recipe(yaml.safe_load(yaml.safe_dump(raw)))
    check_recipe_matches(recipe, model, assignment)
    wrong = dict(assignment, **{"model.layers.1.mlp.experts": "int8"})
    with pytest.raises(AssertionError, match=r"layers\.1\.mlp\.experts\.gate_up_proj"):
        check_recipe_matches(recipe, model, wrong)
    kept = dict(assignment, **{"model.layers.0.mlp.experts": "int8"})
    with pytest.raises(AssertionError, match="ignores model.layers.0.mlp.experts"):
        check_recipe_matches(recipe, model, kept)


@pytest.mark.parametrize("family,bits", [("mixtral", 5.0), ("qwen2_moe", 7.0),
                                         ("deepseek_v3", 9.0)])  # fmt: skip
def test_tune_on_an_moe_model_meets_the_budget_on_the_export(family, bits, tmp_path, monkeypatch,
                                                              caplog):
    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    model = _moe(family)
    model.save_pretrained(tmp_path / "model")
    make_char_tokenizer().save_pretrained(tmp_path / "model")
    text = tmp_path / "text.txt"
    text.write_text("".join(f"Line {i}: the quick brown fox {i * 7 % 13} jumps over {i % 5}.\n"
                            for i in range(80)))
    with caplog.at_level(logging.WARNING):
        report = run_tune(
            str(tmp_path / "model"), TuneTarget(bits_per_weight=bits),
            formats=("float", "int8", "int4-g32"), num_samples=4, seq_len=32,
            calibration_mix={str(text): 1.0}, limit=2, eval_dataset=str(text),
            context_length=64, out_dir=tmp_path / "out", progress=False,
        )  # fmt: skip
    assert "matches none" not in caplog.text  # overrides naming experts reach them
    assert report["measured_bits_per_weight"] <= bits
    assert report["measured_bits_per_weight"] == pytest.approx(
        report["predicted_bits_per_weight"], rel=1e-9)
    units = tune_units(model)
    assert set(report["assignment"]) == set(units)
    experts = [n for n, u in units.items() if u.expert_count]
    assert experts and all(report["assignment"][n] != "float" for n in experts)
    assert all(c["ok"] for c in report["checks"])
    rerun = parse_recipe((tmp_path / "out" / "recipe.yaml").read_text())
    check_recipe_matches(rerun, model, report["assignment"])
    # the export's per-expert tensors, read back per unit: every unit has bytes
    stored = checkpoint_unit_bytes(tmp_path / "out", stored_owners(model, units), units)
    assert all(stored[n] > 0 for n in units) and sum(stored.values()) == report[
        "measured_linear_bytes"]


def test_tune_on_an_moe_model_meets_a_checkpoint_bytes_target(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    model = _moe("mixtral")
    model.save_pretrained(tmp_path / "model")
    make_char_tokenizer().save_pretrained(tmp_path / "model")
    text = tmp_path / "text.txt"
    text.write_text("".join(f"Line {i}: the quick brown fox {i * 7 % 13} jumps over {i % 5}.\n"
                            for i in range(80)))
    float_bytes = sum(t.numel() * 2 for t in model.state_dict().values())
    report = run_tune(
        str(tmp_path / "model"), TuneTarget(max_bytes=int(0.6 * float_bytes)),
        formats=("float", "int8", "int4-g32"), num_samples=4, seq_len=32,
        calibration_mix={str(text): 1.0}, limit=2, eval_dataset=str(text), context_length=64,
        out_dir=tmp_path / "out", progress=False,
    )  # fmt: skip
    (check,) = report["checks"]
    assert check["ok"], check  # the per-expert export's longer header included
