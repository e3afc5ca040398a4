"""The ``compress`` console script: run, validate, inspect, eval (and compare).

Only this module (and scripts/) configures logging. Errors users can fix (bad recipe, missing
model or data, unwritable output) print one clear message and exit with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from pathlib import Path

from compress.cli_flags import (
    add_device_arg,
    add_dtype_arg,
    check_bindable,
    check_flags,
    check_generate_length,
    fit_serve_length,
    reader_left,
    runtime_dtypes,
    serve_kv_dtype,
    serve_length,
    torch_threads,
)
from compress.core.errors import (
    DataError,
    KernelConstraintError,
    ModelLoadError,
    NumericsError,
    OutputError,
    RecipeError,
)

USER_ERRORS = (
    RecipeError, ModelLoadError, DataError, KernelConstraintError, OutputError, NumericsError
)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )


def _cmd_validate(args: argparse.Namespace) -> int:
    from compress.recipe import load_recipe, recipe_reference

    if args.recipe is None:
        if not args.show or args.set:
            raise RecipeError(
                "validate needs a RECIPE file (e.g. compress validate recipes/smollm2-w8-rtn.yaml);"
                " `compress validate --show` alone prints the reference of every recipe key"
            )
        print(recipe_reference(), end="")
        return 0
    recipe = load_recipe(args.recipe, args.set)
    print(f"{args.recipe}: valid ({len(recipe.passes)} passes)")
    if args.show:
        print(recipe.to_yaml())
    return 0


def _job_options(args: argparse.Namespace) -> dict:
    """The keyword arguments ``run`` and ``sweep`` share, from their common flags."""
    return dict(model=args.model, out_dir=args.out, data_dir=args.data_dir,
                progress=not args.no_progress, resume=not args.no_resume,
                overwrite=args.overwrite, kl_top_k=args.kl_top_k)


def _with_device(recipe, device: str | None):
    """``recipe`` with ``--device`` in place of its ``device`` key (None: the recipe's)."""
    import dataclasses

    return recipe if device is None else dataclasses.replace(recipe, device=device)


def _device(args: argparse.Namespace):
    """The torch device ``--device`` names (RecipeError before any work when it cannot be),
    made this process's current CUDA device (``core.device.current_device``: Triton kernels
    launch there)."""
    import torch

    from compress.core.device import resolve_device

    device = resolve_device(args.device, where="--device")
    if device.type == "cuda":  # for the rest of this command's process
        torch.cuda.set_device(device)
    return device


def _cmd_run(args: argparse.Namespace) -> int:
    from compress.pipeline.job import run_job, with_full_eval
    from compress.recipe import load_recipe

    recipe = _with_device(load_recipe(args.recipe, args.set), args.device)
    if args.full_eval:
        recipe = with_full_eval(recipe)
    stream = {"auto": None, "on": True, "off": False}[args.stream]
    result = run_job(recipe, **_job_options(args), stream=stream)
    print(result.markdown)
    print(f"\nwrote {result.out_dir} (results.md, results.json, checkpoint)")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from compress.pipeline.job import with_full_eval
    from compress.pipeline.sweep import run_sweep
    from compress.recipe import load_recipe

    recipes = [_with_device(load_recipe(path, args.set), args.device) for path in args.recipes]
    if args.full_eval:
        recipes = [with_full_eval(r) for r in recipes]
    result = run_sweep(recipes, **_job_options(args))
    print(result.markdown)
    print(f"\nwrote {result.out_dir} (sweep.md, sweep.json)")
    return 0


def _size_bytes(text: str) -> int:
    """``80MB``, ``1.5GiB``, ``120000000`` -> bytes (argparse type)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
             "GIB": 2**30}  # fmt: skip
    number = text.strip().upper().rstrip("S")
    for unit in sorted(units, key=len, reverse=True):
        if unit and number.endswith(unit):
            number, scale = number[: -len(unit)], units[unit]
            break
    else:
        scale = 1
    try:
        return int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 80MB, 1.5GiB)") from None


def _tune_pass_options(args: argparse.Namespace) -> dict[str, int]:
    options = {k: v for k, v in (("iters", args.iters), ("batch_size", args.batch_size)) if v}
    if options and args.algorithm != "autoround":
        raise RecipeError(f"tune: --iters/--batch-size are AutoRound's; --algorithm is "
                          f"{args.algorithm!r} (add --algorithm autoround or drop them)")
    return options


def _cmd_tune(args: argparse.Namespace) -> int:
    from compress.pipeline.tune import DEFAULT_FORMATS, TuneTarget, run_tune, tune_markdown

    target = TuneTarget(bits_per_weight=args.bits_per_weight, max_bytes=args.max_bytes,
                        tpot_ms=args.tpot_ms, max_dppl_pct=args.max_dppl,
                        max_kl=args.max_kl)  # fmt: skip
    report = run_tune(
        args.model, target, formats=tuple(args.formats or DEFAULT_FORMATS),
        algorithm=args.algorithm, pass_options=_tune_pass_options(args),
        symmetric_grid=args.symmetric_grid, num_samples=args.num_samples, seq_len=args.seq_len,
        limit=None if args.full_eval else args.limit, out_dir=args.out, data_dir=args.data_dir,
        progress=not args.no_progress, overwrite=args.overwrite, device=args.device,
        layer_by_layer=args.layer_by_layer or None,
    )  # fmt: skip
    print(tune_markdown(report))
    for row in report["rows"]:
        print(f"{row['variant']}: perplexity {row.get('perplexity')}, "
              f"Δppl {row.get('ppl_delta_pct', 0.0):+.2f}%, KL {row.get('kl')}")  # fmt: skip
    return 0 if all(c["ok"] for c in report["checks"]) else 1


def _cmd_inspect(args: argparse.Namespace) -> int:
    from compress.io.inspect import inspect_checkpoint

    summary = inspect_checkpoint(Path(args.path))
    print(json.dumps(summary, indent=2) if args.json else summary["markdown"])
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from compress.core.device import place_for_eval
    from compress.data import read_text, resolve_text_path
    from compress.eval.lm_eval_tasks import check_tasks, run_tasks, task_folder, task_manager
    from compress.eval.quality import perplexity
    from compress.io.load import load_model

    tasks = [t for t in (args.tasks or "").split(",") if t]
    if tasks:  # unknown names fail here, before the model loads
        check_tasks(tasks, task_manager(task_folder(args.tasks_dir, args.data_dir)))
    path = None if args.no_perplexity else resolve_text_path(args.dataset, args.data_dir)
    device = _device(args)
    if args.layer_by_layer:
        return _eval_layer_by_layer(args, path, tasks, device)
    from compress.pipeline.preflight import check_whole_loads

    check_whole_loads("eval (model loaded whole)", [args.model], "score perplexity one "
                      "decoder layer at a time: compress eval --layer-by-layer")
    loaded = load_model(args.model, backend=args.backend)
    placed = place_for_eval(loaded.model, device)  # bf16 on a GPU; the CPU: as loaded
    out: dict = {}
    if path is not None:
        result = perplexity(
            loaded.model,
            loaded.tokenizer,
            read_text(path),
            context_length=args.context_length,
            stride=args.stride,
            limit=args.limit,
            source=str(path),
            progress=not args.no_progress,
        )
        out = result.to_dict()
        out["protocol"].update(placed)
    out["device"] = placed
    if tasks:  # on the in-memory model: quantized modules run as they are
        # lm-eval prints progress lines to stdout; keep stdout one JSON document
        with contextlib.redirect_stdout(sys.stderr):
            out["lm_eval"] = run_tasks(
                loaded.model,
                loaded.tokenizer,
                tasks,
                limit=args.task_limit,
                tasks_dir=args.tasks_dir,
                data_dir=args.data_dir,
            )
    print(json.dumps(out, indent=2, default=str))
    return 0


def _eval_layer_by_layer(args: argparse.Namespace, path, tasks: list[str], device) -> int:
    """``compress eval --layer-by-layer``: perplexity of a local checkpoint (plain or
    compressed) read one decoder layer at a time, for a model bigger than memory; quantized
    layers are scored through their dequantized weights, as ``compress run`` scores them. On a
    GPU each layer runs there in turn, in bf16 as ``compress eval`` of the whole model would."""
    from compress.core.errors import RecipeError
    from compress.data import read_text
    from compress.eval.quality import layerwise_placement, perplexity
    from compress.io.export import layerwise_model
    from compress.io.load import check_tokenizer_fits, load_tokenizer, resolve_model_path

    where = resolve_model_path(args.model)
    if tasks or path is None or not isinstance(where, Path):
        raise RecipeError(
            "--layer-by-layer scores perplexity of a local checkpoint: drop --tasks and "
            "--no-perplexity, and give a model folder")
    stream = layerwise_model(where, backend=args.backend)
    tokenizer = load_tokenizer(where)
    check_tokenizer_fits(tokenizer, stream.model.get_input_embeddings().num_embeddings, where)
    result = perplexity(
        stream.model, tokenizer, read_text(path),
        context_length=args.context_length, stride=args.stride, limit=args.limit,
        source=str(path), progress=not args.no_progress, stream=stream, device=device)
    out = result.to_dict()
    placed = layerwise_placement(stream, device)
    out["protocol"].update(placed)
    out["device"] = placed
    print(json.dumps(out, indent=2, default=str))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    """Stream the tokens as they come; timings go to stderr so stdout is the text alone."""
    import time

    from compress.core.device import place_for_eval
    from compress.io.load import load_model
    from compress.pipeline.preflight import check_whole_loads
    from compress.runtime.engine import Runtime

    started = time.perf_counter()
    device = _device(args)
    _, matmul, load_dtype = runtime_dtypes(args.model, args.dtype, device)
    check_whole_loads("generate (model loaded whole)", [args.model], "compress it first (W4/W8 "
                      "exports load as stored), or --dtype auto for a bf16 one", dtype=load_dtype)
    loaded = load_model(args.model, backend=args.backend, dtype=load_dtype)
    placed = place_for_eval(loaded.model, device)
    loaded_at = time.perf_counter()
    print(f"loaded {args.model} in {loaded_at - started:.1f} s on {placed['device']}",
          file=sys.stderr)
    ids = loaded.tokenizer(args.prompt)["input_ids"]
    slots = check_generate_length(loaded, ids, args.max_new_tokens)
    steps = ["one-time weight repack"]
    if "q8" in (args.int4_kernel + args.int8_kernel):
        steps.append("our integer-dot kernels are built on first use and cached (~15 s)")
    if args.compile:
        steps.append("the first steps compile")
    if device.type == "cuda" and not args.no_cuda_graphs:
        steps.append("each new key length's first step is captured in a CUDA graph")
    print(f"preparing the runtime ({'; '.join(steps)})...", file=sys.stderr)
    runtime = Runtime(loaded.model, max_seq_len=slots, compile=args.compile,
                      prefill_dtype=matmul, decode_dtype=matmul,
                      int4_kernel=args.int4_kernel, int8_kernel=args.int8_kernel,
                      lm_head_bits=args.lm_head_bits,
                      cuda_graphs=False if args.no_cuda_graphs else None)
    prepared_at = time.perf_counter()
    print(f"prepared in {prepared_at - loaded_at:.1f} s", file=sys.stderr)
    stream = runtime.stream(ids, args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            stop_tokens=[loaded.tokenizer.eos_token_id])
    tokens: list[int] = []
    stamps: list[float] = []
    shown = ""
    for token in stream:
        stamps.append(time.perf_counter())
        tokens.append(token)
        text = loaded.tokenizer.decode(tokens, skip_special_tokens=True)
        print(text[len(shown):], end="", flush=True)  # decode the whole: multi-token chars
        shown = text
    print()
    if runtime.fallback_reason is not None or not stamps:  # transformers: every token at once
        took = 1000 * ((stamps or [prepared_at])[-1] - prepared_at)
        print(f"{len(tokens)} tokens in {took:.0f} ms (transformers generate: no per-token "
              f"times; {torch_threads()} threads)", file=sys.stderr)
        return 0
    ttft = stamps[0] - prepared_at
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")
    print(f"{len(tokens)} tokens: first token {1000 * ttft:.0f} ms, then {rate:.1f} tokens/s "
          f"(decode, batch 1, {torch_threads()} threads)", file=sys.stderr)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    """Load, build the runtime and the scheduler, then serve until Ctrl-C."""
    import torch

    from compress.io.load import load_model
    from compress.io.stream import parse_size
    from compress.pipeline.preflight import check_phase, check_whole_loads
    from compress.runtime.engine import Runtime
    from compress.runtime.scheduler import Scheduler
    from compress.runtime.server import Engine, Server, serve

    try:
        kv_memory = parse_size(args.kv_memory)
    except ValueError as exc:
        raise RecipeError(f"--kv-memory: {exc}") from None
    # the pool is allocated at once: past the free memory it fails, or is killed for memory
    check_phase("serve's KV cache", kv_memory, "lower --kv-memory")
    check_bindable(args.host, args.port)  # before the model loads: uvicorn's failure exits 0
    # checked before the model loads (the scheduler checks them again, later)
    for flag in ("block_size", "max_batch", "prefill_budget"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise RecipeError(f"--{flag.replace('_', '-')} {value}: give a number above 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype, matmul, load_dtype = runtime_dtypes(args.model, args.dtype, extra=kv_memory)
    check_whole_loads("serve (model loaded whole)", [args.model], "compress it first (W4/W8 "
                      "exports load as stored)", dtype=load_dtype, extra=kv_memory)  # fmt: skip
    loaded = load_model(args.model, backend=args.backend, dtype=load_dtype)
    max_model_len = serve_length(loaded, args.max_model_len)
    # quantized layers are released as the runtime takes them; the scheduler brings its cache
    runtime = Runtime(loaded.model, max_seq_len=max_model_len, compile=False,
                      prefill_dtype=matmul, decode_dtype=matmul,
                      int4_kernel=args.int4_kernel, int8_kernel=args.int8_kernel,
                      lm_head_bits=args.lm_head_bits, static_cache=False)
    if runtime.fallback_reason is not None:
        raise RecipeError(f"compress serve runs the runtime's families only: "
                          f"{runtime.fallback_reason}")
    kv_dtype = serve_kv_dtype(runtime, loaded.model, args.kv_dtype)
    try:
        scheduler = Scheduler(runtime, kv_memory=kv_memory, block_size=args.block_size,
                              max_batch=args.max_batch, prefill_budget=args.prefill_budget,
                              kv_dtype=kv_dtype, prefix_caching=not args.no_prefix_cache,
                              decode_stack=not args.python_layers)
    except ValueError as exc:  # e.g. --kv-memory too small for one block
        raise RecipeError(f"serve: {exc}") from None
    name, cache = args.served_model_name or args.model, scheduler.cache
    max_model_len = fit_serve_length(max_model_len, args, cache)
    print(f"serving {name} on http://{args.host}:{args.port}/v1 ({torch_threads()} threads, "
          f"float layers in {dtype}; "
          f"KV cache {cache.num_blocks} blocks of {cache.block_size} tokens, "
          f"{str(cache.dtype).removeprefix('torch.')}, {kv_memory / 1e9:.2f} GB; decode "
          f"attention {'in place' if scheduler.attention_reason is None else 'gathered: '}"
          f"{scheduler.attention_reason or ''}; decode layers "
          f"{'in C++' if scheduler.decode_stack is not None else 'in Python: '}"
          f"{scheduler.decode_stack_reason or ''}; up to {args.max_batch} requests at once)",
          file=sys.stderr)
    engine = Engine(scheduler, max_waiting=args.max_waiting, thread=False)
    serve(Server(engine, loaded.tokenizer, name, max_model_len=max_model_len),
          host=args.host, port=args.port)
    return 0


def _lengths_arg(text: str):
    """argparse type for --prompt-tokens/--output-tokens: N or LOW-HIGH."""
    from compress.eval.workload import parse_lengths

    try:
        return parse_lengths(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


KL_TOP_K_HELP = (
    "KL columns: the baseline's K most likely next tokens (log-probs) are stored per scored "
    "token, the rest of its mass as one bucket, and each variant's mean KL(baseline || variant) "
    "and share of changed top-1 tokens come from them (a lower bound of the full-vocabulary KL). "
    "Disk: 6K+4 bytes per token under $COMPRESS_CACHE_DIR/perplexity-top-k (K=32 on all of "
    "WikiText-2 test with SmolLM2: 59 MB). Default 32; 0 leaves KL out")


def _kl_top_k_arg(text: str) -> int:
    """argparse type for --kl-top-k: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0 (0 leaves KL out)")
    return value


def _cmd_compare(args: argparse.Namespace) -> int:
    from compress.eval.compare import CompareSettings, compare

    settings = CompareSettings(
        dataset=None if args.no_perplexity else args.dataset,
        context_length=args.context_length,
        ppl_limit=args.limit,
        kl_top_k=args.kl_top_k,
        resume=not args.no_resume,
        tasks=[t for t in (args.tasks or "").split(",") if t],
        task_limit=args.task_limit,
        tasks_dir=args.tasks_dir,
        latency=not args.no_latency,
        prompts=args.prompts,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        rounds=args.rounds,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        usd_per_hour=args.usd_per_hour,
        data_dir=args.data_dir,
        backend=args.backend,
        progress=not args.no_progress,
        workload=args.workload,
        batch_sizes=args.batch_sizes,
        rate=args.rate,
        requests=args.requests,
        trace=args.trace,
        max_batch=args.max_batch,
        kv_dtype=args.kv_dtype,
        engine=args.engine,
        compile=args.compile,
        int_kernels=args.int_kernels,
        draft=args.draft,
        draft_k=args.draft_k,
        device=args.device,
    )
    result = compare(args.baseline, args.variants, settings, args.out, overwrite=args.overwrite)
    print(result["markdown"])
    print("\nwrote " + ", ".join(result["files"]))
    return 0


def _int_list(value: str) -> list[int]:
    try:
        sizes = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,4,8, got {value!r}")
    return sizes


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="single", choices=["single", "batch", "poisson", "trace"],
                   help="latency workload: single = one request at a time (default); batch = "
                   "static batches (B requests arrive together, served B at a time), one row "
                   "set per --batch-sizes value; poisson = --requests arrivals at --rate, "
                   "up to --max-batch requests in flight; trace = arrivals from --trace")
    p.add_argument("--batch-sizes", type=_int_list, metavar="B,B,...",
                   help="batch workload: comma-separated batch sizes, each measured and reported "
                   "as its own rows with a 'batch' column (default 1,4,8)")
    p.add_argument("--rate", type=float, metavar="REQ_PER_S",
                   help="poisson workload: mean arrival rate in requests per second (required)")
    p.add_argument("--requests", type=int, default=16, metavar="N",
                   help="poisson workload: requests per round (default 16)")
    p.add_argument("--trace", metavar="FILE", help="trace workload: JSON lines, each with "
                   "arrival_s (seconds from the start) and optional prompt_tokens/output_tokens")
    p.add_argument("--max-batch", type=int, default=8,
                   help="poisson/trace workloads: requests decoded together at most (default 8)")
    p.add_argument("--kv-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "int8", "fp8"],
                   help="batch/poisson/trace workloads: the paged KV cache's storage (auto: the "
                   "runtime's, fp32 on a CPU; int8: per token and head scales; fp8: e4m3 with "
                   "the checkpoint's per-layer scales), as `compress serve --kv-dtype`")
    p.add_argument("--engine", default="runtime", choices=["runtime", "hf"],
                   help="latency engine: runtime = our runtime (single: its static cache, what "
                   "`compress generate` runs; other workloads: its continuous-batching scheduler "
                   "over a paged KV cache, what `compress serve` runs; models it does not run "
                   "fall back to transformers, marked 'hf fallback'); hf = transformers with its "
                   "KV cache (batched decode)")
    p.add_argument("--compile", action="store_true",
                   help="runtime engine: torch.compile the decode step (slow to compile on CPUs)")
    p.add_argument("--int-kernels", default="ours", choices=["ours", "torch"],
                   help="runtime engine, int4/int8 layers on CPU: ours = our integer-dot kernels "
                   "at the CPU's ISA level, int8-rounded activations (faster; default), torch = "
                   "torch's kernels with bf16 activations; each row's engine names the one used")
    p.add_argument("--draft", metavar="MODEL", help="also run speculative decoding of the "
                   "baseline with this draft model (same tokenizer) on the latency prompts")
    p.add_argument("--draft-k", type=int, default=4,
                   help="speculative decoding: draft tokens per target forward (default 4)")


