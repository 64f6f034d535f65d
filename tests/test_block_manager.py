"""BlockManager invariants and KV data under random allocate/append/fork/free/swap (Hypothesis state machine).

The machine keeps its own model, independent of the manager's bookkeeping: what each sequence
wrote (one value per token position) and what each physical block holds, updated by the writes
and by the copies the manager returns (copy-on-write, swap out, swap in). A sequence's content
read back through its table must equal what it wrote, and the counts the manager reports must
match the tables.
"""

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nanoinfer.sampling.sampler import SamplingParams
from runtime.engine.block_manager import BlockManager, PoolExhausted
from runtime.engine.sequence import Sequence

NUM_BLOCKS, BLOCK_SIZE, NUM_CPU_BLOCKS = 12, 4, 8
GARBAGE = "garbage"  # what a slot holds before anything is written or copied into it


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE, NUM_CPU_BLOCKS)
        self.live: list[Sequence] = []
        self.content: dict[int, list] = {}  # seq_id -> value written at each position
        self.swapped: set[int] = set()  # seq_ids whose KV sits in host blocks
        self.device_data: dict[int, list] = {}  # device block -> its BLOCK_SIZE slots
        self.host_data: dict[int, list] = {}
        self.next_id = 0
        self.next_value = 0

    # -- the model ---------------------------------------------------------------------------

    def _new_seq(self) -> Sequence:
        seq = Sequence(self.next_id, [0], SamplingParams(), 1 << 20)
        self.next_id += 1
        return seq

    def _holders(self, block: int, host: bool = False) -> int:
        return sum((s.cpu_block_table if host else s.block_table).count(block) for s in self.live)

    def _write(self, seq: Sequence, start: int, count: int) -> None:
        values = self.content[seq.seq_id]
        for pos in range(start, start + count):
            value = ("v", self.next_value)
            self.next_value += 1
            block = seq.block_table[pos // BLOCK_SIZE]
            self.device_data.setdefault(block, [GARBAGE] * BLOCK_SIZE)[pos % BLOCK_SIZE] = value
            values.append(value)
        seq.num_computed_tokens = len(values)

    def _forget_free_blocks(self) -> None:
        """Blocks no table holds lose their data, so reading one back through a table fails."""
        device_held = {b for s in self.live for b in s.block_table}
        host_held = {b for s in self.live for b in s.cpu_block_table}
        for block in set(self.device_data) - device_held:
            del self.device_data[block]
        for block in set(self.host_data) - host_held:
            del self.host_data[block]

    def _pick(self, data, candidates):
        return candidates[data.draw(st.integers(0, len(candidates) - 1))]

    def _running(self):
        return [s for s in self.live if s.seq_id not in self.swapped]

    def _swapped(self):
        return [s for s in self.live if s.seq_id in self.swapped]

    def _grow(self, seq: Sequence, extra: int) -> None:
        """Make room for `extra` more tokens from num_computed_tokens on and write them."""
        old = len(self.content[seq.seq_id])
        seq.num_computed_tokens = old  # the next write starts here
        new = old + extra
        missing = max(0, blocks_for(new) - len(seq.block_table))
        write_range = range(old // BLOCK_SIZE, min(len(seq.block_table), blocks_for(new)))
        shared = [seq.block_table[i] for i in write_range if self._holders(seq.block_table[i]) > 1]
        need = missing + len(shared)
        free_before = self.blocks.num_free_blocks
        table_before = list(seq.block_table)
        assert self.blocks.blocks_needed(seq, new) == need
        assert (self.blocks.blocks_needed(seq, new) <= self.blocks.num_free_blocks) == (need <= free_before)
        if need > free_before:
            with pytest.raises(PoolExhausted):
                self.blocks.append_slots(seq, new)
            assert self.blocks.num_free_blocks == free_before and seq.block_table == table_before
            return
        copies = self.blocks.append_slots(seq, new)
        assert self.blocks.num_free_blocks == free_before - need
        assert sorted(src for src, _ in copies) == sorted(shared)
        for src, dst in copies:
            assert dst not in table_before and self._holders(dst) == 1
            self.device_data[dst] = list(self.device_data[src])
        assert len(seq.block_table) == blocks_for(new)
        for i in range(old // BLOCK_SIZE, blocks_for(new)):
            block = seq.block_table[i]
            assert self._holders(block) == 1, f"block {block} is in the write range of two sequences"
            assert self.blocks.ref_counts[block] == 1
        self._write(seq, old, extra)

    # -- rules -------------------------------------------------------------------------------

    @rule(tokens=st.integers(1, 20))
    def allocate(self, tokens):
        seq = self._new_seq()
        self.live.append(seq)
        self.content[seq.seq_id] = []
        self._grow(seq, tokens)
        if not seq.block_table:  # refused: the pool could not hold it
            self.live.remove(seq)

    @precondition(lambda self: any(s.seq_id not in self.swapped for s in self.live))
    @rule(data=st.data(), extra=st.integers(0, 9))
    def append(self, data, extra):
        self._grow(self._pick(data, self._running()), extra)

    @precondition(lambda self: any(s.seq_id not in self.swapped for s in self.live))
    @rule(data=st.data())
    def fork(self, data):
        parent = self._pick(data, self._running())
        child = self._new_seq()
        free_before = self.blocks.num_free_blocks
        self.blocks.fork(parent, child)
        assert self.blocks.num_free_blocks == free_before
        assert child.block_table == parent.block_table and child.block_table is not parent.block_table
        assert child.num_computed_tokens == parent.num_computed_tokens
        self.live.append(child)
        self.content[child.seq_id] = list(self.content[parent.seq_id])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = self._pick(data, self.live)
        exclusive = sum(1 for b in seq.block_table if self._holders(b) == 1)
        free_before, cpu_free_before = self.blocks.num_free_blocks, self.blocks.num_free_cpu_blocks
        held_cpu = len(seq.cpu_block_table)
        self.blocks.free(seq)
        assert seq.block_table == [] and seq.cpu_block_table == []
        assert self.blocks.num_free_blocks == free_before + exclusive
        assert self.blocks.num_free_cpu_blocks == cpu_free_before + held_cpu
        self.live.remove(seq)
        self.swapped.discard(seq.seq_id)
        self._forget_free_blocks()

    @precondition(lambda self: any(s.seq_id not in self.swapped for s in self.live))
    @rule(data=st.data())
    def swap_out(self, data):
        seq = self._pick(data, self._running())
        held = list(seq.block_table)
        cpu_free_before = self.blocks.num_free_cpu_blocks
        fits = len(held) <= cpu_free_before
        assert (len(seq.block_table) <= self.blocks.num_free_cpu_blocks) == fits
        if not fits:
            with pytest.raises(PoolExhausted):
                self.blocks.swap_out(seq)
            assert seq.block_table == held and seq.cpu_block_table == []
            return
        exclusive = sum(1 for b in held if self._holders(b) == 1)
        free_before = self.blocks.num_free_blocks
        mapping = self.blocks.swap_out(seq)
        assert [d for d, _ in mapping] == held and [h for _, h in mapping] == seq.cpu_block_table
        assert seq.block_table == []
        assert self.blocks.num_free_blocks == free_before + exclusive
        assert self.blocks.num_free_cpu_blocks == cpu_free_before - len(held)
        for device_block, host_block in mapping:  # the caller copies before the device blocks are reused
            self.host_data[host_block] = list(self.device_data[device_block])
        self.swapped.add(seq.seq_id)
        self._forget_free_blocks()

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        seq = self._pick(data, self._swapped())
        held = list(seq.cpu_block_table)
        free_before = self.blocks.num_free_blocks
        fits = len(held) <= free_before
        assert (len(seq.cpu_block_table) <= self.blocks.num_free_blocks) == fits
        if not fits:
            with pytest.raises(PoolExhausted):
                self.blocks.swap_in(seq)
            assert seq.cpu_block_table == held and seq.block_table == []
            return
        mapping = self.blocks.swap_in(seq)
        assert [h for h, _ in mapping] == held and [d for _, d in mapping] == seq.block_table
        assert seq.cpu_block_table == []
        assert self.blocks.num_free_blocks == free_before - len(held)
        for host_block, device_block in mapping:
            assert device_block not in self.device_data, "swapped into a block still in use"
            self.device_data[device_block] = list(self.host_data[host_block])
        self.swapped.discard(seq.seq_id)
        self._forget_free_blocks()

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def accounting(self):
        for pool, tables, total, free in (
                (self.blocks.device, [s.block_table for s in self.live], NUM_BLOCKS, self.blocks.num_free_blocks),
                (self.blocks.host, [s.cpu_block_table for s in self.live], NUM_CPU_BLOCKS,
                 self.blocks.num_free_cpu_blocks)):
            for table in tables:
                assert len(table) == len(set(table)), f"a table holds a block twice: {table}"
            held = {b for table in tables for b in table}
            assert free + len(held) == total
            assert all(c >= 0 for c in pool.ref_counts)
            for block in range(total):
                assert pool.ref_counts[block] == sum(table.count(block) for table in tables), block
            assert sorted(pool.free) == sorted(set(range(total)) - held)

    @invariant()
    def tables_match_state(self):
        for seq in self.live:
            tokens = len(self.content[seq.seq_id])
            if seq.seq_id in self.swapped:
                assert seq.block_table == [] and len(seq.cpu_block_table) == blocks_for(tokens)
            else:
                assert seq.cpu_block_table == [] and len(seq.block_table) == blocks_for(tokens)

    @invariant()
    def data_preserved(self):
        for seq in self.live:
            swapped = seq.seq_id in self.swapped
            table, data = (seq.cpu_block_table, self.host_data) if swapped else (seq.block_table, self.device_data)
            read = [data[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE] for pos in range(len(self.content[seq.seq_id]))]
            assert read == self.content[seq.seq_id], f"sequence {seq.seq_id} reads back other data"


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_rejects_bad_sizes():
    for args in ((0, 4), (4, 0), (4, 4, -1)):
        with pytest.raises(ValueError):
            BlockManager(*args)


def test_fork_into_a_sequence_with_blocks_is_refused():
    blocks = BlockManager(4, 2)
    parent, child = (Sequence(i, [1, 2, 3], SamplingParams(), 8) for i in range(2))
    blocks.append_slots(parent, 3)
    blocks.append_slots(child, 1)
    with pytest.raises(ValueError):
        blocks.fork(parent, child)


class PrefixCacheMachine(RuleBasedStateMachine):
    """The prefix cache under random admissions (with hits), growth, forks, finishes and swaps.

    Tokens come from {0, 1}, so prefixes are shared often. The model of the KV data: the value
    at position p of a sequence is its whole prefix, tokens[:p + 1] (what attention computes
    there depends on nothing else), so a block found in the cache must hold exactly the values
    the sequence would have computed."""

    def __init__(self):
        super().__init__()
        self.blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE, NUM_CPU_BLOCKS, prefix_caching=True)
        self.live: list[Sequence] = []
        self.swapped: set[int] = set()
        self.device_data: dict[int, list] = {}
        self.host_data: dict[int, list] = {}
        self.prefix_of: dict[bytes, tuple] = {}  # every key ever registered -> the prefix it stands for
        self.next_id = 0

    def _running(self):
        return [s for s in self.live if s.seq_id not in self.swapped]

    def _pick(self, data, candidates):
        return candidates[data.draw(st.integers(0, len(candidates) - 1))]

    def _holders(self, block):
        return sum(s.block_table.count(block) for s in self.live)

    def _compute(self, seq: Sequence) -> bool:
        """Allocate and write positions num_computed_tokens..len(tokens), then register; False
        (and nothing changed) when the pool cannot hold it."""
        end = len(seq.token_ids)
        if self.blocks.blocks_needed(seq, end) > self.blocks.num_free_blocks:
            return False
        for src, dst in self.blocks.append_slots(seq, end):
            self.device_data[dst] = list(self.device_data[src])
        for pos in range(seq.num_computed_tokens, end):
            block = seq.block_table[pos // BLOCK_SIZE]
            assert self._holders(block) == 1 and block not in self.blocks.device.key_of, \
                f"block {block} written while shared or cached"
            self.device_data.setdefault(block, [GARBAGE] * BLOCK_SIZE)[pos % BLOCK_SIZE] = tuple(seq.token_ids[:pos + 1])
        seq.num_computed_tokens = end
        self.blocks.cache.register(seq)
        keys = self.blocks.cache._keys(seq, end // BLOCK_SIZE)
        for i, key in enumerate(keys[:end // BLOCK_SIZE]):
            assert self.prefix_of.setdefault(key, tuple(seq.token_ids[:(i + 1) * BLOCK_SIZE])) == \
                tuple(seq.token_ids[:(i + 1) * BLOCK_SIZE]), "two prefixes under one key"
        return True

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=14))
    def admit(self, tokens):
        seq = Sequence(self.next_id, tokens, SamplingParams(), 1 << 20)
        self.next_id += 1
        hit = self.blocks.cache.prefix_hit(seq)
        assert len(hit.blocks) * BLOCK_SIZE <= len(tokens) - 1  # the last token is always computed
        assert hit.evictable == sum(1 for b in hit.blocks if self.blocks.ref_counts[b] == 0)
        need = self.blocks.blocks_for(len(tokens)) - len(hit.blocks) + hit.evictable
        if need > self.blocks.num_free_blocks:
            return
        free_before = self.blocks.num_free_blocks
        self.blocks.cache.attach(seq, hit.blocks)
        assert self.blocks.num_free_blocks == free_before - hit.evictable
        self.live.append(seq)
        assert self._compute(seq)
        assert self.blocks.num_free_blocks == free_before - need

    @precondition(lambda self: any(s.seq_id not in self.swapped for s in self.live))
    @rule(data=st.data(), extra=st.lists(st.integers(0, 1), min_size=1, max_size=6))
    def grow(self, data, extra):
        seq = self._pick(data, self._running())
        seq.token_ids += extra
        if not self._compute(seq):
            del seq.token_ids[-len(extra):]

    @precondition(lambda self: any(s.seq_id not in self.swapped for s in self.live))
    @rule(data=st.data())
    def fork(self, data):
        parent = self._pick(data, self._running())
        child = Sequence(self.next_id, list(parent.token_ids), SamplingParams(), 1 << 20)
        self.next_id += 1
        self.blocks.fork(parent, child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):  # (a recompute preemption frees the same way)
        seq = self._pick(data, self.live)
        self.blocks.free(seq)
        self.live.remove(seq)
        self.swapped.discard(seq.seq_id)

    @precondition(lambda self: any(s.seq_id not in self.swapped for s in self.live))
    @rule(data=st.data())
    def swap_out(self, data):
        seq = self._pick(data, self._running())
        if not (len(seq.block_table) <= self.blocks.num_free_cpu_blocks):
            return
        for device_block, host_block in self.blocks.swap_out(seq):
            self.host_data[host_block] = list(self.device_data[device_block])
        self.swapped.add(seq.seq_id)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        seq = self._pick(data, [s for s in self.live if s.seq_id in self.swapped])
        if not (len(seq.cpu_block_table) <= self.blocks.num_free_blocks):
            return
        for host_block, device_block in self.blocks.swap_in(seq):
            self.device_data[device_block] = list(self.host_data[host_block])
        self.swapped.discard(seq.seq_id)

    @invariant()
    def cache_matches_contents(self):
        pool = self.blocks.device
        assert len(pool.by_key) == len(pool.key_of)
        for block, (key, tokens) in pool.key_of.items():
            assert pool.by_key[key] == block
            prefix = self.prefix_of[key]
            assert tokens == prefix[-BLOCK_SIZE:]
            start = len(prefix) - BLOCK_SIZE
            assert self.device_data[block] == [prefix[:start + j + 1] for j in range(BLOCK_SIZE)]

    @invariant()
    def ownership_and_counts(self):
        pool = self.blocks.device
        held = {b for s in self.live for b in s.block_table}
        for block in range(NUM_BLOCKS):
            assert pool.ref_counts[block] == self._holders(block)
        assert set(pool.evictable) == {b for b in pool.key_of if pool.ref_counts[b] == 0}
        assert not set(pool.free) & set(pool.key_of) and not set(pool.free) & held
        assert len(pool.free) + len(pool.evictable) + len(held) == NUM_BLOCKS == \
            self.blocks.num_free_blocks + (self.blocks.num_blocks - self.blocks.device.num_free)

    @invariant()
    def sequences_read_their_prefixes(self):
        for seq in self.live:
            swapped = seq.seq_id in self.swapped
            table, data = (seq.cpu_block_table, self.host_data) if swapped else (seq.block_table, self.device_data)
            for pos in range(seq.num_computed_tokens):
                assert data[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE] == tuple(seq.token_ids[:pos + 1])


TestPrefixCache = PrefixCacheMachine.TestCase
TestPrefixCache.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
