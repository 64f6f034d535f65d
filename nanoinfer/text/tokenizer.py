"""Tokenizer: text <-> token ids over a backend, built from a GGUF's (or llama2.c's) vocabulary; the chat template.

A Hugging Face directory's tokenizer files are read by nanoinfer/text/tokenizer_hf.py, and the chat
template is compiled and rendered by nanoinfer/text/chat_template.py: each is imported where it is
first needed, so a plain prompt to a GGUF model runs neither.
"""

from __future__ import annotations

import copy
import json
import struct
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import gguf
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from nanoinfer.errors import CheckpointError, RequestError
from nanoinfer.text.encoders import TokenizerBackend, TokenizersBackend

if TYPE_CHECKING:
    from nanoinfer.gguf_file import GGUFFile

# What `tokenizer.ggml.pre` says about splitting text before byte-level BPE, as llama.cpp does it
# (llama-vocab.cpp). The GPT-2 regex is the ByteLevel pre-tokenizer's own, used for pre-types
# not listed here ("default", "gpt-2", "mpt", "olmo", ...).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
_SPLIT_BY_PRE = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
}
# These vocabularies were trained with every digit split off first (the StarCoder tokenizer.json:
# Digits(individual_digits) before ByteLevel), and llama.cpp splits `\p{N}` first for them too.
# transformers' GGUF converter misses this and so differs on whitespace before a digit: it
# gives "\n\n1" as [Ċ, Ċ, 1] where the model was trained on [ĊĊ, 1].
_DIGITS_FIRST = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_KNOWN_GPT2_PRE = {"default", "gpt-2", "gpt2", "mpt", "olmo", "jais"}
# llama.cpp ignores the merges for a piece that is itself a vocabulary entry on these
# (HF's `ignore_merges`), and it changes a few ids.
_IGNORE_MERGES_PRE = {"llama3", "llama-v3", "llama-bpe"}
# The chat template's names of special tokens -> their GGUF keys (tokenizer.ggml.{key}_token_id).
_GGUF_SPECIAL_TOKENS = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}


