"""The scheduling policy: plan(...) -> Plan, which sequences run this step and how far.

A pure function of the queues and the block manager's counts: it changes nothing, so the
scheduler (runtime/engine/scheduler.py) applies the plan (preempt, swap, allocate) and tests
can check plans alone.

Per step, in order: running decodes, running prefills (chunked to the token budget), swapped
sequences coming back, then waiting ones. Under the "priority" policy a lower `priority`
runs sooner and every `aging_steps` steps of waiting lowers the value by one, so no request
waits forever; ties, and the "fcfs" policy, go by arrival. When the pool runs dry, the
lowest-ranked running sequences are preempted: by recompute (blocks freed, prefilled again
later) or by swap (blocks copied to the host pool, copied back later).
"""

from __future__ import annotations

import bisect
import heapq
from typing import Iterable, Iterator, NamedTuple, Sequence as Seq

from runtime.engine_config import PROMPT_LOGPROB_ROWS, SchedulerConfig
from runtime.engine.block_manager import BlockManager
from runtime.engine.prefix_cache import NO_HIT
from runtime.engine.sequence import Sequence
from runtime.executor.step import Chunk


class Plan(NamedTuple):
    chunks: tuple[Chunk, ...]  # batch order: decodes, prefills, swapped-in, admitted
    preempt: tuple[Sequence, ...]  # running sequences to preempt first, in this order
    swap_out: tuple[Sequence, ...]  # the subset of `preempt` to swap rather than recompute
    swap_in: tuple[Sequence, ...]  # swapped sequences to bring back before the step

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


