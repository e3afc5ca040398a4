"""Side-by-side GPTQ: ours vs llm-compressor's GPTQModifier on SmolLM2-135M, same calibration
tokens, same group size (64: llm-compressor's group layout needs the group to divide every
layer, and 128 does not divide 576), same perplexity protocol and windows.

The reference runs in its own virtual environment (created on first use; CPU torch first so pip
does not pull a CUDA build):

    python scripts/bench_reference_gptq.py --num-samples 16 --limit 8 --out out/bench_ref

Writes bench_reference_gptq.json/.md with perplexity and calibration wall time of both.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from compress.calibration import calibration_sequences
from compress.core.registry import CompressionState, run_passes
from compress.data import resolve_text_path
from compress.eval.quality import perplexity
from compress.io.load import cache_dir, embedded_model_dir, load_model
from compress.quant.gptq import GptqConfig
from compress.quant.rtn import Int4RtnConfig

RUNNER = r"""
import importlib.util, json, sys, time, torch
from transformers import AutoModelForCausalLM
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier
from datasets import Dataset
model_dir, cal_path, text_path, quality_py, group, limit, out = sys.argv[1:8]
spec = importlib.util.spec_from_file_location("quality", quality_py)
quality = importlib.util.module_from_spec(spec); sys.modules["quality"] = quality
spec.loader.exec_module(quality)
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
ids = torch.load(cal_path)
mask = torch.ones_like(ids).tolist()
data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": mask})
recipe = GPTQModifier(ignore=["lm_head"], config_groups={"group_0": {"targets": ["Linear"],
    "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                "group_size": int(group)}}}, dampening_frac=0.01, block_size=128)
start = time.perf_counter()
oneshot(model=model, dataset=data, recipe=recipe, max_seq_length=ids.shape[1],
        num_calibration_samples=ids.shape[0])
seconds = time.perf_counter() - start
res = quality.perplexity(model, tok, open(text_path).read(), context_length=512,
                         limit=int(limit) or None, progress=False)
result = {"perplexity": res.perplexity, "calib_s": seconds, "windows": res.windows}
json.dump(result, open(out, "w"))
"""


def ensure_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "-q",
                f"torch=={torch.__version__.split('+')[0]}",
            ],
            check=True,
        )
    probe = subprocess.run([str(python), "-c", "import llmcompressor"], capture_output=True)
    if probe.returncode:
        subprocess.run([str(python), "-m", "pip", "install", "-q", "llmcompressor"], check=True)
    return python


def run_reference(out: Path, text_path: Path, group_size: int, limit: int) -> None:
    """llm-compressor's GPTQ in its own venv on <out>/calibration.pt -> <out>/reference.json."""
    python = ensure_venv(cache_dir() / "venvs" / "ref")
    (out / "runner.py").write_text(RUNNER)
    quality_py = Path(__file__).resolve().parents[1] / "compress" / "eval" / "quality.py"
    model_dir = embedded_model_dir("smollm2-135m")
    args = [out / "runner.py", model_dir, out / "calibration.pt", text_path, quality_py,
            group_size, limit, out / "reference.json"]
    subprocess.run([str(python), *map(str, args)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--limit", type=int, default=8, help="test windows of 512 (0 = all)")
    parser.add_argument("--out", default="out/bench_ref")
    parser.add_argument(
        "--symmetric-grid", choices=["restricted", "full"], default="restricted",
        help="our int4 grid: amax/7 (restricted) or amax/7.5 (full, llm-compressor's)",
    )
    parser.add_argument(
        "--act-order", action="store_true",
        help="our GPTQ with act_order (static groups): the same configuration as "
        "llm-compressor's default actorder='static' (an alias of 'weight')",
    )
    parser.add_argument(
        "--reuse-reference", action="store_true",
        help="reuse <out>/reference.json from an earlier run with the same settings",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_model("smollm2-135m")
    cal = calibration_sequences(
        "wikitext2-valid",
        loaded.tokenizer,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        seed=0,
    )
    torch.save(cal, out / "calibration.pt")
    text_path = resolve_text_path("wikitext2")
    state = CompressionState(
        tokenizer=loaded.tokenizer, calibration_batches=lambda: list(cal.split(1)), progress=False
    )
    def ppl(model):
        return perplexity(
            model,
            loaded.tokenizer,
            text_path.read_text(),
            context_length=512,
            limit=args.limit or None,
            progress=False,
        )

    grid = args.symmetric_grid
    rtn = copy.deepcopy(loaded.model)
    run_passes(rtn, [Int4RtnConfig(group_size=args.group_size, symmetric_grid=grid)], state)
    rtn_ppl = ppl(rtn).perplexity
    del rtn
    start = time.perf_counter()
    gptq = GptqConfig(group_size=args.group_size, symmetric_grid=grid, act_order=args.act_order)
    run_passes(loaded.model, [gptq], state)
    ours_s = time.perf_counter() - start
    ours = ppl(loaded.model)
    if not (args.reuse_reference and (out / "reference.json").exists()):
        run_reference(out, text_path, args.group_size, args.limit)
    ref = json.loads((out / "reference.json").read_text())
    rows = [
        (f"RTN (compress quantize.int4_rtn, {grid} grid)", rtn_ppl, 0.0),
        (f"compress quantize.gptq ({grid} grid{', act_order' if args.act_order else ''})",
         ours.perplexity, ours_s),
        ("llm-compressor GPTQModifier (default actorder=static)", ref["perplexity"],
         ref["calib_s"]),
    ]
    md = "| implementation | WikiText-2 ppl | calibration s |\n|---|---:|---:|\n" + "\n".join(
        f"| {n} | {p:.3f} | {s:.1f} |" for n, p, s in rows
    )
    md += (
        f"\n\nW4 g{args.group_size} symmetric, {args.num_samples} x {args.seq_len} WikiText-2 "
        f"valid tokens, dampening 0.01, block 128; ppl over {ours.windows} test windows of 512."
    )
    tag = f"{grid}{'_actorder' if args.act_order else ''}"
    (out / f"bench_reference_gptq_{tag}.md").write_text(md + "\n")
    (out / f"bench_reference_gptq_{tag}.json").write_text(
        json.dumps({"rows": rows, "args": vars(args)}, indent=2)
    )
    print(md)


if __name__ == "__main__":
    main()
