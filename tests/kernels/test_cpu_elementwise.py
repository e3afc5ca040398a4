"""The runtime's fused elementwise ops (``compress/kernels/cpu_elementwise.py``), every ISA level
this CPU builds, against their torch expressions in float64 and in fp32."""

from __future__ import annotations

import pytest
import torch

from compress.kernels import cpu_elementwise as ew
from compress.kernels import cpu_q8


def _ops(isa):
    return getattr(torch.ops, f"compress_{isa}")


@pytest.mark.parametrize("rows,cols", [(1, 576), (32, 576), (5, 2048), (3, 20)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_matches_torch(isa, rows, cols, dtype):
    g = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=g) * 3
    w = torch.randn(cols, generator=g)
    got = _ops(isa).rms_norm(x, w, 1e-5, dtype)
    want = ew.rms_norm_reference(x.double(), w.double(), 1e-5, torch.float64)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6)
    else:  # one bf16 rounding of the fp32 result, to nearest even as .to() does
        fp32 = _ops(isa).rms_norm(x, w, 1e-5, torch.float32)
        assert torch.equal(got, fp32.to(torch.bfloat16))


@pytest.mark.parametrize("rows,cols", [(1, 576), (32, 576), (3, 20)])
@pytest.mark.parametrize("y_dtype", [torch.float32, torch.bfloat16], ids=["y-fp32", "y-bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_add_rms_norm_matches_torch(isa, rows, cols, y_dtype, dtype):
    g = torch.Generator().manual_seed(rows + cols)
    x = torch.randn(rows, cols, generator=g)
    y = (torch.randn(rows, cols, generator=g) * 2).to(y_dtype)
    w = torch.randn(cols, generator=g)
    total, normed = _ops(isa).add_rms_norm(x, y, w, 1e-6, dtype)
    want_total, want = ew.add_rms_norm_reference(x.double(), y.double(), w.double(), 1e-6,
                                                 torch.float64)  # fmt: skip
    assert total.dtype == torch.float32 and normed.dtype == dtype
    assert torch.equal(total, x + y.float())  # one fp32 add, as torch's
    if dtype == torch.float32:
        torch.testing.assert_close(normed.double(), want, rtol=2e-6, atol=2e-6)
    else:
        assert torch.equal(normed, _ops(isa).rms_norm(total, w, 1e-6, torch.bfloat16))


def test_greedy_tokens_take_the_first_maximum_and_flag_non_finite_rows(isa):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 49157, generator=g)
    logits[1, [7, 40000]] = 50.0  # a tie: the first index, as argmax
    logits[2, 5] = float("nan")
    logits[3, 49156] = float("inf")  # in the tail past the last 8 columns
    logits[4, 100] = float("-inf")
    got = _ops(isa).greedy_tokens(logits)
    assert got.tolist() == ew.greedy_tokens_reference(logits).tolist()
    assert got[1] == 7 and got[2:5].tolist() == [-1, -1, -1] and got[0] == logits[0].argmax()


@pytest.mark.parametrize("qkv_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("norms", [False, True], ids=["plain", "qk-norm"])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 2, 16), (2, 1, 6)])
def test_rope_qkv_matches_torch(isa, heads, kv_heads, d, norms, qkv_dtype):
    g = torch.Generator().manual_seed(heads * d)
    rows = 7
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g).to(qkv_dtype)
    angles = torch.rand(rows, d // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    qn, kn = (torch.randn(d, generator=g), torch.randn(d, generator=g)) if norms else (None, None)
    got = _ops(isa).rope_qkv(qkv, cos, sin, heads, kv_heads, qn, kn, 1e-6)
    want = ew.rope_qkv_reference(qkv.double(), cos.double(), sin.double(), heads, kv_heads,
                                 None if qn is None else qn.double(),
                                 None if kn is None else kn.double(), 1e-6)  # fmt: skip
    for a, b, n in zip(got, want, (heads, kv_heads, kv_heads), strict=True):
        assert a.shape == (rows, n, d) and a.is_contiguous()
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (32, 1536), (3, 13)])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16], ids=["in-fp32", "in-bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_silu_mul_matches_torch(isa, rows, inter, in_dtype, dtype):
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 6
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's range ends, and 0
    gate_up = gate_up.to(in_dtype)
    got = _ops(isa).silu_mul(gate_up, dtype)
    want = ew.silu_mul_reference(gate_up.double(), torch.float64)
    assert got.dtype == dtype and got.shape == (rows, inter)
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: one rounding of 8 bits
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_stores_what_index_copy_stores(isa, dtype):
    g = torch.Generator().manual_seed(1)
    pools = [torch.randn(40, 3, 64, generator=g).to(dtype) for _ in range(2)]
    want = [p.clone() for p in pools]
    slots = torch.tensor([5, 17, 0, 39, 22])
    k, v = torch.randn(5, 3, 64, generator=g) * 10, torch.randn(5, 3, 64, generator=g)
    _ops(isa).write_kv(pools[0], pools[1], slots, k, v)
    ew.write_kv_reference(want[0], want[1], slots, k, v)
    assert torch.equal(pools[0], want[0]) and torch.equal(pools[1], want[1])
    with pytest.raises(RuntimeError, match="slot 40 outside the pool's 40"):
        _ops(isa).write_kv(pools[0], pools[1], torch.tensor([0, 1, 2, 3, 40]), k, v)
    assert torch.equal(pools[0], want[0])  # refused before writing anything


@pytest.mark.parametrize("d", [64, 20])
def test_write_kv_int8_stores_what_quantize_int8_stores(isa, d):
    """The bytes of the torch reference (codes and scales), ties of x / scale at .5 included
    (half to even), a zero row (scale 1e-8 / 127) and a NaN row (NaN scale, codes 0)."""
    g = torch.Generator().manual_seed(2)
    pools = [torch.randint(-127, 128, (40, 3, d), generator=g, dtype=torch.int8) for _ in "kv"]
    scales = [torch.rand(40, 3, generator=g) for _ in "kv"]
    want = [t.clone() for t in (*pools, *scales)]
    slots = torch.tensor([5, 17, 0, 39, 22])
    k, v = torch.randn(5, 3, d, generator=g) * 10, torch.randn(5, 3, d, generator=g)
    k[1, 0] = torch.arange(d) % 8 - 3.5  # absmax 4.5 -> scale 4.5/127; and exact halves below
    k[2, 1] = 0.0
    v[0, 2, :4] = torch.tensor([127.0, 2.5, -0.5, 1.5])  # scale 1: 2.5 -> 2, -0.5 -> 0, 1.5 -> 2
    v[0, 2, 4:] = 0.0
    _ops(isa).write_kv_int8(*pools, *scales, slots, k, v)
    ew.write_kv_int8_reference(*want, slots, k, v)
    for got, ref in zip((*pools, *scales), want, strict=True):
        assert torch.equal(got, ref)
    assert pools[1][slots[0], 2, :4].tolist() == [127, 2, 0, 2]
    k[3, 2, 5] = float("nan")
    _ops(isa).write_kv_int8(*pools, *scales, slots, k, v)
    assert scales[0][slots[3], 2].isnan() and not pools[0][slots[3], 2].any()
    with pytest.raises(RuntimeError, match="slot 40 outside the pool's 40"):
        _ops(isa).write_kv_int8(*pools, *scales, torch.tensor([0, 1, 2, 3, 40]), k, v)
    with pytest.raises(RuntimeError, match="scales must be contiguous fp32"):
        _ops(isa).write_kv_int8(*pools, scales[0][:, :2], scales[1], slots, k, v)


def test_bad_inputs_are_refused():
    if cpu_q8.unavailable_reason() is not None:
        pytest.skip(cpu_q8.unavailable_reason())
    ops = cpu_q8.ops()
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        ops.rms_norm(torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(4), 1e-6, torch.float32)
    with pytest.raises(RuntimeError, match="w must be"):
        ops.rms_norm(torch.ones(2, 4), torch.ones(5), 1e-6, torch.float32)
    with pytest.raises(RuntimeError, match="writes fp32 or bf16"):
        ops.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6, torch.float16)
    with pytest.raises(RuntimeError, match="heads \\+ 2 kv_heads"):
        ops.rope_qkv(torch.ones(2, 10), torch.ones(2, 2), torch.ones(2, 2), 2, 1, None, None, 0.0)
    with pytest.raises(RuntimeError, match="cos and sin"):
        ops.rope_qkv(torch.ones(2, 16), torch.ones(3, 4), torch.ones(2, 4), 2, 1, None, None, 0.0)
    with pytest.raises(RuntimeError, match="both q_norm and k_norm"):
        ops.rope_qkv(torch.ones(2, 16), torch.ones(2, 4), torch.ones(2, 4), 2, 1, torch.ones(4),
                     None, 0.0)  # fmt: skip
    with pytest.raises(RuntimeError, match="gate_up must be"):
        ops.silu_mul(torch.ones(2, 5), torch.float32)
    with pytest.raises(RuntimeError, match="y must be"):
        ops.add_rms_norm(torch.ones(2, 4), torch.ones(2, 5), torch.ones(4), 1e-6, torch.float32)
    with pytest.raises(RuntimeError, match="logits must be"):
        ops.greedy_tokens(torch.ones(2, 4, dtype=torch.bfloat16))
