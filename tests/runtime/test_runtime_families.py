"""The runtime on every family it runs besides Llama: Qwen2 (q/k/v biases), Qwen3 (per-head q/k
norms), Mistral (sliding window on every layer), CWM (full
and sliding layers), Granite (embedding/attention/residual/logit
multipliers), Gemma (1) ((1 + w) norms, scaled embeddings), Gemma 2 (softcapped attention and
logits), Gemma 3 (local/global rope bases, post-norms), SmolLM3 (layers without RoPE), Seed-OSS
(q/k/v and o biases), ERNIE 4.5 and Helium (interleaved RoPE pairs), Arcee (non-gated relu2
MLP), Apertus (non-gated MLP through xIELU's learned per-layer scalars), HunYuan dense
(per-head q/k norms after RoPE), Phi-3 (fused qkv_proj and gate_up_proj),
OLMo2/3 and EXAONE 4 (no pre-norms, post-norms, q/k norms over all heads or one), VaultGemma
(Gemma 2 without post-norms).
The reference is transformers itself in fp32: greedy tokens and the logits of each prefill and
decode step, float and int4-RTN quantized.

Tiny random models: 2 layers, hidden 64, vocab 320, sliding window 8 (prompts + generation run
past it), every 1-d parameter (norm weights, biases) randomised so that a wrong norm form, a
missing bias or a missing norm changes the numbers."""

from __future__ import annotations

import pytest
import torch

from compress.arch import (
    ARCHS,
    RUNTIME_SPECS,
    arch_for,
    decoder_layers,
    layer_arch,
    runtime_model_types,
)
from compress.kernels.cpu_attention import prefill_unavailable_reason
from compress.quant.rtn import Int4RtnConfig, quantize_linears
from compress.runtime.engine import Runtime, _decode_step, unsupported_reason
from compress.testing import (
    TINY_MOE_TYPES,
    assert_greedy_agrees,
    hf_greedy,
    make_tiny_model,
    make_tiny_moe,
)

PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8, 250, 31, 64], [1, 40, 50], [1, 200, 13, 14, 15]]
WINDOW = 8
# settings on top of compress.testing's tiny sizes (random init wider than the default 0.02,
# which makes a random model repeat one token). Sliding layers: Qwen2/3 from layer
# max_window_layers on (layer 1), Mistral every layer, Gemma 2/3 layer 0 (layer 1 global).
# Gemma's head is untied: with embeddings scaled by sqrt(64) a tied random head predicts the
# last input token forever.
MOE = TINY_MOE_TYPES
FAMILIES = {
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "mistral": dict(sliding_window=WINDOW),
    "ministral": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "cwm": dict(sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention"]),
    # YaRN tables (attention factor in cos/sin); queries scaled past position 512 (beyond the
    # tests' sequences: the runtime runs it up to there)
    "ministral3": dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=1e6, factor=16.0, original_max_position_embeddings=512,
        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
        llama_4_scaling_beta=0.1)),
    "granite": dict(
        embedding_multiplier=2.0,
        attention_multiplier=0.125,
        residual_multiplier=0.5,
        logits_scaling=4.0,
    ),
    # Granite SWA: Granite's multipliers, a sink logit per head, a windowed layer with RoPE
    # and a full one without (layer_rope_theta 0), each base its own rotary module
    "granite_swa": dict(sliding_window=WINDOW, tie_word_embeddings=False),
    "gemma2": dict(
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,
        tie_word_embeddings=False,
        attn_logit_softcapping=5.0,  # small caps so that tanh bends the numbers
        final_logit_softcapping=3.0,
    ),
    # VaultGemma: Gemma 2 without the post-norms (sliding and global layers, the softcaps)
    "vaultgemma": dict(
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
        tie_word_embeddings=False,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
    ),
    # Gemma (1): (1 + w) norms and the scaled embedding without Gemma 2's post-norms
    "gemma": dict(tie_word_embeddings=False),
    "smollm3": dict(no_rope_layers=[1, 0]),  # layer 1 without RoPE
    "seed_oss": dict(attention_bias=True, attention_out_bias=True),  # q/k/v and o biases
    "phi3": dict(sliding_window=WINDOW),  # fused qkv_proj and gate_up_proj
    # Phi-4-mini's layout: RoPE on the first 3/4 of each head
    "phi4": dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                  "partial_rotary_factor": 0.75}),
    "ernie4_5": dict(use_bias=True),  # interleaved RoPE pairs
    "helium": dict(),  # interleaved RoPE pairs, Llama's layout
    "arcee": dict(),  # non-gated relu2 MLP
    # non-gated MLP through xIELU, whose learned scalars differ per layer (randomised with the
    # 1-d parameters); q/k norms, llama3 RoPE; norms of its own names
    "apertus": dict(tie_word_embeddings=False),  # tied, prompt 0 repeats 5 tokens
    "qwen2_gelu": dict(hidden_act="gelu"),  # a gated MLP on exact (erf) gelu
    # LayerNorms with biases: Starcoder2 (biases everywhere, gelu MLP not gated, a window),
    # StableLM (q/k/v biases, RoPE on a quarter of each head)
    "starcoder2": dict(sliding_window=WINDOW),
    # LayerNorms with biases, biases on every linear, relu2 MLP not gated (untied: the tied
    # head repeats 4-5 tokens)
    "jais2": dict(tie_word_embeddings=False),
    "stablelm": dict(use_qkv_bias=True, tie_word_embeddings=False),
    "nemotron": dict(),  # (1 + w) LayerNorms with biases, relu2 MLP not gated, partial RoPE
    # parallel attention and MLP on one LayerNorm: Cohere (interleaved RoPE, logits scaled),
    # Phi (biases, gelu MLP not gated, RoPE on half of each head, a head with a bias)
    "cohere": dict(logit_scale=0.5, attention_bias=True),
    "phi": dict(tie_word_embeddings=False),
    # Cohere 2: Cohere's layers, RoPE on the sliding layer only (layer 1 global, no RoPE)
    "cohere2": dict(logit_scale=0.5, attention_bias=True, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"]),
    "hunyuan_v1_dense": dict(attention_bias=True),  # per-head q/k norms after RoPE
    # its checkpoints' RoPE: NTK-alpha labelled "dynamic", static tables (alpha 1000 at 4K)
    "hunyuan_alpha": dict(rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                                           "rope_theta": 1e4}),  # fmt: skip
    "glm": dict(),  # interleaved pairs over the first half of each head, fused gate_up_proj
    "glm4": dict(),  # ... and post-norms
    # no pre-norms, post-norms; q/k norms over all heads (OLMo2/3) or one (EXAONE 4)
    "olmo2": dict(),
    "olmo3": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    # with a window, the global layer (1) has no RoPE
    "exaone4": dict(
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False,
    ),
    # sparse MoE: the runtime's attention around the family's own router + experts block
    "mixtral": dict(),
    "qwen3_moe": dict(),
    "qwen2_moe": dict(),  # ... with a shared expert (gated by sigmoid)
    "olmoe": dict(),  # ... with q/k norms over all heads
    # ... and sigmoid routing with a bias, RoPE on half of each head (untied: with the tied head
    # one decode step's two best tokens were 3e-6 apart, a tie the kernel's rounding flips)
    "minimax_m2": dict(tie_word_embeddings=False),
    # ... LayerNorms with biases, biases everywhere (the head's too), a sparsemixer router
    "phimoe": dict(tie_word_embeddings=False),
    # K-EXAONE: a dense first layer, a windowed layer with RoPE, a global one without
    "exaone_moe": dict(tie_word_embeddings=False, sliding_window=WINDOW,
                       layer_types=["sliding_attention", "full_attention"],
                       mlp_layer_types=["dense", "sparse"]),
    # HunYuan-MoE: HunYuan dense's attention (q/k norms after RoPE, biases), a softmax router
    # that is a Linear inside the gate module and a shared expert without a gate
    "hunyuan_v1_moe": dict(tie_word_embeddings=False, attention_bias=True),
    # GraniteMoE: Granite's multipliers around Mixtral's block name, the router its own module
    "granitemoe": dict(tie_word_embeddings=False),
    # Solar Open: GLM-4-MoE's block (sigmoid routing with a correction bias, a shared expert)
    # in every layer around Llama's attention
    "solar_open": dict(tie_word_embeddings=False),
    # GPT-OSS: a sink logit per head in every softmax, biases on q/k/v/o, a sliding and a full
    # layer, YaRN tables of one angle per pair; a biased router and transposed, interleaved
    # experts with biases through a clamped SwiGLU
    "gpt_oss": dict(tie_word_embeddings=False),
    # latent attention (compress.runtime.latent) with its low-rank query, interleaved RoPE and
    # GLM-4-MoE's block, and without the low-rank query (Moonlight's layout), RoPE in halves
    "deepseek_v3": dict(tie_word_embeddings=False),
    "deepseek_v3_q_proj": dict(q_lora_rank=None, rope_interleave=False,
                               tie_word_embeddings=False),
    # the released models' dense first layers (first_k_dense_replace): our gated MLP there
    "deepseek_v3_dense_first": dict(first_k_dense_replace=1, tie_word_embeddings=False),
    # GLM-4.7-Flash: DeepSeek-V3's layout, a dense first layer, values wider than the keys'
    # non-rotary part, biases on the projections that read the residual stream
    "glm4_moe_lite": dict(tie_word_embeddings=False, attention_bias=True, v_head_dim=32,
                          mlp_layer_types=["dense", "sparse"]),
    # DeepSeek-V2-Lite's layout: no low-rank query, a softmax router, complex rotary angles
    "deepseek_v2": dict(q_lora_rank=None, tie_word_embeddings=False),
    # the released V3's YaRN (factor 40, mscale in the tables and in the softmax scale)
    "deepseek_v3_yarn": dict(tie_word_embeddings=False, max_position_embeddings=4096,
                             rope_parameters=dict(rope_type="yarn", rope_theta=10000.0,
                                                  factor=40.0, original_max_position_embeddings=64,
                                                  beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                                                  mscale_all_dim=1.0)),
    # GPT-NeoX: q/k/v fused per head, RoPE on a quarter of each head, LayerNorms with biases,
    # attention and MLP in parallel on norms of their own (or one after the other), no GQA
    # (a num_key_value_heads in its config is not read)
    "gpt_neox": dict(tie_word_embeddings=False),
    "gpt_neox_sequential": dict(use_parallel_residual=False, tie_word_embeddings=False),
    # OPT: learned absolute positions added to the embedding (from row 2), no RoPE, LayerNorms,
    # relu MLP not gated, biases everywhere, no GQA
    "opt": dict(),
    "gemma3_text": dict(
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
        tie_word_embeddings=False,
    ),
}


