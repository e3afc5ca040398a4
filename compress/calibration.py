"""Calibration data: token sequences sampled from local text for data-aware passes.

``calibration_sequences`` reads the source (see ``compress.data.read_documents``), tokenizes
every document, concatenates them with the EOS token between documents, and takes
``num_samples`` windows of ``seq_len`` tokens at positions drawn with ``seed`` (without
replacement over non-overlapping slots), so the same recipe gives the same data.
``calibration_mix`` draws from several sources in proportion to their weights (e.g. web text
plus WikiText-2 valid), each with its own derived seed, and concatenates them in mix order.
"""

from __future__ import annotations

from typing import Any

import torch

from compress.core.errors import DataError
from compress.data import read_documents, resolve_text_path


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


def split_counts(weights: dict[str, float], total: int) -> dict[str, int]:
    """``total`` samples split in proportion to ``weights`` (largest remainder, stable order)."""
    bad = {k: v for k, v in weights.items() if not v > 0}
    if not weights or bad:
        raise DataError(
            f"calibration mix weights must be positive numbers, got {bad or weights}; "
            "write e.g. mix: {train_text/web: 0.75, wikitext2-valid: 0.25}"
        )
    norm = sum(weights.values())
    exact = {k: total * v / norm for k, v in weights.items()}
    counts = {k: int(x) for k, x in exact.items()}
    order = sorted(weights, key=lambda k: counts[k] - exact[k])  # largest remainder first
    for key in order[: total - sum(counts.values())]:
        counts[key] += 1
    return counts


def calibration_mix(
    mix: dict[str, float],
    tokenizer: Any,
    *,
    num_samples: int,
    seq_len: int,
    seed: int,
    data_dir: str | None = None,
) -> torch.Tensor:
    """``[num_samples, seq_len]`` token ids drawn from each source of ``mix`` (source -> weight,
    sources as in ``calibration_sequences``) in proportion to its weight."""
    parts = [
        calibration_sequences(
            source, tokenizer, num_samples=count, seq_len=seq_len, seed=seed + index,
            data_dir=data_dir,
        )
        for index, (source, count) in enumerate(split_counts(mix, num_samples).items())
        if count
    ]
    return torch.cat(parts)
