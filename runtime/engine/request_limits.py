"""RequestLimits: what one engine can serve (vocabulary, context, pool, batch), and the check of a request against it.

The engine core checks every request here before queueing it; a data-parallel front checks here too, with its
replicas' limits, so that a request no replica could serve is a RequestError (a 400) where it is submitted,
not a failure in a replica's process (runtime/engine_process/data_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from nanoinfer.errors import RequestError
from nanoinfer.sampling.sampler import SamplingParams


def all_ints(items) -> bool:
    """Whether every item is an int (not a bool): a prompt of token ids. (Their types gathered in C: a server
    checks thousands of ids a request, and a Python loop over them was a visible share of its admission.)"""
    return set(map(type, items)) <= {int}


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    block_size: int
    num_blocks: int  # the KV pool's (on the device)
    context_length: int | None = None  # the model's (or max_model_len's) where the pool holds fewer tokens

    def check(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as a list, or RequestError naming what makes it impossible to serve (the
        grammar aside: the engine compiles it)."""
        vocab, limit = self.vocab_size, self.max_model_len
        ids = list(prompt_token_ids)
        bad_bias = [t for t, _ in params.logit_bias if t >= vocab] + [t for t in params.stop_token_ids if t >= vocab]
        if bad_bias:
            raise RequestError(f"token id {bad_bias[0]} in logit_bias/stop_token_ids is out of range: expected "
                               f"0 <= id < {vocab}", param="logit_bias")
        if not ids:
            raise RequestError("the prompt is empty: expected at least one token", param="prompt")
        if not (all_ints(ids) and 0 <= min(ids) and max(ids) < vocab):
            bad = [t for t in ids if type(t) is not int or not 0 <= t < vocab]  # (as all_ints: no bool)
            raise RequestError(f"prompt token id {bad[0]!r} is out of range: expected 0 <= id < {vocab}",
                               param="prompt")
        if len(ids) >= limit:
            raise RequestError(f"the prompt has {len(ids)} tokens: expected fewer than max_model_len={limit}"
                               f"{self._pool_bound()}", param="prompt")
        if params.max_tokens is not None and len(ids) + params.max_tokens > limit and self.context_length:
            raise RequestError(f"the request needs {len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, "
                               f"{params.max_tokens} in the completion){self._pool_bound()}", param="max_tokens")
        if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
            # As vLLM (and OpenAI) answer: never cut the completion short without saying so.
            raise RequestError(
                f"this model's maximum context length is {limit} tokens; you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, {params.max_tokens} in the "
                f"completion): reduce the prompt or max_tokens", param="max_tokens")
        if params.n > self.max_num_seqs:
            raise RequestError(f"n={params.n} is more than this engine runs at once: expected n <= max_num_seqs="
                               f"{self.max_num_seqs}", param="n")
        prompt_blocks = len(ids) // self.block_size  # full blocks the n completions share
        need = prompt_blocks + params.n * (-(-self.max_total(ids, params) // self.block_size) - prompt_blocks)
        if need > self.num_blocks:
            raise RequestError(
                f"the request needs up to {need * self.block_size} tokens of KV cache "
                f"(n={params.n}, {self.max_total(ids, params)} each) but the pool holds "
                f"{self.num_blocks * self.block_size}: lower max_tokens or raise num_blocks", param="max_tokens")
        return ids

    def _pool_bound(self) -> str:
        """Why the limit is lower than the model's context, if it is."""
        if not self.context_length:
            return ""
        return (f", but the KV cache holds {self.max_model_len} tokens, less than the model's context of "
                f"{self.context_length}: lower max_tokens or raise num_blocks / kv_cache_memory")

    def max_total(self, ids: Sequence[int], params: SamplingParams) -> int:
        """The most tokens (prompt and output) one of the request's completions may hold."""
        if params.max_tokens is None:  # as much as fits: the context, and the pool
            return min(self.max_model_len, self.num_blocks * self.block_size)
        return len(ids) + params.max_tokens
