"""distill.logits: losses against float64 references, schedule, loss decrease, kill-and-resume
equality, a 2-process accelerate (gloo) run against single-process training, and bad input."""

from __future__ import annotations

import math
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compress.core.errors import ConfigError
from compress.distill import (
    LogitsConfig,
    accelerator_settings,
    batch_for,
    distill_logits,
    kl_loss,
    layer_map,
    lr_factor,
)
from compress.prune.config import HiddenSizeConfig
from compress.prune.hidden import prune_hidden_size

sys.path.insert(0, str(Path(__file__).parent))
from distill_worker import tiny_setup  # noqa: E402

WORKER = Path(__file__).parent / "distill_worker.py"


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # shared 2-core box: 1 thread avoids spin-wait collapse
    yield
    torch.set_num_threads(before)


@pytest.fixture
def text_file(tmp_path):
    lines = [
        f"Line {i}: the quick brown fox number {i * 7 % 13} jumps over {i % 5} dogs.\n"
        for i in range(400)
    ]
    path = tmp_path / "train.txt"
    path.write_text("".join(lines))
    return str(path)


def test_kl_matches_float64_reference():
    torch.manual_seed(0)
    s, t = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    temp = 2.0
    p = torch.softmax(t.double() / temp, -1)
    q = torch.softmax(s.double() / temp, -1)
    want = (p * (p.log() - q.log())).sum(-1).mean() * temp**2
    assert kl_loss(s, t, temp).item() == pytest.approx(want.item(), rel=1e-5)
    assert kl_loss(t, t, temp).item() == pytest.approx(0.0, abs=1e-6)


