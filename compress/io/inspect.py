"""``compress inspect``: per-layer formats, schemes, group sizes, shapes and bytes of a
checkpoint, without loading the model (reads config.json and the safetensors headers).

Layers are listed in natural order (``layers.2`` before ``layers.10``). A quantized layer's group
size comes from its tensor shapes (``weight_scale`` holds one column per group), its bits and
symmetry from the format and the presence of ``weight_zero_point``, and its activation
quantization from the matching ``quantization_config`` group.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from safetensors import safe_open

from compress.core.errors import ModelLoadError

_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "I64": 8, "I8": 1, "U8": 1, "BOOL": 1}
_QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


def natural_key(name: str) -> list[Any]:
    """Sort key that orders digit runs by value: ``layers.2`` before ``layers.10``."""
    # re.split with a group alternates text and digits, so items at one index compare alike
    return [int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", name))]


def _config_group(module: str, quant: dict[str, Any]) -> dict[str, Any] | None:
    """The compressed-tensors config group that covers ``module`` (its exact name, a ``re:``
    pattern or ``Linear``), None when ignored."""
    from compress.io.checkpoint import config_group_for

    if module in (quant.get("ignore") or []):
        return None
    return config_group_for(quant, module)


def _bits(module: str, quant: dict[str, Any]) -> int:
    """A packed layer's bits, from its config group (4 when none says)."""
    return ((_config_group(module, quant) or {}).get("weights") or {}).get("num_bits", 4)


def _scheme(module: str, shapes: dict[str, list[int]], quant: dict[str, Any]) -> dict[str, Any]:
    """Bits, group size and symmetry of a quantized layer, read from its tensor shapes."""
    packed = "weight_packed" in shapes
    bits = _bits(module, quant) if packed else 8
    rows, cols = shapes["weight_packed" if packed else "weight"]
    in_features = (shapes.get("unpacked") or [rows, cols * 32 // bits])[1] if packed else cols
    n_groups = (shapes.get("weight_scale") or [rows, 1])[-1]
    per_channel = n_groups <= 1
    group: int | str = "channel" if per_channel else in_features // n_groups
    symmetric = "weight_zero_point" not in shapes
    config = _config_group(module, quant) or {}
    activations = " + A8 dynamic" if config.get("input_activations") else ""
    scheme = (f"W{bits}{'channel' if per_channel else f'g{group}'}"
              f"{'' if symmetric else '-asym'}{activations}")
    return {"scheme": scheme, "group_size": group}


def inspect_checkpoint(path: Path) -> dict[str, Any]:
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a checkpoint directory (no config.json)")
    from compress.io.checkpoint import read_config_json, shard_files
    from compress.io.export import matched_skeleton
    from compress.io.stream import verify_checkpoint

    config = read_config_json(path)
    verify_checkpoint(path)  # corrupt shards, shapes against config.json, finite scales
    matched_skeleton(path)  # every tensor config.json implies is stored, and nothing else
    layers: dict[str, dict[str, Any]] = defaultdict(
        lambda: {"bytes": 0, "tensors": {}, "shapes": {}}
    )
    for file in shard_files(path):  # the files a load reads: not a stray one beside an index
        try:
            with safe_open(file, framework="pt") as handle:
                for key in handle.keys():
                    sl = handle.get_slice(key)
                    shape, dtype = sl.get_shape(), sl.get_dtype()
                    size = _DTYPE_BYTES.get(dtype, 4)
                    for dim in shape:
                        size *= dim
                    module, _, leaf = key.rpartition(".")
                    layers[module]["bytes"] += size
                    layers[module]["tensors"][leaf] = f"{dtype}{list(shape)}"
                    layers[module]["shapes"][leaf] = list(shape)
                    if leaf == "weight_shape":  # packed: the unpacked [N, K], two integers
                        layers[module]["shapes"]["unpacked"] = handle.get_tensor(key).tolist()
        except Exception as exc:  # safetensors raises several types for corrupt headers
            raise ModelLoadError(f"{file} is corrupt or partial ({exc})") from exc
    quant = config.get("quantization_config") or {}
    rows = []
    for module in sorted(layers, key=natural_key):
        info = layers[module]
        tensors = info["tensors"]
        int8_weight = tensors.get("weight", "").startswith("I8")
        if "weight_packed" in tensors:
            fmt = f"int{_bits(module, quant)} pack-quantized"
        elif set(tensors) <= {"k_scale", "v_scale"}:  # an attention module's fp8 KV scales
            fmt = "fp8 KV-cache scales"
        elif any(t.startswith("weight_scale") for t in tensors) and int8_weight:
            fmt = "int8 int-quantized"
        elif any(t.endswith("_blocks") and t[:-7] + "_scales" in tensors for t in tensors):
            fmt = "MXFP4 source (dequantized on read)"  # GPT-OSS as released
        elif "weight_scale_inv" in tensors:
            fmt = "fp8 block-scaled source (dequantized on read)"
        else:
            fmt = "dense " + next(iter(tensors.values())).split("[")[0]
        blocks = [t for leaf, t in tensors.items() if leaf.endswith("_blocks")]
        main = (tensors.get("weight_packed") or tensors.get("weight") or next(iter(blocks), None)
                or next(iter(tensors.values())))
        row = {"module": module, "format": fmt, "main_tensor": main, "bytes": info["bytes"],
               "scheme": None, "group_size": None}
        if fmt.endswith("quantized"):
            row.update(_scheme(module, info["shapes"], quant))
        rows.append(row)
    total = sum(r["bytes"] for r in rows)
    kv = quant.get("kv_cache_scheme")
    kv_line = "" if not kv else (
        f"; KV cache: {kv.get('type')}{kv.get('num_bits')} per {kv.get('strategy')} "
        "(k_scale / v_scale per layer)"
    )
    method = quant.get("format") or quant.get("quant_method") or "none"  # ours, or a source's
    lines = [f"# {path}", "", f"quantization: {method}{kv_line}", "",
             "| module | format | scheme | group | tensor | bytes |", "|---|---|---|---:|---|---:|"]
    lines += [
        f"| {r['module']} | {r['format']} | {r['scheme'] or '—'} | {r['group_size'] or '—'} | "
        f"{r['main_tensor']} | {r['bytes']:,} |"
        for r in rows
    ]
    by_format: dict[str, int] = defaultdict(int)
    for r in rows:
        by_format[r["format"]] += r["bytes"]
    lines += ["", "| format | bytes |", "|---|---:|"]
    lines += [f"| {f} | {b:,} |" for f, b in sorted(by_format.items())]
    lines += [f"| **total** | **{total:,}** |"]
    return {"path": str(path), "layers": rows, "bytes_by_format": dict(by_format),
            "total_bytes": total, "markdown": "\n".join(lines)}
