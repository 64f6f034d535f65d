"""The scheduler policy: plan(...) -> Plan, which sequences run this step and how far.

A pure function of the queues and the block manager's counts: it changes nothing, so the
step loop applies the plan (preempt, swap, allocate, run) and tests can check plans alone.

Per step, in order: running decodes, running prefills (chunked to the token budget), swapped
sequences coming back, then waiting ones. Under the "priority" policy a lower `priority`
runs sooner and every `aging_steps` steps of waiting lowers the value by one, so no request
waits forever; ties, and the "fcfs" policy, go by arrival. When the pool runs dry, the
lowest-ranked running sequences are preempted: by recompute (blocks freed, prefilled again
later) or by swap (blocks copied to the host pool, copied back later).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence as Seq

from nanoinfer.errors import RequestError
from runtime.block_manager import BlockManager
from runtime.sequence import Sequence

POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096  # tokens per step; longer prompts prefill in chunks
    policy: str = "fcfs"
    preemption_mode: str = "recompute"
    aging_steps: int = 64  # steps of waiting that raise a request's priority by one

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "aging_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RequestError(f"{name}={value!r} is invalid: expected an integer >= 1")
        if self.policy not in POLICIES:
            raise RequestError(f"policy={self.policy!r} is invalid: expected one of {POLICIES}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise RequestError(f"preemption_mode={self.preemption_mode!r} is invalid: expected one of {PREEMPTION_MODES}")


class ScheduledChunk(NamedTuple):
    seq: Sequence
    num_tokens: int  # computed this step, from seq.num_computed_tokens on


class Plan(NamedTuple):
    chunks: tuple[ScheduledChunk, ...]  # batch order: decodes, prefills, swapped-in, admitted
    preempt: tuple[Sequence, ...]  # running sequences to preempt first, in this order
    swap_out: tuple[Sequence, ...]  # the subset of `preempt` to swap rather than recompute
    swap_in: tuple[Sequence, ...]  # swapped sequences to bring back before the step

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


def rank(seq: Sequence, config: SchedulerConfig, now: int) -> tuple:
    """Sort key: smaller runs sooner."""
    if config.policy == "priority":
        return (seq.priority - (now - seq.arrival) // config.aging_steps, seq.arrival, seq.seq_id)
    return (seq.arrival, seq.seq_id)


def plan(waiting: Seq[Sequence], running: Seq[Sequence], swapped: Seq[Sequence], blocks: BlockManager,
         config: SchedulerConfig, now: int) -> Plan:
    key = lambda s: rank(s, config, now)  # noqa: E731
    budget = config.max_num_batched_tokens
    free = blocks.num_free_blocks
    free_cpu = blocks.num_free_cpu_blocks
    chunks: list[ScheduledChunk] = []
    preempt: list[Sequence] = []
    swap_out: list[Sequence] = []

    # Running sequences best-first, decodes before prefills; victims come off the far end.
    ordered = sorted(running, key=key)
    queue = [s for s in ordered if s.num_pending_tokens == 1] + [s for s in ordered if s.num_pending_tokens > 1]
    victims = list(reversed(ordered))
    kept = set()
    # Device block -> references the victims so far give up. Completions of one request share
    # blocks: a block comes free only when its last holder goes, and a block whose other holders
    # all go needs no copy-on-write.
    dropped: dict[int, int] = {}
    for seq in queue:
        if seq in preempt:
            continue
        take = min(seq.num_pending_tokens, budget)
        if take == 0:
            break
        need = blocks.blocks_needed(seq, seq.num_computed_tokens + take, dropped)
        while need > free:
            victim = next((v for v in victims if v not in kept and v not in preempt), None)
            if victim is None:
                break
            preempt.append(victim)
            if config.preemption_mode == "swap" and len(victim.block_table) <= free_cpu:
                swap_out.append(victim)
                free_cpu -= len(victim.block_table)
            for block in victim.block_table:
                dropped[block] = dropped.get(block, 0) + 1
                if dropped[block] == blocks.ref_counts[block]:
                    free += 1
            if victim is seq:
                break
            need = blocks.blocks_needed(seq, seq.num_computed_tokens + take, dropped)
        if seq in preempt:  # it was the lowest-ranked left: it waits instead
            continue
        kept.add(seq)
        chunks.append(ScheduledChunk(seq, take))
        free -= need
        budget -= take

    # Nothing new starts in a step that had to preempt: the pool is under pressure.
    swap_in: list[Sequence] = []
    num_running = len(kept)
    if not preempt:
        for seq in sorted(swapped, key=key):
            take = min(seq.num_pending_tokens, budget)
            held = len(seq.cpu_block_table)  # comes back into as many device blocks
            need = held + max(0, blocks.blocks_for(seq.num_computed_tokens + take) - held)
            if take == 0 or num_running >= config.max_num_seqs or need > free:
                break
            swap_in.append(seq)
            chunks.append(ScheduledChunk(seq, take))
            free -= need
            budget -= take
            num_running += 1
        if len(swap_in) == len(swapped):  # swapped sequences go before new ones
            for seq in sorted(waiting, key=key):
                take = min(seq.num_pending_tokens, budget)
                need = blocks.blocks_for(seq.num_computed_tokens + take)
                if take == 0 or num_running >= config.max_num_seqs or need > free:
                    break
                chunks.append(ScheduledChunk(seq, take))
                free -= need
                budget -= take
                num_running += 1
    return Plan(tuple(chunks), tuple(preempt), tuple(swap_out), tuple(swap_in))
