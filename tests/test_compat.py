"""What clients written for vLLM and llama.cpp expect of an OpenAI server, from the OpenAI API
reference and vLLM's documented behaviour, driven by the official `openai` client: chat
template flags, tool-calling edge cases, completions echo and logprobs, prompt logprobs, and
the validation peers apply."""

import json
import math
import re

import httpx
import jsonschema
import openai
import pytest

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PREFILLED = [*MESSAGES, {"role": "assistant", "content": "The capital of France is"}]


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0)


def post(live_server, path, body):
    return httpx.post(live_server.url + path, json={"model": "tiny-chat", **body}, timeout=60)


def still_serves(client):
    r = client.completions.create(model="tiny-chat", prompt="The sea", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason == "length"


# -- chat template flags -------------------------------------------------------------------------


def render(live_server, messages, **flags) -> list[int]:
    tokenizer = live_server.engine.tokenizer
    return tokenizer.encode(tokenizer.apply_chat_template(messages, **flags), add_special_tokens=False)


@pytest.mark.parametrize("kwargs", [{"add_generation_prompt": False}, {"messages": []}, {"bos_token": "<s>"}])
def test_chat_template_kwargs_that_the_engine_also_sets_are_merged_not_a_500(client, live_server, kwargs):
    r = post(live_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1,
                                                    "chat_template_kwargs": kwargs})
    if "messages" in kwargs:  # (the conversation is the request's `messages`: named, a 400)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    else:
        assert r.status_code == 200, r.text
        flags = {"add_generation_prompt": kwargs.get("add_generation_prompt", True)}
        assert r.json()["usage"]["prompt_tokens"] == len(render(live_server, MESSAGES, **flags))
    still_serves(client)


def test_add_generation_prompt_false_renders_no_assistant_turn(client, live_server):
    r = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=1,
                                       extra_body={"add_generation_prompt": False})
    assert r.usage.prompt_tokens == len(render(live_server, MESSAGES, add_generation_prompt=False))
    assert r.usage.prompt_tokens < len(render(live_server, MESSAGES))


def test_continue_final_message_continues_the_prefilled_reply(client, live_server):
    r = client.chat.completions.create(model="tiny-chat", messages=PREFILLED, max_tokens=8, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    # The prompt ends inside the assistant turn, right after its text: the same tokens as the
    # conversation with an assistant turn opened, then the prefilled text.
    tokenizer = live_server.engine.tokenizer
    expected = tokenizer.apply_chat_template(MESSAGES) + "The capital of France is"
    assert r.usage.prompt_tokens == len(tokenizer.encode(expected, add_special_tokens=False))
    plain = client.completions.create(model="tiny-chat", prompt=expected, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == plain.choices[0].text


def test_continue_final_message_with_add_generation_prompt_is_a_400(live_server):
    r = post(live_server, "/v1/chat/completions", {"messages": PREFILLED, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_continue_final_message_matches_transformers(live_server):
    transformers = pytest.importorskip("transformers")
    from nanoinfer.text.chat_template import render_chat_template

    template = live_server.engine.tokenizer.chat_template
    for content in ("The capital of France is", "Trailing space ", "x"):
        messages = [*MESSAGES, {"role": "assistant", "content": content}]
        ours = render_chat_template(template, messages, add_generation_prompt=False, continue_final_message=True)
        theirs = transformers.utils.chat_template_utils.render_jinja_template(
            [messages], chat_template=template, add_generation_prompt=False, continue_final_message=True)[0][0]
        assert ours == theirs


# -- tool calling edge cases -------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"options": {"$ref": "#/$defs/WeatherOptions"}},
    "required": ["options"], "additionalProperties": False,
    "$defs": {"WeatherOptions": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
                                 "required": ["unit"], "additionalProperties": False}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                              "additionalProperties": False}}}


def test_required_tool_call_with_defs_refs_is_forced_and_valid(client):
    """pydantic's `$ref` into `$defs` stays reachable when the tools are wrapped together."""
    r = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, tools=[WEATHER, CLOCK],
                                       tool_choice="required", parallel_tool_calls=False, max_tokens=200,
                                       temperature=0)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_required_tools_schema_keeps_each_tools_defs(live_server):
    from runtime.serve.tool_calls import tool_setup

    setup = tool_setup([WEATHER, CLOCK], "required", list(MESSAGES), None)
    schema = setup.grammar.schema
    jsonschema.validate([{"name": "get_weather", "parameters": {"options": {"unit": "celsius"}}}], schema)
    jsonschema.validate([{"name": "get_time", "parameters": {}}], schema)
    for bad in ([{"name": "get_weather", "parameters": {"options": {"unit": "kelvin"}}}],
                [{"name": "get_time", "parameters": {"options": {"unit": "celsius"}}}], []):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


@pytest.mark.parametrize("parameters", [{"type": "object", "properties": {"x": {"$ref": "#/$defs/Missing"}}},
                                        {"type": "object", "properties": {"x": {"type": "frobnicate"}}}])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "broken"}}])
