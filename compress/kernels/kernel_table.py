"""Which CUDA kernel runs a quantized linear layer, per shape and M: the measured kernel table.

``scripts/gpu_check.sh`` times every candidate kernel on decode and prefill shapes and writes
``kernel_table.json``; committed as ``compress/kernels/configs/kernel_table.json`` it is read
on first use (``load_table``, never at import). File format (``FORMAT`` = 1)::

    {"format": 1,
     "tables": [{"gpu": "NVIDIA H200",            # torch.cuda.get_device_name when measured
                 "match": ["H200"],               # substrings of device names it applies to
                 "measured": {"date": ..., "torch": ..., "triton": ..., "commit": ...,
                              "method": "..."},   # how the times were taken
                 "entries": [{"op": "int4", "n": 4096, "k": 4096, "group_size": 128, "m": 1,
                              "kernel": "triton_gemv",             # the fastest, one of KERNELS
                              "config": {"BLOCK_N": 128, "BLOCK_K": 16, "SPLIT_K": 16,
                                         "num_warps": 1, "num_stages": 1},  # or null
                              "us": {"triton_gemv": 4.1, "torch_int4pack": 9.8, ...},
                              "spread_us": {...}}, ...]}]}

``op`` is ``int4`` (W4A16), ``int8`` (W8A16) or ``w8a8``; ``group_size`` equals K per channel.
Lookup (``choose``): the entries of the exact (op, N, K, group); of those the smallest measured
``m`` >= the call's M (the largest if none is); its kernel if allowed and able to run, else the
fastest allowed one in its ``us``. A shape the table lacks, or no table, gets ``default_kernel``:
a documented default from the last measured H200 numbers (docs/kernels.md, 2026-11-30), not a
measurement of this shape.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources

import torch

FORMAT = 1
TABLE_FILE = "kernel_table.json"  # in compress/kernels/configs/
OPS = ("int4", "int8", "w8a8")
# every kernel a CUDA layer can run; "triton_gemm" is int4_gemm/int8_gemm (split-K up to M 16)
KERNELS = ("triton_gemv", "triton_gemm", "torch_int4pack", "torch_int_mm")
TRITON_KERNELS = ("triton_gemv", "triton_gemm")
GEMV_MAX_M = 4  # = gemv.GEMV_MAX_M (this module does not import triton)
INT4PACK_MAX_M = 16  # the default takes torch's int4 kernel up to here (docs/kernels.md)
INT4PACK_GROUPS = (32, 64, 128, 256)
CONFIG_KEYS = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")


@dataclass(frozen=True)
class Choice:
    """``kernel`` (one of ``KERNELS``), its GEMV ``config`` (dict of ``CONFIG_KEYS``) or None,
    and ``source``: "table" (measured for this shape) or "default" (``default_kernel``)."""

    kernel: str
    config: tuple[tuple[str, int], ...] | None = None
    source: str = "default"


def int4pack_inner_k_tiles(k: int) -> int | None:
    """The ``innerKTiles`` of ``torch._convert_weight_to_int4pack`` for K (8, 4 or 2: K must be
    a multiple of 16 of them), None when K fits none."""
    return next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)


def runs(kernel: str, *, op: str, n: int, k: int, group_size: int, m: int, device_type: str,
         x_dtype: torch.dtype) -> bool:  # fmt: skip
    """Whether ``kernel`` can run this call (shape limits of torch's kernels, GEMV rows)."""
    if kernel == "triton_gemv":
        return m <= GEMV_MAX_M
    if kernel == "triton_gemm":
        return True
    if device_type != "cuda":
        return False
    if kernel == "torch_int4pack":
        shape_ok = n % 8 == 0 and int4pack_inner_k_tiles(k) is not None
        return (
            op == "int4"
            and x_dtype == torch.bfloat16
            and group_size in INT4PACK_GROUPS
            and shape_ok
        )
    if kernel == "torch_int_mm":  # M > 16 and multiples of 8: torch's CUDA _int_mm limits
        return op == "w8a8" and m > 16 and k % 8 == 0 and n % 8 == 0
    raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")


def default_kernel(*, op: str, m: int, allowed: tuple[str, ...], fits) -> str:
    """The choice without a measurement of this shape (``fits(kernel)``: ``runs`` bound to the
    call). From the H200 run of 2026-11-30 (docs/kernels.md): at M <= 16 torch's int4 kernel
    beat our split-K GEMM 3-15x and bf16 cuBLAS 1.3-1.8x, so int4 takes it where it runs; at
    M >= 2048 our GEMMs beat it >10x (W4A16) and matched ``torch._int_mm`` (W8A8, which needs a
    separate scale epilogue), so larger M takes ``triton_gemm``. The GEMV is new and was never
    timed: it is the default only at M <= 4 where torch's int4 kernel cannot run (or is not
    allowed), a design choice, not a measurement."""
    if (
        op == "int4"
        and m <= INT4PACK_MAX_M
        and "torch_int4pack" in allowed
        and fits("torch_int4pack")
    ):
        return "torch_int4pack"
    if m <= GEMV_MAX_M and "triton_gemv" in allowed:
        return "triton_gemv"
    return "triton_gemm"


@dataclass(frozen=True)
class Table:
    """One GPU's measured entries, indexed by (op, n, k, group_size) -> entries sorted by m."""

    gpu: str
    measured: dict
    index: dict

    @classmethod
    def from_dict(cls, data: dict) -> Table:
        index: dict = {}
        for i, entry in enumerate(data["entries"]):
            check_entry(entry, f"{data.get('gpu')} entries[{i}]")
            key = (entry["op"], entry["n"], entry["k"], entry["group_size"])
            index.setdefault(key, []).append(entry)
        for entries in index.values():
            entries.sort(key=lambda e: e["m"])
        return cls(data["gpu"], data.get("measured", {}), index)


def check_entry(entry: dict, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` unless ``entry`` has the fields of the format."""
    missing = [f for f in ("op", "n", "k", "group_size", "m", "kernel", "us") if f not in entry]
    if missing:
        raise ValueError(f"kernel table {where}: missing {missing}")
    if entry["op"] not in OPS or entry["kernel"] not in KERNELS:
        raise ValueError(f"kernel table {where}: op {entry['op']!r} must be one of {OPS}, "
                         f"kernel {entry['kernel']!r} one of {KERNELS}")  # fmt: skip
    config = entry.get("config")
    if config is not None and sorted(config) != sorted(CONFIG_KEYS):
        raise ValueError(f"kernel table {where}: config {config} needs exactly {CONFIG_KEYS}")


def parse_file(data: dict, where: str = TABLE_FILE) -> list[dict]:
    """The ``tables`` of a parsed kernel-table file, checked for the format."""
    if data.get("format") != FORMAT or not isinstance(data.get("tables"), list):
        raise ValueError(f"{where}: expected {{'format': {FORMAT}, 'tables': [...]}}")
    for table in data["tables"]:
        if not {"gpu", "match", "entries"} <= set(table):
            raise ValueError(f"{where}: a table needs 'gpu', 'match' and 'entries'")
    return data["tables"]


def select_table(tables: list[dict], gpu_name: str) -> Table | None:
    """The table whose ``match`` names ``gpu_name`` (first wins), or None."""
    for table in tables:
        if any(pattern in gpu_name for pattern in table["match"]):
            return Table.from_dict(table)
    return None


@functools.cache
def load_table(gpu_name: str) -> Table | None:
    """The committed table for ``gpu_name`` (``configs/kernel_table.json``); None without the
    file or a matching table: ``choose`` then uses ``default_kernel``."""
    path = resources.files(__package__) / "configs" / TABLE_FILE
    if not path.is_file():
        return None
    return select_table(parse_file(json.loads(path.read_text())), gpu_name)


def choose(
    table: Table | None,
    *,
    op: str,
    n: int,
    k: int,
    group_size: int,
    m: int,
    device_type: str = "cuda",
    x_dtype: torch.dtype = torch.bfloat16,
    allowed: tuple[str, ...] = KERNELS,
) -> Choice:
    """The kernel for one call (module docstring); ``allowed`` narrows the candidates (an
    explicit ``backend="triton"`` allows ``TRITON_KERNELS`` only)."""
    fits = functools.partial(runs, op=op, n=n, k=k, group_size=group_size, m=m,
                             device_type=device_type, x_dtype=x_dtype)  # fmt: skip
    entries = None if table is None else table.index.get((op, n, k, group_size))
    if entries:
        entry = next((e for e in entries if e["m"] >= m), entries[-1])
        ranked = [entry["kernel"]] + sorted(
            (name for name, us in entry["us"].items() if us is not None and name in KERNELS),
            key=lambda name: entry["us"][name],
        )
        for kernel in ranked:
            if kernel in allowed and fits(kernel):
                config = entry.get("config") if kernel == entry["kernel"] else None
                frozen = None if config is None else tuple((c, config[c]) for c in CONFIG_KEYS)
                return Choice(kernel, frozen, "table")
    return Choice(default_kernel(op=op, m=m, allowed=allowed, fits=fits))


def merge_tables(existing: dict | None, new_table: dict) -> dict:
    """A kernel-table file with ``new_table`` replacing any table measured on the same GPU."""
    tables = [] if existing is None else parse_file(existing)
    kept = [t for t in tables if t["gpu"] != new_table["gpu"]]
    return {"format": FORMAT, "tables": [new_table, *kept]}
