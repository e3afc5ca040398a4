"""`compress compare` workloads (batch, poisson, trace; hf and runtime engines) and speculative
decoding from the CLI, end to end on tiny saved models: the JSON records the workload, every
request gets its tokens, bad flags fail before any model loads. No timed assertions."""

from __future__ import annotations

import json

import pytest
import torch

from compress.cli import main
from compress.core.errors import DataError
from compress.eval.compare import CompareSettings, compare
from compress.eval.latency import runtime_stream
from compress.eval.workload import Request, StreamEngine, serve
from compress.runtime.engine import Runtime
from compress.testing import make_char_tokenizer, make_tiny_llama

TINY = dict(dataset=None, context_length=32, ppl_limit=1, prompts=2, prompt_tokens=8,
            output_tokens=3)


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("Pack my box with five dozen liquor jugs. " * 40)
    return path


@pytest.fixture
def models(tmp_path):
    return _save(tmp_path, "base", 0), _save(tmp_path, "var", 1)


def _save(tmp_path, name, seed, tokenizer=None):
    # initializer_range 0.3: at the default 0.02 a random model repeats one token, and a
    # different draft would then be accepted everywhere, testing nothing.
    path = tmp_path / name
    make_tiny_llama(seed=seed, initializer_range=0.3).save_pretrained(path)
    (tokenizer or make_char_tokenizer()).save_pretrained(path)
    return str(path)


def _settings(text_file, **changes):
    return CompareSettings(**{**TINY, "dataset": str(text_file), **changes})


def _requests(detail):
    return detail["latency"]["requests"]


@pytest.mark.parametrize("engine", ["hf", "runtime"])
def test_batch_workload_one_row_set_per_batch_size(tmp_path, text_file, models, engine):
    settings = _settings(text_file, workload="batch", batch_sizes=[1, 2], engine=engine)
    payload = compare(models[0], [models[1]], settings, tmp_path / "out")
    rows = payload["rows"]
    assert [(r["variant"], r["batch_size"]) for r in rows] == [
        ("base", 1), ("var", 1), ("base", 2), ("var", 2)
    ]
    assert "tpot_p50_ms_delta_pct" in rows[3] and "tpot_p50_ms_delta_pct" not in rows[2]
    saved = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert saved["settings"]["workload"] == "batch" and saved["settings"]["engine"] == engine
    assert saved["workload"]["kind"] == "batch"
    assert [r["batch_size"] for r in saved["workload"]["runs"]] == [1, 2]
    assert saved["workload"]["runs"][1]["arrival_s"] == [0.0, 0.0]
    for detail in saved["details"].values():
        by_size = detail["latency"]["by_batch_size"]
        for size in (1, 2):
            requests = by_size[str(size)]["requests"]
            assert len(requests) == size
            assert all(r["output_tokens"] == 3 and r["prompt_tokens"] == 8 for r in requests)
    assert "| batch |" in payload["markdown"] and "output tok/s" in payload["markdown"]
    if engine == "runtime":  # continuous batching over the paged cache, its use recorded
        assert all(r["engine"].startswith("runtime scheduler (continuous") for r in rows)
        for detail in saved["details"].values():
            cache = detail["latency"]["by_batch_size"]["2"]["kv_cache"]
            assert cache["kv_bytes_peak"] > 0 and cache["preemptions"] == 0


