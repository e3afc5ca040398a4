"""Recipe loading, validation messages, overrides and round trips."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import compress  # noqa: F401  (registers passes)
from compress.core.errors import RecipeError
from compress.quant.rtn import Int4RtnConfig
from compress.recipe import Recipe, load_recipe, parse_recipe

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_shipped_recipe_validates_and_round_trips(path):
    recipe = load_recipe(path)
    again = parse_recipe(recipe.to_yaml(), source=f"{path.name} (round trip)")
    assert again.to_dict() == recipe.to_dict()


def test_python_recipe_round_trips_through_yaml():
    recipe = Recipe(name="x", passes=[Int4RtnConfig(group_size=64, symmetric=False)])
    text = recipe.to_yaml()
    assert "quantize.int4_rtn" in text
    assert parse_recipe(text).passes == recipe.passes


def _errors(text: str) -> str:
    with pytest.raises(RecipeError) as info:
        parse_recipe(text, source="bad.yaml")
    return str(info.value)


def test_unknown_pass_suggests_the_closest_name():
    msg = _errors("passes:\n  - pass: quantize.int4_rnt\n")
    assert "passes[0]" in msg and "'quantize.int4_rtn'" in msg and "Did you mean" in msg


def test_unknown_key_suggests_the_closest_key():
    msg = _errors("passes:\n  - pass: quantize.int4_rtn\n    group_sise: 64\n")
    assert "group_sise" in msg and "Did you mean 'group_size'" in msg and "bad.yaml" in msg


def test_wrong_type_names_key_value_and_location():
    msg = _errors("passes:\n  - pass: quantize.int8_rtn\n    symmetric: maybe\n")
    assert "passes[0] (quantize.int8_rtn)" in msg and "symmetric" in msg and "'maybe'" in msg


def test_bad_group_size_lists_allowed_values():
    msg = _errors("passes:\n  - pass: quantize.int4_rtn\n    group_size: 100\n")
    assert "group_size" in msg and "100" in msg and "[32, 64, 128, 256]" in msg


def test_three_mistakes_are_all_reported_at_once():
    text = (
        "nmae: typo-top-level\n"
        "passes:\n"
        "  - pass: quantize.int4_rtm\n"
        "  - pass: quantize.int8_rtn\n"
        "    group_size: 7\n"
        "eval:\n"
        "  perplexity: {context_length: many}\n"
    )
    msg = _errors(text)
    assert "4 problems" in msg
    for needle in ("'nmae'", "Did you mean 'name'", "quantize.int4_rtm", "group_size=7",
                   "context_length"):
        assert needle in msg, needle


def test_bad_order_is_reported():
    from compress.core.registry import PASSES

    if not any(n.startswith("prune.") for n in PASSES):
        pytest.skip("no prune pass registered")
    prune = next(n for n in PASSES if n.startswith("prune."))
    msg = _errors(f"passes:\n  - pass: quantize.int8_rtn\n  - pass: {prune}\n")
    assert "must come before quantize" in msg


def test_missing_file_is_reported_as_missing(tmp_path):
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_overrides_go_through_validation(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"name": "r", "passes": [{"pass": "quantize.int4_rtn"}]}))
    recipe = load_recipe(path, ["passes.0.group_size=64", "eval.perplexity.limit=3"])
    assert recipe.passes[0].group_size == 64 and recipe.eval.perplexity.limit == 3
    with pytest.raises(RecipeError, match="group_size=48"):
        load_recipe(path, ["passes.0.group_size=48"])
    with pytest.raises(RecipeError, match="not an index"):
        load_recipe(path, ["passes.3.group_size=64"])
