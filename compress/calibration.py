"""Calibration data: token sequences sampled from local text for data-aware passes.

``calibration_sequences`` reads the source (see ``compress.data.read_documents``), tokenizes
every document, concatenates them with the EOS token between documents, and takes
``num_samples`` windows of ``seq_len`` tokens at positions drawn with ``seed`` (without
replacement over non-overlapping slots), so the same recipe gives the same data.
"""

from __future__ import annotations

from typing import Any

import torch

from compress.data import read_documents, resolve_text_path
from compress.errors import DataError


def calibration_sequences(
    source: str,
    tokenizer: Any,
    *,
    num_samples: int,
    seq_len: int,
    seed: int,
    data_dir: str | None = None,
) -> torch.Tensor:
    """``[num_samples, seq_len]`` token ids; a clear error when the text is too short."""
    path = resolve_text_path(source, data_dir)
    docs = read_documents(path)
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for doc in docs:
        ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        if eos is not None:
            ids.append(eos)
    slots = len(ids) // seq_len
    if slots < num_samples:
        raise DataError(
            f"calibration source {source!r} ({path}) has {len(ids)} tokens: enough for {slots} "
            f"sequences of {seq_len}, but num_samples={num_samples}. Lower num_samples or "
            "seq_len, or use a larger source (e.g. train_text/books)."
        )
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(slots, generator=generator)[:num_samples].sort().values
    tokens = torch.tensor(ids[: slots * seq_len], dtype=torch.long).view(slots, seq_len)
    return tokens[chosen]
