"""Glue between ``QuantLinear`` / ``dispatch`` and the Triton kernels.

``dispatch`` asks ``unsupported_reason`` whether a layer can run here; ``QuantLinear`` calls the
``*_linear`` functions with 2-D activations. Per call they pick the kernel for this (shape, M)
from the GPU's measured table (``kernel_table.choose``, memoized: one dict lookup on the hot
path): the split-K GEMV of ``gemv`` for M <= 4, the GEMMs of ``int4_gemm`` / ``int8_gemm``
(with the tuned config lists of ``load_tuned_configs``), or, with ``kernel="auto"``, torch's
``_weight_int4pack_mm`` / ``_int_mm``. The launchers check everything else.
The kernel modules are imported on first use, so importing this module never imports triton.
"""

from __future__ import annotations

import functools
import json
from importlib import resources

import torch

from . import kernel_table, reference

OPS = ("int4", "int8")
# keys of a tuned-config file: kernel list name -> launcher path
CONFIG_LISTS = ("int4_gemm", "int4_decode", "int8_gemm", "int8_decode")
META_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "GROUP_M")
MIN_CAPABILITY = (8, 0)  # bf16 and the tuned tile shapes assume Ampere or newer


def unsupported_reason(
    op: str, *, device: torch.device, n: int, k: int, group_size: int, symmetric: bool
) -> str | None:
    """Why the Triton kernel for ``op`` ("int4" or "int8") cannot run this layer, or None.

    ``symmetric`` is accepted for the dispatch signature: both kernels take zero points.
    """
    from . import int4_gemm

    if op not in OPS:
        return f"unknown op {op!r}; expected one of {OPS}"
    interpreted = int4_gemm.is_interpreted()
    if device.type == "cuda":
        if interpreted:
            return "TRITON_INTERPRET=1 is set: the kernels only run on CPU tensors"
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            return f"compute capability {capability} < {MIN_CAPABILITY}"
    elif not (device.type == "cpu" and interpreted):
        return (
            f"device {device} is not CUDA (set TRITON_INTERPRET=1 before importing "
            "compress.kernels to run the kernels on CPU in the interpreter, slowly)"
        )
    if n <= 0 or k <= 0:
        return f"empty layer N={n} K={k}"
    if op == "int4" or group_size != k:
        # grouped int8 uses the same per-tile scale logic, with BLOCK_K >= 32 for int8 dots
        reason = int4_gemm.group_reason(k, group_size)
        if reason is None and op == "int8" and group_size % 32:
            reason = f"grouped int8 needs group_size % 32 == 0, got {group_size}"
        return reason
    return None


def int4_linear(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    *,
    group_size: int,
    kernel: str = "triton",
    cache: dict | None = None,
) -> torch.Tensor:
    """W4A16 ``x [M, K] @ W.T -> [M, N]`` (layout in ``int4_gemm``), x's dtype.

    ``kernel``: "triton" runs our kernels (the GEMV up to ``gemv.GEMV_MAX_M`` rows, else the
    GEMM), the one of the two ``kernel_table.choose`` picks; "auto" lets it pick torch's
    ``_weight_int4pack_mm`` too, whose repacked weight is made once into ``cache`` (the
    caller's per-layer dict, e.g. ``QuantLinear._prepared``); without ``cache`` torch's kernel
    is not a candidate (it would repack per call)."""
    x = x.contiguous()
    n, k = w_packed.shape[0], x.shape[1]
    allowed = TRITON_ONLY if kernel == "triton" or cache is None else ALL_KERNELS
    choice = _choice("int4", x.device, x.dtype, n, k, group_size, x.shape[0], allowed)
    if choice.kernel == "triton_gemv":
        from . import gemv

        return gemv.int4_gemv_triton(x, w_packed, scales, zeros, group_size=group_size,
                                     config=_gemv_config(choice))  # fmt: skip
    if choice.kernel == "torch_int4pack":
        assert cache is not None, "torch_int4pack is allowed only with a cache"
        if "int4pack" not in cache:
            cache["int4pack"] = prepare_int4pack(w_packed, scales, zeros, group_size=group_size)
        packed, scale_and_zero = cache["int4pack"]
        return torch._weight_int4pack_mm(x, packed, group_size, scale_and_zero)
    from . import int4_gemm

    path = "int4_decode" if int4_gemm.is_decode(x.shape[0]) else "int4_gemm"
    return int4_gemm.int4_gemm_triton(
        x, w_packed, scales, zeros, group_size=group_size, config=_tuned_list(x.device, path)
    )


