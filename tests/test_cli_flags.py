"""Flags outside their bounds are one ``error:`` line and exit status 2, before any model loads
(compress.cli_flags); they were tracebacks from the runtime, a silently shortened evaluation
(--limit -2) or a static cache allocated until the process was killed (--max-new-tokens)."""

from __future__ import annotations

import pytest

from compress.cli import main

MISSING = "no-such-model"  # the flag check comes first: the model is never looked up

BAD_FLAGS = {
    "eval_context_length": (["eval", MISSING, "--context-length", "0"], "--context-length 0"),
    "eval_stride_zero": (["eval", MISSING, "--stride", "0"], "--stride 0 must be >= 1"),
    "eval_stride_past_context": (["eval", MISSING, "--context-length", "32", "--stride", "64"],
                                 "--stride 64 must be <= --context-length"),
    "eval_negative_limit": (["eval", MISSING, "--limit", "-2"], "--limit -2 must be >= 1"),
    "compare_limit": (["compare", MISSING, MISSING, "--limit", "0"], "--limit 0 must be >= 1"),
    "generate_no_tokens": (["generate", "hi", "--model", MISSING, "--max-new-tokens", "0"],
                           "--max-new-tokens 0 must be >= 1"),
    "generate_nan_temperature": (["generate", "hi", "--model", MISSING, "--temperature", "nan"],
                                 "--temperature nan must be finite and >= 0"),
    # a traceback from the sampler after the model loaded
    "generate_inf_temperature": (["generate", "hi", "--model", MISSING, "--temperature", "inf"],
                                 "--temperature inf must be finite and >= 0"),
    # undecodable argv bytes arrive as lone surrogates: the tokenizer raised a TypeError
    "generate_prompt_not_utf8": (["generate", "\udcff\udcfe", "--model", MISSING],
                                 "the prompt is not valid UTF-8 text"),
    "generate_top_p": (["generate", "hi", "--model", MISSING, "--top-p", "2"],
                       "--top-p 2.0 must be in (0, 1]"),
    "generate_top_k": (["generate", "hi", "--model", MISSING, "--top-k", "0"],
                       "--top-k 0 must be >= 1"),
    "generate_seed": (["generate", "hi", "--model", MISSING, "--seed", str(2**70)],
                      "must be a 64-bit integer"),
    "serve_model_len": (["serve", MISSING, "--max-model-len", "0"], "--max-model-len 0"),
    # wrote to the default out/<name> without a word
    "run_out_empty": (["run", "recipes/smollm2-w8-rtn.yaml", "--out", ""], "--out is empty"),
    "serve_threads": (["serve", MISSING, "--threads", "-2"], "--threads -2 must be >= 1"),
    "serve_port": (["serve", MISSING, "--port", "-1"], "--port -1 must be in 0..65535"),
    "serve_kv_memory": (["serve", MISSING, "--kv-memory", "100000000GB"],
                        "phase 'serve's KV cache'"),
}


@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_a_flag_out_of_bounds_is_one_line_before_any_work(case, capsys, monkeypatch):
    from compress.memory import available_memory_bytes

    if case == "serve_kv_memory" and available_memory_bytes() is None:
        pytest.skip("free memory is not readable here: the KV cache is not checked")
    monkeypatch.delenv("COMPRESS_SKIP_MEMORY_CHECK", raising=False)
    argv, message = BAD_FLAGS[case]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "not found" not in err


def test_compare_settings_refuse_zero_prompts_and_a_nan_price(capsys):
    assert main(["compare", MISSING, MISSING, "--prompts", "0", "--usd-per-hour", "nan"]) == 2
    err = capsys.readouterr().err
    assert "--prompts must be >= 1, got 0" in err and "--usd-per-hour nan" in err


