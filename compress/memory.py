"""Memory measurement, in one place: process peaks and a sampled peak over a block of code.

``peak_memory_bytes()`` is the whole-process view (peak RSS since the process started, from
``getrusage``, and the CUDA allocator's peak); ``MemoryMonitor`` measures one ``with`` block (CUDA
allocator peak, else the process RSS sampled every 10 ms from ``/proc/self/statm``, Linux).
Nothing here allocates or imports anything beyond torch and the standard library.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import torch


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


def available_memory_bytes() -> int | None:
    """Memory this process may still take: ``MemAvailable`` of ``/proc/meminfo``, lowered to
    the cgroup's limit minus its usage where one is set (a container); None where unreadable."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as lim, open(usage_file) as use:
                limit = lim.read().strip()
                if limit != "max" and int(limit) < 1 << 60:
                    found.append(int(limit) - int(use.read().strip()))
        except (OSError, ValueError):
            continue
    return min(found) if found else None


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
