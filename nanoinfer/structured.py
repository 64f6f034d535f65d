"""Structured output: grammars that constrain what a sequence may sample (a JSON object, a
JSON schema, a regex, a choice of strings, a Lark grammar), their per-step token masks, and
the masks applied to the logits on the device.

llguidance computes the masks (picked by measurement and maintenance: bench/grammar_masks.py,
bench/RESULTS.md). A sequence's `Constraint` fills its rows of a packed bitmask (int32 words,
bit t of word t // 32 set: token t allowed) on the host while the device runs the step's
forward; the rows go to the device in one copy and `apply_bitmask` turns the disallowed
logits to -inf there, so the sampler needs no per-row round trip. After a token is resolved,
`consume` advances the grammar (runtime/engine_core.py), which is why a step that masked
some row is waited for before the next one is planned (async scheduling's overlap is lost
while constrained sequences run, not their masks' host time).

Whitespace inside JSON is not free (`whitespace_flexible` off): OpenAI's strict JSON mode
emits compact JSON, and a model cannot then pad an answer forever.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Literal

import torch

from nanoinfer.errors import RequestError
from nanoinfer.settings import json_object

JSON_OPTIONS = {"whitespace_flexible": False}


KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to: `kind` json_object (any JSON object),
    json_schema (`value`: the schema, a dict or its JSON text), regex (`value`: the pattern,
    Rust regex syntax as llguidance reads it), choice (`value`: the strings, one of which is
    the output) or grammar (`value`: a Lark grammar, llguidance's dialect). Hashable: a schema
    is kept as its JSON text, choices as a tuple."""

    kind: Literal["json_object", "json_schema", "regex", "choice", "grammar"]
    value: Any = None

    def __post_init__(self):
        param = "choice" if self.kind == "choice" else "response_format"
        if self.kind not in KINDS:
            raise RequestError(f"structured output kind {self.kind!r} is not supported: expected one of "
                               f"{list(KINDS)}", param="response_format")
        value = self.value
        if self.kind == "json_schema":
            value = json.dumps(json_object(value, "json_schema", "a JSON schema (an object)", param),
                               ensure_ascii=False)  # (key order kept: it orders the output's keys)
        elif self.kind == "choice":
            if isinstance(value, str) or not value or not all(isinstance(c, str) for c in value):
                raise RequestError(f"choice must be a non-empty list of strings, got {value!r}", param=param)
            value = tuple(value)
        elif self.kind in ("regex", "grammar") and not (isinstance(value, str) and value):
            raise RequestError(f"{self.kind} must be a non-empty string, got {value!r}", param=param)
        object.__setattr__(self, "value", value)

    @classmethod
    def parse(cls, value, param: str = "structured_outputs") -> "GrammarSpec | None":
        """From a GrammarSpec or vLLM's `structured_outputs` mapping: exactly one of json (a
        schema), regex, choice, grammar (Lark), or json_object: true."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise RequestError(f"{param}={value!r} is invalid: expected an object with one of json, regex, choice, "
                               f"grammar or json_object", param=param)
        names = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                 "json_object": "json_object"}
        unknown = sorted(set(value) - set(names))
        given = [k for k in names if value.get(k) not in (None, False)]
        if unknown or len(given) != 1:
            raise RequestError(f"{param} must hold exactly one of {list(names)}, got {sorted(value)}", param=param)
        kind = names[given[0]]
        return cls(kind, None if kind == "json_object" else value[given[0]])

    @property
    def schema(self) -> dict | None:
        return json.loads(self.value) if self.kind == "json_schema" else None

    def grammar(self) -> str:
        """The llguidance grammar; RequestError naming a bad schema, pattern or grammar."""
        from llguidance import LLMatcher

        if self.kind == "json_object":
            grammar = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        elif self.kind == "json_schema":
            grammar = LLMatcher.grammar_from_json_schema(self.value, defaults=JSON_OPTIONS)
        elif self.kind == "regex":
            grammar = LLMatcher.grammar_from_regex(self.value)
        elif self.kind == "choice":
            grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.value))
        else:
            grammar = LLMatcher.grammar_from_lark(self.value)
        error = LLMatcher.validate_grammar(grammar)
        if error and not error.startswith("WARNING"):
            raise RequestError(f"the {self.kind} cannot constrain generation: {error}",
                               param="choice" if self.kind == "choice" else "response_format")
        return grammar


def grammar_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of a model's tokenizer (each token's bytes, EOS), masks `vocab_size`
    wide (the model's logits: a padded vocabulary's extra ids are never allowed). Expensive
    (~1 s for a large vocabulary): once per model."""
    from llguidance import LLTokenizer

    spec = tokenizer.tokenizers_json()
    if spec is None:
        raise RequestError(f"structured output needs a Hugging Face `tokenizers` vocabulary; {tokenizer.source} "
                           "has another kind", param="response_format")
    return LLTokenizer(spec, n_vocab=vocab_size, eos_token=list(tokenizer.eos_token_ids) or None)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A host bitmask for `rows` sequences, every token allowed (pinned where CUDA is, for an
    asynchronous copy)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())