@pytest.mark.parametrize("prompt,new,message", [
    ("", "2", "the prompt tokenizes to no tokens"),
    ("hi", "100000000", "exceeds the 256 positions"),  # was killed for memory
], ids=["empty_prompt", "past_the_positions"])
def test_generate_refuses_a_length_the_cache_cannot_hold(prompt, new, message, plain, capsys):
    assert main(["generate", prompt, "--model", str(plain), "--max-new-tokens", new]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("content,message", [
    (b"\x00\x86\xff not text", "cannot be read as UTF-8 text"),
    (b"", "text too short to score (0 tokens)"),
], ids=["binary", "empty"])
def test_eval_of_a_text_it_cannot_score_is_a_data_error(content, message, plain, tmp_path,
                                                         capsys):
    text = tmp_path / "text.txt"
    text.write_bytes(content)
    assert main(["eval", str(plain), "--dataset", str(text), "--no-progress",
                 "--context-length", "64"]) == 2
    assert message in capsys.readouterr().err


def test_a_reader_that_leaves_early_ends_the_command_quietly(plain):
    """``compress inspect | head``: the reader closes the pipe before the report is written.
    The command exits 141 (a tool killed by SIGPIPE) with no traceback, whichever write or the
    flush at exit meets the closed pipe."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-m", "compress.cli", "inspect", str(plain)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()  # before the child has written anything
    _, err = child.communicate(timeout=120)
    assert child.returncode == 141, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()


@pytest.mark.parametrize("positions, prompt, new, slots", [
    (2048, 10, 20, 64),  # rounded up to 64
    (70, 10, 56, 70),  # not past the model's positions (OPT's table has no row 70)
    (70, 10, 61, None),  # past them: refused
    (None, 10, 60, 128),  # no positions in the config: rounded
])
def test_generate_sizes_its_cache_within_the_models_positions(positions, prompt, new, slots):
    from types import SimpleNamespace

    from compress.cli_flags import check_generate_length
    from compress.core.errors import RecipeError

    config = SimpleNamespace() if positions is None else SimpleNamespace(
        max_position_embeddings=positions)
    loaded = SimpleNamespace(model=SimpleNamespace(config=config), source="tiny")
    if slots is None:
        with pytest.raises(RecipeError, match="exceeds the 70 positions of tiny"):
            check_generate_length(loaded, list(range(prompt)), new)
    else:
        assert check_generate_length(loaded, list(range(prompt)), new) == slots


def test_generate_on_the_transformers_fallback_reports_no_per_token_times(tmp_path, capsys):
    """The fallback hands every token back at once: a first-token time and a decode rate
    computed from that would be the whole generation's and a nonsense rate."""
    from compress.testing import make_char_tokenizer, make_tiny_moe

    # GLM-4-MoE's q/k-norm variant: transformers runs it (RuntimeSpec.unsupported_flags)
    make_tiny_moe("glm4_moe", use_qk_norm=True).save_pretrained(tmp_path / "m")
    make_char_tokenizer().save_pretrained(tmp_path / "m")
    assert main(["generate", "hello", "--model", str(tmp_path / "m"),
                 "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert "transformers generate: no per-token times" in err and "tokens/s" not in err


@pytest.mark.parametrize("command", ["generate", "serve", "compare"])
def test_a_model_too_large_to_load_whole_is_refused_before_loading(command, plain, tmp_path,
                                                                   capsys, monkeypatch):
    """generate, serve and compare load models whole: past the available memory they were
    killed for memory (a 7B bf16 checkpoint loads as 27 GB of float32); now refused first."""
    import compress.io.load
    from compress.pipeline import preflight

    monkeypatch.delenv("COMPRESS_SKIP_MEMORY_CHECK", raising=False)
    need = preflight.whole_load_bytes(plain)
    if command == "compare":  # baseline and variant at once, one process's base
        need = 2 * need - preflight.BASE_BYTES
    monkeypatch.setattr(preflight, "available_memory_bytes", lambda: need - 1)
    monkeypatch.setattr(compress.io.load, "load_model", lambda *a, **k: pytest.fail("loaded"))
    argv = {"generate": ["generate", "hi", "--model", str(plain)],
            "serve": ["serve", str(plain), "--kv-memory", "1MB", "--max-model-len", "128"],
            "compare": ["compare", str(plain), str(plain), "--out", str(tmp_path / "cmp"),
                        "--context-length", "128"]}
    assert main(argv[command]) == 2
    err = capsys.readouterr().err
    assert f"phase '{command} (" in err and "nothing was written" in err, err


def test_serve_loads_a_bf16_checkpoint_in_bf16_when_it_computes_in_bf16(tmp_path, monkeypatch):
    import torch

    from compress.cli_flags import runtime_dtypes
    from compress.kernels import cpu_float

    monkeypatch.setattr(cpu_float, "cpu_bf16_matmuls", lambda: True)
    from compress.pipeline.preflight import whole_load_bytes
    from compress.testing import make_char_tokenizer, make_tiny_llama

    for dtype in (torch.bfloat16, torch.float32):
        make_tiny_llama(seed=0).to(dtype).save_pretrained(tmp_path / str(dtype))
        make_char_tokenizer().save_pretrained(tmp_path / str(dtype))
    bf16, fp32 = str(tmp_path / str(torch.bfloat16)), str(tmp_path / str(torch.float32))
    assert runtime_dtypes(bf16, "auto") == ("bfloat16", torch.bfloat16, torch.bfloat16)
    assert runtime_dtypes(bf16, "float32") == ("float32", None, torch.float32)
    assert runtime_dtypes(fp32, "auto") == ("float32", None, torch.float32)
    assert runtime_dtypes(fp32, "bfloat16") == ("bfloat16", torch.bfloat16, torch.float32)
    base = whole_load_bytes(tmp_path / "none")  # no checkpoint: None
    assert base is None
    wide, narrow = (whole_load_bytes(tmp_path / str(torch.bfloat16), d)
                    for d in (None, torch.bfloat16))  # fmt: skip
    assert narrow < wide


def test_auto_computes_a_bf16_checkpoint_in_fp32_on_a_cpu_without_bf16_matmuls(tmp_path,
                                                                                monkeypatch,
                                                                                capsys):
    """ATen's bf16 GEMM without AVX512-BF16/AMX ran 1.9-8x slower than fp32 (AVX2 EPYC): where
    our bf16-weight op does not run either, auto widens where the float32 load fits, keeps bf16
    (with a note) where it does not; an asked dtype and a CUDA device are left alone. Where the
    op runs, auto keeps bf16."""
    import torch

    from compress.cli_flags import runtime_dtypes
    from compress.kernels import cpu_float
    from compress.pipeline import preflight
    from compress.testing import make_char_tokenizer, make_tiny_llama

    make_tiny_llama(seed=0).to(torch.bfloat16).save_pretrained(tmp_path / "m")
    make_char_tokenizer().save_pretrained(tmp_path / "m")
    bf16 = str(tmp_path / "m")
    monkeypatch.setattr(cpu_float, "cpu_bf16_matmuls", lambda: False)
    monkeypatch.setattr(cpu_float, "unavailable_reason", lambda device: None)
    assert runtime_dtypes(bf16, "auto") == ("bfloat16", torch.bfloat16, torch.bfloat16)
    assert "float32" not in capsys.readouterr().err
    monkeypatch.setattr(cpu_float, "unavailable_reason", lambda device: "no op here")
    assert runtime_dtypes(bf16, "auto") == ("float32", None, torch.float32)
    assert "computes this bf16 checkpoint in float32" in capsys.readouterr().err
    assert runtime_dtypes(bf16, "bfloat16") == ("bfloat16", torch.bfloat16, torch.bfloat16)
    assert runtime_dtypes(bf16, "auto", "cuda") == ("bfloat16", torch.bfloat16, torch.bfloat16)
    wide = preflight.whole_load_bytes(tmp_path / "m", torch.float32)
    monkeypatch.setattr(preflight, "available_memory_bytes", lambda: wide + 99)
    assert runtime_dtypes(bf16, "auto", extra=100)[0] == "bfloat16"  # fp32 + extra: no room
    assert "does not fit the free memory" in capsys.readouterr().err
    assert runtime_dtypes(bf16, "auto", extra=99)[0] == "float32"


def test_generate_in_bf16_from_a_bf16_load_gives_the_float32_loads_tokens(tmp_path, capsys):
    """`generate --dtype auto` on a bf16 checkpoint loads it in bf16: the same tokens as the
    runtime computing in bf16 from a float32 load (the values are the same)."""
    import torch

    from compress.io.load import load_model
    from compress.runtime.engine import Runtime
    from compress.testing import make_char_tokenizer, make_tiny_llama

    make_tiny_llama(seed=3).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    make_char_tokenizer().save_pretrained(tmp_path / "bf16")
    assert main(["generate", "the cat", "--model", str(tmp_path / "bf16"), "--dtype", "auto",
                 "--max-new-tokens", "8"]) == 0  # fmt: skip
    printed = capsys.readouterr().out.rstrip("\n")
    loaded = load_model(str(tmp_path / "bf16"))
    assert next(loaded.model.parameters()).dtype == torch.float32
    runtime = Runtime(loaded.model, max_seq_len=64, compile=False,
                      prefill_dtype=torch.bfloat16, decode_dtype=torch.bfloat16)  # fmt: skip
    ids = loaded.tokenizer("the cat")["input_ids"]
    tokens = runtime.generate([ids], 8, stop_tokens=[loaded.tokenizer.eos_token_id])[0]
    assert printed == loaded.tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("argv", [
    ["eval", "PLAIN", "--context-length", "300", "--no-progress"],
    ["eval", "PLAIN", "--context-length", "300", "--layer-by-layer"],
    ["serve", "PLAIN", "--max-model-len", "300"],
    ["compare", "PLAIN", "PLAIN", "--context-length", "300", "--no-progress"],
], ids=["eval", "eval_layer_by_layer", "serve", "compare"])
def test_a_length_past_the_positions_is_refused_before_the_model_loads(argv, plain, capsys,
                                                                       monkeypatch):
    """Read from a local model's config.json: the same refusal came after loading the weights
    (minutes for a 70B, whole or layer by layer)."""
    import compress.io.export
    import compress.io.load

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the length was checked")

    monkeypatch.setattr(compress.io.load, "load_model", never)
    monkeypatch.setattr(compress.io.export, "layerwise_model", never)
    assert main([str(plain) if a == "PLAIN" else a for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "300 exceeds the 256 positions" in err
    assert argv[argv.index("300") - 1] in err  # the flag


def test_serve_kv_dtype_auto_keeps_quantized_pages_in_bf16(monkeypatch):
    """serve's --kv-dtype auto on a CPU where our attention kernel reads the pool: bf16 pages for
    a quantized checkpoint, the runtime's KV dtype (None) for a float one; fp32 where decode
    would gather instead; an explicit choice as given."""
    import torch

    from compress.cli_flags import serve_kv_dtype
    from compress.kernels import cpu_attention
    from compress.quant.rtn import Int4RtnConfig, quantize_linears
    from compress.runtime.engine import Runtime
    from compress.testing import make_tiny_llama

    if (why := cpu_attention.unavailable_reason(torch.bfloat16, torch.device("cpu"), 16)):
        pytest.skip(f"our attention kernel does not run here: {why}")
    model = make_tiny_llama()
    runtime = Runtime(model, max_seq_len=16, compile=False, keep_model_weights=True)
    assert serve_kv_dtype(runtime, model, "auto") is None
    assert serve_kv_dtype(runtime, model, "int8") == "int8"
    quantize_linears(model, Int4RtnConfig(group_size=32), 4, "test")
    runtime = Runtime(model, max_seq_len=16, compile=False, static_cache=False)
    assert serve_kv_dtype(runtime, model, "auto") == "bfloat16"
    assert serve_kv_dtype(runtime, model, "float32") == "float32"
    monkeypatch.setattr(cpu_attention, "unavailable_reason", lambda *a: "no kernel here")
    assert serve_kv_dtype(runtime, model, "auto") == "float32"
