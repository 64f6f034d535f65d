"""BlockManager invariants under random allocate/append/free sequences (Hypothesis state machine)."""

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nanoinfer.sampling import SamplingParams
from runtime.block_manager import BlockManager
from runtime.sequence import Sequence

NUM_BLOCKS, BLOCK_SIZE = 12, 4


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.live: list[tuple[Sequence, int]] = []  # (sequence, tokens it holds)
        self.next_id = 0

    @rule(tokens=st.integers(1, 20))
    def allocate(self, tokens):
        seq = Sequence(self.next_id, [0], SamplingParams(), 64)
        self.next_id += 1
        if self.blocks.can_append(seq, tokens):
            self.blocks.append_slots(seq, tokens)
            self.live.append((seq, tokens))
        else:
            free_before = self.blocks.num_free_blocks
            try:
                self.blocks.append_slots(seq, tokens)
                raise AssertionError("append_slots must refuse when can_append says no")
            except MemoryError:
                assert self.blocks.num_free_blocks == free_before and seq.block_table == []

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=st.integers(0, 9))
    def append(self, data, extra):
        i = data.draw(st.integers(0, len(self.live) - 1))
        seq, tokens = self.live[i]
        if self.blocks.can_append(seq, tokens + extra):
            self.blocks.append_slots(seq, tokens + extra)
            self.live[i] = (seq, tokens + extra)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq, _ = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        self.blocks.free(seq)
        assert seq.block_table == []

    @invariant()
    def accounting(self):
        held = [b for seq, _ in self.live for b in seq.block_table]
        assert len(held) == len(set(held)), "a block is writable by two sequences"
        assert self.blocks.num_free_blocks + len(held) == NUM_BLOCKS
        assert all(c >= 0 for c in self.blocks.ref_counts)
        assert sorted(b for b, c in enumerate(self.blocks.ref_counts) if c) == sorted(held)
        for seq, tokens in self.live:
            assert len(seq.block_table) == -(-tokens // BLOCK_SIZE)


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
