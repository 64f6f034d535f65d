"""Tokenizers from a Hugging Face checkpoint's files: tokenizer.json (the tokenizers library) or
tokenizer.model (sentencepiece), with tokenizer_config.json's named and added tokens and chat template.

`Tokenizer.from_hf_dir` imports this module: a GGUF's vocabulary (nanoinfer/text/tokenizer.py) needs none of it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple, Sequence

import sentencepiece
import tokenizers
from tokenizers import AddedToken

from nanoinfer.text.chat_template import find_hf_chat_template
from nanoinfer.errors import CheckpointError
from nanoinfer.json_files import read_json_object
from nanoinfer.text.encoders import TokenizerBackend, TokenizersBackend

# Names of the special tokens transformers hands to a chat template (its `special_tokens_map`).
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                         "cls_token", "mask_token")


class _SentencePieceBackend:
    """A TokenizerBackend over a `tokenizer.model` run by sentencepiece itself (any model type
    and normalizer), with the checkpoint's added tokens cut out of the text first."""

    def __init__(self, processor: sentencepiece.SentencePieceProcessor, added: dict[str, int],
                 special_ids: set[int], bos_id: int | None, eos_id: int | None):
        self.processor, self.added, self.special_ids = processor, added, special_ids
        self.bos_id, self.eos_id = bos_id, eos_id
        self.added_by_id = {i: t for t, i in added.items()}
        # Longest first, so "<|a|>b" is not cut at a shorter token "<|a|>" that prefixes it.
        self.pattern = re.compile("|".join(map(re.escape, sorted(added, key=len, reverse=True))))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = [self.bos_id] if add_special_tokens and self.bos_id is not None else []
        start = 0
        # Each piece of text between added tokens is encoded on its own, so each gets the dummy
        # prefix: this is what Meta's Llama-2 reference code and llama.cpp do around <s>/[INST].
        for match in self.pattern.finditer(text) if self.added else ():
            if match.start() > start:
                ids += self.processor.encode(text[start:match.start()])
            ids.append(self.added[match.group()])
            start = match.end()
        if start < len(text):
            ids += self.processor.encode(text[start:])
        if add_special_tokens and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        size, parts, run = self.processor.get_piece_size(), [], []
        for token_id in ids:
            if token_id in self.added_by_id:
                parts.append(self.processor.decode(run))
                run = []
                if not (skip_special_tokens and token_id in self.special_ids):
                    parts.append(self.added_by_id[token_id])
            elif 0 <= token_id < size:  # ids past the vocab (padded embeddings) decode to nothing
                run.append(token_id)
        return "".join(parts) + self.processor.decode(run)

    def token_to_id(self, token: str) -> int | None:
        if token in self.added:
            return self.added[token]
        token_id = self.processor.piece_to_id(token)
        return token_id if self.processor.id_to_piece(token_id) == token else None

    def vocab_size(self) -> int:
        return max(self.processor.get_piece_size(), max(self.added_by_id, default=-1) + 1)


class HfTokenizerFiles(NamedTuple):
    """A HF directory's tokenizer: its encoder, its named special tokens, its chat template (if any)."""

    backend: TokenizerBackend
    special_tokens: dict[str, str]
    chat_template: str | None


def read_hf_tokenizer(path: str | Path) -> HfTokenizerFiles | None:
    """What a HF checkpoint directory's tokenizer files hold, or None when it has none
    (`Tokenizer.from_hf_dir` makes the Tokenizer)."""
    path = Path(path)
    config = _read_json(path / "tokenizer_config.json")
    # special_tokens_map.json is the older home of the named tokens; the config wins.
    named = {**_read_json(path / "special_tokens_map.json"), **config}
    special = {k: _content(named[k]) for k in _NAMED_SPECIAL_TOKENS if named.get(k)}
    extra_special = [_content(t) for k in ("additional_special_tokens", "extra_special_tokens")
                     if isinstance(named.get(k), list) for t in named[k]]
    added_specs = sorted((int(i), spec) for i, spec in
                         (config.get("added_tokens_decoder") or {}).items())
    if (path / "tokenizer.json").is_file():
        backend: TokenizerBackend = _hf_tokenizers_backend(path / "tokenizer.json", special, extra_special,
                                                           added_specs)
    elif (path / "tokenizer.model").is_file():
        backend = _sentencepiece_backend(path / "tokenizer.model", config, special, extra_special, added_specs)
    else:
        return None
    return HfTokenizerFiles(backend, special, find_hf_chat_template(path, config))


