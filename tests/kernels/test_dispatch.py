"""The one backend choice (``dispatch.plan_linear``) and the /proc/cpuinfo parser it relies on:
explicit backends run or raise with the shape, ``auto`` falls back with a reason logged once,
the runtime's decode preference (q4q8), and the flag parser on fixed sample texts."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from compress.kernels import KernelConstraintError, cpu_native, cpu_q8, cpuinfo, dispatch

CPU, META = torch.device("cpu"), torch.device("meta")

# Trimmed /proc/cpuinfo of two machines (one core each; real files repeat the block per core).
EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 23
model name\t: AMD EPYC 7B12 64-Core Processor
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat sse sse2 ht \
syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl pni pclmulqdq ssse3 \
fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy \
abm sse4a misalignsse 3dnowprefetch bmi1 avx2 smep bmi2 rdseed adx smap clflushopt clwb \
sha_ni xsaveopt xsavec xgetbv1 clzero xsaveerptr arat npt nrip_save umip rdpid
bugs\t\t: sysret_ss_attrs spectre_v1 spectre_v2 spec_store_bypass retbleed smt_rsb
bogomips\t: 4499.99
"""
XEON_AMX = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep sse sse2 ssse3 fma cx16 sse4_1 sse4_2 \
avx f16c avx2 bmi1 bmi2 avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx_vnni \
avx512_bf16 avx512vbmi avx512_vbmi2 gfni vaes avx512_vnni avx512_bitalg avx512_vpopcntdq \
amx_bf16 avx512_fp16 amx_tile amx_int8
vmx flags\t: vnmi preemption_timer posted_intr invvpid ept_x_only ept_ad
bugs\t\t: spectre_v1 spectre_v2 spec_store_bypass swapgs eibrs_pbrsb
"""
ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 asimddp\n"


# ---- cpuinfo ------------------------------------------------------------------------------
def test_flags_of_an_avx2_only_epyc():
    flags = cpuinfo.parse_flags(EPYC_AVX2)
    assert cpuinfo.has_avx2(flags) and not cpuinfo.has_vnni(flags)
    assert "avx512f" not in flags and "sha_ni" in flags
    # other lines' words are not flags
    assert not flags & {"spectre_v1", "EPYC", "AuthenticAMD", "4499.99"}


def test_flags_of_an_avx512_vnni_amx_xeon():
    flags = cpuinfo.parse_flags(XEON_AMX)
    assert cpuinfo.has_avx2(flags) and cpuinfo.has_vnni(flags)
    assert {"avx512f", "avx512_vnni", "avx_vnni", "amx_int8"} <= flags
    assert "vnmi" not in flags  # from "vmx flags", not "flags"


def test_model_names_for_the_environment_line():
    assert cpuinfo.parse_model_name(EPYC_AVX2) == "AMD EPYC 7B12 64-Core Processor"
    assert cpu_q8.supported_levels(cpuinfo.parse_flags(EPYC_AVX2)) == ["avx2"]
    assert cpu_q8.supported_levels(cpuinfo.parse_flags(XEON_AMX)) == [
        "avx512vnni",
        "avxvnni",
        "avx2",
    ]
    assert cpuinfo.parse_model_name(XEON_AMX) == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert cpuinfo.parse_model_name(ARM) is None


def test_flags_of_arm_and_of_nothing():
    assert "asimddp" in cpuinfo.parse_flags(ARM)
    assert not cpuinfo.has_avx2(cpuinfo.parse_flags(ARM))
    assert cpuinfo.parse_flags("") == frozenset()


def test_vnni_needs_only_one_of_the_three_flags():
    for flag in ("avx512_vnni", "avx_vnni", "amx_int8"):
        assert cpuinfo.has_vnni(frozenset({"avx2", flag}))


# ---- int4 / int8 weight-only layers -------------------------------------------------------
def plan(kind, requested="auto", device=CPU, n=64, k=128, group_size=32, **kw):
    return dispatch.plan_linear(
        kind, requested, device=device, n=n, k=k, group_size=group_size, **kw
    )


def test_auto_takes_the_native_cpu_kernels_where_the_shape_fits():
    assert plan("int4") == dispatch.Plan("cpu", None)
    assert plan("int8", group_size=128) == dispatch.Plan("cpu", None)
    assert plan("int8", group_size=None) == dispatch.Plan("cpu", None)  # None = per channel


@pytest.mark.parametrize(
    ("kind", "n", "group_size", "symmetric", "reason"),
    [
        ("int4", 24, 32, True, "N=24 not divisible by 16"),
        ("int4", 64, 16, True, "group_size 16 not in"),
        ("int8", 64, 128, False, "symmetric-only"),
        ("int8", 64, 32, True, "per-channel scales only"),
    ],
    ids=["int4-N24", "int4-g16", "int8-asym", "int8-grouped"],
)
def test_auto_falls_back_to_the_reference_with_the_reason(kind, n, group_size, symmetric, reason):
    got = plan(kind, n=n, group_size=group_size, symmetric=symmetric)
    assert got.backend == "reference" and reason in got.reason


def test_a_fallback_is_logged_once_at_debug(caplog):
    dispatch._log_fallback_once.cache_clear()  # earlier tests may have logged this reason
    with caplog.at_level(logging.DEBUG, logger=dispatch.__name__):
        for _ in range(3):
            plan("int4", n=40)
    records = [r for r in caplog.records if "N=40 not divisible by 16" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.DEBUG


def test_explicit_backends_run_or_raise_with_the_shape():
    assert plan("int4", "reference", n=24) == dispatch.Plan("reference", None)
    assert plan("int4", "cpu") == dispatch.Plan("cpu", None)
    with pytest.raises(KernelConstraintError, match="int4 layer N=24 K=128 group_size=32"):
        plan("int4", "cpu", n=24)
    with pytest.raises(KernelConstraintError, match="not on CPU"):
        plan("int8", "cpu", device=META, group_size=None)
    with pytest.raises(KernelConstraintError, match="backend='triton'"):
        plan("int4", "triton", device=META)


def test_auto_on_a_device_without_kernels_says_so():
    assert plan("int4", device=META) == dispatch.Plan("reference", "no fast path on meta")


def test_bad_names_raise():
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        plan("int4", "fast")
    with pytest.raises(ValueError, match="unknown layer kind 'int2'"):
        plan("int2")
    with pytest.raises(ValueError, match="int4_kernel='avx'"):
        plan("int4", phase="decode", int4_kernel="avx")


def test_float_layers_run_torch_and_plans_are_frozen():
    got = plan("float", group_size=None)
    assert got == dispatch.Plan("torch")
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.backend = "cpu"  # type: ignore[misc]


def test_resolve_backend_is_the_plans_backend_name():
    assert dispatch.resolve_backend(
        "auto", "int4", device=CPU, n=24, k=128, group_size=32, symmetric=True
    ) == plan("int4", n=24).backend == "reference"


# ---- the runtime's phases -----------------------------------------------------------------
def test_q4q8_is_a_runtime_preference_over_the_native_int4_kernel():
    reason = dispatch.q8_unavailable_reason()  # builds the kernels on first use (~1 minute)
    for phase in ("decode", "prefill"):  # both phases, so the runtime holds one layout
        want = dispatch.Plan("q4q8", None) if reason is None else dispatch.Plan("cpu", reason)
        assert plan("int4", phase=phase, int4_kernel="q4q8") == want
    # the torch preference, a layer's own forward and layers not on the native kernel keep theirs
    assert plan("int4", phase="decode") == dispatch.Plan("cpu", None)
    assert plan("int4", int4_kernel="q4q8") == dispatch.Plan("cpu", None)
    assert plan("int4", "reference", phase="decode", int4_kernel="q4q8").backend == "reference"
    assert plan("int4", n=24, phase="decode", int4_kernel="q4q8").backend == "reference"
    assert plan("int8", group_size=None, phase="decode", int4_kernel="q4q8").backend == "cpu"
    # K not a multiple of 64: the native kernel keeps the layer, with the reason
    odd = plan("int4", k=96, phase="decode", int4_kernel="q4q8")
    assert odd.backend == "cpu" and "multiple of 64" in odd.reason


def test_q8q8_takes_the_native_int8_kernels_layers_in_the_runtime():
    reason = dispatch.q8_unavailable_reason()
    if reason is not None:
        pytest.skip(f"integer-dot kernels unavailable: {reason}")
    kw = dict(phase="decode", int8_kernel="q8q8")
    assert plan("int8", group_size=None, **kw) == dispatch.Plan("q8q8", None)
    # grouped or asymmetric int8: the native kernel cannot, so the reference plan stays (the
    # runtime holds such a layer as a dequantized float in both phases)
    assert plan("int8", group_size=64, symmetric=False, **kw).backend == "reference"
    assert plan("int8", group_size=None, phase="prefill", int8_kernel="q8q8").backend == "q8q8"
    assert plan("int8", group_size=None, int8_kernel="q8q8").backend == "cpu"
    assert plan("int4", phase="decode", int8_kernel="q8q8").backend == "cpu"
    assert plan("int8", "reference", group_size=None, **kw).backend == "reference"
    with pytest.raises(ValueError, match="int8_kernel='fast'"):
        plan("int8", phase="decode", int8_kernel="fast")


# ---- W8A8 ---------------------------------------------------------------------------------
def test_w8a8_auto_on_cpu_uses_int_mm_only_with_int8_dot_products():
    got = plan("w8a8", group_size=None)
    if dispatch.cpu_int_mm_fast():
        assert got == dispatch.Plan("cpu", None)
    else:
        assert got.backend == "float_exact" and dispatch.cpu_int_mm_reason() in got.reason
    assert plan("w8a8", device=META).backend == "float_exact"


def test_int_mm_is_trusted_only_with_vnni_that_onednn_may_use():
    vnni512 = frozenset({"avx2", "avx512f", "avx512_vnni"})
    assert cpu_native.int_mm_inexact_reason(vnni512, None) is None
    assert cpu_native.int_mm_inexact_reason(vnni512, "avx512_core_amx") is None
    # capped below VNNI: oneDNN's vpmaddubsw path saturates int16 pair sums
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in cpu_native.int_mm_inexact_reason(vnni512, "AVX2")
    assert "ONEDNN_MAX_CPU_ISA" in cpu_native.int_mm_inexact_reason(vnni512, "AVX512_CORE")
    # a cap naming VNNI the CPU does not have (AVX-VNNI on an AVX512-VNNI-only CPU)
    assert cpu_native.int_mm_inexact_reason(vnni512, "AVX2_VNNI") is not None
    assert "VNNI" in cpu_native.int_mm_inexact_reason(frozenset({"avx2", "fma"}), None)


def test_w8a8_cpu_backend_refuses_where_int_mm_would_be_inexact(monkeypatch):
    dispatch.cpu_int_mm_reason.cache_clear()
    own = dispatch.cpu_int_mm_reason()
    if own is not None and "ONEDNN_MAX_CPU_ISA" not in own:  # e.g. an AVX2-only EPYC
        pytest.skip(f"torch._int_mm is refused here without the cap already: {own}")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    dispatch.cpu_int_mm_reason.cache_clear()  # the answer without the cap is cached just above
    try:
        with pytest.raises(KernelConstraintError, match="exactly: .*ONEDNN_MAX_CPU_ISA=AVX2"):
            plan("w8a8", "cpu")
        auto = plan("w8a8")
        assert auto.backend == "float_exact" and "ONEDNN_MAX_CPU_ISA=AVX2" in auto.reason
    finally:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
        dispatch.cpu_int_mm_reason.cache_clear()


def test_w8a8_explicit_backends_run_or_raise():
    for name in ("reference", "float_exact"):
        assert plan("w8a8", name, device=META) == dispatch.Plan(name, None)
    if dispatch.cpu_int_mm_fast():
        assert plan("w8a8", "cpu") == dispatch.Plan("cpu", None)
    else:
        with pytest.raises(KernelConstraintError, match="exactly"):
            plan("w8a8", "cpu")
    with pytest.raises(KernelConstraintError, match="w8a8 layer N=64 K=128"):
        plan("w8a8", "cpu", device=META)
    with pytest.raises(KernelConstraintError, match="backend='triton'"):
        plan("w8a8", "triton", device=META)
    with pytest.raises(ValueError, match="unknown W8A8 backend 'int4'"):
        plan("w8a8", "int4")
