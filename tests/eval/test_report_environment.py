"""The environment record beside every published number names the switches that cap an ISA."""

from __future__ import annotations

from compress.eval.report import ISA_LIMITS, environment


def test_environment_records_only_the_isa_caps_that_are_set(monkeypatch):
    for name in ISA_LIMITS:
        monkeypatch.delenv(name, raising=False)
    assert environment()["isa_limits"] == {}
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "")  # set but empty: caps nothing
    env = environment()
    assert env["isa_limits"] == {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert env["cpu"] and env["torch"]
