"""Tool calling: the parsers (tags and JSON styles; streamed in any pieces, the same as whole),
tools through chat templates that render them and one that does not, and the server with
the official `openai` client: auto, required and a named function, whole and streamed,
tool results fed back."""

import json
import random

import pytest

from nanoinfer.errors import RequestError
from runtime.serve.tool_calls import Call, ToolCallParser, parse_json, parse_tags, template_style, tool_setup

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]


# -- parsing ---------------------------------------------------------------------------------------


def test_parse_tags():
    one = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert parse_tags(one) == ("Let me look.", [Call("get_weather", '{"city": "Paris"}')])
    two = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
           '"{\\"x\\": 1}"}</tool_call>')
    assert parse_tags(two) == (None, [Call("a", "{}"), Call("b", '{"x": 1}')])
    assert parse_tags('<tool_call>{"name": "a", "arguments": {}}') == (None, [Call("a", "{}")])  # (EOS, no close)
    broken = 'Sure <tool_call>{"name": "a", "arguments": {</tool_call>'
    assert parse_tags(broken) == (broken, [])
    assert parse_tags("no calls here") == ("no calls here", [])


def test_parse_json():
    assert parse_json('{"name": "f", "parameters": {"a": 1}}') == (None, [Call("f", '{"a": 1}')])
    assert parse_json(' [{"name": "f", "arguments": {}}, {"name": "g", "parameters": {"b": [2]}}]') == (
        None, [Call("f", "{}"), Call("g", '{"b": [2]}')])
    assert parse_json('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}') == (
        None, [Call("f", "{}"), Call("g", "{}")])
    assert parse_json('{"answer": 42}') == ('{"answer": 42}', [])
    assert parse_json("It is sunny.") == ("It is sunny.", [])


def test_forced_replies_parse():
    """What required and named calls constrain the output to: an array of calls, the arguments."""
    parser = ToolCallParser("required")
    assert parser.feed('[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {"x": 1}}]') == ("", [])
    assert parser.finish() == ("", [Call("a", "{}"), Call("b", '{"x": 1}')])
    parser = ToolCallParser("named", "get_time")
    assert parser.feed('{"zone":') == ("", []) and parser.feed('"UTC"}') == ("", [])
    assert parser.finish() == ("", [Call("get_time", '{"zone":"UTC"}')])


REPLIES = {
    "tags": ["Plain text, no call < at all <tool", "Checking.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
             "{\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>",
             '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"k": '
             '"<tool_call>"}}</tool_call>', 'Oops <tool_call>{"name": broken</tool_call>'],
    "json": ['{"name": "f", "parameters": {"a": 1}}', "[{\"name\": \"f\", \"parameters\": {}}]", "Just text {x}",
             '{"not": "a call"}'],
}


@pytest.mark.parametrize("style", sorted(REPLIES))
def test_streamed_in_any_pieces_equals_whole(style):
    """Each reply cut into random pieces: the content deltas and calls add up to the whole
    reply's parse, and no piece of a call leaks into the content first."""
    rng = random.Random(0)
    for reply in REPLIES[style]:
        whole_content, whole_calls = (parse_tags if style == "tags" else parse_json)(reply)
        for _ in range(30):
            cuts = sorted(rng.sample(range(1, len(reply)), rng.randrange(0, min(8, len(reply) - 1))))
            pieces = [reply[a:b] for a, b in zip([0] + cuts, cuts + [len(reply)])]
            parser, content, calls = ToolCallParser(style), "", []
            for piece in pieces:
                text, new = parser.feed(piece)
                content, calls = content + text, calls + new
            text, new = parser.finish()
            content, calls = content + text, calls + new
            assert calls == whole_calls, (reply, pieces)
            if whole_calls:
                assert content.strip() == (whole_content or ""), (reply, pieces)
            else:
                assert content == reply, (reply, pieces)


# -- templates ---------------------------------------------------------------------------------------

TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
Tools:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
Call with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "tool" %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% elif m.tool_calls %}<|im_start|>assistant
{%- for c in m.tool_calls %}
<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA_LIKE = "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}Respond with {\"name\": ..., " \
             "\"parameters\": ...}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
]


def test_template_styles():
    assert template_style(TOOL_TEMPLATE) == ("tags", True)
    assert template_style(LLAMA_LIKE) == ("json", True)
    assert template_style("{% for m in messages %}{{ m.content }}{% endfor %}") == ("tags", False)


