"""RTN passes on the tiny model, export/reload (ours and plain transformers), atomic writes and
bad-input errors."""

from __future__ import annotations

import os

import pytest
import torch

from compress.core.errors import ModelLoadError, OutputError, RecipeError
from compress.core.registry import CompressionState, run_passes
from compress.io.export import export_checkpoint, load_compressed
from compress.quant.linear import QuantLinear, model_bytes, set_backend
from compress.quant.rtn import Int4RtnConfig, Int8RtnConfig
from compress.testing import plain_transformers_logits

IDS = torch.tensor([[1, 40, 41, 42, 43, 50, 60, 70, 80, 90]])
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def _run(model, cfg):
    state = CompressionState(progress=False)
    run_passes(model, [cfg], state)
    set_backend(model, "reference")  # exact comparisons: the CPU kernels compute in bf16
    return state.reports[0]


def test_int4_rtn_swaps_every_decoder_linear(tiny_model):
    report = _run(tiny_model, Int4RtnConfig(group_size=32))
    quant = [n for n, m in tiny_model.named_modules() if isinstance(m, QuantLinear)]
    assert sorted(quant) == sorted(report.changed)
    assert sorted(quant) == sorted(f"model.layers.{i}.{p}" for i in range(2) for p in PROJ)
    assert not report.skipped
    assert torch.isfinite(_logits(tiny_model)).all()
    assert report.metrics["weight_bytes_after"] < report.metrics["weight_bytes_before"] / 4


def test_quantized_logits_stay_close_to_baseline(tiny_model):
    before = _logits(tiny_model)
    _run(tiny_model, Int8RtnConfig())
    after = _logits(tiny_model)
    assert (after - before).abs().max() < 0.05 * before.abs().max()


def test_group_size_not_dividing_is_reported(tiny_model):
    report = _run(tiny_model, Int4RtnConfig(group_size=128))  # tiny hidden is 64
    expected = {f"model.layers.{i}.{p}" for i in range(2) for p in PROJ if p != "mlp.down_proj"}
    assert set(report.skipped) == expected
    assert all("not divisible by group_size 128" in r for r in report.skipped.values())
    assert len(report.changed) == 2  # down_proj (in_features 128)


def test_fallback_group_size_covers_the_rest(tiny_model):
    report = _run(tiny_model, Int4RtnConfig(group_size=128, fallback_group_size=32))
    assert not report.skipped and report.metrics["schemes"] == {"W4g128": 2, "W4g32": 12}


def test_strict_makes_skips_an_error_and_changes_nothing(tiny_model):
    with pytest.raises(RecipeError, match="strict"):
        _run(tiny_model, Int4RtnConfig(group_size=128, strict=True))
    assert not any(isinstance(m, QuantLinear) for m in tiny_model.modules())


SCHEMES = [
    pytest.param(Int4RtnConfig(group_size=32), id="w4g32-sym"),
    pytest.param(Int4RtnConfig(group_size=32, symmetric=False), id="w4g32-asym"),
    pytest.param(Int8RtnConfig(), id="w8-channel"),
    pytest.param(Int8RtnConfig(symmetric=False, group_size=32), id="w8g32-asym"),
    pytest.param(Int4RtnConfig(group_size=128, fallback_group_size=32), id="w4-mixed-groups"),
]


