"""Structured output's machinery: grammars that constrain what a sequence may sample (a JSON
object, a JSON schema, a regex, a choice of strings), their per-step token masks, and the
masks applied to the logits on the device.

llguidance computes the masks (picked by measurement and maintenance: bench/grammar_masks.py,
bench/RESULTS.md). A sequence's `Constraint` fills its row of a packed bitmask (int32 words,
bit t of word t // 32 set: token t allowed) on the host; the step's rows go to the device in
one copy and `apply_bitmask` turns the disallowed logits to -inf there, so the sampler needs
no per-row round trip. After a token is sampled, `consume` advances the grammar.

Whitespace inside JSON is not free (`whitespace_flexible` off): OpenAI's strict JSON mode
emits compact JSON, and a model cannot then pad an answer forever.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import torch

from nanoinfer.errors import RequestError

JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to: `kind` json_object (any JSON object),
    json_schema (`value`: the schema, a dict), regex (`value`: the pattern, Rust regex syntax
    as llguidance reads it) or choice (`value`: the strings, one of which is the output)."""

    kind: Literal["json_object", "json_schema", "regex", "choice"]
    value: Any = None

    def grammar(self) -> str:
        """The llguidance grammar; RequestError naming a bad schema, pattern or choice list."""
        from llguidance import LLMatcher

        if self.kind == "json_object":
            grammar = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        elif self.kind == "json_schema":
            if not isinstance(self.value, dict):
                raise RequestError(f"json_schema must be a JSON object, got {type(self.value).__name__}",
                                   param="response_format")
            grammar = LLMatcher.grammar_from_json_schema(self.value, defaults=JSON_OPTIONS)
        elif self.kind == "regex":
            grammar = LLMatcher.grammar_from_regex(self.value)
        elif self.kind == "choice":
            if not self.value or not all(isinstance(c, str) for c in self.value):
                raise RequestError(f"choice must be a non-empty list of strings, got {self.value!r}", param="choice")
            grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.value))
        else:
            raise RequestError(f"structured output kind {self.kind!r} is not supported (expected json_object, "
                               "json_schema, regex or choice)", param="response_format")
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


class Constraint:
    """One sequence's grammar state."""

    def __init__(self, llm_tokenizer, spec: GrammarSpec, grammar: str | None = None):
        from llguidance import LLMatcher

        self.spec = spec
        self.matcher = LLMatcher(llm_tokenizer, grammar if grammar is not None else spec.grammar(), log_level=0)
        self._check("compiling the grammar")

    def _check(self, doing: str) -> None:
        if self.matcher.is_error():
            raise RequestError(f"{self.spec.kind} constraint failed {doing}: {self.matcher.get_error()}",
                               param="response_format")

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of host `bitmask`: the tokens the grammar allows next."""
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, bitmask, row)
        self._check("computing the next tokens")

    def consume(self, token: int) -> None:
        """Advance past a sampled `token` (one the mask allowed)."""
        if not self.matcher.consume_token(token):
            self._check(f"at token {token}")
            raise RequestError(f"token {token} does not continue the {self.spec.kind}", param="response_format")

    @property
    def done(self) -> bool:
        """The output is complete: only the end of the sequence may follow."""
        return self.matcher.is_stopped() or self.matcher.is_accepting()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [rows, vocab] with every token the rows' `bitmask` [rows, words] (on the same
    device) does not allow set to -inf, in place; columns past the mask's words too.
    (llguidance.torch has one too, but torch.compile'd: a C++ compiler on the CPU and a
    compile per new shape, for what is a few tensor ops and graph-capturable as they are.)"""
    rows, vocab = logits.shape
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).view(rows, -1)  # [rows, words * 32]
    width = min(vocab, allowed.shape[1])
    logits[:, :width].masked_fill_(allowed[:, :width] == 0, float("-inf"))
    logits[:, width:] = float("-inf")
    return logits
