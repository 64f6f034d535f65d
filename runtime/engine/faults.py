"""Containing a failed step: what kind of failure it is, and which request it belongs to.

A step runs many requests' work at once, so an exception in it names no culprit. Rather than
fail them all, the step loop narrows it down: the failed step's sequences are split in two and
each half runs alone; a half that fails again is split again, a half that passes goes on as
usual. A failure that follows one sequence down to a step of its own, twice, belongs to that
request, which fails alone; a failure that does not come back was transient, and nobody fails.

Running out of memory is a failure of size rather than of a request, so it also halves the
step's token budget (a long prompt then prefills in smaller chunks); a single sequence that
cannot run even at the smallest chunk fails with an error that says so. Only an error that
leaves the device unusable (an illegal memory access, a lost device) is fatal: the engine
is then unhealthy and a supervisor should restart the process.

Nothing here runs until something fails: the scheduler and the engine core import this module
in their `except` clauses, and a step with no failure behind it pays nothing for it.
"""

from __future__ import annotations

import enum
import dataclasses
import logging
from collections import deque
from typing import NamedTuple, Sequence as Seq

import torch

from nanoinfer.errors import DeviceLost, RequestError
from runtime.engine.policy import Plan
from runtime.engine.sequence import Sequence

log = logging.getLogger("nanoinfer.engine")

MIN_CHUNK = 16  # the smallest prefill chunk tried before a request is declared too big to run
RELAX_AFTER = 8  # successful steps before a halved token budget is doubled again


class Fault(enum.Enum):
    FATAL = "fatal"  # the device is unusable: nothing on it can be trusted any more
    OUT_OF_MEMORY = "out_of_memory"
    ERROR = "error"  # anything else: a bug, or bad data one request brought


class EngineDead(RuntimeError):
    """The device failed in a way nothing on it survives: every request fails, the engine stops."""


def classify(exc: BaseException) -> Fault:
    if isinstance(exc, DeviceLost):
        return Fault.FATAL
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return Fault.OUT_OF_MEMORY
    message = str(exc)
    if isinstance(exc, RuntimeError) and ("can't allocate memory" in message or "out of memory" in message):
        return Fault.OUT_OF_MEMORY  # the CPU allocator's wording
    accelerator_error = getattr(torch, "AcceleratorError", ())
    if isinstance(exc, accelerator_error) or (isinstance(exc, RuntimeError) and "CUDA error" in message):
        return Fault.FATAL  # CUDA errors are sticky: every later call on the context fails too
    return Fault.ERROR


class RequestFailed(Exception):
    """Why one request was failed by the engine while others went on (`__cause__`: the error)."""

    @classmethod
    def because(cls, what: str, exc: BaseException) -> "RequestFailed":
        failure = cls(f"{what}: {exc!r}")
        failure.__cause__ = exc
        return failure


class Suspects(NamedTuple):
    seqs: list[Sequence]
    strikes: int  # times this very group failed alone: a lone sequence is blamed at the second


