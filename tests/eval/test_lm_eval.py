"""lm-eval plumbing on the tiny in-memory model: the log-likelihoods lm-eval records are the
ones our model gives, accuracy follows from them, unknown tasks and missing folders fail."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval")

from compress.core.errors import DataError  # noqa: E402
from compress.eval.lm_eval_tasks import run_tasks  # noqa: E402


def _loglikelihood(model, tokenizer, context, continuation):
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    cont = tokenizer(continuation, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)
    return sum(float(logp[len(ctx) + i - 1, t]) for i, t in enumerate(cont))


def test_piqa_on_tiny_model_with_limit(tiny_model, tiny_tokenizer, data_dir):
    out = run_tasks(
        tiny_model,
        tiny_tokenizer,
        ["piqa_local"],
        limit=3,
        log_samples=True,
        data_dir=str(data_dir),
    )
    result = out["tasks"]["piqa_local"]
    assert result["samples_evaluated"] == 3 and out["settings"]["limit"] == 3
    correct = 0
    for sample in out["samples"]["piqa_local"]:
        lls = [resp[0] for resp in sample["filtered_resps"]]
        for (context, continuation), ll in zip(sample["arguments"], lls, strict=True):
            assert ll == pytest.approx(
                _loglikelihood(tiny_model, tiny_tokenizer, context, continuation), rel=1e-4
            )
        correct += max(range(len(lls)), key=lls.__getitem__) == sample["target"]
    assert result["acc"] == pytest.approx(correct / 3)
    assert result["acc_stderr"] is not None


def test_unknown_task_lists_available(tiny_model, tiny_tokenizer, data_dir):
    with pytest.raises(DataError, match="piqa_locl.*did you mean 'piqa_local'.*Available"):
        run_tasks(tiny_model, tiny_tokenizer, ["piqa_locl"], data_dir=str(data_dir))


def test_missing_task_folder(tiny_model, tiny_tokenizer, tmp_path):
    with pytest.raises(DataError, match="task folder not found"):
        run_tasks(tiny_model, tiny_tokenizer, ["piqa_local"], tasks_dir=str(tmp_path / "nope"))


def test_cli_eval_runs_tasks_on_a_saved_model(tmp_path, data_dir, capsys):
    import json

    from compress.cli import main
    from compress.testing import make_char_tokenizer, make_tiny_llama

    model_dir = tmp_path / "tiny"
    make_tiny_llama(seed=0).save_pretrained(model_dir)
    make_char_tokenizer().save_pretrained(model_dir)
    code = main(["eval", str(model_dir), "--no-perplexity", "--tasks", "piqa_local",
                 "--task-limit", "2", "--data-dir", str(data_dir), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out)
    assert "perplexity" not in out
    piqa = out["lm_eval"]["tasks"]["piqa_local"]
    assert piqa["samples_evaluated"] == 2 and 0.0 <= piqa["acc"] <= 1.0


def test_cli_eval_unknown_task_fails_before_loading(tmp_path, data_dir, capsys):
    from compress.cli import main

    code = main(["eval", str(tmp_path / "no-such-model"), "--tasks", "piqa_locl",
                 "--data-dir", str(data_dir)])
    assert code == 2
    err = capsys.readouterr().err
    assert "piqa_locl" in err and "did you mean 'piqa_local'" in err
