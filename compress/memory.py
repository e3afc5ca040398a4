"""Memory measurement, in one place: process peaks and a sampled peak over a block of code.

``peak_memory_bytes()`` is the whole-process view (peak RSS since the process started, from
``getrusage``, and the CUDA allocator's peak); ``MemoryMonitor`` measures one ``with`` block (CUDA
allocator peak, else the process RSS sampled every 10 ms from ``/proc/self/statm``, Linux).
``HugePageArena`` and ``hold_in_huge_pages`` put a module's weights on 2 MB pages (the runtime's).
Nothing here imports anything beyond torch and the standard library.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


def peak_rss_bytes() -> int | None:
    """Peak resident memory of this process so far (Linux/macOS), else None."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB


def peak_memory_bytes() -> dict[str, int | None]:
    """Peak resident memory of this process (whole lifetime) and peak CUDA allocation (None
    without CUDA)."""
    from compress.core.device import cuda_available

    cuda = torch.cuda.max_memory_allocated() if cuda_available() else None
    return {"peak_rss_bytes": peak_rss_bytes(), "peak_cuda_allocated_bytes": cuda}


def rss_bytes() -> int:
    """Resident memory of this process now (Linux ``/proc/self/statm``), 0 where unreadable."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


class MemoryMonitor:
    """Peak memory during a ``with`` block: CUDA allocator peak, else sampled process RSS."""

    def __init__(self, device: torch.device, interval_s: float = 0.01) -> None:
        self.device, self.interval_s = device, interval_s
        self.peak_bytes = 0
        self.start_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_bytes = max(self.peak_bytes, rss_bytes())

    def __enter__(self) -> MemoryMonitor:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = torch.cuda.memory_allocated(self.device)
        else:
            self.start_bytes = self.peak_bytes = rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = max(self.peak_bytes, rss_bytes())
        if self.device.type == "cuda":
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)

    def metrics(self) -> dict[str, Any]:
        kind = "cuda_allocated" if self.device.type == "cuda" else "process_rss_sampled"
        return {
            "peak_memory_kind": kind,
            "memory_at_start_bytes": self.start_bytes,
            "peak_memory_bytes": self.peak_bytes,
            "peak_memory_over_start_bytes": max(0, self.peak_bytes - self.start_bytes),
        }


def available_memory_bytes(device: torch.device | None = None) -> int | None:
    """Memory this process may still take: on a CUDA ``device`` that GPU's free memory; else
    ``MemAvailable`` of ``/proc/meminfo``, lowered to what this process's memory cgroup and
    each cgroup above it still allow (``cgroup_headroom_bytes``); None where unreadable."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    found: list[int] = []
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    headroom = cgroup_headroom_bytes()
    if headroom is not None:
        found.append(headroom)
    return min(found) if found else None


