"""End-to-end generation bench, interleaved in one run: transformers generate (fp32, bf16), our
runtime (fp32, bf16, W8, W4 g32/g64/g128 with g64 fallback, each W4 also through the AVX2 Q4 x Q8
decode kernel: the `-q8` rows) and llama.cpp (llama-cpp-python on the same model's Q4_1 GGUF, in
its own venv built once from source: ~25 min on 2 cores). Decode tok/s, TTFT, MB read per token,
MBU vs measured read bandwidth; medians, min-max. --synthetic-1b adds a random 1.1B Llama
(runtime bf16 vs W4 g128 through torch's and our int4 kernel).

    python scripts/bench_e2e.py --reps 3 --compile --out bench
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

from compress.eval.hardware import memory_bandwidth
from compress.io.load import EMBEDDED, _gguf_location, cache_dir, load_model
from compress.quant.rtn import Int4RtnConfig, Int8RtnConfig, quantize_linears
from compress.runtime.engine import Runtime

LLAMA_WORKER = r"""
import json, sys, time
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_ctx=512, verbose=False)
for line in sys.stdin:
    ids, n = json.loads(line)
    llm.reset(); t0 = (time.perf_counter(), time.process_time()); first = None; count = 0
    for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        count += 1; first = first or (time.perf_counter(), time.process_time())
        if count == n: break
    end = (time.perf_counter(), time.process_time())
    print(json.dumps([first[0] - t0[0], end[0] - first[0], count, first[1] - t0[1],
                      end[1] - first[1]]), flush=True)
