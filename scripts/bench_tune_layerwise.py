"""Peak resident memory and wall time of ``compress tune``'s layer-by-layer sensitivity
measurement (``compress.pipeline.tune_layerwise``) on synthetic checkpoints of real shapes,
against its preflight estimate and the whole-model measurement's estimate. Each measurement
runs in a child process (``ru_maxrss``). Speed and memory do not depend on the weights'
values; the token ids are random.

    python scripts/bench_tune_layerwise.py --shapes 7b --formats float int4-g128 \
        --samples 2 --seq-len 128 --out out/bench_tune_layerwise
    python scripts/bench_tune_layerwise.py --shapes --checkpoints DIR ...  # folders as they are

Checkpoints are written once under --models (default .cache/compress/synthetic, the one
scripts/bench_memory.py uses) and reused.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace) -> None:
    import torch

    from compress.io.export import layerwise_model
    from compress.pipeline.tune import parse_format
    from compress.pipeline.tune_layerwise import measure_sensitivity_layerwise
    from compress.pipeline.tune_units import tune_units

    torch.manual_seed(0)
    formats = [parse_format(f) for f in args.formats]
    stream = layerwise_model(Path(args.model))
    vocab = int(stream.model.config.vocab_size)
    ids = torch.randint(3, vocab, (args.samples, args.seq_len))
    units = tune_units(stream.model)
    start = time.perf_counter()
    scores, _ = measure_sensitivity_layerwise(stream, units, formats, list(ids.split(4)),
                                              spill_near=Path(args.spill))  # fmt: skip
    seconds = time.perf_counter() - start
    finite = all(v == v and v != float("inf") for row in scores.values() for v in row.values())
    print(json.dumps({"seconds": seconds, "linears": len(scores), "finite": finite,
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                      * 1024}))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="*", default=["7b"])
    p.add_argument("--checkpoints", nargs="*", default=[],
                   help="checkpoint folders measured too (e.g. bench_memory's synthetic MoE)")
    p.add_argument("--formats", nargs="+", default=["float", "int4-g128"])
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--models", default=str(REPO / ".cache/compress/synthetic"))
    p.add_argument("--out", default="out/bench_tune_layerwise")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--spill", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return

    from compress.pipeline.tune import parse_format, sensitivity_bytes
    from compress.pipeline.tune_layerwise import layerwise_sensitivity_bytes
    from compress.testing import write_synthetic_llama

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    formats = [parse_format(f) for f in args.formats]
    rows = []
    todo = [(shape, Path(args.models) / f"llama-{shape}-bf16") for shape in args.shapes]
    todo += [(Path(folder).name, Path(folder)) for folder in args.checkpoints]
    for shape, model in todo:
        if shape in args.shapes:
            write_synthetic_llama(model, shape, max_position_embeddings=4096, shard_size="2GB")
        tokens = args.samples * args.seq_len
        cmd = [sys.executable, __file__, "--child", "--model", str(model), "--spill", str(out),
               "--formats", *args.formats, "--samples", str(args.samples),
               "--seq-len", str(args.seq_len)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{shape}: the measurement failed:\n{proc.stderr[-3000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append({
            "shape": shape, "formats": args.formats, "tokens": tokens, **result,
            "estimate_layerwise_bytes": layerwise_sensitivity_bytes(
                model, formats, min(args.samples, 4) * args.seq_len, tokens),
            "estimate_whole_bytes": sensitivity_bytes(model, formats,
                                                      min(args.samples, 4) * args.seq_len),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())
    meta = {"commit": commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpu": cpu, "command": " ".join(sys.argv)}  # fmt: skip
    (out / "bench_tune_layerwise.json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                              indent=1))  # fmt: skip
    gb = 1e9
    lines = [f"{meta['date']}, commit {commit}, {cpu}: `{meta['command']}`", "",
             "| shape | formats | tokens | peak RSS GB | estimate GB | whole-model estimate GB "
             "| minutes |", "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['shape']} | {' '.join(r['formats'])} | {r['tokens']} | "
                     f"{r['peak_rss_bytes'] / gb:.2f} | {r['estimate_layerwise_bytes'] / gb:.2f} "
                     f"| {r['estimate_whole_bytes'] / gb:.1f} | {r['seconds'] / 60:.1f} |")
    (out / "bench_tune_layerwise.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
