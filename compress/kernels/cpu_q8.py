"""Our integer-dot CPU kernels (``csrc/q8_dot.cpp``: decode, ``csrc/q8_gemm.cpp``: prefill),
one build per ISA level.

llama.cpp's Q4 x Q8 and Q8 x Q8 schemes: the activations are rounded to int8 per block of 32
columns (scale = amax / 127, round half to even) and each block's dot product with the int4 or
int8 weight codes is done in integers, then scaled. Two ops per build:
``int4_linear_q8`` (int4 weights) and ``int8_linear_q8`` (int8 weights: W8 layers, the int8
lm_head). From 8 rows on (prefill) each op runs as a GEMM whose vector lanes hold rows: the same
integers, another fp32 summation order. Two more ops, ``dequantize_q4`` / ``dequantize_q8``,
return the weights in fp32 for the runtime's long prompts where an fp32 GEMM wins
(``FLOAT_GEMM_MIN_ROWS``).

ISA levels, chosen at run time from the CPU flags (``cpuinfo``), best first:

- ``avx512vnni``: 512-bit ``vpdpbusd`` (AVX512F/BW/VL + AVX512_VNNI: Intel Xeon since Cascade
  Lake, AMD Zen 4);
- ``avxvnni``: 256-bit ``vpdpbusd`` (AVX-VNNI: Intel Alder Lake and later clients);
- ``avx2``: ``vpmaddubsw`` + ``vpmaddwd`` (every x86-64 CPU of the last decade).

``COMPRESS_CPU_ISA=avx2`` (or another level the CPU has) forces a lower level, so CI on an
AVX-512 machine also runs the AVX2 code. Every level computes the same exact integer block
dots; results differ only in fp32 summation order. The float64 model of that arithmetic is
``linear_q8_reference``; tests hold every level the CPU has against it.

Why the kernels exist (docs/results.md): torch's int4 CPU kernel is bound by unpacking int4 to
bf16 (1.4-2.5 GB/s of weights per thread on an AVX2 EPYC) and its int8 kernel takes bf16
activations; the integer dot does 32 weights in two to four instructions. The price is the
activation rounding: +0.2% WikiText-2 perplexity on SmolLM2 W4 (``bench_q8_activations.py``),
so the runtime uses them only when asked (``int4_kernel="q4q8"``, ``int8_kernel="q8q8"``), then
in both phases: at prefill sizes torch's weight-only kernels were slower than an fp32 GEMM
(``scripts/bench_prefill.py``).

Layouts (``prepack_int4`` / ``prepack_int8``, once per layer; K a multiple of 64, groups a
multiple of 32): int4 codes uint8 [N, K/2], per 64 columns 32 bytes with byte i = column i
(low nibble) | column 32+i (high nibble), codes 0..15 meaning ``q - 8``; int8 codes uint8
[N, K] holding the signed code + 128; fp32 scales [N, K/g] and, for asymmetric weights only,
fp32 offsets [N, K/g]: ``w = (code - bias) * scale + offset``. At the avx512vnni level int4
weights with N a multiple of 16 go on to column tiles (``to_tiles``, ``csrc/q8_tiles.cpp``):
codes [N/16, K/8, 64], the vector lanes holding 16 output columns, scales [N/16, K/g, 16]; one
op runs every row count there (``int4_linear_q8_tiles``). Where the CPU and Linux grant AMX-INT8
(``amx_reason``), from ``AMX_MIN_ROWS`` rows the same layout goes through
``int4_linear_q8_tiles_amx`` (``csrc/q8_amx.cpp``): one TDPBSSD per block of 16 x 16 outputs, bit
for bit the VNNI op's outputs. Where it also has AMX-BF16, from ``bf16_amx_min_rows()`` rows the
runtime takes ``int4_linear_bf16_tiles_amx`` instead: the codes unpacked to bf16 tiles, the
activations rounded to bf16 (not int8), TDPBF16PS sums scaled once per group; other numbers,
closer to the float model (``linear_bf16_reference``).

Built with torch.utils.cpp_extension (a C++ compiler and the ``ninja`` package, in the ``dev``
and ``cpu-kernels`` extras; about a minute per level the first time, cached under torch's
extensions directory after). ``unavailable_reason()`` says why none can run (no AVX2, no
compiler, build error); callers then keep torch's kernels.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from . import cpuinfo, reference

CSRC = Path(__file__).with_name("csrc")
# q8_common.h too; paged_attention.cpp and prefill_attention.cpp are compress.kernels.
# cpu_attention's ops,
# elementwise.cpp compress.kernels.cpu_elementwise's, gptq_walk.cpp compress.kernels.cpu_gptq's,
# bf16_linear.cpp compress.kernels.cpu_float's, decode_stack.cpp (calls the others' ops, ops.h)
# compress.runtime.decode_stack's
SOURCES = tuple(
    CSRC / f
    for f in ("q8_dot.cpp", "q8_gemm.cpp", "q8_tiles.cpp", "q8_amx.cpp", "paged_attention.cpp",
              "prefill_attention.cpp", "elementwise.cpp", "gptq_walk.cpp", "bf16_linear.cpp",
              "decode_stack.cpp")
)
BLOCK = 32  # activation block (and code block) width
PAIR = 64  # K must be a multiple of this: the inner loops take two blocks at a time
GEMM_MIN_ROWS = 8  # as csrc/q8_common.h: from this many rows the ops run the row-tile GEMM
TILE = 16  # output columns per tile of the AMX layouts (and of avx512vnni's int4 tiles)
AMX_ISA = "avx512vnni"  # the level whose column tiles the AMX ops extend
# output columns per tile of the column-tile int4 layout (csrc/q8_tiles.cpp), by level: one
# vector of int32 lanes. The avxvnni level keeps the row layout (its tile form is not written).
TILE_WIDTHS: dict[str, int] = {"avx512vnni": 16, "avx2": 8}
ISA_ENV = "COMPRESS_CPU_ISA"
AMX_ENV = "COMPRESS_CPU_AMX"  # "0": keep the VNNI tile op at every row count
# From how many rows the AMX tile op runs. Measured on a Xeon, 2 threads, a 1.1B-shape prefill
# pass (22 layers x 7 projections, g128; scripts/bench_prefill.py, docs/notes/
# 2026-12-04-amx-prefill.md), AMX against VNNI: 16 rows 58.6 / 52.8 ms, 24 rows 81.5 / 74.0,
# 28 rows 83.7 / 86.1, 32 rows 83.0 / 94.3, 256 rows 391 / 637.
AMX_MIN_ROWS = 28

# level -> (CPU flags it needs, compiler flags, the -D switch in q8_dot.cpp); best first
_BASE = ("-O3", "-mavx2", "-mfma", "-fopenmp")
ISA_LEVELS: dict[str, tuple[frozenset[str], tuple[str, ...], str]] = {
    "avx512vnni": (
        frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
        (*_BASE, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
        "COMPRESS_AVX512VNNI",
    ),
    "avxvnni": (
        frozenset({"avx2", "fma", "avx_vnni"}),
        (*_BASE, "-mavxvnni"),
        "COMPRESS_AVXVNNI",
    ),
    "avx2": (frozenset({"avx2", "fma"}), _BASE, "COMPRESS_AVX2"),
}


def supported_levels(flags: frozenset[str]) -> list[str]:
    """The ISA levels a CPU with these flags can run, best first."""
    return [isa for isa, (needs, _, _) in ISA_LEVELS.items() if needs <= flags]


def built_levels() -> list[str]:
    """The levels this CPU has that build and load here, best first (each built once)."""
    return [i for i in supported_levels(cpuinfo.cpu_flags()) if build_reason(i) is None]


@functools.cache
def build_reason(isa: str) -> str | None:
    """Build and load level ``isa`` (at most once); None when its ops are registered, else why
    not (the CPU lacks a flag, no compiler or ninja, build error)."""
    needs, cflags, define = ISA_LEVELS[isa]
    missing = needs - cpuinfo.cpu_flags()
    if missing:
        return f"the CPU does not report {', '.join(sorted(missing))}"
    try:
        from torch.utils import cpp_extension

        build_dir = getattr(cpp_extension, "_get_build_directory", None)  # torch's private helper
        if build_dir is not None:
            _clear_stale_lock(Path(build_dir(f"compress_q8_{isa}", False)))
        cpp_extension.load(
            name=f"compress_q8_{isa}",
            sources=[str(s) for s in SOURCES],
            # -fopenmp: at::parallel_for only spreads over threads when the op is built with
            # OpenMP (measured: without it 2 threads ran no faster than 1)
            # the sources' hash in the flags: torch rebuilds when flags or sources change, and
            # this way also when only the shared header does
            extra_cflags=[
                *cflags,
                f"-D{define}",
                f"-DCOMPRESS_OPS=compress_{isa}",
                f"-DCOMPRESS_CSRC_HASH={_csrc_hash()}",
            ],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001  (no compiler, no ninja, build error: fall back)
        what = f"{type(exc).__name__}: {str(exc)[:300]}"
        return f"building {', '.join(s.name for s in SOURCES)} for {isa} failed: {what}"
    # shapes only, so torch.compile keeps the calls in its graph
    for op in ("int4_linear_q8", "int8_linear_q8"):
        torch.library.register_fake(f"compress_{isa}::{op}")(_fake_linear)
    for op in ("int4_linear_q8_tiles", "int4_linear_q8_tiles_amx", "int4_linear_bf16_tiles_amx"):
        torch.library.register_fake(f"compress_{isa}::{op}")(_fake_tiles_linear)
    torch.library.register_fake(f"compress_{isa}::bf16_linear_tiles_amx")(_fake_bf16_tiles)
    torch.library.register_fake(f"compress_{isa}::bf16_weight_linear")(_fake_bf16_weight)
    torch.library.register_fake(f"compress_{isa}::paged_decode_attention")(_fake_attention)
    torch.library.register_fake(f"compress_{isa}::cache_decode_attention")(_fake_cache_attention)
    torch.library.register_fake(f"compress_{isa}::causal_prefill_attention")(
        _fake_prefill_attention)
    torch.library.register_fake(f"compress_{isa}::rms_norm")(_fake_rms_norm)
    torch.library.register_fake(f"compress_{isa}::rope_qkv")(_fake_rope_qkv)
    torch.library.register_fake(f"compress_{isa}::silu_mul")(_fake_silu_mul)
    torch.library.register_fake(f"compress_{isa}::add_rms_norm")(_fake_add_rms_norm)
    torch.library.register_fake(f"compress_{isa}::greedy_tokens")(_fake_greedy_tokens)
    torch.library.register_fake(f"compress_{isa}::write_kv")(_fake_write_kv)
    torch.library.register_fake(f"compress_{isa}::gptq_walk")(_fake_gptq_walk)
    torch.library.register_fake(f"compress_{isa}::dequantize_int4_exact")(_fake_int4_exact)
    for op, per_byte in (("dequantize_q4", 2), ("dequantize_q8", 1)):
        torch.library.register_fake(f"compress_{isa}::{op}")(_fake_dequantize(per_byte))
    return None


# A build of one level takes about a minute; a lock this old was left by a process that died
# while building (killed, Ctrl-C), and torch would wait on it forever.
STALE_LOCK_SECONDS = 900


def _clear_stale_lock(build_dir: Path, max_age_s: float = STALE_LOCK_SECONDS) -> bool:
    """Remove ``build_dir``'s torch build lock when it is older than ``max_age_s`` (warning
    once); True when one was removed. Measured: a ``.ci/run`` killed while it compiled the avx2
    level left ``lock``, and the next run's tests waited on it without end."""
    import time
    import warnings

    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:  # no lock: the usual case
        return False
    if age < max_age_s:
        return False
    warnings.warn(
        f"removing a stale build lock {lock} ({age / 60:.0f} min old: a build of our kernels "
        "was interrupted); building again",
        RuntimeWarning,
        stacklevel=2,
    )
    lock.unlink(missing_ok=True)
    return True


