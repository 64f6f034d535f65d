"""GrammarSpec: what a request constrains its output to (a JSON object, a JSON schema, a regex, a choice of strings, a
Lark grammar), parsed from the API's forms, bounded before it compiles (what may nest in llguidance's recursive
compiler: rules, `$ref`s, bytes, choices), and turned into llguidance's grammar text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from nanoinfer.errors import RequestError
from nanoinfer.settings import json_object

JSON_OPTIONS = {"whitespace_flexible": False}


KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")

# Bounds on what a client's grammar may hold, checked before llguidance sees it (see above).
MAX_GRAMMAR_BYTES = 2 << 20  # a Lark grammar's, a regex's, a schema's JSON text or the choices together
MAX_GRAMMAR_RULES = 10_000  # Lark rule and terminal definitions (each may nest the next: ~3 KB of stack)
MAX_SCHEMA_REFS = 10_000  # `$ref`s in a schema or a Lark grammar's inline %json (each ~9 KB of stack)
MAX_CHOICES = 10_000  # choice strings (compiling 10,000 takes ~0.2 s; 50,000 ~4 s)
_RULE_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_]\w*[^:\n]*:", re.M)  # (a Lark item starts a line)


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to: `kind` json_object (any JSON object),
    json_schema (`value`: the schema, a dict or its JSON text), regex (`value`: the pattern,
    Rust regex syntax as llguidance reads it), choice (`value`: the strings, one of which is
    the output) or grammar (`value`: a Lark grammar, llguidance's dialect). Hashable: a schema
    is kept as its JSON text, choices as a tuple. `param`: the request field it came from, which
    its errors name (not part of its identity: equal specs share one compilation)."""

    kind: Literal["json_object", "json_schema", "regex", "choice", "grammar"]
    value: Any = None
    param: str = field(default="", compare=False)

    def __post_init__(self):
        if not self.param:
            object.__setattr__(self, "param", "choice" if self.kind == "choice" else "response_format")
        param = self.param
        if self.kind not in KINDS:
            raise RequestError(f"structured output kind {self.kind!r} is not supported: expected one of "
                               f"{list(KINDS)}", param=param)
        value = self.value
        if self.kind == "json_schema":
            try:
                value = json.dumps(json_object(value, "json_schema", "a JSON schema (an object)", param),
                                   ensure_ascii=False)  # (key order kept: it orders the output's keys)
            except RecursionError as exc:
                raise RequestError("json_schema nests too deeply", param=param) from exc
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
        return cls(kind, None if kind == "json_object" else value[given[0]], param=param)

    @property
    def schema(self) -> dict | None:
        return json.loads(self.value) if self.kind == "json_schema" else None

    @property
    def size(self) -> int:
        """Its text's bytes (a grammar's, a pattern's, a schema's JSON, the choices')."""
        if self.kind == "choice":
            return sum(len(c.encode()) for c in self.value)
        return len(self.value.encode()) if isinstance(self.value, str) else 0

    def check_bounds(self) -> None:
        """RequestError naming the bound (MAX_*) this spec exceeds: what may nest in the
        compiler, and what takes long to compile. Pure Python: before anything native runs."""
        if self.kind == "choice" and len(self.value) > MAX_CHOICES:
            self._too_big(f"has {len(self.value):,} strings: expected at most {MAX_CHOICES:,}")
        if self.size > MAX_GRAMMAR_BYTES:
            self._too_big(f"is {self.size:,} bytes: expected at most {MAX_GRAMMAR_BYTES:,}")
        if self.kind in ("json_schema", "grammar"):
            refs = self.value.count('"$ref"')
            if refs > MAX_SCHEMA_REFS:
                self._too_big(f"has {refs:,} $refs: expected at most {MAX_SCHEMA_REFS:,} (each may nest the next)")
        if self.kind == "grammar":
            rules = len(_RULE_DEFINITION.findall(self.value))
            if rules > MAX_GRAMMAR_RULES:
                self._too_big(f"defines {rules:,} rules: expected at most {MAX_GRAMMAR_RULES:,} (each may nest "
                              f"the next)")

    def _too_big(self, what: str):
        raise RequestError(f"the {self.kind} {what}", param=self.param)

    def grammar(self) -> str:
        """The llguidance grammar (within `check_bounds`); RequestError naming a bad schema,
        pattern or grammar. Validated by compiling it: see `Grammars`."""
        self.check_bounds()
        try:
            return self._grammar()
        except ValueError as exc:  # (llguidance reading a schema: "recursion limit exceeded", say)
            raise RequestError(f"the {self.kind} cannot constrain generation: {exc}", param=self.param) from exc
        except RecursionError as exc:  # (closing its objects: nanoinfer/structured/closed_schema.py)
            raise RequestError(f"the {self.kind} nests too deeply", param=self.param) from exc

    def _grammar(self) -> str:
        from llguidance import LLMatcher

        if self.kind == "json_object":
            grammar = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        elif self.kind == "json_schema":  # (every schema enters here: its objects closed, as the peers do)
            schema = self.value
            if '"properties"' in schema or '"patternProperties"' in schema:  # (else no object lists its keys)
                from nanoinfer.structured.closed_schema import closed_schema

                schema = closed_schema(json.loads(schema))
            grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        elif self.kind == "regex":
            grammar = LLMatcher.grammar_from_regex(self.value)
        elif self.kind == "choice":
            grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.value))
        else:
            grammar = LLMatcher.grammar_from_lark(self.value)
        return grammar
