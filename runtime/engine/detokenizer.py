"""Incremental detokenization with stop strings: text deltas that never split a character.

Decoding each new token alone breaks byte-level BPE (one character can span tokens) and
SentencePiece's leading spaces; decoding everything each step is quadratic. We keep a small
window: decode the tokens since `prefix_offset`, and emit what extends past the text the
window already produced, holding back while it ends in a replacement character (an
incomplete UTF-8 sequence that the next token may finish).

Where the vocabulary is a `tokenizers` one, its DecodeStream does the same in one Rust call a
token (two `decode` calls here: ~7 µs a token against ~1.5 on a 2-core Xeon, a server front's
largest per-token cost after its writes: bench/RESULTS.md, issue 60); the window is the
reference (tests hold the two to the same text) and serves the other vocabularies, and the
end's flush of bytes that never made a character.
"""

from __future__ import annotations

from typing import Sequence

from nanoinfer.text.tokenizer import Tokenizer

# Tokens of context decoded before the new ones, so merges and leading spaces render right.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], *, skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.include_stop = include_stop_str_in_output
        # While streaming, hold back text that could still turn out to begin a stop string.
        self._holdback = 0 if include_stop_str_in_output else max((len(s) for s in self.stop), default=1) - 1
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        # The text made and not handed out yet (truncated at a stop string). Neither the text handed out nor the
        # whole is kept: appending to a string that only grows copies it at every token (bench/front_tokens.py).
        self.unsent = ""
        self._longest_stop = max((len(s) for s in self.stop), default=0)
        self._recent = ""  # the text's last characters a stop string may begin in, before the newest piece
        self.stopped = False
        # One token's new text, from a stream decoder primed with the same context; None: the window decodes.
        self._step = tokenizer.decode_stream(self.ids, skip_special_tokens)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> int:
        """Feed new output tokens; sets `stopped` once a stop string appears. Returns how many
        were taken: all, or those up to the one that completed the stop string."""
        for taken, token in enumerate(token_ids):
            if self.stopped:
                return taken
            self.ids.append(token)
            if self._step is not None:
                new = self._step(token)
            else:
                prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
                full = self._decode(self.ids[self.prefix_offset:])
                new = full[len(prefix):] if len(full) > len(prefix) and not full.endswith("\ufffd") else None
            if new:
                self.unsent += new
                # (the window moves on: the ids before it are never decoded again, so they go)
                del self.ids[:self.read_offset]
                self.prefix_offset, self.read_offset = 0, len(self.ids)
                if self.stop:
                    self._check_stop(new)
        return len(token_ids)

    def _check_stop(self, new: str) -> None:
        """Whether a stop string ends in `new` (the newest piece of text, already in `unsent`); if so, the text is
        cut at the first one. A match is searched from the last `longest stop - 1` characters before `new` on:
        one wholly before it was looked for when its own piece came."""
        window = self._recent + new
        hits = [(idx, s) for s in self.stop if (idx := window.find(s)) >= 0]
        if not hits:
            self._recent = window[max(0, len(window) - self._longest_stop + 1):]
            return
        idx, s = min(hits)
        cut = idx + len(s) if self.include_stop else idx
        # (the cut falls inside `unsent`: a match ends in `new`, and where the stop string is left out of the
        # output `unsent` holds at least the hold-back, a stop string's length less one, of what came before `new`;
        # text handed out is never taken back)
        self.unsent = self.unsent[:max(0, len(self.unsent) - len(window) + cut)]
        self.stopped = True

    def take_delta(self, final: bool = False) -> str:
        """Text not yet handed out; while running, minus what may still become a stop string.
        `final` also flushes tokens held back as an incomplete character."""
        if final and not self.stopped and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            self.unsent += self._decode(self.ids[self.prefix_offset:])[len(prefix):]
            self.read_offset = len(self.ids)
        upto = len(self.unsent) if (final or self.stopped) else len(self.unsent) - self._holdback
        if upto <= 0:
            return ""
        delta, self.unsent = self.unsent[:upto], self.unsent[upto:]
        return delta
