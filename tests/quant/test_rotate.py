"""``rotate.hadamard``: the constructions are orthogonal, the fold leaves every supported
family's logits unchanged (norm weights and biases randomized first, so a wrong fold shows), the
exported checkpoint reloads in plain transformers, refused inputs change nothing, and on a model
with an outlier channel the rotation lowers int4 RTN's error (what the pass is for)."""

from __future__ import annotations

import pytest
import torch

from compress.arch import ARCHS
from compress.core.errors import ConfigError
from compress.core.registry import CompressionState, run_passes
from compress.io.export import export_checkpoint
from compress.quant.rotate import RotateConfig, hadamard_matrix, rotation_matrix
from compress.quant.rtn import Int4RtnConfig
from compress.testing import (
    TINY_MODEL_TYPES,
    TINY_MOE_TYPES,
    make_char_tokenizer,
    make_tiny_llama,
    make_tiny_model,
    make_tiny_moe,
    plain_transformers_logits,
)

IDS = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 12, 64, 33, 21, 8, 90, 111, 4, 60]])
# norms after the blocks (Gemma 2/3, OLMo2/3, EXAONE 4, GLM-4)
REFUSED = tuple(t for t in TINY_MODEL_TYPES if ARCHS[t].post_norms)
# LayerNorms: the mean and the bias do not commute with a rotation (StableLM, Starcoder2,
# Cohere, Phi, Phi-3.5-MoE)
LAYER_NORMS = tuple(t for t in TINY_MODEL_TYPES + TINY_MOE_TYPES if ARCHS[t].norm_kind == "layer")
ROTATABLE = [t for t in TINY_MODEL_TYPES + TINY_MOE_TYPES if t not in REFUSED + LAYER_NORMS]


def _model(family: str):
    model = make_tiny_moe(family) if family in TINY_MOE_TYPES else make_tiny_model(family)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random norm weights and biases: a fold that dropped one would show
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(
                    0.5 + torch.rand(p.shape, generator=gen)
                    if "norm" in name
                    else 0.1 * torch.randn(p.shape, generator=gen)
                )
    return model


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits.double()


@pytest.mark.parametrize("n", [1, 2, 4, 12, 20, 28, 48, 64, 96, 576, 896, 1536])
def test_hadamard_matrix_is_hadamard(n):
    h = hadamard_matrix(n)
    assert h is not None and h.shape == (n, n)
    assert set(h.unique().tolist()) <= {-1.0, 1.0}
    torch.testing.assert_close(h @ h.T, n * torch.eye(n, dtype=torch.float64))


@pytest.mark.parametrize("n", [3, 36 * 7, 100])
def test_no_hadamard_falls_back_to_orthogonal_and_says_so(n):
    assert hadamard_matrix(n) is None or n % 4 == 0
    q, what = rotation_matrix(n, "hadamard", torch.Generator().manual_seed(0))
    torch.testing.assert_close(q @ q.T, torch.eye(n, dtype=torch.float64))
    if hadamard_matrix(n) is None:
        assert "random orthogonal" in what and str(n) in what


@pytest.mark.parametrize("family", ROTATABLE)
def test_rotation_leaves_logits_unchanged(family):
    torch.set_num_threads(1)
    model = _model(family)
    before = _logits(model)
    embed_before = model.get_input_embeddings().weight.detach().clone()
    state = CompressionState(progress=False)
    latent = ARCHS[family].latent_attention  # DeepSeek's MLA: the residual stream only
    if latent:
        with pytest.raises(ConfigError, match="latent attention.*value_output: false"):
            run_passes(model, [RotateConfig()], state)
        torch.testing.assert_close(model.get_input_embeddings().weight, embed_before)
    run_passes(model, [RotateConfig(value_output=not latent)], state)
    after = _logits(model)
    assert float((after - before).abs().max() / before.abs().max()) < 1e-4
    # it did rotate: the embedding changed (the invariance above is not a no-op's)
    assert not torch.allclose(model.get_input_embeddings().weight, embed_before)
    metrics = state.reports[-1].metrics
    assert "Hadamard of order 64" in metrics["residual_rotation"]
    assert latent or "Hadamard of order 16" in metrics["value_output_rotation"]


def test_tied_head_is_untied_and_exports_to_plain_transformers(tmp_path):
    torch.set_num_threads(1)
    model = _model("llama")
    assert model.config.tie_word_embeddings
    before = _logits(model)
    state = CompressionState(progress=False)
    run_passes(model, [RotateConfig(kind="orthogonal", seed=3)], state)
    assert "untied_head" in state.reports[-1].metrics
    assert not model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    export_checkpoint(model, make_char_tokenizer(), tmp_path / "export", dtype="float32")
    [theirs] = plain_transformers_logits([tmp_path / "export"], IDS.tolist(), tmp_path)
    assert float((theirs.double() - before).abs().max() / before.abs().max()) < 1e-4


@pytest.mark.parametrize("family", REFUSED)
def test_post_norm_families_are_refused_untouched(family):
    model = _model(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match="norms after its attention/MLP"):
        run_passes(model, [RotateConfig()], CompressionState(progress=False))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("family", LAYER_NORMS)
