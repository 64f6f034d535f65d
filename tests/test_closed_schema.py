"""JSON-schema objects are closed by default (nanoinfer/structured/closed_schema.py): the rewrite itself
(nested objects, arrays, $defs, combinations, what the schema says kept, the input untouched),
the grammar compiled from an open schema refusing undeclared keys, and the default model
answering a named tool and a response_format schema with declared keys only, through the
`openai` client."""

import copy
import functools
import json

import pytest

jsonschema = pytest.importorskip("jsonschema")

from nanoinfer.structured.closed_schema import closed_schema  # noqa: E402
from nanoinfer.structured.grammars import Constraint, grammar_tokenizer
from nanoinfer.structured.spec import GrammarSpec

A = {"type": "object", "properties": {"a": {"type": "integer"}}}
B = {"type": "object", "properties": {"b": {"type": "integer"}}}


def closed(schema: dict) -> dict:
    """`closed_schema`, checked to leave its input as it was."""
    before = copy.deepcopy(schema)
    out = closed_schema(schema)
    assert schema == before
    return out


def valid(schema: dict, text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except jsonschema.ValidationError:
        return False


# -- the rewrite ---------------------------------------------------------------------------------


def test_objects_that_declare_keys_are_closed_wherever_they_sit():
    schema = {"type": "object", "properties": {
        "child": {"type": "object", "properties": {"x": {"type": "string"}}},
        "rows": {"type": "array", "items": {"type": "object", "properties": {"y": {}}}},
        "pair": {"type": "array", "prefixItems": [{"properties": {"p": {}}}, {"type": "integer"}]},
        "maybe": {"anyOf": [{"$ref": "#/$defs/Point"}, {"type": "null"}]},
        "legacy": {"$ref": "#/definitions/Old"},
        "named": {"type": "object", "patternProperties": {"^n_": {"type": "integer"}}}},
        "$defs": {"Point": {"type": "object", "properties": {"x": {}, "y": {}}}},
        "definitions": {"Old": {"properties": {"z": {}}}}}
    out = closed(schema)
    props = out["properties"]
    assert out["additionalProperties"] is False
    assert props["child"]["additionalProperties"] is False
    assert props["rows"]["items"]["additionalProperties"] is False
    assert props["pair"]["prefixItems"][0]["additionalProperties"] is False
    assert "additionalProperties" not in props["pair"]["prefixItems"][1]
    assert out["$defs"]["Point"]["additionalProperties"] is False
    assert out["definitions"]["Old"]["additionalProperties"] is False
    assert props["named"]["additionalProperties"] is False
    assert "additionalProperties" not in props["maybe"] and props["maybe"]["anyOf"][0] == {"$ref": "#/$defs/Point"}
    assert valid(out, '{"child": {"x": "1"}, "rows": [{"y": 1}], "maybe": {"x": 1}, "named": {"n_a": 1}}')
    for extra in ('{"other": 1}', '{"child": {"x": "1", "w": 2}}', '{"rows": [{"y": 1, "w": 2}]}',
                  '{"maybe": {"x": 1, "w": 2}}', '{"legacy": {"w": 1}}', '{"named": {"m": 1}}'):
        assert valid(schema, extra) and not valid(out, extra), extra


@pytest.mark.parametrize("schema", [
    {"type": "object"},  # (no keys declared: any object, as json_object)
    {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
    {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "string"}},
    {"type": "object", "properties": {"a": {}}, "additionalProperties": False},
    {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False},
    {"type": "array", "items": {"type": "string"}},
    {"type": "string", "pattern": "^[a-z]+$"},
    {"not": {"properties": {"a": {}}}},  # (closed, it would allow more, not less)
    {"type": "object", "properties": {"a": {"$ref": "https://example.com/other.json"}}, "allOf": [{"$ref": "#/x"}]},
], ids=["any-object", "explicit-true", "explicit-schema", "explicit-false", "unevaluated", "array", "string", "not",
        "unreadable-ref"])
def test_what_the_schema_says_is_kept(schema):
    assert closed(schema) == schema


def test_an_explicitly_open_member_keeps_its_combination_open():
    schema = {"allOf": [A, {**B, "additionalProperties": True}]}
    assert closed(schema) == schema


def test_allof_members_are_closed_together_not_one_by_one():
    """Each member closed on its own would refuse the other's key: only {} would pass."""
    schema = {"allOf": [A, B]}
    out = closed(schema)
    assert out["allOf"] == schema["allOf"]  # (the members as written)
    assert valid(out, '{"a": 1, "b": 2}') and valid(out, '{"a": 1}')
    assert not valid(out, '{"a": 1, "c": 3}') and not valid(out, '{"a": "x"}')


def test_a_definition_combined_in_one_place_stays_closed_in_the_others():
    schema = {"type": "object", "$defs": {"Base": A},
              "properties": {"child": {"allOf": [{"$ref": "#/$defs/Base"}, B]}, "base": {"$ref": "#/$defs/Base"}}}
    out = closed(schema)
    assert valid(out, '{"child": {"a": 1, "b": 2}, "base": {"a": 1}}')
    for extra in ('{"child": {"a": 1, "c": 2}}', '{"base": {"a": 1, "b": 2}}'):
        assert valid(schema, extra) and not valid(out, extra), extra


def test_branches_beside_properties_allow_the_keys_declared_beside_them():
    schema = {"type": "object", "properties": {"kind": {"type": "string"}},
              "oneOf": [{"properties": {"radius": {"type": "number"}}, "required": ["radius"]},
                        {"properties": {"side": {"type": "number"}}, "required": ["side"]}]}
    out = closed(schema)
    assert valid(out, '{"kind": "circle", "radius": 1}') and valid(out, '{"kind": "square", "side": 2}')
    assert not valid(out, '{"kind": "circle", "radius": 1, "side": 2}')
    assert not valid(out, '{"kind": "circle", "radius": 1, "color": 2}')
    nested = closed({"type": "object", "properties": {"kind": {}},
                     "anyOf": [{"anyOf": [{"properties": {"radius": {}}}]}]})  # (the keys beside, two unions up)
    assert valid(nested, '{"kind": "circle", "radius": 1}') and not valid(nested, '{"kind": "circle", "side": 1}')


def test_unions_combined_allow_the_keys_each_others_alternatives_declare():
    """Each alternative closed over its own keys alone, {"a": 1} would pass A and fail B."""
    schema = {"allOf": [{"anyOf": [A, {"type": "integer"}]}, {"anyOf": [B, {"type": "integer"}]}]}
    out = closed(schema)
    assert valid(out, '{"a": 1}') and valid(out, '{"a": 1, "b": 2}') and valid(out, '1')
    assert not valid(out, '{"a": 1, "c": 3}') and not valid(out, '{"b": "x"}')


def test_a_lone_union_closes_each_alternative():
    out = closed({"anyOf": [A, B]})
    assert "additionalProperties" not in out
    assert [branch["additionalProperties"] for branch in out["anyOf"]] == [False, False]
    assert not valid(out, '{"a": 1, "b": 2}')


def test_pydantic_schemas_are_closed_through_their_refs():
    """pydantic v2 (a $ref with a description beside it) and v1 (an allOf of one $ref) alike."""
    from pydantic import BaseModel, Field

    class Address(BaseModel):
        street: str

    class Person(BaseModel):
        name: str
        home: Address = Field(description="where they live")
        friends: list["Person"] = []

    v2 = Person.model_json_schema()
    v1 = {"type": "object", "properties": {"home": {"allOf": [{"$ref": "#/definitions/Address"}],
                                                    "description": "where they live"}},
          "definitions": {"Address": Address.model_json_schema()}}
    good, extras = '{"name": "A", "home": {"street": "M"}, "friends": []}', (
        '{"name": "A", "home": {"street": "M", "zip": 1}}', '{"name": "A", "home": {"street": "M"}, "age": 3}',
        '{"name": "A", "home": {"street": "M"}, "friends": [{"name": "B", "home": {"street": "M"}, "age": 3}]}')
    assert valid(closed(v2), good) and valid(closed(v1), '{"home": {"street": "M"}}')
    for extra in extras:
        assert valid(v2, extra) and not valid(closed(v2), extra), extra
    assert not valid(closed(v1), '{"home": {"street": "M", "zip": 1}}')


# -- the grammar ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vocab(smollm2_gguf):
    from nanoinfer.loaders.gguf import open_gguf
    from nanoinfer.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(open_gguf(smollm2_gguf), smollm2_gguf)
    return tokenizer, grammar_tokenizer(tokenizer, tokenizer.vocab_size)


def grammar_accepts(vocab, schema: dict, text: str) -> bool:
    """Whether the grammar compiled for `schema` takes `text`'s tokens and may end there."""
    tokenizer, lltok = vocab
    constraint = Constraint(lltok, GrammarSpec("json_schema", schema))
    ok = all(constraint.consume(t) for t in tokenizer.encode(text, add_special_tokens=False))
    return ok and constraint.done


@pytest.mark.parametrize("schema, good, bad", [
    (A, ['{"a":1}', '{}'], ['{"a":1,"b":2}', '{"b":2}']),
    ({"allOf": [A, B]}, ['{"a":1,"b":2}', '{"b":2}'], ['{"a":1,"c":3}']),
    ({"$defs": {"Node": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {
        "type": "array", "items": {"$ref": "#/$defs/Node"}}}, "required": ["v"]}}, "$ref": "#/$defs/Node"},
     ['{"v":1,"kids":[{"v":2,"kids":[]}]}'], ['{"v":1,"kids":[{"v":2,"w":3}]}', '{"v":1,"w":3}']),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
     ['{"a":1,"b":2}'], []),
], ids=["object", "allOf", "recursive", "explicit-true"])
def test_the_compiled_grammar_refuses_undeclared_keys(vocab, schema, good, bad):
    for text in good:
        assert grammar_accepts(vocab, schema, text), text
    for text in bad:
        assert not grammar_accepts(vocab, schema, text), text