def int8_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    *,
    kernel: str = "triton",
) -> torch.Tensor:
    """W8A16 ``x [M, K] @ ((w_q - zeros) * scales).T -> [M, N]``, x's dtype; ``kernel`` as in
    ``int4_linear`` (both kernels are ours here: torch has no CUDA int8 weight-only GEMM)."""
    x = x.contiguous()
    n, k, groups = w_q.shape[0], x.shape[1], scales.shape[1]
    choice = _choice("int8", x.device, x.dtype, n, k, k // groups, x.shape[0], TRITON_ONLY)
    if choice.kernel == "triton_gemv":
        from . import gemv

        return gemv.int8_gemv_triton(x, w_q, scales, zeros, config=_gemv_config(choice))
    from . import int4_gemm, int8_gemm

    path = "int8_decode" if int4_gemm.is_decode(x.shape[0]) else "int8_gemm"
    config = _tuned_list(x.device, path)
    return int8_gemm.int8_weight_gemm_triton(x, w_q, scales, zeros, config=config)


def int8_int8_linear(
    x: torch.Tensor, w_q: torch.Tensor, w_scales: torch.Tensor, *, kernel: str = "triton"
) -> torch.Tensor:
    """W8A8 with dynamic per-token activation quantization: ``x [M, K]`` float, ``w_q [N, K]``
    int8, ``w_scales [N, 1]`` -> ``[M, N]`` in x's dtype (two launches: quantize, GEMM; the
    GEMV's split-K reduce makes three). ``kernel="auto"`` may pick ``torch._int_mm`` (M > 16)."""
    from . import int8_gemm

    x_q, x_scales = int8_gemm.quantize_per_token_triton(x.contiguous())
    (m, k), n = x.shape, w_q.shape[0]
    allowed = TRITON_ONLY if kernel == "triton" else ALL_KERNELS
    choice = _choice("w8a8", x.device, x.dtype, n, k, k, m, allowed)
    if choice.kernel == "triton_gemv":
        from . import gemv

        return gemv.int8_int8_gemv_triton(x_q, x_scales, w_q, w_scales, out_dtype=x.dtype,
                                          config=_gemv_config(choice))  # fmt: skip
    if choice.kernel == "torch_int_mm":
        acc = torch._int_mm(x_q, w_q.t())  # [M, N] int32, exact
        return (acc.to(torch.float32) * x_scales * w_scales.to(torch.float32).t()).to(x.dtype)
    from . import int4_gemm

    path = "int8_decode" if int4_gemm.is_decode(m) else "int8_gemm"
    return int8_gemm.int8_int8_gemm_triton(
        x_q, x_scales, w_q, w_scales, out_dtype=x.dtype, config=_tuned_list(x.device, path)
    )


# ---- the per-call kernel choice (kernel_table) and torch's int4 layout -----------------------
TRITON_ONLY = kernel_table.TRITON_KERNELS
ALL_KERNELS = kernel_table.KERNELS


@functools.lru_cache(maxsize=4096)
def _choice(op, device, x_dtype, n, k, group_size, m, allowed) -> kernel_table.Choice:
    """``kernel_table.choose`` for one call, memoized: the hot path pays one dict lookup."""
    table = None
    if device.type == "cuda":
        table = kernel_table.load_table(_device_name(device.index or 0))
    sizes = dict(op=op, n=n, k=k, group_size=group_size, m=m)
    return kernel_table.choose(
        table, **sizes, device_type=device.type, x_dtype=x_dtype, allowed=allowed
    )


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.lru_cache(maxsize=256)
def _gemv_config(choice: kernel_table.Choice):
    """The table's GEMV config as a ``triton.Config``; None (tune in process) without one."""
    if choice.config is None:
        return None
    from . import gemv

    c = dict(choice.config)
    return gemv.gemv_config(c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"], c["num_warps"],
                            c["num_stages"])  # fmt: skip


def int4pack_parts(
    w_packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, *, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our packed int4 weight in the form torch's int4 kernels take, before their repack:
    ``(q uint8 [N, K / 2]`` with code pairs (even k in the high nibble, odd k low), each
    ``q = w_q + 8``; ``scale_and_zero [K / g, N, 2]`` in the scales' dtype)``. torch computes
    ``w = (q - 8) * s + z``; ours is ``(w_q - zero) * s``, so ``z = -zero * s``."""
    n = w_packed.shape[0]
    k = w_packed.shape[1] * 8
    codes = reference.unpack_int4(w_packed, k).to(torch.int32) + 8  # [N, K] in 0..15
    pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).contiguous()  # [N, K / 2]
    s = scales.to(torch.float32)
    z = torch.zeros_like(s)
    if zeros is not None:
        z = -reference.unpack_int4(zeros, n, dim=0).to(torch.float32) * s
    sz = torch.stack([s.t(), z.t()], dim=-1).to(scales.dtype).contiguous()  # [K / g, N, 2]
    return pairs, sz


def prepare_int4pack(
    w_packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, *, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, scale_and_zero)`` for ``torch._weight_int4pack_mm`` on CUDA (bf16 scales and
    activations), made once per layer. Needs ``kernel_table.runs(..., "torch_int4pack")``."""
    pairs, sz = int4pack_parts(w_packed, scales.to(torch.bfloat16), zeros, group_size=group_size)
    inner = kernel_table.int4pack_inner_k_tiles(pairs.shape[1] * 2)
    return torch._convert_weight_to_int4pack(pairs, inner), sz


def config_files() -> list[str]:
    """Names of the shipped tuned-config files (``compress/kernels/configs/*.json``)."""
    folder = resources.files(__package__) / "configs"
    names = (p.name for p in folder.iterdir() if p.name.endswith(".json"))
    return sorted(name for name in names if name != kernel_table.TABLE_FILE)


def read_config_file(name: str) -> dict:
    """The parsed JSON of one tuned-config file, checked for the expected keys."""
    data = json.loads((resources.files(__package__) / "configs" / name).read_text())
    missing = [key for key in ("match", "shared_memory_bytes", *CONFIG_LISTS) if key not in data]
    if missing:
        raise ValueError(f"compress/kernels/configs/{name} lacks keys {missing}")
    for key in CONFIG_LISTS:
        for entry in data[key]:
            if sorted(entry) != sorted((*META_KEYS, "num_warps", "num_stages")):
                raise ValueError(
                    f"compress/kernels/configs/{name} {key}: entry {entry} needs exactly the keys "
                    f"{META_KEYS} + num_warps, num_stages"
                )
    return data


def load_tuned_configs(gpu_name: str) -> dict[str, list] | None:
    """Tuned ``triton.Config`` lists for the GPU called ``gpu_name`` (as
    ``torch.cuda.get_device_name`` spells it), keyed by ``CONFIG_LISTS``; None if no file in
    ``compress/kernels/configs/`` matches it (the launchers then use their generic lists)."""
    import triton

    for name in config_files():
        data = read_config_file(name)
        if any(pattern in gpu_name for pattern in data["match"]):
            return {
                key: [
                    triton.Config(
                        {meta: entry[meta] for meta in META_KEYS},
                        num_warps=entry["num_warps"],
                        num_stages=entry["num_stages"],
                    )
                    for entry in data[key]
                ]
                for key in CONFIG_LISTS
            }
    return None


@functools.cache
def _tuned_for_device(index: int) -> dict[str, list] | None:
    return load_tuned_configs(torch.cuda.get_device_name(index))


def _tuned_list(device: torch.device, path: str) -> list | None:
    """The tuned list for ``path`` on a CUDA device, None on CPU (interpreter) or unknown GPUs."""
    if device.type != "cuda":
        return None
    tuned = _tuned_for_device(device.index if device.index is not None else 0)
    return None if tuned is None else tuned[path]


# ---- offline compilation (no GPU needed; run in a process WITHOUT TRITON_INTERPRET) ----------
# kernel variant -> (module, kernel attribute, fixed flags); every variant the launchers use
COMPILE_VARIANTS = {
    "int4_gemm": ("int4_gemm", "_int4_gemm_kernel", {"HAS_ZEROS": True, "ATOMIC_OUT": False}),
    "int4_decode": ("int4_gemm", "_int4_gemm_kernel", {"HAS_ZEROS": True, "ATOMIC_OUT": True}),
    "int8_gemm": (
        "int8_gemm",
        "_int8_gemm_kernel",
        {"A_INT8": True, "HAS_ZEROS": False, "ATOMIC_OUT": False},
    ),
    "int8_decode": (
        "int8_gemm",
        "_int8_gemm_kernel",
        {"A_INT8": False, "HAS_ZEROS": True, "ATOMIC_OUT": True},
    ),
    "quantize_per_token": ("int8_gemm", "_quantize_per_token_kernel", {}),
    # the decode GEMVs, at M = 1 (BLOCK_M 1); BLOCK_M is a flag here, not a config key
    "int4_gemv": ("gemv", "_int4_gemv_kernel", {"HAS_ZEROS": True, "HAS_BIAS": False}),
    "int8_gemv": (
        "gemv",
        "_int8_gemv_kernel",
        {"A_INT8": False, "GROUPED": False, "HAS_ZEROS": False, "HAS_BIAS": False},
    ),
    "w8a8_gemv": (
        "gemv",
        "_int8_gemv_kernel",
        {"A_INT8": True, "GROUPED": False, "HAS_ZEROS": False, "HAS_BIAS": False},
    ),
}
# Strides equal to 1 and sizes divisible by 16 are what a launch with contiguous tensors sees:
# triton specializes both, so the offline build must too to produce the same code.
_UNIT_STRIDES = ("stride_xk", "stride_wk", "stride_sg", "stride_zg", "stride_on")
_POINTER_TYPES = {"x_ptr": "*fp16", "w_ptr": "*i32", "scales_ptr": "*fp16", "zeros_ptr": "*i32",
                  "x_scales_ptr": "*fp32", "out_ptr": "*fp16", "x_q_ptr": "*i8",
                  "bias_ptr": "*fp16"}  # fmt: skip


def _gemv_types(variant: str, split_k: int) -> dict[str, str]:
    """Pointer types of a GEMV launch: int8 weights for the int8 kernels, int8 x for W8A8, and
    fp32 (int32 for W8A8) partials when split-K stores them instead of y."""
    types = dict(_POINTER_TYPES)
    if variant != "int4_gemv":
        types.update(w_ptr="*i8", zeros_ptr="*i8")
    if variant == "w8a8_gemv":
        types["x_ptr"] = "*i8"
    if split_k > 1:
        types["out_ptr"] = "*i32" if variant == "w8a8_gemv" else "*fp32"
    return types


def compile_offline(
    variant: str, config, *, group_size: int = 128, arch: int = 90, block_m: int = 1
) -> dict:
    """Compile one kernel variant with one ``triton.Config`` for ``sm_<arch>`` without a GPU.

    Returns ``{"registers", "shared_bytes", "spill_bytes", "stack_bytes", "wgmma"}``, read from
    the cubin with the wheel's ``cuobjdump`` (spills are local memory per thread).
    """
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, attr, flags = COMPILE_VARIANTS[variant]
    fn = getattr(importlib.import_module(f".{module}", __package__), attr)
    if not isinstance(fn, triton.runtime.JITFunction):
        raise RuntimeError("compile_offline needs a process without TRITON_INTERPRET=1")
    int8_x = flags.get("A_INT8", False)
    # BLOCK_M: the GEMMs' comes from their config, the GEMV's (M rounded up) from block_m
    constexprs = {"GROUPED": False, "BLOCK_M": block_m, **flags, **config.kwargs,
                  "GROUP_SIZE": group_size, "DOT_FP32": False,
                  **dict.fromkeys(_UNIT_STRIDES, 1)}  # fmt: skip
    types = dict(_POINTER_TYPES, w_ptr="*i8" if module == "int8_gemm" else "*i32")
    if module == "gemv":
        types = _gemv_types(variant, config.kwargs["SPLIT_K"])
    if int8_x:
        types["x_ptr"] = "*i8"
    if flags.get("ATOMIC_OUT") or int8_x:
        types["out_ptr"] = "*fp32"
    if module == "int8_gemm":
        types["zeros_ptr"] = "*i8"
    names = fn.arg_names
    constexprs = {n: v for n, v in constexprs.items() if n in names}
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    aligned = [n for n in names if n not in constexprs and n not in ("M", "m_bucket")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    compiled = triton.compile(
        ASTSource(fn, signature, constexprs, attrs),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": config.num_warps, "num_stages": config.num_stages},
    )
    usage = _cubin_resource_usage(compiled.asm["cubin"])
    return {
        "registers": usage["REG"],
        "shared_bytes": int(compiled.metadata.shared),
        "spill_bytes": usage["LOCAL"],
        "stack_bytes": usage["STACK"],
        "wgmma": "wgmma" in compiled.asm["ptx"],
    }


def _cubin_resource_usage(cubin: bytes) -> dict[str, int]:
    """``REG``, ``STACK``, ``LOCAL``... of the single function in ``cubin`` (cuobjdump)."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        text = subprocess.run(
            [tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True
        ).stdout
    fields = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {key: int(value) for key, value in fields.items()}


# ---- benchmarking (CUDA only; scripts/bench_kernels.py prints and saves the results) -------
def measure_peaks(device: torch.device) -> dict[str, float]:
    """Measured copy bandwidth (GB/s, 1 GiB device-to-device) and bf16 matmul TFLOP/s
    (8192^3, cuBLAS) of ``device``: the denominators of the benchmark's percentages."""
    import triton.testing

    src = torch.empty(2**29, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    mm_ms = triton.testing.do_bench(lambda: a @ a, return_mode="median")
    return {"copy_gbs": 2 * src.nbytes / copy_ms / 1e6, "bf16_tflops": 2 * 8192**3 / mm_ms / 1e9}


def benchmark_linear(m: int, n: int, k: int, *, group_size: int = 128, device="cuda") -> list:
    """Median ms, TFLOP/s and GB/s of ``[M, K] x [N, K]^T`` for our kernels and torch's
    (bf16 cuBLAS, ``_weight_int4pack_mm``, ``_int_mm``); methods that cannot take the shape
    are reported with ``ms=None`` and the reason."""
    import triton.testing

    from . import reference

    x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    w = torch.randn(n, k, dtype=torch.bfloat16, device=device) * 0.02
    codes = torch.randint(-8, 8, (n, k), dtype=torch.int8, device=device)
    w_packed = reference.pack_int4(codes.cpu()).to(device)
    scales = torch.full((n, k // group_size), 0.01, dtype=torch.bfloat16, device=device)
    w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device)
    s8 = torch.full((n, 1), 0.01, dtype=torch.bfloat16, device=device)
    x8 = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=device)
    act, out = 2 * m * k, 2 * m * n  # bf16 activation and output bytes
    methods = {  # name -> (callable or reason, bytes moved)
        "torch_bf16": (lambda: x @ w.t(), 2 * n * k + act + out),
        "triton_w4a16": (
            lambda: int4_linear(x, w_packed, scales, None, group_size=group_size),
            n * k // 2 + scales.nbytes + act + out,
        ),
        "triton_w8a16": (lambda: int8_linear(x, w8, s8, None), n * k + act + out),
        "triton_w8a8": (lambda: int8_int8_linear(x, w8, s8), n * k + act + out),
    }
    if k % (8 * 16) == 0 and n % 8 == 0 and group_size in (32, 64, 128, 256):
        # torch's layout: byte pairs (hi, lo) of q = code + 8 in 0..15; w = (q - 8) * s + z
        q = (codes.to(torch.int32) + 8).to(torch.uint8)
        packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), 8)
        sz = torch.stack([scales.t(), torch.zeros_like(scales.t())], dim=-1).contiguous()
        fn = lambda: torch._weight_int4pack_mm(x, packed, group_size, sz)  # noqa: E731
        methods["torch_int4pack"] = (fn, n * k // 2 + sz.nbytes + act + out)
    else:
        methods["torch_int4pack"] = ("needs K % 128 == 0, N % 8 == 0", 0)
    if m > 16 and k % 8 == 0 and n % 8 == 0:
        methods["torch_int_mm"] = (lambda: torch._int_mm(x8, w8.t()), n * k + m * k + 4 * m * n)
    else:
        methods["torch_int_mm"] = ("needs M > 16 and K, N multiples of 8", 0)
    rows = []
    for name, (fn, nbytes) in methods.items():
        if isinstance(fn, str):
            rows.append({"method": name, "ms": None, "reason": fn})
            continue
        ms = triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")
        rows.append({"method": name, "ms": ms, "tflops": 2 * m * n * k / ms / 1e9,
                     "gbs": nbytes / ms / 1e6})  # fmt: skip
    return rows
