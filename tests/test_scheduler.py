"""Scheduler policy: plan() on random situations, and plan + apply + fake sampling run for many steps.

The tests check plans against what the docstring of runtime/engine/scheduler.py promises, with an
independent model of the queues and of the KV pools' contents: every position a sequence has
computed holds that sequence's token, read back through its table after any preemption, swap
or copy-on-write. `Sim.apply` carries out a plan the way EngineCore._apply does, and
`Sim.forward` forks a request's n - 1 other completions off its prefill as EngineCore.step does.
"""

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from nanoinfer.errors import RequestError
from nanoinfer.sampling.sampler import SamplingParams
from runtime.engine.block_manager import BlockManager
from runtime.engine_config import SchedulerConfig
from runtime.engine.policy import WaitingQueue, plan, rank
from runtime.engine.sequence import Sequence, SequenceStatus

WAITING, RUNNING, SWAPPED, FINISHED = (SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.SWAPPED,
                                       SequenceStatus.FINISHED)


def expected_rank(seq: Sequence, config: SchedulerConfig, now: int) -> tuple:
    """The order the scheduler's docstring promises: lower priority value first, one step better
    per `aging_steps` waited since arrival; ties, and fcfs, by arrival (then id)."""
    if config.scheduling_policy == "priority":
        return (seq.priority - (now - seq.arrival) // config.aging_steps, seq.arrival, seq.seq_id)
    return (seq.arrival, seq.seq_id)


def token(seq_id: int, position: int) -> int:
    """Every sequence's tokens are distinct from every other's, so KV cross-talk shows."""
    return seq_id * 1000 + position


class Sim:
    """Queues, a BlockManager and a model of what each KV block holds; applies plans like EngineCore."""

    def __init__(self, num_blocks, block_size, num_cpu_blocks, config: SchedulerConfig):
        self.blocks = BlockManager(num_blocks, block_size, num_cpu_blocks)
        self.block_size = block_size
        self.config = config
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.device_data: dict[int, list] = {}  # device block -> token in each slot
        self.host_data: dict[int, list] = {}
        self.now = 0
        self.next_id = 0
        self.num_preemptions = self.num_swap_outs = self.num_swap_ins = self.num_copies_on_write = 0

    # -- building situations ------------------------------------------------------------------

    def new_seq(self, prompt_len: int, max_total: int, num_outputs: int = 0, priority: int = 0,
                arrival: int = 0) -> Sequence:
        seq_id = self.next_id
        self.next_id += 1
        prompt = [token(seq_id, i) for i in range(prompt_len)]
        seq = Sequence(seq_id, prompt, SamplingParams(), max_total, priority=priority, arrival=arrival)
        seq.token_ids += [token(seq_id, i) for i in range(prompt_len, prompt_len + num_outputs)]
        return seq

    def add_request(self, prompt_len: int, max_total: int, priority: int = 0, n: int = 1) -> Sequence:
        """Like EngineCore.add_request: n completions, the last n - 1 forked off the first's prefill."""
        seq = self.new_seq(prompt_len, max_total, priority=priority, arrival=self.now)
        for i in range(1, n):
            seq.forks.append(Sequence(self.next_id, list(seq.prompt_token_ids), SamplingParams(), max_total,
                                      priority=priority, arrival=self.now, index=i))
            self.next_id += 1
        self.add_waiting(seq)
        return seq

    def add_waiting(self, seq: Sequence) -> None:
        seq.status = WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence, computed: int) -> bool:
        """Make `seq` running with `computed` tokens in the cache, as steps of chunks would have."""
        if self.blocks.blocks_needed(seq, computed) > self.blocks.num_free_blocks:
            return False
        self.blocks.append_slots(seq, computed)
        self._write(seq, 0, computed)
        seq.num_computed_tokens = computed
        seq.status = RUNNING
        self.running.append(seq)
        return True

    def add_fork(self, parent: Sequence) -> Sequence:
        child = Sequence(self.next_id, list(parent.prompt_token_ids), SamplingParams(), parent.max_total_tokens,
                         priority=parent.priority, arrival=parent.arrival, token_ids=list(parent.token_ids))
        self.next_id += 1
        self.blocks.fork(parent, child)
        child.status = RUNNING
        self.running.append(child)
        return child

    def swap_out(self, seq: Sequence) -> None:
        for device_block, host_block in self.blocks.swap_out(seq):
            self.host_data[host_block] = list(self.device_data[device_block])
        self.running.remove(seq)
        seq.status = SWAPPED
        self.swapped.append(seq)
        self._forget_free_blocks()

    # -- the model of the pools ---------------------------------------------------------------

    def _write(self, seq: Sequence, start: int, count: int) -> None:
        for pos in range(start, start + count):
            block = seq.block_table[pos // self.block_size]
            self.device_data.setdefault(block, [None] * self.block_size)[pos % self.block_size] = seq.token_ids[pos]

    def _forget_free_blocks(self) -> None:
        """A block no table holds loses its contents, so reading it back later fails."""
        seqs = self.waiting + self.running + self.swapped
        for data, held in ((self.device_data, {b for s in seqs for b in s.block_table}),
                           (self.host_data, {b for s in seqs for b in s.cpu_block_table})):
            for block in set(data) - held:
                del data[block]

    def read(self, seq: Sequence, count: int) -> list:
        table, data = (seq.cpu_block_table, self.host_data) if seq.status is SWAPPED else (seq.block_table,
                                                                                           self.device_data)
        bs = self.block_size
        return [data[table[p // bs]][p % bs] if table[p // bs] in data else "lost" for p in range(count)]

    def holders(self, block: int) -> int:
        return sum(s.block_table.count(block) for s in self.running + self.waiting + self.swapped)

    # -- one step -----------------------------------------------------------------------------

    def plan(self):
        # EngineCore passes its WaitingQueue in rank order (tested against this sort below).
        waiting = sorted(self.waiting, key=lambda s: rank(s, self.config, self.now))
        return plan(waiting, self.running, self.swapped, self.blocks, self.config, self.now)

    def apply(self, p) -> None:
        """EngineCore._apply, with the KV copies done on the model of the pools."""
        for seq in p.preempt:
            seq.num_preemptions += 1
            self.num_preemptions += 1
            if seq in p.swap_out:
                self.swap_out(seq)
                self.num_swap_outs += 1
            else:
                self.running.remove(seq)
                self.blocks.free(seq)
                seq.num_computed_tokens = 0
                seq.status = WAITING
                self.waiting.append(seq)
        self._forget_free_blocks()
        for seq in p.swap_in:
            for host_block, device_block in self.blocks.swap_in(seq):
                assert device_block not in self.device_data, "swapped into a block still in use"
                self.device_data[device_block] = list(self.host_data[host_block])
            self.swapped.remove(seq)
            seq.status = RUNNING
            self.running.append(seq)
            self.num_swap_ins += 1
        self._forget_free_blocks()
        for seq, _, n, *_ in p.chunks:
            if seq.status is WAITING:
                self.waiting.remove(seq)
                seq.status = RUNNING
                self.running.append(seq)
            table_before = list(seq.block_table)
            for src, dst in self.blocks.append_slots(seq, seq.num_computed_tokens + n):
                assert dst not in table_before and dst not in self.device_data
                self.device_data[dst] = list(self.device_data[src])
                self.num_copies_on_write += 1
            self._forget_free_blocks()

    def forward(self, p) -> None:
        """Check each scheduled sequence's context, write its chunk, sample, finish at max length."""
        for seq, planned_start, n, num_drafts, _ in p.chunks:
            start = seq.num_computed_tokens
            assert planned_start == start, "a chunk's start is where its sequence's computed tokens end"
            assert num_drafts == 0  # (no speculation here)
            assert self.read(seq, start) == seq.token_ids[:start], f"seq {seq.seq_id} lost its KV"
            self._write(seq, start, n)
        for seq, _, n, *_ in p.chunks:
            seq.num_computed_tokens += n
        samplers = [seq for seq, *_ in p.chunks if seq.num_computed_tokens == seq.num_tokens]
        for seq in list(samplers):  # a finished prefill: the other completions share its blocks
            for child in seq.forks:
                self.blocks.fork(seq, child)
                child.status = RUNNING
                self.running.append(child)
                samplers.append(child)
            seq.forks = []
        for seq in samplers:
            seq.token_ids.append(token(seq.seq_id, seq.num_tokens))
            if seq.num_tokens >= seq.max_total_tokens:
                self.running.remove(seq)
                self.blocks.free(seq)
                seq.status = FINISHED
                self.finished.append(seq)
        self._forget_free_blocks()
        self.now += 1

    def step(self) -> None:
        before = Snapshot(self)
        p = self.plan()
        check_plan(before, p)
        self.apply(p)
        check_applied(before, p, self)
        self.forward(p)
        check_state(self)


# -- checks ---------------------------------------------------------------------------------


class Snapshot:
    """What the plan is judged against: the queues, counts and needs before the step."""

    def __init__(self, sim: Sim):
        self.sim = sim
        self.config, self.now = sim.config, sim.now
        self.waiting, self.running, self.swapped = list(sim.waiting), list(sim.running), list(sim.swapped)
        self.pending = {s: s.num_pending_tokens for s in self.waiting + self.running + self.swapped}
        self.computed = {s: s.num_computed_tokens for s in self.pending}
        self.free = sim.blocks.num_free_blocks
        bs = sim.block_size
        # Free device blocks each running sequence needs to compute all its pending tokens.
        self.full_need = {}
        for s in self.running:
            end = s.num_computed_tokens + s.num_pending_tokens
            write_range = range(s.num_computed_tokens // bs, min(len(s.block_table), -(-end // bs)))
            shared = sum(1 for i in write_range if sim.holders(s.block_table[i]) > 1)
            self.full_need[s] = max(0, -(-end // bs) - len(s.block_table)) + shared

    def rank(self, seq):
        return expected_rank(seq, self.config, self.now)


def check_plan(before: Snapshot, p) -> None:
    config = before.config
    chunk_seqs = [c.seq for c in p.chunks]
    running, waiting, swapped = before.running, before.waiting, before.swapped
    in_running = lambda s: any(s is r for r in running)  # noqa: E731
    in_waiting = lambda s: any(s is w for w in waiting)  # noqa: E731
    in_swapped = lambda s: any(s is w for w in swapped)  # noqa: E731

    # Token budget and chunk sizes.
    assert p.num_tokens <= config.max_num_batched_tokens
    for seq, _, n, *_ in p.chunks:
        assert 1 <= n <= before.pending[seq], (seq.seq_id, n, before.pending[seq])

    # Membership.
    assert len(set(map(id, chunk_seqs))) == len(chunk_seqs), "a sequence is scheduled twice"
    assert len(set(map(id, p.preempt))) == len(p.preempt)
    assert len(set(map(id, p.swap_in))) == len(p.swap_in)
    assert not set(map(id, chunk_seqs)) & set(map(id, p.preempt)), "scheduled and preempted"
    assert all(in_running(s) for s in p.preempt), "preempted a sequence that is not running"
    assert all(any(s is q for q in p.preempt) for s in p.swap_out), "swap_out is not a subset of preempt"
    if config.preemption_mode == "recompute":
        assert not p.swap_out
    assert all(in_swapped(s) for s in p.swap_in)
    assert all(any(s is c for c in chunk_seqs) for s in p.swap_in), "swapped in but not run"
    for seq in chunk_seqs:
        assert in_running(seq) or in_waiting(seq) or any(seq is s for s in p.swap_in), seq.seq_id

    # Batch order: running decodes, running prefills, swapped-in, admitted.
    def section(seq):
        if in_running(seq):
            return 0 if before.pending[seq] == 1 else 1
        return 2 if in_swapped(seq) else 3
    sections = [section(s) for s in chunk_seqs]
    assert sections == sorted(sections), sections

    # Nothing new starts in a step that preempts.
    admitted = [s for s in chunk_seqs if in_waiting(s)]
    if p.preempt:
        assert not p.swap_in and not admitted

    # Swapped sequences come back best-first, waiting ones are admitted best-first, and only once
    # every swapped one is back: each is a prefix of its queue in rank order.
    by_rank = sorted(swapped, key=before.rank)
    assert [id(s) for s in p.swap_in] == [id(s) for s in by_rank[:len(p.swap_in)]]
    by_rank = sorted(waiting, key=before.rank)
    assert [id(s) for s in admitted] == [id(s) for s in by_rank[:len(admitted)]]
    if admitted:
        assert len(p.swap_in) == len(swapped)

    # Victims go worst-first, and a sequence is preempted only once every worse one is scheduled
    # or preempted.
    victim_ranks = [before.rank(s) for s in p.preempt]
    assert victim_ranks == sorted(victim_ranks, reverse=True)
    for victim in p.preempt:
        for other in running:
            if before.rank(other) > before.rank(victim):
                assert any(other is s for s in chunk_seqs + list(p.preempt)), (victim.seq_id, other.seq_id)

    # No preemption when every running sequence's whole pending work fits in the free blocks.
    if sum(before.full_need.values()) <= before.free:
        assert not p.preempt

    # Progress: a running sequence is scheduled or preempted (a running one left out is only left
    # out because the token budget ran out).
    if running:
        # The last one standing always fits (requests fit the pool), so some chunk runs.
        assert p.chunks, "running sequences, yet an idle step"
        unscheduled = [s for s in running if not any(s is c for c in chunk_seqs + list(p.preempt))]
        if unscheduled:
            assert p.num_tokens == config.max_num_batched_tokens
    elif swapped or waiting:
        # Nothing holds device blocks, so the head of the line fits (requests fit the pool).
        assert p.chunks, "waiting/swapped sequences and an empty pool, yet an idle step"


def check_applied(before: Snapshot, p, sim: Sim) -> None:
    bs = sim.block_size
    # Forks of an n > 1 request join the running ones outside the plan; the plan itself starts
    # nothing (swap in, admit) that takes the running sequences past max_num_seqs.
    if p.swap_in or any(any(s is w for w in before.waiting) for s, *_ in p.chunks):
        assert len(sim.running) <= sim.config.max_num_seqs
    assert len(sim.running) <= max(sim.config.max_num_seqs, len(before.running))
    for seq, _, n, *_ in p.chunks:
        assert seq.status is RUNNING and seq.cpu_block_table == []
        end = seq.num_computed_tokens + n
        assert len(seq.block_table) == -(-end // bs), "the chunk has no slots (or too many)"
        for i in range(seq.num_computed_tokens // bs, len(seq.block_table)):
            block = seq.block_table[i]
            assert sim.holders(block) == 1, f"block {block} is writable by two sequences"
    check_state(sim, {id(seq): n for seq, _, n, *_ in p.chunks})


def check_state(sim: Sim, scheduled: dict | None = None) -> None:
    """scheduled: id(seq) -> tokens it was given slots for this step, not yet computed."""
    bs, scheduled = sim.block_size, scheduled or {}
    queues = {WAITING: sim.waiting, RUNNING: sim.running, SWAPPED: sim.swapped, FINISHED: sim.finished}
    everyone = [s for q in queues.values() for s in q]
    assert len(set(map(id, everyone))) == len(everyone), "a sequence sits in two queues"
    for status, queue in queues.items():
        for seq in queue:
            assert seq.status is status
            if status is WAITING:
                assert seq.num_computed_tokens == 0 and seq.block_table == [] and seq.cpu_block_table == []
            elif status is RUNNING:
                covered = seq.num_computed_tokens + scheduled.get(id(seq), 0)
                assert seq.cpu_block_table == [] and len(seq.block_table) == -(-covered // bs)
            elif status is SWAPPED:
                assert seq.block_table == [] and len(seq.cpu_block_table) == -(-seq.num_computed_tokens // bs)
            else:
                assert seq.block_table == [] and seq.cpu_block_table == []
            if status in (RUNNING, SWAPPED):
                assert sim.read(seq, seq.num_computed_tokens) == seq.token_ids[:seq.num_computed_tokens]
    for pool, tables, free in ((sim.blocks.device, [s.block_table for s in everyone], sim.blocks.num_free_blocks),
                               (sim.blocks.host, [s.cpu_block_table for s in everyone],
                                sim.blocks.num_free_cpu_blocks)):
        held = {b for t in tables for b in t}
        assert free + len(held) == pool.size
        for block in range(pool.size):
            assert pool.ref_counts[block] == sum(t.count(block) for t in tables) >= 0


# -- random situations ----------------------------------------------------------------------


@st.composite
def configs(draw, max_num_seqs=st.integers(1, 6)):
    return SchedulerConfig(max_num_seqs=draw(max_num_seqs), max_num_batched_tokens=draw(st.integers(1, 24)),
                           scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
                           preemption_mode=draw(st.sampled_from(["recompute", "swap"])),
                           aging_steps=draw(st.integers(1, 5)))


@st.composite
def situations(draw):
    block_size = draw(st.integers(1, 4))
    num_blocks = draw(st.integers(1, 16))
    capacity = num_blocks * block_size  # no request may need more than the pool (EngineCore.check_request)
    assume(capacity >= 2)
    sim = Sim(num_blocks, block_size, draw(st.integers(0, 12)), draw(configs()))
    sim.now = draw(st.integers(0, 30))
    kinds = ["waiting", "recomputed", "prefilling", "decoding", "swapped", "fork"]
    for kind in draw(st.lists(st.sampled_from(kinds), min_size=2, max_size=10)):
        if kind == "fork":
            if sim.running and len(sim.running) < sim.config.max_num_seqs:
                sim.add_fork(draw(st.sampled_from(sim.running)))
            continue
        prompt_len = draw(st.integers(1, min(12, capacity - 1)))
        max_total = draw(st.integers(prompt_len + 1, capacity))
        priority, arrival = draw(st.integers(0, 4)), draw(st.integers(0, sim.now))
        if kind in ("waiting", "recomputed"):
            outputs = draw(st.integers(0, max_total - prompt_len - 1)) if kind == "recomputed" else 0
            seq = sim.new_seq(prompt_len, max_total, outputs, priority, arrival)
            seq.num_preemptions = int(kind == "recomputed")
            sim.add_waiting(seq)
            continue
        if len(sim.running) >= sim.config.max_num_seqs and kind != "swapped":
            continue
        decoding = draw(st.booleans()) if kind == "swapped" else kind == "decoding"
        if decoding or prompt_len == 1:
            if max_total < prompt_len + 2:
                continue
            seq = sim.new_seq(prompt_len, max_total, draw(st.integers(1, max_total - prompt_len - 1)), priority,
                              arrival)
            computed = seq.num_tokens - 1
        else:
            seq = sim.new_seq(prompt_len, max_total, 0, priority, arrival)
            computed = draw(st.integers(1, prompt_len - 1))
        if not sim.add_running(seq, computed):
            continue
        if kind == "swapped":
            if len(seq.block_table) <= sim.blocks.num_free_cpu_blocks and not any(b for b in seq.block_table if sim.holders(b) > 1):
                sim.swap_out(seq)
            else:
                sim.running.remove(seq)
                sim.blocks.free(seq)
    check_state(sim)
    return sim


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(situations())
def test_plan_on_random_situations(sim):
    sim.step()


# -- policies --------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(early=st.integers(0, 5), late=st.integers(0, 5), aging_steps=st.integers(1, 5), now=st.integers(0, 30))
def test_priority_ages_by_one_per_aging_steps(early, late, aging_steps, now):
    """A request that has waited `now` steps ranks as priority `early - now // aging_steps`: it goes
    ahead of a fresh one exactly when that is no worse (ties go to the earlier arrival)."""
    config = SchedulerConfig(scheduling_policy="priority", aging_steps=aging_steps, max_num_batched_tokens=8)
    sim = Sim(4, 1, 0, config)  # room for one of the two prompts, not both
    sim.now = now
    old = sim.new_seq(3, 4, priority=early, arrival=0)
    new = sim.new_seq(3, 4, priority=late, arrival=now)
    sim.add_waiting(new)
    sim.add_waiting(old)
    p = sim.plan()
    assert [c.seq for c in p.chunks] == [old if early - now // aging_steps <= late else new]
    assert rank(old, config, now + aging_steps)[0] == rank(old, config, now)[0] - 1


@settings(max_examples=100, deadline=None)
@given(arrivals=st.lists(st.integers(0, 10), min_size=1, max_size=8), priorities=st.lists(st.integers(0, 4), min_size=8,
       max_size=8), num_blocks=st.integers(2, 12), budget=st.integers(1, 30), max_num_seqs=st.integers(1, 8))
def test_fcfs_admits_in_arrival_order_whatever_the_priority(arrivals, priorities, num_blocks, budget, max_num_seqs):
    config = SchedulerConfig(scheduling_policy="fcfs", max_num_batched_tokens=budget, max_num_seqs=max_num_seqs)
    sim = Sim(num_blocks, 2, 0, config)
    sim.now = 10
    for arrival, priority in zip(arrivals, priorities):
        sim.add_waiting(sim.new_seq(3, 4, priority=priority, arrival=arrival))
    p = sim.plan()
    admitted = [c.seq for c in p.chunks]
    left = [s for s in sim.waiting if not any(s is a for a in admitted)]
    assert all((a.arrival, a.seq_id) < (w.arrival, w.seq_id) for a in admitted for w in left)
    assert admitted, "the first request fits an empty pool"


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full():
    config = SchedulerConfig(max_num_batched_tokens=16, preemption_mode="swap")
    sim = Sim(8, 1, 3, config)  # host room for one victim of two blocks
    best = sim.new_seq(8, 8, arrival=0)
    sim.add_running(best, 1)  # 7 prompt tokens to go: 7 blocks, 1 free
    victims = [sim.new_seq(4, 8, arrival=1 + i) for i in range(3)]
    for seq in victims:
        sim.add_running(seq, 2)
    p = sim.plan()
    assert [c.seq for c in p.chunks] == [best] and p.chunks[0].num_tokens == 7
    assert list(p.preempt) == victims[::-1]  # worst (latest) first
    assert list(p.swap_out) == [victims[2]]
    sim.step()
    assert sim.swapped == [victims[2]] and sim.waiting == victims[1::-1]
    assert sim.blocks.num_free_cpu_blocks == 1


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempting_every_holder_of_shared_blocks_frees_them(mode):
    """Two completions of one request share all their blocks: preempting one frees nothing, both
    free them all. The best sequence must not be preempted for want of blocks they free."""
    config = SchedulerConfig(max_num_batched_tokens=8, preemption_mode=mode)
    sim = Sim(4, 2, 4, config)
    best = sim.new_seq(3, 8, num_outputs=2, arrival=0)
    sim.add_running(best, 4)  # 2 blocks; its next token starts a third
    parent = sim.new_seq(3, 8, num_outputs=1, arrival=1)
    sim.add_running(parent, 3)  # the other 2 blocks, shared with its fork
    sim.add_fork(parent)
    assert sim.blocks.num_free_blocks == 0
    p = sim.plan()
    assert [c.seq for c in p.chunks] == [best]
    assert len(p.preempt) == 2 and best not in p.preempt
    sim.step()


def test_a_fork_preempted_leaves_its_sibling_the_shared_block():
    """When a sequence's write-range block is shared only with sequences being preempted, it needs
    no copy: the best of two completions keeps running when its sibling makes way."""
    sim = Sim(3, 2, 0, SchedulerConfig(max_num_batched_tokens=8))
    first = sim.new_seq(1, 6, num_outputs=1, arrival=0)
    sim.add_running(first, 1)  # one block, with room for its next token
    parent = sim.new_seq(3, 6, num_outputs=1, arrival=1)
    sim.add_running(parent, 3)  # two blocks; the next token goes into the shared second one
    fork = sim.add_fork(parent)
    p = sim.plan()
    assert [c.seq for c in p.chunks] == [first, parent] and list(p.preempt) == [fork]
    sim.step()


@settings(max_examples=200, deadline=None)
@given(entries=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 20)), max_size=30),
       policy=st.sampled_from(["fcfs", "priority"]), aging_steps=st.integers(1, 5), now=st.integers(20, 40),
       removed=st.sets(st.integers(0, 29)))
def test_waiting_queue_yields_rank_order(entries, policy, aging_steps, now, removed):
    """The queue the engine hands plan(): whatever the order of arrivals, preemptions put
    back and removals, it yields exactly the rank order the scheduler promises."""
    config = SchedulerConfig(scheduling_policy=policy, aging_steps=aging_steps)
    queue, kept = WaitingQueue(config), []
    for i, (priority, arrival) in enumerate(entries):
        seq = Sequence(i, [1], SamplingParams(), 4, priority=priority, arrival=arrival)
        queue.add(seq)
        kept.append(seq)
    for i in sorted(removed):
        if i < len(kept):
            queue.remove(kept[i])
    kept = [s for i, s in enumerate(kept) if i not in removed]
    assert len(queue) == len(kept)
    assert list(queue.in_rank_order(now)) == sorted(kept, key=lambda s: expected_rank(s, config, now))


def test_a_huge_queue_costs_a_step_only_what_it_admits():
    """10,000 waiting sequences: plan() reads the head of the line, not the whole queue."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    queue = WaitingQueue(config)
    for i in range(10_000):
        queue.add(Sequence(i, [1, 2, 3], SamplingParams(), 8, arrival=i))
    read = []

    def head_of_the_line():
        for seq in queue.in_rank_order(0):
            read.append(seq)
            yield seq
    p = plan(head_of_the_line(), [], [], BlockManager(64, 4), config, 0)
    assert [c.seq.seq_id for c in p.chunks] == [0, 1, 2, 3]
    assert len(read) == 5  # the four admitted, and the one that did not fit


def test_config_rejects_bad_values():
    for bad in ({"max_num_seqs": 0}, {"max_num_batched_tokens": True}, {"aging_steps": 1.5}, {"scheduling_policy": "lifo"},
                {"preemption_mode": "drop"}):
        with pytest.raises(RequestError):
            SchedulerConfig(**bad)


# -- many steps -----------------------------------------------------------------------------


def run_to_completion(sim: Sim, requests, max_steps: int) -> None:
    """requests: (arrival step, prompt_len, max_total, priority, n). Steps until all n of each finish."""
    pending = sorted(requests)
    while pending or sim.waiting or sim.running or sim.swapped:
        assert sim.now < max_steps, (f"not finished after {max_steps} steps: {len(sim.waiting)} waiting, "
                                     f"{len(sim.running)} running, {len(sim.swapped)} swapped")
        while pending and pending[0][0] <= sim.now:
            arrival, prompt_len, max_total, priority, n = pending.pop(0)
            sim.add_request(prompt_len, max_total, priority, n)
        sim.step()
        # Forks join outside the plan, when their parent's prefill ends: the plan must have kept
        # their places (issue 10: 5,249 running at a limit of 256).
        assert len(sim.running) <= sim.config.max_num_seqs, (len(sim.running), sim.config.max_num_seqs)
    assert len(sim.finished) == sum(r[4] for r in requests)
    assert sim.blocks.num_free_blocks == sim.blocks.num_blocks
    assert sim.blocks.num_free_cpu_blocks == sim.blocks.host.size
    for seq in sim.finished:
        outputs = [token(seq.seq_id, i) for i in range(seq.num_prompt_tokens, seq.max_total_tokens)]
        assert seq.token_ids == seq.prompt_token_ids + outputs


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_pool_forces_preemption_and_everything_finishes(mode, policy):
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=6, scheduling_policy=policy, preemption_mode=mode,
                             aging_steps=3)
    sim = Sim(6, 2, 6, config)  # 12 token slots; every request grows to 9-12 tokens
    requests = [(i // 2, 3 + i % 3, 9 + i % 4, (5 - i) % 3, 1) for i in range(10)]
    run_to_completion(sim, requests, max_steps=400)
    assert sim.num_preemptions > 0
    if mode == "swap":
        assert sim.num_swap_outs > 0 and sim.num_swap_ins > 0
    else:
        assert sim.num_swap_outs == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_n_completions_share_the_prompt_and_survive_preemption(mode):
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8, preemption_mode=mode)
    sim = Sim(8, 2, 4, config)  # a 3-token prompt ends mid-block: each completion copies that block
    requests = [(i, 3, 6, 0, 3) for i in range(4)]
    run_to_completion(sim, requests, max_steps=300)
    assert sim.num_copies_on_write > 0 and sim.num_preemptions > 0


@st.composite
def workloads(draw):
    block_size = draw(st.integers(1, 4))
    num_blocks = draw(st.integers(2, 10))
    capacity = num_blocks * block_size
    requests = []
    for _ in range(draw(st.integers(1, 7))):
        # Requests that grow to most of the pool, so that they compete for it.
        prompt_len = draw(st.integers(1, min(10, capacity - 1)))
        longest = min(capacity, prompt_len + 10)
        max_total = draw(st.integers(max(prompt_len + 1, min(longest, capacity // 2)), longest))
        # n completions must fit the pool together, sharing the prompt's full blocks
        # (EngineCore.check_request).
        n = draw(st.sampled_from([1, 1, 2, 3]))
        shared = prompt_len // block_size
        if shared + n * (-(-max_total // block_size) - shared) > num_blocks:
            n = 1
        requests.append((draw(st.integers(0, 5)), prompt_len, max_total, draw(st.integers(0, 3)), n))
    config = draw(configs())
    # EngineCore.check_request rejects n > max_num_seqs: such a request could never run.
    requests = [(*r[:4], min(r[4], config.max_num_seqs)) for r in requests]
    return Sim(num_blocks, block_size, draw(st.integers(0, 10)), config), requests


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish(workload):
    sim, requests = workload
    # A generous bound: each request alone needs at most max_total steps; no livelock may take longer.
    run_to_completion(sim, requests, max_steps=50 + 4 * sum(r[2] * r[4] for r in requests))


def test_prompt_logprob_rows_per_step_are_bounded():
    """Each prompt token whose logprobs are asked for costs a [vocab] row of logits: a step
    computes at most PROMPT_LOGPROB_ROWS of them, however large the token budget."""
    from runtime.engine_config import PROMPT_LOGPROB_ROWS

    config = SchedulerConfig(max_num_batched_tokens=4096)
    sim = Sim(512, 16, 0, config)
    asking = [Sequence(i, list(range(700)), SamplingParams(prompt_logprobs=1), 800, arrival=i) for i in range(2)]
    plain = Sequence(2, list(range(700)), SamplingParams(), 800, arrival=2)
    p = plan(asking + [plain], [], [], sim.blocks, config, 0)
    assert [(c.seq.seq_id, c.num_tokens) for c in p.chunks] == [(0, PROMPT_LOGPROB_ROWS)]  # the second waits its turn
    for seq in asking:
        sim.add_waiting(seq)
    sim.add_waiting(plain)
    sim.step()
    # The first one's rest (188), then the second takes the rows left (324), then the plain one.
    rest = 700 - PROMPT_LOGPROB_ROWS
    p = sim.plan()
    assert [(c.seq.seq_id, c.num_tokens) for c in p.chunks] == [(0, rest), (1, PROMPT_LOGPROB_ROWS - rest), (2, 700)]
