"""DeepSeek-V2/V3's multi-head latent attention (MLA): the entry that matches the config's query
path, and the passes that cannot handle a latent cache refused before any work. The quantization
passes, folds, exports and MTP modules of these families run in the MoE, fold, export and MTP
tests (``TINY_MOE_TYPES``); the runtime's latent attention (``compress.runtime.latent``) in the
runtime family and scheduler tests."""

from __future__ import annotations

import copy

import pytest
import torch

from compress.arch import arch_for
from compress.core.errors import ConfigError
from compress.core.registry import run_passes
from compress.quant.kv_cache import KvCacheFp8Config
from compress.testing import make_tiny_moe
from tests.quant.quant_helpers import tiny_state


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_the_entry_follows_the_query_path_the_config_builds(family):
    for q_lora_rank, reader, inner in ((64, "q_a_proj", 2), (None, "q_proj", 1)):
        model = make_tiny_moe(family, q_lora_rank=q_lora_rank)
        arch = arch_for(model, "test")
        layer = model.model.layers[0]
        built = {n for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
        assert arch.q == f"self_attn.{reader}" and len(arch.inner_linears) == inner
        # every attention Linear the model built is one the entry names, and no other
        assert {p for p in arch.linears if p.startswith("self_attn.")} == {
            n for n in built if n.startswith("self_attn.")}


def test_fp8_kv_cache_scales_are_refused_for_a_latent_cache():
    model = make_tiny_moe("deepseek_v3")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ConfigError, match="multi-head latent attention.*compressed latent"):
        run_passes(model, [KvCacheFp8Config()], tiny_state())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("q_lora_rank", [64, None])
def test_the_runtime_absorbs_an_int4_latent_expansion(q_lora_rank):
    """Every projection int4, kv_b_proj's absorbed into the query and value products in fp32
    (dequantized once): the runtime's prefill and decode logits against transformers running
    the same int4 model (its kernel on bf16 activations), within that kernel's own rounding
    (measured 1.6-1.7%); the cache holds one head of latent and rotary key per token."""
    from compress.quant.rtn import Int4RtnConfig, quantize_linears
    from compress.runtime.engine import Runtime

    model = make_tiny_moe("deepseek_v3", q_lora_rank=q_lora_rank, tie_word_embeddings=False,
                          initializer_range=0.3).eval()
    quantize_linears(model, Int4RtnConfig(group_size=32), 4, "test")
    runtime = Runtime(model, max_seq_len=48, decode_dtype=torch.float32, compile=False,
                      keep_model_weights=True)
    layer = runtime.layers[0]
    assert (layer.n_kv, layer.head_dim, layer.v) == (1, 64 + 16, None)  # rank + rope
    prompt, continuation = [5, 17, 42, 99, 7, 3, 250, 12, 64, 33], [40, 60, 80]
    got = torch.stack([runtime.prefill(prompt)] + [runtime.score([t])[-1] for t in continuation])
    with torch.no_grad():
        expected = model(torch.tensor([prompt + continuation])).logits[0, len(prompt) - 1:]
    # transformers' own int4 kernel (bf16 activations) against the same model in fp32 moves
    # these logits by 3.6% (relative norm); a wrongly absorbed expansion by ~140%
    assert float((got - expected).norm() / expected.norm()) < 5e-2


