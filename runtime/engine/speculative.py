"""Speculative decoding in the engine: how many drafts each sequence gets, and the policy that decides when to draft.

Each step, before the plan, every decoding sequence is given up to `num_speculative_tokens`
draft tokens to verify after its pending one (fewer near its length limit). N-gram lookup
proposes them on the host right away; a draft model proposes them on the device once the plan
has given the sequence its slots (runtime/executor/draft_runner.py). The target then computes the
pending token and the drafts in one forward, and verification (nanoinfer/sampling/rejection.py)
keeps the leading drafts it accepts plus one token of its own.

A step that verifies drafts needs every sequence's tokens on the host (the proposals and
their count depend on them): the step before it is resolved first, and it is resolved at
once. Steps without drafts keep async scheduling's overlap. Speculation runs only while it
pays (`SpeculationPolicy`): a draft the target keeps rejecting switches it off.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque

import numpy as np

from nanoinfer.sampling.ngram import propose_ngram
from runtime.engine_config import SpeculativeConfig
from runtime.engine.sequence import Sequence
from runtime.executor.step import InFlightStep, VerifiedRows, VerifiedTensors


class SpeculationPolicy:
    """Whether the next step speculates: only while it pays. It compares the tokens per second
    that decode steps emitted with speculation and without (the median of each kind's last
    `window` measured steps: one step slowed by something else does not flip it), takes the
    faster, and every `explore_every`-th step tries the other, so that a change (a draft that
    starts or stops agreeing with the target, a batch that grows) is seen. A draft the target
    keeps rejecting thus costs one step in `explore_every`, not every step."""

    def __init__(self, adaptive: bool = True, explore_every: int = 16, window: int = 8):
        self.adaptive, self.explore_every = adaptive, explore_every
        self.samples: dict[bool, deque] = {True: deque(maxlen=window), False: deque(maxlen=window)}
        self.steps = self.explored = 0  # steps chosen for; the last one that tried the slower kind

    def rate(self, speculated: bool) -> float | None:
        """Tokens per second of the recent steps of a kind (None before the first)."""
        samples = self.samples[speculated]
        return statistics.median(samples) if samples else None

    def choose(self) -> bool:
        self.steps += 1
        if not self.adaptive:
            return True
        fast, slow = self.rate(True), self.rate(False)
        if fast is None or slow is None:  # measure both first
            return fast is None
        best = fast >= slow
        # The further behind the other kind is, the more rarely it is tried: what a try costs
        # stays near one step's worth in `explore_every`.
        behind = max(fast, slow) / max(min(fast, slow), 1e-9)
        if self.steps - self.explored >= self.explore_every * math.ceil(behind):
            self.explored = self.steps
            return not best
        return best

    def record(self, speculated: bool, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.samples[speculated].append(tokens / seconds)


class Speculator:
    """Decides each step's lookahead and, for n-gram lookup, the drafts themselves; applies the
    verified drafts; times the steps for the policy. The engine core calls it at three points
    of a step: `begin_step`, `end_step`, and (through the Resolver) `apply_verified`."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.policy = SpeculationPolicy(config.adaptive)
        self.num_proposed = self.num_accepted = 0  # draft tokens verified, and accepted (stats)
        self._timed: tuple | None = None  # (speculated, tokens, start, end) of the step before, for the policy
        # n-gram lookup: each running sequence's tokens as an array, grown as they are (a
        # conversion of the whole list every step would cost batch x context).
        self._arrays: dict[Sequence, np.ndarray] = {}

    def _tokens(self, seq: Sequence) -> np.ndarray:
        ids, array = seq.token_ids, self._arrays.get(seq)
        if array is None or len(array) > len(ids):  # (new, or its tokens were replaced)
            array = np.fromiter(ids, np.int64, len(ids))
        elif len(array) < len(ids):
            array = np.concatenate([array, np.array(ids[len(array):], dtype=np.int64)])
        self._arrays[seq] = array
        return array

    def lookahead(self, running: list[Sequence]) -> dict[Sequence, list[int]]:
        """Set `num_lookahead` on the running sequences that decode next step; returns those
        sequences with their n-gram drafts (empty lists for a draft model: it proposes later)."""
        c, drafts = self.config, {}
        if c.method == "ngram" and len(self._arrays) > len(running):  # forget the sequences that left
            self._arrays = {seq: self._arrays[seq] for seq in running if seq in self._arrays}
        for seq in running:
            if seq.num_pending_tokens != 1 or seq.forks:
                continue
            # Drafts and the token after them must fit the sequence's length limit.
            k = min(c.num_speculative_tokens, seq.max_total_tokens - seq.num_tokens - 1)
            if k <= 0:
                continue
            if c.method == "ngram":
                ids = propose_ngram(self._tokens(seq), k, c.prompt_lookup_max, c.prompt_lookup_min)
            else:
                ids = []
            seq.num_lookahead = len(ids) if c.method == "ngram" else k
            if seq.num_lookahead:
                drafts[seq] = ids
        return drafts

    # -- a step ----------------------------------------------------------------------------------

    def begin_step(self, running: list[Sequence], previous: InFlightStep | None, resolver, start: float):
        """Before the plan: whether this step speculates, and if so each decoding sequence's
        lookahead. Drafts come from the tokens so far, all on the host: the step before is
        resolved first. Returns (its outputs, the step still in flight, the step's start, the
        drafts by sequence)."""
        speculate = self.policy.choose()
        outputs = []
        if speculate and previous is not None:
            outputs, previous = resolver.resolve(previous), None
            start = time.perf_counter()  # (the step before ends here, not when this one began)
        self._note_step_time(start)
        return outputs, previous, start, (self.lookahead(running) if speculate else {})

    @staticmethod
    def forget(drafts: dict[Sequence, list[int]]) -> None:
        for seq in drafts:  # (a lookahead holds for the step it was planned for only)
            seq.num_lookahead = 0

    def end_step(self, chunks, step: InFlightStep | None, tokens: int, start: float) -> None:
        """After the step: remember how fast it emitted `tokens`, if it only decoded (a prefill
        chunk's time says nothing about decoding)."""
        decode_only = bool(chunks) and all(c.num_tokens == 1 or c.seq.num_pending_tokens == 1 for c in chunks)
        if decode_only and step is not None:
            self._timed = (bool(step.verified), tokens, start, time.perf_counter())

    def _note_step_time(self, now: float) -> None:
        """Tell the policy how fast the step before emitted tokens: from its start to this
        one's (async, a step's call waits for the step before it). Not when something else
        came between its call and this one (an idle engine, a slow consumer)."""
        if self._timed is not None:
            speculated, tokens, began, ended = self._timed
            if now - ended <= ended - began:
                self.policy.record(speculated, tokens, now - began)
            self._timed = None

    def apply_verified(self, verified: tuple[VerifiedRows, ...], host: VerifiedTensors, resolver) -> list:
        """Apply a step's verifications: each sequence takes its accepted drafts and the token
        after them, one by one as a sampled token is taken (a stop or the length limit ends it
        there); the KV slots of its rejected drafts are given back."""
        from runtime.engine.resolve import token_logprobs

        scheduler = resolver.scheduler
        accepted, tokens, finite = host.accepted.tolist(), host.tokens.tolist(), host.finite.tolist()
        logprobs = [None] * len(tokens) if host.logprobs is None else token_logprobs(
            host.logprobs, tokens, [v.logprobs for v in verified for _ in range(v.num_drafts + 1)])
        outputs, first = [], 0
        for seq, _, j, _ in verified:
            row = first
            first += j + 1
            if seq.is_finished:
                continue
            if not all(finite[row:row + j + 1]):
                outputs += resolver.fail_row(seq, tokens[row], False)
                continue
            a = 0
            while a < j and accepted[row + a]:
                a += 1
            self.num_proposed += j
            self.num_accepted += a
            seq.num_computed_tokens -= j - a  # the rejected drafts' keys and values are garbage
            seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)
            emitted = tokens[row:row + a + 1]  # (an accepted row's token is its draft)
            scheduler.executor.emitted(seq, emitted)
            for i, token in enumerate(emitted):
                if seq.constraint is not None and not seq.constraint.consume(token):
                    outputs += resolver.fail_row(seq, token, True)
                    break
                outputs.append(resolver.take(seq, token, logprobs[row + i]))
                if seq.is_finished:  # (a stop token or the length limit among the drafts)
                    break
            if not seq.is_finished:
                blocks = scheduler.blocks
                blocks.trim(seq, seq.num_computed_tokens)
                if seq.num_computed_tokens // blocks.block_size > seq.num_registered_blocks:
                    blocks.cache.register(seq)
        return outputs
