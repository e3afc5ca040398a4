"""The static-cache runtime: greedy outputs equal transformers' greedy decoding (fp32 tiny and
real model, batched with left padding, quantized layers through the same native kernels), stop
tokens, sampling, streaming, bad input, fallbacks, and one test of the compiled decode step."""

from __future__ import annotations

import pytest
import torch

from compress.kernels import cpu_float  # noqa: E402
from compress.quant.rtn import Int4RtnConfig, Int8RtnConfig, quantize_linears  # noqa: E402
from compress.runtime.engine import Runtime, _decode_step  # noqa: E402
from compress.testing import hf_greedy, make_tiny_llama  # noqa: E402

PROMPTS = [[1, 5, 9, 33, 70, 100, 7], [1, 40, 50], [1, 200, 13, 14, 15]]


@pytest.fixture
def model():
    # initializer_range 0.3: the default 0.02 makes a random model repeat one token, which
    # would let a broken runtime pass the equality tests.
    return make_tiny_llama(initializer_range=0.3)


def test_greedy_equals_transformers_fp32(model):
    rt = Runtime(model, max_seq_len=64, compile=False)
    for prompt in PROMPTS:
        ref = hf_greedy(model, prompt, 24)
        assert len(set(ref)) > 5  # the reference itself is not degenerate
        assert rt.generate([prompt], 24) == [ref]


def test_decode_reads_only_the_filled_cache_prefix(model):
    # NaN in every slot past the tokens written so far: a step that read (even masked) slots
    # beyond its prefix would turn NaN; it must not, and the tokens stay the reference's.
    rt = Runtime(model, max_seq_len=64, compile=False)
    prompt = PROMPTS[0]
    for cache in rt.k_cache + rt.v_cache:  # one buffer per layer
        cache.fill_(float("nan"))
    assert rt.generate([prompt], 12) == [hf_greedy(model, prompt, 12)]
    for cache in rt.k_cache:  # untouched beyond the end
        assert cache[0, :, len(prompt) + 11 :].isnan().all()


def test_default_kv_cache_dtype_follows_the_cpu(model):
    rt = Runtime(model, max_seq_len=16, compile=False)
    expected = torch.float32 if rt.prefill_dtype == torch.float32 else rt.decode_dtype
    assert {c.dtype for c in rt.k_cache + rt.v_cache} == {expected}
    assert (
        Runtime(model, max_seq_len=16, compile=False, kv_dtype=torch.bfloat16).k_cache[0].dtype
        == torch.bfloat16
    )


# Hand count of the tiny Llama's decode-phase bytes (make_tiny_llama: 2 layers, hidden 64,
# MLP 128, 4 heads of 16 with 2 KV heads, vocab 320, tied head): per layer q, o [64, 64],
# k, v [32, 64], gate, up [128, 64], down [64, 128] = 36,864 weights, and two fp32 norms.
LINEAR_WEIGHTS_PER_LAYER = 2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64
NORMS_PER_LAYER = 2 * 64 * 4  # fp32
HEAD_NORM = 64 * 4


def _hand_count(kind: str) -> int:
    if kind == "fp32":  # every matrix in fp32, the (tied) head included
        layer = LINEAR_WEIGHTS_PER_LAYER * 4 + NORMS_PER_LAYER
        return 2 * layer + HEAD_NORM + 320 * 64 * 4
    if kind == "fp32-bf16-decode":  # decode reads the bf16 copies, not the fp32 prefill ones
        layer = LINEAR_WEIGHTS_PER_LAYER * 2 + NORMS_PER_LAYER
        return 2 * layer + HEAD_NORM + 320 * 64 * 2
    # int4 g32 in torch's CPU layout: codes uint8 [N, K/2] (1/2 byte per weight) and bf16
    # (scale, zero) pairs [K/32, N, 2] (4 bytes per 32 weights = 1/8 byte); the float head is
    # held in the decode dtype: bf16 where the CPU multiplies bf16, else the model's fp32
    layer = LINEAR_WEIGHTS_PER_LAYER // 2 + LINEAR_WEIGHTS_PER_LAYER // 8 + NORMS_PER_LAYER
    return 2 * layer + HEAD_NORM + 320 * 64 * (2 if kind == "int4-g32-bf16-head" else 4)


@pytest.mark.parametrize("kind", ["fp32", "fp32-bf16-decode", "int4-g32"])
def test_decode_bytes_match_a_hand_count(model, kind):
    """What the MBU column divides by: the decode-phase weights and the allocated KV cache (an
    upper bound of what one step reads: it attends to the filled prefix of its rows)."""
    if kind == "int4-g32":
        quantize_linears(model, Int4RtnConfig(group_size=32), 4, "test")
    decode = torch.bfloat16 if kind == "fp32-bf16-decode" else None
    rt = Runtime(model, max_seq_len=48, max_batch_size=3, compile=False, decode_dtype=decode)
    assert rt.kv_dtype == torch.float32  # fp32 weights: fp32 prefill, so an fp32 cache on CPU
    # K and V x 2 layers x 3 rows x 2 KV heads x 48 slots x head_dim 16 x 4 bytes
    kv = 2 * 2 * 3 * 2 * 48 * 16 * 4
    if kind == "int4-g32" and cpu_float.cpu_bf16_matmuls():
        kind = "int4-g32-bf16-head"
    assert rt.decode_bytes() == {"weights": _hand_count(kind), "kv_cache": kv}
    assert _hand_count("fp32") == 378112 and _hand_count("int4-g32-bf16-head") == 88320
    assert _hand_count("fp32-bf16-decode") == 189696


