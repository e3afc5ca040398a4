"""KL(baseline || variant) from the baseline's stored top-k log-probs, against independent
references: the full-vocabulary KL in float64 (equal at k = vocabulary size, a lower bound below
it), identical models (exactly 0), and a perturbation whose KL has a closed form. Plus the disk
it takes and the per-window resume of the KL sums."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from compress.eval.quality import (
    WINDOWS_PER_FORWARD,
    kl_from_top_k,
    perplexity,
    top_k_log_probs,
)
from compress.testing import make_tiny_llama

TEXT = "The quick brown fox jumps over the lazy dog. " * 12  # 540 tokens: 9 windows of 64
CONTEXT = 64
VOCAB = 320


def _full_kl(base_logits: torch.Tensor, variant_logits: torch.Tensor) -> torch.Tensor:
    """Reference: per-token KL(p || q) over the whole vocabulary, in float64."""
    log_p = torch.log_softmax(base_logits.double(), dim=-1)
    log_q = torch.log_softmax(variant_logits.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def _perturbed(scale: float):
    model = make_tiny_llama(seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model


def _window_logits(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Logits of the scored tokens of each disjoint window of CONTEXT tokens, written out from
    the protocol (token 0 of a window is not scored: position t predicts t + 1)."""
    with torch.no_grad():
        return [model(ids[b : b + CONTEXT][None]).logits[0, :-1]
                for b in range(0, len(ids) - 1, CONTEXT) if len(ids[b : b + CONTEXT]) > 1]


def _base_and_variant(tmp_path, tokenizer, variant, top_k, **kwargs):
    base = perplexity(make_tiny_llama(seed=0), tokenizer, TEXT, context_length=CONTEXT,
                      progress=False, top_k=top_k, top_k_dir=tmp_path / "top-k", **kwargs)
    return base, perplexity(variant, tokenizer, TEXT, context_length=CONTEXT, progress=False,
                            kl_base=base.top_k_path, **kwargs)


def test_full_vocabulary_top_k_equals_the_float64_kl(tiny_tokenizer, tmp_path):
    variant = _perturbed(0.05)
    _, result = _base_and_variant(tmp_path, tiny_tokenizer, variant, top_k=VOCAB)
    ids = torch.tensor(tiny_tokenizer(TEXT, add_special_tokens=False)["input_ids"])
    base_logits = torch.cat(_window_logits(make_tiny_llama(seed=0), ids))
    variant_logits = torch.cat(_window_logits(variant, ids))
    kl = _full_kl(base_logits, variant_logits)
    changed = base_logits.argmax(-1) != variant_logits.argmax(-1)
    assert len(kl) == result.scored_tokens
    assert result.kl.top_k == VOCAB
    # float32 log-probs against float64 ones: measured relative error 4e-8 (mean KL 0.109 nats),
    # 8e-7 on the stderr
    assert result.kl.kl_mean == pytest.approx(float(kl.mean()), rel=1e-5)
    assert result.kl.kl_stderr == pytest.approx(float(kl.std() / math.sqrt(len(kl))), rel=1e-4)
    assert result.kl.top1_changed_pct == pytest.approx(100 * float(changed.double().mean()))
    assert 0 < result.kl.top1_changed_pct < 100


