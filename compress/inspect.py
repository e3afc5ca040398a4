"""``compress inspect``: per-layer formats, shapes and bytes of a checkpoint, without loading
the model (reads config.json and the safetensors headers)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from safetensors import safe_open

from compress.errors import ModelLoadError

_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "I64": 8, "I8": 1, "U8": 1, "BOOL": 1}
_QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


def inspect_checkpoint(path: Path) -> dict[str, Any]:
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a checkpoint directory (no config.json)")
    config = json.loads((path / "config.json").read_text())
    layers: dict[str, dict[str, Any]] = defaultdict(lambda: {"bytes": 0, "tensors": {}})
    for file in sorted(path.glob("*.safetensors")):
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
        except Exception as exc:  # safetensors raises several types for corrupt headers
            raise ModelLoadError(f"{file} is corrupt or partial ({exc})") from exc
    quant = config.get("quantization_config") or {}
    rows = []
    for module, info in layers.items():
        tensors = info["tensors"]
        int8_weight = tensors.get("weight", "").startswith("I8")
        if "weight_packed" in tensors:
            fmt = "int4 pack-quantized"
        elif any(t.startswith("weight_scale") for t in tensors) and int8_weight:
            fmt = "int8 int-quantized"
        else:
            fmt = "dense " + next(iter(tensors.values())).split("[")[0]
        main = tensors.get("weight_packed") or tensors.get("weight") or next(iter(tensors.values()))
        rows.append({"module": module, "format": fmt, "main_tensor": main, "bytes": info["bytes"]})
    total = sum(r["bytes"] for r in rows)
    lines = [f"# {path}", "", f"quantization: {quant.get('format', 'none')}", "",
             "| module | format | tensor | bytes |", "|---|---|---|---:|"]
    lines += [
        f"| {r['module']} | {r['format']} | {r['main_tensor']} | {r['bytes']:,} |" for r in rows
    ]
    by_format: dict[str, int] = defaultdict(int)
    for r in rows:
        by_format[r["format"]] += r["bytes"]
    lines += ["", "| format | bytes |", "|---|---:|"]
    lines += [f"| {f} | {b:,} |" for f, b in sorted(by_format.items())]
    lines += [f"| **total** | **{total:,}** |"]
    return {"path": str(path), "layers": rows, "bytes_by_format": dict(by_format),
            "total_bytes": total, "markdown": "\n".join(lines)}
