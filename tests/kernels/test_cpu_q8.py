"""Our integer-dot CPU kernels (Q4 x Q8, Q8 x Q8), every ISA level this CPU has: the layouts
hold our int4/int8 weights exactly, each compiled level equals a float64 plain-torch model of
the same arithmetic, and that model is within int8 activation rounding of the exact product
(so the rounding is really there and bounded)."""

from __future__ import annotations

import pytest
import torch

from compress.kernels import cpu_q8, cpuinfo
from compress.quant.linear import QuantLinear, WeightScheme


def quant_layer(bits: int, n: int, k: int, group: int | None, symmetric: bool, seed: int = 0):
    torch.manual_seed(seed)
    return QuantLinear.from_linear(
        torch.nn.Linear(k, n, bias=False), WeightScheme(bits, group, symmetric)
    )


def q8_weight(layer: QuantLinear) -> cpu_q8.Q8Weight:
    zp = None if layer.scheme.symmetric else layer.weight_zero_point
    if layer.kind == "int4":
        return cpu_q8.prepack_int4(
            layer.weight_packed, layer.weight_scale, zp, group_size=layer.group_size,
            k=layer.in_features,
        )  # fmt: skip
    return cpu_q8.prepack_int8(layer.weight, layer.weight_scale, zp, group_size=layer.group_size)


LAYOUTS = [(4, 64, True), (4, 32, False), (8, None, True), (8, 64, False)]
LAYOUT_IDS = ["int4-g64-sym", "int4-g32-asym", "int8-channel-sym", "int8-g64-asym"]


