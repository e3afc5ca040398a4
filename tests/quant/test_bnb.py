"""quantize.bnb (bitsandbytes NF4/FP4/LLM.int8), its save_pretrained export, and compress.optim.

Tests that need bitsandbytes skip cleanly without it; the validation tests (a recipe or an
optimizer asking for bitsandbytes when it is missing) run either way.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from compress.core.errors import RecipeError
from compress.core.registry import CompressionState
from compress.recipe import parse_recipe

# NormalFloat4 code values (QLoRA, Dettmers et al. 2023, appendix E), the independent reference.
NF4_CODES = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230731010437, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], dtype=torch.float64)


@pytest.fixture
def bnb():
    return pytest.importorskip("bitsandbytes")


def _recipe(**settings):
    return parse_recipe({"name": "t", "passes": [{"pass": "quantize.bnb", **settings}]})


def _quantize(model, **settings):
    from compress.quant.bnb import bnb_quantize

    cfg = _recipe(**settings).passes[0]
    return bnb_quantize(model, cfg, CompressionState(progress=False))


# ---- validation ---------------------------------------------------------------------------
def test_missing_package_fails_at_validation_with_install_command(monkeypatch):
    from compress.optim import check_optimizer_name

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # find_spec -> None: "not installed"
    with pytest.raises(RecipeError, match=r"passes\[0\].*pip install 'compress\[bitsandbytes\]'"):
        _recipe(format="nf4")
    with pytest.raises(ValueError, match="adamw8bit needs the bitsandbytes package.*pip install"):
        check_optimizer_name("adamw8bit")
    assert check_optimizer_name("adamw") == "adamw"


def test_import_compress_does_not_import_bitsandbytes():
    code = "import sys, compress; assert 'quantize.bnb' in compress.PASSES; " \
           "print('bitsandbytes' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"format": "nf3"}, "format"),
        ({"format": "nf4", "threshold": 6.0}, "threshold applies to format int8 only"),
        ({"format": "int8", "threshold": -1.0}, "threshold=-1.0 must be >= 0"),
        ({"format": "int8", "double_quant": True}, "double_quant apply to format nf4/fp4 only"),
        ({"format": "int8", "group_size": 64}, "unknown key 'group_size'"),
    ],
    ids=["bad-format", "threshold-on-nf4", "negative-threshold", "double-quant-on-int8", "extra"],
)
def test_config_errors(bnb, settings, match):
    with pytest.raises(RecipeError, match=match):
        _recipe(**settings)


def test_unknown_optimizer_name():
    from compress.optim import check_optimizer_name

    with pytest.raises(ValueError, match="allowed values"):
        check_optimizer_name("sgd")


# ---- the pass -----------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["nf4", "fp4", "int8"])
def test_pass_swaps_linears_and_logits_stay_close(bnb, tiny_model, fmt):
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        before = tiny_model(ids).logits
    report = _quantize(tiny_model, format=fmt)
    from compress.quant.bnb import is_bnb_module

    layers = [n for n, m in tiny_model.named_modules() if is_bnb_module(m)]
    assert len(report.changed) == len(layers) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    assert type(tiny_model.lm_head) is nn.Linear  # ignored by default
    assert tiny_model.config.quantization_config.quant_method == "bitsandbytes"
    with torch.no_grad():
        after = tiny_model(ids).logits
    assert after.shape == before.shape and torch.isfinite(after).all()
    bound = {"nf4": 0.15, "fp4": 0.2, "int8": 0.02}[fmt]  # relative Frobenius error of logits
    assert float((after - before).norm() / before.norm()) < bound
    assert report.metrics["weight_bytes_after"] < report.metrics["weight_bytes_before"] / 3
    from compress.quant.linear import model_bytes

    # the comparison tables' weight column counts bnb codes + absmax / code maps, as saved
    assert model_bytes(tiny_model)["linear"] == report.metrics["weight_bytes_after"]


def test_nf4_weights_match_float64_reference(bnb, tiny_model):
    from compress.quant.bnb import dequantized_weight

    w = tiny_model.model.layers[0].mlp.down_proj.weight.detach().double()
    _quantize(tiny_model, format="nf4")
    got = dequantized_weight(tiny_model.model.layers[0].mlp.down_proj).double()
    blocks = w.reshape(-1, 64)  # bnb blocks run over the flattened weight
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    codes = (blocks / absmax).unsqueeze(-1).sub(NF4_CODES).abs().argmin(dim=-1)
    ref = (NF4_CODES[codes] * absmax).reshape(w.shape)
    # Same grid and absmax; only fp32 rounding of the scaled values may differ.
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)


def test_int8_weights_and_outlier_decomposition(bnb):
    from compress.quant.bnb import BnbConfig, _to_bnb, dequantized_weight

    torch.manual_seed(0)
    linear = nn.Linear(128, 64, bias=False)
    w = linear.weight.detach().double()
    x = torch.randn(8, 128, dtype=torch.float64)
    x[:, 5] *= 40  # one outlier feature, as LLM.int8 describes for large models
    # bitsandbytes quantizes a float16 copy of the weight: row absmax in fp16, codes in int8.
    w16 = w.half().double()
    absmax = w16.abs().amax(1, keepdim=True)
    ref_w = torch.round(w16 / absmax * 127) * absmax / 127
    errors = {}
    for threshold in (0.0, 6.0):
        module = _to_bnb(linear.eval(), BnbConfig(format="int8", threshold=threshold), bnb)
        diff = (dequantized_weight(module).double() - ref_w).abs()
        # fp32/fp16 arithmetic may round a value sitting on a code midpoint the other way.
        assert (diff <= absmax / 127 * 1.001).all() and (diff > 1e-6).float().mean() < 1e-3
        with torch.no_grad():
            y = module(x.float()).double()
        errors[threshold] = float((y - x @ w.T).norm() / (x @ w.T).norm())
    # The outlier column quantized with the rest (threshold 0) costs far more than 16-bit outliers.
    assert errors[6.0] < errors[0.0] / 2, errors


def test_mixing_with_quantlinear_is_refused(bnb, tiny_model):
    from compress.quant.rtn import Int8RtnConfig, int8_rtn

    int8_rtn(tiny_model, Int8RtnConfig(), CompressionState(progress=False))
    with pytest.raises(RecipeError, match="one checkpoint format per model"):
        _quantize(tiny_model, format="nf4")


# ---- export round trip --------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_save_pretrained_round_trip_gives_same_logits(
    bnb, tiny_model, tiny_tokenizer, tmp_path, fmt
):
    from transformers import AutoModelForCausalLM

    from compress.io.export import export_checkpoint
    from compress.quant.bnb import portable_cpu_layout

    settings = {"format": fmt, "double_quant": True} if fmt == "nf4" else {"format": fmt}
    _quantize(tiny_model, **settings)
    ids = torch.arange(3, 60).unsqueeze(0)
    with torch.no_grad():
        before_export = tiny_model(ids).logits  # a forward first, as run_job's evaluation does
    out = export_checkpoint(tiny_model, tiny_tokenizer, tmp_path / "ckpt", recipe_yaml="name: t\n")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "bitsandbytes"
    assert (out / "recipe.yaml").is_file() and not list(tmp_path.glob(".ckpt.tmp-*"))
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    if fmt == "nf4":  # bitsandbytes' AVX512-BF16 repack would change the logits (see there)
        assert portable_cpu_layout(loaded) == 14
    assert type(loaded.model.layers[1].mlp.up_proj) is type(tiny_model.model.layers[1].mlp.up_proj)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, before_export)


# ---- optimizer ----------------------------------------------------------------------------
def test_optimizer_state_bytes_known_values(bnb):
    from compress.optim import make_optimizer, optimizer_state_bytes

    n = 256 * 64
    sizes = {}
    for name in ("adamw", "adamw8bit"):
        p = nn.Parameter(torch.randn(n))
        opt = make_optimizer(name, [p], 1e-3)
        assert optimizer_state_bytes(opt) == 0  # states are created lazily
        p.grad = torch.randn(n)
        opt.step()
        sizes[name] = optimizer_state_bytes(opt)
    assert sizes["adamw"] == 2 * 4 * n + 4  # two fp32 moments + fp32 step tensor
    # two uint8 moments, two fp32 absmax per 256-value block, two 256-entry fp32 code maps
    assert sizes["adamw8bit"] == 2 * n + 2 * 4 * (n // 256) + 2 * 4 * 256
    assert "AdamW8bit" in type(make_optimizer("adamw8bit", [p], 1e-3)).__name__


def test_adamw8bit_tracks_adamw_on_least_squares(bnb):
    from compress.optim import make_optimizer

    torch.manual_seed(0)
    a, target = torch.randn(512, 64), torch.randn(64, 64)
    b = a @ target
    start = torch.randn(64, 64) * 0.1
    results = {}
    for name in ("adamw", "adamw8bit"):
        w = nn.Parameter(start.clone())  # 4096 elements: the smallest size with 8-bit states
        opt = make_optimizer(name, [w], 1e-2)
        losses = []
        for _ in range(30):
            loss = (a @ w - b).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        results[name] = (losses, w.detach().clone())
    assert results["adamw8bit"][0][-1] < 0.7 * results["adamw8bit"][0][0]
    drift = (results["adamw8bit"][1] - results["adamw"][1]).norm()
    moved = (results["adamw"][1] - start).norm()
    assert drift < 0.1 * moved, (float(drift), float(moved))


def _adamw_state_bytes(params) -> int:
    """torch AdamW: two fp32 moments per value and one fp32 step tensor per parameter."""
    return sum(8 * p.numel() + 4 for p in params)


def _adamw8bit_state_bytes(params) -> int:
    """bitsandbytes AdamW8bit (Dettmers et al. 2022): parameters of >= 4096 values keep two
    uint8 moments plus two fp32 absmax per block of 256; smaller ones two fp32 moments; the two
    256-entry fp32 code maps are shared by all parameters; the step is a Python int."""
    total = 2 * 4 * 256
    for p in params:
        n = p.numel()
        total += 2 * n + 2 * 4 * -(-n // 256) if n >= 4096 else 8 * n
    return total


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    yield  # tiny_setup sets 1 thread (a shared 2-core box); give the others theirs back
    torch.set_num_threads(before)


def test_distill_accepts_adamw8bit_and_reports_smaller_state(bnb, tmp_path, one_thread):
    """distill.logits with optimizer adamw8bit trains (the loss falls) and reports the 8-bit
    state's bytes: the hand count for this student, under 2/5 of fp32 AdamW's."""
    from compress.distill import distill_logits, kl_loss, split_data
    from tests.distill.distill_worker import tiny_setup

    text = tmp_path / "train.txt"
    text.write_text("".join(
        f"Line {i}: the quick brown fox number {i * 7 % 13} jumps over {i % 5} dogs.\n"
        for i in range(400)
    ))
    student, cfg, state = tiny_setup(str(text), batch_size=4)
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    cfg = cfg.model_copy(update={"optimizer": "adamw8bit", "steps": 12, "hidden_weight": 0.0,
                                 "lm_weight": 0.0})  # the loss is the KL to the teacher alone
    _, held_out = split_data(cfg, state.tokenizer, 1, None)

    def held_out_kl() -> float:
        with torch.no_grad():
            return kl_loss(student(held_out).logits, state.teacher(held_out).logits, 1.0).item()

    kl_before = held_out_kl()
    report = distill_logits(student, cfg, state)

    metrics = report.metrics
    losses = [h["loss"] for h in metrics["history"] if "loss" in h]
    assert len(losses) == 12
    assert sum(losses[-4:]) < 0.85 * sum(losses[:4]), losses  # measured 0.72
    assert held_out_kl() < 0.7 * kl_before  # measured 0.52
    params = list(student.parameters())  # tied lm_head/embedding: listed once, as trained
    assert sum(p.numel() for p in params) == 69952  # the MLP-pruned tiny Llama
    assert metrics["optimizer"] == "adamw8bit"
    # A silent fallback to torch AdamW would report _adamw_state_bytes (559,696) instead.
    assert metrics["optimizer_state_bytes"] == _adamw8bit_state_bytes(params) == 194944
    assert _adamw_state_bytes(params) == 559696
    assert metrics["optimizer_state_bytes"] < 0.4 * _adamw_state_bytes(params)
    moved = [n for n, p in student.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before)
