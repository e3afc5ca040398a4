"""Every dense family of ``compress.arch`` through the scale folds, the quantization passes and
the prune passes, on tiny random models (``compress.testing.make_tiny_model``). Adding a family
is one adapter entry plus one config in ``make_tiny_model``; every test here is parametrized
over ``TINY_MODEL_TYPES``.

The references are independent of the code under test: a scale fold (random, AWQ's searched
or SmoothQuant's scales, without rounding) must leave the logits unchanged; a quantized model's
KL to the float model is compared with RTN's (plain W8A8 for SmoothQuant) at the same bits, which
is what catches a wrong norm fold (Gemma's ``(1 + w)``); a structured prune must equal the float
model with the removed units zeroed, and plain ``from_pretrained`` must reload it with the same
logits.

The tiny models get random norm weights (a fold into the wrong norm shows) and, for the KL
tests, activation outlier channels (x10 on 4 embedding columns), the case AWQ and SmoothQuant are
for; without outliers their scales are close to 1 and a broken fold would not show.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from compress.arch import ARCHS, arch_for, decoder_layers, head_dim_of, producer_rows
from compress.core.errors import ConfigError
from compress.core.registry import run_passes
from compress.prune.config import (
    AttentionHeadsConfig,
    HiddenSizeConfig,
    LayersConfig,
    MlpChannelsConfig,
)
from compress.prune.hidden import scale_post_norms
from compress.quant.awq import AwqConfig, _expand, scale_layer
from compress.quant.calibrated import migrate_scales, run_calibrated, run_layer, run_sequential
from compress.quant.gptq import GptqConfig
from compress.quant.linear import QuantLinear, W8A8Linear, WeightScheme
from compress.quant.rtn import Int4RtnConfig
from compress.quant.smoothquant import SmoothquantConfig, smooth_layer
from compress.testing import TINY_MODEL_TYPES, make_tiny_model, make_tiny_moe
from tests.quant.quant_helpers import tiny_state

FAMILIES = list(TINY_MODEL_TYPES)
# Families whose modeling sizes the attention from hidden_size, not from heads x head_dim
# (Helium's hidden x hidden o_proj, StableLM's, OPT's and GPT-NeoX's head_dim = hidden / heads):
# neither fewer heads nor a narrower residual reloads, and the two passes refuse them (GPT-NeoX's
# per-head fused q/k/v is refused by name first).
ATTENTION_FROM_HIDDEN = ("helium", "stablelm", "opt", "gpt_neox")
IDS = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(123))


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # microsecond ops on a shared 2-core box: 1 thread is faster
    yield
    torch.set_num_threads(threads)


# DeepSeek's latent attention (MoE around it), with and without the query's low-rank path
# (q_lora_rank unset: DeepSeek-V2-Lite, Moonlight): its norm -> linear folds
LATENT = ["deepseek_v3", "deepseek_v2", "deepseek_v3-q_proj", "glm4_moe_lite"]


@torch.no_grad()
def _model(model_type: str, seed: int = 0, *, outliers: bool = False, dtype=torch.float64):
    if model_type in LATENT:  # eager experts: the grouped kernel takes no float64
        family, _, q = model_type.partition("-")
        model = make_tiny_moe(family, seed=seed, **({"q_lora_rank": None} if q else {}))
        model.set_experts_implementation("eager")
    else:
        model = make_tiny_model(model_type, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():  # every family's norm class, whatever its form, and biases
        if type(module).__name__.endswith(("RMSNorm", "LayerNorm", "LayerNorm1P")):
            module.weight.add_(0.1 * torch.randn(module.weight.shape, generator=gen))
            if getattr(module, "bias", None) is not None:  # LayerNorm's: folds divide it too
                module.bias.add_(0.1 * torch.randn(module.bias.shape, generator=gen))
    if outliers:
        model.get_input_embeddings().weight[:, :4] *= 10
    return model.to(dtype)


@torch.no_grad()
def _logits(model: nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    return model(ids).logits.double()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _kl(model: nn.Module, reference: nn.Module) -> float:
    """Mean over tokens of KL(reference || model)."""
    p, q = torch.log_softmax(_logits(reference), -1), torch.log_softmax(_logits(model), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


# ---- the adapter entries match the models ------------------------------------------------
@pytest.mark.parametrize("model_type", FAMILIES)
def test_entry_names_every_linear_and_norm_of_the_layer(model_type):
    """Every Linear of a decoder layer is a prune reader/writer (so nothing is missed), every
    norm is a layer norm or a q/k norm, and every mapping's consumers are Linears whose input
    width matches the producer's (fused part)."""
    model = _model(model_type, dtype=torch.float32)
    arch = arch_for(model, "test")
    layer = decoder_layers(model)[0]
    linears = {n for n, m in layer.named_modules() if type(m) is nn.Linear}
    kinds = ("RMSNorm", "LayerNorm", "LayerNorm1P")
    norms = {n for n, m in layer.named_modules() if type(m).__name__.endswith(kinds)}
    assert set(arch.linears) == linears
    assert set(arch.layer_norms) | set(arch.qk_norms) == norms
    for name in arch.layer_norms:  # the declared kind is the modules' (the runtime follows it)
        centered = "LayerNorm" in type(layer.get_submodule(name)).__name__
        assert centered == (arch.norm_kind == "layer"), name
    for m in arch.awq_mappings + arch.smoothquant_mappings:
        rows = producer_rows(layer, m)
        width = layer.get_submodule(m.producer).weight[rows or slice(None)].shape[0]
        for consumer in m.consumers:
            k = layer.get_submodule(consumer).in_features
            assert k % width == 0, (m, width, k)
    scaled = {c for m in arch.awq_mappings for c in m.consumers}
    gaps = {c for g in arch.scale_gaps for c in g.consumers}
    assert scaled | gaps == linears and not scaled & gaps  # every linear: scaled or reported