"""


LLAMA_CPP_PYTHON = "0.3.36"  # the version CPU_FACTS.md measured (112 tok/s decode here)


def llama_cpp_python() -> Path:
    """The venv python with llama-cpp-python, built once from source (CPU, AVX2, 2 jobs).

    The source tree and cmake build tree live in the cache beside the venv and the build runs
    in place, so a build cut short (session end, Ctrl-C) resumes where it stopped next time."""
    root = cache_dir() / "venvs"
    venv, src, build = root / "llamacpp", root / "llamacpp-src", root / "llamacpp-cmake"
    py = venv / "bin" / "python"
    ready = [py, "-c", "import llama_cpp"]
    if py.exists() and subprocess.run(ready, capture_output=True).returncode == 0:
        return py
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    pip = [py, "-m", "pip"]
    # build tools inside the venv (not pip's throw-away isolation env): their paths, recorded
    # in the cmake cache, stay valid for the resumed build
    subprocess.run(
        pip + ["install", "-q", "scikit-build-core[pyproject]>=0.9.2", "cmake", "ninja"], check=True
    )
    tree = src / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    if not tree.exists():
        spec = f"llama-cpp-python=={LLAMA_CPP_PYTHON}"
        download = ["download", "-q", "--no-deps", "--no-binary", ":all:", "-d", src, spec]
        subprocess.run(pip + download + ["--no-build-isolation"], check=True)
        unpacked = src / "unpacking"
        shutil.rmtree(unpacked, ignore_errors=True)
        with tarfile.open(src / f"{tree.name}.tar.gz") as archive:
            archive.extractall(unpacked, filter="data")
        (unpacked / tree.name).rename(tree)  # complete trees only
    env = dict(
        os.environ,
        # Only the library: the multimodal (llava/mtmd) part, tools, tests and examples
        # double the compile time and the bench does not use them.
        CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_AVX2=ON -DGGML_BLAS=OFF -DLLAVA_BUILD=OFF "
        "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF "
        "-DLLAMA_BUILD_SERVER=OFF",
        CMAKE_BUILD_PARALLEL_LEVEL="2",
    )
    print(
        f"building llama-cpp-python from source in {build} (~25 min on 2 cores; resumes "
        "if cut short)...",
        file=sys.stderr,
    )
    subprocess.run(
        ["nice", "-n", "19", *pip, "install", "--no-build-isolation"]
        + ["-C", f"build-dir={build}", tree],
        env=env,
        check=True,
    )
    return py


def read_bandwidth() -> float:
    # the product's probe (1 GiB fp32 buffer, summed; best of 4), as compare's MBU uses
    return memory_bandwidth(size_mb=1024, repeats=4)["bytes_per_s"]


def _clocks() -> tuple[float, float]:
    # CPU time too: on a shared machine wall time measures our share of the cores, CPU time
    # measures the work (all threads of this process).
    return time.perf_counter(), time.process_time()


def time_hf(model, ids, n):
    # The reference rows (hf-*): transformers' own generate, named as such in the table.
    x = torch.tensor([ids])
    kw = dict(do_sample=False, min_new_tokens=n, max_new_tokens=n, pad_token_id=0)
    with torch.no_grad():
        a = _clocks()
        model.generate(x, **dict(kw, min_new_tokens=1, max_new_tokens=1))
        b = _clocks()
        model.generate(x, **kw)
        c = _clocks()
    ttft, cpu_ttft = b[0] - a[0], b[1] - a[1]
    return ttft, c[0] - b[0] - ttft, n, cpu_ttft, c[1] - b[1] - cpu_ttft


def time_runtime(rt, ids, n):
    t0, first, count = _clocks(), None, 0
    for _ in rt.stream(ids, n):
        count += 1
        first = first or _clocks()
    end = _clocks()
    return first[0] - t0[0], end[0] - first[0], count, first[1] - t0[1], end[1] - first[1]


def build_variants(base, ids, args, names):
    """Variant names: hf-fp32/hf-bf16 (transformers), rt-fp32/rt-bf16/rt-w8/rt-w4gN (runtime;
    W4 group N with g64 fallback), suffixes -q8 (int4 decode through our AVX2 Q4 x Q8 kernel)
    and -h4/-h8 (the tied lm_head quantized to int4 g32 / int8 by the runtime)."""
    variants = {}
    for name in names:
        kind, *options = name.split("-")[1:]
        model = copy.deepcopy(base).to(torch.bfloat16) if kind == "bf16" else base
        if kind.startswith("w"):
            model = base if name == names[-1] else copy.deepcopy(base)  # last: in place
            bits, cfg = (
                (8, Int8RtnConfig())
                if kind == "w8"
                else (4, Int4RtnConfig(group_size=int(kind[3:]), fallback_group_size=64))
            )
            quantize_linears(model, cfg, bits, name)
        if name.startswith("hf-"):
            variants[name] = (lambda m=model: time_hf(m, ids, args.new_tokens), None)
        else:
            rt = Runtime(
                model,
                max_seq_len=len(ids) + args.new_tokens,
                compile=args.compile,
                int4_kernel="q4q8" if "q8" in options else "torch",
                lm_head_bits=4 if "h4" in options else 8 if "h8" in options else None,
            )
            # warm-up over the full length: a compiled runtime builds one decode graph per
            # power-of-two cache length, and none may be compiled inside a timed request
            rt.generate([ids], args.new_tokens)
            variants[name] = (lambda r=rt: time_runtime(r, ids, args.new_tokens), rt)
    return variants


def run(variants, reps, bandwidth, extra=None):
    rows = {name: [] for name in list(variants) + list(extra or {})}
    for _ in range(reps):  # interleaved: every variant once per round
        for name, (fn, _) in list(variants.items()) + list((extra or {}).items()):
            rows[name].append(fn())
    out = {}
    for name, samples in rows.items():
        tps = [(c - 1) / d for f, d, c, *_ in samples]
        cpu_tps = [(c - 1) / cd for _, _, c, _, cd in samples]
        cpu_ttft = [cf * 1000 for _, _, _, cf, _ in samples]
        ttft = [f * 1000 for f, *_ in samples]
        rt = variants.get(name, (None, None))[1]
        read = rt.decode_bytes() if rt else None
        med = statistics.median(tps)
        out[name] = dict(
            decode_tok_s=med,
            decode_min=min(tps),
            decode_max=max(tps),
            ttft_ms=statistics.median(ttft),
            ttft_min=min(ttft),
            ttft_max=max(ttft),
            bytes_per_token=read and sum(read.values()),
            mbu=read and sum(read.values()) * med / bandwidth,
            decode_tok_per_cpu_s=statistics.median(cpu_tps),
            cpu_ttft_ms=statistics.median(cpu_ttft),
        )
    return out


def table(title, res, ref):
    lines = [
        f"### {title}",
        "",
        "| variant | decode tok/s (min-max) | vs "
        + ref
        + " | TTFT ms (min-max) | MB read/token | MBU | decode tok/CPU-s | vs "
        + ref
        + " | TTFT CPU-ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    cpu_ref = res[ref]["decode_tok_per_cpu_s"]
    for name, r in res.items():
        mb = f"{r['bytes_per_token'] / 1e6:.0f}" if r["bytes_per_token"] else "-"
        mbu = f"{r['mbu']:.0%}" if r["mbu"] else "-"
        ratio = r["decode_tok_s"] / res[ref]["decode_tok_s"]
        lines.append(
            f"| {name} | {r['decode_tok_s']:.1f} ({r['decode_min']:.1f}-"
            f"{r['decode_max']:.1f}) | {ratio:.2f}x | {r['ttft_ms']:.0f} "
            f"({r['ttft_min']:.0f}-{r['ttft_max']:.0f}) | {mb} | {mbu} | "
            f"{r['decode_tok_per_cpu_s']:.1f} | {r['decode_tok_per_cpu_s'] / cpu_ref:.2f}x"
            f" | {r['cpu_ttft_ms']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    for flag, default in (
        ("--prompt-len", 32),
        ("--new-tokens", 64),
        ("--reps", 3),
        ("--threads", 2),
    ):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--compile", action="store_true", help="compile the runtime's decode step")
    p.add_argument(
        "--variants",
        default="hf-fp32,hf-bf16,rt-fp32,rt-bf16,rt-w8,rt-w4g32,rt-w4g64,rt-w4g128,"
        "rt-w4g32-q8,rt-w4g64-q8,rt-w4g128-q8,rt-w4g128-q8-h4",
        help="see build_variants: -q8 = int4 decode through the AVX2 Q4 x Q8 kernel, -h4/-h8 = "
        "lm_head quantized to int4/int8 by the runtime",
    )
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--synthetic-1b", action="store_true")
    p.add_argument("--out", default="bench_e2e", help="output prefix (.json, .md)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 64  # one decode graph per variant and batch size
    bandwidth = read_bandwidth()
    loaded = load_model(args.model)
    text = "The history of the city begins with a small settlement on the river, " * 8
    ids = loaded.tokenizer(text)["input_ids"][: args.prompt_len]
    variants = build_variants(loaded.model, ids, args, [v for v in args.variants.split(",") if v])
    extra = {}
    if not args.no_llama_cpp and args.model in EMBEDDED:
        worker = subprocess.Popen(
            [
                llama_cpp_python(),
                "-c",
                LLAMA_WORKER,
                _gguf_location(EMBEDDED[args.model]),
                str(args.threads),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

        def llama_cpp():
            worker.stdin.write(json.dumps([ids, args.new_tokens]) + "\n")
            worker.stdin.flush()  # noqa: E702
            return json.loads(worker.stdout.readline())

        llama_cpp()
        extra["llama.cpp-q4_1"] = (llama_cpp, None)  # (timed call, no runtime)
    results, md = {}, []
    if variants:
        results["smollm2"] = run(variants, args.reps, bandwidth, extra)
        md.append(
            table(
                f"{args.model}: {len(ids)}-token prompt, {args.new_tokens} new tokens, "
                f"{args.threads} threads, compile={args.compile}",
                results["smollm2"],
                "hf-bf16" if "hf-bf16" in variants else next(iter(variants)),
            )
        )
    if args.synthetic_1b:
        del variants
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)  # TinyLlama-1.1B shape, normal(0, 0.02) weights (never zeros)
        big = LlamaForCausalLM(
            LlamaConfig(
                hidden_size=2048,
                intermediate_size=5632,
                num_hidden_layers=22,
                num_attention_heads=32,
                num_key_value_heads=4,
                vocab_size=32000,
            )
        ).eval()
        args.new_tokens = max(8, args.new_tokens // 4)
        names = ["rt-bf16", "rt-w4g128", "rt-w4g128-q8", "rt-w4g128-q8-h4"]
        v = build_variants(big, ids, args, names)
        results["synthetic_1b"] = run(v, max(2, args.reps - 1), bandwidth)
        md.append(
            table(
                f"synthetic 1.1B Llama: {args.new_tokens} new tokens",
                results["synthetic_1b"],
                "rt-bf16",
            )
        )
    md.append(f"\nread bandwidth measured: {bandwidth / 1e9:.1f} GB/s ({args.threads} threads)")
    Path(args.out + ".json").write_text(json.dumps(dict(results, bandwidth=bandwidth), indent=1))
    Path(args.out + ".md").write_text("\n\n".join(md) + "\n")
    print("\n\n".join(md))


if __name__ == "__main__":
    main()