def _csrc_hash() -> str:
    digest = hashlib.sha1()
    for path in sorted(CSRC.iterdir()):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _fake_linear(x, codes, scales, offsets, group):
    return x.new_empty(x.shape[0], codes.shape[0])


def _fake_tiles_linear(x, codes, scales, offsets, group):
    return x.new_empty(x.shape[0], codes.shape[0] * (codes.shape[2] // 4))


def _fake_bf16_tiles(x, w):
    return x.new_empty(x.shape[0], w.shape[0] * TILE, dtype=torch.float32)


def _fake_bf16_weight(x, w):
    return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32)


def _fake_attention(q, k_pool, v_pool, k_scale, v_scale, tables, lengths, block_size, scale,
                    softcap, window, sinks=None):  # fmt: skip
    return torch.empty_like(q)


def _fake_prefill_attention(q, k, v, scale, offset):
    return q.new_empty(q.shape[1], q.shape[0] * q.shape[2], dtype=torch.float32)


def _fake_cache_attention(q, keys, values, mask, scale, softcap, sinks=None):
    return torch.empty_like(q)


def _fake_rms_norm(x, w, eps, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype)


def _fake_rope_qkv(qkv, cos, sin, heads, kv_heads, q_norm, k_norm, eps):
    d = qkv.shape[1] // (heads + 2 * kv_heads)
    return [qkv.new_empty(qkv.shape[0], n, d) for n in (heads, kv_heads, kv_heads)]


def _fake_silu_mul(gate_up, out_dtype):
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=out_dtype)


