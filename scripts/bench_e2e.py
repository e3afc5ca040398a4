"""End-to-end generation bench, interleaved in one run: transformers' own generate (fp32,
bf16), our runtime (fp32, bf16, W8, W4 g32/g128 with g64 fallback; the `-q8` rows decode int4
and int8 layers through our integer-dot kernels, Q4 x Q8 / Q8 x Q8 at the CPU's ISA level,
`-h8` adds an int8 lm_head) and llama.cpp (llama-cpp-python in its own venv
built once from source, ~25 min on 2 cores: SmolLM2's shipped Q4_1 GGUF, and llama.cpp's fastest
4-bit and 8-bit types on x86 (``llama_ftypes``: Q4_0, Q4_K_M where the shape allows it, Q8_0),
made by llama.cpp's quantizer from the fp32 weights our rows start from, scripts/gguf_export.py;
each row's engine names the extra weight buffers, e.g. the repacked CPU_REPACK layout, that ran).
--synthetic-1b adds a random TinyLlama-1.1B-shaped Llama with SmolLM2's vocab (runtime bf16, W8
and W4 g128 through torch's and our kernels, and llama.cpp Q4_0/Q4_K_M/Q4_1/Q8_0 of the same
weights).

Every row is a ``compress.eval.latency.Stream`` timed by ``time_request`` (wall clock, each token
stamped as it arrives): ``hf_stream(generate=True)``, ``Runtime.stream`` and the llama.cpp worker,
which prints one line per token as it is generated. Decode tok/s (1 / TPOT) and TTFT: median,
min and max (``distribution``) over interleaved rounds; MBU (``bandwidth_utilization``) from
``Runtime.decode_bytes()`` and the measured read bandwidth. The md and JSON open with the
environment (CPU, kernel flags, torch CPU capability, our kernels' ISA level) and give each
quantized runtime row's integer kernels. MB read/token: the runtime's decode weights plus its
whole allocated KV cache (an upper bound); for llama.cpp the GGUF's tensor bytes (no KV cache).
No CPU-time columns any more: ``time_request`` stamps one clock, and llama.cpp's CPU time is
spent in another process, so only wall time is comparable across the three engines.

    python scripts/bench_e2e.py --reps 3 --compile --out bench
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import NamedTuple

import torch

from compress.eval.hardware import memory_bandwidth
from compress.eval.latency import (
    Stream,
    bandwidth_utilization,
    distribution,
    hf_stream,
    time_request,
)
from compress.eval.report import environment, markdown_table
from compress.io.load import EMBEDDED, _gguf_location, cache_dir, load_model
from compress.quant.rtn import Int4RtnConfig, Int8RtnConfig, quantize_linears
from compress.runtime.engine import Runtime
from compress.testing import make_synthetic_llama

# Protocol: one JSON request per stdin line, [prompt ids, max new tokens]; the answer is one
# line per token id, printed as soon as llama.cpp has it, then a line "end".
# argv: gguf, threads, and optionally --no-extra-buffers (see llama_extra_buffers_work).
LLAMA_WORKER = r"""
import json, sys
import llama_cpp
from llama_cpp import Llama
if "--no-extra-buffers" in sys.argv[4:]:
    defaults = llama_cpp.llama_cpp.llama_model_default_params  # what Llama() starts from
    def without_extra_buffers():
        params = defaults()
        params.use_extra_bufts = False
        return params
    llama_cpp.llama_cpp.llama_model_default_params = without_extra_buffers
llm = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_ctx=int(sys.argv[3]),
            verbose=False)
for line in sys.stdin:
    ids, n = json.loads(line)
    llm.reset()
    for count, token in enumerate(llm.generate(ids, temp=0.0, top_k=1, reset=True), 1):
        print(token, flush=True)
        if count == n:
            break
    print("end", flush=True)
