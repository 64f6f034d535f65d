"""Whether a Lark grammar's `start` can derive any finite string: `start: a` with `a: "x" a`
cannot, and llguidance only finds out once output has started (its first mask allows "x").

A reading of the plain Lark subset (rules, alternatives, groups, optionals, quantifiers,
strings, regexes, terminals, `%ignore`/`%import` lines); anything else (llguidance's
`%json {...}`, `@grammar` references, parameterised rules, ...) and the answer is "don't
know" (None): this check refuses only what it understands. Linear in the grammar's size (the
classic worklist over rules' alternatives), so a 10,000-rule chain costs milliseconds.
"""

from __future__ import annotations

import re
from collections import defaultdict

_TOKEN = re.compile(r"""
    (?P<skip>[ \t\r]+|//[^\n]*|\\\n)
  | (?P<nl>\n)
  | (?P<terminal>"(?:\\.|[^"\\\n])*"i?|/(?:\\.|[^/\\\n])+/[imslux]*|<[^<>\n]*>)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<number>-?\d+)
  | (?P<op>->|\.\.|[:|()\[\]?!*+~.,])
  | (?P<other>.)
""", re.X)


class _Unknown(Exception):
    """A construct this reading does not follow."""


def unproductive_start(grammar: str) -> list[str] | None:
    """The rules that no finite string satisfies, `start` first, if `start` is one of them;
    [] if `start` derives some string; None if the grammar is not one this reading follows
    (or has no `start`)."""
    try:
        rules = _rules(_tokens(grammar))
    except _Unknown:
        return None
    if "start" not in rules:
        return None
    heads, needs = [], []  # per alternative: its rule, and the rules it requires
    for name, alternatives in rules.items():
        for required in alternatives:
            heads.append(name)
            needs.append(set(required))
    users = defaultdict(list)
    for i, required in enumerate(needs):
        for name in required:
            users[name].append(i)
    left = [len(required) for required in needs]
    ready = [heads[i] for i, n in enumerate(left) if n == 0]
    productive = set()
    while ready:
        name = ready.pop()
        if name in productive:
            continue
        productive.add(name)
        for i in users[name]:
            left[i] -= 1
            if left[i] == 0:
                ready.append(heads[i])
    if "start" in productive:
        return []
    return ["start"] + sorted(n for n in rules if n not in productive and n != "start" and not n.startswith("("))


def _tokens(grammar: str) -> list[tuple[str, str]]:
    out = []
    # (`%ignore X` changes no rule's language; any other statement, `%import` say, is not followed)
    grammar = re.sub(r"(?m)^[ \t]*%ignore\b[^\n]*$", "", grammar)
    for m in _TOKEN.finditer(grammar):
        kind = m.lastgroup
        if kind == "other":
            raise _Unknown(m.group())
        if kind != "skip":
            out.append((kind, m.group()))
    return out + [("nl", "\n")]


def _rules(tokens: list[tuple[str, str]]) -> dict[str, list[list[str]]]:
    """Rule name -> its alternatives, each the rules it requires (groups become rules of
    their own, named "(n)"; optional parts and terminals require nothing)."""
    rules: dict[str, list[list[str]]] = {}
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        if kind == "nl":
            i += 1
            continue
        if text in ("?", "!") and tokens[i + 1][0] == "name":  # (inlining flags: the same language)
            i += 1
            kind, text = tokens[i]
        if kind != "name":
            raise _Unknown(text)
        j = i + 1
        if tokens[j] == ("op", "."):  # a priority: name.2:
            j += 2
        if tokens[j] != ("op", ":"):
            raise _Unknown(text)
        body, i = _alternatives(tokens, j + 1, rules, None)
        if not text[0].isupper():  # (a terminal: a regex, productive)
            rules.setdefault(text, []).extend(body)
    return rules


def _alternatives(tokens, i, rules, closer):
    """The alternatives from tokens[i] up to `closer` (None: the end of the rule, a newline
    not followed by `|`); the index after it."""
    alternatives, current = [], []
    while True:
        kind, text = tokens[i]
        if closer is None and kind == "nl":
            if i + 1 < len(tokens) and tokens[i + 1] == ("op", "|"):
                i += 1
                continue
            alternatives.append(current)
            return alternatives, i + 1
        if kind == "nl":
            i += 1
            continue
        if (kind, text) == ("op", closer):
            alternatives.append(current)
            return alternatives, i + 1
        if text == "|":
            alternatives.append(current)
            current, i = [], i + 1
            continue
        if text == "->":  # an alias names the alternative: nothing to derive
            i += 2
            continue
        atom, i = _atom(tokens, i, rules)
        kind, text = tokens[i]
        if text in ("?", "*"):
            atom, i = None, i + 1
        elif text == "+":
            i += 1
        elif text == "~":
            low = tokens[i + 1]
            if low[0] != "number":
                raise _Unknown(low[1])
            i += 2
            if tokens[i] == ("op", ".."):
                i += 2
            if int(low[1]) == 0:
                atom = None
        if atom is not None:
            current.append(atom)


def _atom(tokens, i, rules):
    """(the rule an atom requires, or None), the index after it."""
    kind, text = tokens[i]
    if kind == "terminal":
        if tokens[i + 1] == ("op", ".."):  # a range "a".."z"
            return None, i + 3
        return None, i + 1
    if kind == "name":
        return (None if text[0].isupper() else text), i + 1
    if text == "(":
        body, i = _alternatives(tokens, i + 1, rules, ")")
        name = f"({len(rules)})"
        rules[name] = body
        return name, i
    if text == "[":
        _, i = _alternatives(tokens, i + 1, rules, "]")
        return None, i
    raise _Unknown(text)
