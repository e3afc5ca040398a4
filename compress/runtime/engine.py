"""Generation runtime for decoder-only models (plain or with our QuantLinear layers): Llama and
the families whose arithmetic ``compress.arch.RUNTIME_SPECS`` describes (q/k norms, post-norms,
multipliers, softcaps, sliding windows, LayerNorms, parallel blocks, learned positions).

The idea is gpt-fast's: a pre-allocated static KV cache, a decode step whose shapes never
change (so it compiles once), and a plain Python loop around it instead of ``generate()``.
The model's weights are re-held once at construction in the layout each phase wants
(``runtime/layers.py``): native CPU int4/int8 kernels for QuantLinear layers (one-time repack,
at about memory speed), float weights in the prefill and decode dtypes. Each quantized layer's
own tensors are released from the model as soon as its holder is built (the runtime holds one
copy of the weights, not two; ``keep_model_weights=True`` keeps the model runnable too).
Numerics do not depend on the CPU class: by default prefill runs in the weights' dtype and so
does decode of a float model (an fp32 model is fp32 throughout, its greedy tokens equal
transformers'); a quantized model decodes its remaining float layers in bf16, as the native
kernels take bf16 activations. Reduced-precision prefill is opt-in. The residual stream, norms
and softmax stay fp32; only the matmul inputs change dtype. Layers on our integer-dot kernels
run each decoder layer's q/k/v and gate/up as one call each (their weights stacked,
``layers._IntLinear.stacked``): the same outputs bit for bit, 4 calls instead of 7. Sampling is
``runtime/sampling.py``.

The decode step is compiled whole (``compile=True`` or ``"step"``): embedding, every layer and
the head in one graph, so a token costs one compiled-region entry and one guard check (issue 19:
with one graph per layer, guards and region entry were 15% of a W4 token on an AVX2 CPU). The
first call compiles every layer's code (longer than one layer's); one graph per power-of-two
key length. ``compile="layer"`` compiles one decoder layer that serves every layer instead.
Prefill runs eager by default; ``compile_prefill=True`` pads prompts to power-of-two buckets
and compiles once per bucket. Batches are left-padded; each row has its own positions.

Sliding-window layers mask keys ``sliding_window`` or more slots behind the query; the cache
keeps every slot (no ring buffer). Not supported (falls back to transformers ``generate`` with
a warning; ``unsupported_reason`` says why): families without a ``RuntimeSpec``, rope types
whose tables depend on the sequence length, other activations and layer types, bidirectional
attention. Attention reads the filled cache prefix each step: size ``max_seq_len`` to the job.
"""

from __future__ import annotations

import copy
import logging
import types
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from compress.arch import ARCHS, RUNTIME_SPECS, arch_for, decoder_layers, runtime_model_types
from compress.core.device import current_device, float_dtype
from compress.core.errors import ConfigError
from compress.kernels import cpu_attention, cpu_elementwise, cpu_float, cpu_q8, dispatch
from compress.memory import available_memory_bytes, hold_in_huge_pages, return_freed_memory
from compress.quant.kv_scales import kv_cache_scales
from compress.quant.linear import QuantLinear
from compress.runtime.families import (
    config_unsupported_reason,
    embed_factor,
    head_dim_of_config,
    kv_heads_of,
    rope_reason,
    rope_tables,
    window_mask,
)
from compress.runtime.float_linear import _FloatLinear
from compress.runtime.graphs import CaptureFailed, GraphedSteps
from compress.runtime.head import _Head
from compress.runtime.latent import LatentLayer, cached_head_dim
from compress.runtime.layers import (
    LM_HEAD_SCHEMES,
    _IntKernels,
    _Layer,
    _Q8Kernel,
)
from compress.runtime.paged import kv_bytes_per_token
from compress.runtime.sampling import _make_sampling, _sample, _Sampling, refuse_nan_scores

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = runtime_model_types()  # compress.arch entries with runtime=True
INT4_KERNELS = dispatch.INT4_KERNELS
INT8_KERNELS = dispatch.INT8_KERNELS