# -- the default model, through the openai client ------------------------------------------------


@pytest.fixture(scope="module")
def default_client(smollm2_gguf):
    from openai import OpenAI

    from nanoinfer.loaders import load_model
    from tests.live_server import LiveServer

    with LiveServer(load_model(smollm2_gguf, device="cpu", progress=False), served_model_name="smollm2") as server:
        yield OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


CITY_AND_UNIT = {"type": "object", "properties": {"city": {"type": "string"},
                                                 "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": CITY_AND_UNIT}}


def test_a_named_tool_gets_only_its_declared_arguments(default_client):
    r = default_client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the weather in Vienna?"}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    arguments = json.loads(call.function.arguments)
    assert "city" in arguments and set(arguments) <= {"city", "unit"}, arguments


def test_a_response_format_schema_gets_only_its_declared_keys(default_client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    r = default_client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Describe Ann, aged 31, as JSON."}], max_tokens=100,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 50, r.choices[0].message.content
    assert set(json.loads(r.choices[0].message.content)) <= {"name", "age"}


# -- any schema: closing only narrows, and keeps what uses declared keys ----------------------------


def only_closes(before, after) -> bool:
    """`after` is schema `before` with objects closed and nothing else changed: `additionalProperties:
    false` added, `{}` for keys declared elsewhere, a `$ref` moved into `allOf`."""
    if isinstance(before, list) and isinstance(after, list):
        return len(before) == len(after) and all(map(only_closes, before, after))
    if not (isinstance(before, dict) and isinstance(after, dict)):
        return before == after
    after = dict(after)
    if "$ref" in before and "$ref" not in after:
        moved = after.get("allOf")
        if not (isinstance(moved, list) and moved and moved[-1] == {"$ref": before["$ref"]}):
            return False
        after["$ref"], after["allOf"] = before["$ref"], moved[:-1]
        if "allOf" not in before and after.pop("allOf"):
            return False
    if "additionalProperties" not in before and after.pop("additionalProperties", False) is not False:
        return False
    rest = set(before)
    for kind in ("properties", "patternProperties", "$defs", "definitions"):  # (name -> schema)
        if isinstance(before.get(kind), dict) or kind not in before and kind in after:
            own, named = before.get(kind, {}), after.pop(kind, None)
            if not isinstance(named, dict) or not own.keys() <= named.keys() or any(
                    value != {} or kind not in ("properties", "patternProperties")
                    for key, value in named.items() if key not in own):
                return False
            if not all(only_closes(own[key], named[key]) for key in own):
                return False
            rest.discard(kind)
    return rest == after.keys() and all(only_closes(before[key], after[key]) for key in rest)


KEYWORDS = ["properties", "patternProperties", "additionalProperties", "items", "prefixItems", "allOf", "anyOf",
            "oneOf", "$defs", "definitions", "$ref", "not", "type", "a", "b"]


def test_any_json_is_rewritten_without_error_only_closing_objects():
    """Schemas clients send may be malformed: llguidance names what is wrong, the rewrite never
    fails, leaves its input as it was, and changes nothing but the closing of objects."""
    from hypothesis import given, settings, strategies as st

    refs = st.sampled_from(["#", "#/$defs/a", "#/a/0", "#/x", "x"])
    leaves = st.one_of(st.none(), st.booleans(), st.integers(-2, 2), refs, st.just({}))
    json_values = st.recursive(leaves, lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(KEYWORDS), inner, max_size=4)), max_leaves=30)

    @settings(max_examples=300, deadline=None)
    @given(st.dictionaries(st.sampled_from(KEYWORDS), json_values, max_size=5))
    def check(schema):
        out = closed(schema)
        assert json.loads(json.dumps(out)) == out and only_closes(schema, out), out

    check()
    assert not only_closes(A, {**A, "additionalProperties": True}) and not only_closes(A, {"properties": {"b": {}}})
    assert only_closes({"$ref": "#", "x": 1}, {"allOf": [{"$ref": "#"}], "x": 1, "properties": {"a": {}}})