def rank(seq: Sequence, config: SchedulerConfig, now: int) -> tuple:
    """Sort key: smaller runs sooner."""
    if config.scheduling_policy == "priority":
        return (seq.priority - (now - seq.arrival) // config.aging_steps, seq.arrival, seq.seq_id)
    return (seq.arrival, seq.seq_id)


def num_slots(seq: Sequence) -> int:
    """Places in the batch a sequence will take: itself and the completions that fork off it
    when its prefill ends (n > 1)."""
    return 1 + len(seq.forks)


class WaitingQueue:
    """The waiting sequences, kept in the policy's order so that a step reads only the head of
    the line: its cost grows with what it admits, not with how many wait (a request of
    thousands of sequences must not slow every step down).

    One list per priority value (one list under fcfs), each sorted by arrival. Aging moves a
    whole priority level at once, so within a list the rank order is the arrival order and the
    global order is a merge of the lists' heads.
    """

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self._levels: dict[int, list[Sequence]] = {}

    def _level(self, seq: Sequence) -> list[Sequence]:
        return self._levels.setdefault(seq.priority if self.config.scheduling_policy == "priority" else 0, [])

    def add(self, seq: Sequence) -> None:
        # New requests arrive last (an append); a preempted one goes back to its place.
        bisect.insort(self._level(seq), seq, key=lambda s: (s.arrival, s.seq_id))

    def remove(self, seq: Sequence) -> None:
        self._level(seq).remove(seq)  # admitted sequences sit at the head: a short scan

    def discard(self, seq: Sequence) -> None:
        """Remove `seq` if it is here (a completion not yet forked off never was)."""
        level = self._level(seq)
        if seq in level:
            level.remove(seq)

    def __len__(self) -> int:
        return sum(len(level) for level in self._levels.values())

    def __iter__(self) -> Iterator[Sequence]:
        return (seq for level in self._levels.values() for seq in level)

    def in_rank_order(self, now: int) -> Iterator[Sequence]:
        """Lazily, best first (see `rank`)."""
        levels = [level for level in self._levels.values() if level]
        if len(levels) == 1:
            return iter(levels[0])
        return heapq.merge(*levels, key=lambda s: rank(s, self.config, now))


def wants_prompt_logprobs(seq: Sequence) -> bool:
    return seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_done


def decode_plan(running: Seq[Sequence], blocks: BlockManager, config: SchedulerConfig) -> Plan | None:
    """The steady state planned in one cheap pass: every running sequence decodes its one
    token and the pool has the blocks for it. (The caller checks that nothing waits or is
    swapped out.) None when that is not the case: then `plan` decides. The plan is the one
    `plan` would make, but for the batch order, which changes no sequence's result."""
    if len(running) > config.max_num_batched_tokens:
        return None
    bs, refs, need = blocks.block_size, blocks.ref_counts, 0
    for seq in running:
        computed, table = seq.num_computed_tokens, seq.block_table
        if seq.num_tokens - computed != 1 or seq.num_lookahead or seq.forks or (seq.params.prompt_logprobs is not None
                                                            and not seq.prompt_logprobs_done):
            return None
        i = computed // bs
        if i >= len(table) or refs[table[i]] > 1:  # a new block, or a shared one to copy first
            need += 1
    if need > blocks.num_free_blocks:
        return None
    return Plan(tuple(Chunk(seq, seq.num_computed_tokens, 1) for seq in running), (), (), ())


class _Room:
    """What the step being planned still has room for: tokens, prompt-logprob rows, free device
    and host blocks; and the chunks given so far."""

    def __init__(self, blocks: BlockManager, config: SchedulerConfig):
        self.tokens = config.max_num_batched_tokens
        self.logprob_rows = PROMPT_LOGPROB_ROWS
        self.free, self.free_cpu = blocks.num_free_blocks, blocks.num_free_cpu_blocks
        self.chunks: list[Chunk] = []

    def tokens_for(self, seq: Sequence, start: int | None = None) -> int:
        """What `seq` may compute this step from `start` (default: where it is): its pending
        tokens (and drafts), within the budgets."""
        take = min(seq.num_wanted_tokens if start is None else seq.num_tokens - start, self.tokens)
        return min(take, self.logprob_rows) if wants_prompt_logprobs(seq) else take

    def give(self, chunk: Chunk, need: int) -> None:
        self.chunks.append(chunk)
        self.free -= need
        self.tokens -= chunk.num_tokens
        self.logprob_rows -= chunk.num_tokens if wants_prompt_logprobs(chunk.seq) else 0


def plan(waiting: Iterable[Sequence], running: Seq[Sequence], swapped: Seq[Sequence], blocks: BlockManager,
         config: SchedulerConfig, now: int, num_idle: int = 0) -> Plan:
    """`waiting` in rank order (WaitingQueue.in_rank_order), read only as far as it admits.
    `num_idle` running sequences are left out of `running` (nothing to compute this step) but
    still hold their places under max_num_seqs."""
    key = lambda s: rank(s, config, now)  # noqa: E731
    room = _Room(blocks, config)
    preempt, swap_out = _run(sorted(running, key=key), blocks, config, room)
    # Nothing new starts in a step that had to preempt: the pool is under pressure. A sequence
    # with forks to come counts for all of them, so the batch stays within max_num_seqs once
    # they join.
    swap_in: list[Sequence] = []
    if not preempt:
        num_running = num_idle + sum(num_slots(s) for s in running)
        swap_in, num_running = _admit_swapped(sorted(swapped, key=key), blocks, config, room, num_running)
        if len(swap_in) == len(swapped):  # swapped sequences go before new ones
            _admit_waiting(waiting, blocks, config, room, num_running)
    return Plan(tuple(room.chunks), tuple(preempt), tuple(swap_out), tuple(swap_in))


def _run(ordered: list[Sequence], blocks: BlockManager, config: SchedulerConfig,
         room: _Room) -> tuple[list[Sequence], list[Sequence]]:
    """The running sequences' chunks, best-first, decodes before prefills; when the pool runs
    dry, victims come off the far end. Returns the preempted, and those of them to swap."""
    preempt: list[Sequence] = []
    preempted: set[int] = set()  # seq ids, for O(1) membership: the search stays linear
    swap_out: list[Sequence] = []
    queue = [s for s in ordered if s.num_pending_tokens == 1] + [s for s in ordered if s.num_pending_tokens > 1]
    victims = list(reversed(ordered))
    next_victim = 0  # victims[:next_victim] are preempted or kept: never looked at again
    kept: set[int] = set()
    # Device block -> references the victims so far give up. Completions of one request share
    # blocks: a block comes free only when its last holder goes, and a block whose other holders
    # all go needs no copy-on-write.
    dropped: dict[int, int] = {}
    for seq in queue:
        if seq.seq_id in preempted:
            continue
        take = room.tokens_for(seq)
        if room.tokens == 0:
            break
        if take == 0:
            continue  # no prompt-logprob rows left this step
        need = blocks.blocks_needed(seq, seq.num_computed_tokens + take, dropped)
        while need > room.free:
            while next_victim < len(victims) and victims[next_victim].seq_id in kept:
                next_victim += 1
            if next_victim == len(victims):
                break
            victim = victims[next_victim]
            next_victim += 1
            preempt.append(victim)
            preempted.add(victim.seq_id)
            if config.preemption_mode == "swap" and len(victim.block_table) <= room.free_cpu:
                swap_out.append(victim)
                room.free_cpu -= len(victim.block_table)
            for block in victim.block_table:
                dropped[block] = dropped.get(block, 0) + 1
                if dropped[block] == blocks.ref_counts[block]:
                    room.free += 1
            if victim is seq:
                break
            need = blocks.blocks_needed(seq, seq.num_computed_tokens + take, dropped)
        if seq.seq_id in preempted:  # it was the lowest-ranked left: it waits instead
            continue
        kept.add(seq.seq_id)
        room.give(Chunk(seq, seq.num_computed_tokens, take, max(0, take - seq.num_pending_tokens)), need)
    return preempt, swap_out


def _admit_swapped(ordered: list[Sequence], blocks: BlockManager, config: SchedulerConfig, room: _Room,
                   num_running: int) -> tuple[list[Sequence], int]:
    """Swapped sequences brought back, best first, while they fit."""
    swap_in = []
    for seq in ordered:
        take = room.tokens_for(seq)
        held = len(seq.cpu_block_table)  # comes back into as many device blocks
        need = held + max(0, blocks.blocks_for(seq.num_computed_tokens + take) - held)
        if take == 0 or num_running + num_slots(seq) > config.max_num_seqs or need > room.free:
            break
        swap_in.append(seq)
        room.give(Chunk(seq, seq.num_computed_tokens, take), need)
        num_running += num_slots(seq)
    return swap_in, num_running


def _admit_waiting(waiting: Iterable[Sequence], blocks: BlockManager, config: SchedulerConfig, room: _Room,
                   num_running: int) -> None:
    """Waiting sequences admitted in rank order while they fit, each from its cached prefix."""
    for seq in waiting:
        # A cached prefix is not computed again (prompt logprobs need its logits: no hit).
        hit = NO_HIT if wants_prompt_logprobs(seq) else blocks.cache.prefix_hit(seq)
        start = len(hit.blocks) * blocks.block_size
        take = room.tokens_for(seq, start)
        need = blocks.blocks_for(start + take) - len(hit.blocks) + hit.evictable
        if take == 0 or num_running + num_slots(seq) > config.max_num_seqs or need > room.free:
            break
        room.give(Chunk(seq, start, take, 0, hit.blocks), need)
        num_running += num_slots(seq)
