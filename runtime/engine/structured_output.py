"""Structured output in the engine: a request's grammar checked at submit, then fed each resolved token.

The grammars themselves (compiled by llguidance on their own thread) and the masks a step's
logits get are the executor's (nanoinfer/structured/grammars.py, runtime/executor/grammar_masks.py).
Here: each sequence's `constraint` is made when it is added, and once a step that a grammar
constrained is resolved, the grammars consume its tokens; a token a grammar refuses fails its
request. The engine core builds this on the first request that asks for structured output.
"""

from __future__ import annotations

from nanoinfer.errors import RequestError
from runtime.engine.faults import RequestFailed
from runtime.engine.sequence import Sequence
from runtime.executor.step import InFlightStep


class StructuredOutput:
    def __init__(self, grammars):
        """`grammars`: the executor's nanoinfer.structured.grammars.Grammars."""
        self.grammars = grammars

    def check(self, spec) -> None:
        self.grammars.check(spec)  # (compiled and cached; a bad one is named)

    def constrain(self, seqs: list[Sequence], spec) -> None:
        for seq in seqs:
            seq.constraint = self.grammars.constraint(spec)

    def consume_step(self, step: InFlightStep, tokens: list[int]) -> set[int]:
        """The grammars of the step's constrained rows consume their tokens (in parallel); the
        rows whose token their grammar refused."""
        rows = [i for i, row in enumerate(step.rows) if row.seq.constraint is not None and not row.seq.is_finished]
        ok = self.grammars.consume([(step.rows[i].seq.constraint, tokens[i]) for i in rows])
        return {i for i, accepted in zip(rows, ok) if not accepted}

    @staticmethod
    def off_grammar(seq: Sequence, token: int) -> Exception:
        constraint = seq.constraint
        if constraint.too_complex:  # the client's grammar, not our fault (a 400)
            return RequestError(f"the {constraint.spec.kind} is too complex to follow after {seq.num_output_tokens} "
                                f"output tokens ({constraint.error}): simplify it", param=constraint.spec.param)
        if constraint.failure is not None:  # its mask could not be filled (nanoinfer.structured.grammars.Grammars.fill_later)
            failure = constraint.failure
            return failure if isinstance(failure, (RequestError, RequestFailed)) else RequestFailed.because(
                "internal error while computing this request's grammar mask", failure)
        return RequestFailed(f"token {token} does not continue this request's {constraint.spec.kind} "
                             f"({constraint.error}): its grammar left nothing to sample (min_tokens, logit_bias "
                             f"or stop_token_ids against what the grammar requires?)")