@pytest.mark.parametrize("cfg", SCHEMES)
def test_export_reload_gives_identical_logits(tiny_model, tiny_tokenizer, tmp_path, cfg):
    _run(tiny_model, cfg)
    expected = _logits(tiny_model)
    out = export_checkpoint(tiny_model, tiny_tokenizer, tmp_path / "ckpt", recipe_yaml="x: 1\n")
    assert {"model.safetensors", "config.json", "recipe.yaml", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    reloaded = load_compressed(out, backend="reference")
    assert torch.equal(_logits(reloaded), expected)
    assert model_bytes(reloaded)["linear"] == model_bytes(tiny_model)["linear"]


def test_plain_transformers_loads_the_exports(tiny_tokenizer, tmp_path):
    """One subprocess (no compress import) loads every export with AutoModelForCausalLM.

    Asymmetric int4 is left out: compressed-tensors 0.20 builds the meta skeleton with an
    unpacked int4 zero point [N, K/g] while its own compressor (and vLLM) packs it on dim 0
    [N/8, K/g], so transformers refuses the size mismatch; see the strict xfail below.
    """
    pytest.importorskip("compressed_tensors")
    from compress.testing import make_tiny_llama

    cases = {"w4g32-sym": SCHEMES[0], "w8-channel": SCHEMES[2], "w8g32-asym": SCHEMES[3],
             "w4-mixed-groups": SCHEMES[4]}
    expected, dirs = {}, []
    for name, param in cases.items():
        model = make_tiny_llama()
        _run(model, param.values[0])
        expected[name] = _logits(model)
        dirs.append(str(export_checkpoint(model, tiny_tokenizer, tmp_path / name)))
    plain = plain_transformers_logits(dirs, IDS.tolist(), tmp_path)
    for name, logits in zip(cases, plain, strict=True):
        # Same codes and scales; tolerance covers compressed-tensors' fp16-scale arithmetic.
        torch.testing.assert_close(logits, expected[name], atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.xfail(strict=True, reason="upstream asymmetric int4 zero-point shape bug (above)")
def test_plain_transformers_loads_asymmetric_int4(tiny_model, tiny_tokenizer, tmp_path):
    pytest.importorskip("compressed_tensors")
    _run(tiny_model, SCHEMES[1].values[0])
    folder = export_checkpoint(tiny_model, tiny_tokenizer, tmp_path / "asym")
    plain_transformers_logits([folder], IDS.tolist(), tmp_path)


def test_failed_export_leaves_nothing_behind(tiny_model, tmp_path):
    class BrokenTokenizer:
        def save_pretrained(self, path):
            raise RuntimeError("disk full")

    target = tmp_path / "ckpt"
    with pytest.raises(RuntimeError, match="disk full"):
        export_checkpoint(tiny_model, BrokenTokenizer(), target)
    assert list(tmp_path.iterdir()) == []


def test_failed_export_keeps_the_previous_checkpoint(tiny_model, tiny_tokenizer, tmp_path):
    target = export_checkpoint(tiny_model, tiny_tokenizer, tmp_path / "ckpt")
    before = (target / "model.safetensors").read_bytes()

    class BrokenTokenizer:
        def save_pretrained(self, path):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        export_checkpoint(tiny_model, BrokenTokenizer(), target)
    assert (target / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_output_dir(tiny_model, tiny_tokenizer, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    with pytest.raises(OutputError, match="not writable"):
        export_checkpoint(tiny_model, tiny_tokenizer, locked / "ckpt")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_uncreatable_output_dir_fails_before_writing(tiny_model, tiny_tokenizer):
    # /proc refuses new directories even for root, so this runs in CI (which runs as root).
    with pytest.raises(OutputError, match="cannot create output directory"):
        export_checkpoint(tiny_model, tiny_tokenizer, "/proc/compress-test/sub/ckpt")


def test_output_path_that_is_a_file(tiny_model, tiny_tokenizer, tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(OutputError, match="not a directory"):
        export_checkpoint(tiny_model, tiny_tokenizer, target)


def test_corrupt_safetensors_is_a_clear_error(tiny_model, tiny_tokenizer, tmp_path):
    _run(tiny_model, Int4RtnConfig(group_size=32))
    out = export_checkpoint(tiny_model, tiny_tokenizer, tmp_path / "ckpt")
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated, as by a crash
    with pytest.raises(ModelLoadError, match="corrupt or partially written"):
        load_compressed(out)


def test_missing_model_path_is_a_clear_error(tmp_path):
    from compress.io.load import load_model

    with pytest.raises(ModelLoadError, match="model not found"):
        load_model(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path / "empty"))