def test_a_bf16_model_keeps_its_absorbed_expansion_in_bf16():
    """Half the bytes of the fp32 copy; logits within bf16 rounding of transformers' bf16 model
    (measured 1.5% relative norm; a wrongly absorbed expansion is 144% off)."""
    from compress.runtime.engine import Runtime

    model = make_tiny_moe("deepseek_v3", tie_word_embeddings=False, initializer_range=0.3)
    model = model.to(torch.bfloat16).eval()
    runtime = Runtime(model, max_seq_len=48, compile=False, keep_model_weights=True)
    assert runtime.layers[0].w_k.dtype == torch.bfloat16
    prompt = [5, 17, 42, 99, 7, 3, 250, 12, 64, 33]
    got = runtime.prefill(prompt)
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0, -1].float()
    assert float((got - expected).norm() / expected.norm()) < 3e-2


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_the_latent_is_cached_once_for_keys_and_values(kv_dtype):
    """The values are the cached keys (the latent and the rotary key): the contiguous cache and
    the paged pool hold one tensor per layer for both (they held the latent twice), so a KV
    budget holds twice the blocks; the scheduler's tokens are still the contiguous runtime's,
    and a Llama's caches stay two."""
    from compress.runtime.engine import Runtime
    from compress.runtime.paged import kv_bytes_per_token
    from compress.runtime.scheduler import Scheduler
    from compress.testing import make_tiny_model

    model = make_tiny_moe("deepseek_v3", tie_word_embeddings=False, initializer_range=0.3).eval()
    runtime = Runtime(model, max_seq_len=48, compile=False)
    assert all(k is v for k, v in zip(runtime.k_cache, runtime.v_cache, strict=True))
    layers, width = len(runtime.layers), 64 + 16  # one head of rank + rope
    assert runtime.decode_bytes()["kv_cache"] == layers * 48 * width * 4  # fp32, batch 1
    per_token = kv_bytes_per_token(layers, 1, width, torch.float32, values_in_keys=True)
    assert per_token == layers * width * 4
    scheduler = Scheduler(runtime, kv_memory=32 * 4 * per_token, block_size=4, kv_dtype=kv_dtype)
    cache = scheduler.cache
    assert cache.v is cache.k and cache.v_scale is cache.k_scale
    assert scheduler.pool.num_blocks == (32 if kv_dtype == "float32" else 32 * width * 4 //
                                         (width + 4))
    prompts = [[5, 17, 42, 99, 7, 3], [250, 12, 64, 33, 21, 8, 90]]
    ids = [scheduler.add(p, 8) for p in prompts]
    got = {i: [] for i in ids}
    while scheduler.has_work:
        for event in scheduler.step():
            got[event.id].append(event.token)
    expected = [runtime.generate([p], 8)[0] for p in prompts]
    if kv_dtype == "float32":
        assert [got[i] for i in ids] == expected
    else:  # int8 pages round the latent: the first token comes from the prefill's own keys
        assert [got[i][0] for i in ids] == [e[0] for e in expected]
    llama = Runtime(make_tiny_model("llama"), max_seq_len=16, compile=False)
    assert not any(k is v for k, v in zip(llama.k_cache, llama.v_cache, strict=True))


def test_an_absorbed_int4_expansion_is_not_repacked_and_its_weights_are_released():
    """kv_b_proj is absorbed (w_k, w_v): the layer builds no int4 holder for it (it built one
    and dropped it), and a runtime that releases the model's quantized weights releases its
    codes too; the tokens equal a runtime that keeps them."""
    from compress.quant.linear import QuantLinear
    from compress.quant.rtn import Int4RtnConfig, quantize_linears
    from compress.runtime import layers
    from compress.runtime.engine import Runtime

    model = make_tiny_moe("deepseek_v3", tie_word_embeddings=False, initializer_range=0.3).eval()
    quantize_linears(model, Int4RtnConfig(group_size=32), 4, "test")
    arch = arch_for(model, "test")
    prompt = [5, 17, 42, 99, 7, 3]
    kept = Runtime(model, max_seq_len=32, compile=False, keep_model_weights=True)
    expected = kept.generate([prompt], 8)
    built = []
    convert = layers._convert_linear
    try:
        layers._convert_linear = lambda module, name, *a, **k: built.append(name) or convert(
            module, name, *a, **k)
        import compress.runtime.latent as latent

        latent._convert_linear = layers._convert_linear
        runtime = Runtime(model, max_seq_len=32, compile=False)
    finally:
        layers._convert_linear = latent._convert_linear = convert
    assert built and not any(name.endswith(arch.v) for name in built)
    expand = model.get_submodule(f"{arch.layer_prefix}0.{arch.v}")
    assert isinstance(expand, QuantLinear) and expand.weight_scale.is_meta
    assert runtime.generate([prompt], 8) == expected