def _read(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return None


def cgroup_headroom_bytes(root: str = "") -> int | None:
    """The least that this process's memory cgroup or any cgroup above it still allows: its
    limit minus its usage, the usage without the inactive file cache the kernel reclaims
    before it would kill (what ``docker stats`` calls used), or None without a limit. A
    container sees its own cgroup at the mount's root; a process under a systemd slice or a
    job scheduler sees it at the path ``/proc/self/cgroup`` names (cgroup v2: ``0::/path``,
    v1: ``N:...memory...:/path``), so both are read, and every ancestor, whose limit binds
    too. ``root`` prefixes every path read (tests)."""
    text = _read(f"{root}/proc/self/cgroup") or ""
    places = set()  # (mount, path inside it, limit file, usage file, reclaimable stat key)
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            places.add(("/sys/fs/cgroup", parts[2], "memory.max", "memory.current",
                        "inactive_file"))
        elif "memory" in parts[1].split(","):
            places.add(("/sys/fs/cgroup/memory", parts[2], "memory.limit_in_bytes",
                        "memory.usage_in_bytes", "total_inactive_file"))
    if not places:  # no /proc/self/cgroup: the mounts' roots alone
        places = {("/sys/fs/cgroup", "/", "memory.max", "memory.current", "inactive_file"),
                  ("/sys/fs/cgroup/memory", "/", "memory.limit_in_bytes",
                   "memory.usage_in_bytes", "total_inactive_file")}
    found = []
    for mount, path, limit_name, usage_name, reclaimable_key in places:
        path = "/" + path.strip("/")
        while True:
            folder = f"{root}{mount}{path if path != '/' else ''}"
            limit, usage = _read(f"{folder}/{limit_name}"), _read(f"{folder}/{usage_name}")
            try:
                if limit is not None and usage is not None and limit.strip() != "max" \
                        and int(limit) < 1 << 60:
                    used = int(usage)
                    for stat in (_read(f"{folder}/memory.stat") or "").splitlines():
                        key, _, value = stat.partition(" ")
                        if key == reclaimable_key:
                            used -= int(value)
                    found.append(max(int(limit) - max(used, 0), 0))
            except ValueError:
                pass
            if path == "/":
                break
            path = path.rsplit("/", 1)[0] or "/"
    return min(found) if found else None


def file_backed_copy(tensor: torch.Tensor, folder: str | os.PathLike[str]) -> torch.Tensor:
    """A copy of CPU ``tensor`` in a file of its own in ``folder``, mapped shared: the kernel
    writes its pages back to the file and drops them when memory runs short, and reads them
    back when touched, instead of the process being killed. The values are the same bits. The
    file is unlinked at once (its space returns when the copy is freed) and no descriptor is
    kept open, so thousands of copies need no more than their bytes of disk."""
    import tempfile

    if tensor.numel() == 0:
        return tensor.clone()
    handle, name = tempfile.mkstemp(dir=folder, suffix=".tensor")
    try:
        # the bytes written first, then mapped: a full disk is this OSError (ENOSPC) here, not
        # a SIGBUS later when the kernel fails to write back a page of a sparse file
        with os.fdopen(handle, "wb") as file:
            file.write(memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                                  .numpy()))
        mapped = torch.from_file(name, shared=True, size=tensor.numel(), dtype=tensor.dtype)
    finally:
        os.unlink(name)
    return mapped.view(tensor.shape)


def return_freed_memory() -> None:
    """Hand memory freed by Python and torch back to the OS (glibc ``malloc_trim``; a no-op
    elsewhere). glibc raises its mmap threshold after large frees, so the next layer's
    multi-megabyte tensors come from the heap, and a heap that is freed but not trimmed keeps
    counting as resident: measured +12 MB per streamed decoder layer at hidden 512 without it,
    flat with it."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            import ctypes

            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM = None


HUGE_PAGE_BYTES = 2 << 20  # a transparent huge page on x86-64 and arm64 (4 KB base pages)
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


def huge_page_mode() -> str | None:
    """The kernel's transparent-huge-page mode for anonymous memory ("always", "madvise" or
    "never"), None where unreadable (not Linux)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as handle:
            text = handle.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def _madvise_huge(address: int, nbytes: int) -> bool:
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