def _fake_add_rms_norm(x, y, w, eps, out_dtype):
    return [torch.empty_like(x), x.new_empty(x.shape, dtype=out_dtype)]


def _fake_greedy_tokens(logits):
    return logits.new_empty(logits.shape[0], dtype=torch.long)


def _fake_write_kv(k_pool, v_pool, slots, k, v):
    return None


def _fake_gptq_walk(w, hinv, scales, zeros, codes, err, losses, cols, groups, start, stop,
                    qmin, qmax):
    return None


def _fake_int4_exact(packed, scales, zeros, k, group):
    return scales.new_empty(packed.shape[0], k)


def _fake_dequantize(columns_per_byte: int):
    def fake(codes, scales, offsets, group):
        return scales.new_empty(codes.shape[0], codes.shape[1] * columns_per_byte)

    return fake


def planned_isa() -> str | None:
    """The level ``selected_isa`` will try first, from the flags and ``$COMPRESS_CPU_ISA`` alone
    (builds nothing: for environment lines)."""
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    levels = supported_levels(cpuinfo.cpu_flags())
    return forced or (levels[0] if levels else None)


@functools.cache
def selected_isa() -> str | None:
    """The level this process runs: ``$COMPRESS_CPU_ISA`` when set (it must be one the CPU
    has), else the best level that builds; None when none does (``unavailable_reason``)."""
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced:
        if forced not in ISA_LEVELS:
            raise ValueError(f"{ISA_ENV}={forced!r}: expected one of {list(ISA_LEVELS)}")
        reason = build_reason(forced)
        if reason is not None:
            raise ValueError(f"{ISA_ENV}={forced!r} cannot run here: {reason}; unset it")
        return forced
    for isa in supported_levels(cpuinfo.cpu_flags()):
        if build_reason(isa) is None:
            return isa
    return None


