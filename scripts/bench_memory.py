"""Peak resident memory of `compress run` against model size: synthetic Llamas (and MoE models)
with random bf16 weights in public models' shapes, written to disk as shards, compressed by W4
RTN g128 (W4 GPTQ or AWQ g128 with --algorithm), each run a child process measured by
`/usr/bin/time -v` (its maximum resident set size) and its results.json (peak per phase,
streamed or not).

Speed and memory do not depend on the weights' values, so random weights measure them; quality
needs a real model (docs/results.md section 1). Calibration text is tokenized by a
character-level tokenizer (``compress.testing.make_char_tokenizer``, 99 ids, inside every
vocabulary): the hidden states are as large as with any tokenizer.

    python scripts/bench_memory.py --shapes 1.1b,7b,13b --out out/bench_memory
    python scripts/bench_memory.py --shapes 7b --gptq --out out/bench_memory_gptq
    python scripts/bench_memory.py --shapes 7b,13b --gptq --first-layers 2 --out out/gptq_first2
    python scripts/bench_memory.py --load out/w4-7b --out out/load_w4_7b   # loading an export
    python scripts/bench_memory.py --shapes 70b --layers 4 --in-memory '' --out out/bench_memory_70b
    python scripts/bench_memory.py --shapes qwen3-30b-a3b --layers 4 --in-memory qwen3-30b-a3b \
        --out out/bench_memory_moe   # an MoE shape (compress.testing.MOE_SHAPES), per expert
    python scripts/bench_memory.py --shapes mixtral-8x7b --layers 2 --algorithm awq \
        --first-layers 1 --in-memory '' --out out/awq_mixtral_first1

``--layers N`` writes only the first N decoder layers of each shape, each as wide as the real
model's (with its embedding and head): a 70B checkpoint (141 GB) does not fit this disk. A
streamed pass holds one layer at a time, so its peak does not depend on the depth; compare two
depths to see it.

Checkpoints are written once under --models (default .cache/compress/synthetic) and reused;
each shape's free disk is checked first (bf16 size plus its W4 export), and a shape that does
not fit is reported as skipped, with the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from compress.testing import LLAMA_SHAPES, synthetic_config, write_synthetic_llama

REPO = Path(__file__).resolve().parents[1]

CALIBRATION = {"source": "wikitext2-valid", "num_samples": 16, "seq_len": 512, "seed": 0}
RECIPES = {
    "rtn": "passes: [{pass: quantize.int4_rtn, group_size: GROUP}]",
    "gptq": "calibration: {calibration}\npasses: [{{pass: quantize.gptq, group_size: GROUP}}]",
    "awq": "calibration: {calibration}\npasses: [{{pass: quantize.awq, group_size: GROUP}}]",
}
# a row whose pass left more of the decoder's weights float than this is not a measurement of
# that pass: GPT-OSS's widths (2880) take no group of 128, and g128 runs there quantized nothing
MIN_QUANTIZED_SHARE = 0.9
# the child's memory limit (--cgroup-limit): a cgroup of its own, v2 or v1, made and removed here
CGROUP_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/memory")


def _recipe_text(algorithm: str, group: int = 128) -> str:
    return RECIPES[algorithm].replace("{calibration}", json.dumps(CALIBRATION)).replace(
        "{{", "{").replace("}}", "}").replace("GROUP", str(group))


def group_size_for(model_dir: Path) -> int:
    """128, or the largest power of two under it that divides every input width of the
    checkpoint's weight matrices (hidden, attention output, every MLP and expert width):
    GPT-OSS's 2880 takes 64 (as "g128 means g64 where 128 does not divide" for SmolLM2)."""
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    heads, head_dim = config.get("num_attention_heads"), config.get("head_dim")
    widths = [config.get(k) for k in ("hidden_size", "intermediate_size",
                                      "moe_intermediate_size", "shared_expert_intermediate_size")]
    widths.append(heads * head_dim if heads and head_dim else None)
    group = 128
    while group > 1 and any(w % group for w in widths if w):
        group //= 2
    return group


