"""``calibration.activations``: the hidden states calibrated passes keep between decoder layers
(every sample's, float32: 8.6 GB in and 8.6 GB out for a 70B layer at 128 x 2048 tokens) can
wait in files beside the output, paged by the kernel, instead of in memory. The checkpoint is
the same, bit for bit; ``auto`` does it only when the memory preflight finds they would not
fit, and the result says so."""

from __future__ import annotations

import json
import os

import pytest
import torch

import compress.memory
import compress.quant.calibrated as calibrated
from compress.core.errors import RecipeError
from compress.io.stream import CheckpointReader
from compress.pipeline.job import run_job
from compress.recipe import parse_recipe
from compress.testing import make_char_tokenizer, make_tiny_llama, make_tiny_moe

TEXT = "".join(f"Line {i}: the quick brown fox number {i * 7 % 13} jumps over {i % 5} dogs.\n"
               for i in range(200))
PASSES = {
    "gptq": {"pass": "quantize.gptq", "group_size": 32, "act_order": True},
    "awq": {"pass": "quantize.awq", "group_size": 32, "n_grid": 4, "clip_grid": 4},
    "autoround": {"pass": "quantize.autoround", "group_size": 32, "iters": 3, "batch_size": 2},
}


def _recipe(tmp_path, step: dict, activations: str, samples: int = 3, seq_len: int = 24):
    return parse_recipe({
        "name": "tiny-spill",
        "calibration": {"source": str(tmp_path / "text.txt"), "num_samples": samples,
                        "seq_len": seq_len, "seed": 0, "activations": activations},
        "passes": [step], "export": {"dtype": "auto"},
        "eval": {"baseline": False, "perplexity": None},
    })  # fmt: skip


def _tensors(folder) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(folder)
    return {name: reader.read(name) for name in reader.names()}


def _checkpoint(tmp_path, monkeypatch, model):
    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "ck"
    model.to(torch.bfloat16).save_pretrained(folder)
    make_char_tokenizer().save_pretrained(folder)
    (tmp_path / "text.txt").write_text(TEXT)
    return folder


def _counting_copies(monkeypatch) -> list[int]:
    """Count the file-backed copies the calibration makes (and check each one's folder)."""
    made = []
    original = compress.memory.file_backed_copy

    def counted(tensor, folder):
        assert os.path.basename(folder).startswith(".compress-activations-")
        made.append(tensor.numel())
        return original(tensor, folder)

    monkeypatch.setattr(calibrated, "file_backed_copy", counted)
    return made


def test_a_file_backed_copy_holds_the_same_bits_and_leaves_no_file(tmp_path):
    for tensor in (torch.randn(3, 5, 7), torch.randn(4, 9).to(torch.bfloat16),
                   torch.empty(0, 4)):
        copy = compress.memory.file_backed_copy(tensor, tmp_path)
        assert copy.dtype == tensor.dtype and copy.shape == tensor.shape
        assert torch.equal(copy, tensor)
        assert copy.data_ptr() != tensor.data_ptr() or tensor.numel() == 0
    assert list(tmp_path.iterdir()) == []  # unlinked at once: the mapping keeps the bytes


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "in_memory"])
@pytest.mark.parametrize("kind", list(PASSES))
def test_hidden_states_on_disk_give_the_same_checkpoint(kind, stream, tmp_path, monkeypatch,
                                                        one_thread):
    folder = _checkpoint(tmp_path, monkeypatch,
                         make_tiny_llama(num_hidden_layers=3, tie_word_embeddings=False))
    made = _counting_copies(monkeypatch)
    runs = {}
    for where in ("memory", "disk"):
        runs[where] = run_job(_recipe(tmp_path, PASSES[kind], where), model=str(folder),
                              out_dir=tmp_path / where, stream=stream, progress=False)
        assert runs[where].payload["memory"]["activations"] == where
        assert bool(made) == (where == "disk")  # copies were made, in the disk run only
    a, b = _tensors(tmp_path / "memory"), _tensors(tmp_path / "disk")
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert "hidden states waiting in files" in (tmp_path / "disk" / "results.md").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".compress-activations-")]


