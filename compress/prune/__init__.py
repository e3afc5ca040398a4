"""Structured pruning: attention heads (with their KV groups), MLP channels, hidden size and
whole layers (``structured``), each a pass that keeps the family's structure valid so plain
``from_pretrained`` loads the result.
"""