class Isolation:
    """The search for the request a failure belongs to (see the module docstring).

    `groups` are sets of sequences still to be tried in steps of their own, the first one
    next; while any is left, a step runs only (the still-running members of) that group and
    admits nothing new. `token_cap` bounds the tokens of a step after running out of memory.
    """

    def __init__(self, max_num_batched_tokens: int):
        self.max_tokens = max_num_batched_tokens
        self.groups: deque[Suspects] = deque()
        self.token_cap: int | None = None
        self._successes = 0

    @property
    def active(self) -> bool:
        return bool(self.groups)

    @property
    def done(self) -> bool:
        """Nothing left to narrow down, the token budget whole again: steps run as usual."""
        return not self.groups and self.token_cap is None

    def narrow(self, config, running: list[Sequence], num_idle: int) -> tuple:
        """The scheduler's config, running sequences and idle count for the next step's plan,
        and whether only those may run (nothing new starts while a culprit is sought)."""
        if self.token_cap is not None:
            config = dataclasses.replace(config, max_num_batched_tokens=self.token_cap)
        if not self.groups:
            return config, running, num_idle, False
        allowed = self.restrict(running)
        return config, allowed, num_idle + len(running) - len(allowed), True

    def restrict(self, running: Seq[Sequence]) -> list[Sequence]:
        """The running sequences the next step may schedule."""
        while self.groups:
            group = {id(s) for s in self.groups[0].seqs}
            allowed = [s for s in running if id(s) in group]
            if allowed:
                return allowed
            self.groups.popleft()  # its members finished or were preempted meanwhile
        return list(running)

    def step_budget(self) -> int:
        return self.max_tokens if self.token_cap is None else self.token_cap

    def succeeded(self) -> None:
        # The group is cleared even if the budget let only some of it run: should the culprit
        # be among the rest, it fails again in a later step and a new search starts there.
        if self.groups:
            self.groups.popleft()
        self._successes += 1
        if self.token_cap is not None and self._successes >= RELAX_AFTER:
            self.token_cap = None if 2 * self.token_cap >= self.max_tokens else 2 * self.token_cap
            self._successes = 0

    def failed(self, seqs: Seq[Sequence], num_tokens: int, exc: BaseException,
               kind: Fault) -> tuple[Sequence, Exception] | None:
        """Record a failed step over `seqs`: the sequence whose request must fail now, with the
        error to report, or None while the search goes on."""
        self._successes = 0
        strikes = 0
        if self.groups and {id(s) for s in seqs} <= {id(s) for s in self.groups[0].seqs}:
            strikes = self.groups.popleft().strikes  # this group failed: its halves replace it
        if kind is Fault.OUT_OF_MEMORY and num_tokens > MIN_CHUNK:
            self.token_cap = max(min(MIN_CHUNK, self.max_tokens), min(num_tokens, self.step_budget()) // 2)
        elif len(seqs) == 1 and strikes >= 1:
            seq = seqs[0]
            if kind is Fault.OUT_OF_MEMORY:
                return seq, RequestError(
                    f"out of memory running this request (a step of {num_tokens} tokens at context "
                    f"{seq.num_computed_tokens + num_tokens}): it cannot run on this server; use a shorter "
                    f"prompt or fewer tokens", param="prompt")
            return seq, RequestFailed.because("internal error while running this request", exc)
        if len(seqs) == 1:
            # Alone again (in smaller chunks after an OOM): a second failure here is its own.
            self.groups.appendleft(Suspects(list(seqs), strikes + (kind is not Fault.OUT_OF_MEMORY
                                                                   or num_tokens <= MIN_CHUNK)))
            return None
        half = len(seqs) // 2
        self.groups.appendleft(Suspects(list(seqs[half:]), 0))
        self.groups.appendleft(Suspects(list(seqs[:half]), 0))
        return None


def fatal_or(exc: BaseException) -> Fault:
    """The kind of failure `exc` is; EngineDead (from it) if the device cannot go on."""
    kind = classify(exc)
    if kind is Fault.FATAL:
        raise EngineDead(f"the device failed: {exc!r}") from exc
    return kind


def prepare_failed(seq: Sequence, exc: Exception) -> RequestFailed:
    """Applying a plan failed at `seq` (a copy of its blocks): its request's error."""
    fatal_or(exc)
    log.warning("preparing a step failed at sequence %d (%r): failing its request", seq.seq_id, exc)
    return RequestFailed.because("internal error while preparing this request's step", exc)


def launch_failed(scheduler, p: Plan, exc: Exception, previous, device: torch.device) -> list:
    """Contain a failed launch: nothing of it was committed, so its sequences simply run
    again, narrowed down (the scheduler's `isolation`) until the failure is placed; the
    outputs of a request found to be the culprit. `previous`: the step in flight before it."""
    kind = fatal_or(exc)
    if previous is not None:
        previous.transfer.wait()  # (its tokens are still read: it ran before the failure)
    if kind is Fault.OUT_OF_MEMORY and device.type == "cuda":
        torch.cuda.empty_cache()  # the allocator's cached, fragmented blocks go first
    # (a sequence that the step before finished, read during the launch, is no suspect)
    seqs = [c.seq for c in p.chunks if not c.seq.is_finished]
    if not seqs:
        return []
    if scheduler.isolation is None:
        scheduler.isolation = Isolation(scheduler.config.max_num_batched_tokens)
    culprit = scheduler.isolation.failed(seqs, p.num_tokens, exc, kind)
    log.warning("a step of %d tokens over %d sequences failed (%r): %s", p.num_tokens, len(seqs), exc,
                "failing the request it belongs to" if culprit else
                f"retrying its sequences in smaller steps (token budget {scheduler.isolation.step_budget()})")
    return [] if culprit is None else scheduler.fail(*culprit)


def non_finite() -> RequestFailed:
    return RequestFailed("the model produced non-finite logits (NaN or inf) for this request: its output would "
                         "be garbage, so it was stopped")