class Tokenizer:
    """Encodes and decodes text for one checkpoint, and renders its chat template.

    Build it with `from_hf_dir` or `from_gguf`. Ids match transformers' tokenizer for the same
    files with `add_special_tokens=True`, except where transformers departs from the model's own
    tokenizer and llama.cpp: see `_DIGITS_FIRST` and `_sentencepiece_bpe`.
    """

    def __init__(self, backend: TokenizerBackend, *, source: str, bos_token: str | None,
                 eos_token: str | None, special_tokens: dict[str, str],
                 chat_template: str | None, extra_eos_ids: Iterable[int] = (),
                 end_token_ids: Iterable[int] = ()):
        self._backend = backend
        self.source = source
        self.vocab_size: int = backend.vocab_size()
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id: int | None = backend.token_to_id(bos_token) if bos_token else None
        eos_id = backend.token_to_id(eos_token) if eos_token else None
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(
            i for i in (eos_id, *end_token_ids, *extra_eos_ids) if i is not None))
        self.special_tokens = dict(special_tokens)  # named tokens the chat template may use
        self.chat_template: str | None = chat_template  # compiled at its first use (`check_chat_template`)

    def with_extra_eos_ids(self, ids: Iterable[int]) -> Tokenizer:
        """A copy whose `eos_token_ids` also hold `ids` (e.g. the model config's eos ids)."""
        other = copy.copy(self)
        other.eos_token_ids = tuple(dict.fromkeys((*self.eos_token_ids, *ids)))
        return other

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in it are parsed as those tokens."""
        return self._backend.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. No "clean up" of spaces before punctuation: decoding stays lossless."""
        return self._backend.decode(ids, skip_special_tokens)

    def decode_stream(self, context: Sequence[int], skip_special_tokens: bool = True):
        """A function of the next token id to the text it completes ("" or None: none yet), primed with `context`
        (the tokens before it), where the vocabulary has a stream decoder (a `tokenizers` one); else None."""
        if not isinstance(self._backend, TokenizersBackend):
            return None
        return self._backend.decode_stream(context, skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def tokenizers_json(self) -> str | None:
        """The vocabulary as a Hugging Face tokenizer.json string (None: not a `tokenizers`
        vocabulary), for libraries that read one (structured output's llguidance)."""
        return self._backend.backend.to_str() if isinstance(self._backend, TokenizersBackend) else None

    def save_hf(self, directory: str | Path) -> None:
        """Write this tokenizer as a Hugging Face directory's files (tokenizer.json and
        tokenizer_config.json with the chat template), e.g. a GGUF's beside a dummy config."""
        if not isinstance(self._backend, TokenizersBackend):
            raise RequestError(f"{self.source}: only a `tokenizers` vocabulary can be written as tokenizer.json")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.backend.save(str(directory / "tokenizer.json"))
        config = {"bos_token": self.bos_token, "eos_token": self.eos_token, "chat_template": self.chat_template,
                  "add_bos_token": False}
        (directory / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None},
                                                                    indent=1))

    def check_chat_template(self) -> None:
        """Compile the chat template now (compiles are cached): a broken one raises CheckpointError
        naming this tokenizer's file. A plain prompt never compiles it."""
        if self.chat_template is not None:
            # (jinja2 and the template's sandbox load here: a plain prompt's request needs neither)
            from nanoinfer.text.chat_template import compile_chat_template

            compile_chat_template(self.chat_template, self.source)

    def apply_chat_template(self, messages: list[dict], /, add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """The prompt text for a conversation, as transformers renders it (`tokenize=False`)."""
        if self.chat_template is None:
            raise RequestError(f"the tokenizer of {self.source} has no chat template; "
                               "send a plain prompt instead of chat messages")
        from nanoinfer.text.chat_template import compile_chat_template, render_chat_template

        variables = {**self.special_tokens, **extra}
        variables.setdefault("bos_token", "")
        variables.setdefault("eos_token", "")
        return render_chat_template(compile_chat_template(self.chat_template, self.source), messages,
                                    add_generation_prompt=add_generation_prompt, **variables)

    @classmethod
    def from_hf_dir(cls, path: str | Path, extra_eos_ids: Iterable[int] = ()) -> Tokenizer | None:
        """The tokenizer of a HF checkpoint directory, or None when it has no tokenizer files
        (nanoinfer/text/tokenizer_hf.py, imported by the load that reads such files)."""
        from nanoinfer.text.tokenizer_hf import read_hf_tokenizer

        files = read_hf_tokenizer(path)
        if files is None:
            return None
        tokenizer = cls(files.backend, source=str(path), bos_token=files.special_tokens.get("bos_token"),
                        eos_token=files.special_tokens.get("eos_token"), special_tokens=files.special_tokens,
                        chat_template=files.chat_template, extra_eos_ids=extra_eos_ids)
        tokenizer.check_chat_template()  # (a broken one fails the load, naming the directory)
        return tokenizer

    # ---- GGUF vocabularies -----------------------------------------------------------------

    @classmethod
    def from_gguf(cls, header: GGUFFile, path: str | Path, extra_eos_ids: Iterable[int] = ()) -> Tokenizer:
        """The tokenizer a GGUF file describes in its `tokenizer.ggml.*` fields (`header`: the
        file's, read by nanoinfer/gguf_file.py); a field of the wrong kind is a CheckpointError."""
        kind = header.string("tokenizer.ggml.model", None)
        tokens = header.strings("tokenizer.ggml.tokens", [])
        if not tokens and kind in ("gpt2", "llama"):
            raise CheckpointError(path, "the GGUF has no tokenizer.ggml.tokens")
        if kind not in ("gpt2", "llama"):
            raise CheckpointError(path, f"tokenizer.ggml.model is {kind!r}; NanoInfer supports "
                                        "'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE)")
        types = _per_token(header.integers("tokenizer.ggml.token_type", None), "token_type", len(tokens), path)
        types = types or [gguf.TokenType.NORMAL] * len(tokens)
        try:
            if kind == "gpt2":
                backend = _byte_level_bpe(tokens, header.strings("tokenizer.ggml.merges", []),
                                          header.string("tokenizer.ggml.pre", "default"))
            else:
                scores = _per_token(header.numbers("tokenizer.ggml.scores", None), "scores", len(tokens), path)
                backend = _sentencepiece_bpe(tokens, types, scores or [0.0] * len(tokens),
                                             header.flag("tokenizer.ggml.add_space_prefix", True))
        except Exception as e:  # tokenizers raises plain Exception, e.g. for a merge of unknown tokens
            raise CheckpointError(path, f"its tokenizer.ggml fields do not form a vocabulary: {e}") from e
        # Every token that is not plain text is matched whole in the input, as llama.cpp does.
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, k in zip(tokens, types)
                                    if k in (gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN)])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, k in zip(tokens, types) if k == gguf.TokenType.USER_DEFINED])

        def id_of(key: str) -> int | None:
            """A special token's id; one outside the vocabulary is ignored, as llama.cpp does."""
            token_id = header.integer(f"tokenizer.ggml.{key}_token_id", None)
            return token_id if token_id is not None and 0 <= token_id < len(tokens) else None

        special = {name: tokens[i] for name, key in _GGUF_SPECIAL_TOKENS.items()
                   if (i := id_of(key)) is not None and tokens[i]}
        # llama.cpp adds BOS for a SentencePiece vocabulary that does not say otherwise.
        add_bos = header.flag("tokenizer.ggml.add_bos_token", kind == "llama")
        add_eos = header.flag("tokenizer.ggml.add_eos_token", False)
        _set_bos_eos(backend, special.get("bos_token") if add_bos else None,
                     special.get("eos_token") if add_eos else None)
        # End-of-turn tokens some GGUFs name besides eos (Llama 3 <|eot_id|>, <|eom_id|>).
        ends = [id_of(k) for k in ("eot", "eom")]
        return cls(TokenizersBackend(backend), source=str(path),
                   bos_token=special.get("bos_token"), eos_token=special.get("eos_token"),
                   special_tokens=special, chat_template=header.string("tokenizer.chat_template", None),
                   extra_eos_ids=extra_eos_ids, end_token_ids=[i for i in ends if i is not None])

    # ---- llama2.c -------------------------------------------------------------------------

    @classmethod
    def from_llama2c(cls, path: str | Path, vocab_size: int) -> Tokenizer:
        """llama2.c's tokenizer.bin for a model of `vocab_size` tokens: SentencePiece pieces
        and scores (`read_llama2c_vocab`), <unk> <s> </s> at 0, 1, 2, byte tokens <0xNN>.
        Encodes as its run.c does: BOS, a dummy space prefix, merges by score."""
        pieces, scores = read_llama2c_vocab(Path(path), vocab_size)
        pieces[:3] = ["<unk>", "<s>", "</s>"][:len(pieces)]  # (written as "\n<s>\n", "\n</s>\n")
        kinds = gguf.TokenType
        types = [kinds.UNKNOWN if i == 0 else kinds.CONTROL if i < 3 else
                 kinds.BYTE if len(p) == 6 and p.startswith("<0x") and p.endswith(">") else kinds.NORMAL
                 for i, p in enumerate(pieces)]
        try:
            backend = _sentencepiece_bpe(pieces, types, scores, add_space_prefix=True)
        except Exception as e:  # tokenizers raises plain Exception
            raise CheckpointError(path, f"its pieces do not form a vocabulary: {e}") from e
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in pieces[:3]])
        _set_bos_eos(backend, "<s>", None)
        special = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
        return cls(TokenizersBackend(backend), source=str(path), bos_token="<s>", eos_token="</s>",
                   special_tokens=special, chat_template=None)


