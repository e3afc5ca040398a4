"""A pass's reported peak memory is the peak of the device it ran on: on a GPU host a CPU pass
reports the process's resident memory, not the CUDA allocator's (about 0 bytes for it)."""

from __future__ import annotations

import torch

import compress.memory
from compress.core.registry import CompressionState, run_passes
from compress.quant.rtn import Int8RtnConfig


def test_cpu_pass_on_a_cuda_host_reports_resident_memory(tiny_model, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host, as seen by torch
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 512)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: None)
    state = CompressionState(progress=False)  # device: cpu
    run_passes(tiny_model, [Int8RtnConfig()], state)
    assert compress.memory.peak_memory_bytes()["peak_cuda_allocated_bytes"] == 512
    assert state.reports[0].peak_memory_bytes == compress.memory.peak_rss_bytes()
