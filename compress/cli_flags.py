"""Bounds of the console script's flags, checked before any model work so that a bad value is
one line (``RecipeError``, exit status 2) naming the flag, not a traceback from deep in the
runtime, a silently different evaluation or an allocation killed for memory. Only
``compress.cli`` imports this module; the library functions check their own arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from compress.core.errors import RecipeError

# Numeric flags, by argparse dest, whatever the command: what each must be. Checked before any
# model loads; past these bounds the runtime or a window loop failed with a traceback, scored
# a silently shortened text (--limit -2) or allocated until killed (--max-new-tokens 10**8).
FLAG_BOUNDS = {
    "context_length": (lambda v: v >= 2, ">= 2"),
    "stride": (lambda v: v >= 1, ">= 1"),
    "limit": (lambda v: v >= 1, ">= 1 (leave it out for every window)"),
    "max_new_tokens": (lambda v: v >= 1, ">= 1"),
    "temperature": (lambda v: 0 <= v <= _max_temperature(), "finite and >= 0 (0: greedy)"),
    "top_k": (lambda v: v >= 1, ">= 1"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "seed": (lambda v: -(2**63) <= v < 2**64, "a 64-bit integer"),  # torch.manual_seed's range
    "max_model_len": (lambda v: v >= 2, ">= 2"),
    "max_waiting": (lambda v: v >= 0, ">= 0"),
    "threads": (lambda v: v >= 1, ">= 1"),
    "port": (lambda v: 0 <= v <= 65535, "in 0..65535"),
}


def _max_temperature() -> float:
    from compress.runtime.sampling import MAX_TEMPERATURE  # imports torch: only when asked

    return MAX_TEMPERATURE


def check_bindable(host: str, port: int) -> None:
    """``compress serve``'s address, bound and released before the model loads: uvicorn logs a
    failed bind and returns, so the command exited 0 after loading the model and its KV pool."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(infos[0][4])
    except OSError as exc:
        raise RecipeError(f"serve: cannot listen on --host {host} --port {port} ({exc}); "
                          "pick a free --port or an address of this machine") from None


def check_flags(args: argparse.Namespace) -> None:
    """RecipeError listing every flag of ``args`` outside ``FLAG_BOUNDS``."""
    bad = [f"--{dest.replace('_', '-')} {value} must be {what}"
           for dest, (ok, what) in FLAG_BOUNDS.items()
           if (value := getattr(args, dest, None)) is not None and not ok(value)]
    stride = getattr(args, "stride", None)
    if stride is not None and stride > args.context_length:
        bad.append(f"--stride {args.stride} must be <= --context-length (or it skips tokens)")
    out = getattr(args, "out", None)
    if isinstance(out, str) and not out.strip():  # was the default folder, silently
        bad.append("--out is empty: give a folder (or leave the flag out for the default)")
    prompt = getattr(args, "prompt", None)
    try:
        if isinstance(prompt, str):
            prompt.encode("utf-8")  # undecodable argv bytes arrive as lone surrogates
    except UnicodeEncodeError:
        bad.append("the prompt is not valid UTF-8 text; pass it in UTF-8")
    if bad:
        raise RecipeError(f"{args.command}: " + "; ".join(bad))
    check_length_before_load(args)


# The length flags each command checks against the model's positions, by command: (argparse
# dest, flag). They are checked again once the model is loaded (``serve_length``,
# ``perplexity``), which covers hub ids and the embedded model.
LENGTH_FLAGS = {"eval": ("context_length", "--context-length"),
                "compare": ("context_length", "--context-length"),
                "serve": ("max_model_len", "--max-model-len")}  # fmt: skip


def check_length_before_load(args: argparse.Namespace) -> None:
    """A length flag past a local model's positions refused from its config.json, before the
    weights load: loading a 70B whole or layer by layer takes minutes, and the same refusal came
    after it. ``compare`` checks its baseline and every variant."""
    dest, flag = LENGTH_FLAGS.get(getattr(args, "command", None), (None, None))
    length = getattr(args, dest or "", None)
    if dest is None or getattr(args, "no_perplexity", False) or not isinstance(length, int):
        return
    from compress.io.checkpoint import check_positions
    from compress.io.stream import causal_lm_config

    models = [getattr(args, "model", None), getattr(args, "baseline", None),
              *(getattr(args, "variants", None) or [])]  # fmt: skip
    for model in models:
        folder = Path(model).expanduser() if isinstance(model, str) else None
        if folder is not None and (folder / "config.json").is_file():
            config, _ = causal_lm_config(folder)  # a multimodal checkpoint's text model's
            check_positions(config, length, f"{args.command}: {flag}", str(folder))


