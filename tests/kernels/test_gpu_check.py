"""scripts/gpu_check.sh --dry-run: every section's Python runs on the CPU (kernels interpreted,
tiny shapes) and the report, the kernel table and the section statuses come out as on a GPU.

The default tier runs sections 2-3 and checks that section 4's recipes and section 5's
``compress eval`` flags parse as the GPU run will write them; sections 4-5 start seven CLI
processes (about 50 s here), so their full dry run is in the slow tier: run
``python -m pytest -m slow tests/kernels/test_gpu_check.py`` before spending device time."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compress.kernels import kernel_table

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[2]


def _dry_run(tmp_path, sections: str) -> tuple[Path, dict]:
    env = dict(os.environ, GPU_CHECK_WORK=str(tmp_path / "work"))
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(tmp_path / "out"),
         "--sections", sections, "--budget-s", "600"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["dry_run"] is True
    return out, report["sections"]


def test_gpu_check_dry_run_writes_the_report_and_a_loadable_table(tmp_path):
    out, sections = _dry_run(tmp_path, "23")
    assert list(sections) == ["2 kernel table", "3 runtime decode"]
    _check_table_and_decode(out, sections)


def test_the_gpu_runs_recipes_and_eval_flags_parse():
    """Section 4's recipes as the GPU run writes them (device cuda, the goal's calibration) and
    section 5's ``compress eval`` flags are accepted, without starting a process."""
    import yaml

    from compress.cli import build_parser
    from compress.recipe import parse_recipe

    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    for name in gpu_check.QUANT_RECIPES:
        recipe = parse_recipe(yaml.safe_load(gpu_check.quant_recipe(name, dry_run=False)),
                              source=name)  # fmt: skip
        assert str(recipe.device) == "cuda" and len(recipe.passes) == 1, recipe
        assert type(recipe.passes[0]).__name__.lower().startswith(name), recipe.passes
        dry = parse_recipe(yaml.safe_load(gpu_check.quant_recipe(name, dry_run=True)), source=name)
        assert str(dry.device) == "cpu" and dry.calibration.num_samples == 2
    parser = build_parser()
    for flags in gpu_check.EVAL_RUNS.values():
        args = parser.parse_args(["eval", "/export", *flags, "--limit", "4"])
        assert args.device == flags[1] and args.limit == 4
    args = parser.parse_args(["run", "r.yaml", "--model", "m", "--out", "o", "--overwrite",
                              "--no-progress"])  # fmt: skip
    assert args.overwrite and args.no_progress


@pytest.mark.slow
def test_gpu_check_dry_run_of_every_section_on_the_cpu(tmp_path):
    out, sections = _dry_run(tmp_path, "2345")
    assert list(sections) == ["2 kernel table", "3 runtime decode", "4 calibrated passes",
                              "5 perplexity gpu vs cpu"]  # fmt: skip
    _check_table_and_decode(out, sections)
    # 4 and 5 run their commands on the CPU: the same recipes and evaluations, tiny
    assert all(s["status"] == "ok" for s in sections.values()), sections
    quant = sections["4 calibrated passes"]["result"]
    for name in ("gptq", "awq", "autoround"):
        assert quant[name]["returncode"] == 0, quant[name]
        assert "changed 14 modules, skipped 0" in quant[name]["tail"][-1], quant[name]
    assert quant["column walk"]["codes_equal_fraction"] > 0.99
    ppl = sections["5 perplexity gpu vs cpu"]["result"]
    assert ppl["cuda"]["perplexity"] > 1 and ppl["within_1pct"] is True, ppl


def _check_table_and_decode(out: Path, sections: dict) -> None:
    assert sections["2 kernel table"]["status"] == "ok"
    assert sections["3 runtime decode"]["status"] == "ok"
    decode = sections["3 runtime decode"]["result"]
    assert {"tiny bf16", "tiny w4", "tiny w8a8"} <= set(decode)
    rows = {k: v for k, v in decode.items() if k != "goals"}
    assert all("eager_tok_s" in row for row in rows.values()), decode
    assert all(row["cuda_graph"] == "not run: needs CUDA" for row in rows.values())
    assert any(line.startswith("tiny eager: W4") for line in decode["goals"])
    tables = kernel_table.parse_file(json.loads((out / kernel_table.TABLE_FILE).read_text()))
    table = kernel_table.select_table(tables, tables[0]["gpu"])
    assert table is not None and table.measured["date"]
    entries = table.index[("int4", 40, 128, 128)]
    assert [e["m"] for e in entries] == [1, 17] and entries[0]["kernel"] == "triton_gemv"
    assert "DRY RUN" in (out / "gpu_check.md").read_text()
    assert len(list(out.iterdir())) <= 8  # the device tool returns at most 8 files


def test_gpu_check_needs_a_gpu_without_dry_run(tmp_path):
    if sys.platform != "linux":
        pytest.skip("bash script")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0 and "needs a CUDA GPU" in proc.stderr