def unsupported_reason(model: nn.Module, max_seq_len: int | None = None) -> str | None:
    """Why the runtime cannot run ``model`` itself (then it falls back), or None; with
    ``max_seq_len``, also what it cannot run at that many positions (the Runtime's own
    check)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    arch = ARCHS.get(model_type)
    if arch is not None and not arch.runtime:  # compressed by the passes, run by transformers
        return (f"model_type {model_type!r} is not implemented by this runtime (its compress.arch "
                "entry has runtime=False)")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    spec = RUNTIME_SPECS[model_type]
    return config_unsupported_reason(config, spec, max_seq_len) or rope_reason(model, arch, spec)


def _call_layer(
    layer: _Layer, x, cos, sin, mask, k_cache, v_cache, slots, decode: bool, length: int
):
    return layer(x, cos, sin, mask, k_cache, v_cache, slots, decode, length)


def _decode_step(runtime: Runtime, tokens, positions, mask, slots, b: int, length: int):
    """One whole decode step, token ids [B, 1] to next-token logits [B, V] fp32: embedding, every
    layer (writing its cache slot) and the head. Compiled as one graph (``compile="step"``), a
    token costs one compiled-region entry and one guard check instead of one per layer."""
    x = runtime._embed(tokens, positions)
    x = runtime._apply(_call_layer, x, positions, mask, slots, b, length, True)
    return runtime.head(x[:, -1])


# No guards on the step's modules: this runtime builds them and never changes them, and each
# runtime compiles its own copy of the step's code (``_own_code``), whose graphs only it calls.
# Measured: the module guards (hook dicts, types, constants; ~1500 for SmolLM2) cost 1.4 ms of
# a 15 ms W4 token; without them the cache lookup takes 0.1 ms. Guards on the inputs, the
# caches and the ints (batch, length) stay.
_STEP_GUARDS = torch.compiler.skip_guard_on_all_nn_modules_unsafe


def _own_code(fn):
    """``fn`` with a code object of its own. Dynamo keeps its compiled graphs per code object,
    so runtimes of other models (other module structure) never find this one's graphs; that is
    what makes dropping the module guards safe."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)


def _compile_options() -> dict[str, int]:
    """Inductor options that pin its C++ vector width to the ISA ATen dispatches to.

    Why: inductor's on-disk cache key leaves out ATen's CPU capability. Measured on torch 2.13,
    AVX-512 CPU: a decode step compiled once normally, then again under
    ``ATEN_CPU_CAPABILITY=avx2``, reused the cached 16-lane C++ with 8-lane vectors and died
    with SIGSEGV (a fresh cache directory ran fine). Naming the width puts it in the key."""
    lanes = {"AVX512": 512, "AVX2": 256}.get(torch.backends.cpu.get_cpu_capability())
    return {} if lanes is None else {"cpp.simdlen": lanes}


def _bucket(n: int, cap: int) -> int:
    return min(max(16, 1 << (n - 1).bit_length()), cap)


