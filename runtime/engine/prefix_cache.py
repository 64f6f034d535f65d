"""PrefixCache: computed prompt blocks kept and found again by their tokens (vLLM's automatic prefix caching).

A full block whose keys and values are computed is registered under a key that chains its
parent block's key with its token ids (BLAKE2b, 128 bits, nano-vllm's block hashes), and a hit
is checked against the block's tokens. A new sequence takes the cached blocks of its longest
cached prefix instead of computing it again. The registered blocks live in the block manager's
device pool (runtime/engine/block_manager.py), which keeps them while they are evictable.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import NamedTuple

from runtime.engine.sequence import Sequence


def block_key(parent: bytes, tokens) -> bytes:
    """The prefix cache's key of a full block: its parent's key (b"" for the first) and its tokens."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class PrefixHit(NamedTuple):
    """A sequence's longest cached prefix: the blocks holding it and how many of them are
    evictable (taking those back uses up free blocks; the others are in use already)."""

    blocks: tuple[int, ...]
    evictable: int


NO_HIT = PrefixHit((), 0)


class PrefixCache:
    def __init__(self, pool, block_size: int, enabled: bool):
        """`pool`: the block manager's device pool (its registry of keys, its ref counts)."""
        self.pool, self.block_size, self.enabled = pool, block_size, enabled

    @property
    def num_blocks(self) -> int:
        """Blocks registered (held by tables or evictable)."""
        return len(self.pool.key_of)

    def _keys(self, seq: Sequence, count: int) -> list[bytes]:
        """The keys of `seq`'s first `count` full blocks (kept on the sequence: its tokens only grow)."""
        keys, bs = seq.block_keys, self.block_size
        while len(keys) < count:
            i = len(keys)
            keys.append(block_key(keys[-1] if keys else b"", seq.token_ids[i * bs:(i + 1) * bs]))
        return keys

    def _tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def prefix_hit(self, seq: Sequence) -> PrefixHit:
        """The cached blocks a sequence with no blocks can start from. At least its last token
        is left to compute (its logits are wanted), so a prompt that ends on a block boundary
        computes its last block again rather than write into a cached one."""
        if not self.enabled or seq.block_table:
            return NO_HIT
        count = min(seq.num_tokens - 1, len(seq.token_ids)) // self.block_size
        blocks = []
        for i, key in enumerate(self._keys(seq, count)[:count]):
            block = self.pool.lookup(key, self._tokens(seq, i))
            if block is None:
                break
            blocks.append(block)
        refs = self.pool.ref_counts
        return PrefixHit(tuple(blocks), sum(1 for b in blocks if refs[b] == 0))

    def attach(self, seq: Sequence, blocks: tuple[int, ...]) -> None:
        """`seq` (holding no blocks) starts from the cached `blocks` (a `prefix_hit`'s)."""
        if seq.block_table:
            raise ValueError("attach a cached prefix to a sequence that already holds blocks")
        for block in blocks:
            self.pool.hold(block)
        seq.block_table = list(blocks)
        seq.num_computed_tokens = seq.num_registered_blocks = len(blocks)
        seq.num_computed_tokens *= self.block_size

    def register(self, seq: Sequence) -> None:
        """Put `seq`'s full blocks whose keys and values are computed (and whose tokens are
        known here: an async step's sampled token is not yet) into the cache."""
        full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size
        if not self.enabled or full <= seq.num_registered_blocks:
            return
        keys = self._keys(seq, full)
        for i in range(seq.num_registered_blocks, full):
            self.pool.register(seq.block_table[i], keys[i], self._tokens(seq, i))
        seq.num_registered_blocks = full

    def uncache(self, seq: Sequence) -> None:
        """Take `seq`'s registered blocks that no other table holds out of the cache (its
        step failed: what it wrote may be garbage)."""
        for block in seq.block_table:
            if block in self.pool.key_of and self.pool.ref_counts[block] == 1:
                self.pool.unregister(block)
