"""AutoRound: zero steps is RTN code for code, tuned parameters stay in their boxes, the tuned
layer beats RTN on held-out tokens (and is compared with GPTQ), export reloads with the same
logits in our loader and in plain transformers, bad settings are clear recipe errors."""

from __future__ import annotations

import copy

import pytest
import torch

from compress.core.errors import RecipeError
from compress.core.registry import run_passes
from compress.io.export import export_checkpoint, load_compressed
from compress.quant.autoround import (
    AutoroundConfig,
    RoundingParams,
    _minibatches,
    _sample_losses,
    fake_quantize_learned,
    quantize_learned,
    tune_block,
)
from compress.quant.calibrated import capture_first_layer_inputs, run_layer
from compress.quant.gptq import GptqConfig
from compress.quant.linear import QuantLinear, WeightScheme
from compress.quant.primitives import fake_quantize
from compress.quant.rtn import Int4RtnConfig, Int8RtnConfig
from compress.recipe import parse_recipe
from compress.testing import make_tiny_llama, plain_transformers_logits
from tests.quant.quant_helpers import tiny_state

LAYER0 = (r"re:.*layers\.0\.",)  # tune one decoder layer only: keeps the tests fast


@pytest.fixture(autouse=True)
def _one_thread():
    """Microsecond ops on a shared 2-core box: one thread is faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("symmetric", "grid"),
    [(True, "restricted"), (True, "full"), (True, "signed"), (False, "restricted")],
    ids=["sym", "sym-full-grid", "sym-signed-grid", "asym"],
)
def test_initial_parameters_fake_quantize_like_rtn(symmetric, grid):
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    scheme = WeightScheme(4, 32, symmetric, torch.float32, grid)
    got = fake_quantize_learned(w, RoundingParams.initial(w, 32), scheme)
    expected = fake_quantize(w, n_bits=4, group_size=32, symmetric=symmetric, grid=grid)
    assert torch.equal(got, expected)


RTN_CASES = {
    "w4g32-sym": (AutoroundConfig(iters=0, group_size=32), Int4RtnConfig(group_size=32)),
    "w4g64-asym": (
        AutoroundConfig(iters=0, group_size=64, symmetric=False),
        Int4RtnConfig(group_size=64, symmetric=False),
    ),
    "w8-channel": (AutoroundConfig(iters=0, n_bits=8, group_size=None), Int8RtnConfig()),
}


@pytest.mark.parametrize("case", list(RTN_CASES), ids=list(RTN_CASES))
def test_zero_iters_equals_rtn_code_for_code(case):
    ours, rtn = RTN_CASES[case]
    models = [make_tiny_llama(), make_tiny_llama()]
    run_passes(models[0], [ours], tiny_state())
    run_passes(models[1], [rtn], tiny_state())
    a, b = models[0].state_dict(), models[1].state_dict()
    assert a.keys() == b.keys()
    assert sum(k.endswith(("weight_packed", "weight_scale")) for k in a) >= 14
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _layer0_problem(seed: int = 0):
    model = make_tiny_llama(seed=seed)
    layer = model.model.layers[0]
    inputs = capture_first_layer_inputs(
        model, tiny_state().calibration_batches(), torch.device("cpu")
    )
    linears = {
        n: (m, WeightScheme(4, 32, False, torch.float16))
        for n, m in layer.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    return layer, inputs, linears


def test_tuned_parameters_stay_in_range_and_lower_the_block_loss():
    layer, inputs, linears = _layer0_problem()
    targets = run_layer(layer, inputs)
    cfg = AutoroundConfig(iters=60, batch_size=2, lr=0.05)  # large steps: reach the box edges
    params, info = tune_block(layer, linears, inputs, targets, cfg, torch.Generator())
    assert info["loss_tuned"] < 0.8 * info["loss_rtn"], info
    moved = 0
    for name, p in params.items():
        assert p.v.min() >= -0.5 and p.v.max() <= 0.5, name
        for t in (p.alpha, p.beta):
            assert t.min() >= 0.5 and t.max() <= 1.0, name
        moved += int((p.v.abs() == 0.5).sum()) + int((p.alpha < 1).sum())
        w_q, scales, zeros = quantize_learned(linears[name][0].weight, p, linears[name][1])
        assert w_q.dtype == torch.int8 and int(w_q.min()) >= -8 and int(w_q.max()) <= 7, name
        assert zeros is not None and int(zeros.min()) >= -8 and int(zeros.max()) <= 7, name
        assert scales.shape == (w_q.shape[0], w_q.shape[1] // 32)
    assert moved > 0  # the parameters did move (to the edges of their boxes)
    assert all(not t.requires_grad or t.grad is None for t in layer.parameters())


def test_the_pick_is_never_worse_than_rtn_on_the_calibration_set():
    layer, inputs, linears = _layer0_problem()
    cfg = AutoroundConfig(iters=8, batch_size=1, lr=0.05)
    _, info = tune_block(layer, linears, inputs, run_layer(layer, inputs), cfg, torch.Generator())
    assert info["loss_tuned"] <= info["loss_rtn"], info
    # RTN's loss is measured, not assumed: it equals zero steps' result
    cfg0 = AutoroundConfig(iters=0)
    _, info0 = tune_block(layer, linears, inputs, run_layer(layer, inputs), cfg0, torch.Generator())
    assert info0["loss_tuned"] == info["loss_rtn"]
    assert info0["kept_rtn"] == 0.0


def test_tune_clipping_false_learns_rounding_only():
    layer, inputs, linears = _layer0_problem()
    cfg = AutoroundConfig(iters=5, lr=0.05, tune_clipping=False)
    params, _ = tune_block(layer, linears, inputs, run_layer(layer, inputs), cfg, torch.Generator())
    assert all(torch.equal(p.alpha, torch.ones_like(p.alpha)) for p in params.values())
    assert all(torch.equal(p.beta, torch.ones_like(p.beta)) for p in params.values())
    assert any(bool((p.v != 0).any()) for p in params.values())


def test_token_relative_loss_against_float64_and_blind_to_a_token_s_scale():
    layer, inputs, _ = _layer0_problem()
    targets = run_layer(layer, inputs)
    noisy = [
        t + 0.1 * torch.randn(t.shape, generator=torch.Generator().manual_seed(1)) for t in targets
    ]
    weights = dict(layer.named_parameters())
    everything = list(range(len(targets)))
    got = _sample_losses(layer, weights, inputs, noisy, everything, "token_relative")
    plain = _sample_losses(layer, weights, inputs, noisy, everything, "mse")
    for i in everything:
        out = run_layer(layer, inputs)[i].double()
        want = noisy[i].double()
        err = ((out - want) ** 2).sum(-1) / (want**2).sum(-1)  # per token, float64
        assert float(got[i]) == pytest.approx(float(err.mean()), rel=1e-5)
        assert float(plain[i]) == pytest.approx(float(((out - want) ** 2).mean()), rel=1e-5)
    # one token's target 1000x larger, as the attention sink's state: plain MSE is then all that
    # token, the relative loss moves by at most that token's share (its relative error -> 1)
    sink = noisy[0].clone()
    sink[:, 0] *= 1000
    relative = _sample_losses(layer, weights, inputs, [sink], [0], "token_relative")
    mse = _sample_losses(layer, weights, inputs, [sink], [0], "mse")
    assert float(mse[0]) > 1000 * float(plain[0])
    assert float(relative[0]) <= float(got[0]) + 1.01 / sink.shape[1]


@pytest.mark.parametrize(("n", "size"), [(8, 2), (10, 4), (3, 5)])
def test_cyclic_sampling_visits_every_sequence_once_per_pass(n, size):
    cfg = AutoroundConfig(batch_size=size, sampling="cyclic")
    batches = _minibatches(n, cfg, torch.Generator().manual_seed(0))
    size = min(size, n)
    per_pass = n // size
    for _ in range(3):
        seen = [i for _ in range(per_pass) for i in next(batches)]
        assert len(seen) == len(set(seen)) == per_pass * size  # no repeats inside a pass
        assert set(seen) <= set(range(n))
    random = _minibatches(
        n, AutoroundConfig(batch_size=size, sampling="random"), torch.Generator().manual_seed(0)
    )
    assert all(len(set(b)) == size for b in (next(random) for _ in range(20)))


def test_tune_norms_moves_only_the_1d_parameters_within_half_a_4bit_step():
    layer, inputs, linears = _layer0_problem()
    before = {n: t.detach().clone() for n, t in layer.named_parameters()}
    targets = run_layer(layer, inputs)
    cfg = AutoroundConfig(iters=30, batch_size=2, lr=0.05, tune_norms=True)
    _, info = tune_block(layer, linears, inputs, targets, cfg, torch.Generator())
    assert info["kept_rtn"] == 0.0 and info["loss_tuned"] < info["loss_rtn"], info
    moved = 0
    for name, t in layer.named_parameters():
        if t.dim() != 1:
            assert torch.equal(t, before[name]), name  # linear weights: untouched in place
            continue
        width = float(before[name].clamp(min=0).max() - before[name].clamp(max=0).min())
        assert float((t.detach() - before[name]).abs().max()) <= 0.5 * width / 15 + 1e-6, name
        moved += int((t != before[name]).sum())
    assert moved > 0
    # the same block tuned without norms leaves them as they were
    fresh, inputs2, linears2 = _layer0_problem()
    norms = {n: t.detach().clone() for n, t in fresh.named_parameters() if t.dim() == 1}
    tune_block(
        fresh,
        linears2,
        inputs2,
        run_layer(fresh, inputs2),
        cfg.model_copy(update={"tune_norms": False}),
        torch.Generator(),
    )
    assert all(torch.equal(fresh.get_parameter(n), t) for n, t in norms.items())


def _heldout_layer0_error(base, cfg) -> float:
    """Summed squared error of decoder layer 0's output against the float model's, on tokens the
    calibration never saw (layer 0's inputs come from the embeddings alone)."""
    heldout = capture_first_layer_inputs(
        base, tiny_state(n=8, seed=123).calibration_batches(), torch.device("cpu")
    )
    expected = run_layer(base.model.layers[0], heldout)
    model = copy.deepcopy(base)
    run_passes(model, [cfg], tiny_state(n=16, seq_len=64))
    got = run_layer(model.model.layers[0], heldout)
    return sum(float((a - b).pow(2).sum()) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_beats_rtn_on_heldout_tokens_and_is_near_gptq(symmetric):
    """Layer 0's output error on held-out tokens after 100 steps (16 x 64 calibration tokens,
    group 32). Measured on tiny-model seeds 0/1/2, as ratios to RTN: sym 0.62/0.58/0.66 (GPTQ
    0.98/0.94/1.07), asym 0.90/0.89/0.88 (GPTQ 1.00/0.88/1.03). On so few tokens GPTQ barely
    generalises beyond its calibration set here; the tuned rounding does."""
    base = make_tiny_llama()
    common = dict(group_size=32, symmetric=symmetric, targets=LAYER0)
    ours = _heldout_layer0_error(base, AutoroundConfig(iters=100, **common))
    rtn = _heldout_layer0_error(base, AutoroundConfig(iters=0, **common))
    gptq = _heldout_layer0_error(base, GptqConfig(**common))
    numbers = f"autoround {ours:.4g}, rtn {rtn:.4g}, gptq {gptq:.4g}"
    assert ours < 0.95 * rtn, numbers
    assert ours < gptq, numbers


def _final_hidden_error(base, model, batches) -> float:
    """Squared error of the final (normed) hidden states against the float model's."""
    states = [base(b, output_hidden_states=True).hidden_states[-1] for b in batches]
    got = [model(b, output_hidden_states=True).hidden_states[-1] for b in batches]
    return sum(float((a - b).pow(2).sum()) for a, b in zip(got, states, strict=True))


def test_float_model_target_is_the_quantized_inputs_target_when_earlier_layers_stay_float():
    """Only layer 1 tuned: the float model's states entering it are the quantized model's, so
    the two targets are the same tensors and so are the learned codes."""
    base = make_tiny_llama()
    layer1 = (r"re:.*layers\.1\.",)
    out = {}
    for target in ("float_model", "quantized_inputs"):
        model = copy.deepcopy(base)
        cfg = AutoroundConfig(iters=10, group_size=32, targets=layer1, target=target)
        run_passes(model, [cfg], tiny_state(n=8, seq_len=32))
        out[target] = model.model.layers[1].self_attn.q_proj.weight_packed
    assert torch.equal(out["float_model"], out["quantized_inputs"])


@torch.no_grad()
def test_float_model_target_pulls_back_the_earlier_layers_error():
    """Both layers tuned: with the float model's states as targets, layer 1 also corrects what
    quantizing layer 0 changed, so the last layer ends closer to the float model. Measured on
    tiny-model seeds 0/1/2 (16 x 64 calibration tokens, 60 steps), float_model vs
    quantized_inputs: calibration 113/109/107 vs 200/182/170, held-out 87/84/90 vs 93/103/110."""
    base = make_tiny_llama()
    state = tiny_state(n=16, seq_len=64)
    errors = {}
    for target in ("float_model", "quantized_inputs"):
        model = copy.deepcopy(base)
        with torch.enable_grad():
            run_passes(model, [AutoroundConfig(iters=60, group_size=32, target=target)], state)
        errors[target] = _final_hidden_error(base, model, state.calibration_batches())
    assert errors["float_model"] < errors["quantized_inputs"], errors


def test_report_counts_and_lm_head_untouched():
    model = make_tiny_llama(intermediate_size=96)  # down_proj in_features 96: g64 does not divide
    state = tiny_state()
    run_passes(model, [AutoroundConfig(iters=2, group_size=64)], state)
    report = state.reports[-1]
    assert set(report.skipped) == {f"model.layers.{i}.mlp.down_proj" for i in (0, 1)}
    assert len(report.changed) == 12
    assert not isinstance(model.lm_head, QuantLinear)
    assert set(report.metrics["per_block"]) == {"model.layers.0", "model.layers.1"}
    with pytest.raises(RecipeError, match="not divisible"):
        run_passes(
            make_tiny_llama(intermediate_size=96),
            [AutoroundConfig(group_size=64, strict=True)],
            tiny_state(),
        )


def test_export_reloads_in_our_loader_and_in_plain_transformers(tiny_tokenizer, tmp_path):
    """Asymmetric int4 is left out of the plain load: upstream zero-point shape bug, see
    tests/quant/test_foundation_quantize_export.py."""
    pytest.importorskip("compressed_tensors")
    ids = torch.tensor([[1, 40, 41, 42, 43, 50, 60, 70, 80, 90]])
    cases = {
        # reference backend: exact comparisons (the CPU kernels compute in bf16)
        "w4g32-sym": AutoroundConfig(iters=10, group_size=32, backend="reference"),
        "w8-channel-asym": AutoroundConfig(
            iters=10, n_bits=8, group_size=None, symmetric=False, backend="reference"
        ),
        # negative scales (the signed grid) must survive export and plain transformers' load
        "w4g32-signed-grid": AutoroundConfig(
            iters=10, group_size=32, symmetric_grid="signed", backend="reference"
        ),
    }
    expected, dirs = {}, []
    for name, cfg in cases.items():
        model = make_tiny_llama()
        run_passes(model, [cfg], tiny_state())
        with torch.no_grad():
            expected[name] = model(ids).logits
        out = export_checkpoint(model, tiny_tokenizer, tmp_path / name)
        with torch.no_grad():
            reloaded = load_compressed(out, backend="reference")(ids).logits
        assert torch.equal(reloaded, expected[name]), name
        dirs.append(str(out))
    plain = plain_transformers_logits(dirs, ids.tolist(), tmp_path)
    for name, logits in zip(cases, plain, strict=True):
        # same codes and scales; the tolerance covers compressed-tensors' fp16-scale arithmetic
        torch.testing.assert_close(logits, expected[name], atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("iters", -1),
        ("lr", 0),
        ("clipping_lr", 2.0),
        ("batch_size", 0),
        ("group_size", 100),
        ("n_bits", 3),
        ("tune_clipping", "maybe"),
        ("iter", 10),
        ("sampling", "sequential"),
        ("tune_norms", "perhaps"),
        ("loss", "l1"),
    ],
    ids=lambda v: str(v),
)
def test_bad_settings_are_recipe_errors_naming_the_key(key, value):
    with pytest.raises(RecipeError, match=key):
        parse_recipe({"passes": [{"pass": "quantize.autoround", key: value}]})