NAMES = ["a", "b", "c"]


@functools.lru_cache(maxsize=None)
def schemas(depth: int, refs: tuple[str, ...], objects_only: bool = False):
    """Random schemas of objects (nested, $ref with keys beside it, allOf, anyOf, oneOf beside
    properties, explicit additionalProperties), arrays and leaves. `refs`: the $refs that may sit in
    place (not below a property or an item), so that no $ref reaches itself without reading a value."""
    from hypothesis import strategies as st

    leaves = st.sampled_from([{}, {"type": "integer"}, {"type": "object"}, *({"$ref": r} for r in refs)])
    names = st.lists(st.sampled_from(NAMES), min_size=1, max_size=2, unique=True)
    simple = st.builds(lambda keys: {"type": "object", "properties": {key: {} for key in keys}}, names)
    if depth == 0:
        return simple if objects_only else st.one_of(leaves, simple)
    inner, values = schemas(depth - 1, refs), schemas(depth - 1, ("#", "#/$defs/d0", "#/$defs/d1"))
    shapes = schemas(depth - 1, refs, objects_only=True)
    properties = st.dictionaries(st.sampled_from(NAMES), values, min_size=1, max_size=3)
    says = st.sampled_from([{}, {}, {}, {"additionalProperties": True}, {"additionalProperties": False},
                            {"patternProperties": {"^c": {"type": "integer"}}}])
    members = st.lists(inner, min_size=1, max_size=3)
    branches = st.lists(st.one_of(shapes, st.just({"type": "integer"})), min_size=1, max_size=3)  # (one shape each)
    objects = st.one_of(
        st.builds(lambda p, extra: {"type": "object", "properties": p, **extra}, properties, says),
        st.builds(lambda ms: {"allOf": ms}, members),
        st.builds(lambda bs: {"anyOf": bs}, branches),
        st.builds(lambda p, bs: {"properties": p, "oneOf": bs}, properties, branches),
        *(st.builds(lambda p, r=r: {"$ref": r, "properties": p}, properties) for r in refs),
        *([st.sampled_from([{"$ref": r} for r in refs])] if refs else []))
    arrays = st.builds(lambda item: {"type": "array", "items": item}, values)
    return objects if objects_only else st.one_of(leaves, objects, arrays)


