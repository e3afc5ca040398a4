"""What the runtime's int4 kernels cost in quality, measured through the runtime itself: a
W4 export scored window by window through the paged cache (``runtime.paged.paged_logits``: the
first token alone, the rest as one prefill chunk, fp32 pages), against the same model's own
forward with the dequantized weights and fp32 activations (the ``reference`` backend).

Rows: our kernels (``int4_kernel="q4q8"``) with their int8-rounded activations at every row
count (``COMPRESS_CPU_BF16_ROWS=0``'s setting), and, where the CPU has AMX-BF16, with chunks of
``cpu_q8.bf16_amx_min_rows()`` rows or more through the bf16-activation op
(``int4_linear_bf16_tiles_amx``). Perplexity of each, its change against the reference, and
mean per-token KL(reference || runtime). JSON + markdown:

    python scripts/bench_int4_activations.py ~/.cache/compress/serving/smollm2-w4 \
        --windows 8 --out out/int4-activations

(the export: ``scripts/bench_serving.py`` writes it; any W4 export of SmolLM2 does).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from compress.data import resolve_text_path
from compress.eval.quality import window_spans
from compress.eval.report import environment, markdown_table
from compress.io.load import load_model
from compress.kernels import cpu_q8
from compress.quant.linear import set_backend
from compress.runtime.engine import Runtime
from compress.runtime.layers import _Q8Kernel
from compress.runtime.paged import PagedKVCache, paged_logits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("export", type=Path)
    p.add_argument("--windows", type=int, default=8, help="WikiText-2 test windows of 512")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("out/int4-activations"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.export)
    model, tokenizer = loaded.model, loaded.tokenizer
    runtime = Runtime(model, max_seq_len=512, compile=False, int4_kernel="q4q8",
                      int8_kernel="q8q8", static_cache=False, keep_model_weights=True)  # fmt: skip
    set_backend(model, "reference")  # the model's own forward: dequantized fp32 weights
    ids = tokenizer(resolve_text_path("wikitext2").read_text(encoding="utf-8"),
                    add_special_tokens=False)["input_ids"]  # fmt: skip
    spans = window_spans(len(ids), 512, 512)[: args.windows]
    first = runtime.layers[0]
    cache = PagedKVCache(n_layers=len(runtime.layers), num_blocks=32, block_size=16,
                         n_kv=first.n_kv, head_dim=first.head_dim, dtype=torch.float32,
                         compute_dtype=torch.float32, device=runtime.device)  # fmt: skip
    references = []
    with torch.no_grad():
        for begin, end, _ in spans:
            logits = model(torch.tensor([ids[begin:end]])).logits[0]
            references.append(logits.double().log_softmax(-1))

    def score(name: str) -> dict:
        nll = nll_ref = kl = 0.0
        scored = 0
        for (begin, end, first_scored), ref in zip(spans, references, strict=True):
            window = ids[begin:end]
            targets = torch.tensor(window[first_scored - begin :])
            cut = slice(first_scored - begin - 1, -1)  # row r predicts token r + 1
            logp = paged_logits(runtime, cache, window).double().log_softmax(-1)[cut]
            r = ref[cut]
            nll -= float(logp.gather(-1, targets[:, None]).sum())
            nll_ref -= float(r.gather(-1, targets[:, None]).sum())
            kl += float((r.exp() * (r - logp)).sum())
            scored += len(targets)
        ppl, ppl_ref = math.exp(nll / scored), math.exp(nll_ref / scored)
        row = dict(kernels=name, ppl=ppl, ppl_reference=ppl_ref,
                   delta_pct=100 * (ppl / ppl_ref - 1), kl=kl / scored, tokens=scored)  # fmt: skip
        print(row, flush=True)
        return row

    rows = []
    bf16_rows = cpu_q8.bf16_amx_min_rows()
    if bf16_rows is not None:
        rows.append(score(f"ours, bf16 activations (AMX-BF16) from {bf16_rows} rows"))
    else:
        print(f"no AMX-BF16 row: {cpu_q8.amx_bf16_reason()}")
    for q8 in (m for m in runtime.layers.modules() if isinstance(m, _Q8Kernel)):
        q8.bf16_op = None  # int8-rounded activations at every row count
    rows.insert(0, score("ours, int8 activations per block of 32"))
    columns = [("kernels", "int4 layers"), ("ppl", "ppl"), ("ppl_reference", "ppl, reference"),
               ("delta_pct", "delta %"), ("kl", "KL (nats/token)")]  # fmt: skip
    env = environment()
    md = (
        f"{args.export.name} through the runtime (paged, fp32 pages), first {len(spans)} "
        f"WikiText-2 test windows of 512 ({rows[0]['tokens']} scored), against the model's own "
        f"forward on the dequantized weights in fp32. {env['cpu']}, torch {env['torch']}, "
        f"{env['date']}.\n\n" + markdown_table(rows, columns) + "\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"environment": env, "rows": rows},
                                                      indent=1))  # fmt: skip
    (args.out / "results.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
