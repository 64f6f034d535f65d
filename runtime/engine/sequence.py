"""Sequence: one request's tokens, cache progress, block tables, priority and lifecycle."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable

from nanoinfer.sampling.sampler import SamplingParams

if TYPE_CHECKING:  # (structured output is imported by the requests that use it)
    from nanoinfer.structured.grammars import Constraint


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, no KV blocks (new, or preempted by recompute)
    RUNNING = "running"  # holds device KV blocks; prefilling or decoding
    SWAPPED = "swapped"  # preempted by swap: its KV sits in host blocks
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Mutable state of one request, owned by the engine thread.

    `token_ids` is prompt + output so far, as known on the host; `num_unresolved` more tokens
    were sampled by steps still in flight (async scheduling), so the sequence is `num_tokens`
    long. The first `num_computed_tokens` have their keys and values in the cache, so the next
    step computes tokens num_computed_tokens.. (a whole prompt, a chunk of it, the one token
    sampled last step, or after a recompute preemption the prompt and the output again).
    """

    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # prompt + the most output this request may produce
    # The request this sequence is one completion of: an opaque key (AsyncEngine's handle);
    # the engine core finds a request's sequences by it.
    request: Hashable = None
    priority: int = 0  # lower runs sooner (under the priority policy)
    arrival: int = 0  # the engine step at which it was submitted
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_unresolved: int = 0  # sampled on the device, not yet read back (see runtime/executor/step.py)
    block_table: list[int] = field(default_factory=list)  # device blocks
    cpu_block_table: list[int] = field(default_factory=list)  # host blocks while SWAPPED
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: Exception | None = None  # why the engine failed it (finish_reason "error")
    num_preemptions: int = 0
    scheduled_at: float | None = None  # time.monotonic() when it first got a step (queue time ends)
    index: int = 0  # which of the request's n completions this is
    virtual_engine: int = 0  # its group of sequences, with two steps in flight (runtime/engine/virtual_engines.py)
    # Completions 1..n-1 of the request, waiting to fork off this one's prompt blocks when
    # its prefill ends: one prefill for all n.
    forks: list["Sequence"] = field(default_factory=list)
    prompt_logprobs: list | None = None  # collected over the prefill chunks, when asked for
    prompt_logprobs_done: bool = False  # the last prompt chunk asked for them has been launched
    # The prefix cache (runtime/engine/block_manager.py): keys of the leading full blocks (a function
    # of the tokens), how many of the table's blocks are registered, and the prompt tokens the
    # first admission found cached (the usage's cached_tokens).
    block_keys: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0
    # Speculative decoding (runtime/engine/speculative.py): draft tokens the next step may verify
    # after the pending one (set before each plan, for decoding sequences only), and how many
    # leading tokens the draft model's own KV pool holds.
    num_lookahead: int = 0
    num_draft_computed: int = 0
    # Structured output (nanoinfer/structured/grammars.py): the grammar state of the tokens resolved so far.
    constraint: "Constraint | None" = None

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_unresolved

    @property
    def num_pending_tokens(self) -> int:
        """Tokens the next step should compute for this sequence (draft tokens aside)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_wanted_tokens(self) -> int:
        """Tokens the next step would compute: the pending ones and the drafts to verify."""
        return self.num_tokens - self.num_computed_tokens + self.num_lookahead

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """Output tokens known on the host (`num_unresolved` more are on their way)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
