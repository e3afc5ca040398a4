"""Shared fixtures: a tiny random Llama (2 layers, hidden 64, 4 heads, 2 KV heads) built from a
config with fixed seeds, a character-level tokenizer built in code (no downloads), the data folder,
and the embedded real model for tests marked ``real``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton kernels run under the interpreter without a GPU (tests/kernels/conftest.py says why).
# Set here, before any test module is collected: one that imports triton at collection
# (compressed_tensors imports it) before tests/kernels/conftest.py set it made every kernel test
# fail ("Cannot call @triton.jit'd outside of the scope of a kernel").
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from compress.testing import make_char_tokenizer, make_tiny_llama  # noqa: E402,F401  (re-exported)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def one_thread():
    """One torch thread for the test: tiny ops on a shared 2-core box spin-wait otherwise."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def cuda_scopes(monkeypatch) -> list:
    """``torch.cuda.device`` without a GPU: entering one appends its index to the returned
    list, leaving it appends "exit" (what ran inside which GPU scope)."""
    import torch

    entered: list = []

    class Scope:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            entered.append(self.index)

        def __exit__(self, *exc):
            entered.append("exit")

    monkeypatch.setattr(torch.cuda, "device", Scope)
    return entered


@pytest.fixture
def tiny_model():
    return make_tiny_llama()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_char_tokenizer()


@pytest.fixture
def plain(tiny_model, tiny_tokenizer, tmp_path):
    """A float tiny Llama saved with its tokenizer: a checkpoint folder to corrupt."""
    folder = tmp_path / "plain"
    tiny_model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def data_dir() -> Path:
    from compress.data import resolve_data_dir

    try:
        return resolve_data_dir()
    except Exception as exc:  # noqa: BLE001  (report the reason as the skip message)
        pytest.skip(f"data folder not available: {exc}")


@pytest.fixture(scope="session")
def smollm2():
    """The embedded real model (fp32) and tokenizer, converted once into the cache."""
    pytest.importorskip("gguf")
    from compress.io.load import load_model

    try:
        return load_model("smollm2-135m")
    except Exception as exc:  # noqa: BLE001
        if os.environ.get("CI"):
            raise
        pytest.skip(f"embedded model not available: {exc}")
