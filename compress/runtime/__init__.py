"""The serving runtime: one engine (``engine.Runtime``: static KV cache, prefill, decode,
speculative verification) that times every token the product reports. Families it does not run
fall back to transformers' ``generate`` (``engine.unsupported_reason`` says why).
"""
