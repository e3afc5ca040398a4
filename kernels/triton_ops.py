"""Glue between ``QuantLinear`` / ``dispatch`` and the Triton kernels.

``dispatch`` asks ``unsupported_reason`` whether a layer can run here; ``QuantLinear`` calls the
``*_linear`` functions with 2-D activations. These make activations contiguous (a free view in
the model path), pick the tuned config list of the current GPU (``load_tuned_configs``) and call
the launchers in ``int4_gemm`` / ``int8_gemm``, which check everything else.
The kernel modules are imported on first use, so importing this module never imports triton.
"""

from __future__ import annotations

import functools
import json
from importlib import resources

import torch

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
) -> torch.Tensor:
    """W4A16 ``x [M, K] @ W.T -> [M, N]`` (layout in ``int4_gemm``), x's dtype."""
    from . import int4_gemm

    x = x.contiguous()
    path = "int4_decode" if int4_gemm.is_decode(x.shape[0]) else "int4_gemm"
    config = _tuned_list(x.device, path)
    return int4_gemm.int4_gemm_triton(
        x, w_packed, scales, zeros, group_size=group_size, config=config
    )


def int8_linear(
    x: torch.Tensor, w_q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None
) -> torch.Tensor:
    """W8A16 ``x [M, K] @ ((w_q - zeros) * scales).T -> [M, N]``, x's dtype."""
    from . import int4_gemm, int8_gemm

    x = x.contiguous()
    path = "int8_decode" if int4_gemm.is_decode(x.shape[0]) else "int8_gemm"
    config = _tuned_list(x.device, path)
    return int8_gemm.int8_weight_gemm_triton(x, w_q, scales, zeros, config=config)


def int8_int8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scales: torch.Tensor) -> torch.Tensor:
    """W8A8 with dynamic per-token activation quantization: ``x [M, K]`` float, ``w_q [N, K]``
    int8, ``w_scales [N, 1]`` -> ``[M, N]`` in x's dtype (two launches: quantize, GEMM)."""
    from . import int4_gemm, int8_gemm

    x_q, x_scales = int8_gemm.quantize_per_token_triton(x.contiguous())
    path = "int8_decode" if int4_gemm.is_decode(x.shape[0]) else "int8_gemm"
    config = _tuned_list(x.device, path)
    return int8_gemm.int8_int8_gemm_triton(
        x_q, x_scales, w_q, w_scales, out_dtype=x.dtype, config=config
    )


def config_files() -> list[str]:
    """Names of the shipped tuned-config files (``kernels/configs/*.json``)."""
    folder = resources.files(__package__) / "configs"
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".json"))


def read_config_file(name: str) -> dict:
    """The parsed JSON of one tuned-config file, checked for the expected keys."""
    data = json.loads((resources.files(__package__) / "configs" / name).read_text())
    missing = [key for key in ("match", "shared_memory_bytes", *CONFIG_LISTS) if key not in data]
    if missing:
        raise ValueError(f"kernels/configs/{name} lacks keys {missing}")
    for key in CONFIG_LISTS:
        for entry in data[key]:
            if sorted(entry) != sorted((*META_KEYS, "num_warps", "num_stages")):
                raise ValueError(
                    f"kernels/configs/{name} {key}: entry {entry} needs exactly the keys "
                    f"{META_KEYS} + num_warps, num_stages"
                )
    return data


def load_tuned_configs(gpu_name: str) -> dict[str, list] | None:
    """Tuned ``triton.Config`` lists for the GPU called ``gpu_name`` (as
    ``torch.cuda.get_device_name`` spells it), keyed by ``CONFIG_LISTS``; None if no file in
    ``kernels/configs/`` matches it (the launchers then use their generic lists)."""
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
