"""Helpers shared by the checkpoint tests: a tiny job's recipe and every tensor of a folder."""

from __future__ import annotations

import textwrap

import torch
import yaml

from compress.io.checkpoint import CheckpointReader
from compress.recipe import parse_recipe


def tiny_job_recipe(tmp_path, passes: str, name: str = "tiny-job"):
    """``passes`` (YAML) on 3 x 24 tokens of a text file in ``tmp_path``; the export in the
    source's dtype, no evaluation."""
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    return parse_recipe({
        "name": name,
        "calibration": {"source": str(tmp_path / "text.txt"), "num_samples": 3, "seq_len": 24,
                        "seed": 0},
        "passes": yaml.safe_load(textwrap.dedent(passes)),
        "export": {"dtype": "auto"},
        "eval": {"baseline": False, "perplexity": None},
    })


def stored_tensors(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder, as our reader reads it."""
    reader = CheckpointReader(folder)
    return {name: reader.read(name) for name in reader.names()}
