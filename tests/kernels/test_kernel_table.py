"""The CUDA kernel choice per (shape, M): table lookup, the default without a table, the file
format, and the glue's torch-int4 layout. All on CPU: tables are passed in, nothing is timed."""

from __future__ import annotations

import pytest
import torch

from compress.kernels import kernel_table, reference

ENTRY_CONFIG = {"BLOCK_N": 128, "BLOCK_K": 16, "SPLIT_K": 16, "num_warps": 1, "num_stages": 1}


def _table(entries):
    return kernel_table.Table.from_dict({"gpu": "NVIDIA H200", "match": ["H200"],
                                         "entries": entries})  # fmt: skip


def _entry(m, kernel, us, op="int4", n=4096, k=4096, group_size=128, config=None):
    return {"op": op, "n": n, "k": k, "group_size": group_size, "m": m, "kernel": kernel,
            "us": us, "config": config}  # fmt: skip


TABLE = [
    _entry(1, "triton_gemv", {"triton_gemv": 4.0, "torch_int4pack": 9.0, "triton_gemm": 60.0},
           config=ENTRY_CONFIG),
    _entry(4, "torch_int4pack", {"triton_gemv": 12.0, "torch_int4pack": 10.0}),
    _entry(16, "torch_int4pack", {"torch_int4pack": 20.0, "triton_gemm": 50.0}),
    _entry(2048, "triton_gemm", {"torch_int4pack": 2300.0, "triton_gemm": 190.0}),
]  # fmt: skip


def _choose(table, m, **kw):
    args = dict(op="int4", n=4096, k=4096, group_size=128, m=m) | kw
    return kernel_table.choose(table, **args)


@pytest.mark.parametrize(
    ("m", "kernel"),
    [(1, "triton_gemv"), (2, "torch_int4pack"), (4, "torch_int4pack"), (9, "torch_int4pack"),
     (300, "triton_gemm"), (9000, "triton_gemm")],
    ids=lambda v: str(v),
)  # fmt: skip
def test_lookup_takes_the_smallest_measured_m_at_or_above(m, kernel):
    choice = _choose(_table(TABLE), m)
    assert choice.kernel == kernel and choice.source == "table"


def test_the_tables_gemv_config_comes_with_its_choice():
    choice = _choose(_table(TABLE), 1)
    assert dict(choice.config) == ENTRY_CONFIG
    assert _choose(_table(TABLE), 1, allowed=("triton_gemm",)).config is None


def test_an_explicit_triton_backend_takes_the_fastest_triton_kernel_measured():
    choice = _choose(_table(TABLE), 3, allowed=kernel_table.TRITON_KERNELS)
    assert choice.kernel == "triton_gemv" and choice.source == "table"
    # at M = 16 the GEMV cannot run: the measured triton_gemm
    assert _choose(_table(TABLE), 16, allowed=kernel_table.TRITON_KERNELS).kernel == "triton_gemm"


def test_torch_int4pack_needs_bf16_activations_and_a_shape_it_takes():
    table = _table(TABLE)
    assert _choose(table, 4, x_dtype=torch.float16).kernel == "triton_gemv"
    assert _choose(None, 1, k=4096 + 16, group_size=16 + 4096).kernel == "triton_gemv"
    assert _choose(None, 1, device_type="cpu").kernel == "triton_gemv"


@pytest.mark.parametrize(
    ("op", "m", "allowed", "kernel"),
    [("int4", 1, kernel_table.KERNELS, "torch_int4pack"),
     ("int4", 16, kernel_table.KERNELS, "torch_int4pack"),
     ("int4", 17, kernel_table.KERNELS, "triton_gemm"),
     ("int4", 4, kernel_table.TRITON_KERNELS, "triton_gemv"),
     ("int4", 5, kernel_table.TRITON_KERNELS, "triton_gemm"),
     ("int8", 1, kernel_table.KERNELS, "triton_gemv"),
     ("w8a8", 4, kernel_table.KERNELS, "triton_gemv"),
     ("w8a8", 2048, kernel_table.KERNELS, "triton_gemm")],
    ids=lambda v: v if isinstance(v, str | int) else "",
)  # fmt: skip
def test_default_without_a_table(op, m, allowed, kernel):
    choice = _choose(None, m, op=op, allowed=allowed)
    assert choice.kernel == kernel and choice.source == "default"


def test_a_shape_the_table_lacks_gets_the_default():
    choice = _choose(_table(TABLE), 1, n=576, k=576, group_size=64)
    assert choice.source == "default" and choice.kernel == "torch_int4pack"


