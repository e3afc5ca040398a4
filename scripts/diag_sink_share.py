"""How much of AutoRound's block loss is the first token (the attention sink), layer by layer.

AutoRound's loss for decoder layer i (float-model target) is the squared error between the
quantized model's hidden states after layer i and the float model's. At RTN (zero tuning steps)
that is the difference of two plain forward passes, so this script needs no quantizer internals:
it runs the float model and its int4 RTN copy (the AutoRound recipe's grid and groups) on the
calibration sequences and prints, per layer, position 0's share of the summed squared error and
position 0's squared norm over the median token's. The last decoder layer is left out: the
model returns its output after the final norm.

    python scripts/diag_sink_share.py --num-samples 8 --out out/diag_sink_share

Writes diag_sink_share.json/.md.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

from compress.calibration import calibration_sequences
from compress.core.registry import CompressionState, run_passes
from compress.eval.report import environment, markdown_table
from compress.io.load import load_model
from compress.quant.rtn import Int4RtnConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-samples", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--symmetric-grid", default="signed")
    p.add_argument("--out", default="out/diag_sink_share")
    args = p.parse_args()

    loaded = load_model(args.model)
    cal = calibration_sequences(
        "wikitext2-valid",
        loaded.tokenizer,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        seed=0,
    )
    base = loaded.model.eval()
    rtn = copy.deepcopy(base)
    cfg = Int4RtnConfig(group_size=args.group_size, symmetric_grid=args.symmetric_grid)
    run_passes(rtn, [cfg], CompressionState(tokenizer=loaded.tokenizer, progress=False))
    err, norm = None, None
    with torch.no_grad():
        for ids in cal.split(1):
            want = base(ids, output_hidden_states=True).hidden_states[1:-1]  # after layers 0..L-2
            got = rtn(ids, output_hidden_states=True).hidden_states[1:-1]
            e = torch.stack([(g - w).pow(2).sum(-1)[0] for g, w in zip(got, want, strict=True)])
            n = torch.stack([w.pow(2).sum(-1)[0] for w in want])  # [layers, T]
            err = e if err is None else err + e
            norm = n if norm is None else norm + n
    rows = [
        {
            "layer": i,
            "sink_share_pct": round(100 * float(err[i, 0] / err[i].sum()), 1),
            "sink_norm2_ratio": round(float(norm[i, 0] / norm[i, 1:].median()), 1),
        }
        for i in range(err.shape[0])
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"settings": vars(args), "environment": environment(), "rows": rows}
    (out / "diag_sink_share.json").write_text(json.dumps(record, indent=2))
    columns = [
        ("layer", "decoder layer"),
        ("sink_share_pct", "first token's share of the squared error %"),
        ("sink_norm2_ratio", "first token's squared norm / median token's"),
    ]
    table = markdown_table(rows, columns)
    (out / "diag_sink_share.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