# a FAMILIES key that is a configuration of another model_type
VARIANTS = {"phi4": "phi3", "hunyuan_alpha": "hunyuan_v1_dense", "qwen2_gelu": "qwen2",
            "gpt_neox_sequential": "gpt_neox", "deepseek_v3_q_proj": "deepseek_v3",
            "deepseek_v3_yarn": "deepseek_v3", "deepseek_v3_dense_first": "deepseek_v3"}


def arch_of(family: str):
    return ARCHS[VARIANTS.get(family, family)]


def make_model(family: str, seed: int = 0, **overrides):
    """Tiny random ``family`` model in fp32, eval mode, eager attention (the reference)."""
    settings = {"initializer_range": 0.3, "tie_word_embeddings": True, **FAMILIES[family]}
    build = make_tiny_moe if VARIANTS.get(family, family) in MOE else make_tiny_model
    model = build(VARIANTS.get(family, family), seed, **{**settings, **overrides})
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norms start at 1 (or 0 for 1 + w) and biases at 0: move them
                p.add_(torch.randn_like(p) * 0.3)
    return model


def step_logits(rt: Runtime, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Runtime logits [1 + n, V]: after the prompt (prefill), then after each continuation
    token fed alone (decode steps)."""
    rows = [rt.prefill(prompt)] + [rt.score([t])[-1] for t in continuation]
    return torch.stack(rows)


def hf_logits(model, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """transformers' logits [1 + n, V] at the same positions, from one forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + continuation])).logits[0]
    return logits[len(prompt) - 1 :]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_is_run_by_the_runtime(family):
    model = make_model(family)
    assert model.config.model_type == VARIANTS.get(family, family)
    assert unsupported_reason(model) is None
    assert arch_of(family).runtime


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_fp32(family):
    model = make_model(family)
    rt = Runtime(model, max_seq_len=48, compile=False)
    for prompt in PROMPTS[:2]:
        ref = hf_greedy(model, prompt, 20)
        assert len(set(ref)) > 5  # the reference itself is not degenerate
        assert rt.generate([prompt], 20) == [ref]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_logits_equal_transformers_fp32(family):
    # Logits, not only argmax: Granite's logits_scaling and Gemma 2's final softcap are
    # monotonic, so greedy tokens alone could not see them. 11 + 12 tokens > window 8.
    model = make_model(family)
    prompt, continuation = PROMPTS[0], list(range(40, 280, 20))
    rt = Runtime(model, max_seq_len=48, compile=False)
    got = step_logits(rt, prompt, continuation)
    torch.testing.assert_close(got, hf_logits(model, prompt, continuation), rtol=1e-4, atol=1e-4)
    rt.rewind(len(prompt))  # the continuation in one forward (speculative decoding's verify)
    torch.testing.assert_close(rt.score(continuation), got[1:], rtol=1e-4, atol=1e-4)


# SDPA's own causal form (a prompt from position 0 passes no mask), Gemma 2's softcapped
# attention (the mask built from None) and Mistral's window (window_mask from None)
@pytest.mark.parametrize("family", ["qwen3", "gemma2", "mistral"])
def test_a_causal_prefill_without_a_mask_equals_the_mask_bit_for_bit(family):
    model = make_model(family)
    rt = Runtime(model, max_seq_len=48, compile=False)
    for layer in rt.layers:  # SDPA in both forms (our prefill kernel: tests/kernels)
        layer.prefill_attention = None
    prompt = PROMPTS[0] * 2  # 22 tokens > window 8
    t = len(prompt)
    ids, slots = torch.tensor([prompt]), torch.arange(t)
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        unmasked = rt._layers(ids, slots[None], None, slots, 1, t, decode=False)
        masked = rt._layers(ids, slots[None], causal, slots, 1, t, decode=False)
    assert torch.equal(unmasked, masked)


# A later chunk (a prompt's rest after a prefix hit or an earlier chunk) passes no mask either:
# its queries are the last T of the L keys. SDPA (qwen3) and the softcapped form (gemma2) build
# the mask from None; the prefill kernel, where held, takes it as an offset.
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_a_later_causal_chunk_without_a_mask_equals_the_mask(family, head_dim):
    model = make_model(family, head_dim=head_dim)
    rt = Runtime(model, max_seq_len=48, compile=False)
    layer = rt.layers[0]
    d, t, length = layer.head_dim, 7, 19
    held = prefill_unavailable_reason(d, torch.device("cpu")) is None
    assert (layer.prefill_attention is not None) == held
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, layer.n_heads, t, d, generator=gen)
    keys, values = (torch.randn(1, layer.n_kv, length, d, generator=gen) for _ in range(2))
    mask = (torch.arange(length)[None, :] <= torch.arange(length - t, length)[:, None])
    kernel, layer.prefill_attention = layer.prefill_attention, None
    masked = layer.attend(q, keys, values, mask[None, None])
    assert torch.equal(layer.attend(q, keys, values, None), masked)
    if held:  # at avx2 (PREFILL_HEAD_DIMS); attend keeps softcaps off it
        layer.prefill_attention = kernel
        torch.testing.assert_close(layer.attend(q, keys, values, None), masked,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])
