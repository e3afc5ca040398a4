"""Reading safetensors checkpoint folders (``compress.io`` imports no pass): the shard files of a
folder (its index, else every ``*.safetensors``), each shard's header checked against the rules
safetensors itself enforces (offsets that tile the data exactly, known dtypes, sizes that match
shapes), ``CheckpointReader`` reading one tensor at a time in its stored dtype (checked against
the shape and dtype the model expects; NaN or Inf refused, named), and ``read_config_json``
(config.json and its quantization_config checked before transformers sees them). Every problem
is a ``ModelLoadError`` of one line naming the file, the tensor and the fix. Streaming
(``compress.io.stream``) and loading (``compress.io.load``) read through it.
"""

from __future__ import annotations

import copy
import json
import math
import os
import struct
from pathlib import Path

import torch

from compress.core.errors import ModelLoadError
from compress.core.matcher import check_pattern, matches
from compress.kernels.reference import unpack_int8

INDEX_FILE = "model.safetensors.index.json"


def holds_non_finite(tensor: torch.Tensor) -> bool:
    """Whether a float ``tensor`` holds NaN or Inf. max and min propagate NaN and hold any Inf:
    two reductions, no bool tensor of the weight's size (a 70B embedding's would be 1 GB more
    at the streamed peak)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return False
    return not (bool(torch.isfinite(tensor.amax())) and bool(torch.isfinite(tensor.amin())))

# safetensors dtype names <-> torch
_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",  # block-scaled fp8 sources (CheckpointReader._scale_fp8)
    torch.float8_e5m2: "F8_E5M2",
}
_TORCH_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}
_FP8_NAMES = ("F8_E4M3", "F8_E5M2")
_FP8_SCALE = "fp8_scale"  # a header entry's key (added here) for its weight_scale_inv
# a header entry's key (added here) for an MXFP4 weight read from its blocks and scales
_MXFP4 = "mxfp4_parts"
# a header entry's key (added here) for int8 codes read from compressed-tensors' 8-bit packing
_INT8_PACKED = "int8_packed"
# e2m1 codes 0..15: the values of an MXFP4 block's nibbles before its shared power of two
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def quant_method(config: object) -> str | None:
    """The ``quantization_config.quant_method`` of a parsed config.json (None: a float
    checkpoint, or no readable method)."""
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    return method if isinstance(method, str) else None


def shard_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: those its index names, else every
    ``*.safetensors`` file; ModelLoadError when there are none or the index names a missing one."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            raise ModelLoadError(
                f"{index}: not a readable shard index ({exc}); re-download or re-export the "
                "checkpoint"
            ) from exc
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise ModelLoadError(
                f"{index}: weight_map is not a mapping of tensor names to shard file names; "
                "re-download or re-export the checkpoint"
            )
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        single = path / "model.safetensors"
        if single.is_file() and single not in files:
            # transformers loads the single file, the index's readers the shards: two models
            raise ModelLoadError(
                f"{path} holds both {single.name} and {INDEX_FILE} with other shards, two "
                "checkpoints that loaders read differently; remove the stale one (or re-download "
                "/ re-export the checkpoint)"
            )
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(
                f"{index} names shards that are missing: {', '.join(missing[:5])}; the "
                "download or export is incomplete, fetch or write it again"
            )
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} holds no *.safetensors file")
    return files


def read_header(file: Path) -> tuple[int, dict[str, dict]]:
    """(offset of the data, {name: {dtype, shape, data_offsets}}) of a safetensors file, with
    the checks safetensors makes: a readable header, known dtypes, sizes that match shapes and
    data inside the file. Anything else is a ``ModelLoadError`` naming the file."""

    def corrupt(why: str) -> ModelLoadError:
        return ModelLoadError(
            f"{file}: corrupt or partially written safetensors file ({why}); re-download or "
            "re-export the checkpoint"
        )

    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise corrupt("shorter than its 8-byte header length")
            (length,) = struct.unpack("<Q", head)
            if length > min(size - 8, 100 << 20):
                raise corrupt(f"header of {length} bytes in a file of {size}")
            header = json.loads(handle.read(length))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
        if isinstance(exc, ModelLoadError):
            raise
        raise corrupt(f"unreadable header: {exc}") from exc
    if not isinstance(header, dict):
        raise corrupt("the header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise corrupt("__metadata__ is not a mapping of strings")  # safetensors refuses it too
    start = 8 + length
    spans = []
    for name, entry in header.items():
        try:
            dtype = _TORCH_DTYPES[entry["dtype"]]
            begin, stop = entry["data_offsets"]
            numel = math.prod(int(dim) for dim in entry["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise corrupt(f"tensor {name}: bad header entry {entry!r}") from exc
        if not (isinstance(begin, int) and isinstance(stop, int) and 0 <= begin <= stop):
            raise corrupt(f"tensor {name}: data offsets {entry['data_offsets']}")
        if stop - begin != numel * torch.empty((), dtype=dtype).element_size():
            raise corrupt(f"tensor {name}: {stop - begin} bytes for shape {entry['shape']}")
        if start + stop > size:
            raise corrupt(
                f"tensor {name} ends at byte {start + stop} of a {size}-byte file, truncated"
            )
        spans.append((begin, stop, name))
    # The tensors tile the data exactly, as safetensors (and so transformers) requires: an overlap
    # or a gap is a file that one reader accepts and another refuses.
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise corrupt(
                f"tensor {name} starts at data byte {begin}, not {end}: tensors "
                "overlap or leave a gap"
            )
        end = stop
    if start + end != size:
        raise corrupt(f"{size - start - end} bytes after the last tensor")
    return start, header


def check_stored(reader, name: str, shape: tuple[int, ...] | None,
                 dtype: torch.dtype | None) -> None:
    """ModelLoadError unless ``reader``'s tensor ``name`` (from its header) has ``shape`` and
    fits ``dtype``: integer codes exactly that dtype (a kernel reads their bits), a float tensor
    any float dtype (it is cast). None skips a check."""
    file = reader.file_of(name)
    if shape is not None and reader.shape(name) != tuple(shape):
        raise ModelLoadError(
            f"{file}: tensor {name} has shape {list(reader.shape(name))} but config.json "
            f"implies {list(shape)}; the config does not match the weights, fix config.json "
            "or re-export the checkpoint"
        )
    stored = reader.dtype(name)
    if dtype is not None and (
        stored.is_floating_point != dtype.is_floating_point
        or (not dtype.is_floating_point and stored != dtype)
    ):
        raise ModelLoadError(
            f"{file}: tensor {name} is stored as {stored} but the model holds {dtype} there; "
            "the checkpoint is corrupt or its config.json (quantization_config) does not "
            "match it, re-export it"
        )


class CheckpointReader:
    """Lazy access to the tensors of a checkpoint folder (all its shards). Only the headers are
    read up front; a tensor is read from its file when asked for, with plain reads into a new
    tensor, not through a memory map (a mapped file's touched pages count as the process's
    resident memory until it is closed: 13.5 GB for a 7B checkpoint read through once)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._where: dict[str, Path] = {}
        self._entries: dict[str, tuple[int, dict]] = {}
        for file in shard_files(self.path):
            self._index(file)
        self._scale_fp8()
        self._unpack_mxfp4()
        self._unpack_int8()

    def _source_config(self) -> dict:
        return read_config_json(self.path) if (self.path / "config.json").is_file() else {}

    def _unpack_mxfp4(self) -> None:
        """MXFP4 sources (``quantization_config.quant_method: mxfp4``: GPT-OSS as released):
        each ``<name>_blocks`` ``[E, R, G, 16]`` (uint8, two e2m1 codes a byte, the low nibble
        first) with its ``<name>_scales`` ``[E, R, G]`` (uint8 e8m0: a power of two, bias 127,
        per 32 values) reads as ``<name>``, the weight transformers dequantizes it to:
        ``[E, 32 G, R]`` (the experts module's [in, out] layout), in the config's 16-bit dtype.
        Blocks under any other scheme, or without their scales, are refused, naming them."""
        def pair(name: str) -> bool:  # X_blocks beside X_scales, both uint8: MXFP4's layout
            scales = name.removesuffix("_blocks") + "_scales"
            return scales in self._entries and all(
                self._entries[n][1].get("dtype") == "U8" for n in (name, scales))

        blocks = [n for n in self._entries if n.endswith("_blocks")]
        config = self._source_config() if blocks or any(
            n.endswith("_scales") for n in self._entries) else {}
        method = quant_method(config)
        if method != "mxfp4":
            if any(pair(n) for n in blocks):
                name = next(n for n in blocks if pair(n))
                raise ModelLoadError(
                    f"{self._where[name]}: tensor {name} and its _scales are MXFP4 blocks, but "
                    f"config.json's quantization_config.quant_method is {method!r}, not "
                    "'mxfp4'; the config does not describe the weights: restore its "
                    "quantization_config (or re-download the checkpoint)")
            return  # not MXFP4's names: read as stored (a loader names what does not fit)
        orphans = [n for n in self._entries if n.endswith("_scales")
                   and n.removesuffix("_scales") + "_blocks" not in self._entries]
        if orphans:
            raise ModelLoadError(
                f"{self._where[orphans[0]]}: MXFP4 scales {orphans[0]} have no "
                f"{orphans[0].removesuffix('_scales')}_blocks beside them; the checkpoint is "
                "incomplete: re-download it")
        dtype = {"float16": torch.float16, "float32": torch.float32}.get(
            config.get("torch_dtype") or config.get("dtype"), torch.bfloat16)
        for name in blocks:
            base, scales = name.removesuffix("_blocks"), name.removesuffix("_blocks") + "_scales"
            if base in self._entries:
                raise ModelLoadError(
                    f"{self._where[base]}: tensor {base} is stored twice, as itself and as "
                    f"MXFP4 blocks ({name}); the folder mixes two checkpoints, remove the stale "
                    "shard (or re-download the checkpoint)")
            if scales not in self._entries:
                raise ModelLoadError(
                    f"{self._where[name]}: MXFP4 tensor {name} has no {scales} beside it, so "
                    "its values are unknown; the checkpoint is incomplete: re-download it")
            (start, entry), (_, scale_entry) = self._entries[name], self._entries[scales]
            shape = [int(d) for d in entry["shape"]]
            got = [int(d) for d in scale_entry["shape"]]
            if entry["dtype"] != "U8" or scale_entry["dtype"] != "U8" or len(shape) != 4 \
                    or shape[-1] != 16 or got != shape[:-1]:
                raise ModelLoadError(
                    f"{self._where[name]}: MXFP4 tensors {name} ({entry['dtype']} {shape}) and "
                    f"{scales} ({scale_entry['dtype']} {got}) are not uint8 [E, R, G, 16] "
                    "blocks with uint8 [E, R, G] scales; the checkpoint is corrupt: "
                    "re-download it")
            located = (self._where.pop(scales), self._entries.pop(scales), entry, dtype)
            self._where[base] = self._where.pop(name)
            del self._entries[name]
            self._entries[base] = (start, {"dtype": _DTYPE_NAMES[dtype],
                                           "shape": [shape[0], shape[2] * 32, shape[1]],
                                           "data_offsets": entry["data_offsets"],
                                           _MXFP4: located})

    def _unpack_int8(self) -> None:
        """compressed-tensors ``pack-quantized`` layers of 8 bits (weight-only int8, as
        llm-compressor and compress write it): each ``X.weight_packed`` (int32 ``[N,
        ceil(K/4)]``, ``compress.kernels.reference.pack_int8``) reads as ``X.weight``, int8
        ``[N, K]``, the layout the int8 layers hold; an asymmetric ``X.weight_zero_point``
        (int32 ``[ceil(N/4), G]``, packed along rows) as int8 ``[N, G]``; ``X.weight_shape``
        leaves the names. The bits are those of the config group that targets ``X``."""
        packed = [n for n in self._entries if n.endswith(".weight_packed")]
        quant = (self._source_config().get("quantization_config") or {}) if packed else {}
        if quant.get("quant_method") != "compressed-tensors":
            return
        for name in packed:
            module = name.removesuffix(".weight_packed")
            group = config_group_for(quant, module)
            if group is None or group["weights"].get("num_bits") != 8:
                continue  # int4, or a layer no group targets: the loader names it
            rows, cols = self._packed_shape(module)
            start, entry = self._entries[name]
            if entry["dtype"] != "I32" or [int(d) for d in entry["shape"]] != [rows, -(-cols // 4)]:
                raise ModelLoadError(
                    f"{self._where[name]}: tensor {name} is {entry['dtype']} "
                    f"{list(entry['shape'])} but {module}.weight_shape says {[rows, cols]} "
                    f"under an 8-bit config group, which packs four codes an int32: "
                    f"[{rows}, {-(-cols // 4)}]; the checkpoint is corrupt, re-export it")
            self._replace(name, f"{module}.weight", [rows, cols], (name, entry, cols, 1))
            del self._where[f"{module}.weight_shape"], self._entries[f"{module}.weight_shape"]
            zero = f"{module}.weight_zero_point"
            if zero in self._entries and self._entries[zero][1]["dtype"] == "I32":
                start, entry = self._entries[zero]
                shape = [int(d) for d in entry["shape"]]
                if len(shape) != 2 or shape[0] != -(-rows // 4):
                    raise ModelLoadError(
                        f"{self._where[zero]}: tensor {zero} is {shape} but an 8-bit layer of "
                        f"{rows} rows packs its zero points four rows an int32: "
                        f"[{-(-rows // 4)}, groups]; the checkpoint is corrupt, re-export it")
                self._replace(zero, zero, [rows, shape[1]], (zero, entry, rows, 0))

    def _packed_shape(self, module: str) -> tuple[int, int]:
        """The ``[rows, columns]`` that ``module.weight_shape`` stores (read now: 16 bytes)."""
        name = f"{module}.weight_shape"
        if name not in self._entries:
            raise ModelLoadError(
                f"{self.path}: {module}.weight_packed has no {name} beside it, so its width is "
                "unknown; the checkpoint is incomplete: re-download or re-export it")
        shape = self.read(name)
        if shape.is_floating_point() or shape.shape != (2,) or bool((shape <= 0).any()):
            raise ModelLoadError(
                f"{self._where[name]}: tensor {name} is {shape.tolist()}, not two positive "
                "integers (rows, columns); the checkpoint is corrupt, re-export it")
        return int(shape[0]), int(shape[1])

    def _replace(self, stored: str, name: str, shape: list[int], located: tuple) -> None:
        """Read ``stored`` as int8 ``name`` of ``shape``, unpacked (``_INT8_PACKED``)."""
        start, entry = self._entries.pop(stored)
        self._where[name] = self._where.pop(stored)
        self._entries[name] = (start, {"dtype": "I8", "shape": shape,
                                       "data_offsets": entry["data_offsets"],
                                       _INT8_PACKED: located})

    def _scale_fp8(self) -> None:
        """Block-scaled fp8 sources (``quantization_config.quant_method: fp8``: DeepSeek-V3/R1,
        Kimi K2, Qwen3's and others' FP8 releases): each fp8 weight reads as its codes times the
        ``weight_scale_inv`` stored beside it (one value per ``weight_block_size`` block, or one
        for the tensor), in the config's 16-bit dtype, and the scales leave the names. An fp8
        tensor under any other scheme is refused, naming the fix."""
        fp8 = [n for n, (_, entry) in self._entries.items() if entry.get("dtype") in _FP8_NAMES]
        if not fp8:
            return
        config = self._source_config()
        method = quant_method(config)
        if method != "fp8":
            raise ModelLoadError(
                f"{self._where[fp8[0]]}: tensor {fp8[0]} is stored in fp8 under "
                f"quantization_config.quant_method {method!r}; compress reads fp8 weights of "
                "block-scaled 'fp8' checkpoints (a weight_scale_inv beside each) only: start "
                "from the 16-bit checkpoint")
        block = config["quantization_config"].get("weight_block_size")
        if block is not None and not (isinstance(block, list) and len(block) == 2 and all(
                isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ModelLoadError(
                f"{self.path}/config.json: quantization_config.weight_block_size {block!r} is "
                "not two positive integers (rows, columns of a scale's block); fix config.json")
        dtype = {"float16": torch.float16, "float32": torch.float32}.get(
            config.get("torch_dtype") or config.get("dtype"), torch.bfloat16)
        for name in fp8:
            start, entry = self._entries[name]
            scale = f"{name}_scale_inv"
            if scale not in self._entries:
                raise ModelLoadError(
                    f"{self._where[name]}: fp8 tensor {name} has no {scale} beside it, so its "
                    "values are unknown; the checkpoint is incomplete: re-download it")
            shape = [int(d) for d in entry["shape"]]
            want = [1] if not block else [-(-d // b) for d, b in zip(shape, block, strict=False)]
            got = [int(d) for d in self._entries[scale][1]["shape"]]
            if (got or [1]) != want and not (not block and math.prod(got) == 1):
                raise ModelLoadError(
                    f"{self._where[scale]}: {scale} has shape {got} but weight_block_size "
                    f"{block} over {shape} needs {want}; the checkpoint does not match its "
                    "config.json: re-download it")
            located = (self._where.pop(scale), self._entries.pop(scale), block, dtype)
            self._entries[name] = (start, {**entry, _FP8_SCALE: located})

    def _index(self, file: Path) -> None:
        start, header = read_header(file)
        for name, entry in header.items():
            if name in self._where:  # which copy a loader takes depends on the loader
                raise ModelLoadError(
                    f"{self.path}: tensor {name} is stored twice, in {self._where[name].name} "
                    f"and in {file.name}; the folder mixes two checkpoints, remove the stale "
                    "shard (or re-download / re-export the checkpoint)"
                )
            self._where[name] = file
            self._entries[name] = (start, entry)

    def names(self) -> list[str]:
        return list(self._where)

    def renamed(self, aliases: dict[str, str]) -> CheckpointReader:
        """This reader with the tensors stored as ``aliases``' values read under their keys
        (a checkpoint's legacy names under the module tree's), the others as they are."""
        other = copy.copy(self)
        stored_as = {stored: name for name, stored in aliases.items()}
        other._where = {stored_as.get(n, n): f for n, f in self._where.items()}
        other._entries = {stored_as.get(n, n): e for n, e in self._entries.items()}
        return other

    def selected(self, aliases: dict[str, str]) -> CheckpointReader:
        """This reader holding only the tensors stored as ``aliases``' values, each under its
        key (a multimodal checkpoint's text model: ``compress.io.wrapped``)."""
        other = copy.copy(self)
        other._where = {name: self._where[stored] for name, stored in aliases.items()}
        other._entries = {name: self._entries[stored] for name, stored in aliases.items()}
        return other

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def file_of(self, name: str) -> Path:
        return self._where[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self._entries[name][1]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        """The dtype ``read`` returns (an fp8 source's weight: its dequantized dtype)."""
        entry = self._entries[name][1]
        return entry[_FP8_SCALE][3] if _FP8_SCALE in entry else _TORCH_DTYPES[entry["dtype"]]

    def nbytes(self, name: str) -> int:
        """Bytes of the tensor ``read`` returns."""
        entry = self._entries[name][1]
        if _FP8_SCALE in entry or _MXFP4 in entry or _INT8_PACKED in entry:
            return math.prod(int(d) for d in entry["shape"]) * self.dtype(name).itemsize
        begin, stop = entry["data_offsets"]
        return stop - begin

    def same_values(self, first: str, second: str, chunk: int = 64 << 20) -> bool:
        """Whether two stored tensors hold the same values: compared ``chunk`` bytes at a time
        when both have one dtype and shape (an embedding and a head, 2 GB each at 70B), else
        read whole and compared as float32."""
        if self.shape(first) != self.shape(second):
            return False
        if self.dtype(first) != self.dtype(second) or any(
                any(k in self._entries[n][1] for k in (_FP8_SCALE, _MXFP4, _INT8_PACKED))
                for n in (first, second)):
            return torch.equal(self.read(first).float(), self.read(second).float())
        (start_a, entry_a), (start_b, entry_b) = self._entries[first], self._entries[second]
        size = self.nbytes(first)
        with open(self._where[first], "rb") as a, open(self._where[second], "rb") as b:
            a.seek(start_a + entry_a["data_offsets"][0])
            b.seek(start_b + entry_b["data_offsets"][0])
            for _ in range(0, size, chunk):
                if a.read(chunk) != b.read(chunk):
                    return False
        return True

    def read(
        self, name: str, *, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The tensor ``name`` as stored; ``shape``: what the model expects (checked first).
        ``dtype``: the dtype of the model's tensor it fills: integer codes must be stored in
        exactly that dtype (a kernel reads their bits), a float tensor in any float dtype (it is
        cast). A float tensor holding NaN or Inf is refused, naming it."""
        if name not in self._where:
            raise ModelLoadError(
                f"{self.path}: tensor {name} is missing from the checkpoint; it does not match "
                "its config.json, re-download or re-export it"
            )
        file = self._where[name]
        check_stored(self, name, shape, dtype)
        start, entry = self._entries[name]
        if _MXFP4 in entry:
            scale_file, (scale_start, scale_entry), blocks, dequantized = entry[_MXFP4]
            tensor = _dequantize_mxfp4(
                _read_stored(file, f"{name}_blocks", start, blocks),
                _read_stored(scale_file, f"{name}_scales", scale_start, scale_entry), dequantized)
        elif _INT8_PACKED in entry:
            stored, stored_entry, size, dim = entry[_INT8_PACKED]
            tensor = unpack_int8(_read_stored(file, stored, start, stored_entry), size, dim)
        else:
            tensor = _read_stored(file, name, start, entry)
        if _FP8_SCALE in entry:
            scale_file, (scale_start, scale_entry), block, dequantized = entry[_FP8_SCALE]
            scale = _read_stored(scale_file, f"{name}_scale_inv", scale_start, scale_entry)
            tensor = _dequantize_fp8(tensor, scale, block, dequantized)
        # a NaN weight makes every logit NaN downstream, where nothing can name it any more
        if holds_non_finite(tensor):
            raise ModelLoadError(
                f"{file}: tensor {name} holds NaN or Inf values, so the layer's weights are "
                "undefined; the checkpoint is corrupt, re-download or re-export it"
            )
        return tensor


def config_group_for(quant: dict, name: str) -> dict | None:
    """The group of a compressed-tensors ``quantization_config`` whose targets select the
    linear layer ``name``: an exact name first, then a ``re:`` pattern, then the class
    ``Linear`` (compressed-tensors' order); None when no group does."""
    groups = list((quant.get("config_groups") or {}).values())
    for selects in (lambda t: t == name,
                    lambda t: t.startswith("re:") and matches(name, None, t),
                    lambda t: t == "Linear"):
        for group in groups:
            if any(selects(t) for t in group["targets"]):
                return group
    return None


def _dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, block, dtype: torch.dtype):
    """fp8 ``codes`` [out, in] times ``scale`` (``weight_scale_inv``: one value per ``block``
    [rows, cols], or one for the tensor), in ``dtype``."""
    values, scale = codes.float(), scale.float()
    if block:
        rows, cols = block
        scale = scale.repeat_interleave(rows, 0)[:values.shape[0]]
        scale = scale.repeat_interleave(cols, 1)[:, :values.shape[1]]
    else:
        scale = scale.reshape(())
    return (values * scale).to(dtype)


def _dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
    """MXFP4 ``blocks`` [E, R, G, 16] with ``scales`` [E, R, G] -> [E, 32 G, R] in ``dtype``:
    each byte's low nibble is the even value, its high nibble the odd one, an e2m1 code
    (``_FP4_VALUES``) times 2 ** (scale - 127). Exact in bf16 (three significant bits at most),
    one expert at a time (a 120B layer's experts are 6 GB in bf16 at once)."""
    count, rows, groups, width = blocks.shape
    values = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    out = torch.empty(count, groups * width * 2, rows, dtype=dtype)
    for e in range(count):
        codes = blocks[e].reshape(rows * groups, width)
        expert = torch.empty(rows * groups, width * 2, dtype=torch.float32)
        expert[:, 0::2] = values[(codes & 0x0F).long()]
        expert[:, 1::2] = values[(codes >> 4).long()]
        exponents = scales[e].reshape(rows * groups, 1).to(torch.int32) - 127
        expert = torch.ldexp(expert, exponents)
        out[e] = expert.reshape(rows, groups * width * 2).T.to(dtype)
    return out


def _read_stored(file: Path, name: str, start: int, entry: dict) -> torch.Tensor:
    """The bytes of tensor ``name`` (header ``entry`` of ``file``, data from ``start``) as
    stored, or a ModelLoadError naming what is wrong with them."""
    begin, stop = entry["data_offsets"]
    tensor = torch.empty([int(d) for d in entry["shape"]], dtype=_TORCH_DTYPES[entry["dtype"]])
    try:
        with open(file, "rb", buffering=0) as handle:
            handle.seek(start + begin)
            view = (
                memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
                if tensor.numel()
                else memoryview(bytearray())
            )
            got = handle.readinto(view) if tensor.numel() else 0
            while got < stop - begin:  # readinto may return less for large reads
                more = handle.readinto(view[got:])
                if not more:
                    break
                got += more
    except OSError as exc:
        raise ModelLoadError(
            f"{file}: tensor {name} cannot be read ({exc}); re-download "
            "or re-export the checkpoint"
        ) from exc
    if got != stop - begin:
        raise ModelLoadError(
            f"{file}: tensor {name} is cut short ({got} of {stop - begin} bytes); the file is "
            "truncated, re-download or re-export the checkpoint"
        )
    return tensor


def _config_errors() -> tuple[type[BaseException], ...]:
    """What transformers raises for a config.json it cannot take: its own checks raise
    ValueError/KeyError/TypeError or assert; a zero head count divides by zero and an unknown
    ``dtype`` is an AttributeError of ``torch``; huggingface_hub's strict dataclass validators
    (transformers 5 configs: e.g. heads that do not divide the hidden size) their own type."""
    errors: tuple[type[BaseException], ...] = (
        OSError,
        ValueError,
        KeyError,
        TypeError,
        AssertionError,
        ArithmeticError,
        AttributeError,
    )
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # older huggingface_hub: no strict dataclasses
        return errors
    return (*errors, StrictDataclassError)


def stored_dtype_name(path) -> str | None:
    """The float dtype name (``bfloat16``, ``float16``...) ``path``/config.json says the
    checkpoint is stored in (``dtype``, or transformers 4's ``torch_dtype``); None without a
    readable one (a hub id, no or a damaged config.json: the loaders report those)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (TypeError, OSError, ValueError, RecursionError):
        return None
    if not isinstance(config, dict):
        return None
    stored = config.get("dtype") or config.get("torch_dtype")
    return stored if isinstance(stored, str) else None


def check_positions(config: object, length: int, what: str, source: str = "the model") -> None:
    """Refuse ``length`` tokens per sequence (``what``: the setting that asks them) past the
    model's positions (config.json ``max_position_embeddings``): a learned position table has no
    rows beyond, a RoPE model was not trained there (a score there is of extrapolation), and
    caches and rotary tables sized by the length took all memory (10**8)."""
    from compress.core.errors import ConfigError

    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and length > limit:
        raise ConfigError(f"{what} {length} exceeds the {limit} positions of {source} "
                          f"(config.json max_position_embeddings); give {limit} or less")


def read_config_json(path: str | os.PathLike[str]) -> dict:
    """``path``/config.json as a mapping, or a ModelLoadError naming what is wrong with it (not
    JSON, not an object, a ``quantization_config`` that is not an object)."""
    file = Path(path) / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ModelLoadError(f"{file} cannot be read ({exc}); fix or replace it") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(
            f"{file} holds a JSON {type(config).__name__}, not an object; fix or replace it"
        )
    quant = config.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise ModelLoadError(
            f"{file}: quantization_config is a {type(quant).__name__}, not an "
            "object; fix it or remove it (a float checkpoint has none)"
        )
    groups = (quant or {}).get("config_groups", {})
    problem = None if isinstance(groups, dict) else "config_groups is not an object"
    for key, group in groups.items() if problem is None else ():
        if (
            not isinstance(group, dict)
            or not isinstance(group.get("targets"), list)
            or not isinstance(group.get("weights"), dict)
        ):  # what the loader reads of one
            problem = f"config_groups.{key} needs a targets list and a weights object"
            break
        problem = _patterns_problem(group["targets"], f"config_groups.{key}.targets")
        if problem is not None:
            break
    if problem is None and quant is not None:
        # compressed-tensors writes `"ignore": null` when nothing is ignored
        problem = _patterns_problem(quant.get("ignore") or [], "ignore")
        kv = quant.get("kv_cache_scheme")
        if problem is None and kv is not None and not isinstance(kv, dict):
            problem = f"kv_cache_scheme is a {type(kv).__name__}, not an object or null"
    if problem is not None:
        raise ModelLoadError(
            f"{file}: quantization_config: {problem}; fix it or re-export the checkpoint"
        )
    return config


def _patterns_problem(patterns: object, where: str) -> str | None:
    """What is wrong with a quantization_config ``targets``/``ignore`` list (the loader matches
    module names against it: ``compress.core.matcher``), or None."""
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        return f"{where} is not a list of module names or re: patterns"
    for pattern in patterns:
        try:
            check_pattern(pattern)
        except ValueError as exc:
            return f"{where}: {exc}"
    return None
