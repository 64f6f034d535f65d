"""Scheduler: the sequences' queues, each step's plan (runtime/engine/policy.py) and how it is applied.

It owns where each sequence is — waiting, running, swapped out — and its blocks (the block
manager), and tells the executor when a sequence takes or gives up a row and which blocks to
copy or swap. A step goes plan → apply (preemptions, swaps, allocations: what can fail) →
`step_input` (the rows the executor computes) → launch → `commit`, the one place a launched
step changes its sequences, once nothing can fail. `finish` is the one way a sequence ends.
"""

from __future__ import annotations

import time
from typing import Hashable

from runtime.engine_config import SchedulerConfig
from runtime.engine.block_manager import BlockManager
from runtime.engine.outputs import TokenOutput
from runtime.engine.policy import Plan, WaitingQueue, decode_plan, plan
from runtime.engine.sequence import Sequence, SequenceStatus
from runtime.executor.step import InFlightStep, PromptLogprobRows, StepInput, VerifiedRows

NOTHING = Plan((), (), (), ())


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, executor, steps_in_flight: int = 1):
        """`executor`: where the rows and the KV pools are (runtime/executor/make_executor.py).
        `steps_in_flight` 2: each step plans one of two groups of sequences, alternately
        (runtime/engine/virtual_engines.py)."""
        self.config, self.blocks, self.executor = config, blocks, executor
        self.lanes = None
        if steps_in_flight > 1:
            from runtime.engine.virtual_engines import VirtualEngines

            self.lanes = VirtualEngines(steps_in_flight)
        self.waiting = WaitingQueue(config)
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.requests: dict[Hashable, list[Sequence]] = {}  # request key -> its n sequences, until all finish
        self.isolation = None  # a failure being narrowed down (runtime/engine/faults.py), once a step failed
        self.num_preemptions = 0
        self.prefix_cache_queries = self.prefix_cache_hits = 0

    def add(self, seqs: list[Sequence]) -> None:
        """Queue a request's n sequences (the first runs; the others fork off its prefill)."""
        seqs[0].forks = seqs[1:]
        self.requests[seqs[0].request] = seqs
        if self.lanes is not None:
            self.lanes.assign(seqs)
        self.waiting.add(seqs[0])

    def plan(self, now: int, group: int | None = None) -> Plan:
        """The next step's plan (of one group of sequences only: runtime/engine/virtual_engines.py)."""
        if self.lanes is not None and group is None:
            return self.lanes.plan(self, now)
        running, swapped = self.running, self.swapped
        if group is not None:  # (the other group's running sequences count as idle below: max_num_seqs)
            running = [s for s in running if s.virtual_engine == group]
            swapped = [s for s in swapped if s.virtual_engine == group and not s.num_unresolved]
        # A sequence whose last token (still in flight) reaches its length limit has nothing
        # left to compute; it only waits for that token (and keeps its place in the batch).
        running = [s for s in running if s.num_tokens < s.max_total_tokens]
        num_idle = len(self.running) - len(running)
        config = self.config
        if self.isolation is not None:  # narrowing a failure down (runtime/engine/faults.py)
            config, running, num_idle, only = self.isolation.narrow(config, running, num_idle)
            if only:
                return plan((), running, (), self.blocks, config, now, num_idle)
        if not self.waiting and not swapped and (p := decode_plan(running, self.blocks, config)) is not None:
            return p
        waiting = self.waiting.in_rank_order(now)
        if group is not None:
            waiting = (s for s in waiting if s.virtual_engine == group and not s.num_unresolved)
        return plan(waiting, running, swapped, self.blocks, config, now, num_idle)

    def apply(self, p: Plan) -> tuple[Plan, list[TokenOutput]]:
        """Carry out the plan's preemptions, swaps and allocations, in that order; the part of
        the plan that was carried out. A sequence whose part fails (a copy of its blocks) fails
        its request; the rest of the plan then waits for the next step, where it is planned
        again from what did happen (runtime/engine/faults.py)."""
        seq = None  # the one being worked on, when something fails
        try:
            for seq in p.preempt:
                self._preempt(seq, seq in p.swap_out)
            # Cached prefixes first: once held, no allocation below can evict them. (Admitted
            # sequences come last in a plan: the loop reads only them, not every running one.)
            for seq, _, _, _, cached in reversed(p.chunks) if self.blocks.prefix_caching else ():
                if seq.status is not SequenceStatus.WAITING:
                    break
                self.blocks.cache.attach(seq, cached)
                seq.num_draft_computed = seq.num_computed_tokens  # (a draft model's pool was written with it)
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += seq.num_computed_tokens
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = seq.num_computed_tokens
            for seq in p.swap_in:
                self.swapped.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                self.executor.pools.swap_in(self.blocks.swap_in(seq))
                self.executor.add(seq)
            blocks, executor, rows = self.blocks, self.executor, self.executor.row_of  # (every sequence, every step)
            for seq, start, n, _, _ in p.chunks:
                if seq.status is SequenceStatus.WAITING:
                    self.waiting.remove(seq)
                    seq.status = SequenceStatus.RUNNING
                    self.running.append(seq)
                    if seq.scheduled_at is None:
                        seq.scheduled_at = time.monotonic()
                if blocks.needs_slots(seq, start + n):
                    executor.pools.copy_blocks(blocks.append_slots(seq, start + n))
                    executor.table_changed(seq)
                if seq.seq_id not in rows:
                    executor.add(seq)
                if seq.forks and start + n == seq.num_tokens:  # the n - 1 other completions sample from
                    for fork in seq.forks:                     # its last row: each needs a row of its own
                        if not fork.is_finished:
                            executor.add(fork)
        except Exception as exc:  # noqa: BLE001 - contained: the sequence it happened to fails
            from runtime.engine.faults import prepare_failed

            return NOTHING, self.fail(seq, prepare_failed(seq, exc))
        return p, []

    def _preempt(self, seq: Sequence, swap: bool) -> None:
        self.running.remove(seq)
        self.executor.remove(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if swap:
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            self.executor.pools.swap_out(self.blocks.swap_out(seq))
        else:
            self.blocks.free(seq)
            seq.num_computed_tokens = seq.num_draft_computed = 0  # prefilled again, output and all
            seq.status = SequenceStatus.WAITING
            self.waiting.add(seq)

    @staticmethod
    def step_input(p: Plan, host_drafts: dict[Sequence, list[int]]) -> StepInput:
        """What the executor computes for an applied plan: the rows whose logits are wanted, and
        which of them sample (a sequence at its last token, and forks at their parent's), score
        prompt tokens (prompt logprobs) or verify drafts. `host_drafts`: n-gram drafts."""
        logits_rows, samplers, prompt_rows, verifiers, drafts = [], [], [], [], []
        row = 0
        for chunk in p.chunks:  # (every sequence, every step: kept lean)
            seq, start, n, j, _ = chunk
            if j:  # its pending token, then drafts to verify
                if seq in host_drafts:
                    drafts += host_drafts[seq][:j]
                verifiers.append(VerifiedRows(seq, len(logits_rows), j, seq.params.logprobs))
                logits_rows.extend(range(row, row + n))
                row += n
                continue
            end = start + n
            if seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_done:
                # Row j (position start + j) predicts token start + j + 1 of the prompt; the list
                # is complete once the chunk reaches the prompt's end, where the sequence samples
                # its first token: it goes out with that token.
                last = min(end, seq.num_prompt_tokens - 1)
                prompt_rows.append(PromptLogprobRows(seq, len(logits_rows), start,
                                                     seq.prompt_token_ids[start + 1:last + 1],
                                                     end >= seq.num_prompt_tokens))
                logits_rows.extend(range(row, row + max(0, last - start)))
            if end == seq.num_tokens:
                samplers.append((seq, len(logits_rows)))
                if seq.forks:  # (they share its blocks and sample their first token from its row)
                    samplers.extend((fork, len(logits_rows)) for fork in seq.forks if not fork.is_finished)
                logits_rows.append(row + n - 1)
            row += n
        return StepInput(p.chunks, tuple(logits_rows), tuple(samplers), tuple(prompt_rows), tuple(verifiers),
                         tuple(drafts))

    def commit(self, inp: StepInput, step: InFlightStep) -> None:
        """The launched step's effect on its sequences (nothing here can fail)."""
        for seq, position in step.draft_computed:  # (a draft model's cache, caught up by the step)
            seq.num_draft_computed = position
        # A block just filled goes into the prefix cache (a decode fills one every block_size steps).
        register, bs = self.blocks.cache.register, (self.blocks.block_size if self.blocks.prefix_caching else 1 << 62)
        for chunk in inp.chunks:
            seq = chunk.seq
            if seq.is_finished:  # (by the step before, read during this launch: engine_core.py)
                continue
            seq.num_computed_tokens += chunk.num_tokens
            if seq.num_computed_tokens // bs > seq.num_registered_blocks:
                register(seq)
            if seq.forks and seq.num_computed_tokens >= seq.num_tokens:
                self._fork(seq)
        for entry in inp.prompt_rows:
            entry.seq.prompt_logprobs_done = entry.final  # (a recompute won't redo them)
        for seq, _ in inp.samplers:
            if not seq.is_finished:
                seq.num_unresolved += 1  # known once this step is resolved
        if self.lanes is not None:
            self.lanes.launched()

    def _fork(self, seq: Sequence) -> None:
        """`seq`'s prefill is done: its pending completions join the batch, sharing its blocks."""
        for fork in seq.forks:
            if fork.is_finished:
                continue
            self.blocks.fork(seq, fork)
            fork.num_draft_computed = seq.num_draft_computed
            self.executor.table_changed(fork)
            fork.status = SequenceStatus.RUNNING
            fork.prompt_logprobs_done = True  # the request's prompt logprobs come with the first completion
            self.running.append(fork)
        seq.forks = []

    def abort(self, request: Hashable, reason: str = "abort", index: int | None = None) -> None:
        """Finish a request's sequences now (all, or completion `index`: its stop string
        matched) and free their blocks; completions not yet forked off end with the first.
        Unknown or finished requests are ignored."""
        for seq in list(self.requests.get(request, ())):
            if index is None or seq.index == index:
                for fork in seq.forks:
                    self.finish(fork, reason)
                seq.forks = []
                if not seq.is_finished:
                    self.finish(seq, reason)

    def fail(self, seq: Sequence, error: Exception) -> list[TokenOutput]:
        """Fail `seq`'s whole request with `error`: every completion ends ("error"), its blocks
        are freed; one output per completion that was still unfinished."""
        outputs = []
        for other in list(self.requests.get(seq.request, (seq,))):
            if not other.is_finished:
                self.blocks.cache.uncache(other)  # (what its steps wrote is not to be shared)
                other.error = error
                self.finish(other, "error")
                outputs.append(TokenOutput(other, None, True))
        return outputs

    def finish(self, seq: Sequence, reason: str) -> None:
        """The one way a sequence ends: out of its queue, blocks and row freed, its request
        forgotten once all its completions have ended. (`apply` keeps a sequence's status and
        queue in step even when it fails half way.)"""
        if seq.status is SequenceStatus.RUNNING and seq in self.running:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED and seq in self.swapped:
            self.swapped.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.discard(seq)  # (a completion not yet forked off was never queued)
        self.blocks.free(seq)
        self.executor.remove(seq)
        if self.lanes is not None and not seq.is_finished:
            self.lanes.finished(seq)
        seq.num_unresolved = 0  # (tokens of a step still in flight are dropped when it resolves)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seqs = self.requests.get(seq.request)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self.requests[seq.request]

    def stats(self) -> dict:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "swapped": len(self.swapped),
            "free_blocks": self.blocks.num_free_blocks,
            "total_blocks": self.blocks.num_blocks,
            "num_preemptions": self.num_preemptions,
            # prefix cache: prompt tokens new sequences looked up, and those found computed
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "cached_blocks": self.blocks.cache.num_blocks,
        }