def test_moe_gptq_experts_on_disk_equal_memory(tmp_path, monkeypatch, one_thread):
    # enough tokens that each expert gets GPTQ, not the RTN fallback: the tokens entering the
    # experts are kept per sample (in files too), each expert taking its rows of each
    folder = _checkpoint(tmp_path, monkeypatch, make_tiny_moe("mixtral",
                                                              tie_word_embeddings=False))
    step = {"pass": "quantize.gptq", "group_size": 32}
    runs = {where: run_job(_recipe(tmp_path, step, where, samples=16, seq_len=64),
                           model=str(folder), out_dir=tmp_path / where, stream=True,
                           progress=False)
            for where in ("memory", "disk")}  # fmt: skip
    methods = [e["method"] for e in runs["disk"].payload["passes"][0]["metrics"][
        "per_expert"].values()]
    assert methods and set(methods) == {"gptq"}
    a, b = _tensors(tmp_path / "memory"), _tensors(tmp_path / "disk")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_auto_spills_only_when_memory_would_not_do(tmp_path, monkeypatch, one_thread):
    import compress.pipeline.preflight as preflight

    folder = _checkpoint(tmp_path, monkeypatch,
                         make_tiny_llama(num_hidden_layers=2, tie_word_embeddings=False))
    from compress.io.stream import meta_skeleton

    recipe = _recipe(tmp_path, PASSES["gptq"], "auto", samples=8, seq_len=64)
    skeleton = meta_skeleton(folder)
    held, spilled = (preflight.estimate(recipe, folder, streamed=True, skeleton=skeleton,
                                        spill=spill)["peak_bytes"] for spill in (False, True))
    assert spilled < held
    monkeypatch.setattr(preflight, "available_memory_bytes", lambda: (held + spilled) // 2)
    result = run_job(recipe, model=str(folder), out_dir=tmp_path / "auto", progress=False)
    assert result.payload["memory"]["activations"] == "disk"
    assert result.payload["memory"]["estimate"]["peak_bytes"] == spilled
    with pytest.raises(RecipeError, match="needs about .* GiB.*set calibration.activations to "
                                          "disk or auto"):  # asked to keep them in memory
        run_job(_recipe(tmp_path, PASSES["gptq"], "memory", samples=8, seq_len=64),
                model=str(folder), out_dir=tmp_path / "memory", progress=False)
    monkeypatch.setattr(preflight, "available_memory_bytes", lambda: held + 1)
    result = run_job(recipe, model=str(folder), out_dir=tmp_path / "fits", progress=False)
    assert result.payload["memory"]["activations"] == "memory"
    saved = json.loads((tmp_path / "fits" / "results.json").read_text())
    assert saved["memory"]["activations"] == "memory"


def test_a_full_disk_stops_the_job_in_one_line_and_leaves_nothing(tmp_path, monkeypatch,
                                                                  one_thread):
    # the bytes are written before they are mapped: a full disk is this error, not a SIGBUS
    # when the kernel later fails to write a page of a sparse file back (/dev/full: ENOSPC)
    import tempfile

    folder = _checkpoint(tmp_path, monkeypatch,
                         make_tiny_llama(num_hidden_layers=2, tie_word_embeddings=False))
    original = tempfile.mkstemp

    def full_disk(*args, **kwargs):
        handle, name = original(*args, **kwargs)
        if ".compress-activations-" in name:  # only the spilled files' writes fail
            os.close(handle)
            handle = os.open("/dev/full", os.O_WRONLY)
        return handle, name

    monkeypatch.setattr(tempfile, "mkstemp", full_disk)
    from compress.core.errors import OutputError

    with pytest.raises(OutputError, match=r"cannot keep the calibration's hidden states in .*No "
                                          r"space left on device.*activations: memory"):
        run_job(_recipe(tmp_path, PASSES["gptq"], "disk"), model=str(folder),
                out_dir=tmp_path / "out", stream=True, progress=False)
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "text.txt"]  # no spill folder
