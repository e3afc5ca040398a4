"""Knowledge distillation pass ``distill.logits``: train the (pruned) student to match the teacher.

Minitron recovers a pruned model by distilling from the unpruned one: forward KL between the
teacher's and the student's next-token distributions at temperature ``temperature`` (scaled by
T^2, Hinton et al. 2015), plus optional MSE between normalised hidden states of mapped layers
(student layer i <-> teacher layer round((i+1) * L_t / L_s) - 1; only when the hidden sizes
match) and an optional plain LM loss. The teacher is ``state.teacher`` (the model before the
recipe's first pass, copied by the runner) or a named checkpoint.

Data: local text (``train_text/...``, any .txt/.jsonl/.json.gz file or folder) tokenized and
packed into ``seq_len`` windows; a seeded permutation reserves a held-out slice. Batches are a
pure function of (step, micro-step, rank), so a resumed run sees exactly the batches an
uninterrupted one would. Training: AdamW, linear warm-up + cosine decay, gradient accumulation,
clipping, bf16 autocast only where the device supports it. Multi-process via Hugging Face
``accelerate`` (``accelerate launch``: DDP; FSDP through an accelerate config, untested here).
Checkpoints (student, optimizer, scheduler, step, a fingerprint of the run) are written
atomically; resuming from a checkpoint of a different run is an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator, model_validator
from torch import nn
from tqdm.auto import tqdm

from compress.core.device import current_device
from compress.core.errors import ConfigError, DataError
from compress.core.registry import (
    MAX_TOKENS,
    CompressionState,
    PassConfig,
    PassReport,
    at_most,
    register_pass,
)
from compress.data import read_documents, resolve_text_path
from compress.optim import check_optimizer_name, make_optimizer, optimizer_state_bytes

log = logging.getLogger(__name__)
CHECKPOINT = "distill_state.pt"


class LogitsConfig(PassConfig):
    """Distillation settings. Tokens per optimizer step = batch_size * grad_accum * seq_len *
    number of processes; batch_size is per process."""

    data: str | None = None  # text source: a path under the data dir (train_text/web) or a file
    teacher: str | None = None  # checkpoint/model to use instead of the pre-recipe model
    steps: Annotated[  # optimizer steps
        int, Field(ge=1), at_most(10**6, "each step runs the teacher and trains the student")
    ] = 100
    seq_len: Annotated[  # tokens per packed sequence
        int, Field(ge=8), at_most(MAX_TOKENS, "longer than the context of any supported model")
    ] = 256
    batch_size: Annotated[  # sequences per micro-batch, per process
        int, Field(ge=1), at_most(4096, "a micro-batch's activations are held for backward")
    ] = 4
    grad_accum: Annotated[  # micro-batches per optimizer step
        int, Field(ge=1), at_most(4096, "every micro-batch adds a forward and backward")
    ] = 1
    lr: float = Field(1e-4, gt=0)  # peak learning rate
    min_lr_ratio: float = Field(0.1, ge=0, le=1)  # cosine floor as a fraction of lr
    warmup_steps: int = Field(10, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0)  # None: no clipping
    temperature: float = Field(1.0, gt=0)
    kl_weight: float = Field(1.0, ge=0)
    hidden_weight: float = Field(0.0, ge=0)  # MSE of normalised hidden states of mapped layers
    lm_weight: float = Field(0.0, ge=0)  # plain next-token cross-entropy on the data
    eval_sequences: Annotated[  # held-out sequences (never trained on)
        int, Field(ge=1), at_most(65536, "every evaluation scores them all")
    ] = 16
    eval_every: int = Field(50, ge=1)  # steps between held-out perplexity evaluations
    checkpoint_dir: str | None = None  # where to write/resume; None: no checkpoints
    checkpoint_every: int = Field(50, ge=1)  # steps between checkpoints
    resume: bool = True  # continue from checkpoint_dir if it holds a checkpoint of this run
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"  # auto: bf16 on CUDA if supported
    seed: int = Field(0, ge=0, le=2**32 - 1)  # the range every random generator accepts
    optimizer: str = "adamw"  # adamw | adamw8bit (bitsandbytes 8-bit states; paged on CUDA)

    @field_validator("optimizer")
    @classmethod
    def _optimizer(cls, value: str) -> str:
        return check_optimizer_name(value)

    @model_validator(mode="after")
    def _weights(self):
        if self.kl_weight + self.hidden_weight + self.lm_weight == 0:
            raise ValueError("kl_weight, hidden_weight and lm_weight are all 0: set at least one")
        if self.data is None:
            raise ValueError("distillation needs data: set data (e.g. train_text/web)")
        return self


# ---- data ---------------------------------------------------------------------------------
def packed_sequences(
    source: str, tokenizer, seq_len: int, count: int, data_dir: str | None = None
) -> torch.Tensor:
    """``[n, seq_len]`` token ids (n <= count) from documents joined with EOS, in file order."""
    docs = read_documents(resolve_text_path(source, data_dir))
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for doc in docs:  # tokenize only as much text as the run needs
        ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        if eos is not None:
            ids.append(eos)
        if len(ids) >= count * seq_len:
            break
    n = min(count, len(ids) // seq_len)
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def split_data(cfg: LogitsConfig, tokenizer, world: int, data_dir: str | None):
    """(train, held_out) sequences; train is reused cyclically if the text is short."""
    needed = cfg.steps * cfg.grad_accum * cfg.batch_size * world + cfg.eval_sequences
    seqs = packed_sequences(cfg.data, tokenizer, cfg.seq_len, needed, data_dir)
    if len(seqs) < cfg.eval_sequences + cfg.batch_size * world:
        raise DataError(
            f"distill.logits: {cfg.data!r} gives only {len(seqs)} sequences of {cfg.seq_len} "
            f"tokens; need at least {cfg.eval_sequences + cfg.batch_size * world}. Use a larger "
            "source (e.g. train_text/web) or lower seq_len / eval_sequences."
        )
    order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(cfg.seed))
    return seqs[order[cfg.eval_sequences :]], seqs[order[: cfg.eval_sequences]]


def batch_for(
    train: torch.Tensor, step: int, micro: int, rank: int, world: int, cfg: LogitsConfig
) -> torch.Tensor:
    """The micro-batch of ``rank`` at (step, micro): consecutive slices of the global order, so
    one process with batch_size * world sees exactly what ``world`` processes see together."""
    start = ((step * cfg.grad_accum + micro) * world + rank) * cfg.batch_size
    idx = torch.arange(start, start + cfg.batch_size) % len(train)
    return train[idx]


# ---- losses -------------------------------------------------------------------------------
def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, t: float) -> torch.Tensor:
    """Mean over tokens of KL(teacher_T || student_T) * T^2; logits ``[B, T, V]``."""
    s = F.log_softmax(student_logits.float() / t, dim=-1)
    p = F.log_softmax(teacher_logits.float() / t, dim=-1)
    kl = (p.exp() * (p - s)).sum(-1)  # [B, T]
    return kl.mean() * t * t


def layer_map(n_student: int, n_teacher: int) -> list[tuple[int, int]]:
    """(student, teacher) hidden-state indices (0 = embeddings, i = after layer i)."""
    return [(i, round(i * n_teacher / n_student)) for i in range(1, n_student + 1)]


def hidden_loss(student_hidden, teacher_hidden, pairs) -> torch.Tensor:
    losses = [
        F.mse_loss(
            F.layer_norm(student_hidden[s].float(), student_hidden[s].shape[-1:]),
            F.layer_norm(teacher_hidden[t].float(), teacher_hidden[t].shape[-1:]),
        )
        for s, t in pairs
    ]
    return torch.stack(losses).mean()


@torch.no_grad()
def held_out_perplexity(model: nn.Module, seqs: torch.Tensor, batch_size: int) -> float:
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    for chunk in seqs.split(batch_size):
        chunk = chunk.to(device)
        logits = model(chunk, use_cache=False).logits[:, :-1].float()
        nll += float(F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"))
        count += chunk[:, 1:].numel()
    mean = nll / count  # past float's range inf, as compress.eval.quality.exp_nll (a pass
    # does not import eval)
    return math.exp(mean) if mean < math.log(torch.finfo(torch.float64).max) else math.inf


def lr_factor(step: int, cfg: LogitsConfig) -> float:
    """Linear warm-up to 1, then cosine decay to min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# ---- checkpoints --------------------------------------------------------------------------
