"""JSON-schema objects are closed by default (nanoinfer/closed_schema.py): the rewrite itself
(nested objects, arrays, $defs, combinations, what the schema says kept, the input untouched),
the grammar compiled from an open schema refusing undeclared keys, and the default model
answering a named tool and a response_format schema with declared keys only, through the
`openai` client."""

import copy
import json

import pytest

jsonschema = pytest.importorskip("jsonschema")

from nanoinfer.closed_schema import closed_schema  # noqa: E402
from nanoinfer.structured import Constraint, GrammarSpec, grammar_tokenizer  # noqa: E402

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
    from nanoinfer.tokenizer import Tokenizer

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


KEYWORDS = ["properties", "patternProperties", "additionalProperties", "items", "prefixItems", "allOf", "anyOf",
            "oneOf", "$defs", "definitions", "$ref", "not", "type", "a", "b"]


def test_any_json_is_rewritten_without_error_and_left_unchanged():
    """Schemas clients send may be malformed: llguidance names what is wrong, the rewrite never fails."""
    from hypothesis import given, settings, strategies as st

    refs = st.sampled_from(["#", "#/$defs/a", "#/a/0", "#/x", "x"])
    leaves = st.one_of(st.none(), st.booleans(), st.integers(-2, 2), refs)
    json_values = st.recursive(leaves, lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(KEYWORDS), inner, max_size=4)), max_leaves=30)

    @settings(max_examples=300, deadline=None)
    @given(st.dictionaries(st.sampled_from(KEYWORDS), json_values, max_size=5))
    def check(schema):
        out = closed(schema)
        assert json.loads(json.dumps(out)) == out

    check()


def test_a_schema_past_the_planning_bound_compiles_as_written(monkeypatch):
    import nanoinfer.closed_schema as closing

    monkeypatch.setattr(closing, "MAX_VISITS", 3)
    schema = {"anyOf": [A, B, A, B]}
    assert closing.closed_schema(schema) is schema