def test_the_window_changes_the_logits(family):
    # The equality tests above see the window: the same runtime without its window mask gives
    # other logits once a query is 8 or more tokens past a key.
    model = make_model(family)
    prompt, continuation = PROMPTS[0], list(range(40, 280, 20))
    rt = Runtime(model, max_seq_len=48, compile=False)
    assert rt._windows == {WINDOW}
    rt._windows = set()
    got = step_logits(rt, prompt, continuation)
    assert (got - hf_logits(model, prompt, continuation)).abs().max() > 1e-2


def test_a_window_beyond_the_cache_needs_no_mask():
    model = make_model("mistral", sliding_window=64)
    rt = Runtime(model, max_seq_len=48, compile=False)
    assert rt._windows == set()
    assert rt.generate([PROMPTS[0]], 16) == [hf_greedy(model, PROMPTS[0], 16)]


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_batch_with_left_padding_equals_single_rows(family):
    # Slot distance is token distance in a left-padded row, so the window holds per row.
    model = make_model(family)
    rt = Runtime(model, max_seq_len=48, max_batch_size=3, compile=False)
    assert rt.generate(PROMPTS, 16) == [hf_greedy(model, p, 16) for p in PROMPTS]


@pytest.mark.parametrize("family", FAMILIES)
def test_int4_rtn_equals_transformers_on_the_same_quantized_model(family):
    model = make_model(family)
    # latent attention absorbs its latent's expansion in fp32 (the int4 one: dequantized), where
    # transformers runs the int4 kernel on bf16 activations: kept float here, compared with a
    # tolerance in tests/quant/test_latent_attention.py
    ignore = ("lm_head", f"re:.*{arch_of(family).v}$") if arch_of(family).latent_attention \
        else ("lm_head",)
    report = quantize_linears(model, Int4RtnConfig(group_size=32, ignore=ignore), 4, "test")
    assert report is not None
    # fp32 decode keeps the head in fp32 as transformers does; the int4 layers run the same
    # native kernel (bf16 activations) on both sides; the model keeps its weights to run.
    rt = Runtime(model, max_seq_len=48, decode_dtype=torch.float32, compile=False,
                 keep_model_weights=True)  # fmt: skip
    # MoE: the experts are QuantExperts in the block; Phi-3: qkv_proj and gate_up_proj are one
    # linear each in the checkpoint
    # (an MoE model's dense layer: its MLP's too, layer_arch)
    linears = 0
    for layer in decoder_layers(model):
        arch = layer_arch(arch_for(model, "test"), layer)
        linears += len([p for p in arch.linears if p.startswith(arch.attention + ".")]
                       if arch.moe else arch.linears)
        linears -= bool(arch.latent_attention)  # its latent's expansion is absorbed, in fp32
    assert sum(type(m).__name__ == "_Int4Linear" for m in rt.layers.modules()) == linears
    for prompt in PROMPTS[:2]:  # bf16 activations: a near tie may flip on another CPU's path
        # (apertus on an AMD EPYC, AVX-512 without AMX: a top-2 margin of 0.015 at token 10)
        assert_greedy_agrees(model, prompt, rt.generate([prompt], 16)[0], tol=0.05)


