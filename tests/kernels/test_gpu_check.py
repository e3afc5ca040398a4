"""scripts/gpu_check.sh --dry-run: every section's Python runs on the CPU (kernels interpreted,
tiny shapes) and the report, the kernel table and the section statuses come out as on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compress.kernels import kernel_table

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_writes_the_report_and_a_loadable_table(tmp_path):
    env = dict(os.environ, GPU_CHECK_WORK=str(tmp_path / "work"))
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(tmp_path / "out"),
         "--sections", "2345", "--budget-s", "600"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["dry_run"] is True
    sections = report["sections"]
    assert list(sections) == ["2 kernel table", "3 runtime decode", "4 calibrated passes",
                              "5 perplexity gpu vs cpu"]  # fmt: skip
    assert sections["2 kernel table"]["status"] == "ok"
    assert sections["3 runtime decode"]["status"] == "ok"
    decode = sections["3 runtime decode"]["result"]
    assert {"tiny bf16", "tiny w4", "tiny w8a8"} <= set(decode)
    rows = {k: v for k, v in decode.items() if k != "goals"}
    assert all("eager_tok_s" in row for row in rows.values()), decode
    assert all(row["cuda_graph"] == "not run: needs CUDA" for row in rows.values())
    assert any(line.startswith("tiny eager: W4") for line in decode["goals"])
    # 4 and 5 run their commands on the CPU: the same recipes and evaluations, tiny
    assert all(s["status"] == "ok" for s in sections.values()), sections
    quant = sections["4 calibrated passes"]["result"]
    for name in ("gptq", "awq", "autoround"):
        assert quant[name]["returncode"] == 0, quant[name]
        assert "changed 14 modules, skipped 0" in quant[name]["tail"][-1], quant[name]
    assert quant["column walk"]["codes_equal_fraction"] > 0.99
    ppl = sections["5 perplexity gpu vs cpu"]["result"]
    assert ppl["cuda"]["perplexity"] > 1 and ppl["within_1pct"] is True, ppl
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
