"""Decode attention over the paged KV pool (``compress/kernels/cpu_attention.py``), every ISA
level this CPU builds, against its float64 plain-torch definition and against the runtime's
own attention (SDPA over the gathered keys); bad tables are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compress.kernels import cpu_attention, cpu_q8
from compress.runtime.paged import FP8, quantize_fp8, quantize_int8


def pool_case(b, h, hkv, d, bs, num_blocks, dtype, seed=0):
    """Random pools, each row's blocks drawn without replacement from a shuffled pool, random
    lengths from 1 to its table's slots (the last row the longest: tables are padded)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks * bs, hkv, d, generator=g)
    v = torch.randn(num_blocks * bs, hkv, d, generator=g)
    scales = None
    if dtype == torch.int8:  # PagedKVCache's rounding: per slot and head
        (k, ks), (v, vs) = quantize_int8(k), quantize_int8(v)
        scales = (ks, vs)
    if dtype == FP8:  # one scale per layer; keys past 448 x scale saturate
        scales = (torch.tensor([0.005]), torch.tensor([0.02]))
        k, v = quantize_fp8(k, scales[0]), quantize_fp8(v, scales[1])
    k, v = k.to(dtype), v.to(dtype)
    q = torch.randn(b, h, d, generator=g)
    nb = num_blocks // b
    order = torch.randperm(num_blocks, generator=g)
    tables = order[: b * nb].reshape(b, nb).contiguous()
    lengths = torch.randint(1, nb * bs + 1, (b,), generator=g)
    lengths[-1] = nb * bs
    return q, k, v, tables, lengths, scales


