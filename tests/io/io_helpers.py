"""Helpers shared by the checkpoint tests: a tiny job's recipe, every tensor of a folder, and a
job's exports from a quantized source and its 16-bit twin compared."""

from __future__ import annotations

import textwrap

import torch
import yaml

from compress.io.checkpoint import CheckpointReader
from compress.pipeline.job import run_job
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


def assert_same_exports_as_the_twin(tmp_path, recipe, source, twin) -> dict:
    """Run ``recipe`` on ``source`` (a quantized release: fp8, MXFP4) streamed and in memory and
    on its 16-bit ``twin`` (the dequantized values) streamed: the three exports are equal,
    tensor for tensor. Returns the streamed export's config.json from ``source``."""
    import json

    for folder, stream in ((source, True), (source, False), (twin, True)):
        run_job(recipe, model=str(folder), out_dir=tmp_path / f"{folder.name}-{stream}",
                stream=stream, progress=False)
    reference = stored_tensors(tmp_path / f"{twin.name}-True")
    for out in (f"{source.name}-True", f"{source.name}-False"):
        got = stored_tensors(tmp_path / out)
        assert set(got) == set(reference)
        for name, tensor in reference.items():
            assert torch.equal(got[name], tensor), (out, name)
    return json.loads((tmp_path / f"{source.name}-True" / "config.json").read_text())
