"""Side-by-side AutoRound: ours (quantize.autoround) vs Intel's auto-round on SmolLM2-135M, with the
same calibration token ids, iters, batch size, group layout and perplexity/KL windows.

Group 64 for both: auto-round needs a group dividing every layer and 128 does not divide 576
(SmolLM2's hidden size), so this is not the recipe's g128/g64 mix. Both int4 symmetric, lm_head
float, fp32 (auto-round's CPU bf16 autocast is off unless --amp). Known differences that stay:
auto-round's symmetric grid is +-amax/8 over codes -8..7 (ours: --symmetric-grid signed is the
same grid) and its loss skips each sequence's last position. Both targets are the float model's
own states by default (ours: --target quantized_inputs for the float block on the quantized
inputs). Each side runs in its own process (theirs in a venv under <cache>/venvs/autoround, CPU
torch first), timed around the quantization call; peak RSS is that process's ru_maxrss right
after quantizing. Defaults are recipes/smollm2-w4-autoround.yaml's.

    python scripts/bench_reference_autoround.py --out out/bench_ref_autoround

Writes bench_reference_autoround.json/.md: ppl, Δppl, KL, top-1 changed, wall s, peak RSS.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

AUTOROUND_VERSION = "0.16.1"  # newest on PyPI (2026-11-30); runs on CPU with transformers 5.24
AUTOROUND_DEFAULT_SEED = 42  # AutoRound(seed=...)'s default
ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-w4-autoround.yaml"

RUNNER = r"""
import copy, importlib.util, json, resource, sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from auto_round import AutoRound
s = json.load(open(sys.argv[1]))
if s["threads"]:
    torch.set_num_threads(s["threads"])
spec = importlib.util.spec_from_file_location("quality", s["quality_py"])
quality = importlib.util.module_from_spec(spec); sys.modules["quality"] = quality
spec.loader.exec_module(quality)
tok = AutoTokenizer.from_pretrained(s["model_dir"])
model = AutoModelForCausalLM.from_pretrained(s["model_dir"], dtype=torch.float32)
ids = torch.load(s["calibration"])
# Our tokens hold EOS between documents; auto-round drops pad-token positions from its loss and
# SmolLM2's pad token is its EOS, so it gets a tokenizer without one: all positions count, as ours.
calib_tok = copy.deepcopy(tok); calib_tok.pad_token = None
data = [{"input_ids": r[None], "attention_mask": torch.ones_like(r[None])} for r in ids]
start = time.perf_counter()
ar = AutoRound(model, calib_tok, scheme="W4A16", bits=4, group_size=s["group_size"], sym=True,
               dataset=data, iters=s["iters"], nsamples=ids.shape[0], seqlen=ids.shape[1],
               batch_size=s["batch_size"], device_map="cpu", amp=s["amp"],
               enable_torch_compile=False, seed=s["seed_theirs"])
model, layer_config = ar.quantize()
seconds = time.perf_counter() - start
peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
# without an export format the model keeps fake-quantized float weights: check that it does
distinct, n = 0, 0
for name, mod in model.named_modules():
    if isinstance(mod, torch.nn.Linear) and "lm_head" not in name:
        w = mod.weight.detach().float().reshape(mod.out_features, -1, s["group_size"]).sort(-1)[0]
        distinct = max(distinct, int(((w[..., 1:] != w[..., :-1]).sum(-1) + 1).max())); n += 1
res = quality.perplexity(model, tok, open(s["text"]).read(), context_length=s["context_length"],
                         limit=s["limit"], progress=False, kl_base=s["kl_base"])
schemes = sorted({f"bits={c.get('bits')} group={c.get('group_size')} sym={c.get('sym')} "
                  f"{c.get('data_type')}" for c in layer_config.values()})
json.dump({"result": res.to_dict(), "calib_s": seconds, "peak_rss_mb": peak_mb, "linears": n,
           "max_distinct_per_group": distinct, "schemes": schemes}, open(s["out"], "w"))
"""


def ensure_venv(venv: Path) -> Path:
    """A venv with the CPU torch of this process, then auto-round==AUTOROUND_VERSION."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        torch_pin = f"torch=={torch.__version__.split('+')[0]}"
        subprocess.run([str(python), "-m", "pip", "install", "-q", torch_pin], check=True)
    probe = f"import auto_round; assert auto_round.__version__ == {AUTOROUND_VERSION!r}"
    if subprocess.run([str(python), "-c", probe], capture_output=True).returncode:
        pin = f"auto-round=={AUTOROUND_VERSION}"
        subprocess.run([str(python), "-m", "pip", "install", "-q", pin], check=True)
    return python