CASES = [  # b, heads, kv heads, head dim, block size, blocks
    (1, 4, 2, 16, 4, 6),
    (3, 9, 3, 64, 16, 12),  # SmolLM2's heads
    (5, 8, 8, 32, 4, 20),  # no grouping
    (2, 32, 4, 64, 16, 8),  # the 1.1B shape's heads
    (3, 14, 2, 128, 8, 10),  # seven heads per kv head (groups of 3, 3, 1), two column groups
    (2, 10, 2, 80, 4, 12),  # head dim 80: a 64-column group and one of 16 (AVX-512 build)
    (2, 6, 3, 24, 4, 8),  # head dim 24: not a multiple of 16, the AVX2 loop on every build
]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.int8, FP8], ids=["fp32", "bf16", "int8", "fp8"]
)
@pytest.mark.parametrize("softcap,window", [(None, None), (None, 5), (20.0, None), (20.0, 7)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_kernel_equals_the_float64_definition(isa, case, softcap, window, dtype):
    b, h, hkv, d, bs, blocks = case
    q, k, v, tables, lengths, scales = pool_case(b, h, hkv, d, bs, blocks, dtype)
    args = (q, k, v, tables, lengths, bs, d**-0.5, softcap, window)
    got = cpu_attention.paged_decode_attention(*args, scales=scales, isa=isa)
    want = cpu_attention.paged_decode_attention_reference(*args, scales=scales)
    assert got.dtype == torch.float32 and got.shape == (b, h, d)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


# each of the kernel's paths: per head (fp32; int8 below four heads a group), widened once per
# group (fp8), the AVX-512 groups of heads (head dims of 16s); with a sliding window
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, FP8], ids=["fp32", "int8", "fp8"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_kernel_with_attention_sinks_equals_the_float64_definition(isa, case, dtype, window=5):
    """GPT-OSS's sinks: a logit per query head joins each softmax without a value. Sinks of
    both signs and a few units, as trained ones are, take a visible share of the weight."""
    b, h, hkv, d, bs, blocks = case
    q, k, v, tables, lengths, scales = pool_case(b, h, hkv, d, bs, blocks, dtype)
    sinks = torch.randn(h, generator=torch.Generator().manual_seed(1)) * 2
    args = (q, k, v, tables, lengths, bs, d**-0.5, None, window)
    got = cpu_attention.paged_decode_attention(*args, scales=scales, sinks=sinks, isa=isa)
    want = cpu_attention.paged_decode_attention_reference(*args, scales=scales, sinks=sinks)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    plain = cpu_attention.paged_decode_attention(*args, scales=scales, isa=isa)
    assert (got - plain).abs().max() > 1e-2  # the sinks were applied


def test_reference_sinks_are_the_runtimes_sink_attention():
    """The definition with sinks is the runtime's (``explicit_attention``) over each row's
    gathered keys: the two computations of GPT-OSS's attention agree."""
    from compress.runtime.families import explicit_attention

    b, h, hkv, d, bs, blocks = 3, 9, 3, 64, 4, 12
    q, k, v, tables, lengths, _ = pool_case(b, h, hkv, d, bs, blocks, torch.float32, seed=3)
    sinks = torch.randn(h, generator=torch.Generator().manual_seed(2)) * 2
    want = cpu_attention.paged_decode_attention_reference(q, k, v, tables, lengths, bs, 0.125,
                                                          sinks=sinks)  # fmt: skip
    for row in range(b):
        n = int(lengths[row])
        slots = tables[row][torch.arange(n) // bs] * bs + torch.arange(n) % bs
        keys, values = k[slots].transpose(0, 1)[None], v[slots].transpose(0, 1)[None]
        mask = torch.ones(1, 1, 1, n, dtype=torch.bool)
        a = explicit_attention(q[row][None, :, None].double(), keys.double(), values.double(),
                               mask, 0.125, sinks=sinks.double())  # fmt: skip
        torch.testing.assert_close(a[0, :, 0], want[row])


def test_fp8_pages_decode_every_code_exactly(isa):
    """Each row attends to one key, so its output is that key's value row as the kernel widens
    it: all 254 finite e4m3fn codes (subnormals, both zeros, +-448) against torch's own
    fp8 -> fp32 conversion times the scale, bit for bit."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[[0x7F, 0xFF]] = 0  # the two NaN codes are never written
    d, bs = 64, 4
    v = codes.view(FP8).reshape(4, 1, d)  # four slots of 64 codes, one kv head
    pool_v = torch.zeros(4 * bs, 1, d, dtype=FP8)
    pool_v.view(torch.uint8)[::bs] = v.view(torch.uint8)  # the first slot of blocks 0..3
    scales = (torch.tensor([1.0]), torch.tensor([0.375]))
    q = torch.randn(4, 2, d)
    tables = torch.arange(4).reshape(4, 1).contiguous()
    lengths = torch.ones(4, dtype=torch.long)
    got = cpu_attention.paged_decode_attention(q, pool_v, pool_v, tables, lengths, bs, 0.125,
                                               scales=scales, isa=isa)  # fmt: skip
    want = (v.float() * 0.375).expand(4, 2, d)
    assert torch.equal(got, want)


def test_reference_equals_sdpa_over_gathered_keys():
    """The definition is the runtime's attention: SDPA (GQA) over each row's gathered keys, with
    a sliding-window mask."""
    b, h, hkv, d, bs, blocks = 3, 9, 3, 64, 4, 12
    q, k, v, tables, lengths, _ = pool_case(b, h, hkv, d, bs, blocks, torch.float32, seed=3)
    want = cpu_attention.paged_decode_attention_reference(q, k, v, tables, lengths, bs, 0.125,
                                                          window=6)  # fmt: skip
    for row in range(b):
        n = int(lengths[row])
        slots = tables[row][torch.arange(n) // bs] * bs + torch.arange(n) % bs
        keys, values = k[slots].transpose(0, 1)[None], v[slots].transpose(0, 1)[None]
        mask = (torch.arange(n) > n - 1 - 6)[None, None, None]
        a = F.scaled_dot_product_attention(
            q[row][None, :, None].double(), keys.double(), values.double(),
            attn_mask=mask, scale=0.125, enable_gqa=True,
        )  # fmt: skip
        torch.testing.assert_close(a[0, :, 0], want[row])


def test_bad_tables_and_pages_are_refused():
    if cpu_q8.unavailable_reason() is not None:
        pytest.skip(cpu_q8.unavailable_reason())
    q, k, v, tables, lengths, _ = pool_case(2, 4, 2, 16, 4, 6, torch.float32)
    run = cpu_attention.paged_decode_attention
    with pytest.raises(RuntimeError, match="outside the pool"):
        run(q, k, v, tables.clone().fill_(99), lengths, 4, 0.25)
    with pytest.raises(RuntimeError, match="length"):
        run(q, k, v, tables, lengths + 100, 4, 0.25)
    with pytest.raises(RuntimeError, match="fp32, bf16, int8 or fp8"):
        run(q, k.half(), v.half(), tables, lengths, 4, 0.25)
    with pytest.raises(RuntimeError, match="int8 and fp8 pages need k_scale and v_scale"):
        run(q, k.to(torch.int8), v.to(torch.int8), tables, lengths, 4, 0.25)
    with pytest.raises(RuntimeError, match="fp8 pages' scales must be one fp32 value"):
        run(q, k.to(FP8), v.to(FP8), tables, lengths, 4, 0.25,
            scales=(torch.ones(2), torch.ones(2)))  # fmt: skip
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        run(q[:, :3].contiguous(), k, v, tables, lengths, 4, 0.25)
    assert cpu_attention.unavailable_reason(torch.float16, torch.device("cpu")) is not None
    assert "CPU-only" in cpu_attention.unavailable_reason(torch.float32, torch.device("meta"))


# ---- the same loops over the runtime's contiguous cache ------------------------------------
def cache_case(b, h, hkv, d, length, dtype, seed=0, window=None):
    """A cache of more rows and slots than the step reads ([b + 1, hkv, length + 5, d]), read
    through the view [:b, :, :length] as the runtime reads it; left padding (each row's first
    slots masked, the first row none, the last all but one), and the last ``window`` keys."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(b + 1, hkv, length + 5, d, generator=g).to(dtype)
    v_cache = torch.randn(b + 1, hkv, length + 5, d, generator=g).to(dtype)
    pad = torch.randint(0, length, (b,), generator=g)
    pad[0], pad[-1] = 0, length - 1
    mask = torch.arange(length)[None] >= pad[:, None]  # [b, length]
    if window:
        mask &= torch.arange(length)[None] > length - 1 - window
    q = torch.randn(b, h, d, generator=g)
    return q, k_cache[:b, :, :length], v_cache[:b, :, :length], mask


CACHE_CASES = [  # b, heads, kv heads, head dim, keys
    (1, 4, 2, 16, 7),
    (3, 9, 3, 64, 40),  # SmolLM2's heads
    (2, 32, 4, 64, 300),  # the 1.1B shape's heads; past the one-thread size
    (3, 14, 2, 128, 33),
    (2, 10, 2, 80, 21),
    (2, 6, 3, 24, 9),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("softcap,window,sinks", [(None, None, False), (20.0, 5, False),
                                                  (None, None, True)])  # fmt: skip
@pytest.mark.parametrize("case", CACHE_CASES, ids=lambda c: "x".join(map(str, c)))
def test_cache_kernel_equals_the_float64_definition(isa, case, softcap, window, sinks, dtype):
    b, h, hkv, d, length = case
    q, keys, values, mask = cache_case(b, h, hkv, d, length, dtype, window=window)
    sink = torch.randn(h, generator=torch.Generator().manual_seed(1)) * 2 if sinks else None
    args = (q, keys, values, mask, d**-0.5, softcap, sink)
    got = cpu_attention.cache_decode_attention(*args, isa=isa)
    want = cpu_attention.cache_decode_attention_reference(*args)
    assert got.dtype == torch.float32 and got.shape == (b, h, d)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_cache_reference_equals_sdpa_with_the_mask():
    """The cache definition is the runtime's SDPA (GQA, bool mask) over the same view."""
    q, keys, values, mask = cache_case(3, 9, 3, 64, 40, torch.float32, seed=4, window=9)
    want = cpu_attention.cache_decode_attention_reference(q, keys, values, mask, 0.125)
    a = F.scaled_dot_product_attention(
        q[:, :, None].double(), keys.double(), values.double(), attn_mask=mask[:, None, None],
        scale=0.125, enable_gqa=True,
    )  # fmt: skip
    torch.testing.assert_close(a[:, :, 0], want)


def test_cache_kernel_with_masked_nan_slots_stays_finite(isa):
    """Masked slots are never read: NaN there (a cache's unwritten or padded slots) leaves the
    output equal to the same step with those slots zeroed."""
    q, keys, values, mask = cache_case(3, 8, 2, 32, 20, torch.float32, seed=5)
    clean = cpu_attention.cache_decode_attention(q, keys, values, mask, 0.2, isa=isa)
    keys.masked_fill_(~mask[:, None, :, None], float("nan"))
    values.masked_fill_(~mask[:, None, :, None], float("nan"))
    assert torch.equal(cpu_attention.cache_decode_attention(q, keys, values, mask, 0.2, isa=isa),
                       clean)  # fmt: skip


def test_bad_cache_arguments_are_refused():
    if cpu_q8.unavailable_reason() is not None:
        pytest.skip(cpu_q8.unavailable_reason())
    q, keys, values, mask = cache_case(2, 4, 2, 16, 6, torch.float32)
    run = cpu_attention.cache_decode_attention
    empty = mask.clone()
    empty[1] = False
    with pytest.raises(RuntimeError, match="row 1 of the mask has no key"):
        run(q, keys, values, empty, 0.25)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        run(q, keys.half(), values.half(), mask, 0.25)
    channels_first = keys.transpose(2, 3).contiguous().transpose(2, 3)  # same shape, stride 1 on L
    with pytest.raises(RuntimeError, match="contiguously"):
        run(q, channels_first, channels_first, mask, 0.25)
    with pytest.raises(RuntimeError, match="mask must be bool"):
        run(q, keys, values, mask[:, :3], 0.25)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        run(q[:, :3].contiguous(), keys, values, mask, 0.25)


PREFILL_CASES = [  # heads, kv heads, head dim, queries, offset
    (9, 3, 64, 1, 0),  # SmolLM2's heads; one query
    (9, 3, 64, 130, 0),  # a partial last block of queries (48 a block) and of keys (16 a tile)
    (8, 8, 32, 61, 0),  # no grouping
    (14, 2, 128, 50, 0),  # seven query heads a key head
    (4, 2, 80, 40, 37),  # a later chunk: queries at positions 37.. over 77 keys
    (2, 1, 16, 200, 5),  # more key blocks (64 keys) than query blocks reach alone
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: "x".join(map(str, c)))
def test_prefill_kernel_equals_the_float64_definition(isa, case, dtype):
    h, hkv, d, t, offset = case
    g = torch.Generator().manual_seed(t)
    # q, k and v as the runtime's prompt holds them: [H, T, D] views of token-major [T, H, D]
    q = (torch.randn(t, h, d, generator=g) * 2).to(dtype).transpose(0, 1)
    k, v = ((torch.randn(offset + t, hkv, d, generator=g) * 2).to(dtype).transpose(0, 1)
            for _ in range(2))  # fmt: skip
    got = cpu_attention.causal_prefill_attention(q, k, v, d**-0.5, offset, isa=isa)
    want = cpu_attention.causal_prefill_attention_reference(q, k, v, d**-0.5, offset)
    assert got.dtype == torch.float32 and got.shape == (t, h * d)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_prefill_kernel_reads_mixed_dtypes_and_any_layout(isa):
    """fp32 queries over bf16 keys and values (a bf16 cache's later chunk), contiguous keys and
    values (cache.read's), and heads whose channels are not contiguous (copied first): each the
    float64 definition."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(6, 33, 64, generator=g)
    k, v = (torch.randn(2, 50, 64, generator=g) for _ in range(2))
    for keys, values in [(k.bfloat16(), v), (k, v.bfloat16()), (k.bfloat16(), v.bfloat16()),
                         (k.transpose(1, 2).contiguous().transpose(1, 2), v)]:
        got = cpu_attention.causal_prefill_attention(q, keys, values, 0.125, 17, isa=isa)
        want = cpu_attention.causal_prefill_attention_reference(q, keys, values, 0.125, 17)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_prefill_reference_equals_sdpa_causal():
    """The prefill definition is SDPA's causal attention (GQA) at offset 0, and at an offset
    its bottom-right causal mask."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 20, 32, generator=g, dtype=torch.float64) for n in (6, 2, 2))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.2)
    want = cpu_attention.causal_prefill_attention_reference(q[0], k[0], v[0], 0.2)
    torch.testing.assert_close(a[0].transpose(0, 1).reshape(20, -1), want)
    seen = torch.arange(20)[None, :] <= (12 + torch.arange(8))[:, None]  # queries 12..19
    a = F.scaled_dot_product_attention(q[:, :, 12:], k, v, attn_mask=seen, enable_gqa=True,
                                       scale=0.2)  # fmt: skip
    want = cpu_attention.causal_prefill_attention_reference(q[0, :, 12:], k[0], v[0], 0.2, 12)
    torch.testing.assert_close(a[0].transpose(0, 1).reshape(8, -1), want)


def test_the_runtime_takes_the_prefill_kernel_where_it_was_measured_faster():
    cpu, why = torch.device("cpu"), cpu_q8.unavailable_reason()
    assert "cuda" in cpu_attention.prefill_unavailable_reason(64, torch.device("cuda"))
    assert "not measured faster" in cpu_attention.prefill_unavailable_reason(
        64, cpu, isa="avx512vnni")
    for head_dim in (80, 96, 256):  # head dims not measured
        assert f"heads of {head_dim}" in cpu_attention.prefill_unavailable_reason(
            head_dim, cpu, isa="avx2")
    for head_dim in (64, 128):
        assert cpu_attention.prefill_unavailable_reason(head_dim, cpu, isa="avx2") == why


def test_bad_prefill_arguments_are_refused():
    if cpu_q8.unavailable_reason() is not None:
        pytest.skip(cpu_q8.unavailable_reason())
    q, k = torch.randn(4, 10, 32), torch.randn(2, 10, 32)
    run = cpu_attention.causal_prefill_attention
    with pytest.raises(RuntimeError, match="multiple of 16"):
        run(q[..., :24], k[..., :24], k[..., :24], 0.2)
    with pytest.raises(RuntimeError, match="L = offset \\+ T expected"):
        run(q, k, k, 0.2, 3)
    with pytest.raises(RuntimeError, match="whole number of query heads"):
        run(q[:3], k, k, 0.2)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        run(q.half(), k.half(), k.half(), 0.2)
    with pytest.raises(RuntimeError, match="must match"):
        run(q, k, k[:, :, :16], 0.2)
