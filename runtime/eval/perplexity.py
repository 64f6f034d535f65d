"""Perplexity and bits per byte of a text under a model, over a sliding window of its tokens.

Windows of `context` tokens start every `stride` tokens, as in transformers' guide to the
perplexity of fixed-length models: a window scores the tokens past the previous window's end,
each predicted from the window's tokens before it (a window's first token is never scored:
it has no context there). Every window is one request for its prompt logprobs, and they all
go to the engine at once, so the windows share batches.

perplexity = exp(NLL / tokens scored); bits per byte = NLL / ln 2 / the text's UTF-8 bytes.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

from nanoinfer.errors import RequestError
from nanoinfer.sampling.sampler import SamplingParams


class Perplexity(NamedTuple):
    perplexity: float
    bits_per_byte: float | None  # None when the text's bytes are not known (token ids given)
    tokens: int  # tokens scored
    nll: float  # their summed negative log-likelihood, in nats


def windows(num_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored) of each window over `num_tokens` tokens."""
    if context < 2:
        raise RequestError(f"context={context} is too short: expected at least 2 tokens", param="context")
    if not 1 <= stride <= context:
        raise RequestError(f"stride={stride} is invalid: expected 1 to context ({context})", param="stride")
    if num_tokens < 2:
        raise RequestError(f"the text is {num_tokens} token(s) long: expected at least 2 to score",
                           param="text")
    out, begin, scored_to = [], 0, 0
    while True:
        end = min(begin + context, num_tokens)
        out.append((begin, end, max(scored_to, begin + 1)))
        scored_to = end
        if end == num_tokens:
            return out
        begin += stride


def perplexity(llm, token_ids: Sequence[int], *, context: int, stride: int, num_bytes: int | None = None,
               use_tqdm: bool = False) -> Perplexity:
    """The perplexity of `token_ids` under `llm`'s model (an LLM facade)."""
    spans = windows(len(token_ids), context, stride)
    outs = llm.generate([list(token_ids[b:e]) for b, e, _ in spans],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=use_tqdm)
    nll, count = 0.0, 0
    for (begin, end, first), out in zip(spans, outs):
        nll -= sum(out.prompt_logprobs[p - begin].logprob for p in range(first, end))
        count += end - first
    bits = None if num_bytes is None else nll / math.log(2) / num_bytes
    return Perplexity(math.exp(nll / count), bits, count, nll)