@pytest.mark.parametrize("bits,group,symmetric", LAYOUTS, ids=LAYOUT_IDS)
def test_prepacked_layout_dequantizes_to_the_same_weights(bits, group, symmetric):
    layer = quant_layer(bits, 48, 192, group, symmetric)
    w = q8_weight(layer)
    rebuilt = cpu_q8.dequantize_reference(w)
    assert (w.offsets is None) == symmetric
    assert torch.allclose(rebuilt, layer.dequantized_weight().double(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("n,k,group,symmetric", [(48, 192, 64, True), (40, 128, 32, False),
                                                  (16, 1024, 128, False)])  # fmt: skip
def test_prepack_from_packed_bytes_equals_the_unpacked_codes_path(n, k, group, symmetric):
    # prepack_int4 moves the nibbles of our packed bytes; prepack_int4_reference builds the
    # layout from int32 codes: the same bytes, scales and offsets
    layer = quant_layer(4, n, k, group, symmetric, seed=3)
    zp = None if symmetric else layer.weight_zero_point
    args = (layer.weight_packed, layer.weight_scale, zp)
    got = cpu_q8.prepack_int4(*args, group_size=group, k=k)
    want = cpu_q8.prepack_int4_reference(*args, group_size=group, k=k)
    assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)
    assert (got.offsets is None) == symmetric
    assert symmetric or torch.equal(got.offsets, want.offsets)
    codes = torch.arange(-128, 128, dtype=torch.int8).repeat(2, 1)  # every int8 code
    w8 = cpu_q8.prepack_int8(codes, torch.ones(2, 1), None, group_size=256)
    assert torch.equal(w8.codes, (codes.to(torch.int16) + 128).to(torch.uint8))


def test_reference_is_the_exact_product_up_to_int8_activation_rounding():
    layer = quant_layer(4, 64, 576, 64, True)
    x = torch.randn(3, 576)
    exact = x.double() @ layer.dequantized_weight().double().T
    approx = cpu_q8.linear_q8_reference(x, q8_weight(layer))
    rel = ((approx - exact).norm() / exact.norm()).item()
    # half an int8 step per element of a gaussian block: ~0.5-1% of the output's norm
    assert 1e-4 < rel < 2e-2


def test_all_zero_activation_block_gives_zero_not_nan():
    layer = quant_layer(4, 16, 64, 32, False)
    x = torch.zeros(1, 64)
    x[0, 40] = 3.0  # second block non-zero, first all zeros
    y = cpu_q8.linear_q8_reference(x, q8_weight(layer))
    exact = x.double() @ layer.dequantized_weight().double().T
    assert torch.allclose(y, exact, atol=1e-5)  # one non-zero per block rounds exactly


def test_unsupported_shapes_are_named():
    assert "multiple of 64" in cpu_q8.unsupported_reason(16, 96, 32)
    assert "multiple of 32" in cpu_q8.unsupported_reason(16, 192, 48)
    assert "not divisible" in cpu_q8.unsupported_reason(16, 192, 128)
    layer = quant_layer(4, 16, 96, 32, True)
    with pytest.raises(ValueError, match="multiple of 64"):
        cpu_q8.prepack_int4(layer.weight_packed, layer.weight_scale, None, group_size=32, k=96)


def test_levels_follow_the_cpu_flags_and_the_override(monkeypatch):
    assert cpu_q8.supported_levels(frozenset({"avx2", "fma"})) == ["avx2"]
    assert cpu_q8.supported_levels(frozenset({"avx2", "fma", "avx_vnni"})) == ["avxvnni", "avx2"]
    assert cpu_q8.supported_levels(frozenset({"avx", "sse4_2"})) == []
    cpu_q8.selected_isa.cache_clear()
    monkeypatch.setenv(cpu_q8.ISA_ENV, "sse9")
    try:
        with pytest.raises(ValueError, match="expected one of"):
            cpu_q8.selected_isa()
    finally:
        cpu_q8.selected_isa.cache_clear()


# ---- the compiled levels ----------------------------------------------------------------
HERE = cpu_q8.supported_levels(cpuinfo.cpu_flags())


def tiled() -> list[str]:
    """The levels with a column-tile op that this CPU has and that build here (built on call)."""
    return [i for i in cpu_q8.TILE_WIDTHS if i in HERE and cpu_q8.build_reason(i) is None]


@pytest.mark.parametrize("bits,group,symmetric", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize(
    "n,k,m",
    [
        (64, 576, 1),  # SmolLM2 q_proj-like, one decode row
        (48, 576, 3),  # a small batch
        (32, 1536, 6),  # down_proj-like K; rows in chunks of 4 and 2
        (16, 64, 1),  # a single pair of blocks
        (70, 576, 8),  # prefill's row-tile GEMM from 8 rows: a part-filled tile, N % 4 = 2
        (36, 1536, 40),  # row tiles in pairs and alone (16 lanes), or 5 of 8 lanes
        (9, 64, 33),  # one pair of blocks, one column left over
        (20, 1536, 200),  # a long prompt: 13 (25) row tiles
    ],
)
def test_kernel_equals_float64_reference(isa, bits, group, symmetric, n, k, m):
    if group is not None and k % group:
        pytest.skip(f"group {group} does not divide K={k}")
    layer = quant_layer(bits, n, k, group, symmetric, seed=n + k)
    w = q8_weight(layer)
    x = torch.randn(m, k) * torch.linspace(0.1, 4.0, k)  # blocks of different scales
    x[0, :32] = 0.0  # an all-zero block: scale 1, codes 0
    y = cpu_q8.linear_q8(x, w, isa)
    ref = cpu_q8.linear_q8_reference(x, w)
    assert y.shape == (m, n) and y.dtype == torch.float32
    # integer block dots are exact; only fp32 scaling/accumulation order differs
    assert torch.allclose(y.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("m", [2, 24], ids=["decode loop", "prefill GEMM"])
def test_extreme_int8_codes_do_not_saturate(isa, m):
    # codes -128 and 127 against activations at +-127: the AVX2 sign trick's worst pairs
    torch.manual_seed(1)
    codes = (torch.randint(0, 2, (16, 128)) * 255 - 128).to(torch.int8)  # -128 or 127
    w = cpu_q8.prepack_int8(codes, torch.full((16, 1), 0.01), None, group_size=128)
    x = torch.randint(0, 2, (m, 128)).float() * 2 - 1  # +-1: every code rounds to +-127
    y = cpu_q8.linear_q8(x, w, isa)
    assert torch.allclose(y.double(), cpu_q8.linear_q8_reference(x, w), atol=1e-4, rtol=0)


@pytest.mark.parametrize("bits,group,symmetric", LAYOUTS, ids=LAYOUT_IDS)
def test_prefill_gemm_rows_equal_decode_rows(isa, bits, group, symmetric):
    # invariant: a prompt's rows through the GEMM equal each row through the decode loop (the
    # same integers; fp32 summation order only), so prefill and decode agree
    layer = quant_layer(bits, 44, 576, group, symmetric, seed=3)
    w = q8_weight(layer)
    x = torch.randn(19, 576)
    together = cpu_q8.linear_q8(x, w, isa)
    alone = torch.cat([cpu_q8.linear_q8(x[i : i + 1], w, isa) for i in range(19)])
    assert torch.allclose(together, alone, atol=1e-5 * alone.abs().max().item(), rtol=0)


@pytest.mark.parametrize("bits,group,symmetric", LAYOUTS, ids=LAYOUT_IDS)
def test_dequantize_equals_float64_reference(isa, bits, group, symmetric):
    # the long-prompt path's weights (FLOAT_GEMM_MIN_ROWS): fp32 of (code - bias) * s + o
    layer = quant_layer(bits, 37, 1536, group, symmetric, seed=5)
    w = q8_weight(layer)
    got = cpu_q8.dequantize(w, isa)
    ref = cpu_q8.dequantize_reference(w)
    assert got.shape == (37, 1536) and got.dtype == torch.float32
    assert torch.allclose(got.double(), ref, atol=1e-6 * ref.abs().max().item(), rtol=0)
    assert torch.allclose(ref, layer.dequantized_weight().double(), atol=1e-6, rtol=0)


def test_dequantize_bad_operands_raise_not_crash(isa):
    w = q8_weight(quant_layer(4, 16, 128, 64, True))
    op = cpu_q8.ops(isa).dequantize_q4
    with pytest.raises(RuntimeError, match="scales must be"):
        op(w.codes, w.scales[:8].contiguous(), None, 64)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        op(w.codes[:, :48].contiguous(), w.scales, None, 64)
    with pytest.raises(RuntimeError, match="codes must be"):
        op(w.codes.float(), w.scales, None, 64)


def test_float_gemm_rows_only_where_the_integer_gemm_loses():
    # measured per level (bench_prefill.py --dequant-gemm): AVX-VNNI's int4 row GEMM switches
    # for long prompts; AVX2's (since its steps keep their sums in registers) and 512-bit
    # vpdpbusd never do
    for isa in ("avx512vnni", "avx2", None):
        for bits in (4, 8):
            assert cpu_q8.float_gemm_min_rows(isa, bits) is None
    rows = cpu_q8.float_gemm_min_rows("avxvnni", 4)
    assert rows is not None and rows > cpu_q8.GEMM_MIN_ROWS


def test_kernel_keeps_leading_dims_and_dtype(isa):
    layer = quant_layer(4, 32, 64, 32, True)
    w = q8_weight(layer)
    x = torch.randn(2, 1, 64, dtype=torch.bfloat16)
    y = cpu_q8.linear_q8(x, w, isa)
    assert y.shape == (2, 1, 32) and y.dtype == torch.bfloat16
    ref = cpu_q8.linear_q8_reference(x.reshape(2, 64), w)
    assert torch.allclose(y.reshape(2, 32).double(), ref, atol=2e-2 * ref.abs().max().item())


def test_bad_operands_raise_not_crash(isa):
    layer = quant_layer(8, 16, 128, None, True)
    w = q8_weight(layer)
    op = cpu_q8.ops(isa).int8_linear_q8
    with pytest.raises(RuntimeError, match="codes must be"):
        op(torch.randn(1, 64), w.codes, w.scales, None, 128)  # K of x differs
    with pytest.raises(RuntimeError, match="multiple of 64"):
        op(torch.randn(1, 96), w.codes[:, :96].contiguous(), w.scales, None, 96)
    with pytest.raises(RuntimeError, match="scales must be"):
        op(torch.randn(1, 128), w.codes, w.scales[:8].contiguous(), None, 128)


# ---- the column-tile int4 layout (AVX512-VNNI: 16 columns a tile, AVX2: 8) -------------
@pytest.mark.parametrize("width", [16, 8])
@pytest.mark.parametrize("group,symmetric", [(32, False), (64, True), (128, True), (128, False)])
def test_column_tiles_round_trip_and_name_each_code(group, symmetric, width):
    # to_tiles is a permutation of the nibbles: from_tiles gives the row layout back exactly,
    # and byte 4c+i of step j holds column c's codes k = 8j+i (low) and 8j+4+i (high)
    w = q8_weight(quant_layer(4, 48, 256, group, symmetric, seed=7))
    t = cpu_q8.to_tiles(w, width)
    assert t.tiles and (t.n, t.k) == (48, 256) and t.codes.shape == (48 // width, 32, 4 * width)
    back = cpu_q8.from_tiles(t)
    assert torch.equal(back.codes, w.codes) and torch.equal(back.scales, w.scales)
    codes = cpu_q8.unpack_codes(w) + 8  # [N, K], 0..15
    tile = 32 // width  # the tile whose first column is 32
    byte = t.codes[tile, 5].view(width, 4).to(torch.float64)  # step 5
    assert torch.equal(byte % 16, codes[32:32 + width, 40:44])
    assert torch.equal(byte // 16, codes[32:32 + width, 44:48])
    assert torch.equal(t.scales[19 // width, :, 19 % width], w.scales[19])
    # the C++ conversions (where our kernels build) equal the torch definitions byte for byte
    ref = cpu_q8.to_tiles_reference(w, width)
    assert torch.equal(t.codes, ref.codes) and torch.equal(t.scales, ref.scales)
    assert torch.equal(cpu_q8.from_tiles_reference(ref).codes, w.codes)


def test_column_tiles_are_refused_where_they_do_not_apply():
    w4 = q8_weight(quant_layer(4, 24, 128, 32, True))
    assert "multiple of 16" in cpu_q8.tiles_reason(w4, "avx512vnni")
    assert cpu_q8.tiles_reason(w4, "avx2") is None  # 8 columns a tile there
    assert "avx512vnni, avx2 levels" in cpu_q8.tiles_reason(w4, "avxvnni")
    w8 = q8_weight(quant_layer(8, 32, 128, None, True))
    assert "int8" in cpu_q8.tiles_reason(w8, "avx2")
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_q8.to_tiles(w4)
    with pytest.raises(ValueError, match="width must be 8 or 16"):
        cpu_q8.to_tiles(w4, 4)
    with pytest.raises(ValueError, match="row layout"):
        cpu_q8.stack([cpu_q8.to_tiles(q8_weight(quant_layer(4, 16, 128, 32, True)))])


@pytest.mark.parametrize("group,symmetric", [(32, False), (64, True), (128, True), (128, False)])
# rows go through in steps of up to 4 (avx2 from 20 rows: 3, tiles in pairs)
@pytest.mark.parametrize("m", [1, 3, 6, 8, 13, 40])
# tiles go in pairs from 9 rows (avx2: 20); 48 leaves the last avx512vnni tile alone, 40 avx2's
@pytest.mark.parametrize("n", [40, 48, 64])
@pytest.mark.parametrize("isa", list(cpu_q8.TILE_WIDTHS))
def test_column_tile_kernel_equals_float64_reference(group, symmetric, m, n, isa):
    if isa not in tiled():
        pytest.skip(f"the column-tile op of the {isa} level is not built here")
    if n % cpu_q8.tile_width(isa):
        pytest.skip(f"N={n} is no multiple of the {isa} tile width")
    w = q8_weight(quant_layer(4, n, 512, group, symmetric, seed=m))
    x = torch.randn(m, 512) * torch.linspace(0.1, 4.0, 512)
    x[0, :32] = 0.0  # an all-zero block: scale 1, codes 0
    x[-1, 64:96] = torch.where(torch.arange(32) % 2 == 0, 127.0, -127.0)  # int16 sums at ±30480
    tiles = cpu_q8.to_tiles(w, cpu_q8.tile_width(isa))
    y = cpu_q8.linear_q8(x, tiles, isa)
    ref = cpu_q8.linear_q8_reference(x, w)
    assert y.shape == (m, n)
    assert torch.allclose(y.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=0)
    rows = cpu_q8.linear_q8(x, w, isa)  # the row layout: the same integers
    assert torch.allclose(y, rows, atol=1e-5 * rows.abs().max().item(), rtol=0)
    assert torch.equal(cpu_q8.linear_q8_reference(x, tiles), ref)


@pytest.mark.parametrize("m", [1, 24])  # one tile at a time; pairs of tiles and a lone one
def test_avx2_tile_int16_sums_at_their_extremes(m):
    # the AVX2 tile op adds a block's eight vpmaddubsw pairs in int16: codes 15 (or 0) against
    # activations ±127 give the largest sums the format allows; they must not wrap. From 20
    # rows the sums start at the block's correction (-8 x the code sum): codes 0 against ±127
    # put the low int16 of each lane at its bound, ∓32512
    if "avx2" not in tiled():
        pytest.skip("the avx2 level is not built here")
    layer = quant_layer(4, 24, 64, 32, True)
    w = q8_weight(layer)
    for code in (0, 15):
        codes = torch.full_like(w.codes, code * 17)  # both nibbles = code
        full = cpu_q8.Q8Weight(4, codes, torch.ones_like(w.scales), None, 32)
        for sign in (1.0, -1.0):
            x = torch.full((m, 64), sign * 127.0)
            y = cpu_q8.linear_q8(x, cpu_q8.to_tiles(full, 8), "avx2")
            assert torch.equal(y, torch.full((m, 24), sign * 127.0 * (code - 8) * 64))


@pytest.mark.parametrize(
    "n,k,group,symmetric",
    [
        (64, 512, 32, False),  # column tiles in pairs, a group per block
        (48, 256, 64, True),  # an odd tile count: the last tile alone
        (16, 1024, 128, False),
        (32, 384, 384, True),  # one group per row: 12 blocks, chunks of 4
    ],
)
@pytest.mark.parametrize("m", [1, 15, 16, 17, 40, 67])  # row tiles in pairs, alone, padded
def test_amx_tile_kernel_equals_the_vnni_tile_kernel_bit_for_bit(n, k, group, symmetric, m):
    # same integers, same fp32 operations in the same order: the runtime may send any row count
    # to either op without changing a token (csrc/q8_amx.cpp)
    reason = cpu_q8.amx_reason(cpu_q8.AMX_ISA) if cpu_q8.AMX_ISA in HERE else "no avx512vnni"
    if reason is not None:
        pytest.skip(f"the AMX tile op does not run here: {reason}")
    w = cpu_q8.to_tiles(q8_weight(quant_layer(4, n, k, group, symmetric, seed=m)))
    x = torch.randn(m, k) * torch.linspace(0.1, 4.0, k)
    x[0, :32] = 0.0  # an all-zero block: scale 1, codes 0
    amx = cpu_q8.linear_q8(x, w, cpu_q8.AMX_ISA, amx=True)
    vnni = cpu_q8.linear_q8(x, w, cpu_q8.AMX_ISA, amx=False)
    assert amx.shape == (m, n) and torch.isfinite(amx).all()
    assert torch.equal(amx, vnni)
    ref = cpu_q8.linear_q8_reference(x, w)
    assert torch.allclose(amx.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=0)


def _bf16_op_or_skip():
    reason = "no avx512vnni"
    if cpu_q8.AMX_ISA in HERE:
        reason = cpu_q8.amx_bf16_reason(cpu_q8.AMX_ISA)
    if reason is not None:
        pytest.skip(f"the AMX-BF16 tile op does not run here: {reason}")
    return cpu_q8.ops(cpu_q8.AMX_ISA).int4_linear_bf16_tiles_amx


@pytest.mark.parametrize(
    "n,k,group,symmetric,m",
    [
        (64, 512, 32, False, 1),  # column tiles in pairs, one row (padded to a tile)
        (48, 256, 64, True, 17),  # an odd tile count; a second row tile of one row
        (16, 1024, 128, False, 40),
        (32, 384, 384, True, 67),  # one group per row
        (32, 256, 64, True, 32),  # the last row count with exact codes, scaled per group
        (32, 256, 64, False, 33),  # the first with the scales folded into bf16 weights
        # 304 padded rows: K in chunks of 26 groups of 64 (1 MB of bf16 activations), 3 chunks
        (48, 4096, 64, False, 300),
    ],
)
def test_bf16_amx_tile_kernel_equals_float64_of_bf16_activations(n, k, group, symmetric, m):
    # x rounded to bf16 (no int8 rounding), the codes exact, fp32 sums per group
    op = _bf16_op_or_skip()
    w = cpu_q8.to_tiles(q8_weight(quant_layer(4, n, k, group, symmetric, seed=m)))
    x = torch.randn(m, k) * torch.linspace(0.1, 4.0, k)
    y = op(x, w.codes, w.scales, w.offsets, group)
    assert y.shape == (m, n) and y.dtype == torch.float32 and torch.isfinite(y).all()
    ref = cpu_q8.linear_bf16_reference(x, w)
    assert torch.allclose(y.double(), ref, atol=2e-6 * ref.abs().max().item(), rtol=0)
    # closer to the exact product than the int8 ops are (their activation rounding)
    exact = x.double() @ cpu_q8.dequantize_reference(w).T
    int8 = cpu_q8.linear_q8_reference(x, w)
    assert (y.double() - exact).abs().mean() < 0.5 * (int8 - exact).abs().mean()
    if symmetric:  # bf16 input: the same rounding, so the same outputs
        assert torch.equal(op(x.bfloat16(), w.codes, w.scales, None, group), y)


@pytest.mark.parametrize("n,k,m", [(16, 32, 1), (48, 96, 17), (64, 256, 40), (32, 2048, 33)])
def test_bf16_tiles_linear_equals_float64(n, k, m):
    # dense bf16 weights in B-tile order: float64 of the bf16-rounded x and w, fp32 sums; an
    # odd tile count, padded row tiles, fp32 and bf16 inputs alike
    op = _bf16_op_or_skip()
    del op
    torch.manual_seed(n + k + m)
    w = torch.randn(n, k).bfloat16()
    x = torch.randn(m, k)
    tiles = cpu_q8.bf16_to_tiles(w)
    assert tiles.shape == (n // 16, k // 2, 32)
    assert torch.equal(tiles[0, 3, 5], w[2, 7])  # element 2c + i of row r: w[16t + c, 2r + i]
    ops = cpu_q8.ops(cpu_q8.AMX_ISA)
    y = ops.bf16_linear_tiles_amx(x, tiles)
    ref = x.bfloat16().double() @ w.double().T
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert (y.double() - ref).abs().max() <= 2e-6 * ref.abs().max()
    assert torch.equal(ops.bf16_linear_tiles_amx(x.bfloat16(), tiles), y)
    # the runtime's question: the selected level's answer (None only at avx512vnni with AMX)
    assert cpu_q8.bf16_tiles_reason(w) == cpu_q8.amx_bf16_reason()
    assert "multiple of 16" in cpu_q8.bf16_tiles_reason(w[:8])
    with pytest.raises(RuntimeError, match=r"w must be contiguous bf16 \[N/16, K/2, 32\]"):
        ops.bf16_linear_tiles_amx(x[:, :-32].contiguous(), tiles)


def test_bf16_amx_rows_come_from_the_environment(monkeypatch):
    if cpu_q8.amx_bf16_reason() is not None:  # the selected level (COMPRESS_CPU_ISA may cap it)
        pytest.skip(f"the AMX-BF16 op does not run at the selected level: "
                    f"{cpu_q8.amx_bf16_reason()}")  # fmt: skip
    assert cpu_q8.bf16_amx_min_rows() == cpu_q8.BF16_AMX_MIN_ROWS
    for raw, rows in (("0", None), ("64", 64)):
        monkeypatch.setenv(cpu_q8.BF16_ROWS_ENV, raw)
        cpu_q8._bf16_rows_override.cache_clear()
        try:
            assert cpu_q8.bf16_amx_min_rows() == rows
        finally:
            cpu_q8._bf16_rows_override.cache_clear()
    monkeypatch.setenv(cpu_q8.BF16_ROWS_ENV, "many")
    try:
        with pytest.raises(ValueError, match="expected a row count"):
            cpu_q8.bf16_amx_min_rows()
    finally:
        cpu_q8._bf16_rows_override.cache_clear()


@pytest.mark.parametrize("kind", ["vnni", "amx", "bf16"])
def test_column_tile_ops_name_a_bad_argument(kind):
    # the ops check their arguments alike (csrc/q8_common.h check_tiles_args): an error that
    # names the tensor and the shape it must have, never a crash or a wrong read
    if cpu_q8.AMX_ISA not in HERE or cpu_q8.build_reason(cpu_q8.AMX_ISA) is not None:
        pytest.skip(f"the column-tile ops need the {cpu_q8.AMX_ISA} level, not built here")
    if kind == "amx" and cpu_q8.amx_reason(cpu_q8.AMX_ISA) is not None:
        pytest.skip(f"the AMX tile op does not run here: {cpu_q8.amx_reason(cpu_q8.AMX_ISA)}")
    ops = cpu_q8.ops(cpu_q8.AMX_ISA)
    op = {
        "vnni": lambda: ops.int4_linear_q8_tiles,
        "amx": lambda: ops.int4_linear_q8_tiles_amx,
        "bf16": _bf16_op_or_skip,
    }[kind]()
    w = cpu_q8.to_tiles(q8_weight(quant_layer(4, 32, 128, 64, True)))
    x = torch.randn(40, 128)
    with pytest.raises(RuntimeError, match=r"codes must be contiguous uint8 \[N/16, K/8, 64\]"):
        op(x, w.codes[:, :8].contiguous(), w.scales, None, 64)
    with pytest.raises(RuntimeError, match="scales must be contiguous fp32"):
        op(x, w.codes, w.scales[:, :1].contiguous(), None, 64)
    with pytest.raises(RuntimeError, match="K must be a multiple of 64"):
        op(torch.randn(40, 96), w.codes, w.scales, None, 32)
    with pytest.raises(RuntimeError, match="x must be a contiguous fp32"):
        op(x.double(), w.codes, w.scales, None, 64)
    with pytest.raises(RuntimeError, match="offsets must be fp32"):
        op(x, w.codes, w.scales, torch.zeros(32, 1), 64)


def test_amx_is_refused_with_a_reason_off_its_level_or_when_switched_off(monkeypatch):
    assert "avx512vnni" in cpu_q8.amx_reason("avx2")
    monkeypatch.setenv(cpu_q8.AMX_ENV, "0")
    cpu_q8.amx_reason.cache_clear()
    try:
        assert cpu_q8.amx_reason(cpu_q8.AMX_ISA) == f"{cpu_q8.AMX_ENV}=0"
    finally:
        cpu_q8.amx_reason.cache_clear()


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    # a build killed midway leaves torch's lock file, on which the next build would wait forever
    import os
    import time

    assert not cpu_q8._clear_stale_lock(tmp_path)  # no lock
    lock = tmp_path / "lock"
    lock.touch()
    assert not cpu_q8._clear_stale_lock(tmp_path) and lock.exists()  # a build may be running
    old = time.time() - cpu_q8.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    with pytest.warns(RuntimeWarning, match="stale build lock"):
        assert cpu_q8._clear_stale_lock(tmp_path)
    assert not lock.exists()