def run_ours(settings_path: str) -> None:
    """Worker: our quantize.autoround on the saved tokens, timed, then perplexity + KL."""
    from compress.core.registry import CompressionState, run_passes
    from compress.eval.quality import perplexity
    from compress.io.load import load_model
    from compress.quant.autoround import AutoroundConfig

    s = json.loads(Path(settings_path).read_text())
    if s["threads"]:
        torch.set_num_threads(s["threads"])
    loaded = load_model(s["model_dir"])
    cal = torch.load(s["calibration"])
    state = CompressionState(
        tokenizer=loaded.tokenizer, calibration_batches=lambda: list(cal.split(1)), progress=False
    )
    cfg = AutoroundConfig(
        group_size=s["group_size"],
        fallback_group_size=None,
        iters=s["iters"],
        batch_size=s["batch_size"],
        symmetric_grid=s["grid"],
        target=s["target"],
        seed=s["seed"],
        loss=s["loss"],
        sampling=s["sampling"],
    )
    start = time.perf_counter()
    run_passes(loaded.model, [cfg], state)
    seconds = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    res = perplexity(
        loaded.model,
        loaded.tokenizer,
        Path(s["text"]).read_text(),
        context_length=s["context_length"],
        limit=s["limit"],
        progress=False,
        kl_base=s["kl_base"],
    )
    out = {"result": res.to_dict(), "calib_s": seconds, "peak_rss_mb": peak_mb}
    Path(s["out"]).write_text(json.dumps(out))


def _row(name: str, run: dict, base) -> dict:
    res, base_ppl = run["result"], base.perplexity
    kl = res["kl"] or {}
    return {
        "implementation": name,
        "ppl": res["perplexity"],
        "dppl": 100 * (res["perplexity"] / base_ppl - 1),
        "kl": kl.get("kl_mean"),
        "top1": kl.get("top1_changed_pct"),
        "calib_s": run["calib_s"],
        "rss": run["peak_rss_mb"],
    }


def _parser(recipe) -> argparse.ArgumentParser:
    cal, ours, ppl = recipe.calibration, recipe.passes[0], recipe.eval.perplexity
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=ours.iters)
    p.add_argument("--batch-size", type=int, default=ours.batch_size)
    p.add_argument("--num-samples", type=int, default=cal.num_samples)
    p.add_argument("--seq-len", type=int, default=cal.seq_len)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--limit", type=int, default=ppl.limit, help="test windows (0 = all)")
    p.add_argument(
        "--symmetric-grid",
        choices=["restricted", "full", "signed"],
        default="restricted",
        help="our int4 grid: amax/7 (restricted, the recipe's), amax/7.5 (full) or +-amax/8 "
        "(signed, auto-round's)",
    )
    p.add_argument(
        "--target",
        choices=["float_model", "quantized_inputs"],
        default="float_model",
        help="our block target: the float model's states (auto-round's) or the float block on "
        "the quantized inputs",
    )
    p.add_argument(
        "--loss",
        choices=["mse", "token_relative"],
        default="token_relative",
        help="our block loss: each token's error relative to its target's norm (our default) "
        "or plain MSE (auto-round's)",
    )
    p.add_argument(
        "--sampling",
        choices=["cyclic", "random"],
        default="cyclic",
        help="our minibatch order: shuffled passes over all sequences (auto-round's, our "
        "default) or each step's drawn afresh",
    )
    p.add_argument("--amp", action="store_true", help="auto-round's CPU default: bf16 autocast")
    p.add_argument("--threads", type=int, default=0, help="torch threads per side (0: default)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="minibatch sampling seed: ours uses SEED, auto-round 42 + SEED (its default is 42), "
        "so 0 is each side's default",
    )
    p.add_argument("--out", default="out/bench_ref_autoround")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run ours on a settings file
    return p


def _baseline(recipe, args, out: Path):
    """Save the calibration token ids to <out>/calibration.pt; score the fp32 model, writing its
    top-k log-probs (the variants' ``kl_base``). Returns (PerplexityResult, test text path)."""
    from compress.calibration import calibration_sequences
    from compress.data import resolve_text_path
    from compress.eval.quality import perplexity
    from compress.io.load import cache_dir, load_model
    from compress.pipeline.job import KL_TOP_K

    cal_cfg, ppl_cfg = recipe.calibration, recipe.eval.perplexity
    loaded = load_model(recipe.model)
    cal = calibration_sequences(
        cal_cfg.source,
        loaded.tokenizer,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        seed=cal_cfg.seed,
    )
    torch.save(cal, out / "calibration.pt")
    text_path = resolve_text_path(ppl_cfg.dataset)
    base = perplexity(
        loaded.model,
        loaded.tokenizer,
        text_path.read_text(),
        context_length=ppl_cfg.context_length,
        limit=args.limit or None,
        progress=False,
        state_dir=cache_dir() / "perplexity",
        top_k=KL_TOP_K,
        top_k_dir=cache_dir() / "perplexity-top-k",
    )
    return base, text_path


