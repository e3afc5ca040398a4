"""Resumable perplexity (tiny model): an interrupted evaluation continues where it stopped, a
finished one is read back, and either way the result equals a fresh one exactly."""

from __future__ import annotations

import json

import pytest
import torch

from compress.eval.quality import WINDOWS_PER_FORWARD, perplexity

TEXT = "The quick brown fox jumps over the lazy dog. " * 12
SETTINGS = dict(context_length=64, progress=False)


def _interrupt_after(model, calls: int):
    """A forward pre-hook that raises KeyboardInterrupt (as Ctrl-C would) on call ``calls + 1``;
    hooks leave the state dict, hence the state key, unchanged."""
    seen = []

    def hook(module, args):
        seen.append(1)
        if len(seen) > calls:
            raise KeyboardInterrupt

    return model.register_forward_pre_hook(hook)


def test_interrupted_evaluation_resumes_to_the_fresh_result(tiny_model, tiny_tokenizer, tmp_path):
    fresh = perplexity(tiny_model, tiny_tokenizer, TEXT, **SETTINGS)
    assert fresh.windows > 2 * WINDOWS_PER_FORWARD
    handle = _interrupt_after(tiny_model, 1)  # one forward scores WINDOWS_PER_FORWARD windows
    with pytest.raises(KeyboardInterrupt):  # saved on the way out, although far from 10 s
        perplexity(tiny_model, tiny_tokenizer, TEXT, **SETTINGS, state_dir=tmp_path)
    handle.remove()
    (state_file,) = tmp_path.glob("*.json")
    assert len(json.loads(state_file.read_text())["window_nll"]) == WINDOWS_PER_FORWARD
    resumed = perplexity(tiny_model, tiny_tokenizer, TEXT, **SETTINGS, state_dir=tmp_path)
    assert resumed.reused_windows == WINDOWS_PER_FORWARD
    assert resumed == fresh  # every field, bit for bit (reused_windows is not compared)
    assert resumed.perplexity == fresh.perplexity and resumed.nll_mean == fresh.nll_mean


def test_finished_evaluation_is_read_back_without_running_the_model(
    tiny_model, tiny_tokenizer, tmp_path
):
    first = perplexity(tiny_model, tiny_tokenizer, TEXT, **SETTINGS, state_dir=tmp_path)
    handle = _interrupt_after(tiny_model, 0)  # any forward would raise
    again = perplexity(tiny_model, tiny_tokenizer, TEXT, **SETTINGS, state_dir=tmp_path)
    fewer = perplexity(tiny_model, tiny_tokenizer, TEXT, **SETTINGS, limit=3, state_dir=tmp_path)
    handle.remove()
    assert again == first and again.reused_windows == first.windows
    assert fewer == perplexity(tiny_model, tiny_tokenizer, TEXT, **SETTINGS, limit=3)
    assert fewer.protocol["selection"] == "first 3"
    assert fewer.protocol["windows_in_text"] == first.windows


def test_other_weights_or_no_resume_recompute(tiny_model, tiny_tokenizer, tmp_path):
    perplexity(tiny_model, tiny_tokenizer, TEXT, **SETTINGS, state_dir=tmp_path)
    fresh = perplexity(tiny_model, tiny_tokenizer, TEXT, **SETTINGS, state_dir=tmp_path,
                       resume=False)
    assert fresh.reused_windows == 0
    with torch.no_grad():
        tiny_model.model.norm.weight.mul_(1.5)
    changed = perplexity(tiny_model, tiny_tokenizer, TEXT, **SETTINGS, state_dir=tmp_path)
    assert changed.reused_windows == 0 and changed.perplexity != fresh.perplexity
    assert len(list(tmp_path.glob("*.json"))) == 2  # one state per weights


def test_the_same_weights_under_another_config_recompute(tiny_model, tiny_tokenizer, tmp_path):
    # the state key holds the config: the same tensors with another RoPE base compute other
    # numbers, so the first config's saved windows must not be read back for the second
    first = perplexity(tiny_model, tiny_tokenizer, TEXT, **SETTINGS, state_dir=tmp_path)
    tiny_model.config.rope_parameters = {**tiny_model.config.rope_parameters,
                                         "rope_theta": 100.0}
    tiny_model.model.rotary_emb.__init__(tiny_model.config)
    other = perplexity(tiny_model, tiny_tokenizer, TEXT, **SETTINGS, state_dir=tmp_path)
    assert other.reused_windows == 0 and other.perplexity != first.perplexity
    assert other == perplexity(tiny_model, tiny_tokenizer, TEXT, **SETTINGS)
    tiny_model.config._name_or_path = "/elsewhere"  # where it came from is not what it computes
    again = perplexity(tiny_model, tiny_tokenizer, TEXT, **SETTINGS, state_dir=tmp_path)
    assert again.reused_windows == again.windows


def test_unreadable_state_is_ignored(tiny_model, tiny_tokenizer, tmp_path):
    perplexity(tiny_model, tiny_tokenizer, TEXT, **SETTINGS, state_dir=tmp_path)
    (state_file,) = tmp_path.glob("*.json")
    state_file.write_text("{not json")
    result = perplexity(tiny_model, tiny_tokenizer, TEXT, **SETTINGS, state_dir=tmp_path)
    assert result.reused_windows == 0
    assert json.loads(state_file.read_text())["window_nll"]  # rewritten


@pytest.mark.parametrize("edit", [
    lambda s: s.update(window_nll=[float("nan")] * len(s["window_nll"])),
    lambda s: s.update(window_nll=[-1.0] * len(s["window_nll"])),
    lambda s: s.update(window_tokens=[0] * len(s["window_tokens"])),
    lambda s: s.update(kl={"base": {"window_kl": [float("inf")], "window_kl_sq": [0.0],
                                    "window_changed": [0]}}),
], ids=["nan_nll", "negative_nll", "empty_window", "infinite_kl"])
def test_a_damaged_state_is_scored_again_not_reported(edit, tiny_model, tiny_tokenizer,
                                                      tmp_path):
    # these were resumed as they were: a NaN or negative perplexity, a ZeroDivisionError
    fresh = perplexity(tiny_model, tiny_tokenizer, TEXT, **SETTINGS, state_dir=tmp_path)
    (state_file,) = tmp_path.glob("*.json")
    state = json.loads(state_file.read_text())
    edit(state)
    state_file.write_text(json.dumps(state))
    result = perplexity(tiny_model, tiny_tokenizer, TEXT, **SETTINGS, state_dir=tmp_path)
    assert result.reused_windows == 0 and result.perplexity == fresh.perplexity


def test_a_state_that_cannot_be_saved_is_an_output_error(tiny_model, tiny_tokenizer, tmp_path):
    from compress.core.errors import OutputError
    from compress.eval.quality import state_key

    ids = torch.tensor(tiny_tokenizer(TEXT, add_special_tokens=False)["input_ids"])
    (tmp_path / f"{state_key(tiny_model, ids, 64, 64)}.json").mkdir()  # in the file's place
    with pytest.raises(OutputError, match="cannot save evaluation state .* COMPRESS_CACHE_DIR"):
        perplexity(tiny_model, tiny_tokenizer, TEXT, **SETTINGS, state_dir=tmp_path)
