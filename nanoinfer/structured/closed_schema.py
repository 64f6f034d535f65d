"""Closed JSON-schema objects: the copy of a client's schema that structured output compiles, in
which an object that names its keys allows no other key unless the schema says it may.

JSON Schema leaves an object open where it says nothing of `additionalProperties`: any other key,
with any value, validates too. A model held to such a schema may write keys nobody declared (the
default model, held to a tool's {"city", "unit"} parameters, wrote {"type": "function", ...}; held
to a response_format schema, {"": 1}, or ran to max_tokens). The peers close these objects:
vLLM's default backend, xgrammar, compiles schemas in its strict mode (as if every object said
`unevaluatedProperties: false`), and llama.cpp's json-schema-to-grammar allows declared keys only
unless `additionalProperties` says otherwise. llguidance, which compiles ours, has no such option,
so `closed_schema` rewrites the schema before it is compiled:

- An object schema that declares `properties` or `patternProperties` and has neither
  `additionalProperties` nor `unevaluatedProperties` gets `"additionalProperties": false`, where it
  sits: the root, properties, items, prefixItems, additionalProperties, $defs and definitions, and
  each anyOf/oneOf branch (an alternative is one shape of object).
- Schemas that describe one object together are closed together: the members of an `allOf`, a
  `$ref` and the keys beside it, `properties` beside anyOf/oneOf branches. Closing each on its own
  would make their intersection refuse the keys the others declare (`allOf: [A, B]` would allow
  only the keys both declare). The object may hold any key one of them declares and no other: the
  schema holding them gets `{}` for each key declared elsewhere and `additionalProperties: false`,
  the members stay as written, and a branch allows its own keys, those declared beside it and
  those the alternatives of the unions combined with its own declare (llama.cpp merges an allOf's
  properties into one closed object the same way).
- What the schema says is kept: `additionalProperties` true or a schema keeps its object open,
  with every schema combined with it; a `$ref` that cannot be read here (not `#...` in the
  document) keeps its object open too; `{"type": "object"}` with no keys declared is any object.
- `not` and `if` are left as written (closing an object there would widen what passes), and so are
  the keywords llguidance does not implement (then, else, dependentSchemas, contains,
  propertyNames): it refuses a schema that uses them anyway.
"""

from __future__ import annotations

from urllib.parse import unquote

Key = tuple[str, str]  # ("properties" | "patternProperties", the name or the pattern)

_KEYS = ("properties", "patternProperties")
_BRANCHES = ("anyOf", "oneOf")
_DEFINITIONS = ("$defs", "definitions")
_ONE_VALUE = ("additionalProperties", "additionalItems", "unevaluatedItems")  # (a schema, or a boolean)
_SHAPED = frozenset((*_KEYS, "allOf", "$ref", *_BRANCHES))  # a schema without these closes nothing
_WALKED = _SHAPED | {*_DEFINITIONS, *_ONE_VALUE, "items", "prefixItems"}  # ... without these, it holds none
# Planning steps: a schema visited, a key merged or checked, a key a closed object will list. A schema
# whose combinations take more compiles as written (open), not after seconds of Python (and gigabytes)
# on the compile thread. Real schemas take a few per subschema and key.
MAX_VISITS = 200_000


def closed_schema(schema: dict) -> dict:
    """A copy of JSON schema `schema` whose objects allow only the keys they declare, unless
    the schema says otherwise (the module's docstring has the rule). `schema` is not changed."""
    if not isinstance(schema, dict):
        return schema
    closer = _Closer(schema)
    try:
        closer.plan()
    except _TooManyVisits:
        return schema
    return closer.rewrite(schema)


class _TooManyVisits(Exception):
    pass


def _declared(node: dict) -> dict[Key, None]:
    """The keys (names and patterns) `node` itself declares, in its order."""
    return {(kind, key): None for kind in _KEYS if isinstance(node.get(kind), dict) for key in node[kind]}


_NO_KEYS: dict[Key, None] = {}


def _says(node: dict) -> bool:
    """`node` says itself which other keys its object may hold."""
    return "additionalProperties" in node or "unevaluatedProperties" in node


def _opens(node: dict) -> bool:
    """`node` allows keys it does not declare (additionalProperties true or a schema), or says so
    with a keyword we do not read (unevaluatedProperties)."""
    return node.get("additionalProperties", False) is not False or "unevaluatedProperties" in node


def _values(node: dict):
    """The subschemas of `node` that describe other values: its properties', its items'."""
    for kind in _KEYS:
        if isinstance(node.get(kind), dict):
            yield from node[kind].values()
    for kind in _ONE_VALUE:
        yield node.get(kind)
    items = node.get("items")
    yield from items if isinstance(items, list) else (items,)  # (a list: draft 4-7's prefixItems)
    if isinstance(node.get("prefixItems"), list):
        yield from node["prefixItems"]