def run_fingerprint(cfg: LogitsConfig, student: nn.Module, world: int) -> str:
    """Identity of a run: settings that change the trajectory, the student's shape, the world."""
    settings = cfg.model_dump(
        mode="json", exclude={"checkpoint_dir", "checkpoint_every", "resume", "eval_every"}
    )
    shapes = {k: list(v.shape) for k, v in student.state_dict().items()}
    blob = json.dumps({"cfg": settings, "shapes": shapes, "world": world}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def save_checkpoint(path: Path, payload: dict) -> None:
    """Atomic: written to a temporary file, then renamed over the old checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, fingerprint: str) -> dict | None:
    if not path.is_file():
        return None
    payload = torch.load(path, map_location="cpu", weights_only=False)
    if payload.get("fingerprint") != fingerprint:
        raise ConfigError(
            f"distill.logits: {path} is a checkpoint of a different run (fingerprint "
            f"{payload.get('fingerprint')} != {fingerprint}: other settings, student shape or "
            "process count). Use another checkpoint_dir, delete it, or set resume: false."
        )
    return payload


# ---- the pass -----------------------------------------------------------------------------
def _teacher(cfg: LogitsConfig, student: nn.Module, state: CompressionState) -> nn.Module:
    teacher = state.teacher
    if cfg.teacher is not None:
        from compress.io.load import load_model

        loaded = load_model(cfg.teacher)
        if (
            state.tokenizer is not None
            and loaded.tokenizer.get_vocab() != state.tokenizer.get_vocab()
        ):
            raise ConfigError(
                f"distill.logits: teacher {cfg.teacher!r} has a different tokenizer from the "
                "student; distillation on logits needs the same vocabulary. Pick a teacher of "
                "the same model family."
            )
        teacher = loaded.model
    if teacher is None:
        raise ConfigError(
            "distill.logits has no teacher: set `teacher:` or run it through "
            "`compress run` (which keeps a copy of the model before the passes)"
        )
    t_vocab = teacher.get_output_embeddings().weight.shape[0]
    s_vocab = student.get_output_embeddings().weight.shape[0]
    if t_vocab != s_vocab:
        raise ConfigError(
            f"distill.logits: teacher vocabulary {t_vocab} != student {s_vocab}; "
            "teacher and student must share a tokenizer"
        )
    if cfg.hidden_weight > 0 and teacher.config.hidden_size != student.config.hidden_size:
        raise ConfigError(
            f"distill.logits: hidden_weight needs equal hidden sizes (teacher "
            f"{teacher.config.hidden_size}, student {student.config.hidden_size} after "
            "prune.hidden_size); set hidden_weight: 0"
        )
    return teacher.eval().requires_grad_(False)


def _loss(cfg, student, teacher, batch, autocast):
    need_hidden = cfg.hidden_weight > 0
    with autocast():
        out = student(batch, use_cache=False, output_hidden_states=need_hidden)
        with torch.no_grad():
            t_out = teacher(batch, use_cache=False, output_hidden_states=need_hidden)
    loss = cfg.kl_weight * kl_loss(out.logits, t_out.logits, cfg.temperature)
    if need_hidden:
        pairs = layer_map(len(out.hidden_states) - 1, len(t_out.hidden_states) - 1)
        loss = loss + cfg.hidden_weight * hidden_loss(out.hidden_states, t_out.hidden_states, pairs)
    if cfg.lm_weight > 0:
        logits = out.logits[:, :-1].float()
        loss = loss + cfg.lm_weight * F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    return loss


def optimizer_step(optimizer, scheduler) -> None:
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def accelerator_settings(mixed_precision: str, device: torch.device) -> tuple[str, bool]:
    """``(mixed_precision, cpu)`` for accelerate's ``Accelerator``: training runs on ``device``
    (``state.device``), and ``auto`` is bf16 only when that is a GPU with bf16 (a CPU run on a
    GPU host is not autocast to bf16 because CUDA exists). Multi-process runs take their GPU
    from accelerate's launcher (one per rank), not from the index of ``device``."""
    on_gpu = device.type == "cuda"
    if mixed_precision == "auto":
        mixed_precision = "bf16" if on_gpu and torch.cuda.is_bf16_supported() else "no"
    return mixed_precision, not on_gpu


def device_scope(device: torch.device):
    """The block in which a single-process run trains on ``device``: accelerate puts a
    non-distributed run on ``torch.device("cuda")``, the *current* GPU, so ``cuda:1`` needs
    ``torch.cuda.device(1)`` around the run (without it every run trained on GPU 0). Runs
    launched with several processes take their GPU from the launcher (rank), not from here."""
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return contextlib.nullcontext() if launched else current_device(device)


@register_pass("distill.logits", LogitsConfig, needs_teacher=True)
def distill_logits(student: nn.Module, cfg: LogitsConfig, state: CompressionState) -> PassReport:
    with device_scope(state.device):
        return _distill_logits(student, cfg, state)


def _distill_logits(student: nn.Module, cfg: LogitsConfig, state: CompressionState) -> PassReport:
    from accelerate import Accelerator

    if state.tokenizer is None:
        raise ConfigError("distill.logits needs the tokenizer in state to read its data")
    precision, cpu = accelerator_settings(cfg.mixed_precision, state.device)
    accelerator = Accelerator(mixed_precision=precision, cpu=cpu)
    home = next(student.parameters()).device  # where the student goes back to after training
    world, rank, main = (
        accelerator.num_processes,
        accelerator.process_index,
        accelerator.is_main_process,
    )
    teacher = _teacher(cfg, student, state).to(accelerator.device)
    train, held_out = split_data(cfg, state.tokenizer, world, state.data_dir)
    fingerprint = run_fingerprint(cfg, student, world)
    ckpt_path = Path(cfg.checkpoint_dir) / CHECKPOINT if cfg.checkpoint_dir else None
    student.train()
    decay = [p for n, p in student.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in student.named_parameters() if p.ndim < 2]
    model = accelerator.prepare(student)
    optimizer = make_optimizer(
        cfg.optimizer,  # type: ignore[arg-type]
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        cfg.lr,
        betas=(0.9, 0.95),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
    start_step, history = 0, []
    payload = load_checkpoint(ckpt_path, fingerprint) if ckpt_path and cfg.resume else None
    if payload is not None:
        student.load_state_dict(payload["student"])
        optimizer.load_state_dict(payload["optimizer"])
        scheduler.load_state_dict(payload["scheduler"])
        start_step, history = payload["step"], payload["history"]
        log.info("distill.logits: resumed from %s at step %d", ckpt_path, start_step)
    if start_step == 0:
        history = [
            {"step": 0, "held_out_ppl": held_out_perplexity(student, held_out, cfg.batch_size)}
        ]
        student.train()
    tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len * world
    bar = tqdm(
        range(start_step, cfg.steps),
        desc="distill.logits: training steps",
        disable=not (state.progress and main),
        initial=start_step,
        total=cfg.steps,
    )
    started = time.perf_counter()
    for step in bar:
        total = 0.0
        for micro in range(cfg.grad_accum):
            batch = batch_for(train, step, micro, rank, world, cfg).to(accelerator.device)
            loss = _loss(cfg, model, teacher, batch, accelerator.autocast) / cfg.grad_accum
            accelerator.backward(loss)
            total += float(loss.detach())
        if cfg.max_grad_norm is not None:
            accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer_step(optimizer, scheduler)
        done = step + 1
        record = {"step": done, "loss": round(total, 6), "lr": scheduler.get_last_lr()[0]}
        if done % cfg.eval_every == 0 or done == cfg.steps:
            record["held_out_ppl"] = held_out_perplexity(student, held_out, cfg.batch_size)
            student.train()
        history.append(record)
        rate = (done - start_step) * tokens_per_step / (time.perf_counter() - started)
        bar.set_postfix(loss=f"{total:.4f}", tok_s=f"{rate:.0f}")
        if ckpt_path and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
            if main:
                save_checkpoint(
                    ckpt_path,
                    {
                        "fingerprint": fingerprint,
                        "step": done,
                        "history": history,
                        "student": student.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                    },
                )
            accelerator.wait_for_everyone()
    student.eval()
    teacher_ppl = held_out_perplexity(teacher, held_out, cfg.batch_size)
    # back where they were (the host): later passes, evaluation and export find the model where
    # the job keeps it, as after every other pass
    student.to(home)
    teacher.to(home)
    seconds = time.perf_counter() - started
    report = PassReport("distill.logits", changed=["all student parameters"])
    report.metrics.update(
        steps=cfg.steps,
        resumed_from=start_step,
        tokens=cfg.steps * tokens_per_step,
        processes=world,
        train_seconds=round(seconds, 1),
        held_out_ppl_before=history[0]["held_out_ppl"],
        held_out_ppl_after=history[-1].get("held_out_ppl"),
        teacher_held_out_ppl=teacher_ppl,
        final_loss=history[-1].get("loss"),
        optimizer=cfg.optimizer,
        optimizer_state_bytes=optimizer_state_bytes(optimizer),
        history=history,
    )
    return report
