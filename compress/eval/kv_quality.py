"""What a KV-cache dtype costs in quality and buys in memory (the serving scheduler's pages).

Each window of the perplexity protocol (``quality.window_spans``: non-overlapping windows of
``context_length`` tokens, the text tokenized once without special tokens) is scored through the
paged cache (``runtime.paged.paged_logits``): every key and value but the first token's is
written to pages in the dtype under test and read back before attention, as decode reads them.
Against the ``reference`` dtype's pass on the same windows: perplexity, its change in percent,
and mean per-token KL(reference || dtype) over the full vocabulary. Memory: bytes per token of
K and V, and how many requests of ``request_tokens`` fit in one GiB of pages.

The matmuls are the runtime's (the same for every dtype), so the differences come from the
cache alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from compress.eval.quality import exp_nll, window_spans
from compress.runtime.engine import Runtime
from compress.runtime.paged import KV_DTYPES, PagedKVCache, kv_bytes_per_token, paged_logits


def kv_cache_quality(
    model: nn.Module,
    tokenizer: Any,
    text: str,
    *,
    kv_dtypes: tuple[str, ...] = ("bfloat16", "int8"),
    reference: str = "float32",
    context_length: int = 512,
    limit: int | None = 8,
    block_size: int = 16,
    request_tokens: int = 512,
) -> dict[str, Any]:
    """Per dtype (``reference`` first): ``ppl``, ``delta_ppl_pct``, ``kl`` (mean nats per
    scored token), ``bytes_per_token``, ``requests_per_gib``; plus the protocol."""
    # the caller's model stays usable (keep_model_weights); the paged caches below are its KV
    runtime = Runtime(model, max_seq_len=context_length, compile=False, keep_model_weights=True,
                      static_cache=False)
    if runtime.fallback_reason is not None:
        raise ValueError(f"the runtime does not run this model: {runtime.fallback_reason}")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    spans = window_spans(len(ids), context_length, context_length)[:limit]
    if not spans:
        raise ValueError(f"the text is too short to score ({len(ids)} tokens)")
    first = runtime.layers[0]
    caches = {
        name: PagedKVCache(
            n_layers=len(runtime.layers),
            num_blocks=-(-context_length // block_size),
            block_size=block_size,
            n_kv=first.n_kv,
            head_dim=first.head_dim,
            dtype=KV_DTYPES[name],
            compute_dtype=runtime.kv_dtype if name in ("int8", "fp8") else KV_DTYPES[name],
            device=runtime.device,
            kv_scales=runtime.kv_scales if name == "fp8" else None,
            values_in_keys=first.values_in_keys,
        )
        for name in (reference, *kv_dtypes)
    }
    nll = dict.fromkeys(caches, 0.0)
    kl = dict.fromkeys(caches, 0.0)
    scored = 0
    for begin, end, first_scored in spans:
        window = ids[begin:end]
        targets = torch.tensor(window[first_scored - begin :], device=runtime.device)
        ref_logp = None
        for name, cache in caches.items():
            # row r predicts token r + 1: rows first_scored - begin - 1 .. end - begin - 2
            logp = paged_logits(runtime, cache, window)[first_scored - begin - 1 : -1]
            logp = logp.double().log_softmax(-1)
            nll[name] -= float(logp.gather(-1, targets[:, None]).sum())
            if ref_logp is None:
                ref_logp = logp
            else:
                kl[name] += float((ref_logp.exp() * (ref_logp - logp)).sum())
        scored += len(targets)
    base_ppl = exp_nll(nll[reference] / scored)
    per_dtype = {}
    for name in caches:
        ppl = exp_nll(nll[name] / scored)
        per_token = kv_bytes_per_token(
            len(runtime.layers), first.n_kv, first.head_dim, KV_DTYPES[name], first.values_in_keys
        )
        per_dtype[name] = {
            "ppl": ppl,
            "delta_ppl_pct": 100.0 * (ppl / base_ppl - 1.0),
            "kl": kl[name] / scored,
            "bytes_per_token": per_token,
            "requests_per_gib": (1 << 30) // (per_token * request_tokens),
        }
    return {
        "reference": reference,
        "windows": len(spans),
        "scored_tokens": scored,
        "context_length": context_length,
        "request_tokens": request_tokens,
        # fp8 pages' per-layer scales: the checkpoint's (quantize.kv_cache_fp8) or vLLM's 1.0
        "fp8_scales": "calibrated" if runtime.kv_scales is not None else "1.0",
        "dtypes": per_dtype,
    }