def test_batch_with_left_padding_equals_single_rows(model):
    rt = Runtime(model, max_seq_len=64, max_batch_size=3, compile=False)
    assert rt.generate(PROMPTS, 16) == [hf_greedy(model, p, 16) for p in PROMPTS]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_attention_runs_our_cache_kernel_and_keeps_sdpas_tokens(model, kv_dtype):
    """On a CPU where the kernels build, one-query attention goes through
    cpu_attention.cache_decode_attention; with it taken away (SDPA, the runtime's attention
    elsewhere) a batch with left padding gives the same tokens. Logits: within fp32 rounding of
    SDPA's on an fp32 cache; on a bf16 cache at least as close to the fp32 cache's as SDPA's
    (which also rounds the query and its output to bf16)."""
    from compress.kernels import cpu_attention

    reason = cpu_attention.unavailable_reason(kv_dtype, torch.device("cpu"), 16)
    if reason is not None:
        pytest.skip(reason)
    runs = {}
    for name, dtype in (("kernel", kv_dtype), ("sdpa", kv_dtype), ("fp32", torch.float32)):
        rt = Runtime(model, max_seq_len=64, max_batch_size=3, compile=False, kv_dtype=dtype,
                     keep_model_weights=True)  # fmt: skip
        assert all(layer.cache_attention is not None for layer in rt.layers)
        if name != "kernel":
            for layer in rt.layers:
                layer.cache_attention = None
        rt.prefill(PROMPTS[0][:2])  # then one-token decode steps: their logits
        logits = torch.stack([rt.score([token])[0] for token in PROMPTS[0][2:]])
        runs[name] = (rt.generate(PROMPTS, 16), logits)
    assert runs["kernel"][0] == runs["sdpa"][0]
    kernel, sdpa, exact = (runs[name][1] for name in ("kernel", "sdpa", "fp32"))
    if kv_dtype == torch.float32:
        torch.testing.assert_close(kernel, sdpa, rtol=1e-4, atol=1e-4)
    else:
        assert (kernel - exact).abs().max() <= (sdpa - exact).abs().max()


@pytest.mark.parametrize(
    "cfg,bits", [(Int4RtnConfig(group_size=32), 4), (Int8RtnConfig(), 8)], ids=["int4-g32", "int8"]
)
def test_quantized_native_kernels_equal_transformers(model, cfg, bits):
    quantize_linears(model, cfg, bits, "test")
    # fp32 decode keeps lm_head in fp32 as transformers does; the quantized layers run the same
    # native kernels (bf16 activations) on both sides; the model keeps its weights to run.
    rt = Runtime(model, max_seq_len=64, decode_dtype=torch.float32, compile=False,
                 keep_model_weights=True)  # fmt: skip
    kinds = {type(m).__name__ for m in rt.layers.modules()}
    assert {"_Int4Linear" if bits == 4 else "_Int8Linear"} <= kinds
    for prompt in PROMPTS[:2]:
        assert rt.generate([prompt], 16) == [hf_greedy(model, prompt, 16)]


def test_quantized_default_bf16_decode_stays_close(model):
    quantize_linears(model, Int4RtnConfig(group_size=32), 4, "test")
    ref = hf_greedy(model, PROMPTS[0], 12)
    out = Runtime(model, max_seq_len=64, compile=False).generate([PROMPTS[0]], 12)[0]
    # bf16 lm_head may flip a near tie late; the first tokens must agree.
    assert out[:4] == ref[:4]


@pytest.mark.parametrize("bits", [4, 8])
def test_q8_kernel_decode_equals_transformers_with_the_same_kernel(model, bits):
    from compress.kernels import cpu_q8
    from compress.quant.linear import QuantLinear

    if cpu_q8.unavailable_reason() is not None:
        pytest.skip(f"integer-dot kernels not available here: {cpu_q8.unavailable_reason()}")
    if bits == 4:
        quantize_linears(model, Int4RtnConfig(group_size=32), 4, "test")
    else:
        quantize_linears(model, Int8RtnConfig(), 8, "test")
    kernels = dict(int4_kernel="q4q8") if bits == 4 else dict(int8_kernel="q8q8")
    rt = Runtime(model, max_seq_len=64, decode_dtype=torch.float32, compile=False, **kernels,
                 keep_model_weights=True)  # the model runs too, below  # fmt: skip
    holder = "_Int4Linear" if bits == 4 else "_Int8Linear"
    q8 = [m.q8 for m in rt.layers.modules() if type(m).__name__ == holder]
    assert q8 and all(q is not None for q in q8)
    assert rt.q8_isa in cpu_q8.ISA_LEVELS
    # transformers side: our kernel for the prompt (its row-tile GEMM from 8 rows on) and for
    # one-token steps, as the runtime does in both phases (the kernel itself is checked
    # against a float64 model in tests/kernels/test_cpu_q8.py)
    for layer in model.modules():
        if isinstance(layer, QuantLinear):
            w = _q8_weight(layer)
            layer.register_forward_hook(lambda _m, args, out, w=w: cpu_q8.linear_q8(args[0], w))
    long_prompt = [1, 5, 9, 33, 70, 100, 7, 8, 21, 64, 3, 99, 17]  # prefill through the GEMM
    for prompt in [*PROMPTS[:2], long_prompt]:
        assert rt.generate([prompt], 12) == [hf_greedy(model, prompt, 12)]


def _q8_weight(layer):
    """A QuantLinear's weight in our kernels' layout, made here from the layer's own tensors."""
    from compress.kernels import cpu_q8

    zp = None if layer.scheme.symmetric else layer.weight_zero_point
    if layer.kind == "int4":
        return cpu_q8.prepack_int4(layer.weight_packed, layer.weight_scale, zp,
                                   group_size=layer.group_size, k=layer.in_features)  # fmt: skip
    return cpu_q8.prepack_int8(layer.weight, layer.weight_scale, zp, group_size=layer.group_size)


