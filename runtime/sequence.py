"""Sequence: one request's tokens, cache progress, block table and lifecycle."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from nanoinfer.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # admitted to the engine, no KV blocks yet
    RUNNING = "running"  # holds KV blocks; prefilling or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Mutable state of one request, owned by the engine thread.

    `token_ids` is prompt + output so far; the first `num_computed_tokens` of them have their
    keys and values in the cache, so the next step computes token_ids[num_computed_tokens:]
    (a whole prompt, a chunk of it, or the one token sampled last step).
    """

    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # prompt + the most output this request may produce
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
