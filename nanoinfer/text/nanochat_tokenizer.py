"""nanochat's tokenizer: its pickled tiktoken encoding, read without running the pickle, and
its conversation format as a chat template.

nanochat (karpathy/nanochat, tokenizer.py) saves `pickle.dump(tiktoken.Encoding(...))` as
`tokenizer/tokenizer.pkl`. Unpickling an arbitrary file runs whatever its globals name, so
ours admits only what that pickle holds: the class `tiktoken.core.Encoding` (taken as a
stand-in that keeps its state: a dict of `name`, `pat_str`, `mergeable_ranks` {bytes: int},
`special_tokens` {str: int}) and, for protocol 2, `_codecs.encode` (how it writes bytes).
Anything else is a CheckpointError naming the global; the state's types are checked before
tiktoken builds the encoding from it.

Conversations render as nanochat's `render_conversation` / `render_for_completion` do:
<|bos|>, then <|user_start|>…<|user_end|> and <|assistant_start|>…<|assistant_end|> turns, a
system message merged into the first user message ("system\\n\\nuser"), and a generation
prompt of <|assistant_start|>. A reply ends at <|assistant_end|> (or <|bos|>, as nanochat's
engine stops).
"""

from __future__ import annotations

import codecs
import pickle
from pathlib import Path
from typing import Sequence

from nanoinfer.errors import CheckpointError

SPECIAL_TOKENS = ("<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
                  "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>")

CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "<|bos|>"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = message['content'] + '\\n\\n' -%}"
    "{%- elif message['role'] == 'user' -%}"
    "<|user_start|>{{ ns.system + message['content'] }}<|user_end|>{%- set ns.system = '' -%}"
    "{%- elif message['role'] == 'assistant' -%}<|assistant_start|>{{ message['content'] }}<|assistant_end|>"
    "{%- else -%}{{ raise_exception('nanochat renders system, user and assistant messages, not ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant_start|>{%- endif -%}")


class _EncodingState:
    """What the pickle's `tiktoken.core.Encoding` becomes here: its state, nothing run."""

    def __setstate__(self, state) -> None:
        self.state = state


class _RestrictedUnpickler(pickle.Unpickler):
    ALLOWED = {("tiktoken.core", "Encoding"): _EncodingState, ("_codecs", "encode"): codecs.encode}

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"global {module}.{name} is not part of a tiktoken encoding")
        return self.ALLOWED[module, name]


def read_encoding_state(path: Path) -> dict:
    """The keyword arguments of the tiktoken.Encoding pickled at `path`, checked."""
    try:
        with open(path, "rb") as f:
            obj = _RestrictedUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise CheckpointError(path, f"not a pickled tiktoken encoding as nanochat saves it: {exc}") from exc
    state = getattr(obj, "state", None)
    ok = (isinstance(state, dict) and set(state) == {"name", "pat_str", "mergeable_ranks", "special_tokens"}
          and isinstance(state["name"], str) and isinstance(state["pat_str"], str)
          and isinstance(state["mergeable_ranks"], dict) and isinstance(state["special_tokens"], dict)
          and all(type(k) is bytes and type(v) is int for k, v in state["mergeable_ranks"].items())
          and all(type(k) is str and type(v) is int for k, v in state["special_tokens"].items()))
    if not ok:
        raise CheckpointError(path, "the pickle holds no tiktoken encoding state (expected name, pat_str, "
                                    "mergeable_ranks {bytes: int} and special_tokens {str: int})")
    missing = [t for t in SPECIAL_TOKENS if t not in state["special_tokens"]]
    if missing:
        raise CheckpointError(path, f"special tokens {missing} are missing: not a nanochat tokenizer")
    return state


class _TiktokenBackend:
    """What Tokenizer needs from an encoder, over a tiktoken.Encoding. Text is encoded
    ordinarily except for the special tokens written in it (a rendered chat template's)."""

    def __init__(self, encoding, bos_id: int | None):
        self.encoding, self.bos_id = encoding, bos_id
        self.special_ids = set(encoding._special_tokens.values())

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = self.encoding.encode(text, allowed_special="all")
        return [self.bos_id] + ids if add_special_tokens and self.bos_id is not None else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        ids = [i for i in ids if not (skip_special_tokens and i in self.special_ids)]
        return self.encoding.decode(ids)

    def token_to_id(self, token: str) -> int | None:
        return self.encoding._special_tokens.get(token)

    def vocab_size(self) -> int:
        return self.encoding.n_vocab


def nanochat_tokenizer(path: Path):
    """The Tokenizer of nanochat's `tokenizer.pkl`: BOS prepended to plain prompts (as its
    base-model completions are), its chat format, <|assistant_end|> and <|bos|> ending a reply."""
    from nanoinfer.text.tokenizer import Tokenizer

    state = read_encoding_state(path)
    try:
        import tiktoken
    except ImportError as exc:
        raise CheckpointError(path, "a nanochat tokenizer needs tiktoken: pip install 'nanoinfer[nanochat]'") from exc
    try:
        encoding = tiktoken.Encoding(**state)
    except ValueError as exc:  # (tiktoken checks the ids fit together)
        raise CheckpointError(path, f"its tiktoken encoding does not build: {exc}") from exc
    special = dict(state["special_tokens"])
    return Tokenizer(_TiktokenBackend(encoding, special["<|bos|>"]), source=str(path), bos_token="<|bos|>",
                     eos_token="<|assistant_end|>", special_tokens={"bos_token": "<|bos|>",
                                                                    "eos_token": "<|assistant_end|>"},
                     chat_template=CHAT_TEMPLATE, end_token_ids=[special["<|bos|>"]])