# (Phi-3's projections are fused in the checkpoint: nothing to compare with. Exact gelu on the
# stacked gate_up's strided half takes torch's scalar erf, on a separate contiguous output its
# vectorized one: 1-ulp apart, so that variant is compared by the transformers tests only.)
# (Latent attention's projections read different inputs: never stacked, LatentLayer._stack.)
@pytest.mark.parametrize("family", [f for f in FAMILIES if arch_of(f).q != arch_of(f).k
                                    and f != "qwen2_gelu" and not arch_of(f).latent_attention])
def test_stacked_projections_equal_separate_calls(family, monkeypatch):
    # Our kernel runs q/k/v (and gate/up) of one input as one call; every output column is
    # its own dot product, so prefill (the row-tile GEMM: 11 tokens) and decode logits must
    # equal the separate calls' bit for bit, Qwen2's q/k/v biases included.
    from compress.kernels import cpu_q8
    from compress.runtime import layers

    if cpu_q8.unavailable_reason() is not None:
        pytest.skip(f"integer-dot kernels not available here: {cpu_q8.unavailable_reason()}")
    model = make_model(family)
    quantize_linears(model, Int4RtnConfig(group_size=32), 4, "test")
    settings = dict(max_seq_len=48, decode_dtype=torch.float32, compile=False, int4_kernel="q4q8")
    stacked = Runtime(model, **settings, keep_model_weights=True)  # a second one follows
    for layer, source in zip(stacked.layers, decoder_layers(model), strict=True):
        assert layer.qkv is not None and (layer.q, layer.k, layer.v) == (None, None, None)
        own = layer_arch(arch_of(family), source)  # an MoE model's dense layer: its gated MLP
        assert (layer.gate_up is None) == (own.moe is not None or not own.gate)
        layer.fused = False  # the fused elementwise ops need stacked calls: compare torch's
    monkeypatch.setattr(layers._IntLinear, "stacked", classmethod(lambda cls, parts: None))
    separate = Runtime(model, **settings)
    assert all(layer.qkv is None and layer.q is not None for layer in separate.layers)
    for layer in separate.layers:
        layer.fused = False  # GLM: its checkpoint's gate_up_proj would take the fused ops
    continuation = [40, 60, 80]
    got = step_logits(stacked, PROMPTS[0], continuation)
    assert torch.equal(got, step_logits(separate, PROMPTS[0], continuation))