@contextlib.contextmanager
def _limited(command: list[str], limit_bytes: int | None):
    """``command`` run inside a new memory cgroup of ``limit_bytes`` (None: as it is)."""
    if not limit_bytes:
        yield command
        return
    for root in CGROUP_ROOTS:
        v2 = root == CGROUP_ROOTS[0] and Path(root, "cgroup.controllers").exists()
        if v2 or (root == CGROUP_ROOTS[1] and Path(root, "memory.limit_in_bytes").exists()):
            break
    else:
        raise SystemExit("--cgroup-limit needs a writable cgroup v1 or v2 memory controller")
    folder = Path(root, f"compress-bench-{os.getpid()}")
    folder.mkdir()
    try:
        Path(folder, "memory.max" if v2 else "memory.limit_in_bytes").write_text(
            str(limit_bytes))
        if not v2:  # no swap either (memsw is absent without swap accounting)
            memsw = Path(folder, "memory.memsw.limit_in_bytes")
            if memsw.exists():
                memsw.write_text(str(limit_bytes))
        yield ["sh", "-c", f'echo $$ > {folder}/cgroup.procs && exec "$@"', "sh", *command]
    finally:
        folder.rmdir()


def _parse_time_v(text: str) -> dict[str, float]:
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text)
    seconds = 0.0
    if wall:
        for part in wall.group(1).split(":"):
            seconds = seconds * 60 + float(part)
    return {"peak_rss_bytes": int(peak.group(1)) * 1024 if peak else None,
            "wall_s": seconds if wall else None}


def run_one(shape: str, algorithm: str, model_dir: Path, out_root: Path, stream: str,
            eval_windows: int = 0, limit_bytes: int | None = None) -> dict:
    """``compress run`` of one recipe on one checkpoint, in a child under /usr/bin/time -v.
    ``eval_windows``: also score the baseline and the export on that many 512-token windows of
    WikiText-2 test (perplexity and KL; a streamed job scores them layer by layer)."""
    recipe = out_root / f"{shape}-{algorithm}-{stream}.yaml"
    evaluation = ("eval: {baseline: true, perplexity: {dataset: wikitext2, limit: "
                  f"{eval_windows}}}}}\n" if eval_windows
                  else "eval: {baseline: false, perplexity: null}\n")
    group = group_size_for(model_dir)
    recipe.write_text(f"name: bench-{shape}-{algorithm}\n{_recipe_text(algorithm, group)}\n"
                      "export: {dtype: bfloat16}\n" + evaluation)
    out = out_root / f"{shape}-{algorithm}-{stream}"
    command = ["/usr/bin/time", "-v", sys.executable, "-m", "compress.cli", "run", str(recipe),
               "--model", str(model_dir), "--out", str(out), "--overwrite", "--no-progress",
               "--stream", stream]
    started = time.perf_counter()
    with _limited(command, limit_bytes) as command:
        proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    row = {"shape": shape, "algorithm": algorithm, "group_size": group, "stream": stream,
           "eval_windows": eval_windows,
           "returncode": proc.returncode, **_parse_time_v(proc.stderr),
           "seconds_measured": round(time.perf_counter() - started, 1)}
    if proc.returncode != 0:  # the child's last words, not time -v's report after them
        said = [line for line in proc.stderr.strip().splitlines()
                if not line.startswith("\t") and not line.startswith("Command ")]
        row["error"] = said[-3:] + [line.strip() for line in proc.stderr.splitlines()
                                    if line.startswith("Command terminated by signal")]
        return row
    payload = json.loads((out / "results.json").read_text())
    row["phases_peak_rss_bytes"] = payload["memory"]["peak_rss_bytes"]
    row["streamed"] = payload["memory"]["streamed"]
    row["estimate_peak_bytes"] = payload["memory"]["estimate"]["peak_bytes"]
    row["activations"] = payload["memory"].get("activations")
    row["parameters"] = payload["memory"]["estimate"]["model_parameters"]
    row["export_bytes"] = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    row["quantized_share"] = payload["passes"][0]["metrics"].get("quantized_share")
    if (row["quantized_share"] or 0) < MIN_QUANTIZED_SHARE:
        row["returncode"] = "not quantized"
        row["error"] = (f"the pass quantized {row['quantized_share']} of the decoder's weights "
                        f"(group size {group}): not a measurement of it")
    if eval_windows:
        row["perplexity"] = {k: (v or {}).get("perplexity") for k, v in payload["eval"].items()
                             if k in ("baseline", "compressed")}
        row["scored"] = (payload["eval"]["compressed"] or {}).get("protocol", {}).get("scored")
    row["checkpoint_bytes"] = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    shutil.rmtree(out, ignore_errors=True)  # the export is not needed once measured
    return row