def _read_json(file: Path) -> dict:
    return read_json_object(file) if file.is_file() else {}


def _content(token: str | dict) -> str:
    """Special tokens are saved as strings or as AddedToken dicts ({"content": ...})."""
    return token["content"] if isinstance(token, dict) else str(token)


def _added_token(spec: dict | str, special: bool) -> AddedToken:
    if isinstance(spec, str):
        return AddedToken(spec, special=special, normalized=False)
    keys = ("single_word", "lstrip", "rstrip", "normalized")
    return AddedToken(spec["content"], special=spec.get("special", special),
                      **{k: spec[k] for k in keys if k in spec})


def _hf_tokenizers_backend(file: Path, special: dict[str, str],
                           extra_special: list[str], added_specs: list) -> TokenizersBackend:
    try:
        backend = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises plain Exception for any malformed file
        raise CheckpointError(file, f"is not a tokenizer the tokenizers library can read: {e}") from e
    # As transformers: the config's added tokens and named special tokens are matched whole in
    # text even when tokenizer.json lists them only as vocabulary (adding one it has is a no-op).
    for _, spec in added_specs:
        token = _added_token(spec, special=False)
        (backend.add_special_tokens if token.special else backend.add_tokens)([token])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in (*special.values(), *extra_special)])
    # BOS/EOS come from tokenizer.json's post-processor alone: transformers 5 drops the config's
    # add_bos_token/add_eos_token when there is a tokenizer.json (Llama's adds BOS this way).
    return TokenizersBackend(backend)


def _sentencepiece_backend(file: Path, config: dict, special: dict[str, str],
                           extra_special: list[str], added_specs: list) -> _SentencePieceBackend:
    try:
        processor = sentencepiece.SentencePieceProcessor(model_file=str(file))
    except (OSError, RuntimeError) as e:
        raise CheckpointError(file, f"is not a sentencepiece model: {e}") from e
    # A config without bos/eos names (old checkpoints) gets sentencepiece's own; `special` is
    # the caller's fresh dict of named tokens, so the Tokenizer sees them too.
    for name, token_id in (("bos_token", processor.bos_id()), ("eos_token", processor.eos_id())):
        if token_id >= 0:
            special.setdefault(name, processor.id_to_piece(token_id))
    added: dict[str, int] = {}
    special_ids = {i for i in range(processor.get_piece_size())
                   if processor.is_control(i) or processor.is_unknown(i)}
    for token_id, spec in added_specs:
        added[_content(spec)] = token_id
        if not isinstance(spec, dict) or spec.get("special", False):
            special_ids.add(token_id)
    for token in (*special.values(), *extra_special):
        token_id = processor.piece_to_id(token)
        if token not in added and processor.id_to_piece(token_id) == token:
            added[token] = token_id
            special_ids.add(token_id)
    # Llama-style checkpoints add BOS unless the config says otherwise (sentencepiece's own
    # convention, and transformers' LlamaTokenizer default).
    bos, eos = special.get("bos_token"), special.get("eos_token")
    bos_id = added.get(bos) if bos and config.get("add_bos_token", True) else None
    eos_id = added.get(eos) if eos and config.get("add_eos_token", False) else None
    return _SentencePieceBackend(processor, added, special_ids, bos_id, eos_id)
