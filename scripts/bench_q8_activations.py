"""What our integer-dot decode kernels cost in quality (compress/kernels/cpu_q8.py, llama.cpp's
Q4 x Q8 / Q8 x Q8 scheme): perplexity with exact activations vs activations rounded to int8 per
block of 32 (scale = amax/127, round half to even) at the input of every int4/int8 layer, as
the runtime's ``int4_kernel="q4q8"``/``int8_kernel="q8q8"`` decode computes them.

The int8 rounding is emulated in float (fake-quantized inputs to every quantized decoder linear),
so this measures the numerics, not the speed: the kernels equal a float64 model of the same
arithmetic (tests/kernels/test_cpu_q8.py). Every column runs the quantized layers on the
reference backend (dequantized fp32 weights), so "exact" means fp32 activations. One run, same
windows for every row. The last column also gives the model the runtime's int8 lm_head
(``lm_head_bits=8``: RTN, per channel, symmetric), its inputs rounded too. JSON + markdown:

    python scripts/bench_q8_activations.py --limit 32 --out out/q8_activations
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from compress.core.registry import run_passes
from compress.data import resolve_text_path
from compress.eval.quality import perplexity
from compress.eval.report import environment, markdown_table
from compress.io.load import load_model
from compress.pipeline.job import recipe_state
from compress.quant.linear import QuantLinear, WeightScheme, set_backend
from compress.quant.primitives import fake_quantize
from compress.recipe import load_recipe

BLOCK = 32  # llama.cpp's q8_0 block
HEAD_SCHEME = WeightScheme(8, None, True)  # the head Runtime(lm_head_bits=8) makes (RTN)


def q8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 per block of BLOCK along its last dim (symmetric, amax/127), in float."""
    flat = x.reshape(-1, x.shape[-1])
    return fake_quantize(flat, n_bits=8, group_size=BLOCK, symmetric=True).reshape(x.shape)


def q8_activation_hooks(model: torch.nn.Module) -> list:
    """Round the inputs of every weight-only int4/int8 QuantLinear (the layers our kernels run)."""
    return [
        m.register_forward_pre_hook(lambda _m, args: (q8_blocks(args[0]),))
        for m in model.modules()
        if isinstance(m, QuantLinear) and m.kind in ("int4", "int8")
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows", nargs="*", default=["smollm2-w4g128-rtn", "smollm2-w4g32-rtn", "smollm2-w8-rtn"]
    )
    parser.add_argument("--limit", type=int, default=32, help="first N test windows of 512")
    parser.add_argument("--out", default="out/q8_activations")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = resolve_text_path("wikitext2").read_text(encoding="utf-8")

    def ppl(model, tokenizer) -> float:
        return perplexity(model, tokenizer, text, limit=args.limit, source="wikitext2").perplexity

    rows = []
    for name in args.rows:
        recipe = load_recipe(f"recipes/{name}.yaml")
        loaded = load_model(recipe.model)
        run_passes(loaded.model, recipe.passes, recipe_state(recipe, loaded.tokenizer))
        set_backend(loaded.model, "reference")  # fp32 activations (the native kernel takes bf16)
        exact = ppl(loaded.model, loaded.tokenizer)
        hooks = q8_activation_hooks(loaded.model)
        rounded = ppl(loaded.model, loaded.tokenizer)
        for hook in hooks:
            hook.remove()
        # + the tied lm_head as int8 (what Runtime(lm_head_bits=8) runs), int8 activations too
        loaded.model.lm_head = QuantLinear.from_linear(
            loaded.model.lm_head, HEAD_SCHEME, backend="reference"
        )
        hooks = q8_activation_hooks(loaded.model)
        with_head = ppl(loaded.model, loaded.tokenizer)
        for hook in hooks:
            hook.remove()
        rows.append(
            {
                "variant": name,
                "quantized_linears": len(hooks) - 1,
                "ppl_exact": exact,
                "ppl_q8": rounded,
                "delta_pct": 100 * (rounded / exact - 1),
                "ppl_q8_head8": with_head,
                "head_delta_pct": 100 * (with_head / exact - 1),
            }
        )
        print(rows[-1], flush=True)
    columns = [
        ("variant", "variant"),
        ("quantized_linears", "int4/int8 linears"),
        ("ppl_exact", "ppl, exact activations"),
        ("ppl_q8", f"ppl, int8 activations (blocks of {BLOCK})"),
        ("delta_pct", "Δ %"),
        ("ppl_q8_head8", "ppl, int8 activations + int8 lm_head"),
        ("head_delta_pct", "Δ %"),
    ]
    md = markdown_table(rows, columns) + (
        f"\n\nWikiText-2 test, first {args.limit} windows of 512 tokens; torch "
        f"{torch.__version__}. SmolLM2's weights came from a Q4_1 grid (groups of 32)."
    )
    payload = {"environment": environment(), "limit": args.limit, "rows": rows}
    (out / "q8_activations.json").write_text(json.dumps(payload, indent=2))
    (out / "q8_activations.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
