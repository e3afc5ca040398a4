"""The GPU check of issue 34, one section after another, each recording its error and going on.

    python scripts/gpu_check.py --out DIR [--dry-run] [--budget-s 450]

Sections: 1 kernel tests on CUDA; 2 the kernel table (``compress.kernels.bench``) against cuBLAS
bf16 and torch's int4/int8 kernels on decode shapes, written as ``kernel_table.json`` (the file
format of ``compress/kernels/kernel_table.py``, merged with the committed one: copy it to
``compress/kernels/configs/`` to commit it); 3 runtime decode, bf16 vs W4 vs W8A8, SmolLM2-135M
and TinyLlama-1.1B shapes (random weights), eager and replayed from the runtime's CUDA graphs;
4 GPTQ, AWQ and AutoRound of the 1.1B shape via ``compress run`` with ``device: cuda``; 5
perplexity of one export on the GPU (whole, layer by layer) and the CPU. Writes
``gpu_check.json`` and ``gpu_check.md`` after every section. ``--dry-run`` runs the same code
on CPU on tiny shapes (the kernels in the interpreter): it checks the plumbing, its numbers mean
nothing.
Needs what ``scripts/gpu_check.sh`` sets up (this checkout importable, ``.gpu/data`` as
``COMPRESS_DATA_DIR`` for sections 4-5).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
# N x K (out x in): Llama 7B/8B, SmolLM2-135M, TinyLlama-1.1B
DECODE_SHAPES = [(4096, 4096), (576, 576), (1536, 576), (576, 1536), (2048, 5632),
                 (5632, 2048), (11008, 4096), (2048, 2048), (256, 2048)]  # fmt: skip
M_VALUES = [1, 2, 4, 16, 256]
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
               tie_word_embeddings=True, rope_theta=100000.0)  # fmt: skip
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)  # fmt: skip
QUANT_RECIPES = {  # section 4; the goal's GPTQ setting is 128 x 2048 tokens
    "gptq": ("{source: wikitext2-valid, num_samples: 128, seq_len: 2048, seed: 0}",
             "{pass: quantize.gptq, group_size: 128}"),
    "awq": ("{source: wikitext2-valid, num_samples: 32, seq_len: 512, seed: 0}",
            "{pass: quantize.awq, group_size: 128}"),
    "autoround": ("{source: wikitext2-valid, num_samples: 32, seq_len: 512, seed: 0}",
                  "{pass: quantize.autoround, group_size: 128}"),
}  # fmt: skip


GPU_TESTS = [f"tests/kernels/test_{name}.py" for name in (
    "gemv", "gptq_walk", "int4_gemm", "int8_gemm", "triton_ops", "llama_triton", "kernel_table",
    "dispatch")] + [  # the real capture (the CPU emulation beside it is CI's)
    "tests/runtime/test_cuda_graphs.py::test_real_cuda_graphs_give_the_launched_logits"]


def section_tests(ctx: dict) -> dict:
    """1. The GPU kernels' tests and the runtime's CUDA-graph tests, interpreter off (the CPU
    kernels' tests are CI's: their C++ builds would eat this section's time)."""
    cmd = [sys.executable, "-m", "pytest", *GPU_TESTS, "-m", "not slow", "-q",
           "-p", "no:cacheprovider",
           "-k", "not q4q8 and not q8q8"]  # fmt: skip  (those two build our CPU kernels: ~1 min)
    if ctx["dry_run"]:
        cmd += ["--collect-only"]
    elif importlib.util.find_spec("xdist") is not None:  # the device image has pytest-xdist
        cmd += ["-n", "8"]  # Triton's compiles (ptxas) dominate: 8 of the 16 cores share them
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" or ctx["dry_run"]}
    proc = _run(cmd, ctx, cap_s=150, env=env)  # the kernel table after it needs its time
    (ctx["out"] / "kernel_tests.log").write_text(proc["output"])
    return {"returncode": proc["returncode"], "summary": proc["output"].strip().splitlines()[-1:]}


def section_table(ctx: dict) -> dict:
    """2. The kernel table; saved after every entry, so a timeout keeps what was measured."""
    from compress.kernels import bench, kernel_table

    device = ctx["device"]
    shapes = [(40, 128)] if ctx["dry_run"] else DECODE_SHAPES
    m_values = [1, 17] if ctx["dry_run"] else M_VALUES
    dtype = torch.float32 if ctx["dry_run"] else torch.bfloat16  # the interpreter: no bf16 dot

    def save(table: dict) -> None:
        committed = REPO / "compress/kernels/configs" / kernel_table.TABLE_FILE
        existing = json.loads(committed.read_text()) if committed.is_file() else None
        table = dict(table, measured=ctx["versions"] | {"method": bench.METHOD})
        merged = kernel_table.merge_tables(existing, table)
        (ctx["out"] / kernel_table.TABLE_FILE).write_text(json.dumps(merged, indent=1) + "\n")

    budget = min(150.0, ctx["left"]() - 240)  # leave time for sections 3-5
    table = bench.measure_table(shapes, m_values, device=device, dtype=dtype, budget_s=budget,
                                repeats=1 if ctx["dry_run"] else bench.REPEATS,
                                on_entry=save)  # fmt: skip
    save(table)
    kernel_table.select_table([dict(table, match=[table["gpu"]])], table["gpu"])  # loads back
    fields = ("op", "n", "k", "group_size", "m", "kernel", "us", "baseline_us", "config")
    rows = [{k: e.get(k) for k in (*fields, "errors")} for e in table["entries"]]
    return {"entries": rows, "not_measured": table["not_measured"], "goals": _kernel_goals(rows)}


def _kernel_goals(rows: list[dict]) -> list[str]:
    """Issue 34's kernel goals, read off the table (W4A16, M = 1)."""
    lines = []
    for r in rows:
        if r["op"] != "int4" or r["m"] != 1:
            continue
        ours = min((r["us"][k] for k in ("triton_gemv", "triton_gemm") if k in r["us"]),
                   default=None)  # fmt: skip
        pack, bf16 = r["us"].get("torch_int4pack"), r["baseline_us"].get("torch_bf16")
        shown = "n/a" if ours is None else f"{ours:.2f}"
        lines.append(f"{r['n']}x{r['k']}: ours {shown} us, vs bf16 {_ratio(bf16, ours)}, "
                     f"vs int4pack {_ratio(pack, ours)}")  # fmt: skip
    return lines


def _ratio(base, ours) -> str:
    return f"{base / ours:.2f}x" if base and ours else "n/a"


def _model(shape: dict, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**shape, max_position_embeddings=2048)
    return LlamaForCausalLM(config).to(device, dtype).eval()


def _quantize(model, variant: str):
    from compress.quant.linear import QuantLinear, WeightScheme, w8a8_from_linear

    for name, linear in list(model.named_modules()):
        if isinstance(linear, torch.nn.Linear) and "lm_head" not in name:
            parent, _, child = name.rpartition(".")
            if variant == "w4":
                group = 128 if linear.in_features % 128 == 0 else 64
                q = QuantLinear.from_linear(linear, WeightScheme(4, group), backend="auto")
            else:
                q = w8a8_from_linear(linear, torch.bfloat16, "auto")
            setattr(model.get_submodule(parent), child, q)
    return model


def _decode_rates(model, ctx: dict, prompt_len: int = 32, new_tokens: int = 64) -> dict:
    """Tokens/s of ``Runtime.generate`` (greedy, batch 1, ``new_tokens`` after a ``prompt_len``
    prompt), eager (every kernel launched from Python) and with the runtime's CUDA graphs (one
    replay per token, ``compress/runtime/graphs.py``), and whether the two give the same
    tokens. Each is timed after a warm-up generation of the same length (compiles, tunes,
    captures the graphs of both power-of-two key lengths)."""
    from compress.runtime.engine import Runtime

    dry, cuda = ctx["dry_run"], ctx["device"].type == "cuda"
    prompt = list(range(1, prompt_len + 1))
    count = 4 if dry else new_tokens
    out: dict = {}
    tokens = {}
    for mode, graphs in (("eager", False), ("cuda_graph", True)):
        if graphs and not cuda:
            out[mode] = "not run: needs CUDA"
            continue
        try:
            runtime = Runtime(model, max_seq_len=prompt_len + new_tokens + 8, compile=False,
                              keep_model_weights=True, cuda_graphs=graphs)  # fmt: skip
            runtime.generate([prompt], count)  # warm-up
            _sync(ctx)
            start = time.perf_counter()
            tokens[mode] = runtime.generate([prompt], count)[0]
            _sync(ctx)
            out[f"{mode}_tok_s"] = len(tokens[mode]) / (time.perf_counter() - start)
            if graphs:
                out["graphs"] = len(runtime._graphs.graphs) if runtime._graphs else 0
        except Exception as exc:  # noqa: BLE001
            out[mode] = f"failed: {type(exc).__name__}: {exc}"[:400]
    out["tokens"] = len(tokens.get("eager", []))
    if len(tokens) == 2:
        out["graph_tokens_equal_eager"] = tokens["eager"] == tokens["cuda_graph"]
    return out


def section_runtime(ctx: dict) -> dict:
    """3. Runtime decode, bf16 vs W4 (Triton) vs W8A8, on random weights of two shapes."""
    from compress.testing import LLAMA_SHAPES

    real = {"smollm2-135m": SMOLLM2, "1.1b": LLAMA_SHAPES["1.1b"]}
    shapes = {"tiny": TINY} if ctx["dry_run"] else real
    dtype = torch.float32 if ctx["dry_run"] else torch.bfloat16
    results = {}
    for name, shape in shapes.items():
        for variant in ("bf16", "w4", "w8a8"):
            key, model = f"{name} {variant}", None
            if ctx["left"]() < 200:  # sections 4-5 need their share
                results[key] = {"skipped": "the run's time budget is spent"}
                continue
            try:
                model = _model(shape, ctx["device"], dtype)
                if variant != "bf16":
                    model = _quantize(model, variant)
                with torch.no_grad():
                    results[key] = _decode_rates(model, ctx)
            except Exception as exc:  # noqa: BLE001
                results[key] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            del model
            if ctx["device"].type == "cuda":
                torch.cuda.empty_cache()
    results["goals"] = _runtime_goals(results, list(shapes))
    return results


def _runtime_goals(results: dict, shapes: list[str]) -> list[str]:
    """Issue 34's decode goals: W4 over bf16 tokens/s (>= 2x on the 1.1B shape, >= 1x on
    SmolLM2's), graphed and eager."""
    lines = []
    for name in shapes:
        want = {"1.1b": 2.0}.get(name, 1.0)
        for mode in ("cuda_graph", "eager"):
            w4 = results.get(f"{name} w4", {}).get(f"{mode}_tok_s")
            bf16 = results.get(f"{name} bf16", {}).get(f"{mode}_tok_s")
            if w4 and bf16:
                verdict = "met" if w4 / bf16 >= want else "not met"
                lines.append(f"{name} {mode}: W4 {w4:.1f} / bf16 {bf16:.1f} tok/s = "
                             f"{w4 / bf16:.2f}x (goal >= {want:g}x: {verdict})")  # fmt: skip
    return lines


def section_quant(ctx: dict) -> dict:
    """4. GPTQ / AWQ / AutoRound of the 1.1B shape on the GPU: wall time and peak memory."""
    from compress.recipe import parse_recipe

    try:
        parse_recipe({"name": "probe", "device": "cuda", "passes": []})
    except Exception as exc:  # noqa: BLE001
        return {"skipped": f"recipes have no 'device' key yet ({type(exc).__name__}: "
                           f"{str(exc)[:200]})"}  # fmt: skip
    results = {"column walk": _gptq_walk_timing(ctx)}
    model_dir = _synthetic(ctx)
    for name in QUANT_RECIPES:
        recipe = ctx["work"] / f"quant-{name}.yaml"  # not in --out: 8 files come back at most
        recipe.write_text(quant_recipe(name, dry_run=ctx["dry_run"]))
        export = ctx["work"] / f"export-{name}"
        cmd = [sys.executable, "-m", "compress.cli", "run", str(recipe), "--model", str(model_dir),
               "--out", str(export), "--overwrite", "--no-progress"]  # fmt: skip
        proc = _run(cmd, ctx, cap_s=150 if name == "gptq" else 75)
        row = {"returncode": proc["returncode"], "wall_s": proc["seconds"],
               "tail": proc["output"].strip().splitlines()[-3:]}  # fmt: skip
        results_json = export / "results.json"
        if results_json.is_file():
            row["peaks"] = _peaks(json.loads(results_json.read_text()))
            ctx.setdefault("exports", []).append(str(export))
        results[name] = row
    return results


def quant_recipe(name: str, *, dry_run: bool) -> str:
    """Section 4's recipe ``name`` (a QUANT_RECIPES key) on the GPU, or for the dry run on the
    CPU with two short sequences and groups the tiny width has."""
    calibration, step = QUANT_RECIPES[name]
    if dry_run:
        calibration = re.sub(r"num_samples: \d+, seq_len: \d+", "num_samples: 2, seq_len: 32",
                             calibration)  # fmt: skip
        step = step.replace("group_size: 128", "group_size: 32")
    return (f"name: gpu-check-{name}\ndevice: {'cpu' if dry_run else 'cuda'}"
            f"\ncalibration: {calibration}\npasses: [{step}]\n"
            "export: {dtype: bfloat16}\neval: {baseline: false, perplexity: null}\n")


def _gptq_walk_timing(ctx: dict) -> dict:
    """GPTQ of one 1.1B down_proj (2048 x 5632, g128) on the device, the column walk in torch
    (a dozen launches a column) and in Triton (``kernels.gptq_walk``, one a group): seconds
    each and how many codes agree."""
    from compress.quant.gptq import GptqConfig, gptq_quantize
    from compress.quant.linear import WeightScheme

    n, k = (64, 256) if ctx["dry_run"] else (2048, 5632)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g).to(ctx["device"])
    x = torch.randn(2 * k, k, generator=g).to(ctx["device"])
    h = x.T @ x / x.shape[0]
    out: dict = {"shape": [n, k]}
    codes = {}
    for walk in ("torch", "triton"):
        try:
            gptq_quantize(w[:16], h, WeightScheme(4, 128), GptqConfig(), walk=walk)  # warm-up
            _sync(ctx)
            start = time.perf_counter()
            codes[walk] = gptq_quantize(w, h, WeightScheme(4, 128), GptqConfig(), walk=walk)[0]
            _sync(ctx)
            out[f"{walk}_s"] = round(time.perf_counter() - start, 3)
        except Exception as exc:  # noqa: BLE001
            out[walk] = f"failed: {type(exc).__name__}: {exc}"[:400]
    if len(codes) == 2:
        out["codes_equal_fraction"] = (codes["torch"] == codes["triton"]).float().mean().item()
    return out