@pytest.mark.parametrize("bits", [4, 8])
def test_q8_kernel_long_prompts_switch_to_the_dequantized_fp32_gemm(model, bits, monkeypatch):
    # FLOAT_GEMM_MIN_ROWS (AVX-VNNI's long int4 prompts) set to 8 rows for whichever level runs
    # here: prompts of 8+ tokens must then equal transformers on the dequantized fp32 weights
    # and one-token steps transformers on our kernel
    from compress.kernels import cpu_q8

    if cpu_q8.unavailable_reason() is not None:
        pytest.skip(f"integer-dot kernels not available here: {cpu_q8.unavailable_reason()}")
    quantize_linears(model, Int4RtnConfig(group_size=32) if bits == 4 else Int8RtnConfig(),
                     bits, "test")  # fmt: skip
    monkeypatch.setitem(cpu_q8.FLOAT_GEMM_MIN_ROWS, cpu_q8.selected_isa(), {bits: 8})
    # the switch is the row layout's: int4 column tiles never take it (checked below), so the
    # int4 run holds rows
    with_tiles = Runtime(model, max_seq_len=64, compile=False, int4_kernel="q4q8",
                         keep_model_weights=True)
    if bits == 4 and cpu_q8.tile_width(cpu_q8.selected_isa()) is not None:
        held = [m.q8 for m in with_tiles.layers.modules() if type(m).__name__ == "_Int4Linear"]
        assert held and all(q.tiles and q.float_rows is None for q in held)
    monkeypatch.setattr(cpu_q8, "TILE_WIDTHS", {})
    kernels = dict(int4_kernel="q4q8") if bits == 4 else dict(int8_kernel="q8q8")
    rt = Runtime(model, max_seq_len=64, decode_dtype=torch.float32, compile=False, **kernels,
                 keep_model_weights=True)  # the model runs too, below  # fmt: skip
    holder = "_Int4Linear" if bits == 4 else "_Int8Linear"
    assert all(m.q8.float_rows == 8 for m in rt.layers.modules() if type(m).__name__ == holder)

    def ours(layer, x2):
        w = _q8_weight(layer)
        if x2.shape[0] >= 8:
            return torch.nn.functional.linear(x2.float(), cpu_q8.dequantize_reference(w).float())
        return cpu_q8.linear_q8(x2, w)

    _assert_long_prompt_tokens_with(model, rt, ours)


def _assert_long_prompt_tokens_with(model, rt, linear) -> None:
    """``rt`` greedy on a 13-token prompt equals transformers' with every QuantLinear's output
    replaced by ``linear(layer, x [rows, K])``."""
    from compress.quant.linear import QuantLinear

    def hook(layer, args, out):
        x = args[0]
        y = linear(layer, x.reshape(-1, x.shape[-1]))
        return y.reshape(*x.shape[:-1], -1).to(x.dtype)

    for layer in model.modules():
        if isinstance(layer, QuantLinear):
            layer.register_forward_hook(hook)
    long_prompt = [1, 5, 9, 33, 70, 100, 7, 8, 21, 64, 3, 99, 17]
    assert rt.generate([long_prompt], 12) == [hf_greedy(model, long_prompt, 12)]


def test_q8_kernel_big_steps_take_the_bf16_amx_op(model, monkeypatch):
    # BF16_AMX_MIN_ROWS lowered to 8: prompts of 8+ tokens run the AMX-BF16 op (bf16
    # activations) in every int4 layer, one-token steps our int8-activation kernel; transformers
    # with the same two ops per row count gives the same tokens
    from compress.kernels import cpu_q8

    if cpu_q8.unavailable_reason() is not None:
        pytest.skip(f"integer-dot kernels not available here: {cpu_q8.unavailable_reason()}")
    if cpu_q8.amx_bf16_reason() is not None:
        pytest.skip(f"the AMX-BF16 op does not run here: {cpu_q8.amx_bf16_reason()}")
    quantize_linears(model, Int4RtnConfig(group_size=32), 4, "test")
    monkeypatch.setattr(cpu_q8, "BF16_AMX_MIN_ROWS", 8)
    rt = Runtime(model, max_seq_len=64, decode_dtype=torch.float32, compile=False,
                 int4_kernel="q4q8", keep_model_weights=True)  # fmt: skip
    q8 = [m.q8 for m in rt.layers.modules() if type(m).__name__ == "_Int4Linear"]
    assert q8 and all(q.bf16_rows == 8 and q.tiles for q in q8)
    op = cpu_q8.ops().int4_linear_bf16_tiles_amx
    for rows, expected in ((8, op), (7, cpu_q8.ops().int4_linear_q8_tiles)):  # the dispatch
        x = torch.randn(rows, q8[0].weight.k)
        assert torch.equal(q8[0](x), expected(x, q8[0].codes, q8[0].scales, None, 32))

    def ours(layer, x2):
        w = cpu_q8.to_tiles(_q8_weight(layer))
        x2 = x2.float().contiguous()
        if x2.shape[0] >= 8:
            return op(x2, w.codes, w.scales, w.offsets, w.group_size)
        return cpu_q8.linear_q8(x2, w)

    _assert_long_prompt_tokens_with(model, rt, ours)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_lm_head_equals_transformers_with_that_head(model, bits):
    import copy

    from compress.quant.linear import QuantLinear
    from compress.runtime.layers import LM_HEAD_SCHEMES

    rt = Runtime(
        model, max_seq_len=64, decode_dtype=torch.float32, compile=False, lm_head_bits=bits
    )
    assert type(rt.head.lm_head).__name__ == ("_Int4Linear" if bits == 4 else "_Int8Linear")
    reference = copy.deepcopy(model)  # the same RTN head, run by QuantLinear's native kernels
    reference.lm_head = QuantLinear.from_linear(model.lm_head, LM_HEAD_SCHEMES[bits])
    assert torch.equal(model.get_input_embeddings().weight, model.lm_head.weight)  # untouched
    for prompt in PROMPTS[:2]:
        assert rt.generate([prompt], 12) == [hf_greedy(reference, prompt, 12)]
    with pytest.raises(ValueError, match="lm_head_bits=3"):
        Runtime(model, max_seq_len=64, compile=False, lm_head_bits=3)


def test_a_head_its_groups_do_not_divide_is_refused_with_the_way_out():
    narrow = make_tiny_llama(hidden_size=48, head_dim=12)  # 48: no groups of 32
    with pytest.raises(ValueError, match="groups of 32, which do not divide hidden_size 48; "
                                         "use lm_head_bits=8"):
        Runtime(narrow, max_seq_len=32, compile=False, lm_head_bits=4)
    rt = Runtime(narrow, max_seq_len=32, decode_dtype=torch.float32, compile=False,
                 lm_head_bits=8)
    assert len(rt.generate([PROMPTS[0]], 4)[0]) == 4


