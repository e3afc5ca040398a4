"""The machine probes of compress/eval/hardware.py: what they report is bytes (or FLOPs) over
the best of
their repetitions, checked with a fake clock whose durations are known; on the real clock they
report positive, finite rates (never asserted against a speed)."""

from __future__ import annotations

import math

import pytest

from compress.eval import hardware


class FakeClock:
    """perf_counter for code that reads it twice per repetition: start, then stop, taking the
    given durations in turn (other calls in between would shift the pairs and fail the test)."""

    def __init__(self, durations: list[float]) -> None:
        self.durations, self.now, self.calls = list(durations), 100.0, 0

    def __call__(self) -> float:
        self.calls += 1
        if self.calls % 2 == 0:  # a stop: advance by this repetition's duration
            self.now += self.durations[self.calls // 2 - 1]
        return self.now


@pytest.fixture
def clock(monkeypatch):
    def install(durations):
        fake = FakeClock(durations)
        monkeypatch.setattr(hardware.time, "perf_counter", fake)
        return fake

    return install


def test_memory_bandwidth_is_buffer_bytes_over_the_best_repetition(clock):
    fake = clock([0.5, 0.125, 0.25])  # the best (least disturbed) is the second
    result = hardware.memory_bandwidth(size_mb=2, repeats=3)
    assert fake.calls == 6
    assert result == {"bytes_per_s": 2 * 2**20 / 0.125, "buffer_mb": 2, "repeats": 3}


def test_matmul_peak_is_2n3_flops_over_the_best_repetition(clock):
    fake = clock([0.25, 0.5, 0.0625, 1.0])
    result = hardware.matmul_peak(n=16, repeats=4)
    assert fake.calls == 8
    assert result["flops_per_s"] == 2 * 16**3 / 0.0625
    assert (result["n"], result["repeats"], result["dtype"]) == (16, 4, "torch.float32")


def test_probes_on_this_machine_report_positive_finite_rates():
    bandwidth = hardware.memory_bandwidth(size_mb=8, repeats=2)["bytes_per_s"]
    peak = hardware.matmul_peak(n=64, repeats=2)["flops_per_s"]
    assert math.isfinite(bandwidth) and bandwidth > 0
    assert math.isfinite(peak) and peak > 0
