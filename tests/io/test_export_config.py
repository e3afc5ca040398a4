"""The JSON files an export writes are read the same way by every transformers we support.

transformers 5 keeps RoPE settings only in ``rope_parameters``; 4.x (pyproject allows >=4.56)
reads ``rope_theta``/``rope_scaling`` and silently uses theta 10000 without them, and does not
know the tokenizer class name ``TokenizersBackend``. A local path in ``_name_or_path`` leaks the
exporting machine. scripts/check_dependency_floor.sh loads exports on the real floor; these are
the fast checks on the files themselves.
"""

from __future__ import annotations

import json
import re

import pytest

from compress.core.registry import CompressionState, run_passes
from compress.io.export import export_checkpoint
from compress.quant.rtn import Int4RtnConfig
from compress.testing import make_tiny_llama

JSON_FILES = ("config.json", "tokenizer_config.json", "generation_config.json")
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _assert_no_local_paths(out, tmp_path):
    for name in JSON_FILES:
        data = json.loads((out / name).read_text())
        for key in ("_name_or_path", "name_or_path", "is_local", "local_files_only"):
            assert key not in data, f"{name} has {key}"
        for s in _strings(data):
            looks_absolute = s.startswith(("/", "~")) or re.match(r"^[A-Za-z]:[\\/]", s)
            assert not looks_absolute and str(tmp_path) not in s, f"{name}: local path {s!r}"


def _tokenizer_from_disk(tiny_tokenizer, tmp_path):
    """The tokenizer as a real run has it: loaded from a local directory (the embedded model's
    cache), which is what makes transformers remember where it came from."""
    from transformers import AutoTokenizer

    tiny_tokenizer.save_pretrained(tmp_path / "source-tokenizer")
    return AutoTokenizer.from_pretrained(tmp_path / "source-tokenizer")


def _source_rope(config):
    rope = getattr(config, "rope_parameters", None)
    if rope:  # transformers 5
        return dict(rope)
    return {"rope_theta": config.rope_theta, **(config.rope_scaling or {})}


@pytest.mark.parametrize("quantize", [True, False], ids=["int4", "unquantized"])
def test_config_has_legacy_rope_fields_and_no_local_paths(tiny_tokenizer, tmp_path, quantize):
    model = make_tiny_llama(rope_theta=100000.0)
    model.config._name_or_path = str(tmp_path / "cache" / "models" / "tiny")  # as a cache load
    if quantize:
        run_passes(model, [Int4RtnConfig(group_size=32)], CompressionState(progress=False))
    tokenizer = _tokenizer_from_disk(tiny_tokenizer, tmp_path)
    out = export_checkpoint(model, tokenizer, tmp_path / "ckpt")
    config = json.loads((out / "config.json").read_text())
    assert _source_rope(model.config)["rope_theta"] == 100000.0
    assert config["rope_theta"] == 100000.0  # what transformers 4.x reads
    assert config["rope_scaling"] is None  # default RoPE: 4.x wants null, not a dict
    if "rope_parameters" in config:  # what transformers 5 reads
        assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert ("quantization_config" in config) == quantize
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] != "TokenizersBackend"  # unknown to transformers 4.x
    _assert_no_local_paths(out, tmp_path)


def test_scaled_rope_is_written_as_rope_scaling_too(tiny_tokenizer, tmp_path):
    model = make_tiny_llama(rope_parameters=dict(LLAMA3_ROPE))
    source = _source_rope(model.config)
    out = export_checkpoint(model, tiny_tokenizer, tmp_path / "ckpt")
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == source["rope_theta"] == 500000.0
    scaling = config["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
    assert scaling["original_max_position_embeddings"] == 32
    if "rope_parameters" in config:
        # transformers 5 takes a non-null rope_scaling in place of rope_parameters: same dict
        assert scaling == config["rope_parameters"]


@pytest.mark.parametrize("rope", [{"rope_theta": 100000.0}, {"rope_parameters": LLAMA3_ROPE}],
                         ids=["theta1e5", "llama3"])
def test_exported_config_reads_back_the_same_rope(tiny_tokenizer, tmp_path, rope):
    from transformers import AutoConfig

    model = make_tiny_llama(**{k: v if k == "rope_theta" else dict(v) for k, v in rope.items()})
    out = export_checkpoint(model, tiny_tokenizer, tmp_path / "ckpt")
    assert _source_rope(AutoConfig.from_pretrained(out)) == _source_rope(model.config)


def test_bnb_export_has_legacy_rope_fields_and_no_local_paths(tiny_tokenizer, tmp_path):
    pytest.importorskip("bitsandbytes")
    from compress.quant.bnb import bnb_quantize
    from compress.recipe import parse_recipe

    model = make_tiny_llama(rope_theta=100000.0)
    model.config._name_or_path = str(tmp_path / "cache" / "models" / "tiny")
    cfg = parse_recipe({"name": "t", "passes": [{"pass": "quantize.bnb", "format": "nf4"}]})
    bnb_quantize(model, cfg.passes[0], CompressionState(progress=False))
    out = export_checkpoint(model, _tokenizer_from_disk(tiny_tokenizer, tmp_path), tmp_path / "q")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "bitsandbytes"
    assert config["rope_theta"] == 100000.0 and config["rope_scaling"] is None
    _assert_no_local_paths(out, tmp_path)
