"""Perplexity and KL layer by layer (``perplexity(stream=...)``): every window through layer i,
then layer i+1, each layer read from the checkpoint and freed, for a model bigger than memory.
The numbers must be the whole-model path's, bit for bit, for a plain bf16 checkpoint and for
a compressed one (quantized layers scored dequantized), KL included; at most one decoder layer
is resident at any time."""

from __future__ import annotations

import pytest
import torch

from compress.eval.quality import perplexity
from compress.io import stream as stream_module
from compress.io.export import export_checkpoint, layerwise_model, load_compressed
from compress.quant.linear import dequantized_for_scoring
from compress.testing import make_char_tokenizer, make_tiny_llama

TEXT = "".join(f"Line {i}: the quick brown fox number {i * 7 % 13} jumps over {i % 5} dogs.\n"
               for i in range(120))


@pytest.fixture
def checkpoint(tmp_path):
    model = make_tiny_llama(num_hidden_layers=3, tie_word_embeddings=False).to(torch.bfloat16)
    folder = tmp_path / "tiny-bf16"
    model.save_pretrained(folder)
    make_char_tokenizer().save_pretrained(folder)
    return folder


def _whole(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _score(model, tmp_path, name, stream=None, **kw):
    # 7 windows of 48 tokens: two forward batches of 4 and 3 (WINDOWS_PER_FORWARD)
    return perplexity(model, make_char_tokenizer(), TEXT, context_length=48, limit=7,
                      progress=False, state_dir=tmp_path / f"state-{name}", stream=stream,
                      top_k_dir=tmp_path / "top", **kw)


def test_layerwise_equals_whole_model_for_plain_and_compressed(checkpoint, tmp_path,
                                                              monkeypatch, one_thread):
    from compress.core.registry import run_passes
    from compress.quant.rtn import Int4RtnConfig

    whole = _whole(checkpoint)
    base = _score(whole, tmp_path, "base-whole", top_k=8)
    stream = layerwise_model(checkpoint)
    resident = []
    original = stream_module.StreamedModel.load_layer

    def load_layer(self, index, device="cpu", **kwargs):
        layer = original(self, index, device, **kwargs)
        resident.append(sum(stream_module.is_resident(x) for x in self.layers))
        return layer

    monkeypatch.setattr(stream_module.StreamedModel, "load_layer", load_layer)
    base_lw = _score(stream.model, tmp_path, "base-layerwise", stream, top_k=8)
    assert resident == [1, 1, 1]
    assert base_lw.nll_mean == base.nll_mean and base_lw.scored_tokens == base.scored_tokens
    assert base_lw.windows == 7

    # a compressed export (W4 RTN, float parts in the checkpoint's bf16), scored both ways
    # against the baseline's top-k: same NLL, same KL
    from compress.core.registry import CompressionState

    quantized = _whole(checkpoint)
    run_passes(quantized, [Int4RtnConfig(group_size=32)],
               CompressionState())
    out = tmp_path / "w4"
    export_checkpoint(quantized, make_char_tokenizer(), out, dtype="bfloat16")
    loaded = load_compressed(out).eval()
    with dequantized_for_scoring(loaded):
        w4 = _score(loaded, tmp_path, "w4-whole", kl_base=base.top_k_path)
    w4_stream = layerwise_model(out)
    w4_lw = _score(w4_stream.model, tmp_path, "w4-layerwise", w4_stream,
                   kl_base=base_lw.top_k_path)
    assert w4_lw.nll_mean == w4.nll_mean and w4.nll_mean != base.nll_mean
    assert w4_lw.kl.kl_mean == w4.kl.kl_mean and w4.kl.kl_mean > 0
    assert w4_lw.kl.top1_changed_pct == w4.kl.top1_changed_pct


def test_layerwise_resumes_from_its_saved_state(checkpoint, tmp_path, one_thread):
    stream = layerwise_model(checkpoint)
    first = _score(stream.model, tmp_path, "lw", stream)
    again = _score(stream.model, tmp_path, "lw", stream)
    assert again.reused_windows == 7 and again.nll_mean == first.nll_mean


@pytest.mark.parametrize("model_type", ["gemma2", "qwen3", "phi3", "olmo3", "smollm3", "gpt_neox"])
def test_layerwise_equals_whole_model_across_families(model_type, tmp_path, one_thread):
    """Families whose forward differs around the stack: Gemma2 scales the embedding, soft-caps
    the logits and alternates sliding and global layers (per-layer masks), Qwen3 normalizes
    q/k, Phi3 fuses qkv, OLMo3 takes a rope table per layer type, SmolLM3 has layers without
    RoPE, GPT-NeoX's checkpoints name its head embed_out (lm_head in transformers 5's tree)."""
    from compress.testing import make_tiny_model

    model = make_tiny_model(model_type, num_hidden_layers=3).to(torch.bfloat16)
    folder = tmp_path / model_type
    model.save_pretrained(folder)
    whole = _score(_whole(folder), tmp_path, "whole")
    stream = layerwise_model(folder)
    layerwise = _score(stream.model, tmp_path, "layerwise", stream)
    assert layerwise.nll_mean == whole.nll_mean
    # nothing stays resident, a head tied to the embedding included (Gemma2 ties them)
    assert all(t.device.type == "meta" for t in stream.model.state_dict().values())


def test_windows_beyond_the_hidden_budget_are_scored_in_groups(checkpoint, tmp_path,
                                                              monkeypatch, one_thread):
    """With a budget of one forward batch, each batch is its own group (the checkpoint is read
    once per group): the numbers do not change, and a run cut after the first group resumes
    from it."""
    from compress.eval import quality

    whole = _score(_whole(checkpoint), tmp_path, "whole")
    monkeypatch.setattr(quality, "LAYERWISE_HIDDEN_BYTES", 1)
    stream = layerwise_model(checkpoint)
    loads = stream.loads
    cut = {"groups": 0}
    original = quality._logits_from_last_hidden

    def stop_after_first_group(*args):
        if cut["groups"] == 1:  # the first group (a batch of 4 windows) is scored: stop
            raise KeyboardInterrupt
        cut["groups"] += 1
        return original(*args)

    monkeypatch.setattr(quality, "_logits_from_last_hidden", stop_after_first_group)
    with pytest.raises(KeyboardInterrupt):
        _score(stream.model, tmp_path, "grouped", stream)
    monkeypatch.setattr(quality, "_logits_from_last_hidden", original)
    resumed = _score(stream.model, tmp_path, "grouped", stream)
    assert resumed.reused_windows == 4 and resumed.nll_mean == whole.nll_mean
    assert stream.loads - loads == 3 * 3  # two groups, then the second again: 3 layers each


def test_cli_eval_layer_by_layer_equals_eval_and_refusal_names_it(checkpoint, tmp_path, capsys,
                                                                  monkeypatch, one_thread):
    """``compress eval --layer-by-layer`` gives ``compress eval``'s perplexity on a plain
    checkpoint; ``compress eval`` of a model that would not fit loaded whole is refused before
    loading, with the flag as the way out."""
    import json

    from compress.cli import main
    from compress.pipeline import preflight

    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    common = [str(checkpoint), "--dataset", str(text), "--context-length", "48", "--limit", "5",
              "--no-progress"]
    assert main(["eval", *common]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main(["eval", *common, "--layer-by-layer"]) == 0
    layerwise = json.loads(capsys.readouterr().out)
    assert layerwise["perplexity"] == whole["perplexity"]
    assert layerwise["protocol"]["scored"] == "layer by layer"
    monkeypatch.setattr(preflight, "available_memory_bytes", lambda: 10**6)
    assert main(["eval", *common]) == 2
    assert "--layer-by-layer" in capsys.readouterr().err


def test_layerwise_on_a_device_scores_as_the_whole_model_there(checkpoint, tmp_path,
                                                               monkeypatch, one_thread):
    """On a GPU evaluation casts the weights to bf16 (``eval_dtype``) and layer-by-layer scoring
    runs each layer, the modules outside the stack and the hidden states there, cast the same
    way. Without a GPU the same code runs with the CPU standing in for it and ``eval_dtype``
    giving bf16: the numbers must be those of the whole model scored under ``on_eval_device``,
    bit for bit, plain and W4 (against fp32 they differ: the cast happened)."""
    from compress.core import device as device_mod
    from compress.core.device import on_eval_device
    from compress.core.registry import CompressionState, run_passes
    from compress.eval.quality import layerwise_placement
    from compress.quant.rtn import Int4RtnConfig

    fp32 = _score(_whole(checkpoint), tmp_path, "fp32")
    monkeypatch.setattr(device_mod, "eval_dtype", lambda device: torch.bfloat16)
    cpu = torch.device("cpu")
    whole = _whole(checkpoint)
    with on_eval_device(whole, cpu) as placed:
        assert placed["dtype"] == "bfloat16"
        ref = _score(whole, tmp_path, "whole-bf16")
    stream = layerwise_model(checkpoint)
    layerwise = _score(stream.model, tmp_path, "layerwise-bf16", stream, device=cpu)
    assert layerwise.nll_mean == ref.nll_mean and layerwise.nll_mean != fp32.nll_mean
    assert layerwise_placement(stream, cpu) == {"device": "cpu", "dtype": "bfloat16",
                                                "scored": "layer by layer"}  # fmt: skip
    assert all(t.device.type == "meta" for t in stream.model.state_dict().values())

    quantized = _whole(checkpoint)
    run_passes(quantized, [Int4RtnConfig(group_size=32)], CompressionState())
    out = tmp_path / "w4"
    export_checkpoint(quantized, make_char_tokenizer(), out, dtype="bfloat16")
    loaded = load_compressed(out).eval()
    with on_eval_device(loaded, cpu), dequantized_for_scoring(loaded):
        w4 = _score(loaded, tmp_path, "w4-whole-bf16")
    w4_stream = layerwise_model(out)
    w4_layerwise = _score(w4_stream.model, tmp_path, "w4-layerwise-bf16", w4_stream, device=cpu)
    assert w4_layerwise.nll_mean == w4.nll_mean and w4.nll_mean != layerwise.nll_mean


@pytest.mark.parametrize("model_type", ["gemma2", "qwen3"])
def test_layerwise_on_a_device_across_families(model_type, tmp_path, monkeypatch, one_thread):
    """The device path (cast as on a GPU, the CPU standing in) for a family with a scaled
    embedding, soft-capped logits and a tied head (Gemma2) and one with q/k norms (Qwen3)."""
    from compress.core import device as device_mod
    from compress.core.device import on_eval_device
    from compress.testing import make_tiny_model

    model = make_tiny_model(model_type, num_hidden_layers=3).to(torch.bfloat16)
    folder = tmp_path / model_type
    model.save_pretrained(folder)
    monkeypatch.setattr(device_mod, "eval_dtype", lambda device: torch.bfloat16)
    cpu = torch.device("cpu")
    whole = _whole(folder)
    with on_eval_device(whole, cpu):
        ref = _score(whole, tmp_path, "whole")
    stream = layerwise_model(folder)
    assert _score(stream.model, tmp_path, "layerwise", stream, device=cpu).nll_mean == ref.nll_mean
    assert all(t.device.type == "meta" for t in stream.model.state_dict().values())