def _run_side(side: str, settings: dict, out: Path) -> dict:
    """Quantize + evaluate in a fresh process: ours with this interpreter, theirs in the venv."""
    from compress.io.load import cache_dir

    path = out / f"settings_{side}.json"
    path.write_text(json.dumps({**settings, "out": str(out / f"{side}.json")}))
    if side == "ours":
        cmd = [sys.executable, __file__, "--worker", str(path)]
    else:
        (out / "runner.py").write_text(RUNNER)
        python = ensure_venv(cache_dir() / "venvs" / "autoround")
        cmd = [str(python), str(out / "runner.py"), str(path)]
    subprocess.run(cmd, check=True)
    return json.loads((out / f"{side}.json").read_text())


def _markdown(args, base, runs: dict) -> tuple[str, list[dict]]:
    from compress.eval.report import kl_note, markdown_table
    from compress.pipeline.job import KL_TOP_K

    amp = ", bf16 amp" if args.amp else ""
    rows = [
        {
            "implementation": "baseline (fp32)",
            "ppl": base.perplexity,
            "dppl": 0.0,
            "kl": 0.0,
            "top1": 0.0,
        },
        _row(
            f"compress quantize.autoround ({args.symmetric_grid} grid, target {args.target}, "
            f"loss {args.loss}, {args.sampling} sampling)",
            runs["ours"],
            base,
        ),
        _row(f"auto-round {AUTOROUND_VERSION} (amax/8 grid{amp})", runs["theirs"], base),
    ]
    columns = [
        ("implementation", "implementation"),
        ("ppl", "WikiText-2 ppl"),
        ("dppl", "Δppl %"),
        ("kl", "KL"),
        ("top1", "top-1 changed %"),
        ("calib_s", "calibration wall s"),
        ("rss", "peak RSS MB"),
    ]
    md = markdown_table(rows, columns) + (
        f"\n\nW4 g{args.group_size} symmetric (both; lm_head float), {args.num_samples} x "
        f"{args.seq_len} WikiText-2 valid token ids (the same tensor for both), {args.iters} "
        f"iters, batch {min(args.batch_size, args.num_samples)}, lr 1/iters, minibatch seed "
        f"{args.seed} (auto-round: {AUTOROUND_DEFAULT_SEED + args.seed}), fp32"
        f"{' (auto-round: bf16 amp)' if args.amp else ''}. Perplexity: context "
        f"{base.protocol['context_length']}, {base.windows} test windows, "
        f"{base.scored_tokens:,} scored tokens. {kl_note(KL_TOP_K)} Wall s: the quantization "
        "call (calibration forward included); peak RSS: that process's ru_maxrss after "
        f"quantizing. Threads per side: {args.threads or 'torch default'}."
    )
    return md, rows


def main() -> None:
    from compress.eval.report import environment, write_results
    from compress.io.load import embedded_model_dir
    from compress.output_dir import claim_output_dir
    from compress.recipe import load_recipe

    recipe = load_recipe(RECIPE)
    args = _parser(recipe).parse_args()
    if args.worker:
        return run_ours(args.worker)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = claim_output_dir(args.out, "bench_reference_autoround", overwrite=args.overwrite)
    base, text_path = _baseline(recipe, args, out)
    gc.collect()  # the baseline model is gone; the two sides run in their own processes
    settings = {
        "model_dir": str(embedded_model_dir(recipe.model)),
        "calibration": str(out / "calibration.pt"),
        "text": str(text_path),
        "quality_py": str(ROOT / "compress" / "eval" / "quality.py"),
        "group_size": args.group_size,
        "iters": args.iters,
        "batch_size": args.batch_size,
        "context_length": recipe.eval.perplexity.context_length,
        "limit": args.limit or None,
        "kl_base": base.top_k_path,
        "threads": args.threads,
        "amp": args.amp,
        "grid": args.symmetric_grid,
        "target": args.target,
        "seed": args.seed,
        "loss": args.loss,
        "sampling": args.sampling,
        "seed_theirs": AUTOROUND_DEFAULT_SEED + args.seed,
    }
    runs = {side: _run_side(side, settings, out) for side in ("ours", "theirs")}
    if runs["theirs"]["max_distinct_per_group"] > 16:
        raise RuntimeError("auto-round's model kept more than 16 values per group: not int4")
    md, rows = _markdown(args, base, runs)
    payload = {
        "rows": rows,
        "args": vars(args),
        "runs": runs,
        "environment": environment(),
        "auto_round_version": AUTOROUND_VERSION,
    }
    write_results(out, "bench_reference_autoround", md, payload)
    print(md)


if __name__ == "__main__":
    main()