DATA_DIR_HELP = "data folder (default: $COMPRESS_DATA_DIR or ../shared/data)"
OVERWRITE_HELP = (
    "replace --out even when it holds files compress did not write (they are deleted once the "
    "new checkpoint is complete); without it such a folder is an error. The model's own folder "
    "is always refused"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="compress",
        description="Compress causal language models with YAML recipes (quantize, prune, "
        "distill), export compressed-tensors checkpoints, and measure quality and size.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add_recipe_args(p: argparse.ArgumentParser, optional: bool = False) -> None:
        p.add_argument("recipe", nargs="?" if optional else None,
                       help="path to a recipe .yaml file (see recipes/)"
                       + ("; without one, --show prints the recipe reference" if optional else ""))
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a recipe value, e.g. --set passes.0.group_size=64 (repeatable; "
            "validated like the file)",
        )

    p_run = sub.add_parser("run", help="run a recipe end to end and print baseline vs compressed")
    add_recipe_args(p_run)
    p_run.add_argument("--model", help="model to compress (directory, hub id, or smollm2-135m); "
                       "default: the recipe's `model`")
    p_run.add_argument("--out", help="output checkpoint directory (default: out/<recipe name>)")
    p_run.add_argument("--data-dir", help=DATA_DIR_HELP)
    p_run.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p_run.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p_run.add_argument("--full-eval", action="store_true",
                       help="score every perplexity window instead of the recipe's sample "
                       "(sets eval.perplexity.limit=null). WikiText-2 test is 593 windows of "
                       "512 tokens: on 2 idle CPU cores ~9 min for the baseline and ~15 for an "
                       "int4 model, several times that on busy cores (README); a stopped run "
                       "resumes when rerun")
    p_run.add_argument("--stream", choices=("auto", "on", "off"), default="auto",
                       help="run the passes one decoder layer at a time, read from the "
                       "checkpoint's shards and written to the export as they finish (peak "
                       "memory follows one layer, not the model). auto: whenever every pass is "
                       "layer-wise (RTN, GPTQ, AWQ, SmoothQuant, AutoRound) and the model is a "
                       "local safetensors folder; off: load the model whole")
    p_run.add_argument("--no-resume", action="store_true",
                       help="recompute perplexity even when an earlier run saved it for the same "
                       "weights and protocol (saved under $COMPRESS_CACHE_DIR/perplexity)")
    p_run.add_argument("--kl-top-k", type=_kl_top_k_arg, default=32, metavar="K",
                       help=KL_TOP_K_HELP)
    add_device_arg(p_run, recipe=True)
    p_run.set_defaults(func=_cmd_run)

    p_sweep = sub.add_parser(
        "sweep", help="run several recipes against one shared baseline and print one table "
        "(resumable; no checkpoints exported)")
    p_sweep.add_argument("recipes", nargs="+", help="recipe .yaml files (one row each)")
    p_sweep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                         help="override a value in every recipe, e.g. --set "
                         "eval.perplexity.limit=32 (repeatable)")
    p_sweep.add_argument("--model", help="model for every recipe (default: the recipes' own, "
                         "which must agree)")
    p_sweep.add_argument("--out", default="out/sweep",
                         help="folder for sweep.md / sweep.json (default: out/sweep)")
    p_sweep.add_argument("--data-dir", help=DATA_DIR_HELP)
    p_sweep.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p_sweep.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p_sweep.add_argument("--full-eval", action="store_true",
                         help="score every perplexity window (see `run --full-eval`)")
    p_sweep.add_argument("--no-resume", action="store_true",
                         help="recompute finished rows and saved perplexity windows")
    p_sweep.add_argument("--kl-top-k", type=_kl_top_k_arg, default=32, metavar="K",
                         help=KL_TOP_K_HELP)
    add_device_arg(p_sweep, recipe=True)
    p_sweep.set_defaults(func=_cmd_sweep)

    p_tune = sub.add_parser(
        "tune", help="write and run a mixed-precision recipe from a budget (bits/weight, bytes "
        "or TPOT), then verify the budget and the quality")
    p_tune.add_argument("model", help="model (directory, hub id, or smollm2-135m)")
    target = p_tune.add_mutually_exclusive_group(required=True)
    target.add_argument("--bits-per-weight", type=float,
                        help="average stored bits per decoder linear weight, scales and zero "
                        "points included (e.g. 4.25)")
    target.add_argument("--max-bytes", type=_size_bytes,
                        help="checkpoint size, e.g. 90MB (everything counted)")
    target.add_argument("--tpot-ms", type=float,
                        help="decode time per token on this machine, through the runtime")
    p_tune.add_argument("--max-dppl", type=float, metavar="PCT",
                        help="quality ceiling checked on the result: Δ perplexity in %%")
    p_tune.add_argument("--max-kl", type=float, metavar="NATS",
                        help="quality ceiling checked on the result: mean KL to the baseline")
    p_tune.add_argument("--formats", nargs="+", metavar="FORMAT",
                        help="candidate formats (default: float int8 int4-g32 int4-g64 "
                        "int4-g128 int4-g32-asym int4-g128-asym)")
    p_tune.add_argument("--algorithm", choices=["gptq", "awq", "autoround"], default="gptq",
                        help="the calibrated pass the written recipe runs (default: gptq)")
    p_tune.add_argument("--iters", type=int,
                        help="autoround: sign-SGD steps per decoder layer (default: 200)")
    p_tune.add_argument("--batch-size", type=int,
                        help="autoround: calibration sequences per step (default: the pass's 8)")
    p_tune.add_argument("--symmetric-grid", choices=["restricted", "full", "signed"],
                        default="restricted",
                        help="grid of the symmetric int candidates, in the measurement and the "
                        "recipe: amax/7, amax/7.5 or signed +-amax/8 (llama.cpp's)")
    p_tune.add_argument("--layer-by-layer", action="store_true", help="measure the sensitivities "
                        "one decoder layer at a time (default: when the whole model won't fit)")
    p_tune.add_argument("--num-samples", type=int, default=32, help="calibration sequences")
    p_tune.add_argument("--seq-len", type=int, default=512, help="calibration sequence length")
    p_tune.add_argument("--limit", type=int, default=16, help="perplexity windows to verify on")
    p_tune.add_argument("--full-eval", action="store_true", help="verify on the whole test split")
    p_tune.add_argument("--out", help="output folder (default: out/tune-<model>)")
    p_tune.add_argument("--data-dir", help=DATA_DIR_HELP)
    p_tune.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p_tune.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    add_device_arg(p_tune)
    p_tune.set_defaults(func=_cmd_tune)

    p_val = sub.add_parser("validate", help="check a recipe completely and exit (no model work)")
    add_recipe_args(p_val, optional=True)
    p_val.add_argument("--show", action="store_true", help="print the resolved recipe as YAML; "
                       "without a recipe, every recipe key with its default, type and bounds")
    p_val.set_defaults(func=_cmd_validate)

    p_ins = sub.add_parser("inspect", help="per-layer formats, shapes and bytes of a checkpoint")
    p_ins.add_argument("path", help="checkpoint directory")
    p_ins.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    p_ins.set_defaults(func=_cmd_inspect)

    p_eval = sub.add_parser("eval", help="token perplexity (and lm-eval tasks) of a model or "
                            "checkpoint")
    p_eval.add_argument("model", nargs="?", default="smollm2-135m",
                        help="model or checkpoint (default smollm2-135m)")
    p_eval.add_argument("--dataset", default="wikitext2",
                        help="wikitext2 (test), wikitext2-valid, or a text file path")
    p_eval.add_argument("--context-length", type=int, default=512, help="tokens per window")
    p_eval.add_argument("--stride", type=int, help="window start step (default: context length)")
    p_eval.add_argument("--limit", type=int, help="score only the first N windows")
    p_eval.add_argument("--backend", default="auto", choices=["auto", "reference", "cpu", "triton"],
                        help="quantized kernel backend")
    p_eval.add_argument("--no-perplexity", action="store_true", help="skip perplexity")
    p_eval.add_argument("--tasks", help="comma-separated lm-eval tasks, e.g. piqa_local,"
                        "arc_easy_local (see shared/data/lm_eval_tasks)")
    p_eval.add_argument("--task-limit", type=int, help="lm-eval: examples per task (fast runs)")
    p_eval.add_argument("--tasks-dir", help="folder of lm-eval task configs (default: "
                        "<data dir>/lm_eval_tasks)")
    p_eval.add_argument("--data-dir", help="data folder")
    p_eval.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p_eval.add_argument("--layer-by-layer", action="store_true",
                        help="read one decoder layer at a time (a model bigger than memory; "
                        "perplexity only, on --device; quantized layers scored dequantized, as "
                        "compress run scores them)")
    add_device_arg(p_eval)
    p_eval.set_defaults(func=_cmd_eval)

    p_cmp = sub.add_parser("compare", help="baseline vs variants: quality, latency, size, cost "
                           "(markdown, CSV, JSON and a PNG plot)")
    p_cmp.add_argument("baseline", help="baseline model (directory, checkpoint or smollm2-135m)")
    p_cmp.add_argument("variants", nargs="+", help="variant models or checkpoint directories")
    p_cmp.add_argument("--out", default="out/compare", help="output folder (default out/compare)")
    p_cmp.add_argument("--overwrite", action="store_true",
                       help="write into --out even when it holds files compress did not write "
                       "(compare.* files there are replaced); a model's folder is always refused")
    p_cmp.add_argument("--dataset", default="wikitext2", help="perplexity text (as for eval)")
    p_cmp.add_argument("--no-perplexity", action="store_true", help="skip perplexity")
    p_cmp.add_argument("--context-length", type=int, default=512, help="perplexity window")
    p_cmp.add_argument("--limit", type=int, help="perplexity: score only the first N windows")
    p_cmp.add_argument("--kl-top-k", type=_kl_top_k_arg, default=32, metavar="K",
                       help=KL_TOP_K_HELP)
    p_cmp.add_argument("--no-resume", action="store_true",
                       help="recompute perplexity and KL even when an earlier run saved them for "
                       "the same weights and windows (under $COMPRESS_CACHE_DIR/perplexity)")
    p_cmp.add_argument("--tasks", help="comma-separated lm-eval tasks, e.g. piqa_local,"
                       "arc_easy_local (see shared/data/lm_eval_tasks)")
    p_cmp.add_argument("--task-limit", type=int, help="lm-eval: examples per task (fast runs)")
    p_cmp.add_argument("--tasks-dir", help="folder of lm-eval task configs (default: "
                       "<data dir>/lm_eval_tasks)")
    p_cmp.add_argument("--no-latency", action="store_true", help="skip latency measurement")
    p_cmp.add_argument("--prompts", type=int, default=4, help="latency: requests per round")
    p_cmp.add_argument("--prompt-tokens", type=_lengths_arg, default=64,
                       help="latency: prompt length, N or LOW-HIGH (uniform per request)")
    p_cmp.add_argument("--output-tokens", type=_lengths_arg, default=32,
                       help="latency: new tokens, N or LOW-HIGH (uniform per request)")
    p_cmp.add_argument("--rounds", type=int, default=1, help="latency: interleaved repetitions")
    p_cmp.add_argument("--slo-ttft-ms", type=float, help="goodput SLO: max TTFT in ms")
    p_cmp.add_argument("--slo-tpot-ms", type=float, help="goodput SLO: max TPOT in ms")
    p_cmp.add_argument("--usd-per-hour", type=float, default=1.0, help="machine price for cost")
    p_cmp.add_argument("--backend", default="auto", choices=["auto", "reference", "cpu", "triton"],
                       help="quantized kernel backend")
    p_cmp.add_argument("--data-dir", help="data folder")
    p_cmp.add_argument("--no-progress", action="store_true", help="hide progress bars")
    _add_workload_args(p_cmp)
    add_device_arg(p_cmp)
    p_cmp.set_defaults(func=_cmd_compare)

    p_gen = sub.add_parser("generate", help="generate text with the static-cache runtime")
    p_gen.add_argument("prompt", help="prompt text")
    p_gen.add_argument("--model", default="smollm2-135m",
                       help="model or checkpoint (default smollm2-135m)")
    p_gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    p_gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p_gen.add_argument("--top-k", type=int, help="sample from the k most likely tokens")
    p_gen.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1]")
    p_gen.add_argument("--seed", type=int, help="sampling seed")
    p_gen.add_argument("--compile", action="store_true",
                       help="torch.compile the decode step (minutes to compile on small CPUs)")
    p_gen.add_argument("--backend", default="auto", choices=["auto", "reference", "cpu", "triton"],
                       help="quantized kernel backend")
    p_gen.add_argument("--int4-kernel", default="torch", choices=["torch", "q4q8"],
                       help="int4 layers on CPU (prefill and decode): torch's kernel (bf16 "
                       "activations, default) or our integer-dot kernel at the CPU's ISA level "
                       "with int8-rounded activations (faster; quality cost in docs/results.md)")
    p_gen.add_argument("--int8-kernel", default="torch", choices=["torch", "q8q8"],
                       help="int8 layers on CPU: torch's kernel or our Q8 x Q8 integer-dot kernel")
    p_gen.add_argument("--lm-head-bits", type=int, choices=[4, 8],
                       help="quantize a copy of the output head for decode (8: +0.01-0.1%% ppl "
                       "measured on SmolLM2, the largest matrix of small models)")
    add_dtype_arg(p_gen, "float32")
    p_gen.add_argument("--no-cuda-graphs", action="store_true",
                       help="on a GPU, launch every kernel of every decode step instead of "
                       "replaying each step from a CUDA graph (the default there)")
    add_device_arg(p_gen)
    p_gen.set_defaults(func=_cmd_generate)

    p_srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server: continuous batching "
                           "over a paged KV cache with prefix caching")
    p_srv.add_argument("model", nargs="?", default="smollm2-135m",
                       help="model or checkpoint (default smollm2-135m)")
    p_srv.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1: this machine only)")
    p_srv.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p_srv.add_argument("--served-model-name", help="the model id clients send (default: MODEL)")
    p_srv.add_argument("--max-model-len", type=int,
                       help="longest prompt + output in tokens (default: 2048, or the model's "
                            "positions or what --kv-memory holds where fewer)")
    add_dtype_arg(p_srv, "auto")
    p_srv.add_argument("--kv-memory", default="1GB",
                       help="memory for the paged KV cache, e.g. 512MB or 2GiB")
    p_srv.add_argument("--kv-dtype", default="auto",
                       choices=["auto", "float32", "bfloat16", "int8", "fp8"],
                       help="KV cache storage (auto, where decode attends in the pool, i.e. "
                       "where our CPU kernels build: bfloat16 for a quantized checkpoint, else "
                       "the float layers' dtype; elsewhere float32 on a CPU; int8: per token "
                       "and head scales, about half of bf16's bytes; fp8: "
                       "e4m3, half of bf16's bytes, with the per-layer scales a "
                       "quantize.kv_cache_fp8 pass wrote into the checkpoint, 1.0 without)")
    p_srv.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p_srv.add_argument("--max-batch", type=int, default=32, help="requests running at once")
    p_srv.add_argument("--prefill-budget", type=int, default=256,
                       help="tokens computed per scheduler step (chunked prefill): prompt "
                            "tokens, plus the decode rows where both run as one forward")
    p_srv.add_argument("--no-prefix-cache", action="store_true",
                       help="do not reuse the KV blocks of prompts seen before")
    p_srv.add_argument("--python-layers", action="store_true",
                       help="decode steps through the Python layer loop, not one C++ call")
    p_srv.add_argument("--max-waiting", type=int, default=256,
                       help="queued requests beyond which new ones get 503")
    p_srv.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p_srv.add_argument("--backend", default="auto", choices=["auto", "reference", "cpu", "triton"],
                       help="quantized kernel backend")
    p_srv.add_argument("--int4-kernel", default="torch", choices=["torch", "q4q8"],
                       help="int4 layers on CPU: torch's kernel or our integer-dot kernel")
    p_srv.add_argument("--int8-kernel", default="torch", choices=["torch", "q8q8"],
                       help="int8 layers on CPU: torch's kernel or our Q8 x Q8 kernel")
    p_srv.add_argument("--lm-head-bits", type=int, choices=[4, 8],
                       help="quantize a copy of the output head")
    p_srv.set_defaults(func=_cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    try:
        check_flags(args)
        return args.func(args)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return reader_left()
    except KeyboardInterrupt:
        if args.command != "run":
            raise
        print("\ninterrupted. Finished perplexity windows are saved: run the same command again "
              "to resume (--no-resume starts over).", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