SERVE_MAX_MODEL_LEN = 2048  # serve's default length, where the model's positions allow


def serve_length(loaded, max_model_len: int | None) -> int:
    """``serve``'s --max-model-len, checked within the model's positions as ``generate`` checks
    its length (past them the rotary tables alone grew with it: 100000000 was killed for memory;
    a learned position table has no rows beyond); None: ``SERVE_MAX_MODEL_LEN`` or the model's
    positions where fewer (a 1024-position model was refused the old default)."""
    from compress.io.checkpoint import check_positions

    if max_model_len is None:
        limit = getattr(loaded.model.config, "max_position_embeddings", None)
        return min(SERVE_MAX_MODEL_LEN, limit) if isinstance(limit, int) and limit > 1 else \
            SERVE_MAX_MODEL_LEN
    check_positions(loaded.model.config, max_model_len, "serve: --max-model-len", loaded.source)
    return max_model_len


def fit_serve_length(max_model_len: int, args: argparse.Namespace, cache) -> int:
    """``max_model_len`` where the KV cache holds one sequence that long; else a RecipeError for
    a length ``args`` asked for, or the cache's length with a note for the default. (A server
    whose cache held fewer tokens than it advertised refused every chat request without
    max_tokens: the default output fills max_model_len.)"""
    asked, kv_memory = args.max_model_len is not None, args.kv_memory
    holds = cache.num_blocks * cache.block_size
    if max_model_len <= holds:
        return max_model_len
    if asked:
        raise RecipeError(
            f"serve: --max-model-len {max_model_len} needs {-(-max_model_len // cache.block_size)}"
            f" KV blocks of {cache.block_size} tokens; --kv-memory {kv_memory} holds "
            f"{cache.num_blocks} ({holds} tokens): raise --kv-memory or give --max-model-len "
            f"{holds} or less")
    print(f"note: max_model_len {holds} (what --kv-memory {kv_memory} holds, under "
          f"{max_model_len}); raise --kv-memory for longer requests", file=sys.stderr)
    return holds


