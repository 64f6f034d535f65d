"""BlockManager: the host-side allocator of the paged KV pools (free lists, ref counts, tables).

Two pools: the device pool the model reads, and an optional host pool that preempted
sequences swap into. A block may be shared by several tables (a forked sequence shares its
parent's prompt; requests share a cached prefix); it is copied on write before a sequence
writes into it, so no block is ever writable by two sequences.

The prefix cache (runtime/engine/prefix_cache.py) registers full blocks in the device pool:
a registered block no table holds is *evictable*: it still counts as free and is taken only
when the plain free list is empty, least recently freed first, and until then a sequence with
that prefix can take it back.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping
from runtime.engine.prefix_cache import PrefixCache
from runtime.engine.sequence import Sequence

BlockCopy = tuple[int, int]  # (source block, destination block)


class PoolExhausted(RuntimeError):
    """More blocks asked for than are free: the scheduler's accounting is wrong (a bug; not an
    out-of-memory the step could recover from by shrinking)."""


class _Pool:
    """A free list with reference counts over block ids 0..size-1, and the prefix cache's
    registered blocks: key -> block, and the evictable ones in the order they were freed."""

    def __init__(self, size: int):
        self.size = size
        self.ref_counts = [0] * size
        self.free: deque[int] = deque(range(size))
        self.by_key: dict[bytes, int] = {}
        self.key_of: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # block -> (key, its tokens)
        self.evictable: OrderedDict[int, None] = OrderedDict()  # registered, no holder: oldest first

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.evictable)

    def take(self) -> int:
        if self.free:
            block = self.free.popleft()
        else:  # the least recently freed cached block leaves the cache
            block, _ = self.evictable.popitem(last=False)
            del self.by_key[self.key_of.pop(block)[0]]
        self.ref_counts[block] = 1
        return block

    def hold(self, block: int) -> None:
        """One more table holds `block` (a fork, or a prefix hit: an evictable block comes back)."""
        if self.ref_counts[block] == 0:
            del self.evictable[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self.key_of:
                self.evictable[block] = None
            else:
                self.free.append(block)
        elif self.ref_counts[block] < 0:
            raise AssertionError(f"block {block} released more often than taken")

    def register(self, block: int, key: bytes, tokens: tuple[int, ...]) -> None:
        """`block` (held, full, computed) is found by `key` from now on, unless another block
        holds that key already (two sequences computed the same prefix) or `block` has one."""
        if key not in self.by_key and block not in self.key_of:
            self.by_key[key] = block
            self.key_of[block] = (key, tokens)

    def unregister(self, block: int) -> None:
        key, _ = self.key_of.pop(block)
        del self.by_key[key]
        if block in self.evictable:
            del self.evictable[block]
            self.free.append(block)

    def lookup(self, key: bytes, tokens: tuple[int, ...]) -> int | None:
        block = self.by_key.get(key)
        return block if block is not None and self.key_of[block][1] == tokens else None


class BlockManager:
    """Invariants: a block is on its pool's free list iff its ref count is 0, and otherwise its
    ref count is the number of tables holding it; free + used = total in each pool."""

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0, prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1 or num_cpu_blocks < 0:
            raise ValueError(f"need num_blocks >= 1, block_size >= 1, num_cpu_blocks >= 0, "
                             f"got {num_blocks}, {block_size}, {num_cpu_blocks}")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.device = _Pool(num_blocks)
        self.host = _Pool(num_cpu_blocks)
        self.cache = PrefixCache(self.device, block_size, prefix_caching)

    @property
    def num_blocks(self) -> int:
        return self.device.size

    @property
    def ref_counts(self) -> list[int]:
        return self.device.ref_counts

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence may take: never used, or cached and evictable."""
        return self.device.num_free

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

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back `seq`'s blocks past the first `num_tokens` slots (the slots of draft tokens
        a verification rejected). Those blocks are its own and never registered: a block is
        registered only once full of verified tokens."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self.device.release(seq.block_table.pop())

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares all of `parent`'s blocks (n > 1 samples of one prompt)."""
        if child.block_table:
            raise ValueError("fork into a sequence that already holds blocks")
        for block in parent.block_table:
            self.device.hold(block)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_registered_blocks = parent.num_registered_blocks

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references in both pools; unshared blocks go back to the free lists
        (cached ones to the evictable, its last blocks first: a prefix outlives its tails)."""
        for block in reversed(seq.block_table):
            self.device.release(block)
        for block in seq.cpu_block_table:
            self.host.release(block)
        seq.block_table, seq.cpu_block_table = [], []
        seq.num_registered_blocks = 0

    # -- swapping --------------------------------------------------------------------------

    def swap_out(self, seq: Sequence) -> list[BlockCopy]:
        """Move `seq` to host blocks; returns (device block, host block) copies to apply
        before the device blocks are reused."""
        if len(seq.block_table) > self.num_free_cpu_blocks:
            raise PoolExhausted(f"host pool exhausted: need {len(seq.block_table)} blocks, "
                              f"{self.num_free_cpu_blocks} free")
        mapping = [(block, self.host.take()) for block in seq.block_table]
        for block in seq.block_table:
            self.device.release(block)
        seq.block_table, seq.cpu_block_table = [], [h for _, h in mapping]
        return mapping

    def swap_in(self, seq: Sequence) -> list[BlockCopy]:
        """Move `seq` back to device blocks; returns (host block, device block) copies."""
        if len(seq.cpu_block_table) > self.num_free_blocks:
            raise PoolExhausted(f"KV pool exhausted: need {len(seq.cpu_block_table)} blocks to swap in, "
                              f"{self.num_free_blocks} free")
        hit = self.cache.prefix_hit(seq).blocks[:len(seq.cpu_block_table)]  # (still cached: no copy back)
        for block in hit:
            self.device.hold(block)
        mapping = [(block, self.device.take()) for block in seq.cpu_block_table[len(hit):]]
        for block in seq.cpu_block_table:
            self.host.release(block)
        seq.block_table, seq.cpu_block_table = [*hit, *(d for _, d in mapping)], []
        seq.num_registered_blocks = len(hit)
        return mapping
