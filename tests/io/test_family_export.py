"""Every family end to end: its tiny random model quantized (GPTQ W4 g32), exported, reloaded by
plain transformers in a subprocess that does not import compress (same logits within 1e-2
relative; GraniteMoE's per-expert int4 experts by our loader: transformers reads that
family's experts only fused), and generated from by the runtime (tokens equal transformers' on
the same quantized model) or, for a family the runtime does not run, by the fallback with its
reason.

Parametrized over ``compress.testing.TINY_MODEL_TYPES`` and the MoE types, so a new family is
one adapter entry plus one tiny config."""

from __future__ import annotations

import pytest
import torch

from compress.arch import ARCHS
from compress.core.registry import CompressionState, run_passes
from compress.io.export import export_checkpoint, load_compressed
from compress.io.names import checkpoints_store_experts_fused
from compress.quant.gptq import GptqConfig
from compress.runtime.engine import Runtime, unsupported_reason
from compress.testing import (
    TINY_MODEL_TYPES,
    TINY_MOE_TYPES,
    hf_greedy,
    make_char_tokenizer,
    make_tiny_model,
    make_tiny_moe,
    plain_transformers_logits,
)

MOE_TYPES = TINY_MOE_TYPES
IDS = [[5, 17, 42, 99, 7, 3, 250, 12, 64, 33, 21, 8]]


FAMILIES = [*TINY_MODEL_TYPES, *MOE_TYPES]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Every family quantized (GPTQ W4 g32, strict) and exported; then every export reloaded by
    plain transformers in one subprocess (one interpreter start instead of one a family: about
    4 s each). -> family -> (the quantized model, its share, our logits, transformers')."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("families")
    done = {}
    for family in FAMILIES:
        model = make_tiny_moe(family) if family in MOE_TYPES else make_tiny_model(family)
        gen = torch.Generator().manual_seed(0)
        batches = list(torch.randint(3, 300, (4, 1, 32), generator=gen))
        state = CompressionState(calibration_batches=lambda b=batches: b, progress=False)
        run_passes(model, [GptqConfig(group_size=32, strict=True)], state)
        export_checkpoint(model, make_char_tokenizer(), root / family, dtype="float32")
        with torch.no_grad():
            ours = model(torch.tensor(IDS)).logits
        done[family] = (model, state.reports[-1].metrics["quantized_share"], ours)
    # plain transformers reads GraniteMoE's experts only fused (as its checkpoints store them):
    # its per-expert int4 export is read by our loader (and vLLM), not by transformers
    plain = [f for f in FAMILIES if not checkpoints_store_experts_fused(done[f][0])]
    theirs = dict(zip(plain, plain_transformers_logits([root / f for f in plain], IDS, root),
                      strict=True))
    for family in set(FAMILIES) - set(plain):
        with torch.no_grad():
            theirs[family] = load_compressed(root / family)(torch.tensor(IDS)).logits
    torch.set_num_threads(threads)
    return {f: (*done[f], theirs[f]) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_family_quantize_export_reload_generate(family, exported):
    torch.set_num_threads(1)
    model, share, ours, theirs = exported[family]
    assert share == 1.0
    assert float((theirs - ours).norm() / ours.norm()) < 1e-2

    expected = hf_greedy(model, IDS[0], 8)
    reason = unsupported_reason(model)
    if reason is None:  # the runtime runs it: fp32 decode, the int4 layers on the native kernel
        runtime = Runtime(model, max_seq_len=32, decode_dtype=torch.float32, compile=False,
                          keep_model_weights=True)  # the model stays the fixture's
        assert runtime.generate(IDS, 8) == [expected]
    else:  # the fallback says why and still generates transformers' tokens
        assert not ARCHS[family].runtime, reason
        with pytest.warns(RuntimeWarning, match=f"model_type '{family}'"):
            runtime = Runtime(model, max_seq_len=32)
        assert runtime.generate(IDS, 8) == [expected]
