"""Decode speed of a mixed-precision model whose float layers hold a copy per phase.

SmolLM2-135M (fp32) with its MLPs W4g64 (RTN) and its attention float, as ``compress tune``
leaves such exports: on a CPU with bf16 matmuls our runtime decodes those float layers in bf16
and prefills them in fp32 (``runtime/float_linear.py``). One row, a 32-token prompt, 128 greedy
new tokens, eager, 2 threads; tokens/s of ``--rounds`` runs (median, min, max) and the first
tokens (equal across code versions: the same function). Prints one JSON line.

    python scripts/bench_mixed_float_decode.py
    PYTHONPATH=<a checkout of another commit> python scripts/bench_mixed_float_decode.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    import compress
    from compress.io.load import load_model
    from compress.quant.rtn import Int4RtnConfig, quantize_linears
    from compress.runtime.engine import Runtime

    torch.set_num_threads(2)
    model = load_model("smollm2-135m").model
    quantize_linears(model, Int4RtnConfig(group_size=64, targets=(r"re:.*mlp\..*",)), 4, "bench")
    runtime = Runtime(model, max_seq_len=256, compile=False, int4_kernel="q4q8")
    qkv = runtime.layers[0].qkv
    prompt = [list(range(100, 132))]
    runtime.generate(prompt, 16)  # warm-up
    rates, tokens = [], None
    for _ in range(args.rounds):
        start = time.perf_counter()
        tokens = runtime.generate(prompt, args.new_tokens)[0]
        rates.append(args.new_tokens / (time.perf_counter() - start))
    print(json.dumps({
        "compress": compress.__file__,
        "qkv": None if qkv is None else ("amx tiles" if qkv.amx_op is not None else "plain"),
        "decode_dtype": str(runtime.decode_dtype), "prefill_dtype": str(runtime.prefill_dtype),
        "tok_s_median": round(statistics.median(rates), 1),
        "tok_s_min": round(min(rates), 1), "tok_s_max": round(max(rates), 1),
        "first_tokens": tokens[:8],
    }))


if __name__ == "__main__":
    main()