def test_a_template_that_renders_tools_gets_them(smollm2_gguf):
    from nanoinfer.text.chat_template import render_chat_template

    setup = tool_setup(TOOLS, "auto", CONVERSATION, TOOL_TEMPLATE)
    assert setup.messages == CONVERSATION and setup.template_kwargs == {"tools": TOOLS} and setup.grammar is None
    prompt = render_chat_template(TOOL_TEMPLATE, setup.messages, **setup.template_kwargs)
    assert json.dumps(WEATHER) in prompt and '"arguments": {"city": "Paris", "unit": "celsius"}' in prompt
    assert "<tool_response>{\"temp\": 21}</tool_response>" in prompt


def test_a_template_without_tools_gets_them_in_its_system_message(tiny_chat_model):
    template = tiny_chat_model.tokenizer.chat_template
    assert "tools" not in template  # (the default model's: ChatML without tools)
    setup = tool_setup(TOOLS, "auto", [{"role": "system", "content": "Be brief."}, *CONVERSATION], template)
    assert setup.style == "tags" and setup.template_kwargs == {}
    prompt = tiny_chat_model.tokenizer.apply_chat_template(setup.messages)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions")
    assert json.dumps(WEATHER["function"]) in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' \
        in prompt
    assert "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>" in prompt


@pytest.mark.parametrize("tools, choice, message", [
    ("x", "auto", "tools must be a list"),
    ([{"type": "function", "function": {"name": "a b"}}], "auto", "is invalid"),
    ([WEATHER, WEATHER], "auto", "name a function twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "auto", "must be a JSON schema"),
    (TOOLS, "sometimes", "tool_choice='sometimes' is invalid"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
    (None, "required", "tool_choice needs tools"),
])
def test_bad_tools_are_named(tools, choice, message):
    with pytest.raises(RequestError, match=message):
        tool_setup(tools, choice, [{"role": "user", "content": "hi"}], None)


def test_tool_choice_none_is_no_tools():
    assert tool_setup(TOOLS, "none", [{"role": "user", "content": "hi"}], TOOL_TEMPLATE) is None


# -- the server, with the official client ----------------------------------------------------------------


@pytest.fixture(scope="module")
def client(live_server):
    from openai import OpenAI

    return OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0)


MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
          '</tool_call>')


def streamed(stream):
    """A streamed chat completion's choice 0 put back together: (content, calls, finish)."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for call in c.delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_auto_parses_what_the_model_wrote(client):
    """The tiny random model made to write a call (a one-string `choice` grammar): parsed into
    tool_calls, whole and streamed, the text before it as content."""
    kw = dict(model="tiny-chat", messages=MESSAGES, tools=TOOLS, max_tokens=100,
              extra_body={"structured_outputs": {"choice": [FORCED]}})
    r = client.chat.completions.create(**kw)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content == "Checking."
    (call,) = message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    content, calls, finish = streamed(client.chat.completions.create(**kw, stream=True))
    assert content.strip() == "Checking." and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris",
                                                                                         "unit": "celsius"})]
    plain = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                           extra_body={"structured_outputs": {"choice": ["It is sunny."]}})
    assert plain.choices[0].message.content == "It is sunny." and plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason == "stop"


def test_required_and_named_always_parse(client):
    """A model that knows nothing still calls: required gives one call or more, each valid for
    its function; a named function gives that call; both streamed too."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(3):  # (one call: a random model would add calls to the array until max_tokens)
        r = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, seed=seed, parallel_tool_calls=False)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        assert len(r.choices[0].message.tool_calls) == 1
        for call in r.choices[0].message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                       max_tokens=100, seed=1)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), schemas["get_time"])
    content, calls, finish = streamed(client.chat.completions.create(
        model="tiny-chat", messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=100, seed=1, stream=True))
    assert content == "" and finish == "tool_calls" and [c["name"] for c in calls] == ["get_time"]
    assert calls[0]["arguments"] == call.function.arguments  # (the same seed: the same call)


def test_tool_results_are_fed_back(client):
    """The conversation goes on after a call: the assistant's tool_calls and the tool's result
    as messages, in the client's own types."""
    first = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, tools=TOOLS, max_tokens=100,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    r = client.chat.completions.create(model="tiny-chat", messages=messages, tools=TOOLS, max_tokens=8,
                                       extra_body={"structured_outputs": {"choice": ["It is 21 degrees."]}})
    assert r.choices[0].message.content == "It is 21 degrees." and r.usage.prompt_tokens > 80