def declared_keys_only(schema):
    """The reference for "uses only declared keys": `schema` with every value's object allowing no
    key that its schemas did not evaluate (`unevaluatedProperties: false` where a value is
    described, by schemas that declare or combine), and anyOf read as oneOf (a union's alternative
    is one shape, not a mix of two)."""
    def place(node):
        node = walk(node)
        if isinstance(node, dict) and not {"properties", "patternProperties", "allOf", "$ref", "anyOf",
                                           "oneOf"}.isdisjoint(node) and "additionalProperties" not in node:
            node["unevaluatedProperties"] = False
        return node

    def walk(node):
        if not isinstance(node, dict):
            return node
        out = dict(node)
        if "properties" in node:
            out["properties"] = {key: place(value) for key, value in node["properties"].items()}
        if "items" in node:
            out["items"] = place(node["items"])
        if "$defs" in node:
            out["$defs"] = {key: walk(value) for key, value in node["$defs"].items()}
        for kind in ("allOf", "anyOf", "oneOf"):  # (the generated schemas have no anyOf beside a oneOf)
            if kind in node:
                out["oneOf" if kind == "anyOf" else kind] = [walk(member) for member in out.pop(kind)]
        return out

    return place(schema)


def one_of_as_any_of(node):
    """`node` with its oneOfs read as anyOfs, as llguidance compiles them (it refuses a oneOf whose
    alternatives it cannot prove exclusive). As written, closing alternatives could make an object
    that two of them allowed fit one only, and pass."""
    if isinstance(node, list):
        return [one_of_as_any_of(value) for value in node]
    if isinstance(node, dict):
        return {"anyOf" if key == "oneOf" else key: one_of_as_any_of(value) for key, value in node.items()}
    return node