def check_generate_length(loaded, ids: list[int], max_new_tokens: int) -> int:
    """The static cache holds prompt + new tokens: refuse an empty prompt, and a length past the
    model's positions, whose cache could take all memory (--max-new-tokens 100000000 was
    killed for memory). Returns the cache's slots: the length rounded up to 64 (fewer shapes
    to build) but not past the model's positions (a learned position table, OPT's, has no rows
    beyond)."""
    if not ids:
        raise RecipeError("generate: the prompt tokenizes to no tokens; give a prompt text")
    from compress.io.checkpoint import check_positions

    need = len(ids) + max_new_tokens
    check_positions(loaded.model.config, need, f"generate: the prompt ({len(ids)} tokens) + "
                    f"--max-new-tokens {max_new_tokens} =", loaded.source)
    limit = getattr(loaded.model.config, "max_position_embeddings", None)
    rounded = -(-need // 64) * 64
    return min(rounded, limit) if isinstance(limit, int) else rounded


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def reader_left() -> int:
    """Exit status after the reader of stdout went away (``compress inspect | head``): the rest
    of the output goes to /dev/null, so the flush at exit raises no second BrokenPipeError."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141  # 128 + SIGPIPE, what a tool killed by the signal reports


def runtime_dtypes(model: str, asked: str, device=None, extra: int = 0):
    """``compress serve``'s and ``generate``'s float-layer dtype for ``asked`` (auto: the
    checkpoint's stored one, bfloat16 or float32): its name, the runtime's matmul dtype (None:
    float32) and the dtype the model loads in: bfloat16 for a plain bf16 checkpoint computed in
    bf16 (the same values as a float32 load, which the runtime casts to bf16 anyway, in half the
    memory: a 7B model 13.5 GB instead of 27), float32 otherwise (compressed checkpoints keep
    their codes as stored either way).

    auto computes a bf16 checkpoint in float32 on a CPU without bf16 matmuls (no AVX512-BF16
    or AMX: oneDNN has none, and ATen's bf16 GEMM measured 1.9x slower than fp32 at 1 row and
    5.6x at 32 rows on an AVX2-only AMD EPYC, 1536x576, 2 threads; serving SmolLM2's bf16
    export took ~970 ms a token there), where the float32 load fits the free memory with
    ``extra`` bytes beside it (``device``: where it computes, None: the CPU), unless our
    ``bf16_weight_linear`` runs there (``cpu_float.bf16_weights_fast``): bf16 stays, its layers
    through that op. Served on that EPYC (docs/results.md section 7, commit 77f9ef0, where fp32
    layers of bf16 values also run through the op), SmolLM2's bf16 export in bf16 / fp32: one
    request alone 30.1 / 35.5 tok/s, all at once 130.4 / 141.0, TPOT p50 at 2 req/s 83 / 101
    ms, KV peak 140 / 280 MB: about level, so the checkpoint's own dtype stays, at half the KV
    memory."""
    from pathlib import Path

    import torch

    from compress.io.checkpoint import stored_dtype_name
    from compress.io.load import is_compressed_checkpoint, resolve_model_path
    from compress.kernels import cpu_float
    from compress.pipeline import preflight

    where = resolve_model_path(model)
    stored = stored_dtype_name(where) if isinstance(where, Path) else None
    dtype = asked if asked != "auto" else ("bfloat16" if stored == "bfloat16" else "float32")
    plain = isinstance(where, Path) and not is_compressed_checkpoint(where)
    slow_bf16 = ((device is None or torch.device(device).type == "cpu")
                 and not cpu_float.bf16_weights_fast())
    if asked == "auto" and dtype == "bfloat16" and slow_bf16:
        wide = preflight.whole_load_bytes(where, torch.float32) if plain else None
        available = preflight.available_memory_bytes()
        if wide is None or available is None or wide + extra <= available:
            dtype = "float32"
            print("note: --dtype auto computes this bf16 checkpoint in float32: this CPU has no "
                  "bf16 matmuls (--dtype bfloat16 keeps bf16, several times slower here)",
                  file=sys.stderr)
        else:
            print("note: this CPU has no bf16 matmuls, so bf16 runs several times slower than "
                  "float32 here, but the float32 load does not fit the free memory: computing in "
                  "bf16 (a W4/W8 export runs through the integer kernels instead)",
                  file=sys.stderr)
    narrow = dtype == stored == "bfloat16" and plain
    matmul = torch.bfloat16 if dtype == "bfloat16" else None
    return dtype, matmul, torch.bfloat16 if narrow else torch.float32


def serve_kv_dtype(runtime, model, asked: str) -> str | None:
    """``compress serve``'s KV pages for ``--kv-dtype asked``: a dtype name, or None for the
    runtime's KV dtype. auto on a CPU, where decode attends in the pool (our kernel builds for
    the runtime's KV dtype): bf16 for a quantized checkpoint, the runtime's otherwise (bf16 for
    bf16 layers: a 32-row SmolLM2 bf16 step 55.5 ms on bf16 pages, 59.0 on fp32, Xeon); where
    it gathers, fp32 (gathered bf16 keys measured slower: 101 vs 72 ms). A quantized model's
    runtime computes in fp32 on CPUs without bf16 matmuls, so its cache would be fp32: bf16
    pages cost SmolLM2 0.00004 nats/token of KL (docs/results.md section 7), hold twice the
    tokens, and attended faster (a 32-row W4 decode step on the AVX2-only EPYC, median of 63:
    96-98 ms against 107-131 on fp32 pages, ``scripts/profile_serving_step.py --burst``)."""
    if asked != "auto":
        return asked
    if runtime.device.type != "cpu":
        return None
    import torch

    from compress.kernels import cpu_attention
    from compress.quant.linear import QuantLinear

    head_dim = runtime.layers[0].head_dim
    if cpu_attention.unavailable_reason(runtime.kv_dtype, runtime.device, head_dim) is not None:
        return "float32"
    quantized = any(isinstance(m, QuantLinear) for m in model.modules())
    bf16 = cpu_attention.unavailable_reason(torch.bfloat16, runtime.device, head_dim) is None
    return "bfloat16" if quantized and bf16 else None


def add_device_arg(p: argparse.ArgumentParser, recipe: bool = False) -> None:
    p.add_argument("--device", default=None if recipe else "auto", metavar="DEVICE",
                   help="where the work runs: auto (the first GPU when there is one, else "
                   "the CPU), cpu, cuda or cuda:N; on a GPU evaluation runs in bf16 "
                   + ("(default: the recipe's `device` key, auto)" if recipe
                      else "(default: auto)"))


def add_dtype_arg(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--dtype", default=default, choices=["auto", "float32", "bfloat16"],
                   help=f"matmul dtype of the float layers (auto: the checkpoint's stored dtype, "
                   "but float32 for a bf16 one on a CPU with neither bf16 matmuls nor our "
                   "bf16-weight kernel, where it fits; a "
                   f"bf16 checkpoint computed in bf16 loads in bf16; default {default}); "
                   "quantized layers run their int kernels either way")
