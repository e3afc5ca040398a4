"""The console script: help texts, validate's error report, inspect, and a tiny end-to-end run."""

from __future__ import annotations

import json

import pytest
import yaml

from compress.cli import build_parser, main

# Every subcommand the parser has, read from the parser itself so that a new one is covered
# too; the ones below must be among them (a removed or renamed command fails here).
SUBCOMMANDS = sorted(
    next(a for a in build_parser()._actions if a.dest == "command").choices
)
KNOWN = {"run", "validate", "inspect", "eval", "compare", "generate"}


def test_the_known_subcommands_exist_and_top_level_help_lists_them(capsys):
    assert KNOWN <= set(SUBCOMMANDS), SUBCOMMANDS
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for command in SUBCOMMANDS:
        assert command in text


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_complete_help(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "usage: compress " + command in text
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    for action in sub._actions:
        if action.dest == "help":
            continue
        assert action.help, f"{command}: {action.dest} has no help text"
        # each argument is shown: its option strings, or a positional's name
        shown = action.option_strings or [action.metavar or action.dest]
        for name in shown:
            assert name in text, f"{command} --help does not show {name}"


def test_validate_reports_three_mistakes_and_exits_2(tmp_path, capsys):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(
        "name: bad\n"
        "passes:\n"
        "  - pass: quantize.int4_rtm\n"        # misspelt pass
        "  - pass: quantize.int8_rtn\n"
        "    symetric: true\n"                 # misspelt key
        "eval:\n"
        "  perplexity: {limit: -3}\n"          # bad value
    )
    assert main(["validate", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "3 problems" in err and str(recipe) in err
    assert "Did you mean 'quantize.int4_rtn'" in err
    assert "Did you mean 'symmetric'" in err
    assert "limit=-3" in err


def test_validate_missing_file(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "none.yaml")]) == 2
    assert "recipe file not found" in capsys.readouterr().err


def test_run_and_inspect_on_the_tiny_model(tiny_model, tiny_tokenizer, tmp_path, capsys):
    model_dir = tmp_path / "tiny"
    tiny_model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "tiny-w4",
        "passes": [{"pass": "quantize.int4_rtn", "group_size": 32}],
        "eval": {"perplexity": {"dataset": str(text), "context_length": 64, "limit": 4}},
    }))
    out = tmp_path / "out"
    assert main(["run", str(recipe), "--model", str(model_dir), "--out", str(out),
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "| baseline" in printed and "| tiny-w4 |" in printed
    results = json.loads((out / "results.json").read_text())
    base, comp = results["rows"]
    assert base["perplexity"] > 1 and comp["perplexity"] > 1
    assert comp["linear_weight_mb"] < base["linear_weight_mb"] / 4
    assert (out / "report.json").is_file() and (out / "recipe.yaml").is_file()
    assert main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "int4 pack-quantized" in shown and "model.layers.0.mlp.down_proj" in shown
    # the exported checkpoint generates through the runtime, with either int4 decode kernel
    for kernel in ("torch", "q4q8"):
        argv = ["generate", "The quick brown", "--model", str(out), "--max-new-tokens", "4"]
        extra = ["--no-cuda-graphs"] if kernel == "torch" else []  # accepted (a no-op on CPU)
        assert main([*argv, "--int4-kernel", kernel, "--int8-kernel", "q8q8",
                     "--lm-head-bits", "8", *extra]) == 0
        captured = capsys.readouterr()
        assert captured.out.strip()  # the text alone on stdout, timings on stderr
        assert "prepared in" in captured.err and "tokens/s" in captured.err


def test_run_with_unwritable_model_path_writes_nothing(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: x\npasses:\n  - pass: quantize.int8_rtn\n")
    out = tmp_path / "out"
    assert main(["run", str(recipe), "--model", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "model not found" in capsys.readouterr().err
    assert not out.exists()


def test_tune_rejects_autoround_settings_for_another_algorithm(capsys):
    # before any model work: the flags belong to the rounding pass only
    assert main(["tune", "smollm2-135m", "--bits-per-weight", "4.5", "--iters", "20"]) == 2
    assert "--algorithm autoround" in capsys.readouterr().err
