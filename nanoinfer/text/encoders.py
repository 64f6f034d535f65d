"""Tokenizer backends: the encoder interface Tokenizer (nanoinfer/text/tokenizer.py) runs over, and the one over
the tokenizers library."""

from __future__ import annotations

import functools
from typing import Protocol, Sequence

import tokenizers
from tokenizers.decoders import DecodeStream


class TokenizerBackend(Protocol):
    """What Tokenizer needs from an encoder: TokenizersBackend here, sentencepiece's and
    tiktoken's (nanoinfer/text/tokenizer_hf.py, nanoinfer/text/nanochat_tokenizer.py)."""

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str: ...
    def token_to_id(self, token: str) -> int | None: ...
    def vocab_size(self) -> int: ...


class TokenizersBackend:
    """A TokenizerBackend over a `tokenizers.Tokenizer` (whose added vocab and post-processor
    hold the added tokens and BOS/EOS)."""

    def __init__(self, backend: tokenizers.Tokenizer):
        self.backend = backend

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch, not encode: only it lets go of the GIL while it works, so a long prompt
        # tokenized on a server's thread (~0.2 s for 120k tokens) does not stall its event loop.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, context: Sequence[int], skip_special_tokens: bool):
        """tokenizers' DecodeStream primed with `context`, as a function of one token id (see Tokenizer's); None
        where the context does not end on a whole character (the stream would hold its bytes and put them, as
        replacement characters, before the next token's text, where a window decode drops them)."""
        stream, backend = DecodeStream(skip_special_tokens=skip_special_tokens), self.backend
        text = ""
        for token in context:
            text = stream.step(backend, token)
        if context and not text:
            return None
        return functools.partial(stream.step, backend)  # (no Python frame of ours a token)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)