def test_int4pack_inner_k_tiles():
    assert [kernel_table.int4pack_inner_k_tiles(k) for k in (4096, 576, 96, 80)] == [8, 4, 2, None]


def test_file_format_round_trip_and_errors():
    new = {"gpu": "NVIDIA H200", "match": ["H200"], "measured": {"date": "x"}, "entries": TABLE}
    old = {"gpu": "NVIDIA H100 80GB HBM3", "match": ["H100"], "entries": []}
    stale = {"gpu": "NVIDIA H200", "match": ["H200"], "entries": []}
    merged = kernel_table.merge_tables({"format": 1, "tables": [stale, old]}, new)
    tables = kernel_table.parse_file(merged)
    assert [t["gpu"] for t in tables] == ["NVIDIA H200", "NVIDIA H100 80GB HBM3"]
    chosen = kernel_table.select_table(tables, "NVIDIA H200 141GB")
    assert chosen is not None and len(chosen.index[("int4", 4096, 4096, 128)]) == 4
    assert kernel_table.select_table(tables, "Tesla T4") is None
    with pytest.raises(ValueError, match="format"):
        kernel_table.parse_file({"tables": []})
    with pytest.raises(ValueError, match="missing"):
        _table([{"op": "int4"}])
    with pytest.raises(ValueError, match="kernel 'cublas'"):
        _table([_entry(1, "cublas", {})])
    with pytest.raises(ValueError, match="config"):
        _table([_entry(1, "triton_gemv", {}, config={"BLOCK_N": 1})])


def test_no_committed_table_means_the_default():
    """Until the GPU check's table is committed the loader finds none (update when it is)."""
    from importlib import resources

    path = resources.files("compress.kernels") / "configs" / kernel_table.TABLE_FILE
    if path.is_file():
        pytest.skip("a measured table is committed")
    assert kernel_table.load_table("NVIDIA H200") is None


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_int4pack_parts_compute_our_weight_in_torchs_convention(symmetric):
    """torch computes (q - 8) * s + z from the pairs and scale_and_zero we hand it; checked
    through torch's CPU int4 kernel, which takes the same convention."""
    from compress.kernels import triton_ops

    g = torch.Generator().manual_seed(0)
    n, k, group = 16, 128, 32
    w_packed = reference.pack_int4(torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8))
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 0.01).to(torch.bfloat16)
    zeros = None
    if not symmetric:
        zeros = reference.pack_int4(
            torch.randint(-8, 8, (n, k // group), generator=g, dtype=torch.int8), dim=0
        )
    pairs, sz = triton_ops.int4pack_parts(w_packed, scales, zeros, group_size=group)
    assert pairs.shape == (n, k // 2) and sz.shape == (k // group, n, 2)
    q = torch.stack([pairs >> 4, pairs & 0xF], dim=-1).reshape(n, k).to(torch.int32)
    w_torch = ((q.float() - 8).view(n, -1, group) * sz[..., 0].t().float()[..., None]
               + sz[..., 1].t().float()[..., None]).view(n, k)  # fmt: skip
    w_ours = reference.int4_weight(w_packed, scales, zeros, group, k)
    torch.testing.assert_close(w_torch, w_ours, atol=2e-3, rtol=0)  # z rounded to bf16
    if hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 2)
        x = torch.randn(3, k, generator=g).to(torch.bfloat16)
        y = torch._weight_int4pack_mm_for_cpu(x, packed, group, sz)
        expected = x.float() @ w_ours.t()
        torch.testing.assert_close(y.float(), expected, atol=0.05, rtol=0.02)


def test_plans_carry_the_kernel_set_and_cuda_kernel_reads_the_choice(device):
    from compress.kernels import dispatch

    shape = dict(n=4096, k=4096, group_size=128)
    plan = dispatch.plan_linear("int4", "triton", device=device, **shape)
    assert plan.backend == "triton" and plan.kernel == "triton"
    at = dict(gpu_name="Tesla T4", **shape, m=1)  # no table matches: the default
    assert dispatch.cuda_kernel("int4", plan, **at).kernel == "triton_gemv"
    auto = dispatch.Plan("triton", kernel="auto")
    assert dispatch.cuda_kernel("int4", auto, **at).kernel == "torch_int4pack"
    assert dispatch.cuda_kernel("int8", auto, **at).kernel == "triton_gemv"
    assert dispatch.cuda_kernel("int4", dispatch.Plan("cpu"), **at) is None