def read_llama2c_vocab(path: Path, vocab_size: int) -> tuple[list[str], list[float]]:
    """tokenizer.bin's pieces ("▁" for space, as SentencePiece has them) and scores.

    The file: int32 max_token_length, then per token: fp32 score, int32 length, its bytes
    (SentencePiece pieces with "▁" written as a space; <s> and </s> written as "\\n<s>\\n" and
    "\\n</s>\\n"). It is read into the same SentencePiece BPE as a GGUF's llama vocabulary."""
    raw = path.read_bytes()
    pieces, scores, at = [], [], 4
    try:
        for _ in range(vocab_size):
            score, length = struct.unpack_from("<fi", raw, at)
            piece = raw[at + 8:at + 8 + length]
            if length < 0 or len(piece) != length:
                raise struct.error("a token runs past the end of the file")
            pieces.append(piece.decode("utf-8").replace(" ", "▁"))
            scores.append(score)
            at += 8 + length
    except (struct.error, UnicodeDecodeError) as exc:
        raise CheckpointError(path, f"token {len(pieces)} of the {vocab_size} the model's header promises cannot be "
                                    f"read ({exc}): expected llama2.c's tokenizer.bin for this model") from exc
    return pieces, scores


def _per_token(values, key: str, n_tokens: int, path: str | Path) -> list | None:
    """A `tokenizer.ggml.{key}` array as a list (None: absent, or empty as gguf-py's reader took it),
    one value per token."""
    if values is None or len(values) == 0:
        return None
    if len(values) != n_tokens:
        raise CheckpointError(path, f"GGUF metadata key 'tokenizer.ggml.{key}' holds {len(values)} values for "
                                    f"{n_tokens} tokens: expected one per token")
    return values.tolist()


