"""GPTQ vs RTN on a subset of SmolLM2's decoder layers (the rest stay fp32), to see where GPTQ
helps; GPTQ runs with each given weight of the attention-sink token in the Hessian
(``sink_token_weight``; 1 = plain GPTQ). Prints token perplexity on the first N WikiText-2
test windows of 512.

    python scripts/diag_gptq_layers.py --layers '[0-5]' --limit 4 --num-samples 16
    python scripts/diag_gptq_layers.py --layers '(2[0-9])' --limit 4 --num-samples 16
"""

from __future__ import annotations

import argparse
import copy
import json
import time

from compress.calibration import calibration_sequences
from compress.core.registry import CompressionState, run_passes
from compress.data import resolve_text_path
from compress.eval.quality import perplexity
from compress.io.load import load_model
from compress.quant.gptq import GptqConfig
from compress.quant.rtn import Int4RtnConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="[0-5]", help="regex for the layer index, e.g. '[0-5]'")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--limit", type=int, default=4, help="first N test windows of 512")
    parser.add_argument("--num-samples", type=int, default=16, help="calibration sequences of 512")
    parser.add_argument("--sink-weights", type=float, nargs="+", default=[1.0, 512.0])
    args = parser.parse_args()

    loaded = load_model("smollm2-135m")
    text = resolve_text_path("wikitext2").read_text(encoding="utf-8")
    calibration = calibration_sequences(
        "wikitext2-valid", loaded.tokenizer, num_samples=args.num_samples, seq_len=512, seed=0
    )
    targets = (rf"re:model\.layers\.{args.layers}\.",)

    def ppl(model) -> float:
        return perplexity(model, loaded.tokenizer, text, context_length=512, limit=args.limit,
                          progress=False).perplexity

    results = {"layers": args.layers, "group_size": args.group_size, "baseline": ppl(loaded.model)}
    for name, cfg in [
        ("rtn", Int4RtnConfig(group_size=args.group_size, targets=targets)),
        *[
            (f"gptq_sink{w:g}", GptqConfig(n_bits=4, group_size=args.group_size, targets=targets,
                                            sink_token_weight=w))
            for w in args.sink_weights
        ],
    ]:
        model = copy.deepcopy(loaded.model)
        state = CompressionState(tokenizer=loaded.tokenizer, progress=False)
        state.calibration_batches = lambda: list(calibration.split(1))
        start = time.perf_counter()
        run_passes(model, [cfg], state)
        results[name] = ppl(model)
        results[f"{name}_seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
