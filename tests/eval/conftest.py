"""Eval tests run torch on one thread: the tiny model's ops are microseconds long, and on a
shared 2-core machine a second OpenMP thread turns each into a wait for a busy core (measured
here under load: 650 ms per tiny forward with 2 threads vs 48 ms with 1)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