@pytest.mark.parametrize("family", [f for f in FAMILIES if not arch_of(f).latent_attention])
def test_fused_elementwise_ops_compute_the_torch_layer(family, monkeypatch):
    """Eager CPU runtimes run norms, RoPE (with q/k norms) and SiLU x up through
    kernels.cpu_elementwise where projections are stacked: logits within fp32 rounding of the
    same runtime on torch's ops, the same greedy tokens. fp32 weights, packed and stacked at
    any size here, so nothing but the elementwise ops differs (int kernels would round their
    activations to int8, where a last-bit difference can move a code)."""
    from compress.kernels import cpu_elementwise
    from compress.runtime import float_linear

    reason = cpu_elementwise.unavailable_reason(torch.device("cpu"))
    if reason is not None or not torch.backends.mkldnn.is_available():
        pytest.skip(f"the fused ops do not run here: {reason or 'no oneDNN'}")
    monkeypatch.setattr(float_linear, "FP32_PACK_MIN_ELEMENTS", 1)
    runtime = Runtime(make_model(family), max_seq_len=48, compile=False)
    assert all(layer.fused for layer in runtime.layers)
    assert all(layer.qkv is not None for layer in runtime.layers)
    continuation = [40, 60, 80]
    fused = step_logits(runtime, PROMPTS[0], continuation)
    tokens = runtime.generate([PROMPTS[1]], 8)
    for layer in runtime.layers:
        layer.fused = False
    torch.testing.assert_close(fused, step_logits(runtime, PROMPTS[0], continuation),
                               rtol=1e-4, atol=1e-4)  # fmt: skip
    assert runtime.generate([PROMPTS[1]], 8) == tokens


