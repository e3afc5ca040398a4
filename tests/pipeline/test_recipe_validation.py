"""Recipe validation gaps: unsafe names, NaN/inf, unbounded sizes, control characters, --set
error messages, the schema reference, and a property test over mutated shipped recipes."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compress  # noqa: F401  (registers passes)
from compress.cli import main
from compress.core.errors import RecipeError
from compress.recipe import Recipe, load_recipe, parse_recipe

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
BASE = {"name": "r", "passes": [{"pass": "quantize.int4_rtn", "group_size": 32}]}


def _problems(data) -> str:
    with pytest.raises(RecipeError) as info:
        parse_recipe(data, source="r.yaml")
    return str(info.value)


@pytest.mark.parametrize("name", ["../../x", "a/b", ".x", "x\x00y", "a\\b", "..", "", "x" * 101,
                                  "a..b", "tab\tname"])
def test_unsafe_recipe_names_are_rejected(name):
    message = _problems({**BASE, "name": name})
    assert "name=" in message and "out/<name>" in message
    with pytest.raises(RecipeError, match="name="):
        Recipe(name=name)


def test_safe_names_pass():
    for name in ("smollm2-w4g128-rtn", "my run 2", "ü-model_v1.5"):
        assert parse_recipe({**BASE, "name": name}).name == name


@pytest.mark.parametrize("section,key", [
    ({"passes": [{"pass": "quantize.bnb", "format": "int8", "threshold": float("nan")}]},
     "threshold"),
    ({"passes": [{"pass": "quantize.gptq", "max_dampening": float("inf")}],
      "calibration": {}}, "max_dampening"),
    ({"calibration": {"mix": {"wikitext2-valid": float("nan")}}}, "mix.wikitext2-valid"),
    ({"eval": {"latency": {"usd_per_hour": float("inf")}}}, "eval.latency.usd_per_hour"),
    ({"passes": [{"pass": "prune.mlp_channels", "sparsity": float("nan")}]}, "sparsity"),
    ({"passes": [{"pass": "prune.layers", "target_params": float("inf")}]}, "target_params"),
])
def test_nan_and_inf_are_rejected_with_the_key(section, key):
    message = _problems({"name": "r", **section})
    assert key in message and ("finite" in message or "not a count" in message
                               or "must be in" in message)


def test_yaml_nan_from_a_set_override_is_rejected(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"name": "r", "passes": [{"pass": "quantize.bnb",
                                                             "format": "int8"}]}))
    with pytest.raises(RecipeError, match=r"--set passes.0.threshold=.nan: .*threshold=nan"):
        load_recipe(path, ["passes.0.threshold=.nan"])


@pytest.mark.parametrize("section,key,reason", [
    ({"calibration": {"num_samples": 10**9}}, "calibration.num_samples", "activations"),
    ({"calibration": {"seq_len": 10**7}}, "calibration.seq_len", "context"),
    ({"calibration": {"num_samples": 60000, "seq_len": 4096}}, "num_samples * seq_len",
     "in memory"),
    ({"eval": {"perplexity": {"context_length": 10**8}}}, "context_length", "context"),
    ({"eval": {"latency": {"rounds": 10**6}}}, "eval.latency.rounds", "every request"),
    ({"passes": [{"pass": "prune.mlp_channels", "sparsity": 0.5},
                 {"pass": "distill.logits", "data": "x", "steps": 10**9}]}, "steps", "teacher"),
    ({"passes": [{"pass": "prune.mlp_channels", "sparsity": 0.5},
                 {"pass": "distill.logits", "data": "x", "batch_size": 10**6}]}, "batch_size",
     "backward"),
])
def test_sizes_that_exhaust_memory_or_time_are_bounded_with_a_reason(section, key, reason):
    message = _problems({"name": "r", **section})
    assert key in message and "at most" in message and reason in message


@pytest.mark.parametrize("section,key", [
    ({"model": "smollm2\x00-135m"}, "model"),
    ({"description": "nul \x00 here"}, "description"),
    ({"calibration": {"source": "train_text/\x1bweb"}}, "calibration.source"),
    ({"eval": {"perplexity": {"dataset": "wiki\ntext2"}}}, "eval.perplexity.dataset"),
    ({"passes": [{"pass": "quantize.int8_rtn", "targets": ["Lin\x00ear"]}]}, "targets"),
    ({"passes": [{"pass": "prune.mlp_channels", "sparsity": 0.5},
                 {"pass": "distill.logits", "data": "x", "checkpoint_dir": "out/\x00"}]},
     "checkpoint_dir"),
])
def test_control_characters_are_rejected(section, key):
    message = _problems({"name": "r", **section})
    assert key in message and "control character" in message


def test_multiline_description_and_odd_param_counts():
    assert parse_recipe({**BASE, "description": "two\nlines\twith a tab"}).description
    for value in ([1, 2], {"a": 1}, True):
        message = _problems({"name": "r", "passes": [{"pass": "prune.layers",
                                                      "target_params": value}]})
        assert "target_params" in message
    assert "multiple_of" in _problems({"name": "r", "passes": [
        {"pass": "prune.mlp_channels", "sparsity": 0.5, "multiple_of": 0}]})


# ---- --set errors -------------------------------------------------------------------------
def test_set_unknown_key_names_the_dotted_key_the_level_and_the_origin(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(BASE))
    with pytest.raises(RecipeError) as info:
        load_recipe(path, ["eval.perplexity.limt=20"])
    message = str(info.value)
    assert "--set eval.perplexity.limt=20: eval.perplexity: unknown key 'limt'." in message
    assert "Did you mean 'limit'?" in message
    assert "Keys allowed in eval.perplexity: dataset, context_length, stride, limit" in message
    assert "baseline" not in message  # not the keys of `eval`
    assert f"{path}:" not in message  # the file is fine


def test_set_errors_in_passes_and_files_keep_their_origins(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**BASE, "eval": {"perplexity": {"limit": -1}}}))
    with pytest.raises(RecipeError) as info:
        load_recipe(path, ["passes.0.group_sise=64", "passes.0.group_size=48"])
    message = str(info.value)
    assert "--set passes.0.group_sise=64: passes[0] (quantize.int4_rtn): unknown key " \
           "'group_sise'. Did you mean 'group_size'?" in message
    assert "--set passes.0.group_size=48: passes[0] (quantize.int4_rtn): group_size=48" in message
    assert f"{path}: eval.perplexity.limit=-1" in message  # from the file, not from --set
    with pytest.raises(RecipeError, match="overrides.0: unknown key 'nbits'. Did you mean 'n_b"):
        load_recipe(path, ["eval.perplexity.limit=2",
                           "passes.0.overrides=[{layers: x, nbits: 8}]"])


# ---- validate --show ----------------------------------------------------------------------
def test_validate_show_without_a_recipe_prints_the_reference(capsys):
    assert main(["validate", "--show"]) == 0
    text = capsys.readouterr().out
    reference = yaml.safe_load(text)  # valid YAML: keys with their defaults
    assert set(reference) == {"name", "description", "model", "device", "calibration", "passes",
                              "export", "eval"}
    assert reference["device"] == "auto"
    assert {p["pass"] for p in reference["passes"]} == set(compress.PASSES)
    assert "num_samples: 128  # int, >= 1, <= 65,536" in text
    assert "limit: null  # int | None, >= 1" in text


def test_validate_without_a_recipe_needs_show(capsys):
    assert main(["validate"]) == 2
    assert "--show" in capsys.readouterr().err
    recipe = REPO / "recipes" / "smollm2-w8-rtn.yaml"
    assert main(["validate", str(recipe), "--show"]) == 0
    assert "name: smollm2-w8-rtn" in capsys.readouterr().out


# ---- property test over mutated shipped recipes ----------------------------------------------
RAW = {p.name: yaml.safe_load(p.read_text()) for p in RECIPES}


def _valid(name: str) -> bool:
    try:
        parse_recipe(copy.deepcopy(RAW[name]))
    except RecipeError:  # e.g. an optional package missing: nothing to mutate from
        return False
    return True


VALID = [name for name in RAW if _valid(name)]
ODD = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([float("nan"), float("inf"), float("-inf"), 10**9, 2**63, -1, 0, -0.5]),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(alphabet="ab./\\\x00\x01\n\x7f\u200b", max_size=6),
    st.lists(st.integers(min_value=-5, max_value=5), max_size=2),
    st.dictionaries(st.sampled_from(["a", "x_y"]), st.integers(min_value=-5, max_value=5),
                    max_size=2),
)
NEW_KEY = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=3, max_size=10)


def _paths(node, prefix=()):
    """Every place in a parsed recipe: (path, whether it is a mapping key)."""
    items = node.items() if isinstance(node, dict) else enumerate(node) \
        if isinstance(node, list) else ()
    for key, value in items:
        yield (*prefix, key), isinstance(node, dict)
        yield from _paths(value, (*prefix, key))


def _containers(node, prefix=()):
    if isinstance(node, dict):
        yield prefix
    if isinstance(node, (dict, list)):
        for key, value in (node.items() if isinstance(node, dict) else enumerate(node)):
            yield from _containers(value, (*prefix, key))


def _at(data, path):
    for key in path:
        data = data[key]
    return data


@st.composite
def mutants(draw):
    """(mutated recipe, the key the mutation touched)."""
    data = copy.deepcopy(RAW[draw(st.sampled_from(VALID))])
    action = draw(st.sampled_from(["delete", "replace", "add"]))
    if action == "add":
        path = draw(st.sampled_from(list(_containers(data))))
        key = draw(NEW_KEY)
        _at(data, path)[key] = draw(ODD)
        return data, key
    places = list(_paths(data))
    if action == "delete":
        places = [p for p in places if p[1]]
    path, _ = draw(st.sampled_from(places))
    parent = _at(data, path[:-1])
    if action == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1]] = draw(ODD)
    return data, next(str(k) for k in reversed(path) if isinstance(k, str))


@settings(max_examples=200, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(mutants())
def test_mutated_recipes_validate_or_name_the_offending_key(mutant):
    data, key = mutant
    try:
        parse_recipe(data, source="mutant.yaml")
    except RecipeError as exc:  # any other exception type fails the test
        message = str(exc)
        assert key in message or repr(key) in message, (key, message)


@pytest.mark.parametrize("first", ["quantize.int4_rtn", "quantize.kv_cache_fp8"])
def test_a_rotation_after_a_quantization_pass_is_refused_before_work(first):
    problems = _problems({"name": "r", "passes": [{"pass": first}, {"pass": "rotate.hadamard"}]})
    assert f"passes[1] (rotate.hadamard) comes after {first}" in problems
    assert "move it before the quantize.* passes" in problems
    parse_recipe({"name": "r", "passes": [{"pass": "rotate.hadamard"}, {"pass": first}]})


def test_yaml_nested_past_the_parser_stack_is_a_recipe_error(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("a:" + " [" * 5000)
    with pytest.raises(RecipeError, match="deep.yaml: nested too deeply"):
        load_recipe(deep)
    with pytest.raises(RecipeError, match="nested too deeply"):
        parse_recipe(deep.read_text())


def test_a_recipe_that_is_not_utf8_is_a_recipe_error(tmp_path):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("name: caf\xe9\npasses:\n  - pass: quantize.int8_rtn\n".encode("latin1"))
    with pytest.raises(RecipeError, match="latin1.yaml: cannot be read as UTF-8 text"):
        load_recipe(latin1)  # was a UnicodeDecodeError traceback


@pytest.mark.parametrize("text", [
    "name: r\nname: s\npasses: []\n",
    "name: r\npasses:\n  - pass: quantize.int4_rtn\n    group_size: 32\n    group_size: 64\n",
], ids=["top_level", "in_a_pass"])
def test_a_key_given_twice_is_refused_not_the_last_one_kept(text):
    with pytest.raises(RecipeError, match="found the key '(name|group_size)' twice"):
        parse_recipe(text, source="r.yaml")


def test_a_merge_key_is_not_a_duplicate():
    text = "passes:\n  - <<: {pass: quantize.int4_rtn}\n    group_size: 32\nname: r\n"
    assert parse_recipe(text, source="r.yaml").passes[0].group_size == 32


def test_set_with_a_value_that_is_not_yaml_is_a_recipe_error(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(BASE))
    assert main(["validate", str(recipe), "--set", "calibration=[1"]) == 2  # was a traceback
    assert "--set 'calibration=[1': not valid YAML" in capsys.readouterr().err
