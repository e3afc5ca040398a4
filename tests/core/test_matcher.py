"""The one module matcher (``compress.core.matches``): ``re:`` patterns are ``re.match`` on the
module name (anchored at the start, not at the end), as compressed-tensors reads them; other
patterns are an exact module name or exact class name. Pass targets, per-layer overrides and the
checkpoint loader all go through it."""

from __future__ import annotations

import logging

import pytest
from torch import nn

from compress.core.matcher import matches, target_modules
from compress.core.registry import CompressionState, PassConfig, run_passes
from compress.quant.linear import QuantLinear
from compress.quant.rtn import Int4RtnConfig
from compress.quant.scheme import LayerOverride

NAME = "model.layers.1.mlp.down_proj"


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("re:.*down_proj", True),
        ("re:down_proj", False),  # re.match: anchored at the start of the name
        (r"re:model\.layers\.1", True),  # ... but not at its end
        (r"re:.*layers\.1\.mlp\.down_proj$", True),
        (r"re:.*layers\.1\.mlp$", False),
        (NAME, True),  # exact name
        ("down_proj", False),  # a plain name is never a substring or suffix match
        ("Linear", True),  # exact class name
    ],
)
def test_re_patterns_match_from_the_start_of_the_name(pattern, expected):
    assert matches(NAME, nn.Linear(2, 2), pattern) is expected


def test_class_names_match_exactly_not_base_classes():
    class MyLinear(nn.Linear):
        pass

    assert not matches("x", MyLinear(2, 2), "Linear")
    assert matches("x", MyLinear(2, 2), "MyLinear")
    assert not matches("x", None, "Linear")  # names only when no module is given


def test_re_semantics_agree_with_compressed_tensors():
    match = pytest.importorskip("compressed_tensors.utils.match")
    names = [NAME, "lm_head", "model.layers.10.self_attn.q_proj", "model.embed_tokens"]
    patterns = ["re:.*down_proj", "re:down_proj", r"re:model\.layers\.1", "re:.*lm_head",
                r"re:.*layers\.1\.", "lm_head", "re:.*(q|k)_proj$"]
    for name in names:
        for pattern in patterns:
            assert matches(name, None, pattern) == match.match_name(name, pattern), (name, pattern)


def test_targets_ignore_and_overrides_share_the_semantics(tiny_model, caplog):
    cfg = PassConfig(targets=("re:.*q_proj",), ignore=(r"re:model\.layers\.1\.",))
    assert [n for n, _ in target_modules(tiny_model, cfg)] == ["model.layers.0.self_attn.q_proj"]
    assert not list(target_modules(tiny_model, PassConfig(targets=("re:q_proj",))))
    assert LayerOverride(layers="re:.*mlp").matches(NAME)
    assert not LayerOverride(layers="re:mlp").matches(NAME)

    searched = {"layers": r"re:layers\.1\.mlp\.down_proj", "n_bits": 8}  # never matches
    with caplog.at_level(logging.WARNING):
        run_passes(tiny_model, [Int4RtnConfig(group_size=32, overrides=[searched])],
                   CompressionState(progress=False))
    assert "matches none of the" in caplog.text and "re:.*" in caplog.text
    layer = tiny_model.get_submodule(NAME)
    assert isinstance(layer, QuantLinear) and layer.scheme.n_bits == 4