def _subschemas(node: dict):
    """Every subschema of `node` the rule walks: its values', its combinations', its definitions'."""
    yield from _values(node)
    for kind in ("allOf", *_BRANCHES):
        if isinstance(node.get(kind), list):
            yield from node[kind]
    for kind in _DEFINITIONS:
        if isinstance(node.get(kind), dict):
            yield from node[kind].values()


class _Closer:
    """`plan` finds, for each place a value is described, which schemas close its object: the one
    that declares all its keys, in place, or the schema at that place, over the keys all of them
    declare (`closers`); schemas combined with others are `shared`, never closed in place.
    `rewrite` then makes the closed copy.

    Many places describe their value with the same schemas (every `{"$ref": "#/$defs/B"}`), so the
    keys of a set of schemas are merged once and shared, never copied per place (`union`); what a
    place still costs is counted (`step`) against MAX_VISITS, the keys a closed object will list included."""

    def __init__(self, root: dict):
        self.root = root
        self.shared: set[int] = set()  # ids of schemas that describe an object together with others
        self.closers: dict[int, dict[Key, None]] = {}  # id of a schema -> every key its object may hold
        self._planned: set[tuple[int, int]] = set()  # (id of a schema, id of the keys beside it)
        self._in_place: list[tuple[dict, dict, dict[Key, None]]] = []  # (place, its one declaring schema, keys)
        self._declared: dict[int, dict[Key, None]] = {}  # id of a schema -> _declared(it)
        self._unions: dict[tuple[int, ...], dict[Key, None]] = {}  # ids of key sets -> their union
        self._within: dict[tuple[int, int], bool] = {}  # (id of keys, id of a schema) -> it declares them all
        self._visits = 0

    def step(self, work: int = 1) -> None:
        self._visits += work
        if self._visits > MAX_VISITS:
            raise _TooManyVisits

    def plan(self) -> None:
        self.place(self.root)
        todo = [self.root]
        while todo:
            node = todo.pop()
            self.step()
            for value in _values(node):
                self.place(value)
            todo.extend(n for n in _subschemas(node) if isinstance(n, dict) and not _WALKED.isdisjoint(n))
        for node, part, keys in self._in_place:  # (a schema combined elsewhere no longer closes in place)
            if id(part) in self.shared:
                self.close_over(node, keys)

    def place(self, node, beside: dict[Key, None] = _NO_KEYS) -> None:
        """Plan the value `node` describes, where `beside` are the keys declared beside it (it is
        an anyOf/oneOf branch of schemas that declare them; a `union`, so that its id names it)."""
        if not isinstance(node, dict) or _SHAPED.isdisjoint(node) or (id(node), id(beside)) in self._planned:
            return
        self._planned.add((id(node), id(beside)))
        parts, parts_readable = self.describing(node, branches=False)
        everything, readable = self.describing(node, branches=True)
        if not parts_readable or any(_opens(p) for p in parts):  # the object is open: so are its branches
            self.shared.update(id(n) for n in everything)
            return
        declaring = [p for p in parts if self.declared(p)]
        keys = self.union([*(self.declared(n) for n in everything), beside])
        if not readable or any(_opens(n) for n in everything):  # a branch is open: not the schemas around it
            self.shared.update(id(p) for p in parts)
        elif keys and (declaring or beside):  # (a lone anyOf/oneOf: its branches close themselves)
            if len(declaring) == 1 and self.within(keys, declaring[0]):
                self._in_place.append((node, declaring[0], keys))
            else:
                self.close_over(node, keys)
                self.shared.update(id(p) for p in parts if p is not node)
        inner = self.union([beside, *(self.declared(p) for p in declaring)])
        unions = [part[kind] for part in parts for kind in _BRANCHES if isinstance(part.get(kind), list)]
        if len(unions) > 1:  # (each union's alternatives allow the keys the others' declare: they describe one object)
            alternatives = [self.union([self.declared(n) for branch in branches
                                        for n in self.describing(branch, branches=True)[0]]) for branches in unions]
            insides = [self.union([inner, *alternatives[:i], *alternatives[i + 1:]]) for i in range(len(unions))]
        else:
            insides = [inner] * len(unions)
        for branches, inside in zip(unions, insides):
            for branch in branches:
                self.place(branch, inside)

    def declared(self, node: dict) -> dict[Key, None]:
        """`_declared(node)`, read once per schema (and the same dict each time: `union` keys on it)."""
        keys = self._declared.get(id(node))
        if keys is None:
            keys = self._declared[id(node)] = _declared(node)
            self.step(len(keys))
        return keys

    def union(self, key_sets: list[dict[Key, None]]) -> dict[Key, None]:
        """The keys in `key_sets` (each `declared`'s or a `union`), in order: merged once for the
        same sets, and shared (never changed). Its id names it while the plan lasts."""
        key_sets = [keys for keys in key_sets if keys]
        if len(key_sets) <= 1:
            return key_sets[0] if key_sets else _NO_KEYS
        ids = tuple(id(keys) for keys in key_sets)
        merged = self._unions.get(ids)
        if merged is None:
            self.step(sum(map(len, key_sets)))
            merged = self._unions[ids] = {k: None for keys in key_sets for k in keys}
        return merged

    def within(self, keys: dict[Key, None], part: dict) -> bool:
        """`part` itself declares every one of `keys`."""
        own = self.declared(part)
        if keys is own:
            return True
        if (id(keys), id(part)) not in self._within:
            self.step(len(keys))
            self._within[id(keys), id(part)] = keys.keys() <= own.keys()
        return self._within[id(keys), id(part)]

    def close_over(self, node: dict, keys: dict[Key, None]) -> None:
        """Close `node`'s object over `keys` (with those it got from other places): each is a key
        the closed copy lists, so each is a step."""
        self.step(len(keys))
        self.closers.setdefault(id(node), {}).update(keys)

    def describing(self, node: dict, branches: bool) -> tuple[list[dict], bool]:
        """The schemas that describe the value `node` describes: itself, its allOf members and
        $ref targets (with `branches`, its anyOf/oneOf branches too), recursively; and whether
        every $ref among them could be read."""
        found, readable, todo, seen = [], True, [node], set()
        while todo:
            n = todo.pop()
            if not isinstance(n, dict) or id(n) in seen:
                continue
            seen.add(id(n))
            found.append(n)
            self.step()
            if "$ref" in n:
                target = self.resolve(n["$ref"])
                readable &= target is not None
                todo.append(target)
            for kind in ("allOf", *(_BRANCHES if branches else ())):
                if isinstance(n.get(kind), list):
                    todo.extend(reversed(n[kind]))
        return found, readable

    def resolve(self, ref) -> dict | None:
        """The subschema a local `$ref` ("#", "#/$defs/Name", any JSON pointer) points to; None
        for another document's, an anchor's, or a pointer to nothing here."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        pointer, node = unquote(ref[1:]), self.root
        if pointer and not pointer.startswith("/"):
            return None
        for token in pointer.split("/")[1:] if pointer else ():
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and token in node:
                node = node[token]
            elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
                node = node[int(token)]
            else:
                return None
        return node if isinstance(node, dict) else None

    def rewrite(self, node):
        """The closed copy of `node` (what is not walked is shared with the input, unchanged)."""
        if not isinstance(node, dict) or _WALKED.isdisjoint(node):
            return node
        out = dict(node)
        for kind in (*_KEYS, *_DEFINITIONS):
            if isinstance(node.get(kind), dict):
                out[kind] = {key: self.rewrite(value) for key, value in node[kind].items()}
        for kind in (*_ONE_VALUE, "items"):
            if kind in node:
                value = node[kind]
                out[kind] = [self.rewrite(v) for v in value] if isinstance(value, list) else self.rewrite(value)
        for kind in ("prefixItems", "allOf", *_BRANCHES):
            if isinstance(node.get(kind), list):
                out[kind] = [self.rewrite(value) for value in node[kind]]
        if not (_says(node) or id(node) in self.shared):
            self.close(node, out)
        return out

    def close(self, node: dict, out: dict) -> None:
        """Close `out`, the copy of `node`: over the keys `plan` found its object may hold, or
        its own. (A malformed `properties` is left for llguidance to name.)"""
        keys = self.closers.get(id(node))
        if any(kind in node and not isinstance(node[kind], dict) for kind in _KEYS) or not isinstance(
                node.get("allOf", []), list):
            return
        if keys:
            for kind, key in keys:  # (out's properties are rewrite's own copies: filled in place, not copied per key)
                out.setdefault(kind, {}).setdefault(key, {})  # ({}: what the schemas that declare it say)
            if "$ref" in out:  # (llguidance refuses a recursive $ref with keys beside it; in an allOf, the same)
                out["allOf"] = [*out.get("allOf", ()), {"$ref": out.pop("$ref")}]
            out["additionalProperties"] = False
        elif _declared(node):
            out["additionalProperties"] = False