def _high_water_bytes(pid: int) -> int | None:
    """The peak resident set of a live process so far (``VmHWM``, what ``time -v`` reports
    at its end)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def run_first_layers(shape: str, algorithm: str, model_dir: Path, out_root: Path,
                     layers: int) -> dict:
    """``compress run`` of one recipe, stopped (SIGTERM) once ``layers`` decoder layers are
    done: for a run too long for one session (13B GPTQ, about 5 h on 2 cores). Its peak is the
    child's ``VmHWM`` read just before the stop; every decoder layer repeats the same work, so
    the peak over the first layers is the pass's peak (the export writes each finished layer
    and holds nothing more). Nothing lands at the run's --out (it is atomic)."""
    recipe = out_root / f"{shape}-{algorithm}-first{layers}.yaml"
    group = group_size_for(model_dir)
    recipe.write_text(f"name: bench-{shape}-{algorithm}\n{_recipe_text(algorithm, group)}\n"
                      "export: {dtype: bfloat16}\neval: {baseline: false, perplexity: null}\n")
    out = out_root / f"{shape}-{algorithm}-first{layers}"
    command = [sys.executable, "-m", "compress.cli", "run", str(recipe), "--model",
               str(model_dir), "--out", str(out), "--overwrite", "--stream", "auto"]
    started = time.perf_counter()
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            cwd=REPO)
    done, total, peak, tail = 0, None, None, ""
    assert proc.stderr is not None
    while proc.poll() is None:
        # whatever is there (tqdm redraws with \r: no newline to wait for)
        chunk = os.read(proc.stderr.fileno(), 4096).decode(errors="replace")
        if not chunk:
            break
        tail = (tail + chunk)[-4000:]
        found = re.findall(r"decoder layers[^|]*\|[^|]*\|\s*(\d+)/(\d+)", tail)
        if found:
            done, total = int(found[-1][0]), int(found[-1][1])
        peak = _high_water_bytes(proc.pid) or peak
        if done >= layers:
            proc.terminate()
            break
    proc.wait()
    stopped = done >= layers
    row = {"shape": shape, "algorithm": algorithm, "group_size": group, "stream": "auto",
           "eval_windows": 0,
           "returncode": 0 if stopped else proc.returncode, "peak_rss_bytes": peak,
           "wall_s": round(time.perf_counter() - started, 1), "first_layers": done,
           "layers": total, "checkpoint_bytes": sum(
               f.stat().st_size for f in model_dir.glob("*.safetensors"))}
    if not stopped:
        row["error"] = tail.strip().splitlines()[-3:]
    row["left_at_out"] = out.exists()
    return row


_LOAD = {
    # what compress.load / eval / generate run: module by module, large bf16 tensors kept
    "module by module (load_compressed)": (
        "from compress.io.export import load_compressed; load_compressed(sys.argv[1])"),
    # the reference: every tensor read at once, floats cast to float32 (the path before)
    "whole, float32 (_load_whole)": (
        "from compress.io.export import _load_whole, _quantization_config; "
        "from pathlib import Path; p = Path(sys.argv[1]); "
        "_load_whole(p, _quantization_config(p), torch.float32, 'auto')"),
}


def load_rows(folder: Path, generate_tokens: int = 16) -> list[dict]:
    """Peak resident memory of loading the compressed checkpoint ``folder``, each way in its
    own child (``ru_maxrss`` through ``time -v``), and of ``compress generate`` on it."""
    rows = []
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    for how, code in _LOAD.items():
        command = ["/usr/bin/time", "-v", sys.executable, "-c",
                   f"import sys, torch; {code}", str(folder)]
        proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
        rows.append({"load": how, "folder": str(folder), "checkpoint_bytes": size,
                     "returncode": proc.returncode, **_parse_time_v(proc.stderr)})
    command = ["/usr/bin/time", "-v", sys.executable, "-m", "compress.cli", "generate",
               "--model", str(folder), "The capital of France is",
               "--max-new-tokens", str(generate_tokens)]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    rows.append({"load": f"compress generate ({generate_tokens} tokens)", "folder": str(folder),
                 "checkpoint_bytes": size, "returncode": proc.returncode,
                 **_parse_time_v(proc.stderr)})
    return rows