def test_projections_that_differ_are_not_stacked():
    # A mixed recipe (int8 v, int4 q/k) keeps separate q/k/v calls (gate/up still stack), and
    # kernels of other group sizes do not stack; those that do compute their parts' columns.
    from compress.kernels import cpu_q8
    from compress.quant.rtn import Int8RtnConfig
    from compress.runtime import layers

    if cpu_q8.unavailable_reason() is not None:
        pytest.skip(f"integer-dot kernels not available here: {cpu_q8.unavailable_reason()}")
    model = make_model("qwen2")
    float_v = [layer.self_attn.v_proj for layer in model.model.layers]
    quantize_linears(model, Int4RtnConfig(group_size=32), 4, "test")
    for layer, v in zip(model.model.layers, float_v, strict=True):
        layer.self_attn.v_proj = v
    quantize_linears(model, Int8RtnConfig(), 8, "test")
    rt = Runtime(model, max_seq_len=48, decode_dtype=torch.float32, compile=False,
                 int4_kernel="q4q8", int8_kernel="q8q8")  # fmt: skip
    assert type(rt.layers[0].v).__name__ == "_Int8Linear"
    assert all(layer.qkv is None and layer.gate_up is not None for layer in rt.layers)

    def weight(n: int, group: int, offsets: bool) -> cpu_q8.Q8Weight:
        codes = torch.randint(0, 256, (n, 64), dtype=torch.uint8)
        scales = torch.rand(n, 128 // group)
        return cpu_q8.Q8Weight(4, codes, scales, torch.randn_like(scales) if offsets else None,
                               group)  # fmt: skip

    assert cpu_q8.stack([weight(8, 32, False), weight(8, 64, False)]) is None
    assert cpu_q8.stack([weight(8, 32, False), weight(8, 32, True)]) is None
    x = torch.randn(3, 128)
    # parts of W/2 and 3W/2 columns keep the row layout (W: the level's tile width, 16 at
    # AVX512-VNNI, 8 at AVX2), so does their stack (_IntLinear.stacked tiles it only where every
    # part is tiled); W and 2W columns get column tiles, their stack too: each column bit for
    # bit either way
    width = cpu_q8.tile_width(cpu_q8.selected_isa()) or 16
    for sizes, tiles in (((width // 2, 3 * width // 2), False), ((width, 2 * width), True)):
        parts = [weight(n, 32, True) for n in sizes]
        stacked = layers._Q8Kernel(cpu_q8.stack(parts), tiles=tiles)
        alone = [layers._Q8Kernel(p) for p in parts]
        assert all(a.tiles == stacked.tiles for a in alone)
        assert torch.equal(stacked(x), torch.cat([a(x) for a in alone], dim=-1))


def test_compiled_decode_step_equals_transformers_gemma3():
    # The one compiled family test: alternating sliding/global layers share one compiled
    # layer (their masks and rope tables are inputs).
    torch._dynamo.reset()
    model = make_model("gemma3_text")
    rt = Runtime(model, max_seq_len=32, compile=True)
    prompt = PROMPTS[0]
    assert rt.generate([prompt], 12) == [hf_greedy(model, prompt, 12)]
    assert rt._step is not _decode_step  # compiled, not the eager fallback after a failure


@pytest.mark.parametrize(
    "family,overrides,match",
    [
        ("qwen2", dict(hidden_act="tanh"), "hidden_act 'tanh'"),
        ("gemma3_text", dict(use_bidirectional_attention=True), "bidirectional"),
        ("stablelm", dict(use_parallel_residual=True), "use_parallel_residual=True"),
        ("stablelm", dict(qk_layernorm=True), "qk_layernorm=True"),
        ("olmoe", dict(clip_qkv=0.5), "clip_qkv=0.5"),
        # OPT-350m: norms after the blocks, a 512-wide embedding projected to 1024
        ("opt", dict(do_layer_norm_before=False), "do_layer_norm_before=False"),
        ("opt", dict(word_embed_proj_dim=32), "word_embed_proj_dim=32 differs from hidden_size"),
        (
            "gemma3_text",  # a per-layer-type rope: the global layers' type is checked too
            dict(
                rope_parameters={
                    "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                }
            ),
            "rope_type 'dynamic' depends on the sequence length",
        ),
        (
            "qwen3",  # an alpha makes "dynamic" static for HunYuan only: Qwen3's stays dynamic
            dict(rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 2.0,
                                  "rope_theta": 1e4}),  # fmt: skip
            "rope_type 'dynamic' depends on the sequence length",
        ),
    ],
    ids=["activation", "bidirectional", "parallel-residual", "qk-layernorm", "clip-qkv",
         "norms-after-blocks", "embedding-projection", "dynamic-rope",
         "dynamic-rope-with-alpha"],  # fmt: skip
)
def test_what_the_runtime_cannot_run_falls_back_with_the_reason(family, overrides, match):
    model = make_model(family, **overrides)
    assert match in unsupported_reason(model)
    with pytest.warns(RuntimeWarning, match=match):
        rt = Runtime(model, max_seq_len=48)
    assert rt.generate([PROMPTS[1]], 8) == [hf_greedy(model, PROMPTS[1], 8)]


def test_ministral3_query_scaling_runs_below_its_limit_and_falls_back_past_it():
    """Ministral 3 scales queries by 1 + beta * log(1 + floor(position / limit)): exactly 1
    below the limit, so a runtime of at most ``limit`` positions runs the model (tokens equal
    transformers'); a longer one would need the scaling and falls back, saying so."""
    model = make_model("ministral3")  # limit 512
    assert unsupported_reason(model, max_seq_len=512) is None
    assert Runtime(model, max_seq_len=64).generate([PROMPTS[1]], 8) == [
        hf_greedy(model, PROMPTS[1], 8)]
    assert "queries at positions 512 and beyond" in unsupported_reason(model, max_seq_len=513)
    with pytest.warns(RuntimeWarning, match="llama_4_scaling_beta=0.1"):
        rt = Runtime(model, max_seq_len=600)
    assert rt.generate([PROMPTS[1]], 8) == [hf_greedy(model, PROMPTS[1], 8)]


def test_a_family_the_runtime_does_not_implement_falls_back_saying_so(monkeypatch):
    # every family compress.arch names runs today: one made passes-only (runtime=False)
    import dataclasses

    monkeypatch.setitem(ARCHS, "opt", dataclasses.replace(ARCHS["opt"], runtime=False))
    model = make_model("opt")
    assert "is not implemented by this runtime" in unsupported_reason(model)
    with pytest.warns(RuntimeWarning, match="model_type 'opt' is not implemented"):
        rt = Runtime(model, max_seq_len=48)
    assert rt.generate([PROMPTS[1]], 8) == [hf_greedy(model, PROMPTS[1], 8)]


def test_a_family_without_runtime_facts_falls_back_by_model_type(monkeypatch):
    # a family whose Arch lacks runtime=True (OPT today): Qwen3 made so
    from compress.runtime import engine

    supported = tuple(t for t in engine.SUPPORTED_MODEL_TYPES if t != "qwen3")
    monkeypatch.setattr(engine, "SUPPORTED_MODEL_TYPES", supported)
    model = make_model("qwen3")
    assert "model_type 'qwen3' is not one of" in unsupported_reason(model)
    with pytest.warns(RuntimeWarning, match="model_type 'qwen3'"):
        rt = Runtime(model, max_seq_len=48)
    assert rt.generate([PROMPTS[1]], 8) == [hf_greedy(model, PROMPTS[1], 8)]


def test_runtime_families_have_runtime_facts():
    # A family flagged runtime=True needs its RuntimeSpec, and a spec is only worth having
    # for a family the runtime runs (catches an arch/families.py merge that loses either side).
    assert set(runtime_model_types()) == set(RUNTIME_SPECS)


def test_learned_positions_bound_the_cache_length():
    """OPT's position table has max_position_embeddings rows past its offset of 2: a cache
    longer than that is refused before any weight is taken, and the last position is read."""
    model = make_model("opt", max_position_embeddings=24)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="learned positions for 24 tokens; lower it to that"):
        Runtime(model, max_seq_len=25, compile=False)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    rt = Runtime(model, max_seq_len=24, compile=False, decode_dtype=torch.float32)
    prompt = PROMPTS[0] + PROMPTS[2]  # 16 tokens + 8 new: position 23 is the last
    assert rt.generate([prompt], 8) == [hf_greedy(model, prompt, 8)]
