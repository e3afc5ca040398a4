"""KV-cache blocks: who holds which block, and the prefix cache over full blocks.

The paged cache (``runtime/paged.py``) stores keys and values in fixed-size blocks of
``block_size`` token slots; a request holds a list of block ids (its block table), so memory
follows the tokens in use rather than ``max_batch x max_seq``. This module only counts: a
reference count per block, a free list, and (prefix caching) a map from the content key of a
full block to the block that holds it.

A full block's key is a SHA-256 digest chained over the whole token prefix up to and including
that block (vLLM's and nano-vllm's scheme): two requests share a block only when every token
before it is the same too, so positions and attention context match. A block whose last holder
lets go keeps its key and stays reusable until memory is needed; then the least recently
released such block is evicted (its key forgotten) and handed out again. Blocks that never
filled carry no key and go straight back to the free list.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np

ROOT_KEY = b""  # the key before the first block


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The content key of a full block holding ``tokens`` after the prefix keyed ``parent``."""
    return hashlib.sha256(parent + np.asarray(tokens, dtype=np.int64).tobytes()).digest()


class OutOfBlocks(RuntimeError):
    """No free or evictable block is left (the scheduler preempts or waits)."""


class BlockPool:
    """Reference-counted blocks ``0 .. num_blocks - 1`` with an optional prefix cache."""

    def __init__(self, num_blocks: int, *, prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks, self.prefix_caching = num_blocks, prefix_caching
        self.refs = [0] * num_blocks
        self.key_of: list[bytes | None] = [None] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))  # blocks without a key, ref 0
        self.cached: dict[bytes, int] = {}  # key -> block holding that content
        self.evictable: OrderedDict[int, None] = OrderedDict()  # keyed, ref 0; oldest first
        self.evictions = 0

    @property
    def available(self) -> int:
        """Blocks that ``allocate`` can hand out now (free, or cached and unused)."""
        return len(self.free) + len(self.evictable)

    @property
    def in_use(self) -> int:
        """Blocks some request holds."""
        return self.num_blocks - self.available

    def allocate(self) -> int:
        """A block for new content, held once. Evicts the least recently released cached block
        when no free one is left; raises ``OutOfBlocks`` when neither exists."""
        if self.free:
            block = self.free.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.key_of[block]]
            self.key_of[block] = None
            self.evictions += 1
        else:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are held by running requests")
        self.refs[block] = 1
        return block

    def lookup(self, key: bytes) -> int | None:
        """The block that holds the content ``key``, or None (miss, or caching off)."""
        return self.cached.get(key) if self.prefix_caching else None

    def acquire(self, block: int) -> None:
        """Hold a cached block (a prefix hit)."""
        if self.refs[block] == 0:
            del self.evictable[block]
        self.refs[block] += 1

    def release(self, block: int) -> None:
        """Let go of a block: at ref 0 a keyed block stays cached (evictable), others are free."""
        if self.refs[block] < 1:
            raise RuntimeError(f"block {block} released more often than it was held")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if self.key_of[block] is not None:
                self.evictable[block] = None
            else:
                self.free.append(block)

    def register(self, block: int, key: bytes) -> None:
        """Record that held ``block`` is full with the content ``key``. If another block already
        holds that content (two requests computed it at once), the first one stays the cached
        copy and this one is freed normally when released."""
        if not self.prefix_caching or self.key_of[block] is not None or key in self.cached:
            return
        self.cached[key] = block
        self.key_of[block] = key
