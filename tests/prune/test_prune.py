"""prune.*: exact equivalence with masked originals, importance picks planted dead units, targets
(ratio / size / parameter budget), plain-transformers loading of the result, and bad input."""

from __future__ import annotations

import copy

import pytest
import torch

from compress.core.errors import ConfigError
from compress.core.registry import CompressionState
from compress.prune.config import (
    AttentionHeadsConfig,
    HiddenSizeConfig,
    LayersConfig,
    MlpChannelsConfig,
    parse_param_count,
)
from compress.prune.depth import prune_layers
from compress.prune.heads import prune_attention_heads
from compress.prune.hidden import prune_hidden_size
from compress.prune.mlp import prune_mlp_channels
from compress.prune.slicing import count_params
from compress.testing import make_tiny_llama

TOKENS = torch.randint(3, 100, (4, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # shared 2-core box: 1 thread avoids spin-wait collapse
    yield
    torch.set_num_threads(before)


def _state() -> CompressionState:
    return CompressionState(progress=False, calibration_batches=lambda: list(TOKENS.split(1)))


def _logits(model):
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.parametrize("importance", ["activation", "magnitude"])
def test_mlp_pruning_equals_masking_the_removed_channels(importance):
    model = make_tiny_llama(seed=1)
    original = copy.deepcopy(model)
    prune_mlp_channels(
        model, MlpChannelsConfig(intermediate_size=48, importance=importance), _state()
    )
    assert model.config.intermediate_size == 48
    for layer, ref in zip(model.model.layers, original.model.layers, strict=True):
        # recover which rows were kept, then zero the others in the reference's down_proj
        gate = ref.mlp.gate_proj.weight
        kept = [int((gate == row).all(1).nonzero()[0]) for row in layer.mlp.gate_proj.weight]
        mask = torch.zeros(gate.shape[0], dtype=torch.bool)
        mask[kept] = True
        ref.mlp.down_proj.weight.data[:, ~mask] = 0
    torch.testing.assert_close(_logits(model), _logits(original), rtol=1e-5, atol=1e-5)


def _kept_heads(o_pruned, o_original, head_dim=16):
    """Indices of the original heads whose o_proj column blocks survive, in order."""
    n = o_original.shape[1] // head_dim
    blocks = [o_original[:, h * head_dim : (h + 1) * head_dim] for h in range(n)]
    kept = []
    for j in range(o_pruned.shape[1] // head_dim):
        block = o_pruned[:, j * head_dim : (j + 1) * head_dim]
        kept.append(next(h for h in range(n) if torch.equal(blocks[h], block)))
    return kept


@pytest.mark.parametrize("mode,kv_after", [("kv_groups", 1), ("query_heads", 2)])
def test_head_pruning_equals_masking_the_removed_heads(mode, kv_after):
    model = make_tiny_llama(seed=2)
    for block in model.model.layers:
        block.self_attn.v_proj.weight.data[16:32] = 0  # KV head 1: its query heads 2, 3 output 0
    original = copy.deepcopy(model)
    prune_attention_heads(model, AttentionHeadsConfig(num_attention_heads=2, mode=mode), _state())
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (2, kv_after)
    for block, ref in zip(model.model.layers, original.model.layers, strict=True):
        kept = _kept_heads(block.self_attn.o_proj.weight, ref.self_attn.o_proj.weight)
        if mode == "kv_groups":
            assert kept == [0, 1]  # the dead group went
        else:
            assert kept[0] in (0, 1) and kept[1] in (2, 3)  # one per group
        for head in set(range(4)) - set(kept):
            ref.self_attn.o_proj.weight.data[:, head * 16 : (head + 1) * 16] = 0
    torch.testing.assert_close(_logits(model), _logits(original), rtol=1e-5, atol=1e-5)


def test_query_head_mode_keeps_best_head_in_every_group():
    model = make_tiny_llama(seed=2, num_attention_heads=4, num_key_value_heads=2)
    for block in model.model.layers:
        block.self_attn.o_proj.weight.data[:, 0:16] *= 0  # head 0 (group 0) contributes nothing
        block.self_attn.q_proj.weight.data[48:64] *= 0
    o_before = [b.self_attn.o_proj.weight.detach().clone() for b in model.model.layers]
    prune_attention_heads(
        model,
        AttentionHeadsConfig(num_attention_heads=2, mode="query_heads", importance="magnitude"),
        _state(),
    )
    for block, before in zip(model.model.layers, o_before, strict=True):
        assert torch.equal(
            block.self_attn.o_proj.weight, torch.cat([before[:, 16:32], before[:, 32:48]], 1)
        )
        assert block.self_attn.num_key_value_groups == 1


def test_identity_layer_is_removed_and_logits_unchanged():
    model = make_tiny_llama(seed=4, num_hidden_layers=3)
    block = model.model.layers[1]
    block.self_attn.o_proj.weight.data.zero_()  # the block adds nothing to the residual
    block.mlp.down_proj.weight.data.zero_()
    before = _logits(model)
    report = prune_layers(model, LayersConfig(num_layers=2), _state())
    assert report.metrics["removed_layers"] == [1]
    assert report.metrics["scores"][1] == pytest.approx(0.0, abs=1e-6)
    assert [b.self_attn.layer_idx for b in model.model.layers] == [0, 1]
    torch.testing.assert_close(_logits(model), before, rtol=1e-5, atol=1e-5)


def test_dead_hidden_channels_are_the_ones_removed():
    model = make_tiny_llama(seed=5)
    dead = [3, 17, 40, 41, 60, 63, 5, 9]
    model.model.embed_tokens.weight.data[:, dead] = 0  # nothing ever flows through these
    for block in model.model.layers:
        block.self_attn.o_proj.weight.data[dead] = 0
        block.mlp.down_proj.weight.data[dead] = 0
    embed_before = model.model.embed_tokens.weight.detach().clone()
    prune_hidden_size(model, HiddenSizeConfig(hidden_size=56), _state())
    alive = [c for c in range(64) if c not in dead]
    assert torch.equal(model.model.embed_tokens.weight, embed_before[:, alive])
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tie kept
    assert torch.isfinite(_logits(model)).all()


def test_all_four_passes_give_a_model_plain_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    from compress.io.export import export_checkpoint
    from compress.testing import make_char_tokenizer

    model = make_tiny_llama(seed=6)
    state = _state()
    prune_attention_heads(model, AttentionHeadsConfig(sparsity=0.5), state)
    prune_mlp_channels(model, MlpChannelsConfig(sparsity=0.25, multiple_of=32), state)
    prune_hidden_size(model, HiddenSizeConfig(hidden_size=48), state)
    prune_layers(model, LayersConfig(num_layers=1), state)
    export_checkpoint(model, make_char_tokenizer(), tmp_path / "out", dtype="float32")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    cfg = loaded.config
    assert (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.intermediate_size,
        cfg.hidden_size,
        cfg.num_hidden_layers,
    ) == (2, 1, 96, 48, 1)
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=1e-5, atol=1e-5)
    assert count_params(loaded) == count_params(model)


@pytest.mark.parametrize(
    "cfg_cls,fn",
    [
        (MlpChannelsConfig, prune_mlp_channels),
        (AttentionHeadsConfig, prune_attention_heads),
        (HiddenSizeConfig, prune_hidden_size),
        (LayersConfig, prune_layers),
    ],
    ids=["mlp", "heads", "hidden", "layers"],
)
def test_parameter_budget_is_met_tightly(cfg_cls, fn):
    model = make_tiny_llama(
        seed=7, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4
    )
    budget = int(count_params(model) * 0.8)
    report = fn(model, cfg_cls(target_params=budget, importance="magnitude"), _state())
    after = report.metrics["params_after"]
    assert after == count_params(model) <= budget
    assert after < report.metrics["params_before"]


def test_sparsity_rounds_to_expressible_sizes():
    model = make_tiny_llama(seed=8)
    prune_mlp_channels(model, MlpChannelsConfig(sparsity=0.3, multiple_of=32), _state())
    assert model.config.intermediate_size == 96  # 128 * 0.7 = 89.6 -> nearest multiple of 32


def test_param_count_parsing():
    assert parse_param_count("90M") == 90_000_000
    assert parse_param_count("1.5b") == 1_500_000_000
    assert parse_param_count(1234) == 1234
    with pytest.raises(ValueError, match="not a count"):
        parse_param_count("ninety")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({}, "exactly one"),
        ({"sparsity": 0.5, "intermediate_size": 64}, "exactly one"),
        ({"sparsity": 1.5}, "sparsity"),
        ({"target_params": "lots"}, "not a count"),
    ],
    ids=["none", "two", "range", "budget-text"],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MlpChannelsConfig(**kwargs)


def test_unexpressible_targets_are_clear_errors_and_change_nothing():
    model = make_tiny_llama(seed=9, hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match="allowed values: 3"):
        prune_attention_heads(model, AttentionHeadsConfig(num_attention_heads=4), _state())
    with pytest.raises(ConfigError, match="below what this structure allows"):
        prune_mlp_channels(model, MlpChannelsConfig(target_params=1000), _state())
    with pytest.raises(ConfigError, match="calibration"):
        prune_layers(model, LayersConfig(num_layers=1), CompressionState(progress=False))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_quantized_model_is_refused():
    from compress.quant.rtn import Int4RtnConfig, int4_rtn

    model = make_tiny_llama(seed=10)
    int4_rtn(model, Int4RtnConfig(group_size=32), CompressionState(progress=False))
    with pytest.raises(ConfigError, match="prune before quantize"):
        prune_mlp_channels(model, MlpChannelsConfig(intermediate_size=64), _state())


@pytest.mark.real
def test_real_model_query_head_pruning(smollm2):
    model = copy.deepcopy(smollm2.model)
    ids = smollm2.tokenizer("The capital of France is Paris. " * 4, return_tensors="pt").input_ids
    state = CompressionState(progress=False, calibration_batches=lambda: [ids])
    report = prune_attention_heads(
        model, AttentionHeadsConfig(num_attention_heads=6, mode="query_heads"), state
    )
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (6, 3)
    assert report.metrics["params_before"] - report.metrics["params_after"] == 3 * 2 * 576 * 64 * 30
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_count_params_counts_quantized_weights_once():
    from compress.core.registry import run_passes
    from compress.quant.rtn import Int4RtnConfig
    from tests.quant.quant_helpers import tiny_state

    model = make_tiny_llama()
    expected = sum(p.numel() for p in model.parameters())  # all float, ties counted once
    run_passes(model, [Int4RtnConfig(group_size=32)], tiny_state())
    assert count_params(model) == expected