def test_a_bad_tool_schema_is_a_400_naming_tools(client, live_server, parameters, tool_choice):
    broken = {"type": "function", "function": {"name": "broken", "parameters": parameters}}
    r = post(live_server, "/v1/chat/completions", {"messages": MESSAGES, "tools": [broken],
                                                    "tool_choice": tool_choice})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    still_serves(client)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_cut_off_by_max_tokens_returns_no_call(client, tool_choice, stream):
    kw = dict(model="tiny-chat", messages=MESSAGES, tools=[WEATHER], tool_choice=tool_choice, max_tokens=3,
              temperature=0)
    if not stream:
        r = client.chat.completions.create(**kw)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "length"
        assert not message.tool_calls and not message.content
        return
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.tool_calls for d in deltas) and not "".join(d.content or "" for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


# -- completions: echo, logprobs, prompt logprobs ---------------------------------------------------


def engine_prompt_logprobs(live_server, prompt, k):
    """The engine's own prompt logprobs for `prompt` (the reference the API's must equal)."""
    from nanoinfer import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=k)
    return live_server.call(live_server.engine.generate(prompt, params)).prompt_logprobs


def test_echo_with_max_tokens_0_scores_the_prompt(client, live_server):
    prompt = "The capital of France is Paris"
    r = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    ids = live_server.engine.tokenizer.encode(prompt)
    lp = choice.logprobs
    assert choice.text == prompt and r.usage.completion_tokens == 0
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    reference = engine_prompt_logprobs(live_server, prompt, 1)
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in reference[1:]], abs=1e-5)
    assert "".join(lp.tokens) == prompt and lp.text_offset[0] == 0


def test_echo_prefixes_the_prompt_and_its_logprobs(client):
    prompt = "The sea is"
    plain = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
    echoed = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=4, temperature=0, logprobs=2,
                                       echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    lp, generated = echoed.choices[0].logprobs, plain.choices[0].logprobs
    n = len(lp.tokens) - len(generated.tokens)
    assert lp.tokens[n:] == generated.tokens
    assert lp.token_logprobs[n:] == pytest.approx(generated.token_logprobs, abs=1e-5)
    assert [o - len(prompt) for o in lp.text_offset[n:]] == generated.text_offset
    streamed = list(client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=4, temperature=0,
                                              echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text
    assert streamed[0].choices[0].text.startswith(prompt)


def test_max_tokens_0_without_echo_is_a_400(live_server):
    r = post(live_server, "/v1/completions", {"prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("k", [0, 1, 3])
def test_completion_top_logprobs_always_list_the_sampled_token(client, k):
    r = client.completions.create(model="tiny-chat", prompt="The sea", max_tokens=24, temperature=1.5, seed=3,
                                  logprobs=k)
    lp = r.choices[0].logprobs
    sizes = []
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == pytest.approx(value) and k <= len(top) <= k + 1 or len(top) < k
        sizes.append(len(top))
    # (a temperature of 1.5 samples some token outside the top k, which then makes k + 1)
    assert k + 1 in sizes


def test_prompt_logprobs_on_completions_and_chat(client, live_server):
    prompt = "One two three four"
    r = post(live_server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    reference = engine_prompt_logprobs(live_server, prompt, 2)
    assert entries[0] is None and len(entries) == len(reference)
    for entry, ref in zip(entries[1:], reference[1:]):
        assert entry[str(ref.token_id)]["logprob"] == pytest.approx(ref.logprob, abs=1e-5)
        ranked = sorted((e["rank"], int(t)) for t, e in entry.items() if e["rank"] is not None)
        assert [t for _, t in ranked] == [t for t, _ in ref.top] and [r for r, _ in ranked] == [1, 2]
        assert all(set(e) == {"logprob", "rank", "decoded_token"} for e in entry.values())
    chat = post(live_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 0})
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert all(len(e) == 1 and math.isfinite(next(iter(e.values()))["logprob"]) for e in body["prompt_logprobs"][1:])
    assert post(live_server, "/v1/completions", {"prompt": "x", "max_tokens": 1}).json()["choices"][0][
        "prompt_logprobs"] is None


def test_prompt_logprobs_cannot_stream(live_server):
    r = post(live_server, "/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


# -- validation as peers apply it ---------------------------------------------------------------------


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": MESSAGES, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "seed": 1 << 63}, "seed"),
    ("/v1/chat/completions", {"messages": MESSAGES, "seed": -(1 << 63) - 1}, "seed"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
])
def test_what_peers_refuse_is_a_400(client, live_server, path, body, param):
    r = post(live_server, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    still_serves(client)


def test_int64_seeds_at_the_edges_are_served(client):
    for seed in ((1 << 63) - 1, -(1 << 63)):
        r = client.completions.create(model="tiny-chat", prompt="The sea", max_tokens=2, seed=seed, n=2)
        assert len(r.choices) == 2


# -- system_fingerprint ------------------------------------------------------------------------------


def test_responses_and_chunks_carry_one_system_fingerprint(client):
    """As OpenAI sends it ("fp_" and hex digits), the same for every response of this server."""
    chat = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=2)
    completion = client.completions.create(model="tiny-chat", prompt="The sea", max_tokens=2)
    chunks = [*client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=2, stream=True,
                                              stream_options={"include_usage": True}),
              *client.completions.create(model="tiny-chat", prompt="The sea", max_tokens=2, stream=True)]
    fingerprints = {chat.system_fingerprint, completion.system_fingerprint, *(c.system_fingerprint for c in chunks)}
    assert len(fingerprints) == 1 and re.fullmatch(r"fp_[0-9a-f]{10}", fingerprints.pop())