def test_schedule_warmup_then_cosine():
    cfg = LogitsConfig(data="x", steps=110, warmup_steps=10, min_lr_ratio=0.1)
    assert [lr_factor(s, cfg) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert lr_factor(10, cfg) == pytest.approx(1.0)
    assert lr_factor(60, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(110, cfg) == pytest.approx(0.1)


def test_world_batches_equal_single_process_batches():
    train = torch.arange(40).view(20, 2)
    one = LogitsConfig(data="x", batch_size=4, grad_accum=2)
    two = LogitsConfig(data="x", batch_size=2, grad_accum=2)
    for step in range(3):
        for micro in range(2):
            joined = torch.cat([batch_for(train, step, micro, r, 2, two) for r in range(2)])
            assert torch.equal(joined, batch_for(train, step, micro, 0, 1, one))


def test_layer_map_ends_at_last_layers():
    assert layer_map(3, 6) == [(1, 2), (2, 4), (3, 6)]
    assert layer_map(2, 2) == [(1, 1), (2, 2)]


def test_distillation_reduces_held_out_kl(text_file):
    student, cfg, state = tiny_setup(text_file, batch_size=4)
    cfg = cfg.model_copy(update={"steps": 20, "hidden_weight": 0.0, "lm_weight": 0.0})
    from compress.distill import split_data

    _, held = split_data(cfg, state.tokenizer, 1, None)
    with torch.no_grad():
        before = kl_loss(student(held).logits, state.teacher(held).logits, 1.0).item()
    report = distill_logits(student, cfg, state)
    with torch.no_grad():
        after = kl_loss(student(held).logits, state.teacher(held).logits, 1.0).item()
    assert after < 0.7 * before
    assert report.metrics["tokens"] == 20 * 4 * 2 * 32
    assert report.metrics["held_out_ppl_after"] < report.metrics["held_out_ppl_before"]
    losses = [h["loss"] for h in report.metrics["history"] if "loss" in h]
    assert sum(losses[-5:]) < sum(losses[:5])


def test_kill_and_resume_matches_uninterrupted_run(tmp_path, text_file):
    killed = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path), text_file, "4", "8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -9, killed.stderr[-2000:]  # really killed, in step 8
    ckpt = tmp_path / "ckpt" / "distill_state.pt"
    assert torch.load(ckpt, weights_only=False)["step"] == 6  # last checkpoint before the kill
    resumed, cfg, state = tiny_setup(text_file, 4, str(tmp_path / "ckpt"))
    report = distill_logits(resumed, cfg, state)
    assert report.metrics["resumed_from"] == 6
    straight, cfg2, state2 = tiny_setup(text_file, 4, None)
    distill_logits(straight, cfg2, state2)
    for (name, a), b in zip(
        resumed.state_dict().items(), straight.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_resume_from_a_different_run_is_an_error(tmp_path, text_file):
    student, cfg, state = tiny_setup(text_file, 4, str(tmp_path / "ckpt"))
    distill_logits(student, cfg.model_copy(update={"steps": 3}), state)
    other, cfg, state = tiny_setup(text_file, 4, str(tmp_path / "ckpt"))
    before = (tmp_path / "ckpt" / "distill_state.pt").read_bytes()
    with pytest.raises(ConfigError, match="different run"):
        distill_logits(other, cfg.model_copy(update={"lr": 1e-2}), state)
    assert (tmp_path / "ckpt" / "distill_state.pt").read_bytes() == before


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_process_accelerate_matches_single_process(tmp_path, text_file):
    launcher = shutil.which("accelerate")
    if launcher is None:
        pytest.skip("accelerate CLI not installed")
    # --multi_gpu picks accelerate's torchrun (DDP) launcher; without CUDA it runs MULTI_CPU/gloo.
    cmd = [
        launcher,
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(_free_port()),
        str(WORKER),
        str(tmp_path),
        text_file,
        "2",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rank0 = torch.load(tmp_path / "rank0.pt")
    rank1 = torch.load(tmp_path / "rank1.pt")
    single, cfg, state = tiny_setup(text_file, 4)  # same global batch: 2 ranks x 2 sequences
    distill_logits(single, cfg, state)
    teacher = state.teacher.state_dict()
    for name, value in single.state_dict().items():
        torch.testing.assert_close(rank0[name], rank1[name], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(rank0[name], value, rtol=1e-4, atol=1e-5, msg=name)
    moved = [
        n
        for n, v in single.state_dict().items()
        if n in teacher and v.shape == teacher[n].shape and not torch.equal(v, teacher[n])
    ]
    assert moved  # training changed the student


@pytest.mark.parametrize("requested", ["auto", "no", "bf16"])
def test_training_runs_on_the_state_device_with_its_precision(requested, monkeypatch):
    """On a GPU host with state.device cpu, auto is not bf16 (it was: "CUDA exists") and the
    accelerator trains on the CPU; on a GPU, auto is bf16 and the accelerator is not the CPU
    (issue 34; cpu= was always true because run_job never set state.device)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    on_cpu = accelerator_settings(requested, torch.device("cpu"))
    on_gpu = accelerator_settings(requested, torch.device("cuda", 0))
    assert on_cpu == ({"auto": "no"}.get(requested, requested), True)
    assert on_gpu == ({"auto": "bf16"}.get(requested, requested), False)


@pytest.mark.parametrize(
    "device, world, want",
    [("cuda:1", "1", [1, "exit"]), ("cuda:0", "1", [0, "exit"]), ("cuda", "1", []),
     ("cuda:1", "2", []), ("cpu", "1", [])],
)  # fmt: skip
def test_a_single_process_run_trains_on_the_gpu_it_was_given(device, world, want, monkeypatch,
                                                             cuda_scopes):
    """accelerate puts a single-process run on the current GPU: ``cuda:1`` trained on GPU 0
    until the pass ran inside ``torch.cuda.device(1)``. A launched run (WORLD_SIZE > 1) takes
    its GPU from its rank; ``cuda`` without an index and the CPU need no scope."""
    import compress.distill as distill
    from compress.core.registry import CompressionState

    monkeypatch.setenv("WORLD_SIZE", world)
    inside: list = []
    monkeypatch.setattr(distill, "_distill_logits",
                        lambda *args: inside.append(list(cuda_scopes)) or "report")  # fmt: skip
    state = CompressionState(device=torch.device(device))
    assert distill_logits(None, None, state) == "report"
    assert cuda_scopes == want and inside == [want[:1]]


def test_bad_config_messages():
    with pytest.raises(ValueError, match="needs data"):
        LogitsConfig()
    with pytest.raises(ValueError, match="at least one"):
        LogitsConfig(data="x", kl_weight=0)


def test_teacher_mismatch_errors(text_file):
    student, cfg, state = tiny_setup(text_file, 4)
    from compress.testing import make_tiny_llama

    state.teacher = make_tiny_llama(vocab_size=400)
    with pytest.raises(ConfigError, match="vocabulary"):
        distill_logits(student, cfg, state)
    student, cfg, state = tiny_setup(text_file, 4)
    prune_hidden_size(student, HiddenSizeConfig(hidden_size=32, importance="magnitude"), state)
    with pytest.raises(ConfigError, match="hidden_weight"):
        distill_logits(student, cfg, state)


def test_distillation_without_enough_data(tmp_path, text_file):
    short = tmp_path / "short.txt"
    short.write_text("tiny text")
    student, cfg, state = tiny_setup(str(short), 4)
    from compress.core.errors import DataError

    with pytest.raises(DataError, match="larger source"):
        distill_logits(student, cfg, state)