def test_q4q8_unavailable_falls_back_with_warning(model, monkeypatch):
    from compress.kernels import cpu_q8

    quantize_linears(model, Int4RtnConfig(group_size=32), 4, "test")
    monkeypatch.setattr(cpu_q8, "unavailable_reason", lambda: "no C++ compiler")
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        rt = Runtime(model, max_seq_len=64, compile=False, int4_kernel="q4q8")
    assert rt.int4_kernel == "torch" and rt.q8_isa is None
    assert not any(getattr(m, "q8", None) is not None for m in rt.layers.modules())
    with pytest.raises(ValueError, match="int4_kernel='fast'"):
        Runtime(model, max_seq_len=64, compile=False, int4_kernel="fast")


def test_bucketed_prefill_equals_transformers(model):
    # compile_prefill pads prompts to power-of-two buckets (here eager, the same padding).
    rt = Runtime(model, max_seq_len=64, max_batch_size=2, compile=False, compile_prefill=True)
    assert rt.generate(PROMPTS[:2], 12) == [hf_greedy(model, p, 12) for p in PROMPTS[:2]]


def test_stop_tokens_end_each_row_and_are_included(model):
    rt = Runtime(model, max_seq_len=64, max_batch_size=2, compile=False)
    full = rt.generate(PROMPTS[:2], 20)
    stop = full[0][5]
    out = rt.generate(PROMPTS[:2], 20, stop_tokens=[stop])
    for row, ref in zip(out, full, strict=True):
        cut = ref.index(stop) + 1 if stop in ref else len(ref)
        assert row == ref[:cut]


def test_stream_yields_the_generate_tokens(model):
    rt = Runtime(model, max_seq_len=64, compile=False)
    assert list(rt.stream(PROMPTS[0], 10)) == rt.generate([PROMPTS[0]], 10)[0]


def test_sampling_is_seeded_and_top_k_1_is_greedy(model):
    rt = Runtime(model, max_seq_len=64, compile=False)
    a = rt.generate([PROMPTS[0]], 12, temperature=1.0, seed=3)
    assert a == rt.generate([PROMPTS[0]], 12, temperature=1.0, seed=3)
    assert a != rt.generate([PROMPTS[0]], 12, temperature=1.0, seed=4)
    greedy = rt.generate([PROMPTS[0]], 12)
    assert rt.generate([PROMPTS[0]], 12, temperature=1.0, top_k=1, seed=0) == greedy
    assert rt.generate([PROMPTS[0]], 12, temperature=1.0, top_p=1e-6, seed=0) == greedy


@pytest.mark.parametrize(
    "prompts,n,match",
    [
        ([[1] * 60], 10, "max_seq_len"),
        ([[1] * 70], 1, "max_seq_len"),
        ([[1, 2]] * 3, 4, "max_batch_size"),
        ([[]], 4, "at least one token"),
        ([[1, 999]], 4, "outside the vocabulary"),
        ([[1, 2]], 0, "max_new_tokens"),
    ],
    ids=["prompt+new>cache", "prompt>cache", "batch>allocated", "empty", "bad-id", "zero-new"],
)
def test_bad_input_raises_clear_error(model, prompts, n, match):
    rt = Runtime(model, max_seq_len=64, max_batch_size=2, compile=False)
    with pytest.raises(ValueError, match=match):
        rt.generate(prompts, n)


def test_bad_sampling_options_raise(model):
    rt = Runtime(model, max_seq_len=64, compile=False)
    with pytest.raises(ValueError, match="top_p"):
        rt.generate([[1, 2]], 4, temperature=1.0, top_p=1.5)


def test_score_of_k_tokens_equals_one_token_steps_and_rewind_replays(model):
    # What speculative decoding needs: scoring k tokens in one forward gives the logits that k
    # single decode steps give, and after a rewind the same tokens score the same again.
    prompt, n = PROMPTS[0], 6
    greedy = Runtime(model, max_seq_len=64, compile=False).generate([prompt], n)[0]
    rt = Runtime(model, max_seq_len=64, compile=False)
    first = rt.prefill(prompt)
    assert int(first.argmax()) == greedy[0] and rt.position == len(prompt)
    steps = torch.stack([rt.score([t])[-1] for t in greedy[:-1]])  # [n - 1, V]
    assert steps.argmax(-1).tolist() == greedy[1:]
    rt.rewind(len(prompt))
    together = rt.score(greedy[:-1])  # one forward, [n - 1, V]
    assert rt.position == len(prompt) + n - 1
    torch.testing.assert_close(together, steps, rtol=1e-4, atol=1e-4)
    rt.rewind(len(prompt) + 2)  # drop the last tokens, then feed a different one
    other = (greedy[2] + 1) % 320
    got = rt.score([other])[-1]
    ref = Runtime(model, max_seq_len=64, compile=False)
    ref.prefill(prompt + greedy[:2])
    torch.testing.assert_close(got, ref.score([other])[-1], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="rewind"):
        rt.rewind(rt.position + 1)


def test_unsupported_architecture_falls_back_with_warning():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=320, n_positions=64, n_embd=32, n_layer=1, n_head=2, initializer_range=0.3
        )
    ).eval()
    with pytest.warns(RuntimeWarning, match="model_type 'gpt2'"):
        rt = Runtime(gpt2, max_seq_len=64)
    assert rt.generate([PROMPTS[0]], 8) == [hf_greedy(gpt2, PROMPTS[0], 8)]


@pytest.mark.parametrize("factor, reason", [
    # Llama's rotary module does not read the key (its tables cover the head): was a
    # RuntimeError; 2.0 indexed past the head (IndexError)
    (0.5, "tables cover 16 channels of a head, the config's partial_rotary_factor says 8"),
    (2.0, "partial_rotary_factor rotates 32 channels of a 16-channel head"),
    (0.0, "partial_rotary_factor rotates 0 channels"),
])  # fmt: skip
def test_a_rotary_setting_the_model_does_not_apply_falls_back_to_the_models_numbers(factor,
                                                                                     reason):
    llama = make_tiny_llama(seed=0)
    llama.config.partial_rotary_factor = factor  # after building: the module ignores it
    with pytest.warns(RuntimeWarning, match=reason):
        rt = Runtime(llama, max_seq_len=64)
    assert rt.generate([PROMPTS[0]], 4) == [hf_greedy(llama, PROMPTS[0], 4)]


