"""Resolver: a launched step's results applied to its sequences — tokens appended, stop and length checked.

The step's results come back as a StepTensors (runtime/executor/step.py), read by field. Rows
of sequences that finished meanwhile (an abort, or a stop token found in the step before) are
dropped: their one extra row of work is the price of overlap. A row that cannot be applied
fails its own request, no other. Verified drafts (runtime/engine/speculative.py) and grammars
(runtime/engine/structured_output.py) are applied by their features, when a step has them.
"""

from __future__ import annotations

from nanoinfer.sampling.sampler import Logprobs
from runtime.engine.outputs import TokenLogprob, TokenOutput
from runtime.engine.scheduler import Scheduler
from runtime.engine.sequence import Sequence, SequenceStatus
from runtime.executor.step import InFlightStep, PromptLogprobRows, StepTensors


def token_logprobs(lp: Logprobs, tokens: list[int], wanted) -> list[TokenLogprob | None]:
    """Per row, its token's logprob and its top `wanted[i]` alternatives (None where not asked)."""
    chosen, top_ids, top_values = (t.tolist() for t in lp)
    return [None if k is None else TokenLogprob(tokens[i], chosen[i], tuple(zip(top_ids[i][:k], top_values[i][:k])))
            for i, k in enumerate(wanted)]


class Resolver:
    def __init__(self, scheduler: Scheduler, eos_token_ids):
        self.scheduler = scheduler
        self.eos_token_ids = frozenset(eos_token_ids)
        self.generated_tokens = 0
        self.grammars = None  # structured output's consumer (runtime/engine/structured_output.py), once a request uses it
        self.speculator = None  # speculative decoding's (runtime/engine/speculative.py), when configured

    def resolve(self, step: InFlightStep) -> list[TokenOutput]:
        """Wait for a launched step's results and apply them."""
        try:
            host: StepTensors = step.transfer.wait()
        except Exception as exc:  # noqa: BLE001 - errors of the device surface here, asynchronously
            from runtime.engine.faults import fatal_or

            fatal_or(exc)
            if getattr(step.transfer, "failed", None) is exc:  # (a sampling queued after its step: PendingSampling)
                return self.sampling_failed(step, exc)
            raise
        tokens, finite = host.tokens.tolist(), host.finite.tolist()
        logprobs = [None] * len(tokens) if host.logprobs is None else token_logprobs(
            host.logprobs, tokens, [r.logprobs for r in step.rows])
        outputs, prompt_done = [], {}
        for entry, lp in zip(step.prompt_logprobs, host.prompt_logprobs):
            try:
                done = self._prompt_logprobs(entry, lp)
            except Exception as exc:  # noqa: BLE001 - this request's bookkeeping: it fails alone
                from runtime.engine.faults import RequestFailed

                outputs += self.scheduler.fail(entry.seq, RequestFailed.because(
                    "internal error while running this request", exc))
                continue
            if done is not None:
                prompt_done[entry.seq.seq_id] = done
        rejected = self.grammars.consume_step(step, tokens) if step.constrained else ()
        finished, take = SequenceStatus.FINISHED, self.take
        for i, (row, token, ok) in enumerate(zip(step.rows, tokens, finite)):  # (every sequence, every step)
            seq = row.seq
            if seq.status is finished:
                continue
            seq.num_unresolved -= 1
            if not ok or i in rejected:
                outputs += self.fail_row(seq, token, ok)
                continue
            outputs.append(take(seq, token, logprobs[i], prompt_done.get(seq.seq_id)))
        if step.verified:
            outputs += self.speculator.apply_verified(step.verified, host.verified, self)
        return outputs

    def sampling_failed(self, step: InFlightStep, exc: Exception) -> list[TokenOutput]:
        """A step whose sampling could not be queued after it (runtime/executor/step.py's
        PendingSampling): its sequences fail, the engine goes on."""
        from runtime.engine.faults import RequestFailed

        outputs = []
        for row in step.rows:
            if not row.seq.is_finished:
                outputs += self.scheduler.fail(row.seq, RequestFailed.because(
                    "internal error while sampling this request's token", exc))
        return outputs

    def take(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None,
             prompt_logprobs: tuple | None = None) -> TokenOutput:
        """A resolved token joins its sequence; a stop token or the length limit finishes it."""
        ids, params = seq.token_ids, seq.params
        ids.append(token)
        self.generated_tokens += 1
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            reason = "stop"
        elif seq.constraint is not None and seq.constraint.finished:  # (only the end may follow: it is here)
            reason = "stop"
        elif len(ids) >= seq.max_total_tokens:
            reason = "length"
        else:
            return TokenOutput(seq, token, False, logprob, prompt_logprobs)
        self.scheduler.finish(seq, reason)
        return TokenOutput(seq, token, True, logprob, prompt_logprobs)

    def fail_row(self, seq: Sequence, token: int, finite: bool) -> list[TokenOutput]:
        """A row whose logits were not finite, or whose token its grammar refused, fails its request."""
        from runtime.engine.faults import non_finite

        return self.scheduler.fail(seq, non_finite() if not finite else self.grammars.off_grammar(seq, token))

    @staticmethod
    def _prompt_logprobs(entry: PromptLogprobRows, lp: Logprobs) -> tuple | None:
        """Add a chunk's prompt logprobs to its sequence's list; the whole list once complete
        (None first: the first token has no context)."""
        seq = entry.seq
        if seq.is_finished:
            return None
        if entry.start == 0:  # (again, after a recompute preemption mid-prompt)
            seq.prompt_logprobs = [None]
        chosen, top_ids, top_values = (t.tolist() for t in lp)
        for t, v, ids, vals in zip(entry.targets, chosen, top_ids, top_values):
            seq.prompt_logprobs.append(TokenLogprob(t, v, tuple(zip(ids, vals))))
        return tuple(seq.prompt_logprobs) if entry.final else None