def test_closing_only_narrows_and_keeps_instances_that_use_declared_keys():
    """Against jsonschema, on random schemas and instances: what the closed schema allows the
    original allows, and what the original allows with only declared keys the closed one does."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    validator = jsonschema.Draft202012Validator
    roots = st.builds(lambda body, d0, d1: {**body, "$defs": {"d0": d0, "d1": d1}},  # (d0 may read d1 in place)
                      schemas(3, ("#/$defs/d0", "#/$defs/d1"), objects_only=True), schemas(2, ("#/$defs/d1",)),
                      schemas(2, ()))
    keys = st.sampled_from([*NAMES, "x"])
    nested = st.recursive(st.sampled_from([0, "s", {}, []]), lambda inner: st.one_of(  # ({}: any object allows it)
        st.lists(inner, max_size=2), st.dictionaries(keys, inner, max_size=3)), max_leaves=6)
    instances = st.dictionaries(keys, nested, max_size=4)
    seen = {"closed": 0, "declared": 0}

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(roots, st.lists(instances, min_size=4, max_size=8))
    def check(schema, objects):
        out = closed(schema)
        assert only_closes(schema, out), out
        original, narrowed = validator(one_of_as_any_of(schema)), validator(one_of_as_any_of(out))
        strict = validator(declared_keys_only(schema))
        for value in objects:
            if narrowed.is_valid(value):
                seen["closed"] += 1
                assert original.is_valid(value), (schema, out, value)
            if original.is_valid(value) and strict.is_valid(value):
                seen["declared"] += 1
                assert narrowed.is_valid(value), (schema, out, value)

    check()
    assert seen["closed"] > 100 and seen["declared"] > 100, seen  # (the generators reach both cases)


# -- the planning bound --------------------------------------------------------------------------

LARGE_SCHEMAS = """
def refs(places, keys, combined=False):  # (pydantic's pattern: every field a $ref to one model)
    fields = {f"p{i}": {"$ref": "#/$defs/B"} for i in range(places)}
    if combined:  # (B combined elsewhere too: each place's closed copy lists B's keys)
        fields["c"] = {"allOf": [{"$ref": "#/$defs/B"}, {"properties": {"z": {}}}]}
    return {"type": "object", "properties": fields,
            "$defs": {"B": {"type": "object", "properties": {f"k{j}": {} for j in range(keys)}}}}

def union(keys):
    return {"allOf": [{"type": "object", "properties": {f"k{j}": {} for j in range(keys)}}, {"properties": {"z": {}}}]}
"""

PLANNED_IN_LINEAR_WORK = LARGE_SCHEMAS + """
import re, resource
import nanoinfer.structured.closed_schema as closing

mapped = int(re.search(r"VmSize:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))

out = closing.closed_schema(refs(10_000, 10_000))  # (B closed in place, the $refs as written)
assert out["$defs"]["B"]["additionalProperties"] is False and out["properties"]["p9999"] == {"$ref": "#/$defs/B"}
out = closing.closed_schema(union(20_000))
assert out["additionalProperties"] is False and len(out["properties"]) == 20_001
schema = refs(10_000, 10_000, combined=True)  # (10^8 keys to list: past the bound, as written)
assert closing.closed_schema(schema) is schema
closing.MAX_VISITS = 10**6  # (room for a union of 150,000 keys: merged key by key, minutes)
assert len(closing.closed_schema(union(150_000))["properties"]) == 150_001
print("ok")
"""


def test_many_refs_to_a_large_definition_plan_in_linear_work():
    """The review's 448 KB schema (10,000 $refs to one definition of 10,000 keys) took 123 s and
    11 GB; an allOf of 20,000 keys and 1, 2.9 s. Run apart, capped at 1 GiB past what it maps and
    a generous minute, so that a quadratic rewrite fails here instead of hanging."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", PLANNED_IN_LINEAR_WORK], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr[-2000:]


def test_the_keys_a_closed_copy_would_list_count_against_the_bound(monkeypatch):
    """200 places closed over a definition's 200 keys list 40,000: within the default bound, closed;
    past a smaller one, compiled as written."""
    import nanoinfer.structured.closed_schema as closing

    builders = {}
    exec(LARGE_SCHEMAS, builders)
    schema = builders["refs"](200, 200, combined=True)
    place = closed(schema)["properties"]["p0"]
    assert len(place["properties"]) == 200 and place["additionalProperties"] is False
    monkeypatch.setattr(closing, "MAX_VISITS", 20_000)
    assert closing.closed_schema(schema) is schema


def test_a_schema_past_the_planning_bound_compiles_as_written(monkeypatch):
    import nanoinfer.structured.closed_schema as closing

    monkeypatch.setattr(closing, "MAX_VISITS", 3)
    schema = {"anyOf": [A, B, A, B]}
    assert closing.closed_schema(schema) is schema