def test_layer_norm_families_are_refused_untouched(family):
    model = _model(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=f"'{family}' uses LayerNorms: .* does not commute"):
        run_passes(model, [RotateConfig()], CompressionState(progress=False))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_later_norm_that_does_not_commute_is_refused_before_any_layer_changes():
    """A LayerNorm in the last layer is found before layer 0 is rotated (a streamed model is
    checked the same way on its meta skeleton, before any layer is read)."""
    model = _model("llama")
    model.model.layers[-1].post_attention_layernorm = torch.nn.LayerNorm(64, bias=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match="layer 1 post_attention_layernorm is a LayerNorm"):
        run_passes(model, [RotateConfig()], CompressionState(progress=False))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_quantized_model_is_refused_and_selection_fields_are_rejected():
    model = make_tiny_llama()
    run_passes(model, [Int4RtnConfig(group_size=32)], CompressionState(progress=False))
    with pytest.raises(ConfigError, match="before the quantization passes"):
        run_passes(model, [RotateConfig()], CompressionState(progress=False))
    with pytest.raises(ValueError, match="cannot select layers"):
        RotateConfig(ignore=("re:.*down_proj",))


def _kl_to(reference: torch.Tensor, model, ids: torch.Tensor) -> float:
    log_p = reference.log_softmax(-1)
    with torch.no_grad():
        log_q = model(ids).logits.double().log_softmax(-1)
    return float((log_p.exp() * (log_p - log_q)).sum(-1).mean())


def test_rotation_lowers_int4_error_with_outlier_columns():
    """Two input columns 20x larger in every linear that reads the residual stream (the weight
    outliers rotations target): int4 RTN (one group per row) after the rotation has under half
    the relative weight error and 60% of the KL to the float model that it has without."""
    torch.set_num_threads(1)
    ids = torch.randint(3, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    base = make_tiny_llama()
    with torch.no_grad():
        for layer in base.model.layers:
            for linear in (
                layer.self_attn.q_proj,
                layer.self_attn.k_proj,
                layer.self_attn.v_proj,
                layer.mlp.gate_proj,
                layer.mlp.up_proj,
            ):
                linear.weight[:, [3, 40]] *= 20
        reference = base(ids).logits.double()
    weight_error, kl = {}, {}
    for rotate in (False, True):
        model = make_tiny_llama()
        model.load_state_dict(base.state_dict())
        state = CompressionState(progress=False)
        passes = ([RotateConfig()] if rotate else []) + [Int4RtnConfig(group_size=64)]
        run_passes(model, passes, state)
        weight_error[rotate] = state.reports[-1].metrics["relative_weight_error"]
        kl[rotate] = _kl_to(reference, model, ids)
    assert weight_error[True] < 0.5 * weight_error[False], weight_error
    assert kl[True] < 0.6 * kl[False], kl


def test_rotated_quantized_model_runs_on_the_runtime():
    """The untied head and the rotated weights go through the runtime's own decode (fp32):
    the same greedy tokens as transformers' generate on the same model."""
    from compress.runtime.engine import Runtime
    from compress.testing import hf_greedy

    torch.set_num_threads(1)
    model = _model("llama")
    run_passes(
        model, [RotateConfig(), Int4RtnConfig(group_size=32)], CompressionState(progress=False)
    )
    prompt = IDS[0, :8].tolist()
    runtime = Runtime(
        model, max_seq_len=32, decode_dtype=torch.float32, compile=False, keep_model_weights=True
    )  # the model runs too, for the reference
    assert runtime.generate([prompt], 8) == [hf_greedy(model, prompt, 8)]


def test_clamped_values_refuse_their_rotation_and_the_v_to_o_scale():
    """OLMoE's clip_qkv clamps v_proj's outputs before o_proj: rotating the value heads, or
    folding AWQ's or SmoothQuant's scale from one into the other, changed the float model
    (perplexity 3,263 -> 1,941) with exit 0. The residual rotation stays exact."""
    from compress.arch import with_clamped_values

    model = _model("olmoe")
    model.config.clip_qkv = 0.05  # clamps: the tiny model's q, k, v reach past it
    arch = with_clamped_values(ARCHS["olmoe"], model.config)
    assert all(m.producer != arch.v for m in arch.awq_mappings + arch.smoothquant_mappings)
    gap = [g for g in arch.scale_gaps if g.consumers == (arch.o,)]
    assert gap and "clip_qkv=0.05 clamps" in gap[0].reason
    model.config.clip_qkv = None
    assert with_clamped_values(ARCHS["olmoe"], model.config) is ARCHS["olmoe"]
    model.config.clip_qkv = 0.05
    before = _logits(model)
    state = CompressionState(progress=False)
    with pytest.raises(ConfigError, match="clip_qkv=0.05 clamps the values.*value_output: false"):
        run_passes(model, [RotateConfig()], state)
    run_passes(model, [RotateConfig(value_output=False)], state)
    after = _logits(model)
    assert float((after - before).abs().max() / before.abs().max()) < 1e-4