def unavailable_reason() -> str | None:
    """None when a level is built and loaded (``selected_isa``), else why not."""
    if selected_isa() is not None:
        return None
    if not cpuinfo.has_avx2(cpuinfo.cpu_flags()):
        return "the CPU does not report AVX2 (or /proc/cpuinfo is unreadable)"
    return build_reason("avx2")


def ops(isa: str | None = None):
    """The op namespace of level ``isa`` (default: the selected one), built on first use."""
    isa = isa or selected_isa()
    reason = "no level builds here" if isa is None else build_reason(isa)
    if reason is not None:
        raise RuntimeError(f"integer-dot CPU kernels unavailable: {reason or unavailable_reason()}")
    return getattr(torch.ops, f"compress_{isa}")


def classes(isa: str | None = None):
    """The custom-class namespace of level ``isa`` (default: the selected one; csrc/
    decode_stack.cpp's ``DecodeStack``), built on first use."""
    ops(isa)  # builds and loads the level, or says why it cannot
    return getattr(torch.classes, f"compress_{isa or selected_isa()}")


@dataclass(frozen=True)
class Q8Weight:
    """A layer's int4 or int8 weight in the kernels' layout (module docstring)."""

    bits: int  # 4 or 8
    codes: torch.Tensor  # uint8 [N, K/2] (int4) or [N, K] (int8); tiles: [N/W, K/8, 4W]
    scales: torch.Tensor  # fp32 [N, K/g]; tiles: [N/W, K/g, W]
    offsets: torch.Tensor | None  # fp32 [N, K/g], asymmetric weights only (both layouts)
    group_size: int
    tiles: bool = False  # the column-tile int4 layout (``to_tiles``), else rows

    @property
    def n(self) -> int:
        return self.codes.shape[0] * (self.tile_width if self.tiles else 1)

    @property
    def tile_width(self) -> int:
        """Output columns per tile (W: 16 or 8); only for ``tiles``."""
        return self.codes.shape[2] // 4

    @property
    def k(self) -> int:
        if self.tiles:
            return self.codes.shape[1] * 8
        return self.codes.shape[1] * (2 if self.bits == 4 else 1)


def stack(weights: list[Q8Weight]) -> Q8Weight | None:
    """One weight whose output rows are ``weights``' in order (codes, scales and offsets
    concatenated along N), so one call computes all their outputs; None where they differ in
    bits, K, group size or in having offsets. Each output column is its own dot product, so
    its value equals the part's bit for bit."""
    first = weights[0]
    if any(w.tiles for w in weights):
        raise ValueError("stack the row layout, then convert it (to_tiles)")
    key = (first.bits, first.k, first.group_size, first.offsets is None)
    if any((w.bits, w.k, w.group_size, w.offsets is None) != key for w in weights):
        return None
    offsets = None if first.offsets is None else torch.cat([w.offsets for w in weights])
    codes, scales = torch.cat([w.codes for w in weights]), torch.cat([w.scales for w in weights])
    return Q8Weight(first.bits, codes, scales, offsets, first.group_size)


def unsupported_reason(n: int, k: int, group_size: int) -> str | None:
    """Why these kernels cannot take a layer's shape, or None (asked by ``dispatch``)."""
    if k % PAIR:
        return f"K={k} is not a multiple of {PAIR}"
    if group_size % BLOCK:
        return f"group_size {group_size} is not a multiple of {BLOCK}"
    if k % group_size:
        return f"K={k} not divisible by group_size {group_size}"
    return None


def _check(n: int, k: int, group_size: int) -> None:
    reason = unsupported_reason(n, k, group_size)
    if reason is not None:
        raise ValueError(f"integer-dot CPU kernel cannot take this layer: {reason}")


