"""CPU feature flags from ``/proc/cpuinfo``: one parser for every capability probe in kernels.

``parse_flags`` takes the file's text, so it is tested on fixed samples (an AVX2-only AMD EPYC,
an AVX-512/VNNI/AMX Xeon); ``cpu_flags`` reads this machine's file once, on first use. Linux
only: elsewhere (or when the file is unreadable) the set is empty, so every probe says no and
the dispatcher takes the portable path.
"""

from __future__ import annotations

import functools

# int8 dot-product instructions: the only CPUs where torch._int_mm beats widening to float32
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def parse_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of a ``/proc/cpuinfo`` text: the ``flags`` lines (x86) or
    ``Features`` lines (Arm), every core's, as one set."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return frozenset(flags)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This machine's flags (read once; empty when /proc/cpuinfo cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return parse_flags(f.read())
    except OSError:
        return frozenset()


def parse_model_name(cpuinfo: str) -> str | None:
    """The first ``model name`` of a ``/proc/cpuinfo`` text (x86), or None."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "model name":
            return value.strip()
    return None


@functools.cache
def cpu_model_name() -> str | None:
    """This machine's CPU model name (None when /proc/cpuinfo cannot be read or has none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return parse_model_name(f.read())
    except OSError:
        return None


# the flags that decide which kernels run (recorded beside every published number)
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_int8")


def has_avx2(flags: frozenset[str]) -> bool:
    return "avx2" in flags


def has_vnni(flags: frozenset[str]) -> bool:
    """AVX512-VNNI, AVX-VNNI or AMX int8 (``torch._int_mm`` on CPU is fast only with these)."""
    return bool(flags & VNNI_FLAGS)
