"""The Minitron-style chain prune -> distill -> GPTQ through ``run_job`` on the tiny model: the
passes run in order on one model, distillation's teacher is the model as loaded (unpruned, its
logits equal to an independent load of the same folder), and the export holds the pruned,
quantized student."""

from __future__ import annotations

import json

import torch
import yaml
from transformers import AutoModelForCausalLM

import compress.distill
from compress.io.export import load_compressed
from compress.pipeline.job import run_job
from compress.prune.slicing import count_params
from compress.quant.linear import QuantLinear
from compress.recipe import parse_recipe

HIDDEN, INTERMEDIATE, PRUNED, VOCAB = 64, 128, 64, 320


def _params(intermediate: int) -> int:
    """Hand count for the tiny Llama (2 layers, hidden 64, 2 of 4 heads as KV, tied head)."""
    attn = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * 32  # q, o: 64x64; k, v: 32x64
    mlp = 3 * HIDDEN * intermediate
    return VOCAB * HIDDEN + 2 * (attn + mlp + 2 * HIDDEN) + HIDDEN


def test_prune_distill_gptq_chain_with_unpruned_teacher(
    tiny_model, tiny_tokenizer, tmp_path, monkeypatch, one_thread
):
    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = tmp_path / "tiny"
    tiny_model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    text = tmp_path / "text.txt"
    text.write_text("".join(
        f"Line {i}: the quick brown fox number {i * 7 % 13} jumps over {i % 5} dogs.\n"
        for i in range(60)
    ))
    recipe = parse_recipe(yaml.safe_load(f"""
        name: tiny-minitron
        calibration: {{source: {text}, num_samples: 4, seq_len: 32, seed: 0}}
        passes:
          - {{pass: prune.mlp_channels, intermediate_size: {PRUNED}}}
          - {{pass: distill.logits, data: {text}, steps: 4, seq_len: 32, batch_size: 2,
              warmup_steps: 1, eval_sequences: 2, eval_every: 4}}
          - {{pass: quantize.gptq, group_size: 32}}
        export: {{dtype: float32}}
        eval: {{perplexity: {{dataset: {text}, context_length: 64, limit: 2}}}}
    """))

    seen: dict[str, object] = {}
    real_teacher = compress.distill._teacher

    def spy_teacher(cfg, student, state):
        teacher = real_teacher(cfg, student, state)
        seen["student_params"] = sum(p.numel() for p in student.parameters())
        seen["teacher_params"] = sum(p.numel() for p in teacher.parameters())
        seen["teacher_intermediate"] = teacher.config.intermediate_size
        seen["teacher_is_student"] = teacher is student

        def record(module, args, kwargs, output):  # the first training batch's teacher logits
            if "logits" not in seen:
                ids = args[0] if args else kwargs["input_ids"]
                seen["ids"], seen["logits"] = ids.detach().clone(), output.logits.detach().clone()

        teacher.register_forward_hook(record, with_kwargs=True)
        return teacher

    monkeypatch.setattr(compress.distill, "_teacher", spy_teacher)
    result = run_job(recipe, model=str(model_dir), out_dir=tmp_path / "out", progress=False)

    # distillation: an unpruned teacher, distinct from the pruned student
    assert seen["teacher_params"] == _params(INTERMEDIATE) == 94528
    assert seen["teacher_intermediate"] == INTERMEDIATE
    assert seen["student_params"] == _params(PRUNED) == 69952
    assert not seen["teacher_is_student"]
    original = AutoModelForCausalLM.from_pretrained(model_dir).eval()  # independent load
    with torch.no_grad():
        expected = original(seen["ids"], use_cache=False).logits
    torch.testing.assert_close(seen["logits"], expected, rtol=1e-6, atol=1e-6)

    # the chain: three reports in recipe order, each on the previous pass's model
    passes = result.payload["passes"]
    assert [p["name"] for p in passes] == ["prune.mlp_channels", "distill.logits",
                                           "quantize.gptq"]
    assert passes[0]["metrics"]["intermediate_after"] == PRUNED
    assert passes[1]["metrics"]["steps"] == 4
    assert passes[1]["metrics"]["teacher_held_out_ppl"] != passes[1]["metrics"][
        "held_out_ppl_before"]  # teacher and student are different models
    assert len(passes[2]["changed"]) == 14 and not passes[2]["skipped"]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    reloaded = load_compressed(tmp_path / "out")  # the export: the pruned, quantized student
    down = reloaded.model.layers[1].mlp.down_proj
    assert isinstance(down, QuantLinear) and down.in_features == PRUNED
    assert count_params(reloaded) == _params(PRUNED)
    baseline, compressed = result.rows
    assert baseline["linear_weight_mb"] > 0 and compressed["perplexity"] > 1