"""


def worker_stream(command: list) -> Stream:
    """A Stream over a worker process speaking LLAMA_WORKER's protocol (started here, once).
    Tokens are yielded as their lines arrive, so TTFT and TPOT include the pipe (microseconds)."""
    worker = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def stream(prompt: list[int], max_new_tokens: int):
        worker.stdin.write(json.dumps([list(prompt), max_new_tokens]) + "\n")
        worker.stdin.flush()
        line = "end"
        try:
            while (line := worker.stdout.readline()) not in ("end\n", ""):
                yield int(line)
        finally:
            while line not in ("end\n", ""):  # closed early: drain so the next request starts clean
                line = worker.stdout.readline()
        if line == "":
            raise RuntimeError(f"llama.cpp worker exited (code {worker.wait()}) inside a request")

    stream.engine, stream.worker = "llama.cpp", worker
    return stream


LLAMA_CPP_PYTHON = "0.3.36"  # the version CPU_FACTS.md measured (112 tok/s decode here)


# $LLAMA_CPP_ISA: "native" (default: every instruction set this CPU has), "avx512" (AVX-512
# F/CD/VL/DQ/BW with VNNI, BF16 and VBMI, AVX-VNNI, no AMX: on a Xeon whose native build's AMX
# extra buffers crash, the build whose CPU_REPACK buffers still run, i.e. llama.cpp's fastest
# working one; -march=native cannot be used minus AMX, its flags come after any -mno-amx) or
# "avx2" (AVX2/FMA/F16C only, no AVX-512/VNNI/AMX): the build an AVX2-only CPU gets, for a
# like-for-like comparison with our kernels forced to their AVX2 level (COMPRESS_CPU_ISA=avx2)
# on an AVX-512 machine.
LLAMA_ISA_FLAGS = {
    "native": "-DGGML_NATIVE=ON -DGGML_AVX2=ON",
    "avx512": "-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON "
    "-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON "
    "-DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF "
    "-DGGML_AMX_BF16=OFF",
    "avx2": "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
    "-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF "
    "-DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF",
}


def llama_cpp_isa() -> str:
    isa = os.environ.get("LLAMA_CPP_ISA", "native")
    if isa not in LLAMA_ISA_FLAGS:
        raise SystemExit(f"LLAMA_CPP_ISA={isa!r}: expected one of {list(LLAMA_ISA_FLAGS)}")
    return isa


def llama_cpp_python() -> Path:
    """The venv python with llama-cpp-python, built once from source (CPU, 2 jobs; the
    instruction sets of ``llama_cpp_isa()``).

    The source tree and cmake build tree live in the cache beside the venv and the build runs
    in place, so a build cut short (session end, Ctrl-C) resumes where it stopped next time."""
    root = cache_dir() / "venvs"
    isa = llama_cpp_isa()
    suffix = "" if isa == "native" else f"-{isa}"
    venv, src = root / f"llamacpp{suffix}", root / "llamacpp-src"
    build = root / f"llamacpp-cmake{suffix}"
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
        CMAKE_ARGS=f"{LLAMA_ISA_FLAGS[isa]} -DGGML_BLAS=OFF -DLLAVA_BUILD=OFF "
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


def llama_extra_buffers_work(python: Path, gguf: Path) -> list[str] | None:
    """Whether llama.cpp runs ``gguf`` with its extra weight buffers (AMX, repacking) here:
    None where they crash, else the extra buffers that llama.cpp's load log says hold weights
    (e.g. ["CPU_REPACK"]; [] where this type has none on this CPU: they are on but unused).

    On an x86 CPU whose cpuid lists AMX, the -march=native build sends Q4_1/Q8_0 matmuls to its
    AMX buffers, and on a VM that does not really enable AMX tile state the first one dies of
    SIGILL (``tilezero``; seen 2026-11-30 on a 2-core Xeon) or SIGSEGV (2026-12-01, the same
    kind of VM): any death by a signal counts as "no". Without extra buffers they run on
    AVX-512/AVX2; llama.cpp repacks only Q4_0/Q4_K/Q2_K/IQ4_NL on x86, not Q4_1, Q8_0 or Q6_K,
    so for Q4_0/Q4_K_M "no" also loses the repacked layout."""
    probe = "import sys; from llama_cpp import Llama; Llama(sys.argv[1], n_ctx=64, verbose=True)"
    done = subprocess.run([python, "-c", probe + ".eval([1, 2])", gguf], capture_output=True)
    log = done.stderr.decode(errors="replace")
    if done.returncode < 0:  # killed by that signal
        return None
    if done.returncode > 0:
        raise RuntimeError(f"llama.cpp could not run {gguf}: {log[-2000:]}")
    # "load_tensors:   CPU_REPACK model buffer size =    59.06 MiB": one line per buffer type
    # holding weights; plain CPU / CPU_Mapped ones are the default buffers, not extra ones
    held = re.findall(r"(\S+) model buffer size =", log)
    return sorted({b for b in held if b not in ("CPU", "CPU_Mapped")})


def llama_ftypes(config, *also: str) -> tuple[str, ...]:
    """llama.cpp's fastest 4-bit and 8-bit types on x86 for a model of this shape, plus ``also``:
    Q4_0 (repacked to an interleaved layout where the extra buffers run), Q4_K_M only where the
    hidden and MLP sizes are multiples of its 256-wide super-blocks (llama.cpp would silently
    swap other types into the tensors that are not: SmolLM2's 576 is not), and Q8_0."""
    k_quants = config.hidden_size % 256 == 0 and config.intermediate_size % 256 == 0
    return ("Q4_0", *(("Q4_K_M",) if k_quants else ()), *also, "Q8_0")


class Variant(NamedTuple):
    stream: Stream
    engine: str  # who makes the tokens: "hf generate", "runtime", "hf fallback", "llama.cpp"
    runtime: Runtime | None = None  # for decode_bytes() and the kernels it chose
    quantized: bool = False  # whether any int4/int8 layer runs (the kernel cell is empty otherwise)
    read_bytes: int | None = None  # bytes per decode step of a row without a runtime (llama.cpp)


def build_variants(base, ids, args, names) -> dict[str, Variant]:
    """Variant names: hf-fp32/hf-bf16 (transformers), rt-fp32/rt-bf16/rt-w8/rt-w4gN (runtime;
    W4 group N with g64 fallback), suffixes -q8 (int4 and int8 decode through our integer-dot
    kernels, Q4 x Q8 / Q8 x Q8, at the CPU's ISA level), -h4/-h8 (the tied lm_head quantized
    to int4 g32 / int8 by the runtime), -layer (with --compile: one compiled graph per decoder
    layer instead of the whole decode step), -cpp (with --compile: the whole step with its host
    code in C++, ``Runtime(compile="step-cpp")``), -sdpa (decode attention through torch's
    scaled_dot_product_attention instead of our cache kernel, to attribute what it changes)."""
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
            variants[name] = Variant(hf_stream(model, generate=True), "hf generate")
        else:
            rt = Runtime(
                model,
                max_seq_len=len(ids) + args.new_tokens,
                compile=(
                    ("layer" if "layer" in options else "step-cpp" if "cpp" in options else True)
                    if args.compile
                    else False
                ),
                int4_kernel="q4q8" if "q8" in options else "torch",
                int8_kernel="q8q8" if "q8" in options else "torch",
                lm_head_bits=4 if "h4" in options else 8 if "h8" in options else None,
            )
            if "sdpa" in options:  # before the warm-up below: the graphs trace this choice
                for layer in rt.layers:
                    layer.cache_attention = None
            quantized = kind.startswith("w") or "h4" in options or "h8" in options
            if rt.fallback_reason is None:
                variants[name] = Variant(rt.stream, "runtime", rt, quantized)
            else:  # transformers' loop under the runtime's name: no kernel, no decode bytes
                variants[name] = Variant(rt.stream, "hf fallback")
        # warm-up over the full length: a compiled runtime builds one decode graph per
        # power-of-two cache length, and none may be compiled inside a timed request
        time_request(variants[name].stream, ids, args.new_tokens)
    return variants


def kernel_cell(v: Variant) -> str | None:
    """Which integer kernels decode a quantized runtime row: torch's, or ours and their ISA."""
    if not v.quantized or v.runtime is None:
        return None
    rt = v.runtime
    if rt.q8_isa is None:
        return "torch"
    return f"ours ({rt.q8_isa})"


def llama_ggufs(model, name: str, ftypes: tuple[str, ...], args, **kw) -> dict[str, Path]:
    """{"llama.cpp-<ftype>": GGUF} of ``model``'s own fp32 weights, quantized by llama.cpp
    (scripts/gguf_export.py; made once, cached by ``name``), with SmolLM2's tokenizer. Call it
    before build_variants: the last quantized variant rewrites ``model`` in place."""
    from gguf_export import cached_llama_ggufs

    donor = _gguf_location(EMBEDDED["smollm2-135m"])
    py = llama_cpp_python()
    paths = cached_llama_ggufs(
        model, name, ftypes, donor=donor, python=py, threads=args.threads, **kw
    )
    return {f"llama.cpp-{f.lower()}": path for f, path in paths.items()}


def llama_variants(ggufs: dict[str, Path], ids, args) -> dict[str, Variant]:
    """One llama.cpp row per GGUF, each in its own LLAMA_WORKER process, warmed up. Bytes per
    decode step: the GGUF's tensor bytes (``gguf_export.tensor_bytes(decode=True)``: weights
    only, no KV cache, token_embd left out where an untied output.weight is read instead).
    Each row's engine names the extra buffers that held its weights (llama_extra_buffers_work,
    probed per file: Q4_0's repacked layout runs or not); a file whose extra buffers crash runs
    without them, and its engine says so."""
    from gguf_export import tensor_bytes

    variants = {}
    python = llama_cpp_python() if ggufs else None
    for name, gguf in ggufs.items():
        # context: prompt and new tokens (512 at least, as before --prompt-len grew past it)
        n_ctx = max(512, len(ids) + args.new_tokens)
        command = [python, "-c", LLAMA_WORKER, str(gguf), str(args.threads), str(n_ctx)]
        extra = llama_extra_buffers_work(python, gguf)
        if extra is None:  # they crash here: the row runs without them
            command.append("--no-extra-buffers")
            engine = "llama.cpp, no extra buffers (they crash here)"
        else:
            engine = f"llama.cpp, extra buffers: {'+'.join(extra) or 'on, none used'}"
        stream = worker_stream(command)
        time_request(stream, ids, args.new_tokens)  # warm-up
        variants[name] = Variant(stream, engine, read_bytes=tensor_bytes(gguf, decode=True))
    return variants


def gguf_note(ggufs: dict[str, Path]) -> str:
    """A paragraph for below a table naming each llama.cpp row's file and tensor types."""
    from gguf_export import tensor_types

    if not ggufs:
        return ""
    files = "; ".join(f"{n}: {p.name} ({tensor_types(p)})" for n, p in ggufs.items())
    return f"\n\nllama.cpp GGUFs and their tensor types: {files}."


def close_workers(variants: dict[str, Variant]) -> None:
    for v in variants.values():
        if (worker := getattr(v.stream, "worker", None)) is not None:
            worker.stdin.close()  # the worker's loop ends at EOF
            worker.wait()


def run(variants: dict[str, Variant], ids, new_tokens, reps, bandwidth) -> list[dict]:
    """One row per variant: medians and min-max over ``reps`` interleaved rounds."""
    timings = {name: [] for name in variants}
    for _ in range(reps):  # interleaved: every variant once per round
        for name, v in variants.items():
            timings[name].append(time_request(v.stream, ids, new_tokens))
    rows = []
    for name, v in variants.items():
        tok_s = distribution([1 / t.tpot for t in timings[name]])
        ttft = distribution([t.ttft for t in timings[name]], 1e3)
        read = sum(v.runtime.decode_bytes().values()) if v.runtime else v.read_bytes
        mbu = read and bandwidth_utilization(read, 1 / tok_s["p50"], bandwidth)
        rows.append(dict(
            variant=name, engine=v.engine,
            kernel=kernel_cell(v),
            decode_tok_s=tok_s["p50"], decode_min=tok_s["min"], decode_max=tok_s["max"],
            ttft_ms=ttft["p50"], ttft_min=ttft["min"], ttft_max=ttft["max"],
            mb_per_token=read and read / 1e6, mbu_pct=mbu and 100 * mbu, reps=reps,
        ))  # fmt: skip
    return rows


COLUMNS = [
    ("variant", "variant"), ("engine", "engine"), ("kernel", "int kernels"),
    ("decode_tok_s", "decode tok/s"), ("decode_min", "min"), ("decode_max", "max"),
    ("vs_ref", "vs ref"), ("ttft_ms", "TTFT ms"), ("ttft_min", "min"), ("ttft_max", "max"),
    ("mb_per_token", "MB read/token"), ("mbu_pct", "MBU %"),
]  # fmt: skip


def table(title: str, rows: list[dict], ref: str) -> str:
    ref_tok_s = next(r["decode_tok_s"] for r in rows if r["variant"] == ref)
    cells = [dict(r, vs_ref=r["decode_tok_s"] / ref_tok_s) for r in rows]
    note = f"Medians and min-max over {rows[0]['reps']} interleaved rounds; vs ref: {ref}."
    return f"### {title}\n\n{markdown_table(cells, COLUMNS)}\n\n{note}"


def environment_line(env: dict, bandwidth: float) -> str:
    return (
        f"Environment: {env['cpu']}; kernel flags {' '.join(env['cpu_flags']) or 'none'}; "
        f"torch CPU capability {env['torch_cpu_capability']}; our integer-dot kernels' ISA "
        f"{env['q8_kernel_isa']}; ISA caps {env.get('isa_limits') or 'none'}; "
        f"torch {env['torch']}, "
        f"transformers {env['transformers']}; {env['threads']} threads; {env['date']}. "
        f"Read bandwidth measured: {bandwidth / 1e9:.1f} GB/s."
    )


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
        default="hf-fp32,hf-bf16,rt-fp32,rt-bf16,rt-w8,rt-w8-q8,rt-w8-q8-h8,rt-w4g128,"
        "rt-w4g32-q8-h8,rt-w4g128-q8,rt-w4g128-q8-h8",
        help="see build_variants: -q8 = int4/int8 decode through our integer-dot kernels, "
        "-h4/-h8 = lm_head quantized to int4/int8 by the runtime",
    )
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--synthetic-1b", action="store_true")
    p.add_argument(
        "--variants-1b",
        default="rt-bf16,rt-w8-q8-h8,rt-w4g128,rt-w4g128-q8,rt-w4g128-q8-h8",
        help="the runtime rows of --synthetic-1b (names as --variants)",
    )
    p.add_argument("--out", default="bench_e2e", help="output prefix (.json, .md)")
    args = p.parse_args()
    if args.new_tokens < 2 or args.reps < 1:
        p.error("--new-tokens must be >= 2 (decode speed needs a second token), --reps >= 1")
    torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 64  # one decode graph per variant and batch size
    bandwidth = memory_bandwidth()["bytes_per_s"]  # the product's probe, as compare's MBU
    loaded = load_model(args.model)
    # the sentence is 14 tokens: repeated to cover --prompt-len (8 times at least, as before)
    sentence = "The history of the city begins with a small settlement on the river, "
    ids = loaded.tokenizer(sentence * max(8, args.prompt_len // 10 + 1))["input_ids"]
    ids = ids[: args.prompt_len]
    ggufs = {}
    if not args.no_llama_cpp and args.model in EMBEDDED:
        # the shipped Q4_1 file, and llama.cpp's fastest types made by its quantizer from the
        # fp32 weights we load
        ggufs = {"llama.cpp-q4_1": _gguf_location(EMBEDDED[args.model])}
        ggufs |= llama_ggufs(loaded.model, args.model, llama_ftypes(loaded.model.config), args)
    variants = build_variants(loaded.model, ids, args, [v for v in args.variants.split(",") if v])
    variants |= llama_variants(ggufs, ids, args)
    results, md = {}, []
    if variants:
        results[args.model] = run(variants, ids, args.new_tokens, args.reps, bandwidth)
        title = (
            f"{args.model}: {len(ids)}-token prompt, {args.new_tokens} new tokens, "
            f"{args.threads} threads, compile={args.compile}"
        )
        ref = "hf-bf16" if "hf-bf16" in variants else next(iter(variants))
        md.append(table(title, results[args.model], ref) + gguf_note(ggufs))
    close_workers(variants)
    if args.synthetic_1b:
        del variants
        # TinyLlama-1.1B shape, normal(0, 0.02) weights (never zeros); SmolLM2's vocab (49152,
        # not 32000): llama.cpp needs a real tokenizer in the GGUF and SmolLM2's is the one here
        big = make_synthetic_llama("1.1b", seed=0, vocab_size=49152)
        args.new_tokens = max(8, args.new_tokens // 4)
        names = [v for v in args.variants_1b.split(",") if v]
        # F16 source (2.3 GB, not 4.7) for llama.cpp's quantizer: these weights are random anyway
        big_ggufs = {}
        if not args.no_llama_cpp:
            name = "synthetic-1b-v49152-seed0"  # the cache key: change it with the weights
            ftypes = llama_ftypes(big.config, "Q4_1")  # Q4_1: as the earlier tables
            big_ggufs = llama_ggufs(big, name, ftypes, args, dtype="f16")
        v = build_variants(big, ids, args, names)
        v |= llama_variants(big_ggufs, ids, args)
        results["synthetic_1b"] = run(v, ids, args.new_tokens, max(2, args.reps - 1), bandwidth)
        close_workers(v)
        title = (
            f"synthetic 1.1B Llama (TinyLlama shape, SmolLM2's vocab 49152 instead of 32000): "
            f"{args.new_tokens} new tokens"
        )
        ref = "rt-bf16" if "rt-bf16" in v else next(iter(v))
        md.append(table(title, results["synthetic_1b"], ref) + gguf_note(big_ggufs))
    env = environment()
    md.insert(0, environment_line(env, bandwidth))
    payload = dict(environment=env, bandwidth=bandwidth, settings=vars(args), results=results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(payload, indent=1))
    Path(args.out + ".md").write_text("\n\n".join(md) + "\n")
    print("\n\n".join(md))


if __name__ == "__main__":
    main()