def test_the_fallback_refuses_nan_logits_instead_of_printing_nothing():
    """transformers' generate drew token 0 from NaN logits: empty text, exit 0."""
    from compress.core.errors import NumericsError

    llama = make_tiny_llama(seed=0)
    llama.config.partial_rotary_factor = 2.0  # a fallback
    with torch.no_grad():
        llama.model.norm.weight.fill_(float("nan"))
    with pytest.warns(RuntimeWarning):
        rt = Runtime(llama, max_seq_len=64)
    with pytest.raises(NumericsError, match="logits hold NaN or Inf"):
        rt.generate([PROMPTS[0]], 4)


@pytest.mark.parametrize("compiled", ["_decode_fn", "_step"])  # per layer / whole step
def test_compile_failure_falls_back_once_with_warning(model, compiled):
    rt = Runtime(model, max_seq_len=64, compile=False)

    def broken(*args):
        raise RuntimeError("inductor exploded")

    setattr(rt, compiled, broken)  # stands in for a compiler failure on the first decode step
    with pytest.warns(RuntimeWarning, match="inductor exploded"):
        out = rt.generate([PROMPTS[0]], 8)
    assert out == [hf_greedy(model, PROMPTS[0], 8)]


def test_compiled_decode_step_equals_transformers(model):
    """The one compiled test (about 1-2 minutes of inductor work on 2 busy cores): the whole
    decode step (embedding, every layer, head) is one graph, entered once per token."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rt = Runtime(model, max_seq_len=32, compile=True)
    assert rt.generate([PROMPTS[0]], 6) == [hf_greedy(model, PROMPTS[0], 6)]
    assert rt._step is not _decode_step  # compiled, not the eager fallback after a failure
    # 6 tokens: 5 decode steps, all at key length 16 (one power-of-two bucket): one graph
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    # The step keeps no guards on its modules (their checks cost 8% of a token); each runtime
    # compiles its own copy of the step's code, so a runtime of another structure (an int8
    # head, the same model and cache) gets its own graph and tokens, and the first keeps its own.
    other = Runtime(model, max_seq_len=32, compile=True, lm_head_bits=8)
    eager = Runtime(model, max_seq_len=32, compile=False, lm_head_bits=8)
    assert other.generate([PROMPTS[0]], 6) == eager.generate([PROMPTS[0]], 6)
    assert rt.generate([PROMPTS[0]], 6) == [hf_greedy(model, PROMPTS[0], 6)]
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


def test_compiled_step_calls_packed_bf16_weights_without_a_graph_break(model):
    """A bf16 model's float weights are packed for a compiled step too (oneDNN's layout, called
    through compress_runtime::packed_linear so the opaque tensor stays out of the graph, our
    AMX tiles, or on CPUs without bf16 matmuls a bf16 copy for our bf16_weight_linear): one
    graph, no break, the eager runtime's tokens. fp32 weights are not packed there (their
    compiled steps are unchanged)."""
    from torch._dynamo.utils import counters

    from compress.runtime.float_linear import _FloatLinear

    ours = cpu_float.unavailable_reason(torch.device("cpu"))
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported() and ours is not None:
        pytest.skip(f"this CPU has no bf16 matmuls for oneDNN and our op does not build: {ours}")
    torch._dynamo.reset()
    counters.clear()
    fp32 = Runtime(model, max_seq_len=32, compile=True, keep_model_weights=True)
    held = [m for m in [*fp32.layers.modules(), *fp32.head.modules()]
            if isinstance(m, _FloatLinear)]
    assert held and all(h.packed is None for h in held)  # fp32 compiled steps stay as they were
    model = model.to(torch.bfloat16)
    eager = Runtime(model, max_seq_len=32, compile=False, keep_model_weights=True)
    want = eager.generate([PROMPTS[0]], 6)
    rt = Runtime(model, max_seq_len=32, compile=True, keep_model_weights=True)
    holders = [m for m in [*rt.layers.modules(), *rt.head.modules()]
               if isinstance(m, _FloatLinear)]
    assert holders and all(h.packed is not None for h in holders)
    assert rt.generate([PROMPTS[0]], 6) == want
    assert rt._step is not _decode_step  # compiled, not the eager fallback after a failure
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_compiled_step_with_cpp_host_code_gives_the_same_tokens(model):
    """compile="step-cpp" (inductor's C++ wrapper; 17 s here from an empty inductor cache): the
    same graph with its host code in C++, our integer-dot kernels called from it, the same
    tokens as eager."""
    from compress.kernels import cpu_q8

    if cpu_q8.unavailable_reason() is not None:
        pytest.skip(f"integer-dot kernels unavailable: {cpu_q8.unavailable_reason()}")
    quantize_linears(model, Int4RtnConfig(group_size=32), 4, "w4")
    kernels = dict(int4_kernel="q4q8", int8_kernel="q8q8", lm_head_bits=8)
    with pytest.raises(ValueError, match="step-cpp"):  # before any weight is taken
        Runtime(model, max_seq_len=32, compile="cpp", **kernels)
    eager = Runtime(model, max_seq_len=32, compile=False, keep_model_weights=True, **kernels)
    expected = eager.generate([PROMPTS[0]], 6)
    rt = Runtime(model, max_seq_len=32, compile="step-cpp", **kernels)
    assert rt.generate([PROMPTS[0]], 6) == expected
    assert rt._step is not _decode_step  # compiled, not the eager fallback after a failure


@pytest.mark.real
def test_real_model_greedy_equals_transformers(smollm2):
    prompt = smollm2.tokenizer("The capital of France is")["input_ids"]
    ref = hf_greedy(smollm2.model, prompt, 8)
    out = Runtime(smollm2.model, max_seq_len=32, compile=False).generate([prompt], 8)
    assert out == [ref]
    text = smollm2.generate("The capital of France is", 8)
    assert text == smollm2.tokenizer.decode(ref, skip_special_tokens=True)


def test_w8a8_layers_keep_int8_activations_in_the_runtime(model):
    # A weight-only int8 kernel would give other numbers than the model that was evaluated:
    # the runtime's greedy tokens equal transformers' on the same W8A8 model.
    from compress.quant.linear import w8a8_from_linear

    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and "layers." in name:
            parent, _, child = name.rpartition(".")
            w8a8 = w8a8_from_linear(module, torch.float32, "auto")
            setattr(model.get_submodule(parent), child, w8a8)
    rt = Runtime(model, max_seq_len=64, compile=False)
    for prompt in PROMPTS:
        assert rt.generate([prompt], 16) == [hf_greedy(model, prompt, 16)]


@pytest.mark.parametrize("api", ["generate", "stream"])
def test_seeded_generator_is_made_on_the_models_device(api, model, monkeypatch):
    """multinomial on CUDA refuses a CPU generator (issue 34): the seeded generator is made on
    the runtime's device. A CPU-only build cannot make a CUDA generator, so the check is that
    the runtime names its device (the old code named none: always the CPU's)."""
    rt = Runtime(model, max_seq_len=64, compile=False)
    asked, real = [], torch.Generator

    def generator(device=None):
        asked.append(device)
        return real(device=device)

    monkeypatch.setattr(torch, "Generator", generator)
    if api == "generate":
        rt.generate([PROMPTS[0]], 2, temperature=1.0, seed=0)
    else:
        list(rt.stream(PROMPTS[0], 2, temperature=1.0, seed=0))
    assert asked == [rt.device] == [torch.device("cpu")]


BF16_MATMULS = torch.ops.mkldnn._is_mkldnn_bf16_supported()
needs_bf16 = pytest.mark.skipif(not BF16_MATMULS, reason="oneDNN has no bf16 matmul on this CPU")


@needs_bf16
def test_packed_bf16_linear_equals_plain_and_stacks():
    """_FloatLinear.pack against F.linear on the plain bf16 weight (a second path), at decode's
    few rows and prefill's many; stacked parts equal each part's own packed output."""
    from compress.runtime.float_linear import _FloatLinear

    torch.manual_seed(0)
    ws = [torch.randn(n, 96) for n in (64, 32, 32)]
    bias = torch.randn(32)
    parts = [_FloatLinear(w, bias if i == 1 else None, torch.bfloat16, torch.bfloat16)
             for i, w in enumerate(ws)]  # fmt: skip
    for rows in (1, 5, 300):
        x = torch.randn(rows, 96)
        plain = [p(x, True) for p in parts]
        stacked = _FloatLinear.stacked_packed(parts)
        assert stacked is not None and stacked.n == 128
        assert all(p.pack() for p in parts) and all(p.w_decode is None for p in parts)
        packed = [p(x, True) for p in parts]
        for a, b, part, w in zip(packed, plain, parts, ws, strict=True):
            if part.amx_op is None:
                # oneDNN's layout: equal on the Xeon it was written on; within one bf16
                # rounding of the output wherever oneDNN blocks the sum differently
                torch.testing.assert_close(a, b, rtol=2**-7, atol=0)
            else:
                # our AMX-BF16 tiles: fp32 sums of the bf16 products, not rounded to bf16
                ref = x.bfloat16().double() @ w.bfloat16().double().T
                if part.bias is not None:
                    ref = ref + part.bias.double()
                assert (a.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
                torch.testing.assert_close(a, b, rtol=0, atol=2**-7 * b.abs().max().item())
        assert torch.equal(stacked(x, False), torch.cat(packed, -1))
        parts = [_FloatLinear(w, bias if i == 1 else None, torch.bfloat16, torch.bfloat16)
                 for i, w in enumerate(ws)]  # fmt: skip
    # a copy per phase packs only as our AMX tiles (the decode copy; the test below), never
    # for oneDNN
    from compress.kernels import cpu_q8

    mixed = _FloatLinear(ws[0], None, torch.float32, torch.bfloat16)
    assert mixed.pack() == (cpu_q8.bf16_tiles_reason(ws[0].bfloat16()) is None)
    assert mixed.w_prefill is not None and (mixed.packed is None or mixed.amx_op is not None)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_large_fp32_linears_pack_within_fp32_rounding():
    """From FP32_PACK_MIN_ELEMENTS on, an fp32 weight is held packed for oneDNN (ATen's GEMM is
    slow on large weights at 4+ rows); its outputs stay within fp32 rounding of F.linear in
    float64 (a second path), at decode's rows and a prompt's, with a bias; stacked parts too."""
    from compress.runtime.float_linear import (
        FP32_PACK_MIN_ELEMENTS,
        FP32_PACKED_MIN_ROWS,
        _FloatLinear,
    )

    torch.manual_seed(0)
    k = 1024
    n = FP32_PACK_MIN_ELEMENTS // k
    w, bias = torch.randn(n, k) / k**0.5, torch.randn(n)
    # below the size: packed, and the plain copy kept for calls under FP32_PACKED_MIN_ROWS rows
    small = _FloatLinear(w[: n // 2].clone(), bias[: n // 2], torch.float32, torch.float32)
    assert small.pack() and small.packed is not None and small.w_decode is not None
    for rows in (1, FP32_PACKED_MIN_ROWS - 1, FP32_PACKED_MIN_ROWS, 33):
        x = torch.randn(2, rows, k)  # a batch dimension: the rows are all of x's
        want = torch.nn.functional.linear(x.double(), w[: n // 2].double(), bias[: n // 2].double())
        got = small(x, rows < 8)
        assert got.dtype == torch.float32 and got.shape == (2, rows, n // 2)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4)
    parts = [_FloatLinear(w[: n // 2], bias[: n // 2], torch.float32, torch.float32),
             _FloatLinear(w[n // 2 :], None, torch.float32, torch.float32)]  # fmt: skip
    stacked = _FloatLinear.stacked_packed(parts)  # together they reach the size
    assert stacked is not None and stacked.packed is not None and stacked.w_decode is None
    layer = _FloatLinear(w, bias, torch.float32, torch.float32)
    assert layer.pack() and layer.w_decode is None
    for rows in (1, 4, 300):
        x = torch.randn(rows, k)
        want = torch.nn.functional.linear(x.double(), w.double(), bias.double())
        half_bias = want - torch.cat([torch.zeros(n // 2), bias[n // 2 :]]).double()
        for got, ref in ((layer(x, True), want), (stacked(x, False), half_bias)):
            assert got.dtype == torch.float32 and got.shape == (rows, n)
            torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-4)


def test_small_fp32_linears_stack(model):
    """fp32 parts under FP32_PACK_MIN_ELEMENTS stack: one GEMM of the concatenated weight
    (ATen's at one row, oneDNN's packed one from FP32_PACKED_MIN_ROWS), each part's columns
    within fp32 rounding of its own call (float64 reference), its bias where it had one; an
    eager fp32 runtime then runs stacked q/k/v and gate/up and the fused elementwise ops."""
    from compress.kernels import cpu_elementwise
    from compress.runtime.float_linear import _FloatLinear

    torch.manual_seed(0)
    ws = [torch.randn(n, 96) for n in (64, 32, 32)]
    bias = torch.randn(32)
    parts = [_FloatLinear(w, bias if i == 1 else None, torch.float32, torch.float32)
             for i, w in enumerate(ws)]  # fmt: skip
    stacked = _FloatLinear.stacked_packed(parts)
    assert stacked is not None and stacked.w_decode is not None and stacked.n == 128
    for rows in (1, 5):  # the plain copy, then the packed one where oneDNN runs
        x = torch.randn(rows, 96)
        want = torch.cat([x.double() @ ws[0].double().T,
                          x.double() @ ws[1].double().T + bias.double(),
                          x.double() @ ws[2].double().T], -1)  # fmt: skip
        torch.testing.assert_close(stacked(x, True).double(), want, rtol=0, atol=1e-4)
    # parts holding a copy per phase (fp32 prefill, bf16 decode: a quantized model's float
    # layers on a CPU with bf16 matmuls) stack alike, unpacked; each phase's columns are its
    # parts' own calls
    mixed = [_FloatLinear(w, None, torch.float32, torch.bfloat16) for w in ws]
    both = _FloatLinear.stacked_packed(mixed)
    assert both is not None and both.packed is None
    assert (both.w_prefill.dtype, both.w_decode.dtype) == (torch.float32, torch.bfloat16)
    x = torch.randn(3, 96)
    for decode, tolerance in ((False, 1e-4), (True, 2e-2)):
        torch.testing.assert_close(both(x, decode), torch.cat([p(x, decode) for p in mixed], -1),
                                   rtol=0, atol=tolerance)
    assert _FloatLinear.stacked_packed([mixed[0], parts[1]]) is None  # one copy beside two
    runtime = Runtime(model, max_seq_len=32, compile=False)  # fp32, eager
    layer = runtime.layers[0]
    assert layer.qkv is not None and layer.q is None and layer.gate_up is not None
    assert layer.fused == (cpu_elementwise.unavailable_reason(torch.device("cpu")) is None)


@needs_bf16
def test_eager_bf16_runtime_packs_and_keeps_its_tokens(model, monkeypatch):
    """An eager CPU runtime in bf16 holds q/k/v, gate/up and the head packed for oneDNN (or, on
    AMX-BF16 CPUs, in our tile order); its greedy tokens and logits are those of the same
    runtime on plain bf16 weights (within bf16 rounding for our tiles, which skip it)."""
    from compress.runtime.float_linear import _FloatLinear

    bf16 = dict(prefill_dtype=torch.bfloat16, decode_dtype=torch.bfloat16, compile=False)
    packed = Runtime(model, max_seq_len=64, keep_model_weights=True, **bf16)
    layer = packed.layers[0]
    assert layer.q is None and layer.gate is None
    assert layer.qkv.packed is not None and layer.gate_up.packed is not None
    assert layer.o.packed is not None and packed.head.lm_head.packed is not None
    monkeypatch.setattr(_FloatLinear, "pack", lambda self, *args, **kwargs: False)
    plain = Runtime(model, max_seq_len=64, **bf16)
    assert plain.layers[0].qkv is None and plain.layers[0].q.packed is None
    amx = layer.qkv.amx_op is not None  # our AMX-BF16 tiles: fp32 outputs, not bf16-rounded
    for prompt in PROMPTS:
        a, b = packed.prefill(prompt), plain.prefill(prompt)
        if not amx:
            torch.testing.assert_close(a, b)
            assert packed.generate([prompt], 16) == plain.generate([prompt], 16)
        else:  # within the bf16 roundings the plain path adds (0.8% of the largest, measured)
            torch.testing.assert_close(a, b, rtol=0, atol=0.02 * b.abs().max().item())
            assert packed.generate([prompt], 4) == plain.generate([prompt], 4)


def test_a_copy_per_phase_decodes_from_amx_tiles_and_prefills_in_fp32():
    """A float holder with an fp32 prefill copy and a bf16 decode copy (a quantized model's
    float layers on a CPU with bf16 matmuls) holds the decode copy as our AMX tiles: decode
    equals the bf16 copy's product (float64 reference), prefill the fp32 weight's, each
    phase's input dtype its own."""
    from compress.kernels import cpu_q8
    from compress.runtime.float_linear import _FloatLinear

    torch.manual_seed(0)
    w = torch.randn(64, 96)
    if (why := cpu_q8.bf16_tiles_reason(w.bfloat16())) is not None:
        pytest.skip(f"our AMX tiles do not run here: {why}")
    holder = _FloatLinear(w, None, torch.float32, torch.bfloat16)
    assert holder.pack() and holder.amx_op is not None and holder.w_decode is None
    assert (holder.input_dtype(True), holder.input_dtype(False)) == (torch.bfloat16,
                                                                     torch.float32)
    x = torch.randn(5, 96)
    decode = x.bfloat16().double() @ w.bfloat16().double().T
    torch.testing.assert_close(holder(x.bfloat16(), True).double(), decode, rtol=0,
                               atol=1e-5 * decode.abs().max())
    torch.testing.assert_close(holder(x, False), x @ w.T)  # fp32, as unpacked


def test_bf16_linears_without_bf16_matmuls_run_our_op_and_stack(monkeypatch):
    """bf16 float linears on a CPU without bf16 matmuls (forced): held for our
    ``bf16_weight_linear`` (fp32 sums of bf16 inputs and weights, float64 reference here, with
    the bias), stacked q/k/v parts as one call equal to each part's own."""
    from compress.kernels import cpu_q8
    from compress.runtime.float_linear import _FloatLinear

    if (why := cpu_float.unavailable_reason(torch.device("cpu"))) is not None:
        pytest.skip(f"our kernels do not build here: {why}")
    monkeypatch.setattr(cpu_float, "cpu_bf16_matmuls", lambda: False)
    # nor AMX-BF16 (an AMX Xeon held them as our AMX tiles instead)
    monkeypatch.setattr(cpu_q8, "bf16_tiles_reason", lambda w: "no AMX-BF16 (forced)")
    torch.manual_seed(0)
    ws, bias = [torch.randn(n, 96) for n in (64, 32, 32)], torch.randn(32)
    def parts():
        return [_FloatLinear(w, bias if i == 1 else None, torch.bfloat16, torch.bfloat16)
                for i, w in enumerate(ws)]  # fmt: skip
    stacked = _FloatLinear.stacked_packed(parts())
    assert stacked is not None and stacked.bf16_op is not None
    singles = parts()
    assert all(p.pack() and p.bf16_op is not None and p.w_decode is None for p in singles)
    for rows in (1, 5, 300):
        x = torch.randn(rows, 96).bfloat16()
        outs = [p(x, True) for p in singles]
        for i, (got, w) in enumerate(zip(outs, ws, strict=True)):
            want = x.double() @ w.bfloat16().double().T + (bias.double() if i == 1 else 0)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * want.abs().max())
        assert torch.equal(stacked(x, False), torch.cat(outs, -1))


def test_bf16_valued_fp32_weights_run_from_bf16_copies_and_keep_fp32_tokens(model, monkeypatch):
    """On a CPU without bf16 matmuls (forced here, so that every CPU where our kernels build
    runs it), fp32 weights that hold bf16 values (the head and the decoder layers) are held as
    bf16 copies run in fp32 by our op: the greedy tokens stay transformers' fp32 ones, and a
    prompt of 40 tokens (the op's blocked form) gives the plain fp32 runtime's logits within
    fp32 rounding. A quantized model there decodes in fp32 (not bf16), within fp32 rounding of
    the plain head."""
    from compress.runtime.float_linear import _FloatLinear

    if (why := cpu_float.unavailable_reason(torch.device("cpu"))) is not None:
        pytest.skip(f"our kernels do not build here: {why}")
    monkeypatch.setattr(cpu_float, "cpu_bf16_matmuls", lambda: False)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    rt = Runtime(model, max_seq_len=64, compile=False, keep_model_weights=True)
    head = rt.head.lm_head
    assert head.bf16_op is not None and head.packed.dtype == torch.bfloat16
    assert head.packed_dtype == torch.float32  # its input stays fp32
    layers = [m for m in rt.layers.modules() if isinstance(m, _FloatLinear)]
    assert layers and all(m.bf16_op is not None and m.w_decode is None for m in layers)
    assert rt.decode_dtype == torch.float32
    for prompt in PROMPTS:
        assert rt.generate([prompt], 12) == [hf_greedy(model, prompt, 12)]
    with monkeypatch.context() as m:
        m.setattr(cpu_float, "holds_bf16_copy", lambda w: False)
        fp32 = Runtime(model, max_seq_len=64, compile=False, keep_model_weights=True)
    assert all(m.bf16_op is None for m in fp32.layers.modules() if isinstance(m, _FloatLinear))
    long_prompt = [(7 * i + 1) % model.config.vocab_size for i in range(40)]
    a, b = rt.prefill(long_prompt), fp32.prefill(long_prompt)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * b.abs().max().item())
    quantize_linears(model, Int4RtnConfig(group_size=32), 4, "test")
    kw = dict(max_seq_len=64, compile=False, keep_model_weights=True)
    rt = Runtime(model, **kw)
    assert rt.decode_dtype == torch.float32 and rt.head.lm_head.bf16_op is not None
    monkeypatch.setattr(cpu_float, "holds_bf16_copy", lambda w: False)
    plain = Runtime(model, **kw)
    assert plain.head.lm_head.bf16_op is None
    for prompt in PROMPTS:
        a, b = rt.prefill(prompt), plain.prefill(prompt)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * b.abs().max().item())
        assert rt.generate([prompt], 8) == plain.generate([prompt], 8)


def test_a_static_cache_past_the_free_memory_is_refused_before_any_weight_is_taken(
        monkeypatch):
    """The cache is allocated and zeroed at once: past the free memory the allocator fails or
    the kernel kills the process. The refusal comes first, names the sizes and the way out, and
    leaves the model whole (the layers release its weights as they take them)."""
    from compress.runtime import engine

    model = make_tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # 2 layers x (k, v) x 4 rows x 2 KV heads x 1024 slots x 16 dims x 4 bytes = 2 MiB
    need = 2 * 2 * 4 * 2 * 1024 * 16 * 4
    assert (model.config.num_hidden_layers, model.config.num_key_value_heads,
            model.config.hidden_size // model.config.num_attention_heads) == (2, 2, 16)
    monkeypatch.setattr(engine, "available_memory_bytes", lambda device: need - 1)
    with pytest.raises(ValueError, match=r"max_batch_size=4 x max_seq_len=1024 needs 0\.00 GB "
                                         r".*lower max_seq_len or max_batch_size"):
        Runtime(model, max_seq_len=1024, max_batch_size=4, compile=False,
                kv_dtype=torch.float32)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    monkeypatch.setattr(engine, "available_memory_bytes", lambda device: need)
    runtime = Runtime(model, max_seq_len=1024, max_batch_size=4, compile=False,
                      kv_dtype=torch.float32)
    assert sum(t.numel() * t.element_size() for t in runtime.k_cache + runtime.v_cache) == need
