"""`compare` on tiny saved models: files written, deltas and sizes right, tokenizer mismatch
refused before anything is written; the Pareto front against hand-made cases."""

from __future__ import annotations

import csv
import json

import pytest

from compress.core.errors import DataError
from compress.eval.compare import CompareSettings, compare
from compress.eval.plot import pareto_front
from compress.testing import make_char_tokenizer, make_tiny_llama  # noqa: E402


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("Pack my box with five dozen liquor jugs. " * 40)
    return path


def _save(tmp_path, name, seed, tokenizer=None):
    path = tmp_path / name
    make_tiny_llama(seed=seed).save_pretrained(path)
    (tokenizer or make_char_tokenizer()).save_pretrained(path)
    return str(path)


def test_compare_writes_table_csv_json_png(tmp_path, text_file):
    pytest.importorskip("matplotlib")
    base, var = _save(tmp_path, "base", 0), _save(tmp_path, "var", 1)
    settings = CompareSettings(
        dataset=str(text_file),
        context_length=64,
        ppl_limit=3,
        prompts=2,
        prompt_tokens=8,
        output_tokens=4,
    )
    out = tmp_path / "cmp"
    payload = compare(base, [var], settings, out)
    for name in ("compare.md", "compare.csv", "compare.json", "compare.png"):
        assert (out / name).is_file(), name
    rows = payload["rows"]
    assert [r["variant"] for r in rows] == ["base", "var"]
    assert rows[1]["perplexity_delta_pct"] == pytest.approx(
        100 * (rows[1]["perplexity"] / rows[0]["perplexity"] - 1)
    )
    assert rows[0]["bits_per_weight"] == pytest.approx(32.0)  # fp32 linears
    assert rows[0]["tpot_p50_ms"] > 0 and rows[0]["mbu"] > 0
    assert "memory-bandwidth-bound" in payload["markdown"] or "compute-bound" in payload["markdown"]
    saved = json.loads((out / "compare.json").read_text())
    assert saved["environment"]["threads"] >= 1 and "date" in saved["environment"]
    with (out / "compare.csv").open() as f:
        table = list(csv.DictReader(f))
    assert float(table[1]["perplexity"]) == pytest.approx(rows[1]["perplexity"])


def test_compare_refuses_different_tokenizers(tmp_path, text_file):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(c): c - 29 for c in range(32, 127)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    other = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    base, var = _save(tmp_path, "base", 0), _save(tmp_path, "var", 1, other)
    out = tmp_path / "cmp"
    with pytest.raises(DataError, match="different tokenizer.*not comparable"):
        compare(base, [var], CompareSettings(dataset=str(text_file), latency=False), out)
    assert not out.exists()


@pytest.mark.parametrize(
    "points, maximize, front",
    [
        ([(10, 5.0), (20, 6.0), (15, 7.0)], True, [0, 1]),  # (15, 7) is worse than (20, 6)
        ([(10, 5.0), (20, 6.0), (15, 7.0)], False, [0]),  # smaller x and lower y wins
        ([(1, 1.0), (1, 1.0)], True, [0, 1]),  # ties do not dominate
    ],
    ids=["speed", "size", "ties"],
)
def test_pareto_front(points, maximize, front):
    assert pareto_front(points, maximize) == front