def _peaks(payload, path: str = "") -> dict:
    """Every numeric field named like a peak (``peak_gpu_bytes``, ``peak_rss_bytes``...)."""
    found = {}
    if isinstance(payload, dict):
        for key, value in payload.items():
            if "peak" in key and isinstance(value, int | float):
                found[f"{path}{key}"] = value
            elif isinstance(value, dict | list):
                found |= _peaks(value, f"{path}{key}.")
    elif isinstance(payload, list):
        for i, value in enumerate(payload):
            found |= _peaks(value, f"{path}{i}.")
    return found


def _synthetic(ctx: dict) -> Path:
    from compress.testing import write_synthetic_llama

    if ctx["dry_run"]:  # the same writer, the tiny shape
        return write_synthetic_llama(ctx["work"] / "synthetic-tiny", "1.1b", **TINY)
    # bench_memory's checkpoint of this shape (the same settings)
    folder = ctx["work"] / "synthetic-1.1b"
    return write_synthetic_llama(folder, "1.1b", max_position_embeddings=4096, shard_size="2GB")


def section_ppl(ctx: dict) -> dict:
    """5. Perplexity of one export on the GPU and on the CPU (``compress eval``)."""
    help_text = _run([sys.executable, "-m", "compress.cli", "eval", "--help"], ctx, cap_s=30)
    if "--device" not in help_text["output"]:
        return {"skipped": "compress eval has no --device option yet"}
    exports = ctx.get("exports") or []
    if not exports:
        return {"skipped": "no export from section 4"}
    out = {"export": exports[0]}
    for name, flags in EVAL_RUNS.items():
        if ctx["dry_run"]:  # every run on the CPU: the plumbing, not the numbers
            flags = [f if f != "cuda" else "cpu" for f in flags]
        cmd = [sys.executable, "-m", "compress.cli", "eval", exports[0], *flags, "--limit", "4"]
        proc = _run(cmd, ctx, cap_s=60)
        found = re.search(r'"perplexity": ([0-9.eE+-]+)', proc["output"])
        out[name] = {"returncode": proc["returncode"], "seconds": proc["seconds"],
                     "perplexity": float(found.group(1)) if found else None,
                     "tail": proc["output"].strip().splitlines()[-4:]}  # fmt: skip
    gpu, cpu = out["cuda"]["perplexity"], out["cpu"]["perplexity"]
    if gpu and cpu:  # GPU in bf16, CPU in the export's dtype; 1% is a guess at bf16's noise
        out["relative_difference"] = abs(gpu / cpu - 1)
        out["within_1pct"] = out["relative_difference"] <= PPL_TOLERANCE
    layerwise = out["cuda layer by layer"]["perplexity"]
    if gpu and layerwise:  # the same casts and ops, one layer at a time: expected equal
        out["layer_by_layer_equals_whole"] = layerwise == gpu
    return out


