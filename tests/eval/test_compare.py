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


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Perplexity windows and the baseline's top-k log-probs go to the cache: a fresh one."""
    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))


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
    assert rows[0]["kl"] == 0.0 and rows[0]["top1_changed_pct"] == 0.0  # by definition
    kl = payload["details"][var]["perplexity"]["kl"]
    assert rows[1]["kl"] == kl["kl_mean"] > 0 and rows[1]["top1_changed_pct"] > 0
    assert kl["top_k"] == 32 and "| KL | top-1 changed % |" in payload["markdown"]
    assert "top-32 log-probs" in payload["markdown"]
    assert rows[0]["tpot_p50_ms"] > 0 and rows[0]["mbu"] > 0
    assert "memory-bandwidth-bound" in payload["markdown"] or "compute-bound" in payload["markdown"]
    saved = json.loads((out / "compare.json").read_text())
    assert saved["environment"]["threads"] >= 1 and "date" in saved["environment"]
    with (out / "compare.csv").open() as f:
        table = list(csv.DictReader(f))
    assert float(table[1]["perplexity"]) == pytest.approx(rows[1]["perplexity"])
    assert float(table[1]["kl"]) == pytest.approx(rows[1]["kl"])


def test_compare_kl_equals_the_top_k_estimate_of_the_variant(tmp_path, text_file):
    """The KL column is quality.perplexity's with the baseline's top-k (the same windows), and
    a variant identical to the baseline gets KL 0 and no top-1 change."""
    from compress.eval.quality import perplexity
    from compress.io.load import load_model

    base, var, same = _save(tmp_path, "base", 0), _save(tmp_path, "var", 1), _save(
        tmp_path, "same", 0)
    settings = CompareSettings(dataset=str(text_file), context_length=64, ppl_limit=2,
                               latency=False, kl_top_k=8)
    rows = compare(base, [var, same], settings, tmp_path / "cmp")["rows"]
    assert rows[2]["kl"] == 0.0 and rows[2]["top1_changed_pct"] == 0.0
    text = text_file.read_text()
    models = [load_model(m) for m in (base, var)]
    kwargs = dict(context_length=64, limit=2, progress=False)
    ref = perplexity(models[0].model, models[0].tokenizer, text, **kwargs, top_k=8,
                     top_k_dir=tmp_path / "ref")
    kl = perplexity(models[1].model, models[1].tokenizer, text, **kwargs,
                    kl_base=ref.top_k_path).kl
    assert rows[1]["kl"] == kl.kl_mean and rows[1]["top1_changed_pct"] == kl.top1_changed_pct
    no_kl = compare(base, [var], CompareSettings(dataset=str(text_file), context_length=64,
                                                 ppl_limit=2, latency=False, kl_top_k=0),
                    tmp_path / "cmp0")
    assert "kl" not in no_kl["rows"][1] and "| KL |" in no_kl["markdown"]  # column of dashes


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