@pytest.mark.parametrize("model_type", FAMILIES)
@torch.no_grad()
def test_sequential_calibration_runs_each_layer_as_the_model_does(model_type):
    """Every layer's output in the layer-by-layer calibration equals its output in the model's
    own forward: Gemma2/3 give sliding and global layers different masks (and Gemma3 different
    rotary tables), so replaying layer 0's arguments for every layer would be wrong."""
    model = _model(model_type, dtype=torch.float32)
    batches = tiny_state().calibration_batches()  # 32 tokens: beyond the 8-token windows
    layers = decoder_layers(model)
    expected: list[list[torch.Tensor]] = [[] for _ in layers]
    handles = [
        layer.register_forward_hook(lambda m, a, out, i=i: expected[i].append(out))
        for i, layer in enumerate(layers)
    ]
    try:
        for ids in batches:
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    got: list[list[torch.Tensor]] = []
    run_sequential(
        model, batches, lambda i, layer, inputs: got.append(run_layer(layer, inputs)),
        device=torch.device("cpu"), progress=False,
    )  # fmt: skip
    for mine, theirs in zip(got, expected, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---- scale folds keep the function -------------------------------------------------------
@torch.no_grad()
def _random_folds(model: nn.Module, arch) -> None:
    """Fold random scales (0.5-2) through every AWQ and SmoothQuant mapping of every layer."""
    gen = torch.Generator().manual_seed(7)
    mappings = list(dict.fromkeys(arch.awq_mappings + arch.smoothquant_mappings))
    for layer in decoder_layers(model):
        for m in mappings:
            rows = producer_rows(layer, m)
            prev = layer.get_submodule(m.producer)
            lins = [layer.get_submodule(c) for c in m.consumers]
            width = prev.weight[rows or slice(None)].shape[0]
            s_prev = 0.5 + 1.5 * torch.rand(width, generator=gen, dtype=torch.float64)
            s = _expand(s_prev, lins[0].in_features // width, head_dim_of(layer))
            migrate_scales(prev, lins, s_prev, s, norm_form=arch.norm_form, rows=rows)


@pytest.mark.parametrize("model_type", FAMILIES + LATENT)
def test_random_scale_folds_keep_the_logits(model_type):
    model = _model(model_type)
    before = _logits(model)
    _random_folds(model, arch_for(model, "test"))
    # Gemma's norms compute in float32 whatever the model's dtype: ~1e-7 there, ~1e-15 else
    assert _rel(_logits(model), before) < 1e-5


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_gemma_fold_needs_the_one_plus_w_form(model_type):
    """The control for the test above: folding into Gemma's norms as if they were ``w * n(x)``
    changes the logits (the bug of issue 17), so the test above can fail."""
    model = _model(model_type)
    before = _logits(model)
    _random_folds(model, dataclasses.replace(arch_for(model, "test"), norm_form="w"))
    assert _rel(_logits(model), before) > 1e-2


def _fold_only(model: nn.Module, fold) -> dict:
    """Run ``fold(layer, arch, inputs, prefix, notes)`` layer by layer on the calibration data."""
    arch, notes = arch_for(model, "test"), {}

    def process(index, layer, inputs):
        fold(layer, arch, inputs, f"{arch.layer_prefix}{index}.", notes)

    run_calibrated(model, tiny_state(), process, "fold", offload="none")
    return notes


@pytest.mark.parametrize("model_type", FAMILIES + LATENT)
def test_awq_scale_fold_keeps_the_logits(model_type):
    model = _model(model_type, outliers=True)
    before = _logits(model)
    cfg = AwqConfig(group_size=32, n_grid=10)
    scheme = WeightScheme(4, 32, True, torch.float16)

    def fold(layer, arch, inputs, prefix, notes):
        mine = dict.fromkeys(arch.linears, scheme)
        scale_layer(layer, arch, mine, inputs, cfg, prefix=prefix, notes=notes)

    notes = _fold_only(model, fold)
    scaled = {k: v for k, v in notes.items() if isinstance(v, dict)}
    arch = arch_for(model, "test")
    assert len(scaled) == 2 * len(arch.awq_mappings)  # every mapping of both layers
    # scales far from 1 (a wrong fold then moves the logits far past the tolerance): a real
    # test. Post-norm families (OLMo2/3) have only linear -> linear mappings, spread ~1.9.
    assert max(v["scale_spread"] for v in scaled.values()) > 1.5
    assert len(notes) - len(scaled) == 2 * len(arch.scale_gaps)  # the gaps, reported
    assert _rel(_logits(model), before) < 1e-5


@pytest.mark.parametrize("model_type", FAMILIES + LATENT)
def test_smoothquant_scale_fold_keeps_the_logits(model_type):
    model = _model(model_type, outliers=True)
    before = _logits(model)
    cfg = SmoothquantConfig()

    def fold(layer, arch, inputs, prefix, notes):
        smooth_layer(layer, arch, set(arch.linears), inputs, cfg, prefix=prefix, notes=notes)

    notes = _fold_only(model, fold)
    spreads = [v for v in notes.values() if isinstance(v, float)]
    assert len(spreads) == 2 * len(arch_for(model, "test").smoothquant_mappings)
    assert min(spreads) > 1.5
    assert _rel(_logits(model), before) < 1e-5


@pytest.mark.parametrize("cfg", [AwqConfig(group_size=32, n_grid=5), SmoothquantConfig()],
                         ids=["awq", "smoothquant"])  # fmt: skip
def test_olmo2_unscaled_groups_are_reported(cfg, caplog):
    """OLMo2's q/k/v and gate/up read the residual stream: quantized unscaled, and the report
    and a WARNING say so (v -> o and up -> down are still scaled)."""
    model = _model("olmo2", dtype=torch.float32)
    state = tiny_state()
    with caplog.at_level("WARNING"):
        run_passes(model, [cfg], state)
    unscaled = state.reports[-1].metrics["unscaled"]
    assert len(unscaled) == 4  # 2 groups x 2 layers
    assert all("residual stream" in reason for reason in unscaled.values())
    assert any("olmo2" in r.message and "4 groups" in r.message for r in caplog.records)


# ---- quantized: every decoder linear, and no worse than the plain method ----------------
def _quantized(model_type: str, cfg, seed: int, cls=QuantLinear):
    """(float model, quantized copy, report); checks every decoder Linear became ``cls``."""
    base = _model(model_type, seed, outliers=True, dtype=torch.float32)
    model = copy.deepcopy(base)
    state = tiny_state(seed=seed)
    run_passes(model, [cfg], state)
    report = state.reports[-1]
    arch = arch_for(model, "test")
    layers = decoder_layers(model)
    expected = {f"{arch.layer_prefix}{i}.{n}" for i in range(len(layers)) for n in arch.linears}
    assert set(report.changed) == expected and not report.skipped
    assert not [n for n, m in layers.named_modules() if type(m) is nn.Linear]
    assert all(isinstance(model.get_submodule(n), cls) for n in expected)
    return base, model, report


@pytest.mark.parametrize("model_type", FAMILIES)
def test_awq_kl_is_not_worse_than_rtn(model_type):
    """KL summed over 2 seeds. Measured AWQ / RTN: 0.48-0.81 (Gemma2 0.81); with Gemma's norms
    folded as ``w * n(x)`` (the bug of issue 17): 1.67 (Gemma2), 1.51 (Gemma3)."""
    kls = {"awq": 0.0, "rtn": 0.0}
    for seed in (0, 1):
        for name, cfg in (
            ("awq", AwqConfig(group_size=32, n_grid=10, clip_grid=10)),
            ("rtn", Int4RtnConfig(group_size=32)),
        ):
            base, model, _ = _quantized(model_type, cfg, seed)
            kls[name] += _kl(model, base)
    assert kls["awq"] <= 1.25 * kls["rtn"], kls


@pytest.mark.parametrize("model_type", FAMILIES)
def test_smoothquant_kl_is_not_worse_than_plain_w8a8(model_type):
    """Measured SmoothQuant / plain W8A8: 0.31-0.68 (OLMo2 0.97: only up -> down can be
    smoothed); with Gemma's norms folded as ``w * n(x)``: 566 (Gemma3), 1317 (Gemma2)."""
    base, model, report = _quantized(model_type, SmoothquantConfig(), 0, W8A8Linear)
    _, plain, _ = _quantized(model_type, SmoothquantConfig(smooth=False), 0, W8A8Linear)
    assert _kl(model, base) <= 1.5 * _kl(plain, base)
    assert len(report.metrics["unscaled"]) == 2 * len(arch_for(model, "test").scale_gaps)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_gptq_kl_is_not_far_worse_than_rtn(model_type):
    """Fused linears are plain Linears to GPTQ. Measured GPTQ / RTN (one seed): 0.67-1.17."""
    base, model, _ = _quantized(model_type, GptqConfig(group_size=32), 0)
    _, rtn, _ = _quantized(model_type, Int4RtnConfig(group_size=32), 0)
    assert _kl(model, base) <= 1.5 * _kl(rtn, base)


# ---- pruning -----------------------------------------------------------------------------
def _kept(pruned: torch.Tensor, original: torch.Tensor) -> list[int]:
    """Indices of the original columns that the pruned weight kept (random weights: unique)."""
    return [int((original - col[:, None]).abs().sum(0).argmin()) for col in pruned.T]


@pytest.mark.parametrize(
    ("model_type", "what"),
    # OLMo2/3's q_norm spans all heads: removing heads changes its statistics, so a head-pruned
    # OLMo2 is not the masked one (its structure and reload are checked below).
    [(t, "heads") for t in FAMILIES
     if ARCHS[t].qk_norm_span != "heads" and t not in ATTENTION_FROM_HIDDEN]  # fmt: skip
    + [(t, "mlp") for t in FAMILIES],
)
@torch.no_grad()
def test_structured_prune_equals_the_masked_model(model_type, what):
    """A pruned model (magnitude importance) equals the float model with the removed query
    heads (KV groups) or MLP channels zeroed at the output projection's input."""
    model = _model(model_type)
    masked = copy.deepcopy(model)
    arch = arch_for(model, "test")
    cfg = (
        AttentionHeadsConfig(num_attention_heads=2, importance="magnitude")
        if what == "heads"
        else MlpChannelsConfig(intermediate_size=96, importance="magnitude")
    )
    run_passes(model, [cfg], tiny_state())
    out = arch.o if what == "heads" else arch.down
    for layer, ref in zip(decoder_layers(model), decoder_layers(masked), strict=True):
        w, w_ref = layer.get_submodule(out).weight, ref.get_submodule(out).weight
        kept = _kept(w, w_ref)
        assert w.shape[1] < w_ref.shape[1] and len(set(kept)) == len(kept)
        removed = sorted(set(range(w_ref.shape[1])) - set(kept))
        w_ref[:, removed] = 0
    torch.testing.assert_close(_logits(model), _logits(masked), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("model_type", [t for t in FAMILIES if ARCHS[t].qk_norms])
@torch.no_grad()
def test_head_prune_keeps_the_q_k_norms_of_the_kept_heads(model_type):
    """q/k norms over one head (Qwen3, Gemma3) are unchanged; norms over all heads (OLMo2) keep
    the entries of the kept q rows and k rows (found from the kept o columns and k rows)."""
    model = _model(model_type)
    original = copy.deepcopy(model)
    arch = arch_for(model, "test")
    run_passes(model, [AttentionHeadsConfig(num_attention_heads=2, importance="magnitude")],
               tiny_state())  # fmt: skip
    for layer, ref in zip(decoder_layers(model), decoder_layers(original), strict=True):
        (q_norm, k_norm), (q_ref, k_ref) = (
            [x.get_submodule(n).weight for n in arch.qk_norms] for x in (layer, ref)
        )
        if arch.qk_norm_span == "head":
            assert torch.equal(q_norm, q_ref) and torch.equal(k_norm, k_ref)
            continue
        q_rows = _kept(layer.get_submodule(arch.o).weight, ref.get_submodule(arch.o).weight)
        k_rows = _kept(layer.get_submodule(arch.k).weight.T, ref.get_submodule(arch.k).weight.T)
        assert len(q_rows) == 32 and len(k_rows) == 16
        assert torch.equal(q_norm, q_ref[q_rows]) and torch.equal(k_norm, k_ref[k_rows])


@pytest.mark.parametrize("model_type", FAMILIES)
def test_prune_chain_reloads_with_plain_transformers(model_type, tmp_path):
    """Heads, MLP channels, hidden size and layers (activation importance), then a plain
    ``from_pretrained`` gives the same logits and the pruned config."""
    from transformers import AutoModelForCausalLM

    model = _model(model_type, dtype=torch.float32)
    arch = arch_for(model, "test")
    # Gemma (1) scales its embedding by sqrt(hidden) and has no post-norm to compensate a new
    # factor with: hidden-size pruning refuses it (checked), the rest of the chain runs.
    hidden = 64 if arch.embed_scaling != "none" and not arch.post_norms else 48
    if hidden == 64:
        with pytest.raises(ConfigError, match="post-norm"):
            run_passes(copy.deepcopy(model), [HiddenSizeConfig(hidden_size=48)], tiny_state())
    heads = 4 if model_type in ATTENTION_FROM_HIDDEN else 2
    if model_type in ATTENTION_FROM_HIDDEN:  # refused before anything is sliced
        untouched = copy.deepcopy(model.state_dict())
        refusals = [AttentionHeadsConfig(num_attention_heads=2), HiddenSizeConfig(hidden_size=48)]
        for refused in refusals:
            refusal = r"(is \d+x\d+, not .*would not reload|fuses q/k/v per head)"
            with pytest.raises(ConfigError, match=refusal):
                run_passes(model, [refused], tiny_state())
        assert all(torch.equal(v, untouched[k]) for k, v in model.state_dict().items())
        hidden = 64
    passes = [
        *([AttentionHeadsConfig(num_attention_heads=2)] if heads == 2 else []),
        MlpChannelsConfig(intermediate_size=96),
        *([HiddenSizeConfig(hidden_size=hidden)] if hidden != 64 else []),
        LayersConfig(num_layers=1),
    ]
    run_passes(model, passes, tiny_state())
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(model)
    config = reloaded.config
    assert (config.num_attention_heads, config.num_key_value_heads) == (heads, heads // 2)
    sizes = (getattr(config, arch.mlp_width_key), config.hidden_size, config.num_hidden_layers)
    assert sizes == (96, hidden, 1)
    torch.testing.assert_close(_logits(reloaded), _logits(model), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
@torch.no_grad()
def test_gemma_residual_rescale_is_invisible(model_type):
    """Hidden-size pruning changes Gemma's embedding factor sqrt(hidden_size); scaling every
    post-norm by the same ratio scales the whole residual stream, which the pre-norms and the
    final norm do not see. Without the post-norm scaling the logits change."""
    model = _model(model_type)
    arch = arch_for(model, "test")
    before = _logits(model)
    model.get_submodule(arch.embed).embed_scale.mul_(0.5)
    changed = _logits(model)
    scale_post_norms(decoder_layers(model), arch, 0.5)
    assert _rel(changed, before) > 1e-2
    assert _rel(_logits(model), before) < 1e-4  # the norms' eps: 1e-6 against mean(x^2)


# ---- refusals ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cfg",
    [AwqConfig(), SmoothquantConfig(), MlpChannelsConfig(intermediate_size=8)],
    ids=["quantize.awq", "quantize.smoothquant", "prune.mlp_channels"],
)
def test_a_variant_the_entry_does_not_describe_is_a_config_error(cfg, request):
    """A checkpoint lacking a module its family's entry names: ConfigError naming the pass, the
    model_type and the module, before any calibration (no AttributeError)."""
    model = _model("qwen2", dtype=torch.float32)
    arch = ARCHS["qwen2"]
    parent, _, child = arch.up.rpartition(".")
    delattr(model.model.layers[0].get_submodule(parent), child)
    name = request.node.callspec.id
    with pytest.raises(ConfigError, match=rf"{name}: model_type 'qwen2'.*has no {arch.up}"):
        run_passes(model, [cfg], tiny_state())


@pytest.mark.parametrize("variant, message", [
    ("do_layer_norm_before", "do_layer_norm_before=False: its LayerNorms come"),
    ("layer_norm_elementwise_affine", "layer_norm_elementwise_affine=False: its LayerNorms have "
                                      "no weight"),
])
def test_a_variant_the_entry_does_not_describe_is_refused_by_the_folding_passes(variant,
                                                                                message):
    """OPT-350m's layout (``do_layer_norm_before=False``: LayerNorms after the blocks, no final
    norm), and LayerNorms without weights (AWQ and SmoothQuant raised AttributeError): AWQ,
    SmoothQuant and the prune passes would fold into or slice along norms that are not there
    and refuse it untouched; GPTQ runs each layer as it is (calibration stops at the head)."""
    model = make_tiny_model("opt", **{variant: False})
    before = copy.deepcopy(model.state_dict())
    refused = [AwqConfig(group_size=32), SmoothquantConfig(),
               MlpChannelsConfig(intermediate_size=96)]  # fmt: skip
    for cfg in refused:
        with pytest.raises(ConfigError, match=message):
            run_passes(model, [cfg], tiny_state())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    state = tiny_state()
    run_passes(model, [GptqConfig(group_size=32)], state)
    assert state.reports[-1].metrics["quantized_share"] == 1.0