class HugePageArena:
    """One CPU buffer for many tensors, on 2 MB boundaries and advised ``MADV_HUGEPAGE`` before
    any page of it is touched, so the kernel backs it with 2 MB pages where its mode is "always"
    or "madvise" (``advised`` says whether madvise accepted the advice; the pages stay 4 KB
    under "never", see ``huge_page_mode``, or where the kernel has no 2 MB page free). ``take``
    copies a tensor into the next 64-byte-aligned slice and returns the copy; pages are
    committed as they are written, so moving tensors in one at a time, each freed after its
    copy, adds one tensor to the peak.

    Why: decode streams every weight byte once per token, and with 4 KB pages every 4 KB is a
    TLB miss and a stop for the hardware prefetchers. Measured on a Zen 5 EPYC (2 threads,
    4 KB against 2 MB pages in one process, scripts/bench_huge_pages.py): a 1.1B-shaped decode
    pass of our int4 op 1.10-1.29x (avx2 level 1.18-1.22x), int8 1.04-1.10x; a served 1.1B W4
    decode step 1.04-1.09x, SmolLM2's 1.00x (docs/notes/2026-12-05-huge-pages.md)."""

    def __init__(self, nbytes: int) -> None:
        # an untouched allocation: no page is committed (or made 4 KB) before the advice
        self.buffer = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
        base = self.buffer.data_ptr()
        self.offset = (-base) % HUGE_PAGE_BYTES
        span = (nbytes + HUGE_PAGE_BYTES - 1) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        self.advised = nbytes > 0 and _madvise_huge(base + self.offset, span)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of contiguous CPU ``tensor`` in the arena (same dtype, shape and values)."""
        nbytes = tensor.numel() * tensor.element_size()
        start = (self.offset + 63) // 64 * 64
        if start + nbytes > self.buffer.numel():
            raise ValueError(
                f"HugePageArena: {nbytes} bytes do not fit ({self.buffer.numel() - start} left)"
            )
        self.offset = start + nbytes
        view = self.buffer[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        return view


def _unshared(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` alone holds its storage (no view or other tensor on it), so moving it
    frees the original. The count includes the storage object made here to ask. A torch without
    that (private) count gets False: nothing is moved rather than anything held twice."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return use_count is not None and use_count(tensor.untyped_storage()._cdata) <= 2


def hold_in_huge_pages(modules: list[nn.Module], min_bytes: int = 4096) -> dict[str, int | bool]:
    """Move the plain CPU buffers and parameters of ``modules`` (not their submodules') of at
    least ``min_bytes`` into one ``HugePageArena``, one tensor at a time, each original
    freed once its copy replaces it: the weights that decode streams every token, on 2 MB pages
    where the kernel grants them (the arena says why, and what it measured). Left in place, and
    counted: tensors whose storage another tensor shares (a view; a tied embedding) and oneDNN's
    opaque packed weights (and torch's quantized tensors). Values, dtypes and shapes are
    unchanged. Returns the tensors moved, their bytes, the ones left and whether madvise
    accepted the advice."""
    todo: list[tuple[dict, str, bool]] = []  # (table, name, is a parameter): no tensor refs
    total = left = 0
    for module in modules:
        for table, is_param in ((module._buffers, False), (module._parameters, True)):
            for name, tensor in table.items():
                if tensor is None or tensor.numel() * tensor.element_size() < min_bytes:
                    continue
                plain = tensor.device.type == "cpu" and tensor.layout == torch.strided
                plain = plain and not (tensor.is_mkldnn or tensor.is_quantized)
                if plain and tensor.is_contiguous() and _unshared(tensor):
                    todo.append((table, name, is_param))
                    total += tensor.numel() * tensor.element_size() + 64
                else:
                    left += 1
    if not todo:
        return {"moved": 0, "moved_bytes": 0, "left": left, "advised": False}
    try:  # one reservation of every moved byte: a strict-overcommit host may refuse it
        arena = HugePageArena(total)
    except RuntimeError as error:
        log.warning("runtime: weights stay on 4 KB pages (no %d-byte arena: %s)", total, error)
        return {"moved": 0, "moved_bytes": 0, "left": left + len(todo), "advised": False}
    copies: dict[int, torch.Tensor] = {}  # the same tensor object in two tables: one copy
    moved_bytes = untrimmed = 0
    for table, name, is_param in todo:
        tensor = table[name]
        copy = copies.get(id(tensor))
        if copy is None:
            copy = copies[id(tensor)] = arena.take(tensor.detach())
            moved_bytes += copy.numel() * copy.element_size()
            untrimmed += copy.numel() * copy.element_size()
        table[name] = nn.Parameter(copy, requires_grad=False) if is_param else copy
        del tensor  # the original goes once no table holds it
        # glibc keeps freed heap chunks resident until trimmed: without this the originals
        # counted until the end (measured: a 1.1B W4 build peaked 2.10 GB against 1.60)
        if untrimmed >= 64 << 20:
            return_freed_memory()
            untrimmed = 0
    return_freed_memory()
    return {"moved": len(copies), "moved_bytes": moved_bytes, "left": left,
            "advised": arena.advised}  # fmt: skip
