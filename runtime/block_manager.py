"""BlockManager: the host-side allocator of the paged KV pool (free list, ref counts, tables)."""

from __future__ import annotations

from collections import deque

from runtime.sequence import Sequence


class BlockManager:
    """Owns which physical KV blocks are free and which sequence tables point at them.

    Invariants: every block is either on the free list (ref count 0) or referenced by at
    least one block table (ref count = number of tables holding it); free + used = total.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` token slots."""
        return -(-num_tokens // self.block_size)

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` can grow to hold `num_tokens` tokens in all."""
        return self.blocks_for(num_tokens) - len(seq.block_table) <= len(self._free)

    def append_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table to cover `num_tokens` tokens in all."""
        missing = self.blocks_for(num_tokens) - len(seq.block_table)
        if missing > len(self._free):
            raise MemoryError(f"KV pool exhausted: need {missing} blocks, {len(self._free)} free")
        for _ in range(missing):
            block = self._free.popleft()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; blocks no other table holds go back to the free list."""
        for block in seq.block_table:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free.append(block)
        seq.block_table = []