def _peaked_logits(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Base and variant logits [256, VOCAB] shaped like a trained model's (a few likely tokens)."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(256, VOCAB, generator=gen) * 3
    return base, base + torch.randn(256, VOCAB, generator=gen) * 0.5


# k -> the least share of the full KL the estimate keeps on _peaked_logits (mean KL 0.10 nats;
# measured: 0.274, 0.690, 0.909, 0.993 of it at k = 1, 8, 32, 128; 1 - 5e-8 at k = VOCAB)
SHARE_KEPT = {1: 0.25, 8: 0.65, 32: 0.89, 128: 0.99, VOCAB: 1 - 1e-6}


@pytest.mark.parametrize("k", SHARE_KEPT, ids=[f"k{k}" for k in SHARE_KEPT])
def test_top_k_estimate_is_a_lower_bound_of_the_full_kl(k):
    base, variant = _peaked_logits(0)
    exact = _full_kl(base, variant)
    kl, changed = kl_from_top_k(*top_k_log_probs(base, k), variant)
    # per token: merging the tail into one bucket can only lose divergence (log-sum inequality)
    assert bool((kl <= exact + 1e-6).all())
    assert float(kl.sum()) >= SHARE_KEPT[k] * float(exact.sum()) - 1e-6
    if k == VOCAB:
        torch.testing.assert_close(kl, exact, rtol=1e-4, atol=1e-6)
    assert torch.equal(changed, base.argmax(-1) != variant.argmax(-1))


def test_identical_models_give_zero_kl_and_no_top1_change(tiny_model, tiny_tokenizer, tmp_path):
    _, result = _base_and_variant(tmp_path, tiny_tokenizer, tiny_model, top_k=8)
    assert result.kl.kl_mean == 0.0 and result.kl.kl_stderr == 0.0
    assert result.kl.top1_changed_pct == 0.0


class BigramModel(nn.Module):
    """Logits at position t are ``table[ids[t]]`` whatever the context."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = nn.Parameter(table, requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.table[input_ids])  # [B, T, V]


def _peak_table(peak: float) -> torch.Tensor:
    """Row r: logit ``peak`` at token (r + 7) % VOCAB, 0 elsewhere."""
    table = torch.zeros(VOCAB, VOCAB)
    table[torch.arange(VOCAB), (torch.arange(VOCAB) + 7) % VOCAB] = peak
    return table


@pytest.mark.parametrize("k", [1, 5, VOCAB], ids=["k1", "k5", "k-vocab"])
@pytest.mark.parametrize(("peak", "changed_pct"), [(2.0, 0.0), (-1.0, 100.0)],
                         ids=["flatter", "peak-inverted"])
def test_known_perturbation_gives_the_closed_form(tiny_tokenizer, tmp_path, k, peak,
                                                  changed_pct):
    """Every row has one peak (logit a = 5) over V - 1 equal logits; the variant has logit b
    there. Both are uniform off the peak, so any k >= 1 loses nothing: KL = p log(p/q) +
    (1 - p) log((1 - p)/(1 - q)) with p = e^a / (e^a + V - 1), q = e^b / (e^b + V - 1)."""
    a, b = 5.0, peak
    base = perplexity(BigramModel(_peak_table(a)), tiny_tokenizer, TEXT, context_length=CONTEXT,
                      progress=False, top_k=k, top_k_dir=tmp_path)
    result = perplexity(BigramModel(_peak_table(b)), tiny_tokenizer, TEXT,
                        context_length=CONTEXT, progress=False, kl_base=base.top_k_path)
    p = math.exp(a) / (math.exp(a) + VOCAB - 1)
    q = math.exp(b) / (math.exp(b) + VOCAB - 1)
    expected = p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))
    assert result.kl.kl_mean == pytest.approx(expected, rel=1e-5)
    assert result.kl.kl_stderr < 1e-6  # the same value at every token
    assert result.kl.top1_changed_pct == changed_pct


def test_disk_per_token_is_6k_plus_4_bytes(tiny_model, tiny_tokenizer, tmp_path):
    k = 16
    base = perplexity(tiny_model, tiny_tokenizer, TEXT, context_length=CONTEXT, progress=False,
                      top_k=k, top_k_dir=tmp_path)
    files = sorted(Path(base.top_k_path).glob("*.npz"))
    assert len(files) == base.windows
    data = base.scored_tokens * (k * (2 + 4) + 4)  # uint16 ids, float32 log-probs, float32 tail
    size = sum(f.stat().st_size for f in files)
    assert data <= size <= data + 1024 * base.windows  # + npz/npy headers
    with np.load(files[0]) as f:
        assert f["ids"].dtype == np.uint16 and f["log_probs"].dtype == np.float32
        assert f["ids"].shape == (CONTEXT - 1, k) and f["log_tail"].shape == (CONTEXT - 1,)


def _interrupt_after(model, calls: int):
    """Raise KeyboardInterrupt (as Ctrl-C would) on forward ``calls + 1``."""
    seen = []

    def hook(module, args):
        seen.append(1)
        if len(seen) > calls:
            raise KeyboardInterrupt

    return model.register_forward_pre_hook(hook)


def test_interrupted_kl_resumes_to_the_fresh_result(tiny_tokenizer, tmp_path):
    variant = _perturbed(0.05)
    base, fresh = _base_and_variant(tmp_path, tiny_tokenizer, variant, top_k=8)
    settings = dict(context_length=CONTEXT, progress=False, state_dir=tmp_path / "state",
                    kl_base=base.top_k_path)
    assert fresh.windows > 2 * WINDOWS_PER_FORWARD
    handle = _interrupt_after(variant, 1)  # one forward scores WINDOWS_PER_FORWARD windows
    with pytest.raises(KeyboardInterrupt):
        perplexity(variant, tiny_tokenizer, TEXT, **settings)
    handle.remove()
    (state_file,) = (tmp_path / "state").glob("*.json")
    (saved,) = json.loads(state_file.read_text())["kl"].values()
    stored = [len(saved[k]) for k in ("window_kl", "window_kl_sq", "window_changed")]
    assert stored == [WINDOWS_PER_FORWARD] * 3
    resumed = perplexity(variant, tiny_tokenizer, TEXT, **settings)
    assert resumed.reused_windows == WINDOWS_PER_FORWARD
    assert resumed == fresh and resumed.kl == fresh.kl  # bit for bit: same sums, same order
    handle = _interrupt_after(variant, 0)  # finished: read back without a forward
    assert perplexity(variant, tiny_tokenizer, TEXT, **settings) == fresh
    handle.remove()


def test_baseline_scored_before_top_k_existed_writes_them(tiny_model, tiny_tokenizer, tmp_path):
    settings = dict(context_length=CONTEXT, progress=False, state_dir=tmp_path / "state")
    plain = perplexity(tiny_model, tiny_tokenizer, TEXT, **settings)
    base = perplexity(tiny_model, tiny_tokenizer, TEXT, **settings, top_k=4,
                      top_k_dir=tmp_path / "top-k")
    assert base == plain and base.reused_windows == 0  # run again for the top-k, NLL unchanged
    assert len(list((tmp_path / "top-k").glob("*/*.npz"))) == base.windows
    again = perplexity(tiny_model, tiny_tokenizer, TEXT, **settings, top_k=4,
                       top_k_dir=tmp_path / "top-k")
    assert again.reused_windows == base.windows


def test_other_windows_or_more_windows_than_the_baseline_are_refused(tiny_model, tiny_tokenizer,
                                                                      tmp_path):
    base = perplexity(tiny_model, tiny_tokenizer, TEXT, context_length=CONTEXT, limit=3,
                      progress=False, top_k=4, top_k_dir=tmp_path)
    with pytest.raises(ValueError, match="another text or other windows"):
        perplexity(tiny_model, tiny_tokenizer, TEXT, context_length=32, progress=False,
                   kl_base=base.top_k_path)
    with pytest.raises(ValueError, match="lack 6 of the 9 windows.*same limit"):
        perplexity(tiny_model, tiny_tokenizer, TEXT, context_length=CONTEXT, progress=False,
                   kl_base=base.top_k_path)
    fewer = perplexity(tiny_model, tiny_tokenizer, TEXT, context_length=CONTEXT, limit=2,
                       progress=False, kl_base=base.top_k_path)
    assert fewer.kl.kl_mean == 0.0
    with pytest.raises(ValueError, match="needs top_k_dir"):
        perplexity(tiny_model, tiny_tokenizer, TEXT, progress=False, top_k=4)


def _damage_window_0(folder: Path, how: str) -> None:
    file = folder / "00000.npz"
    if how == "garbage":
        file.write_bytes(b"garbage")
        return
    with np.load(file) as f:
        arrays = dict(f)
    if how == "nan":
        arrays["log_probs"] = arrays["log_probs"] * np.nan
    else:  # another window's length
        arrays = {k: v[:3] for k, v in arrays.items()}
    with file.open("wb") as f:
        np.savez(f, **arrays)


@pytest.mark.parametrize("how", ["garbage", "nan", "short"])
def test_a_damaged_baseline_window_is_named_not_compared_with(how, tiny_tokenizer, tmp_path):
    # was a pickle ValueError, a silently wrong KL, an AssertionError
    from compress.core.errors import DataError

    base = perplexity(make_tiny_llama(seed=0), tiny_tokenizer, TEXT, context_length=CONTEXT,
                      progress=False, top_k=8, top_k_dir=tmp_path / "top-k")
    _damage_window_0(Path(base.top_k_path), how)
    with pytest.raises(DataError, match=r"00000.npz: the baseline's stored top-k log-probs are "
                                        r"damaged .* delete .* and run again"):
        perplexity(_perturbed(0.05), tiny_tokenizer, TEXT, context_length=CONTEXT,
                   progress=False, kl_base=base.top_k_path)


def test_a_baseline_meta_that_is_not_an_object_is_a_data_error(tiny_tokenizer, tmp_path):
    from compress.core.errors import DataError

    base = perplexity(make_tiny_llama(seed=0), tiny_tokenizer, TEXT, context_length=CONTEXT,
                      progress=False, top_k=8, top_k_dir=tmp_path / "top-k")
    (Path(base.top_k_path) / "meta.json").write_text("[]")  # was an AttributeError
    with pytest.raises(DataError, match="not a baseline top-k folder .*holds a JSON list"):
        perplexity(_perturbed(0.05), tiny_tokenizer, TEXT, context_length=CONTEXT,
                   progress=False, kl_base=base.top_k_path)