def test_poisson_workload_through_the_cli(tmp_path, text_file, models, capsys):
    out = tmp_path / "out"
    code = main(["compare", *models, "--dataset", str(text_file), "--limit", "1",
                 "--context-length", "32", "--prompt-tokens", "8", "--output-tokens", "3",
                 "--workload", "poisson", "--rate", "200", "--requests", "3",
                 "--max-batch", "2", "--kv-dtype", "bfloat16", "--out", str(out),
                 "--no-progress"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    saved = json.loads((out / "compare.json").read_text())
    run = saved["workload"]["runs"][0]
    assert all("paged bfloat16 KV" in row["engine"] for row in saved["rows"])
    assert saved["workload"]["kind"] == "poisson" and run["rate_per_s"] == 200.0
    assert run["max_batch"] == 2 and run["requests"] == 3
    assert run["arrival_s"] == sorted(run["arrival_s"]) and run["arrival_s"][0] > 0
    for detail in saved["details"].values():
        assert [r["output_tokens"] for r in _requests(detail)] == [3, 3, 3]
        assert detail["latency"]["summary"]["goodput"]["requests"] == 3


def test_trace_workload_uses_the_trace_lengths(tmp_path, text_file, models):
    trace = tmp_path / "trace.jsonl"
    lines = [{"arrival_s": 0.0}, {"arrival_s": 0.001, "prompt_tokens": 5, "output_tokens": 2},
             {"arrival_s": 0.002, "output_tokens": 4}]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    settings = _settings(text_file, workload="trace", trace=str(trace), max_batch=2,
                         engine="runtime")
    payload = compare(models[0], [models[1]], settings, tmp_path / "out")
    assert payload["workload"]["runs"][0]["trace"] == str(trace)
    for detail in payload["details"].values():
        got = [(r["prompt_tokens"], r["output_tokens"]) for r in _requests(detail)]
        assert got == [(8, 3), (5, 2), (8, 4)]


def test_single_workload_on_the_runtime_engine(tmp_path, text_file, models):
    settings = _settings(text_file, engine="runtime", rounds=2)
    payload = compare(models[0], [models[1]], settings, tmp_path / "out")
    assert payload["workload"] == {
        "kind": "single", "engine": "runtime", "rounds": 2, "runs": payload["workload"]["runs"]
    }
    for detail in payload["details"].values():
        assert [r["output_tokens"] for r in _requests(detail)] == [3] * 4  # 2 prompts x 2 rounds
    assert payload["rows"][0]["mbu"] is not None  # single stream: TPOT is one decode step


def test_runtime_is_the_default_engine_and_a_fallback_row_is_marked(tmp_path, text_file, models):
    # A GPT-2 variant: the runtime does not run it, so its latency comes from transformers, and
    # the row and a footnote say so; the Llama baseline is timed on the runtime.
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=320, n_positions=64, n_embd=32, n_layer=1,
                                      n_head=2, initializer_range=0.3)).eval()
    gpt2.save_pretrained(tmp_path / "gpt2")
    make_char_tokenizer().save_pretrained(tmp_path / "gpt2")
    settings = _settings(text_file)
    assert settings.engine == "runtime"
    payload = compare(models[0], [str(tmp_path / "gpt2")], settings, tmp_path / "out")
    assert [r["engine"] for r in payload["rows"]] == ["runtime", "hf fallback"]
    header = payload["markdown"].splitlines()[0]
    assert "| engine |" in header
    assert "Engine hf fallback: gpt2" in payload["markdown"]


def test_runtime_pool_interleaves_with_own_caches():
    model = make_tiny_llama(initializer_range=0.3)
    prompts = [[1, 5, 9, 33, 70], [1, 40, 50], [1, 200, 13, 14]]
    expected = Runtime(model, max_seq_len=64, compile=False).generate(prompts[:1], 6)
    expected += [Runtime(model, max_seq_len=64, compile=False).generate([p], 6)[0]
                 for p in prompts[1:]]
    stream = runtime_stream(model, max_seq_len=64, slots=2)
    timings, _ = serve(StreamEngine(stream), [Request(p, 6) for p in prompts], max_batch=2)
    assert [t.tokens for t in timings] == expected


