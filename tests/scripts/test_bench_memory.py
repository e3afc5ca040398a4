"""scripts/bench_memory.py's choice of group size: a W4 "g128" row must quantize the model it
names (GPT-OSS's widths, 2880, take no group of 128; a g128 run there left every weight float
and measured only the reading of the checkpoint)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from compress.testing import synthetic_config

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_memory",
                                                  ROOT / "scripts" / "bench_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("shape", "group"), [
    ("7b", 128), ("70b", 128), ("mixtral-8x7b", 128), ("qwen3-30b-a3b", 128),
    ("gpt-oss-120b", 64), ("gpt-oss-20b", 64),
])
def test_the_group_size_divides_every_input_width(shape, group, tmp_path):
    synthetic_config(shape, num_hidden_layers=1).save_pretrained(tmp_path)
    assert _bench().group_size_for(tmp_path) == group
    config = json.loads((tmp_path / "config.json").read_text())
    widths = [config.get(k) for k in ("hidden_size", "intermediate_size",
                                      "moe_intermediate_size")]
    assert all(w % group == 0 for w in widths if w)


def test_smollm2_width_takes_g64(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
         "head_dim": 64}))
    assert _bench().group_size_for(tmp_path) == 64