def markdown(rows: list[dict], env: dict) -> str:
    lines = [f"CPU: {env.get('cpu')}; {env.get('flags')}; torch {torch.__version__}; "
             f"{os.cpu_count()} cores; RAM {env.get('ram_gib')} GiB", "",
             "| shape | pass | path | checkpoint GB | parameters | peak RSS GB (time -v) | "
             "estimate GB | wall s | s per 1e9 params | peak per phase GB |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r.get("group_size"):
            r = {**r, "algorithm": f"{r['algorithm']} g{r['group_size']}"}
        if r.get("first_layers") is not None and r.get("returncode") == 0:
            lines.append(
                f"| {r['shape']} | {r['algorithm']} | streamed, stopped after its first "
                f"{r['first_layers']} of {r['layers']} layers | {r['checkpoint_bytes'] / 1e9:.2f} "
                f"| — | {r['peak_rss_bytes'] / 1e9:.2f} (VmHWM) | — | {r['wall_s']:.0f} | "
                f"{r['wall_s'] / r['first_layers']:.0f} s per layer | — |")
            continue
        if r.get("returncode") != 0:
            limit = (f", cgroup limit {r['cgroup_limit_bytes'] / 1e9:.1f} GB"
                     if r.get("cgroup_limit_bytes") else "")
            lines.append(f"| {r['shape']} | {r['algorithm']} | {r.get('stream')}{limit} | — | — "
                         "| — | — "
                         f"| — | — | failed or skipped: {r.get('error') or r.get('skipped')} |")
            continue
        phases = ", ".join(f"{k}: {v / 1e9:.2f}" for k, v in r["phases_peak_rss_bytes"].items())
        path = "streamed" if r["streamed"] else "whole model"
        if r.get("activations") == "disk":
            path += ", hidden states in files"
        if r.get("cgroup_limit_bytes"):
            path += f", cgroup limit {r['cgroup_limit_bytes'] / 1e9:.1f} GB"
        if r.get("eval_windows"):
            path += (f", + eval of {r['eval_windows']} windows "
                     f"({r.get('scored') or 'model loaded whole'})")
        lines.append(
            f"| {r['shape']} | {r['algorithm']} | {path} | {r['checkpoint_bytes'] / 1e9:.2f} | "
            f"{r['parameters'] / 1e9:.2f}e9 | {r['peak_rss_bytes'] / 1e9:.2f} | "
            f"{r['estimate_peak_bytes'] / 1e9:.2f} | {r['wall_s']:.0f} | "
            f"{r['wall_s'] / (r['parameters'] / 1e9):.1f} | {phases} |")
    return "\n".join(lines) + "\n"


def environment() -> dict:
    from compress.eval.report import environment as env

    info = env()
    flags = sorted(set(re.findall(r"\b(avx\w*|amx\w*)\b", Path("/proc/cpuinfo").read_text())))
    return {"cpu": info.get("cpu"), "flags": " ".join(flags),
            "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            **info}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1.1b,7b,13b")
    p.add_argument("--gptq", action="store_true", help="W4 GPTQ g128 instead of W4 RTN g128")
    p.add_argument("--algorithm", choices=sorted(RECIPES), default=None,
                   help="the W4 g128 pass to run (default rtn; --gptq is --algorithm gptq)")
    p.add_argument("--in-memory", default="1.1b",
                   help="shapes also run with --stream off (the model loaded whole), for the "
                   "per-parameter wall-time comparison; '' for none")
    p.add_argument("--models", default=str(REPO / ".cache/compress/synthetic"))
    p.add_argument("--delete-models", action="store_true",
                   help="delete each synthetic checkpoint after its runs (disk)")
    p.add_argument("--out", default="out/bench_memory", help="output prefix (.json, .md)")
    p.add_argument("--eval-windows", type=int, default=0,
                   help="also evaluate baseline and export on this many WikiText-2 windows")
    p.add_argument("--load", default="",
                   help="comma-separated compressed checkpoint folders: measure loading them "
                   "(module by module vs whole in float32) and `compress generate`, then exit")
    p.add_argument("--layers", type=int, default=0,
                   help="write only this many decoder layers of each shape (0: all of them)")
    p.add_argument("--first-layers", type=int, default=0,
                   help="stop each run once this many decoder layers are done and report the "
                   "peak so far (runs too long for one session; no --in-memory rows)")
    p.add_argument("--calibration", default="",
                   help="num_samples,seq_len of the calibrated passes (default 16,512)")
    p.add_argument("--activations", choices=["auto", "memory", "disk"], default="auto",
                   help="calibration.activations of the calibrated passes")
    p.add_argument("--cgroup-limit", type=float, default=0,
                   help="run each child in a memory cgroup of this many GB (root; cgroup v1 "
                   "or v2): what a container or a job scheduler would allow it")
    args = p.parse_args()
    if args.calibration:
        samples, seq_len = (int(x) for x in args.calibration.split(","))
        CALIBRATION.update(num_samples=samples, seq_len=seq_len)
    CALIBRATION["activations"] = args.activations
    limit = int(args.cgroup_limit * 1e9) or None
    if args.load:
        env = environment()
        rows = [r for folder in args.load.split(",") for r in load_rows(Path(folder))]
        lines = [f"CPU: {env.get('cpu')}; {env.get('flags')}; torch {torch.__version__}", "",
                 "| checkpoint | GB on disk | how | peak RSS GB (time -v) | wall s |",
                 "|---|---:|---|---:|---:|"]
        lines += [f"| {r['folder']} | {r['checkpoint_bytes'] / 1e9:.2f} | {r['load']} | "
                  + (f"{r['peak_rss_bytes'] / 1e9:.2f} | {r['wall_s']:.0f} |"
                     if r["returncode"] == 0 else f"failed ({r['returncode']}) | — |")
                  for r in rows]
        Path(args.out + ".json").write_text(json.dumps({"environment": env, "rows": rows},
                                                       indent=2))
        Path(args.out + ".md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return
    algorithm = args.algorithm or ("gptq" if args.gptq else "rtn")
    out_root = Path(args.out + "-runs")
    out_root.mkdir(parents=True, exist_ok=True)
    rows = []
    env = environment()
    for shape in args.shapes.split(","):
        depth = {"num_hidden_layers": args.layers} if args.layers else {}
        family = "llama-" if shape in LLAMA_SHAPES else ""
        model_dir = Path(args.models) / (f"{family}{shape}-{args.layers}layers-bf16" if depth
                                         else f"{family}{shape}-bf16")
        params = _param_count(shape, depth)
        need = params * 2 * (0 if (model_dir / "config.json").is_file() else 1) + params * 0.6
        existing = Path(args.models).resolve()
        while not existing.exists():  # the disk the folder will be made on
            existing = existing.parent
        free = shutil.disk_usage(existing).free
        if need > free:
            rows.append({"shape": shape, "algorithm": algorithm, "returncode": None,
                         "skipped": f"needs {need / 1e9:.0f} GB of disk, {free / 1e9:.0f} free"})
            continue
        Path(args.models).mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        write_synthetic_llama(model_dir, shape, max_position_embeddings=4096, shard_size="2GB",
                              **depth)
        print(f"{shape}: checkpoint ready in {time.perf_counter() - started:.0f} s", flush=True)
        # the row says how much of the model was written; file names keep a plain form
        label = (f"{shape} ({args.layers} of {synthetic_config(shape).num_hidden_layers} "
                 "layers)" if depth else shape)
        whole = shape in args.in_memory.split(",")
        shape = f"{shape}-{args.layers}layers" if depth else shape
        if args.first_layers:
            row = run_first_layers(shape, algorithm, model_dir, out_root, args.first_layers)
            row["shape"] = label
            print(json.dumps(row), flush=True)
            rows.append(row)
            if args.delete_models:
                shutil.rmtree(model_dir)
            continue
        modes = ["auto"] + (["off"] if whole else [])
        for stream in modes:
            row = run_one(shape, algorithm, model_dir, out_root, stream, args.eval_windows,
                          limit)
            row.update(calibration=dict(CALIBRATION), cgroup_limit_bytes=limit)
            row["shape"] = label
            print(json.dumps(row), flush=True)
            rows.append(row)
        if args.delete_models:
            shutil.rmtree(model_dir)
    Path(args.out + ".json").write_text(json.dumps({"environment": env, "rows": rows}, indent=2))
    Path(args.out + ".md").write_text(markdown(rows, env))
    print(markdown(rows, env))


def _param_count(shape: str, depth: dict) -> int:
    """Parameters of the synthetic checkpoint (a meta model of its config: no memory)."""
    from transformers import AutoModelForCausalLM

    from compress.io.stream import no_weight_init, parameters_on_meta

    with no_weight_init(), parameters_on_meta():
        model = AutoModelForCausalLM.from_config(synthetic_config(shape, **depth))
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    main()
