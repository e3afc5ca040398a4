"""Batch-1 decode of families whose layers differ from Llama's, in public models' shapes with
random bf16 weights (speed does not depend on the values): transformers' ``generate`` on the
bf16 model (what the runtime's fallback ran before these families were in the runtime), our
runtime on the same bf16 model, and our runtime on its RTN W4 copy (g128, g64 where 128 does
not divide) with our integer-dot kernels (``compress serve``'s kernels). A Llama shape of the
same size is the fused path's reference. A prompt of ``--prompt`` random tokens, then
``--new`` tokens; decode tokens per second after the first, the median of ``--runs`` with the
spread. JSON + markdown:

    python scripts/bench_family_decode.py --out out/family_decode
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from compress.eval.report import environment, markdown_table

# public models' shapes (their config.json sizes)
SHAPES = {
    "pythia-160m": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
        vocab_size=50304, rotary_pct=0.25, max_position_embeddings=2048,
        tie_word_embeddings=False)),
    "opt-125m": ("OPTConfig", "OPTForCausalLM", dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, ffn_dim=3072,
        vocab_size=50272, word_embed_proj_dim=768, max_position_embeddings=2048)),
    "phi-1.5": ("PhiConfig", "PhiForCausalLM", dict(
        hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, intermediate_size=8192,
        vocab_size=51200, partial_rotary_factor=0.5, tie_word_embeddings=False)),
    # DeepSeek-V2-Lite's widths and YaRN, 4 of its 27 layers (the whole model is 31 GB in bf16):
    # latent attention (compress.runtime.latent: the latent in the cache) and 64 routed experts
    "deepseek-v2-lite-4l": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
        intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64,
        n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, q_lora_rank=None,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, head_dim=64,
        v_head_dim=128, vocab_size=102400, topk_method="greedy", tie_word_embeddings=False,
        max_position_embeddings=163840, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=40.0,
            original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
            mscale=0.707, mscale_all_dim=0.707))),
    "smollm2-135m": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)),
}


def build(shape: str) -> torch.nn.Module:
    import transformers

    config_name, model_name, settings = SHAPES[shape]
    config = getattr(transformers, config_name)(**settings)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).to(torch.bfloat16).eval()


def runtime_rate(runtime, prompt: list[int], new: int) -> float:
    """Decode tokens per second after the first of the runtime's stream of ``new`` tokens."""
    stamps = [time.perf_counter() for _ in runtime.stream(prompt, new)]
    assert len(stamps) == new, f"{len(stamps)} tokens, expected {new}"
    return (new - 1) / (stamps[-1] - stamps[0])


def hf_rate(model, prompt: list[int], new: int) -> float:
    from transformers import TextStreamer

    stamps: list[float] = []

    class Stamps(TextStreamer):  # one call per new token (the prompt comes first)
        def put(self, value):
            stamps.append(time.perf_counter())

        def end(self):
            pass

    with torch.no_grad():
        model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, streamer=Stamps(None), pad_token_id=0)
    return (new - 1) / (stamps[-1] - stamps[1])  # stamps[0]: the prompt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("out/family_decode"))
    args = p.parse_args()
    from compress.core.registry import CompressionState, run_passes
    from compress.quant.rtn import Int4RtnConfig
    from compress.runtime.engine import Runtime

    rows = []
    for shape in args.shapes:
        model = build(shape)
        vocab = model.config.vocab_size
        prompts = [torch.randint(3, vocab, (args.prompt,), generator=torch.Generator().manual_seed(
            run)).tolist() for run in range(args.runs)]  # fmt: skip
        cells = {"transformers bf16": [hf_rate(model, q, args.new) for q in prompts]}
        length = args.prompt + args.new
        ours = Runtime(model, max_seq_len=length, compile=False, keep_model_weights=True)
        assert ours.fallback_reason is None, ours.fallback_reason
        cells["ours bf16"] = [runtime_rate(ours, q, args.new) for q in prompts]
        del ours
        # g128, or g64 where 128 does not divide a layer's inputs (SmolLM2's 576)
        widths = [m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)]
        group = 128 if all(w % 128 == 0 for w in widths) else 64
        state = CompressionState(progress=False)
        run_passes(model, [Int4RtnConfig(group_size=group)], state)
        assert state.reports[-1].metrics["quantized_share"] == 1.0, "layers left in float"
        w4 = Runtime(model, max_seq_len=length, compile=False, int4_kernel="q4q8")
        cells["ours W4 (q4q8)"] = [runtime_rate(w4, q, args.new) for q in prompts]
        row = {"shape": shape, "model_type": model.config.model_type, "w4_group": group}
        for name, rates in cells.items():
            row[name] = {"median": statistics.median(rates), "min": min(rates),
                         "max": max(rates), "runs": rates}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del w4, model
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"environment": environment(), "settings": vars(args) | {"out": str(args.out)},
              "rows": rows}
    (args.out / "family_decode.json").write_text(json.dumps(result, indent=1))
    columns = [c for c in rows[0] if c not in ("shape", "model_type", "w4_group")]
    shown = [{"shape": r["shape"], "model_type": r["model_type"], "w4_group": r["w4_group"],
              **{c: f"{r[c]['median']:.1f} ({r[c]['min']:.1f}-{r[c]['max']:.1f})"
                 for c in columns}} for r in rows]  # fmt: skip
    table = markdown_table(shown, [("shape", "shape"), ("model_type", "model_type"),
                                   ("w4_group", "W4 group"),
                                   *((c, f"{c} tok/s") for c in columns)])
    (args.out / "family_decode.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
