"""Every family end to end: its tiny random model quantized (GPTQ W4 g32), exported, reloaded by
plain transformers in a subprocess that does not import compress (same logits within 1e-2
relative), and generated from by the runtime (tokens equal transformers' on the same quantized
model) or, for a family the runtime does not run, by the fallback with its reason.

Parametrized over ``compress.testing.TINY_MODEL_TYPES`` and the MoE types, so a new family is
one adapter entry plus one tiny config."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from compress.core.registry import CompressionState, run_passes
from compress.io.export import export_checkpoint
from compress.quant.gptq import GptqConfig
from compress.runtime.engine import Runtime, unsupported_reason
from compress.testing import TINY_MODEL_TYPES, make_char_tokenizer, make_tiny_model, make_tiny_moe

MOE_TYPES = ("mixtral", "qwen3_moe")
IDS = [[5, 17, 42, 99, 7, 3, 250, 12, 64, 33, 21, 8]]
RELOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM
assert "compress" not in sys.modules
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
with torch.no_grad():
    print(json.dumps(model(torch.tensor(json.loads(sys.argv[2]))).logits.tolist()))
assert not any(name.split(".")[0] == "compress" for name in sys.modules)
"""


@pytest.mark.parametrize("family", [*TINY_MODEL_TYPES, *MOE_TYPES])
def test_family_quantize_export_reload_generate(family, tmp_path):
    torch.set_num_threads(1)
    model = make_tiny_moe(family) if family in MOE_TYPES else make_tiny_model(family)
    gen = torch.Generator().manual_seed(0)
    batches = list(torch.randint(3, 300, (4, 1, 32), generator=gen))
    state = CompressionState(calibration_batches=lambda: batches, progress=False)
    run_passes(model, [GptqConfig(group_size=32, strict=True)], state)
    assert state.reports[-1].metrics["quantized_share"] == 1.0

    export_checkpoint(model, make_char_tokenizer(), tmp_path / "export", dtype="float32")
    run = subprocess.run(
        [sys.executable, "-c", RELOAD, str(tmp_path / "export"), json.dumps(IDS)],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    with torch.no_grad():
        ours = model(torch.tensor(IDS)).logits
    theirs = torch.tensor(json.loads(run.stdout))
    assert float((theirs - ours).norm() / ours.norm()) < 1e-2

    with torch.no_grad():
        expected = model.generate(
            torch.tensor(IDS), max_new_tokens=8, do_sample=False, eos_token_id=None,
            pad_token_id=2,
        )[0, len(IDS[0]) :].tolist()  # fmt: skip
    reason = unsupported_reason(model)
    if reason is None:  # the runtime runs it: fp32 decode, the int4 layers on the native kernel
        runtime = Runtime(model, max_seq_len=32, decode_dtype=torch.float32, compile=False)
        assert runtime.generate(IDS, 8) == [expected]
    else:  # the fallback says why and still generates transformers' tokens
        assert family in ("phi3", "olmo2")
        with pytest.warns(RuntimeWarning, match=f"model_type '{family}'"):
            runtime = Runtime(model, max_seq_len=32)
        assert runtime.generate(IDS, 8) == [expected]