class Grammars:
    """A model's grammar compiler: llguidance's view of its tokenizer (built on first use),
    and the grammars of recent specs (a request is checked where it is submitted, then its
    sequences constrained where they run: one compilation)."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 64):
        self.tokenizer, self.vocab_size, self.cache_size = tokenizer, vocab_size, cache_size
        self._llm_tokenizer = None
        self._grammars: dict[GrammarSpec, str] = {}
        self._lock = threading.Lock()  # (the event loop checks requests while the engine thread runs them)
        self._executor = None  # llguidance's thread pool, made on first use

    def constraint(self, spec: GrammarSpec) -> "Constraint":
        """A fresh Constraint for `spec`; RequestError naming what makes it unusable."""
        with self._lock:
            self._build_tokenizer()
            grammar = self._grammars.get(spec)
            if grammar is None:
                grammar = spec.grammar()
                if len(self._grammars) >= self.cache_size:
                    self._grammars.pop(next(iter(self._grammars)))
                self._grammars[spec] = grammar
        return Constraint(self._llm_tokenizer, spec, grammar)

    def prepare(self) -> None:
        """Build llguidance's view of the tokenizer and its token tables now: ~2 s once for a
        49k vocabulary, which the first structured request would otherwise wait for, and
        everything queued with it (a server calls this on a thread at startup). Nothing when
        this model cannot have structured output."""
        try:
            with self._lock:
                self._build_tokenizer()
        except RequestError:
            pass

    def _build_tokenizer(self) -> None:
        if self._llm_tokenizer is not None:
            return
        if self.tokenizer is None:
            raise RequestError("structured output needs the model's tokenizer, and this model has none",
                               param="response_format")
        tokenizer = grammar_tokenizer(self.tokenizer, self.vocab_size)
        # (the token tables are built on the first mask: build them here, with any grammar)
        Constraint(tokenizer, GrammarSpec("regex", "a")).fill(allocate_bitmask(1, self.vocab_size), 0)
        self._llm_tokenizer = tokenizer

    def consume(self, pairs: list[tuple["Constraint", int]]) -> list[bool]:
        """`Constraint.consume` for each (constraint, token), in parallel: whether each token
        continued its grammar."""
        if not pairs:
            return []
        ok = self._executor_().consume_token_par([(c.matcher, token) for c, token in pairs])
        return [o and not c.matcher.is_error() for o, (c, _) in zip(ok, pairs)]

    def _executor_(self):
        from llguidance import LLExecutor

        if self._executor is None:
            self._executor = LLExecutor()
        return self._executor

    def fill(self, rows: list[tuple["Constraint", int, list[int]]], bitmask: torch.Tensor) -> None:
        """Fill host `bitmask`'s rows as `Constraint.fill` does for each (constraint, row,
        drafts), in parallel on llguidance's threads (without the GIL: a mask over a large
        vocabulary inside a JSON string takes ~0.1-1 ms)."""
        executor = self._executor_()
        assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and not bitmask.is_cuda
        where = (bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
        plain = [(c.matcher, row) for c, row, drafts in rows if not drafts]
        drafting = [(c.matcher, row, list(drafts)) for c, row, drafts in rows if drafts]
        if plain:
            executor.unsafe_compute_mask_ptr(plain, *where)
        if drafting:  # (llguidance refuses an empty draft list there)
            executor.unsafe_compute_mask_ptr_with_draft_token(drafting, *where)
        for c, _, _ in rows:
            c._check("computing the next tokens")


class Constraint:
    """One sequence's grammar state: the tokens it has consumed so far."""

    def __init__(self, llm_tokenizer, spec: GrammarSpec, grammar: str | None = None):
        from llguidance import LLMatcher

        self.spec = spec
        self.matcher = LLMatcher(llm_tokenizer, grammar if grammar is not None else spec.grammar(), log_level=0)
        self._check("compiling the grammar")

    def _check(self, doing: str) -> None:
        if self.matcher.is_error():
            raise RequestError(f"{self.spec.kind} constraint failed {doing}: {self.matcher.get_error()}",
                               param="response_format")

    def fill(self, bitmask: torch.Tensor, row: int, drafts: list[int] = ()) -> None:
        """Row `row` of host `bitmask`: the tokens the grammar allows next; with `drafts` (a
        speculative step's), rows row + 1.. too, each allowing what may follow the drafts
        before it. Rows past a draft the grammar rejects are left as they are: verification
        rejects that draft (its probability is 0), so they are never read. (One row at a
        time, on this thread: the reference for `Grammars.fill`, which the engine uses.)"""
        from llguidance.torch import fill_next_token_bitmask

        valid = self.matcher.validate_tokens(drafts) if drafts else 0
        for i in range(valid + 1):
            fill_next_token_bitmask(self.matcher, bitmask, row + i)
            self._check("computing the next tokens")
            if i < valid:
                self.matcher.consume_token(drafts[i])
        if valid:
            self.matcher.rollback(valid)

    def consume(self, token: int) -> bool:
        """Advance past a sampled `token`; False if the grammar does not allow it (only when
        the mask left nothing to sample, min_tokens banning the end the grammar requires)."""
        return self.matcher.consume_token(token) and not self.matcher.is_error()

    @property
    def error(self) -> str:
        return self.matcher.get_error() or "the token does not continue it"

    @property
    def finished(self) -> bool:
        """Nothing may follow but the end of the sequence (a complete JSON document, say)."""
        return self.matcher.is_stopped()

    @property
    def done(self) -> bool:
        """The output may end here (more may follow: a regex `[0-9]+`, say)."""
        return self.matcher.is_stopped() or self.matcher.is_accepting()


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab] bool: token t allowed (bit t % 32 of word t // 32;
    tokens past the words' bits are not)."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).view(bitmask.shape[0], -1).bool()
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    return torch.cat([allowed, allowed.new_zeros(allowed.shape[0], vocab - allowed.shape[1])], dim=1)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """A float32 copy of `logits` [n, vocab] where every token the `bitmask` [m, words] (on
    the same device) does not allow is -inf: in rows `rows` [m] (int64), or in every row
    (m = n). A copy: the raw logits stay what logprobs report.
    (llguidance.torch has one too, but torch.compile'd: a C++ compiler on the CPU and a
    compile per new shape, for what is a few tensor ops.)"""
    out = logits.to(torch.float32, copy=True)
    disallowed = ~unpack_bitmask(bitmask, logits.shape[1])
    if rows is None:
        return out.masked_fill_(disallowed, float("-inf"))
    out.index_copy_(0, rows, out.index_select(0, rows).masked_fill_(disallowed, float("-inf")))
    return out
