"""BlockManager: the host-side allocator of the paged KV pools (free lists, ref counts, tables).

Two pools: the device pool the model reads, and an optional host pool that preempted
sequences swap into. A block may be shared by several tables (a forked sequence shares its
parent's prompt); it is copied on write before a sequence writes into it, so no block is
ever writable by two sequences.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from runtime.sequence import Sequence

BlockCopy = tuple[int, int]  # (source block, destination block)


class PoolExhausted(RuntimeError):
    """More blocks asked for than are free: the scheduler's accounting is wrong (a bug; not an
    out-of-memory the step could recover from by shrinking)."""


class _Pool:
    """A free list with reference counts over block ids 0..size-1."""

    def __init__(self, size: int):
        self.size = size
        self.ref_counts = [0] * size
        self.free: deque[int] = deque(range(size))

    def take(self) -> int:
        block = self.free.popleft()
        self.ref_counts[block] = 1
        return block

    def release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free.append(block)
        elif self.ref_counts[block] < 0:
            raise AssertionError(f"block {block} released more often than taken")


class BlockManager:
    """Invariants: a block is on its pool's free list iff its ref count is 0, and otherwise its
    ref count is the number of tables holding it; free + used = total in each pool."""

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0):
        if num_blocks < 1 or block_size < 1 or num_cpu_blocks < 0:
            raise ValueError(f"need num_blocks >= 1, block_size >= 1, num_cpu_blocks >= 0, "
                             f"got {num_blocks}, {block_size}, {num_cpu_blocks}")
        self.block_size = block_size
        self.device = _Pool(num_blocks)
        self.host = _Pool(num_cpu_blocks)

    @property
    def num_blocks(self) -> int:
        return self.device.size

    @property
    def ref_counts(self) -> list[int]:
        return self.device.ref_counts

    @property
    def num_free_blocks(self) -> int:
        return len(self.device.free)

    @property
    def num_used_blocks(self) -> int:
        return self.device.size - len(self.device.free)

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self.host.free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` token slots."""
        return -(-num_tokens // self.block_size)

    # -- growing ---------------------------------------------------------------------------

    def _shared_in_write_range(self, seq: Sequence, num_tokens: int,
                               dropped: Mapping[int, int] | None = None) -> list[int]:
        """Indices into seq.block_table of shared blocks that positions
        [num_computed_tokens, num_tokens) would write into."""
        table, refs = seq.block_table, self.device.ref_counts
        first = seq.num_computed_tokens // self.block_size
        last = min(len(table), -(-num_tokens // self.block_size))
        if not dropped:  # (the per-step common case, kept cheap: it runs for every sequence)
            return [i for i in range(first, last) if refs[table[i]] > 1]
        return [i for i in range(first, last) if refs[table[i]] - dropped.get(table[i], 0) > 1]

    def blocks_needed(self, seq: Sequence, num_tokens: int, dropped: Mapping[int, int] | None = None) -> int:
        """Free device blocks `append_slots(seq, num_tokens)` would take once other tables have
        given up `dropped[block]` references (the scheduler's victims): a block no one else
        holds by then needs no copy."""
        missing = max(0, self.blocks_for(num_tokens) - len(seq.block_table))
        return missing + len(self._shared_in_write_range(seq, num_tokens, dropped))

    def needs_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `append_slots(seq, num_tokens)` has anything to do (most decode steps: no)."""
        table, bs = seq.block_table, self.block_size
        if len(table) * bs < num_tokens:
            return True
        refs, first, last = self.device.ref_counts, seq.num_computed_tokens // bs, -(-num_tokens // bs)
        if last - first == 1:  # (a decode: one block to check)
            return refs[table[first]] > 1
        return any(refs[table[i]] > 1 for i in range(first, last))

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_tokens: int) -> list[BlockCopy]:
        """Make `seq`'s table cover `num_tokens` tokens with every block it is about to write
        (from num_computed_tokens on) exclusively its own. Returns the copies the caller must
        apply to the KV pool before the write (copy-on-write of shared blocks)."""
        shared = self._shared_in_write_range(seq, num_tokens)
        need = max(0, self.blocks_for(num_tokens) - len(seq.block_table)) + len(shared)
        if need > self.num_free_blocks:
            raise PoolExhausted(f"KV pool exhausted: need {need} blocks, {self.num_free_blocks} free")
        copies = []
        for i in shared:
            shared = seq.block_table[i]
            own = self.device.take()
            self.device.release(shared)
            seq.block_table[i] = own
            copies.append((shared, own))
        while len(seq.block_table) < self.blocks_for(num_tokens):
            seq.block_table.append(self.device.take())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares all of `parent`'s blocks (n > 1 samples of one prompt)."""
        if child.block_table:
            raise ValueError("fork into a sequence that already holds blocks")
        for block in parent.block_table:
            self.device.ref_counts[block] += 1
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references in both pools; unshared blocks go back to the free lists."""
        for block in seq.block_table:
            self.device.release(block)
        for block in seq.cpu_block_table:
            self.host.release(block)
        seq.block_table, seq.cpu_block_table = [], []

    # -- swapping --------------------------------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= self.num_free_cpu_blocks

    def swap_out(self, seq: Sequence) -> list[BlockCopy]:
        """Move `seq` to host blocks; returns (device block, host block) copies to apply
        before the device blocks are reused."""
        if not self.can_swap_out(seq):
            raise PoolExhausted(f"host pool exhausted: need {len(seq.block_table)} blocks, "
                              f"{self.num_free_cpu_blocks} free")
        mapping = [(block, self.host.take()) for block in seq.block_table]
        for block in seq.block_table:
            self.device.release(block)
        seq.block_table, seq.cpu_block_table = [], [h for _, h in mapping]
        return mapping

    def can_swap_in(self, seq: Sequence) -> bool:
        return len(seq.cpu_block_table) <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[BlockCopy]:
        """Move `seq` back to device blocks; returns (host block, device block) copies."""
        if not self.can_swap_in(seq):
            raise PoolExhausted(f"KV pool exhausted: need {len(seq.cpu_block_table)} blocks to swap in, "
                              f"{self.num_free_blocks} free")
        mapping = [(block, self.device.take()) for block in seq.cpu_block_table]
        for block in seq.cpu_block_table:
            self.host.release(block)
        seq.block_table, seq.cpu_block_table = [d for _, d in mapping], []
        return mapping