def test_speculative_with_itself_as_draft_accepts_everything(tmp_path, text_file, models):
    settings = _settings(text_file, latency=False, draft=models[0], draft_k=3, output_tokens=6)
    payload = compare(models[0], [models[1]], settings, tmp_path / "out")
    spec = payload["speculative"]
    assert spec["draft"] == models[0] and spec["k"] == 3 and spec["prompts"] == 2
    assert spec["acceptance_rate"] == 1.0 and spec["outputs_identical"]
    assert spec["tokens_per_target_forward"] > 1
    assert "Speculative decoding of the baseline" in payload["markdown"]
    saved = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert saved["speculative"]["outputs_identical"] is True
    assert "same output as greedy" in (tmp_path / "out" / "compare.md").read_text()


def test_speculative_with_another_draft_keeps_greedy_output(tmp_path, text_file, models):
    settings = _settings(text_file, draft=models[1], output_tokens=6, rounds=1)
    payload = compare(models[0], [models[1]], settings, tmp_path / "out")
    spec = payload["speculative"]
    assert spec["outputs_identical"] and spec["mismatches"] == []
    assert 0.0 <= spec["acceptance_rate"] < 1.0  # a different model: some proposals rejected
    assert spec["plain_tpot_ms"]["n"] == spec["speculative_tpot_ms"]["n"] == 2


def test_draft_with_another_tokenizer_is_refused(tmp_path, text_file, models):
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(c): c - 29 for c in range(32, 127)}}
    tok = Tokenizer(tok_models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    other = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    draft = _save(tmp_path, "draft", 2, other)
    out = tmp_path / "out"
    with pytest.raises(DataError, match="--draft .* different tokenizer"):
        compare(models[0], [models[1]], _settings(text_file, draft=draft), out)
    assert not out.exists()


def test_unknown_workload_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["compare", "base", "var", "--workload", "bursty"])
    assert exc.value.code == 2
    assert "--workload" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, flag",
    [
        (["--workload", "poisson"], "--rate"),
        (["--workload", "trace", "--trace", "missing.jsonl"], "--trace"),
        (["--workload", "trace"], "--trace"),
        (["--rate", "3"], "--rate"),
        (["--workload", "batch", "--batch-sizes", "0,2"], "--batch-sizes"),
    ],
    ids=["poisson-no-rate", "trace-missing", "trace-no-file", "rate-not-poisson", "batch-zero"],
)
def test_bad_workload_flags_exit_2_naming_the_flag(tmp_path, capsys, flags, flag):
    # The models do not exist: the settings are checked before any model is loaded. Errors
    # argparse catches raise SystemExit(2); the others return 2 from main.
    try:
        code = main(["compare", "no-such-base", "no-such-var", "--out", str(tmp_path / "o"),
                     *flags])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert flag in err
    assert not (tmp_path / "o").exists()


def test_length_ranges_from_the_cli_draw_per_request(tmp_path, text_file, models, capsys):
    out = tmp_path / "out"
    code = main(["compare", *models, "--dataset", str(text_file), "--limit", "1",
                 "--context-length", "32", "--prompts", "6", "--prompt-tokens", "4-9",
                 "--output-tokens", "2-5", "--engine", "runtime", "--out", str(out),
                 "--no-progress"])
    assert code == 0, capsys.readouterr().err
    saved = json.loads((out / "compare.json").read_text())
    assert saved["settings"]["prompt_tokens"] == [4, 9]
    for detail in saved["details"].values():
        requests = _requests(detail)
        assert all(4 <= r["prompt_tokens"] <= 9 and 2 <= r["output_tokens"] <= 5
                   for r in requests)
        assert len({(r["prompt_tokens"], r["output_tokens"]) for r in requests}) > 1
    # the same seeded draw for every variant
    a, b = (_requests(d) for d in saved["details"].values())
    assert [r["prompt_tokens"] for r in a] == [r["prompt_tokens"] for r in b]
    assert "4-9 (uniform) prompt + 2-5 (uniform) output tokens" in (out / "compare.md").read_text()


@pytest.mark.parametrize("flag,value", [("--prompt-tokens", "9-4"), ("--output-tokens", "0"),
                                        ("--prompt-tokens", "a-b")])
def test_bad_length_ranges_are_refused(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["compare", "base", "var", flag, value])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err