def prepack_int4(
    w_packed: torch.Tensor,
    scales: torch.Tensor,
    zeros_packed: torch.Tensor | None,
    *,
    group_size: int,
    k: int,
) -> Q8Weight:
    """Our packed int4 weight (signed codes, ``w = (w_q - zeros) * scales``) -> kernel layout.

    The layout's byte i of 64 columns pairs columns i and 32 + i; our packed bytes hold columns
    2j and 2j+1 (``reference.int4_bytes``), so the first 16 bytes of every 32 give the even and
    odd output bytes' low nibbles and the next 16 their high ones (``reference.merge_nibbles``):
    byte operations over the packed weight, no int32 codes (``prepack_int4_reference`` widens
    every code to int32: 20x slower, measured)."""
    n = w_packed.shape[0]
    _check(n, k, group_size)
    data = reference.int4_bytes(w_packed, k)
    if data is None:
        return prepack_int4_reference(w_packed, scales, zeros_packed, group_size=group_size, k=k)
    # [N, K/2] -> [N, pairs, first/second 32 columns, 16 bytes of two columns each]
    halves = data.view(n, k // PAIR, 2, BLOCK // 2)
    nibbles = torch.empty(n, k // PAIR, BLOCK // 2, 2, dtype=torch.uint8)
    # in steps of rows whose ops stay under torch's parallel grain, on the calling thread
    # (cpu_native.STEP_BYTES says why)
    step = max(1, (1 << 14) // (k // 4))
    for r0 in range(0, n, step):
        part, out = halves[r0 : r0 + step], nibbles[r0 : r0 + step]
        reference.merge_nibbles(part[:, :, 0], part[:, :, 1], out[..., 0], out[..., 1])
    scales32, zeros = reference.int4_float_parts(scales, zeros_packed, n)
    return _q4_weight(nibbles.view(n, k // 2), scales32, zeros, zeros_packed is None, group_size)


def prepack_int4_reference(
    w_packed: torch.Tensor,
    scales: torch.Tensor,
    zeros_packed: torch.Tensor | None,
    *,
    group_size: int,
    k: int,
) -> Q8Weight:
    """``prepack_int4`` from the unpacked int32 codes: the definition of the layout."""
    n = w_packed.shape[0]
    _check(n, k, group_size)
    codes, scales32, zeros = reference.int4_unsigned_parts(w_packed, scales, zeros_packed, k)
    halves = codes.to(torch.uint8).view(n, k // PAIR, 2, BLOCK)  # [N, pairs, lo/hi, 32]
    nibbles = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    return _q4_weight(nibbles, scales32, zeros, zeros_packed is None, group_size)


def _q4_weight(nibbles, scales32, zeros, symmetric: bool, group_size: int) -> Q8Weight:
    offsets = None if symmetric else (-zeros * scales32).contiguous()
    return Q8Weight(4, nibbles, scales32.contiguous(), offsets, group_size)


def prepack_int8(
    w_q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, *, group_size: int
) -> Q8Weight:
    """Our int8 weight (``w = (w_q - zeros) * scales``, ``w_q`` int8 [N, K], scales and zeros
    [N, K/g]) -> kernel layout."""
    n, k = w_q.shape
    _check(n, k, group_size)
    # code + 128 as uint8 is the code's bits with the sign bit flipped: one byte operation
    codes = w_q.contiguous().view(torch.uint8) ^ 0x80
    scales32 = scales.to(torch.float32).contiguous()
    offsets = None if zeros is None else (-zeros.to(torch.float32) * scales32).contiguous()
    return Q8Weight(8, codes, scales32, offsets, group_size)


def linear_q8(
    x: torch.Tensor, weight: Q8Weight, isa: str | None = None, amx: bool | None = None
) -> torch.Tensor:
    """``x [..., K] @ W.T`` with x rounded to int8 per block, fp32 inside, x's dtype outside;
    ``isa`` picks a level (default: ``selected_isa()``); ``amx`` forces the column-tile op's AMX
    form on or off (default: from ``AMX_MIN_ROWS`` rows where ``amx_reason`` is None)."""
    rows = x.numel() // max(1, x.shape[-1])
    if weight.tiles:
        if amx is None:
            amx = rows >= AMX_MIN_ROWS and amx_reason(isa) is None
        op = ops(isa).int4_linear_q8_tiles_amx if amx else ops(isa).int4_linear_q8_tiles
    else:
        op = ops(isa).int4_linear_q8 if weight.bits == 4 else ops(isa).int8_linear_q8
    x2 = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()
    y = op(x2, weight.codes, weight.scales, weight.offsets, weight.group_size)
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.n)


# From how many rows (tokens of a prompt) an fp32 GEMM of the dequantized weights beats our
# integer GEMM, per level and weight bits; levels and bits not listed never switch. AVX2 without
# VNNI spends four operations per 32 int8 products (the sign trick) and two plus int16 block
# sums per 32 int4 ones, where fp32 needs four FMAs, so from some prompt length a tuned fp32
# GEMM could win even after dequantizing. Measured first on SmolLM2's layers with torch, MKL and
# our kernels capped at AVX2 on a Xeon (docs/notes/2026-12-01-prefill-gemm.md): avx2 int8
# 0.85-0.90x fp32 at 128 rows against 0.95-0.96x dequantized, avx2 int4 at parity from 256
# rows, avxvnni int4 0.90-0.91x against 0.96-1.02x at 512. Since then the row GEMM's steps keep
# their sums in registers (csrc/q8_gemm.cpp's tile: int8 1.12-1.27x, int4 1.71-2.05x at avx2),
# and on the AVX2-only Zen 3 EPYC (scripts/bench_prefill.py --dequant-gemm, 2 threads,
# 2026-12-07) ours beat the dequantized GEMM at every length tried: SmolLM2 int8 at 128 / 256
# / 512 / 1,024 rows 182 / 331 / 691 / 1,274 ms against 339 / 467 / 850 / 1,500, the 1.1B
# shape's int8 at 256 / 1,024 3.2 / 12.7 s against 4.5 / 15.0, SmolLM2 int4 (row layout) at
# 256 / 1,024 322 / 1,040 ms against 434 / 1,787; a whole 1,024-token SmolLM2 W8 prefill, one
# process, 7 rounds alternated: 2,326 ms on the int8 GEMM against 2,776 with the switch at 128
# rows. So avx2 never switches. avxvnni's entry
# predates the rework and was not measured since (no such CPU here). avx512vnni stayed 2.1-2.5x
# fp32 at 512 rows. int4 in column tiles (avx2, avx512vnni) never switches either.
FLOAT_GEMM_MIN_ROWS: dict[str, dict[int, int]] = {"avxvnni": {4: 512}}


def float_gemm_min_rows(isa: str | None, bits: int) -> int | None:
    """Rows from which ``isa``'s layers of ``bits``-bit weights run as an fp32 GEMM of the
    dequantized weights (``dequantize``) instead of the integer GEMM; None: never."""
    return FLOAT_GEMM_MIN_ROWS.get(isa or "", {}).get(bits)


def dequantize(weight: Q8Weight, isa: str | None = None) -> torch.Tensor:
    """The weights as fp32 [N, K], ``(code - bias) * scale + offset``, by level ``isa``."""
    weight = from_tiles(weight) if weight.tiles else weight
    op = ops(isa).dequantize_q4 if weight.bits == 4 else ops(isa).dequantize_q8
    return op(weight.codes, weight.scales, weight.offsets, weight.group_size)


def dequantize_reference(weight: Q8Weight) -> torch.Tensor:
    """``dequantize`` in float64 from the layout, plain torch (for tests)."""
    weight = from_tiles(weight) if weight.tiles else weight
    g = weight.group_size
    w = unpack_codes(weight) * weight.scales.double().repeat_interleave(g, dim=1)
    if weight.offsets is not None:
        w = w + weight.offsets.double().repeat_interleave(g, dim=1)
    return w


def round_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (int8-valued codes [M, K/32, 32], scales [M, K/32, 1]) as the kernels
    round them: scale = amax / 127 in fp32 (1 for an all-zero block), round half to even."""
    blocks = x.to(torch.float32).reshape(x.shape[0], -1, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(blocks / scale), scale


def unpack_codes(weight: Q8Weight) -> torch.Tensor:
    """The signed codes ``code - bias`` as float64 [N, K] (int4: -8..7, int8: -128..127)."""
    if weight.tiles:
        return unpack_codes(from_tiles(weight))
    if weight.bits == 8:
        return weight.codes.to(torch.float64) - 128
    n, k = weight.n, weight.k
    c = weight.codes.view(n, k // PAIR, BLOCK)
    return torch.cat([c & 0xF, c >> 4], dim=-1).reshape(n, k).to(torch.float64) - 8


def linear_q8_reference(x: torch.Tensor, weight: Q8Weight) -> torch.Tensor:
    """The kernels' product in float64 from their layout, plain torch (for tests)."""
    weight = from_tiles(weight) if weight.tiles else weight
    n, k, g = weight.n, weight.k, weight.group_size
    x2 = x.reshape(-1, k).to(torch.float32)
    xq, xscale = round_activations(x2)  # [M, B, 32], [M, B, 1]
    codes = unpack_codes(weight).view(n, k // BLOCK, BLOCK)
    dots = torch.einsum("mbt,nbt->mnb", xq.double(), codes)  # exact integers
    w_scale = weight.scales.double().repeat_interleave(g // BLOCK, dim=1)  # [N, B]
    y = (dots * xscale.double()[:, None, :, 0] * w_scale[None]).sum(-1)
    if weight.offsets is None:
        return y
    xsum = x2.double().view(x2.shape[0], k // g, g).sum(-1)  # [M, K/g], from the exact x
    return y + xsum @ weight.offsets.double().T


def linear_bf16_reference(x: torch.Tensor, weight: Q8Weight) -> torch.Tensor:
    """``int4_linear_bf16_tiles_amx``'s product in float64, plain torch (for tests): x rounded
    to bf16 times the weights ``(code - 8) * scale``, plus the offsets' term from the unrounded
    x's group sums (as ``linear_q8_reference``). Up to ``BF16_WHOLE_MIN_ROWS - 1`` rows the
    weights are exact and each group's sums are scaled; from ``BF16_WHOLE_MIN_ROWS`` rows the op
    rounds each weight to fp32, then bf16 (the scales folded into its tiles, one sum over K)."""
    weight = from_tiles(weight) if weight.tiles else weight
    k, g = weight.k, weight.group_size
    x2 = x.reshape(-1, k)
    scales = weight.scales.repeat_interleave(g, dim=1)
    if x2.shape[0] >= BF16_WHOLE_MIN_ROWS:
        w = (unpack_codes(weight).float() * scales.float()).bfloat16().double()
    else:
        w = unpack_codes(weight) * scales.double()
    y = x2.to(torch.bfloat16).double() @ w.T
    if weight.offsets is None:
        return y
    xsum = x2.float().double().view(x2.shape[0], k // g, g).sum(-1)
    return y + xsum @ weight.offsets.double().T


@functools.cache
def amx_reason(isa: str | None = None) -> str | None:
    """Why the AMX form of the column-tile op does not run at level ``isa`` (default: the
    selected one), or None when it does."""
    isa = isa or selected_isa()
    if isa != AMX_ISA:
        return f"the AMX op extends the {AMX_ISA} level's tiles (here: {isa})"
    if os.environ.get(AMX_ENV, "").strip() == "0":
        return f"{AMX_ENV}=0"
    missing = {"amx_tile", "amx_int8"} - cpuinfo.cpu_flags()
    if missing:
        return f"the CPU does not report {', '.join(sorted(missing))}"
    if not ops(isa).amx_ready():
        return (
            "the kernels were built without AMX intrinsics (GCC before 11) or Linux did not grant "
            "the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
        )
    return None


# From how many rows the runtime's int4 column-tile layers take the AMX-BF16 op (bf16
# activations, no int8 rounding; ``int4_linear_bf16_tiles_amx``), where ``amx_bf16_reason`` is
# None; ``$COMPRESS_CPU_BF16_ROWS`` overrides it (0: never). Its fixed cost is unpacking the
# codes to bf16 (four bytes stored per byte of codes), so one-row decode stays on the VNNI op.
# Measured on a Xeon, 2 threads, one prefill pass of a shape's layers, weights from DRAM
# (``scripts/bench_prefill.py --only "column tiles"``, medians of 5, 2026-12-05, with the codes
# prefetched two groups ahead), VNNI / AMX-BF16 ms: the 1.1B shape (g128) at 4 rows 32.1 /
# 39.3, 8 rows 37.1 / 39.2, 10 rows 44.6 / 41.0, 12 rows 50.3 / 40.8, 16 rows 61.4 / 43.1;
# SmolLM2's (g64) at 8 rows 8.2 / 7.5, 10 rows 9.1 / 8.2, 12 rows 9.8 / 8.2, 16 rows 11.5 / 8.9.
BF16_AMX_MIN_ROWS = 10
BF16_ROWS_ENV = "COMPRESS_CPU_BF16_ROWS"
# From how many rows (more than one pair of 16-row tiles) ``int4_linear_bf16_tiles_amx`` folds
# the weight scales into its bf16 tiles (each weight rounded to bf16, as a dequantize-then-bf16
# GEMM does) and sums all of K in the tile unit; below, the codes stay exact and each group's
# sums leave the tiles to be scaled. The constant of csrc/q8_amx.cpp's op, not a setting.
BF16_WHOLE_MIN_ROWS = 33


def bf16_amx_min_rows(isa: str | None = None) -> int | None:
    """The row count from which int4 column-tile layers run the AMX-BF16 op at level ``isa``
    (default: the selected one); None where it does not run (``amx_bf16_reason``) or
    ``$COMPRESS_CPU_BF16_ROWS`` is 0."""
    if amx_bf16_reason(isa) is not None:
        return None
    rows = _bf16_rows_override()
    return BF16_AMX_MIN_ROWS if rows is None else (rows or None)


@functools.cache
def _bf16_rows_override() -> int | None:
    raw = os.environ.get(BF16_ROWS_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ValueError(f"{BF16_ROWS_ENV}={raw!r}: expected a row count (0: never)")
    return int(raw)


@functools.cache
def amx_bf16_reason(isa: str | None = None) -> str | None:
    """Why the AMX-BF16 column-tile op (``int4_linear_bf16_tiles_amx``: bf16 activations) does
    not run at level ``isa`` (default: the selected one), or None when it does."""
    reason = amx_reason(isa)
    if reason is not None:
        return reason
    if "amx_bf16" not in cpuinfo.cpu_flags() or not ops(isa).amx_bf16_ready():
        return "the CPU does not report amx_bf16"
    return None


def bf16_tiles_reason(w: torch.Tensor) -> str | None:
    """Why a dense weight does not run as our AMX-BF16 tiles (``bf16_to_tiles``,
    ``bf16_linear_tiles_amx``) in this process, or None."""
    if w.dtype != torch.bfloat16 or w.dim() != 2 or w.device.type != "cpu":
        return "a 2-D bf16 weight on the CPU runs there"
    if w.shape[0] % TILE or w.shape[1] % BLOCK:
        return f"[N, K] = {list(w.shape)}: N must be a multiple of {TILE}, K of {BLOCK}"
    if unavailable_reason() is not None:
        return unavailable_reason()
    return amx_bf16_reason()


def bf16_to_tiles(w: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] -> [N/16, K/2, 32], AMX-BF16's B-tile order: element 2c + i of row r of
    tile t is w[16t + c, 2r + i] (``bf16_linear_tiles_amx`` reads 16 such rows per tile)."""
    n, k = w.shape
    tiles = w.view(n // TILE, TILE, k // 2, 2).permute(0, 2, 1, 3)
    return tiles.reshape(n // TILE, k // 2, 32).contiguous()


def tile_width(isa: str | None) -> int | None:
    """Output columns per tile of level ``isa``'s column-tile op, or None where it has none."""
    return TILE_WIDTHS.get(isa or "")


def tiles_reason(weight: Q8Weight, isa: str | None) -> str | None:
    """Why ``weight`` does not go to the column-tile layout at level ``isa``, or None."""
    width = tile_width(isa)
    if width is None:
        return f"the column-tile op exists at the {', '.join(TILE_WIDTHS)} levels (here: {isa})"
    if weight.bits != 4:
        return "int8 weights keep the row layout"
    if weight.n % width:
        return f"N={weight.n} is not a multiple of {width}"
    return None


def to_tiles(weight: Q8Weight, width: int = TILE, reference: bool = False) -> Q8Weight:
    """Row-layout int4 -> the column-tile layout of csrc/q8_tiles.cpp with ``width`` (W: 16 or
    8, ``tile_width`` of the level that runs it) columns a tile: codes [N/W, K/8, 4W], byte
    4c+i of tile t, step j = (code of column Wt+c at k = 8j+i) | (at k = 8j+4+i) << 4; scales
    [N/W, K/g, W]; offsets stay [N, K/g]. The codes move in one C++ pass where our kernels are
    built (``int4_to_tiles``: 0.7 ns a weight at a 7B down_proj), else, or with ``reference``,
    by the torch byte operations below that define the layout (4.0 ns; both measured beside a
    test suite)."""
    if width not in (8, 16):
        raise ValueError(f"to_tiles: width must be 8 or 16, not {width}")
    if weight.tiles or weight.bits != 4 or weight.n % width:
        raise ValueError(f"to_tiles takes row-layout int4 with N a multiple of {width}")
    n, k, g = weight.n, weight.k, weight.scales.shape[1]
    if not reference and unavailable_reason() is None:
        tiles = ops().int4_to_tiles(weight.codes.contiguous(), width)
    else:
        c = weight.codes.view(n, k // PAIR, BLOCK)  # byte i of pair p: column 64p+i | 64p+32+i
        codes = torch.cat([c & 0xF, c >> 4], dim=-1).view(n // width, width, k // 8, 2, 4)
        packed = codes[:, :, :, 0] | (codes[:, :, :, 1] << 4)  # [T, W, K/8, 4]
        tiles = packed.permute(0, 2, 1, 3).reshape(n // width, k // 8, 4 * width).contiguous()
    scales = weight.scales.view(n // width, width, g).transpose(1, 2).contiguous()
    return Q8Weight(4, tiles, scales, weight.offsets, weight.group_size, tiles=True)


def to_tiles_reference(weight: Q8Weight, width: int = TILE) -> Q8Weight:
    """``to_tiles`` by its torch definition (for tests)."""
    return to_tiles(weight, width, reference=True)


def from_tiles(weight: Q8Weight, reference: bool = False) -> Q8Weight:
    """The column-tile layout back to rows (``to_tiles`` inverted, exactly; ``int4_from_tiles``
    where our kernels are built, else, or with ``reference``, torch byte operations)."""
    t, steps, _ = weight.codes.shape
    width = weight.tile_width
    n, k, g = t * width, steps * 8, weight.scales.shape[1]
    if not reference and unavailable_reason() is None:
        rows = ops().int4_from_tiles(weight.codes.contiguous())
    else:
        b = weight.codes.view(t, steps, width, 4).permute(0, 2, 1, 3)  # [T, W, K/8, 4]
        codes = torch.stack([b & 0xF, b >> 4], dim=3).reshape(n, k // PAIR, 2, BLOCK)
        rows = (codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    scales = weight.scales.transpose(1, 2).reshape(n, g).contiguous()
    return Q8Weight(4, rows, scales, weight.offsets, weight.group_size)


def from_tiles_reference(weight: Q8Weight) -> Q8Weight:
    """``from_tiles`` by its torch definition (for tests)."""
    return from_tiles(weight, reference=True)
