"""Real-model tier: SmolLM2-135M (the embedded default) on small slices of WikiText-2."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

from compress.core.registry import CompressionState, run_passes
from compress.data import resolve_text_path
from compress.eval.quality import perplexity
from compress.io.export import export_checkpoint
from compress.quant.rtn import Int4RtnConfig, Int8RtnConfig

pytestmark = pytest.mark.real

SLICE = dict(context_length=256, limit=6, progress=False)


@pytest.fixture(scope="module")
def wikitext(data_dir):
    return resolve_text_path("wikitext2", data_dir).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def baseline_ppl(smollm2, wikitext):
    return perplexity(smollm2.model, smollm2.tokenizer, wikitext, **SLICE).perplexity


def test_greedy_continuation_is_coherent_and_stable(smollm2):
    tok = smollm2.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    with torch.no_grad():
        out = smollm2.model.generate(ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in text, text


def _quantized(smollm2, cfg):
    model = copy.deepcopy(smollm2.model)
    run_passes(model, [cfg], CompressionState(progress=False))
    return model


def test_w8_rtn_perplexity_within_one_percent(smollm2, wikitext, baseline_ppl):
    model = _quantized(smollm2, Int8RtnConfig())
    ppl = perplexity(model, smollm2.tokenizer, wikitext, **SLICE).perplexity
    assert abs(ppl / baseline_ppl - 1) < 0.01, (ppl, baseline_ppl)


def test_w4_rtn_perplexity_finite_and_reported(smollm2, wikitext, baseline_ppl):
    model = _quantized(smollm2, Int4RtnConfig(group_size=128, fallback_group_size=64))
    ppl = perplexity(model, smollm2.tokenizer, wikitext, **SLICE).perplexity
    print(f"\nSmolLM2 W4 RTN g128/g64 on the slice: {ppl:.3f} (baseline {baseline_ppl:.3f})")
    assert torch.isfinite(torch.tensor(ppl)) and baseline_ppl < ppl < 3 * baseline_ppl


PLAIN = """
import sys, torch
from transformers import AutoModelForCausalLM
ids = torch.load(sys.argv[1])
for path in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        torch.save(model(ids).logits, path + ".plain.pt")
assert "compress" not in sys.modules
"""


def test_w4_and_w8_exports_reload_in_plain_transformers(smollm2, tmp_path):
    pytest.importorskip("compressed_tensors")
    from compress.quant.linear import set_backend

    ids = smollm2.tokenizer("Compression makes serving cheaper because", return_tensors="pt")[
        "input_ids"
    ]
    torch.save(ids, tmp_path / "ids.pt")
    expected, dirs = [], []
    for name, cfg in [("w4", Int4RtnConfig(group_size=128, fallback_group_size=64)),
                      ("w8", Int8RtnConfig())]:
        model = _quantized(smollm2, cfg)
        set_backend(model, "reference")
        with torch.no_grad():
            expected.append(model(ids).logits)
        dirs.append(str(export_checkpoint(model, smollm2.tokenizer, tmp_path / name)))
        del model
    env = {**os.environ, "PYTHONPATH": ""}
    proc = subprocess.run([sys.executable, "-c", PLAIN, str(tmp_path / "ids.pt"), *dirs],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for want, path in zip(expected, dirs, strict=True):
        got = torch.load(path + ".plain.pt")
        # Stated tolerance: 1e-3 absolute on logits of magnitude ~30 (fp32 reordering only).
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
