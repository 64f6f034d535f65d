"""POST /tokenize and /detokenize as vLLM serves them (a prompt or chat messages in; ids,
count, max_model_len out; ids back to text), driven with httpx against the live server: the
ids are the ones a completion or a chat completion of the same input would run on."""

import httpx
import openai
import pytest

from tests.live_server import LiveServer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0)


def post(live_server, path: str, body: dict) -> httpx.Response:
    return httpx.post(live_server.url + path, json=body, timeout=60)


def test_a_prompt_is_tokenized_as_a_completion_would_run_it(client, live_server):
    prompt = "The capital of France is Paris, naïvely 🙂"
    r = post(live_server, "/tokenize", {"model": "tiny-chat", "prompt": prompt})
    assert r.status_code == 200, r.text
    body = r.json()
    tokenizer = live_server.engine.tokenizer
    assert body["tokens"] == tokenizer.encode(prompt) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == live_server.engine.core.max_model_len and body["token_strs"] is None
    completion = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=1)
    assert completion.usage.prompt_tokens == body["count"]
    plain = post(live_server, "/tokenize", {"prompt": prompt, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(prompt, add_special_tokens=False)


@pytest.mark.parametrize("body", [{"prompt": "Hello there, world"}, {"messages": MESSAGES}])
def test_token_strings_are_each_tokens_text(live_server, body):
    """Each token's text as logprobs name it (vLLM gives the vocabulary's raw strings, "Ġworld")."""
    r = post(live_server, "/tokenize", {**body, "return_token_strs": True}).json()
    tokenizer = live_server.engine.tokenizer
    assert r["token_strs"] == [tokenizer.decode([t], skip_special_tokens=False) for t in r["tokens"]]
    assert "".join(r["token_strs"]) == tokenizer.decode(r["tokens"], skip_special_tokens=False)


@pytest.mark.parametrize("flags", [{}, {"add_generation_prompt": False}, {"tools": [WEATHER]},
                                   {"chat_template_kwargs": {"add_generation_prompt": False}}])
def test_messages_are_tokenized_as_a_chat_completion_would_run_them(client, live_server, flags):
    r = post(live_server, "/tokenize", {"messages": MESSAGES, **flags})
    assert r.status_code == 200, r.text
    chat = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=1,
                                          tools=flags.get("tools", openai.NOT_GIVEN), extra_body={
                                              k: v for k, v in flags.items() if k != "tools"})
    assert r.json()["count"] == chat.usage.prompt_tokens == len(r.json()["tokens"])


def test_continue_final_message_tokenizes_the_prefilled_reply(live_server):
    prefilled = [*MESSAGES, {"role": "assistant", "content": "The capital of France is"}]
    body = post(live_server, "/tokenize", {"messages": prefilled, "add_generation_prompt": False,
                                           "continue_final_message": True}).json()
    text = post(live_server, "/detokenize", {"tokens": body["tokens"]}).json()["prompt"]
    assert text.endswith("The capital of France is")
    both = post(live_server, "/tokenize", {"messages": prefilled, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message", both.text


def test_detokenize_gives_back_the_text(live_server):
    prompt = "Hello, world: ünïcödé and \n newlines"
    ids = post(live_server, "/tokenize", {"prompt": prompt, "add_special_tokens": False}).json()["tokens"]
    r = post(live_server, "/detokenize", {"model": "tiny-chat", "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": prompt}
    assert post(live_server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path,body,status,param,message", [
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model", "not served here"),
    ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model", "not served here"),
    ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens", r"token id 49152 .*0 <= id < 49152"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", r"token id -1 .*0 <= id < 49152"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens", "Expected `array`"),
    ("/tokenize", {"content": "llama-server's field"}, 400, "prompt", "prompt"),
    ("/tokenize", {"prompt": ["a", "b"]}, 400, "prompt", "Expected `str`"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages", "wizard"),
])
def test_bad_requests_are_named(live_server, path, body, status, param, message):
    import re

    r = post(live_server, path, body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert re.search(message, r.json()["error"]["message"]), r.text


def test_the_tokenizer_routes_take_the_api_key(tiny_chat_model):
    with LiveServer(tiny_chat_model, api_key="s3cret") as server:
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            assert httpx.post(server.url + path, json=body).status_code == 401
            keyed = httpx.post(server.url + path, json=body, headers={"Authorization": "Bearer s3cret"})
            assert keyed.status_code == 200, keyed.text
