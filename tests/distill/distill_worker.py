"""Runs distill.logits on the tiny model for test_distill.py, as a separate process.

Usage: python distill_worker.py OUT_DIR DATA_FILE BATCH_SIZE [KILL_AT_STEP]
Under ``accelerate launch`` each rank writes OUT_DIR/rank<r>.pt with its final parameters. With
KILL_AT_STEP the process SIGKILLs itself inside that optimizer step (a real kill, no cleanup).
"""

from __future__ import annotations

import copy
import os
import signal
import sys
from pathlib import Path

import torch

import compress.distill as distill  # noqa: E402
from compress.core.registry import CompressionState
from compress.prune.config import MlpChannelsConfig  # noqa: E402
from compress.prune.mlp import prune_mlp_channels  # noqa: E402
from compress.testing import make_char_tokenizer, make_tiny_llama  # noqa: E402


def tiny_setup(data_file: str, batch_size: int, checkpoint_dir: str | None = None):
    """(student, cfg, state): a tiny Llama with its MLP pruned 128 -> 64, its teacher, the data."""
    torch.set_num_threads(1)  # the CI box is oversubscribed: 1 thread is far faster there
    teacher = make_tiny_llama(seed=3, initializer_range=0.1)  # peaky logits: a real gap
    student = copy.deepcopy(teacher)
    state = CompressionState(tokenizer=make_char_tokenizer(), teacher=teacher, progress=False)
    prune_mlp_channels(
        student, MlpChannelsConfig(intermediate_size=64, importance="magnitude"), state
    )
    cfg = distill.LogitsConfig(
        data=data_file,
        steps=12,
        seq_len=32,
        batch_size=batch_size,
        grad_accum=2,
        lr=1e-3,
        warmup_steps=3,
        eval_every=4,
        eval_sequences=4,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=3,
        lm_weight=0.5,
        hidden_weight=0.5,
    )
    return student, cfg, state


def main() -> None:
    out, data_file, batch_size = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    kill_at = int(sys.argv[4]) if len(sys.argv) > 4 else None
    student, cfg, state = tiny_setup(data_file, batch_size, str(out / "ckpt") if kill_at else None)
    if kill_at is not None:
        calls = {"n": 0}
        real_step = distill.optimizer_step

        def step_then_maybe_die(optimizer, scheduler):
            calls["n"] += 1
            if calls["n"] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            real_step(optimizer, scheduler)

        distill.optimizer_step = step_then_maybe_die
    distill.distill_logits(student, cfg, state)
    rank = int(os.environ.get("RANK", "0"))
    torch.save(student.state_dict(), out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