# section 5's `compress eval` runs of the first export (with `--limit 4`)
EVAL_RUNS = {"cuda": ["--device", "cuda"], "cpu": ["--device", "cpu"],
             "cuda layer by layer": ["--device", "cuda", "--layer-by-layer"]}  # fmt: skip
PPL_TOLERANCE = 0.01  # relative; bf16 weights and activations against the CPU's numbers


SECTIONS = {"1 kernel tests": section_tests, "2 kernel table": section_table,
            "3 runtime decode": section_runtime, "4 calibrated passes": section_quant,
            "5 perplexity gpu vs cpu": section_ppl}  # fmt: skip


def _run(cmd: list[str], ctx: dict, *, cap_s: float, env=None) -> dict:
    """A child process with the smaller of ``cap_s`` and the time left; output kept."""
    timeout = max(5.0, min(cap_s, ctx["left"]() - 10))
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                              env=env)  # fmt: skip
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, output = "timeout", f"timed out after {timeout:.0f} s\n{exc.stdout or ''}"
    return {"returncode": code, "output": str(output)[-20000:],
            "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip


def _sync(ctx: dict) -> None:
    if ctx["device"].type == "cuda":
        torch.cuda.synchronize()


def versions(device) -> dict:
    import triton

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (dry run)"
    return {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "triton": triton.__version__, "commit": commit or None, "gpu": gpu}  # fmt: skip


def write_report(out: Path, report: dict) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    kind = "DRY RUN: CPU, numbers mean nothing" if report["dry_run"] else "GPU"
    lines = [f"# GPU check ({kind})", "", f"versions: {report['versions']}", ""]
    for name, sec in report["sections"].items():
        lines += [f"## {name}: {sec['status']} ({sec['seconds']} s)", ""]
        if sec.get("error"):
            lines += ["```", sec["error"], "```", ""]
        result = sec.get("result") or {}
        if name.startswith("2") and result.get("entries"):
            lines += ["| op | N×K | group | M | chosen | µs per kernel | bf16 µs |",
                      "|---|---|---:|---:|---|---|---:|"]  # fmt: skip
            for e in result["entries"]:
                us = ", ".join(
                    f"{k} {v:.2f}" for k, v in sorted(e["us"].items(), key=lambda kv: kv[1])
                )
                bf16 = e["baseline_us"].get("torch_bf16")
                lines.append(
                    f"| {e['op']} | {e['n']}×{e['k']} | {e['group_size']} | {e['m']} | "
                    f"{e['kernel']} | {us} | {'-' if bf16 is None else f'{bf16:.2f}'} |"
                )
            lines += ["", *[f"- {g}" for g in result["goals"]], ""]
        elif result:
            lines += ["```", json.dumps(result, indent=1, default=str)[:6000], "```", ""]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT", "out")),
        help="where gpu_check.json/.md and kernel_table.json go ($OUT or ./out)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU, tiny shapes, kernels interpreted: checks the plumbing only",
    )
    parser.add_argument("--budget-s", type=float, default=450.0, help="whole-run time budget")
    parser.add_argument("--sections", default="12345", help="which sections to run, e.g. 23")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_check.py needs a CUDA GPU (or --dry-run)")
    if args.dry_run:  # read when the kernels are first imported, in section 2
        os.environ["TRITON_INTERPRET"] = "1"
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    device = torch.device("cpu" if args.dry_run else "cuda")
    work = Path(os.environ.get("GPU_CHECK_WORK") or Path(tempfile.gettempdir()) / "gpu_check_work")
    work.mkdir(parents=True, exist_ok=True)
    ctx = {"out": args.out, "work": work, "dry_run": args.dry_run, "device": device,
           "versions": versions(device),
           "left": lambda: args.budget_s - (time.perf_counter() - started)}  # fmt: skip
    report = {"dry_run": args.dry_run, "versions": ctx["versions"], "sections": {}}
    for name, fn in SECTIONS.items():
        if name[0] not in args.sections:
            continue
        t0 = time.perf_counter()
        entry = {"status": "ok"}
        if ctx["left"]() < 20:
            entry = {"status": "skipped", "error": "the run's time budget is spent"}
        else:
            try:
                entry["result"] = fn(ctx)
                if isinstance(entry["result"], dict) and "skipped" in entry["result"]:
                    entry["status"] = "skipped"
            except Exception:  # noqa: BLE001  (one failing section must not stop the others)
                entry = {"status": "failed", "error": traceback.format_exc()[-3000:]}
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        report["sections"][name] = entry
        write_report(args.out, report)
        print(f"{name}: {entry['status']} in {entry['seconds']} s", flush=True)


if __name__ == "__main__":
    main()