def _set_bos_eos(backend: tokenizers.Tokenizer, bos: str | None, eos: str | None) -> None:
    """Make `encode(..., add_special_tokens=True)` wrap a text in `bos`/`eos` (None: neither)."""
    bos = bos if bos and backend.token_to_id(bos) is not None else None
    eos = eos if eos and backend.token_to_id(eos) is not None else None
    single = " ".join(([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else []))
    pair = " ".join([single] + ([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else []))
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair,
        special_tokens=[(t, backend.token_to_id(t)) for t in dict.fromkeys((bos, eos)) if t])


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> tokenizers.Tokenizer:
    """GPT-2 style BPE over UTF-8 bytes spelled as printable characters (Ġ for space)."""
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    model = models.BPE(vocab, pairs, ignore_merges=pre in _IGNORE_MERGES_PRE)
    backend = tokenizers.Tokenizer(model)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _SPLIT_BY_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"), byte_level])
    elif pre in _DIGITS_FIRST:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        if pre not in _KNOWN_GPT2_PRE:
            warnings.warn(f"GGUF tokenizer.ggml.pre {pre!r} is not known to NanoInfer; "
                          "splitting text with the GPT-2 regex, ids may differ from llama.cpp's")
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], types: list[int], scores: list[float],
                       add_space_prefix: bool) -> tokenizers.Tokenizer:
    """SentencePiece BPE rebuilt as a HF BPE: pieces with ▁ for space, byte fallback for
    characters outside the vocabulary, and merges recovered from the scores."""
    vocab = {token: i for i, token in enumerate(tokens)}
    # SentencePiece merges the adjacent pair whose concatenation is the best-scored piece; a
    # HF BPE merges the best-ranked pair. So every split of a normal piece into two pieces is a
    # merge, ranked by the score of the piece it makes.
    normal = {t for t, k in zip(tokens, types) if k == gguf.TokenType.NORMAL}
    ranked = []
    for token in normal:
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[vocab[token]], vocab[token], vocab[left], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unk = next((t for t, k in zip(tokens, types) if k == gguf.TokenType.UNKNOWN), None)
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True,
                                              byte_fallback=True))
    # A normalizer, not the Metaspace pre-tokenizer: SentencePiece (and llama.cpp) put the dummy
    # "▁" before every text, even one that starts with a space (" hi" -> "▁▁hi"), and before
    # each stretch of text after a special token; Metaspace (which transformers' GGUF converter
    # uses) does neither.
    steps = [normalizers.Prepend("▁")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    return backend
