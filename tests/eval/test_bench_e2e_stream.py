"""The llama.cpp rows of scripts/bench_e2e.py: the script's own worker (LLAMA_WORKER) runs over a
fake ``llama_cpp`` module, and ``worker_stream`` turns it into a Stream for ``time_request``.

The fake model stamps each token (time.monotonic) just before handing it to the worker; on
Linux that clock is CLOCK_MONOTONIC, shared by every process, so the stamps compare with the
ones ``time_request`` takes in this process. Each token must be stamped here after the worker
produced it and before the worker produced the next one (the fake waits GAP seconds between
tokens): TTFT and TPOT come from arrival times, not from a reply read back at the end.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

from compress.eval.latency import time_request

ROOT = Path(__file__).resolve().parents[2]
GAP = 0.2  # seconds the fake model takes per token

FAKE_LLAMA_CPP = f"""
import json, os, time

class Llama:
    def __init__(self, model_path, n_threads, n_ctx, verbose):
        self.stamps = os.environ["FAKE_LLAMA_STAMPS"]

    def reset(self):
        pass

    def generate(self, ids, temp, top_k, reset):
        # endless, like llama.cpp's: the worker stops after n tokens
        stamps, token = [], sum(ids)
        try:
            while True:
                time.sleep({GAP})
                token += 1
                stamps.append(time.monotonic())
                yield token
        finally:
            with open(self.stamps, "a") as f:
                f.write(json.dumps(stamps) + "\\n")
"""

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="compares time.monotonic across processes (Linux only)"
)


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "scripts" / "bench_e2e.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def llama(bench, tmp_path, monkeypatch):
    """A worker_stream over LLAMA_WORKER with the fake llama_cpp; yields (stream, stamps file)."""
    (tmp_path / "llama_cpp.py").write_text(FAKE_LLAMA_CPP)
    stamps = tmp_path / "stamps.jsonl"
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("FAKE_LLAMA_STAMPS", str(stamps))
    stream = bench.worker_stream([sys.executable, "-c", bench.LLAMA_WORKER, "fake.gguf", "1",
                                  "512"])  # fmt: skip
    yield stream, stamps
    stream.worker.stdin.close()
    assert stream.worker.wait(timeout=30) == 0


def test_tokens_are_stamped_as_the_worker_produces_them(llama):
    stream, stamps = llama
    timing = time_request(stream, [3, 4], 4, clock=time.monotonic)
    produced = json.loads(stamps.read_text().splitlines()[-1])
    assert timing.tokens == [8, 9, 10, 11]
    assert len(produced) == 4
    for i, stamp in enumerate(timing.token_times):
        assert stamp >= produced[i]  # read after the model made it
        if i + 1 < len(produced):
            assert stamp < produced[i + 1]  # and before the next one existed
    assert timing.ttft >= produced[0] - timing.arrival >= GAP
    assert timing.tpot == pytest.approx((timing.token_times[-1] - timing.token_times[0]) / 3)


def test_a_stream_closed_early_leaves_the_worker_in_sync(llama):
    stream, _ = llama
    tokens = stream([10], 3)
    assert next(tokens) == 11
    tokens.close()  # the two tokens still on their way are drained, with the "end" line
    assert list(stream([20], 2)) == [21, 22]


def test_a_worker_that_dies_mid_request_is_an_error(bench):
    stream = bench.worker_stream([sys.executable, "-c", "import sys; sys.stdin.readline()"])
    with pytest.raises(RuntimeError, match="worker exited"):
        time_request(stream, [1], 2)
