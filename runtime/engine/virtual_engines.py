"""Virtual engines: the running sequences in two groups whose steps alternate, so two steps of disjoint sequences are in flight.

Pipeline parallelism (runtime/executor/pipeline_parallel.py) keeps its stages busy only if
stage 0 can compute step N+1 while the last stage computes step N: step N+1 must not need
step N's tokens. So each sequence belongs to one of two groups for its whole life (the one
with fewer unfinished sequences when it arrives; a request's n completions together), and a
step plans one group: the one the step launched last did not. If that group has nothing to
run, the step plans the other (`serial`): the engine then reads the older steps first and
runs this one as with one step in flight. A sequence thus never has two unresolved steps
between engine steps. A waiting or swapped sequence whose last step is unread stays out until
it is read (its next prefill needs that token on the host).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from runtime.engine.sequence import Sequence

if TYPE_CHECKING:
    from runtime.engine.policy import Plan


class GroupPlanner(Protocol):
    """What plans one group's step (the Scheduler)."""

    def plan(self, now: int, group: int | None = None) -> Plan: ...


class VirtualEngines:
    def __init__(self, count: int = 2):
        self.load = [0] * count  # unfinished sequences per group
        self.planned = 0  # the group of the plan made last
        self.last: int | None = None  # the group of the step launched last (None: none yet)
        self.serial = False  # the plan made last is of the same group as the step launched last

    def assign(self, seqs: list[Sequence]) -> None:
        """A request's sequences join the group with fewer unfinished ones."""
        group = self.load.index(min(self.load))
        for seq in seqs:
            seq.virtual_engine = group
        self.load[group] += len(seqs)

    def finished(self, seq: Sequence) -> None:
        self.load[seq.virtual_engine] -= 1

    def plan(self, scheduler: GroupPlanner, now: int) -> Plan:
        """The plan of the group whose turn it is; of the other one if that has nothing to compute."""
        count = len(self.load)
        turn = 0 if self.last is None else (self.last + 1) % count
        first = None
        for group in [(turn + k) % count for k in range(count)]:
            p = scheduler.plan(now, group)
            if first is None:
                first = p
            if p.chunks:
                self.planned, self.serial = group, group == self.last
                return p
        self.planned, self.serial = turn, False
        return first

    def launched(self) -> None:
        """The plan made last was launched (Scheduler.commit)."""
        self.last = self.planned