def _check_cache_fits(config, arch, max_batch_size: int, max_seq_len: int,
                      kv_dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a static KV cache larger than the free memory where it goes: allocated and
    zeroed at once, it would fail in the allocator or get the process killed for memory."""
    kv_heads, head_dim = kv_heads_of(config, arch), head_dim_of_config(config)
    if arch.latent_attention:  # one head of latent and rotary key, no values (runtime.latent)
        kv_heads, head_dim = 1, cached_head_dim(config, arch)
    layers = config.num_hidden_layers
    need = max_batch_size * max_seq_len * kv_bytes_per_token(
        layers, kv_heads, head_dim, kv_dtype, values_in_keys=bool(arch.latent_attention))
    free = available_memory_bytes(device)
    if free is not None and need > free:  # a ValueError that the CLI prints as a user's error
        raise ConfigError(
            f"the static KV cache of max_batch_size={max_batch_size} x max_seq_len={max_seq_len} "
            f"needs {need / 1e9:.2f} GB ({layers} layers, {kv_heads} KV heads of {head_dim}, "
            f"{str(kv_dtype).removeprefix('torch.')}), more than the {free / 1e9:.2f} GB free on "
            f"{device}; lower max_seq_len or max_batch_size"
        )


class Runtime:
    """Static-cache generation for one model; reuse it across calls (the cache is allocated once).

    ``max_seq_len``: cache slots per row (prompt + new tokens); ``max_batch_size``: rows
    allocated. ``prefill_dtype``/``decode_dtype``: matmul input dtype per phase (None: prefill
    in the weights' dtype on every CPU; decode in bf16 for bf16 models and for quantized ones
    on CPUs with bf16 matmuls, else the weights' dtype). ``kv_dtype`` defaults to fp32 when
    prefill is fp32 on CPU (a bf16 cache changes an fp32 model's tokens; through SDPA it was
    also slower: one query over 512 bf16 keys 2.0 ms vs 0.36 ms in fp32 on an AVX2 CPU), else
    the decode dtype. On CPUs where our kernels build, one-query attention reads the cache
    through ``kernels.cpu_attention.cache_decode_attention`` (bf16 as fast as fp32 there; SDPA
    elsewhere and for prefill). ``compile``: True/``"step"`` compiles the whole decode step as
    one graph, ``"step-cpp"`` the same with the graph's host code generated as C++, not Python
    (inductor's ``cpp_wrapper``: the per-op Python between kernels goes; measured on a Xeon,
    SmolLM2 W4 with our kernels decoded in 4.9 instead of 5.2 ms a token, and its first
    compile took 143 s instead of 55), ``"layer"`` one decoder layer reused by all, False:
    eager. ``int4_kernel``: ``"torch"``
    (torch's native int4 kernel, bf16 activations: the default, tokens equal transformers') or
    ``"q4q8"`` (both phases through our integer-dot kernel, ``compress/kernels/cpu_q8.py``, at
    the CPU's ISA level, activations rounded to int8 per block of 32, llama.cpp's scheme: faster
    decode and prefill (a row-tile GEMM; on the 256-bit levels, prompts from
    ``cpu_q8.FLOAT_GEMM_MIN_ROWS`` tokens run an fp32 GEMM of the dequantized weights instead;
    on CPUs with AMX-BF16, steps of ``cpu_q8.bf16_amx_min_rows()`` rows or more take bf16
    activations on AMX instead of the int8 rounding), +0.2% perplexity measured on SmolLM2 W4
    with int8 activations, tokens may differ; torch's layout is not held then).
    ``int8_kernel``: the same choice for int8 layers and an int8 head (``"torch"`` or
    ``"q8q8"``). Both fall back to "torch" with a warning where our kernels cannot be built;
    ``q8_isa`` says which level runs. ``lm_head_bits``: None keeps
    a float lm_head (in the decode dtype); 4 or 8 quantizes a copy at construction (RTN,
    symmetric; int4 group 32, int8 per channel) run by the int4/int8 kernels above: the (tied)
    lm_head is the largest matrix of small models (SmolLM2: 49152x576, 45% of W4's decode bytes
    in bf16).

    Memory: by default the model's quantized linears are released as the runtime takes them,
    one at a time (``layers.release_weights``: meta tensors in the model, whose own forward then
    refuses to run; norms, embedding, a float head and the config stay, as does any layer the
    runtime calls as it is: W8A8, MoE blocks, Triton layers on CUDA). A caller that still runs
    the model, or builds a second Runtime from it, passes ``keep_model_weights=True`` and holds
    both copies. ``static_cache=False`` allocates no contiguous KV cache (``max_batch_size`` x
    ``max_seq_len`` slots per layer): for a runtime that only a ``Scheduler`` drives, which
    brings its own paged cache; ``generate``/``stream``/``prefill`` then refuse.

    ``cuda_graphs``: replay each decode step from a CUDA graph (``runtime/graphs.py``; one per
    batch size and power-of-two key length, captured on first use), so a token costs one launch
    instead of one per kernel. None (default): on where the model is on a GPU and the runtime
    has its static cache; True elsewhere is refused. A capture that fails warns once and decodes
    without graphs from then on.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_seq_len: int = 512,
        max_batch_size: int = 1,
        prefill_dtype: torch.dtype | None = None,
        decode_dtype: torch.dtype | None = None,
        kv_dtype: torch.dtype | None = None,
        compile: bool | str = True,
        compile_prefill: bool = False,
        int4_kernel: str = "torch",
        int8_kernel: str = "torch",
        lm_head_bits: int | None = None,
        keep_model_weights: bool = False,
        static_cache: bool = True,
        cuda_graphs: bool | None = None,
    ) -> None:
        if int4_kernel not in INT4_KERNELS:
            raise ValueError(f"int4_kernel={int4_kernel!r}: expected one of {INT4_KERNELS}")
        if int8_kernel not in INT8_KERNELS:
            raise ValueError(f"int8_kernel={int8_kernel!r}: expected one of {INT8_KERNELS}")
        if lm_head_bits not in (None, *LM_HEAD_SCHEMES):
            raise ValueError(f"lm_head_bits={lm_head_bits!r}: expected None, 4 or 8")
        group = lm_head_bits and LM_HEAD_SCHEMES[lm_head_bits].group_size
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        if group and hidden and hidden % group:
            raise ValueError(
                f"lm_head_bits={lm_head_bits} quantizes the head in groups of {group}, which do "
                f"not divide hidden_size {hidden}; use lm_head_bits=8 or leave it unset"
            )
        if compile not in (False, True, "step", "step-cpp", "layer"):
            raise ValueError(
                f"compile={compile!r}: expected True/'step', 'step-cpp', 'layer' or False"
            )
        if max_seq_len < 2 or max_batch_size < 1:
            raise ValueError(
                f"max_seq_len={max_seq_len} and max_batch_size={max_batch_size} must be >= 2, 1"
            )
        self.model, self.max_seq_len, self.max_batch_size = model, max_seq_len, max_batch_size
        self.fallback_reason = unsupported_reason(model, max_seq_len)
        self.device = model.get_input_embeddings().weight.device  # seeded generators live here
        if cuda_graphs not in (None, True, False):
            raise ValueError(f"cuda_graphs={cuda_graphs!r}: expected None, True or False")
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(
                f"cuda_graphs=True needs the model on a CUDA device; it is on {self.device} "
                "(leave cuda_graphs=None: graphs where the model is on a GPU)"
            )
        self._graphs: GraphedSteps | None = None  # decode steps replayed from CUDA graphs
        if self.fallback_reason is not None:
            warnings.warn(
                f"compress runtime falls back to transformers generate: {self.fallback_reason}",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        config = model.config
        embed = model.get_input_embeddings().weight
        # the dtype the model computes in (a loaded bf16 embedding may serve an fp32 model)
        device, w_dtype = embed.device, float_dtype(model.get_input_embeddings()) or embed.dtype
        quantized = any(isinstance(m, QuantLinear) for m in model.modules())
        if decode_dtype is None:
            # a quantized model's float parts (the head) in bf16 where the CPU multiplies bf16;
            # elsewhere in the weights' dtype, and a bf16 export's fp32-loaded head is held in
            # bf16 all the same (_FloatLinear.pack), computed in fp32
            cpu_quant = quantized and device.type == "cpu" and cpu_float.cpu_bf16_matmuls()
            decode_dtype = torch.bfloat16 if cpu_quant or w_dtype == torch.bfloat16 else w_dtype
        if prefill_dtype is None:
            # The weights' dtype on every CPU class: bf16 prefill is faster where the CPU has
            # bf16 matmuls but changes an fp32 model's tokens, so it is opt-in.
            prefill_dtype = w_dtype
        self.prefill_dtype, self.decode_dtype = prefill_dtype, decode_dtype
        if kv_dtype is None:
            fp32_prefill = device.type == "cpu" and prefill_dtype == torch.float32
            kv_dtype = torch.float32 if fp32_prefill else decode_dtype
        self.kv_dtype = kv_dtype
        # fp8 KV pages' (k_scale, v_scale) per layer from the checkpoint (quantize.kv_cache_fp8;
        # None: it has none), read by the scheduler's fp8 paged cache
        self.kv_scales = kv_cache_scales(model)
        wants_q8 = int4_kernel == "q4q8" or int8_kernel == "q8q8"
        q8_reason = dispatch.q8_unavailable_reason() if wants_q8 else None
        if q8_reason is not None:
            warnings.warn(
                f"int4_kernel={int4_kernel!r}, int8_kernel={int8_kernel!r}: our integer-dot "
                f"kernels are unavailable ({q8_reason}); using torch's int4/int8 kernels",
                RuntimeWarning,
                stacklevel=2,
            )
            int4_kernel = int8_kernel = "torch"
        self.int4_kernel, self.int8_kernel = int4_kernel, int8_kernel
        # the ISA level of our kernels in this process, for reports (None: not asked for)
        self.q8_isa = cpu_q8.selected_isa() if wants_q8 and q8_reason is None else None
        kernels = _IntKernels(int4_kernel, int8_kernel)
        notes: list[str] = []
        arch = arch_for(model, "compress runtime")
        spec = RUNTIME_SPECS[arch.model_type]
        # learned absolute positions (OPT): a table whose rows from ``offset`` on are positions
        positions = model.get_submodule(arch.positions).weight if arch.positions else None
        offset = spec.position_offset
        if positions is not None and max_seq_len + offset > positions.shape[0]:
            raise ConfigError(  # before the layers take (and release) the model's weights
                f"max_seq_len={max_seq_len} (compress serve's --max-model-len): this model has "
                f"learned positions for {positions.shape[0] - offset} tokens; lower it to that")
        if static_cache:  # before the layers take (and release) the model's weights
            _check_cache_fits(config, arch, max_batch_size, max_seq_len, kv_dtype, device)
        with torch.no_grad():
            self.layers = nn.ModuleList()
            for i, layer in enumerate(decoder_layers(model, "compress runtime")):
                self.layers.append(
                    (LatentLayer if arch.latent_attention else _Layer)(
                        layer,
                        config,
                        prefill_dtype,
                        decode_dtype,
                        notes,
                        i,
                        kernels,
                        arch,
                        spec=spec,
                        release=not keep_model_weights,
                    )  # fmt: skip
                )
                # glibc keeps the heap chunks just freed (the layer's released tensors, the
                # repack's temporaries) resident until trimmed, so they would count twice in
                # the peak: measured at a 1.1B W4 shape, 1.62 GB after the build without this
                # and 1.26 GB once trimmed, for a load peak of 1.23
                return_freed_memory()
            self.head = _Head(
                model, decode_dtype, notes, kernels, lm_head_bits, arch, spec=spec,
                release=not keep_model_weights,
            )  # fmt: skip
            self.embed, self.embed_dtype = embed.detach(), w_dtype
            self.position_table = None if positions is None else positions.detach()[offset:]
            self.embed_factor = embed_factor(config, arch, spec, w_dtype)
            self.rope = rope_tables(model, arch, spec, max_seq_len)
        # layers (lm_head included) that decode through our integer-dot kernels
        held = list(self.layers.modules()) + list(self.head.modules())
        self.q8_layers = sum(isinstance(m, _Q8Kernel) for m in held)
        # rows from which some of those layers switch to a float GEMM (None: none does)
        self.float_gemm_rows = min(
            (m.float_rows for m in held if isinstance(m, _Q8Kernel) and m.float_rows is not None),
            default=None,
        )
        # Windows at or beyond the cache length never cut a key, so they need no mask.
        self._windows = {
            layer.window for layer in self.layers if layer.window and layer.window < max_seq_len
        }
        if notes:
            log.warning(
                "runtime: %d layers without a native kernel: %s", len(notes), "; ".join(notes[:20])
            )
        self.device = device
        self.static_cache = static_cache
        self.k_cache, self.v_cache = self._new_caches()
        self.valid = torch.zeros(max_batch_size, max_seq_len, dtype=torch.bool, device=device)
        self._slot = torch.zeros(1, dtype=torch.long, device=device)
        self.compile_prefill = compile_prefill
        self._decode_fn = self._prefill_fn = _call_layer
        self._step = _decode_step
        self._compiled = bool(compile)
        self.huge_pages: dict[str, int | bool] | None = None  # hold_in_huge_pages' counts
        if device.type == "cpu":
            # Float weights packed (_FloatLinear.pack; a compiled step calls oneDNN's through
            # an op of ours, bf16 only: measured on an AMD EPYC without AMX, 2 threads, the
            # 1.1B shape in bf16 decoded 9.1 tok/s compiled unpacked, 18.9 packed, 26.2 eager
            # packed, in one process). Fused elementwise ops (and greedy sampling in one pass,
            # Scheduler._emit), eager only: measured on a Xeon (2 threads,
            # scripts/profile_serving_step.py, three interleaved runs each), a 32-row
            # SmolLM2-135M decode step 55.7-57.2 -> 46.5-48.1 ms in bf16, 51.9-60.7 -> 42.5-45.3
            # ms for W4; a 28-row 1.1B-shape W4 step 145 -> 135 ms (one run each)
            fused = not compile and cpu_elementwise.unavailable_reason(device) is None
            for layer in self.layers:
                layer.pack_float(fp32=not compile)
                layer.fused = fused
            for module in self.head.modules():
                if isinstance(module, _FloatLinear):
                    module.pack(fp32=not compile)
            # one-query attention over the cache through our kernel where it builds, not SDPA
            # (csrc/paged_attention.cpp, cache_decode_attention, says what it measured)
            for layer in self.layers:
                if (kv_dtype in cpu_attention.CACHE_DTYPES and cpu_attention.unavailable_reason(
                        kv_dtype, device, layer.head_dim) is None):
                    layer.cache_attention = cpu_q8.ops().cache_decode_attention
                # a prompt's causal attention through our kernel where it was measured faster
                # than ATen's flash attention (cpu_attention.PREFILL_ISAS, PREFILL_HEAD_DIMS)
                if cpu_attention.prefill_unavailable_reason(layer.head_dim, device) is None:
                    layer.prefill_attention = cpu_q8.ops().causal_prefill_attention
            # the weights every decode step streams, on 2 MB pages where the kernel grants them
            # (memory.HugePageArena says why and what it measured)
            self.huge_pages = hold_in_huge_pages(
                list(self.layers.modules()) + list(self.head.modules())
            )
        if compile:
            options = _compile_options() if device.type == "cpu" else {}
            if compile == "step-cpp":
                options = {**options, "cpp_wrapper": True}
            if compile == "layer":
                self._decode_fn = torch.compile(_call_layer, dynamic=False, options=options)
            else:
                self._step = torch.compile(
                    _own_code(_decode_step),
                    dynamic=False,
                    options={**options, "guard_filter_fn": _STEP_GUARDS},
                )
            if compile_prefill:
                self._prefill_fn = torch.compile(_call_layer, dynamic=False, options=options)
        if cuda_graphs is None:
            cuda_graphs = device.type == "cuda"
        if cuda_graphs and static_cache:
            self.use_graphs(GraphedSteps())

    def use_graphs(self, graphs: GraphedSteps | None) -> None:
        """Replay decode steps from ``graphs`` (None: launch every kernel of every step). Key
        lengths are then rounded up to powers of two, as for a compiled step, so that a
        generation of ``max_seq_len`` tokens captures log2(max_seq_len) graphs per batch size.
        The CUDA default is ``GraphedSteps()``; tests pass one that replays on the CPU."""
        self._graphs = graphs

    # ---- public API ----------------------------------------------------------------------
    def stream(self, input_ids: list[int], max_new_tokens: int, **sampling) -> Iterator[int]:
        """Yield new tokens of one prompt as they are produced (see ``generate`` for options)."""
        stop = set(sampling.pop("stop_tokens", None) or ())
        if self.fallback_reason is not None:
            yield from self.generate([input_ids], max_new_tokens, stop_tokens=stop, **sampling)[0]
            return
        sampling_ = _make_sampling(**sampling, device=self.device)
        for tokens in self._run([list(input_ids)], max_new_tokens, sampling_):
            token = int(tokens[0])
            yield token
            if token in stop:
                return

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        *,
        stop_tokens: list[int] | set[int] | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> list[list[int]]:
        """New tokens per prompt (a stop token ends its row and is included).

        Greedy when ``temperature`` is 0; otherwise sampling with optional top-k/top-p and a
        seeded generator. Rows decode together (left-padded); generation ends when every row
        has stopped or ``max_new_tokens`` are produced.
        """
        prompts = [list(p) for p in prompts]
        stop = set(stop_tokens or ())
        sampling = _make_sampling(temperature, top_k, top_p, seed, device=self.device)
        if self.fallback_reason is not None:
            return self._hf_generate(prompts, max_new_tokens, stop, sampling)
        out: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        for tokens in self._run(prompts, max_new_tokens, sampling):
            for row, token in enumerate(tokens.tolist()):
                if not done[row]:
                    out[row].append(token)
                    done[row] = token in stop
            if all(done):
                break
        return out

    def fork(self) -> Runtime:
        """Another runtime with its own KV cache that shares this one's weights and compiled
        step: one per request that must stay open while others run (interleaved serving),
        without repacking the weights again."""
        other = copy.copy(self)
        if self.fallback_reason is None:  # the fallback keeps no cache
            other.k_cache, other.v_cache = self._new_caches()
            other.valid, other._slot = torch.zeros_like(self.valid), torch.zeros_like(self._slot)
            # graphs replay fixed addresses: this runtime's read the other cache and slot
            other._graphs = None if self._graphs is None else self._graphs.fresh()
        return other

    def decode_bytes(self) -> dict[str, int]:
        """Bytes a decode step reads: ``weights`` (every layer's decode-phase weights and the
        head; one embedding row is negligible) and ``kv_cache`` (the whole allocated cache)."""
        seen: set[int] = set()
        weights = 0
        for module in list(self.layers.modules()) + list(self.head.modules()):
            tensors = dict(module.named_buffers(recurse=False))
            if isinstance(module, _FloatLinear):  # decode reads w_decode (maybe w_prefill itself)
                tensors["w_prefill"] = module.w_decode
                # one row reads the plain weight where one is kept beside the packed copy
                if module.packed is not None and module.w_decode is None:
                    # an opaque oneDNN tensor: no data_ptr
                    weights += module.packed.numel() * module.packed.element_size()
            for t in tensors.values():
                if t is not None and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    weights += t.numel() * t.element_size()
        cache = sum(c.numel() * c.element_size() for c in {id(c): c for c in
                                                            self.k_cache + self.v_cache}.values())
        return {"weights": weights, "kv_cache": cache}

    def _new_caches(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Keys and values: one zeroed [B_max, Hkv, S, D] buffer per layer each (none without
        ``static_cache``; a layer whose values are its keys, ``values_in_keys``, has one for
        both). Separate tensors, not views of one: the compiled step writes each in place, where
        it copied a view's slice out and back (measured: a KV-slice copy per layer per token,
        torch 2.13)."""
        if not self.static_cache:
            return [], []
        first = self.layers[0]
        shape = (self.max_batch_size, first.n_kv, self.max_seq_len, first.head_dim)
        keys = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in self.layers]
        values = [k if layer.values_in_keys else torch.zeros_like(k)
                  for k, layer in zip(keys, self.layers, strict=True)]
        return keys, values

    # ---- one row, step by step (speculative decoding) ------------------------------------
    position = 0  # tokens in row 0's cache for prefill/score/rewind

    def prefill(self, prompt: list[int]) -> torch.Tensor:
        """Start row 0 at ``prompt``: fill its cache, return the next-token logits [V] fp32.
        Then ``score`` feeds tokens and ``rewind`` drops them; ``position`` is the cache length."""
        if self.fallback_reason is not None:
            raise RuntimeError(f"the runtime does not run this model: {self.fallback_reason}")
        self._check_cache()
        self._check([list(prompt)], 1)
        self.position = 0
        return self.score(list(prompt))[-1]

    @torch.no_grad()
    def score(self, tokens: list[int]) -> torch.Tensor:
        """Logits [T, V] fp32 after each of ``tokens``, fed in one forward from ``position``
        (gpt-fast's verify step): row i is what greedy decoding would compute after token i.
        A single token goes through the (compiled or graphed) decode step; several run eager."""
        with current_device(self.device):
            return self._score(tokens)

    def _score(self, tokens: list[int]) -> torch.Tensor:
        self._check_cache()
        start, t = self.position, len(tokens)
        if t < 1 or start + t > self.max_seq_len:
            raise ValueError(
                f"{t} tokens at position {start} do not fit max_seq_len={self.max_seq_len}"
            )
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        slots = torch.arange(start, start + t, device=self.device)
        if start == 0:  # prefill: attends to its own fresh keys, as in ``_run``; causal
            x = self._layers(ids, slots[None], None, slots, 1, t, decode=False)
        else:
            length = start + t
            if t == 1 and self._bucketed:  # the compiled step's power-of-two key lengths
                length = _bucket(length, self.max_seq_len)
            keys = torch.arange(length, device=self.device)
            mask = (keys[None, :] <= slots[:, None])[None, None]  # [1, 1, T, L] causal
            if t == 1:  # [1, V]; a copy: a graph's output is overwritten by its next replay
                self._slot.fill_(start)
                self.position = start + t
                return self._decode(ids, slots[None], mask, 1, length).clone()
            else:  # eager: a k-token decode step is another shape than the compiled one
                x = self._embed(ids, slots[None])
                x = self._apply(_call_layer, x, slots[None], mask, slots, 1, length, True)
        self.position = start + t
        return self.head(x[0])

    def rewind(self, position: int) -> None:
        """Forget every token at or after ``position`` (their cache slots get overwritten)."""
        if not 0 < position <= self.position:
            raise ValueError(f"cannot rewind to {position}: the cache holds {self.position}")
        self.position = position

    # ---- the loop ------------------------------------------------------------------------
    def _check_cache(self) -> None:
        if not self.static_cache:
            raise RuntimeError(
                "this Runtime was built with static_cache=False (for a Scheduler's paged "
                "cache): build it with static_cache=True to generate from it directly"
            )

    def _check(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        """Refuse prompts this runtime cannot take (the scheduler asks it too)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if len(prompts) > self.max_batch_size:
            raise ValueError(
                f"batch of {len(prompts)} prompts exceeds max_batch_size={self.max_batch_size} "
                f"allocated; create the Runtime with max_batch_size>={len(prompts)}"
            )
        need = max(len(p) for p in prompts) + max_new_tokens
        if max_new_tokens < 1 or need > self.max_seq_len:
            raise ValueError(
                f"longest prompt ({max(len(p) for p in prompts)} tokens) + max_new_tokens "
                f"({max_new_tokens}) must be in 1..max_seq_len={self.max_seq_len}; create the "
                f"Runtime with max_seq_len>={need} or shorten the prompt"
            )
        vocab = self.embed.shape[0]
        bad = [t for p in prompts for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}")

    @torch.no_grad()
    def _run(self, prompts, max_new_tokens: int, sampling: _Sampling) -> Iterator[torch.Tensor]:
        self._check_cache()
        self._check(prompts, max_new_tokens)
        b, t = len(prompts), max(len(p) for p in prompts)
        tb = _bucket(t, self.max_seq_len) if self.compile_prefill else t
        tokens = torch.zeros(b, tb, dtype=torch.long)
        pad = torch.tensor([t - len(p) for p in prompts])
        self.valid.zero_()
        for row, p in enumerate(prompts):  # left padding: every row's last token is at t - 1
            tokens[row, t - len(p) : t] = torch.tensor(p)
            self.valid[row, t - len(p) : t] = True
        pad, tokens = pad.to(self.device), tokens.to(self.device)
        positions = (torch.arange(tb, device=self.device)[None] - pad[:, None]).clamp(min=0)
        keys = self.valid[:b, :tb]
        causal = torch.ones(tb, tb, dtype=torch.bool, device=self.device).tril()
        # Every query sees itself, so padding rows stay finite (their outputs are never read).
        eye = torch.eye(tb, dtype=torch.bool, device=self.device)
        mask = ((causal & keys[:, None, :]) | eye)[:, None]  # [B, 1, T, T]
        if b == 1 and tb == t:  # one prompt, no padding: plain causal (_Layer.attend)
            mask = None
        slots = torch.arange(tb, device=self.device)
        with current_device(self.device):  # Triton kernels and graphs use the current GPU
            x = self._layers(tokens, positions, mask, slots, b, tb, decode=False)
            logits = self.head(x[:, t - 1])
        pos = t
        for step in range(max_new_tokens):
            next_tokens = _sample(logits, sampling)
            yield next_tokens
            if step == max_new_tokens - 1:
                return
            self.valid[:b, pos] = True
            self._slot.fill_(pos)
            # Attend to the filled prefix only (measured: the whole 512-slot cache cost more per
            # token than every int4 matmul together); compiled and graphed steps use power-of-two
            # lengths so that only log2(max_seq_len) graphs exist.
            length = _bucket(pos + 1, self.max_seq_len) if self._bucketed else pos + 1
            mask = self.valid[:b, None, None, :length]  # [B, 1, 1, L]
            with current_device(self.device):
                logits = self._decode(next_tokens[:, None], (pos - pad)[:, None], mask, b, length)
            pos += 1

    @property
    def _bucketed(self) -> bool:
        """Whether decode key lengths are rounded up to powers of two (compiled or graphed
        steps: one graph per length)."""
        return self._compiled or self._graphs is not None

    def _decode(self, tokens, positions, mask, b: int, length: int) -> torch.Tensor:
        """Logits [B, V] of one decode step at cache slot ``self._slot``, replayed from a CUDA
        graph where graphs are on, else launched (``_launch_decode``). A graph's logits are its
        output tensor: read them before the next step."""
        if self._graphs is not None:
            step = lambda t, p, m: self._launch_decode(t, p, m, b, length)  # noqa: E731
            try:
                return self._graphs((b, length), step, tokens, positions, mask)
            except CaptureFailed as exc:
                warnings.warn(
                    f"compress runtime: {exc}; decoding without CUDA graphs from now on",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self._graphs = None  # rerunning writes the same cache slot from the same inputs
        return self._launch_decode(tokens, positions, mask, b, length)

    def _launch_decode(self, tokens, positions, mask, b: int, length: int) -> torch.Tensor:
        """One decode step's kernels launched from Python (whole-step compiled, per-layer
        compiled or eager: ``compile``)."""
        if self._step is _decode_step:
            x = self._layers(tokens, positions, mask, self._slot, b, length, decode=True)
            return self.head(x[:, -1])
        try:
            return self._step(self, tokens, positions, mask, self._slot, b, length)
        except Exception as exc:  # noqa: BLE001  (any compiler failure: warn once, run eager)
            self._compile_failed(exc)
            return self._launch_decode(tokens, positions, mask, b, length)

    def _compile_failed(self, exc: Exception) -> None:
        warnings.warn(
            f"compress runtime: torch.compile failed ({type(exc).__name__}: {exc}); "
            "running eager from now on",
            RuntimeWarning,
            stacklevel=3,
        )
        self._decode_fn = self._prefill_fn = _call_layer
        self._step = _decode_step

    def _layers(
        self, tokens, positions, mask, slots, b: int, length: int, *, decode: bool
    ) -> torch.Tensor:
        fn = self._decode_fn if decode else self._prefill_fn
        x = self._embed(tokens, positions)  # [B, T, H]
        try:
            return self._apply(fn, x, positions, mask, slots, b, length, decode)
        except Exception as exc:  # noqa: BLE001  (any compiler failure: warn once, run eager)
            if fn is _call_layer:
                raise
            self._compile_failed(exc)
            # Re-running is safe: each layer rewrites the same cache slots from the same input.
            return self._apply(_call_layer, x, positions, mask, slots, b, length, decode)

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Embeddings [B, T, H] fp32 of tokens [B, T] at positions [B, T], scaled in the model
        dtype where the family scales, plus the learned position's row where it has them
        (added in the model dtype, as transformers adds them)."""
        x = self.embed[tokens].to(self.embed_dtype)
        if self.embed_factor is not None:
            x = x * self.embed_factor
        if self.position_table is not None:
            x = x + self.position_table[positions].to(self.embed_dtype)
        return x.float()

    def _apply(self, fn, x, positions, mask, slots, b: int, length: int, decode: bool):
        """All layers; each gets its whole cache buffers and uses rows ``:b`` and slots
        ``:length``. positions [B, T] index the rope tables; slots [T] are the queries' cache
        slots (for sliding windows)."""
        ropes = {key: (cos[positions], sin[positions]) for key, (cos, sin) in self.rope.items()}
        masks = {window: window_mask(mask, slots, window) for window in self._windows}
        for i, layer in enumerate(self.layers):
            cos, sin = ropes[layer.rope_key]  # [B, T, D]
            layer_mask = masks.get(layer.window, mask)
            k_cache, v_cache = self.k_cache[i], self.v_cache[i]
            x = fn(layer, x, cos, sin, layer_mask, k_cache, v_cache, slots, decode, length)
        return x

    def _hf_generate(self, prompts, max_new_tokens: int, stop: set[int], s: _Sampling):
        pad_id = next(iter(stop), 0)
        t = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (t - len(p)) + p for p in prompts])
        attention = torch.tensor([[0] * (t - len(p)) + [1] * len(p) for p in prompts])
        kwargs = dict(
            do_sample=s.temperature > 0,
            max_new_tokens=max_new_tokens,
            eos_token_id=sorted(stop) or None,
            pad_token_id=pad_id,
            logits_processor=[refuse_nan_scores],
        )
        if s.temperature > 0:
            kwargs.update(temperature=s.temperature, top_k=s.top_k or 0, top_p=s.top_p or 1.0)
        device = self.model.get_input_embeddings().weight.device
        with torch.no_grad():
            out = self.model.generate(
                ids.to(device), attention_mask=attention.to(device), **kwargs
            )[:, t:]
        result = []
        for row in out.tolist():
            cut = next((i + 1 for i, tok in enumerate(row) if tok in stop), len(row))
            result.append(row[:cut])
        return result
