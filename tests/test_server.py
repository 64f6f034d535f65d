"""The OpenAI-compatible server, driven by the official `openai` client and raw HTTP."""

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from tests.live_server import LiveServer

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0)


def metric(url, name) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def wait_drained(url, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(url, "nanoinfer_requests_running") == 0 and metric(url, "nanoinfer_kv_blocks_used") == 0 \
                and metric(url, "nanoinfer_requests_waiting") == 0:
            return True
        time.sleep(0.02)
    return False


def test_models_and_health(client, live_server):
    assert [m.id for m in client.models.list().data] == ["tiny-chat"]
    assert httpx.get(live_server.url + "/health").json() == {"status": "ok"}


def test_chat_completion(client):
    r = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=12, seed=3, temperature=0.8)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 12 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens > 10  # the chat template's system turn is counted


def test_completion_n2_seed_usage(client):
    r = client.completions.create(model="tiny-chat", prompt="Once upon a time", max_tokens=8, n=2, seed=11,
                                  temperature=1.0)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.choices[0].text != r.choices[1].text  # two samples, not one repeated
    assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens == 4
    again = client.completions.create(model="tiny-chat", prompt="Once upon a time", max_tokens=8, n=2, seed=11,
                                      temperature=1.0)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]


def test_stream_equals_non_stream(client):
    kw = dict(model="tiny-chat", messages=MESSAGES, max_tokens=20, seed=5, temperature=0.9)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    text = client.completions.create(model="tiny-chat", prompt="abc", max_tokens=10, seed=1).choices[0].text
    streamed = client.completions.create(model="tiny-chat", prompt="abc", max_tokens=10, seed=1, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text


def test_stop_and_max_tokens(client):
    base = client.completions.create(model="tiny-chat", prompt="The sea", max_tokens=16, temperature=0).choices[0]
    assert base.finish_reason == "length"
    stop = base.text[3:7]
    cut = client.completions.create(model="tiny-chat", prompt="The sea", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == base.text[: base.text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_eight_identical_concurrent_seeded_requests(live_server):
    async def go():
        aclient = openai.AsyncOpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0)
        rs = await asyncio.gather(*(aclient.chat.completions.create(
            model="tiny-chat", messages=MESSAGES, max_tokens=16, seed=42, temperature=1.0) for _ in range(8)))
        await aclient.close()
        return [r.choices[0].message.content for r in rs]
    texts = asyncio.run(go())
    assert len(set(texts)) == 1 and texts[0]


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b'["a list"]', 400, None),
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": "ten"}).encode(), 400, "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "x", "temperature": -0.5}).encode(), 400, "temperature"),
    ("/v1/completions", json.dumps({"prompt": "x", "top_p": 7}).encode(), 400, "top_p"),
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "x", "n": 0}).encode(), 400, "n"),
    ("/v1/completions", json.dumps({"prompt": [1, "a"]}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": [10**9]}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"max_tokens": 5}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": "x", "model": "gpt-9"}).encode(), 404, "model"),
    ("/v1/completions", json.dumps({"prompt": "word " * 3000}).encode(), 400, "prompt"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(), 400,
     "messages"),
    ("/v1/chat/completions", json.dumps({"messages": []}).encode(), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"messages": "hi"}).encode(), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"messages": MESSAGES, "stop": 5}).encode(), 400, "stop"),
    ("/v1/chat/completions", b"x" * (2 << 20), 413, None),
    # Issue 10: invalid UTF-8 and deep nesting were 500s.
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 100_000
     + b"]" * 100_000 + b"}", 400, None),
    # Issue 10: max_tokens beyond the context was silently capped (vLLM answers 400).
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2048}).encode(), 400, "max_tokens"),
    # Issue 10: parameters whose effect we do not implement were silently ignored.
    ("/v1/chat/completions", json.dumps({"messages": MESSAGES, "response_format": {"type": "xml"}}).encode(),
     400, "response_format"),
    ("/v1/chat/completions", json.dumps({"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}}).encode(), 400,
     "response_format"),
    ("/v1/completions", json.dumps({"prompt": "x", "guided_regex": "(unclosed"}).encode(), 400, "guided_regex"),
    ("/v1/completions", json.dumps({"prompt": "x", "guided_choice": ["a"], "response_format": {
        "type": "json_object"}}).encode(), 400, "guided_choice"),
    ("/v1/chat/completions", json.dumps({"messages": MESSAGES, "tools": [{"type": "function", "function": {
        "name": "bad name!"}}]}).encode(), 400, "tools"),
    ("/v1/chat/completions", json.dumps({"messages": MESSAGES, "tools": [{"type": "retrieval"}]}).encode(), 400,
     "tools"),
    ("/v1/chat/completions", json.dumps({"messages": MESSAGES, "tool_choice": "required"}).encode(), 400,
     "tool_choice"),
    ("/v1/chat/completions", json.dumps({"messages": MESSAGES, "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}).encode(), 400, "tool_choice"),
    ("/v1/chat/completions", json.dumps({"messages": MESSAGES, "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": "required", "response_format": {"type": "json_object"}}).encode(), 400,
     "tool_choice"),
    ("/v1/completions", json.dumps({"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}).encode(),
     400, "tools"),
    ("/v1/completions", json.dumps({"prompt": "x", "suffix": "y"}).encode(), 400, "suffix"),
    ("/v1/completions", json.dumps({"prompt": "x", "use_beam_search": True}).encode(), 400, "use_beam_search"),
    # Issue 10: n is bounded (sequences are what admission counts).
    ("/v1/completions", json.dumps({"prompt": "x", "n": 17}).encode(), 400, "n"),
    ("/v1/completions", json.dumps({"prompt": ["x"] * 100, "n": 16}).encode(), 400, "n"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS, ids=[f"{i}" for i in range(len(BAD_REQUESTS))])
def test_malformed_requests_get_4xx_and_the_server_keeps_serving(live_server, path, body, status, param):
    r = httpx.post(live_server.url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    ok = httpx.post(live_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1


def test_dropped_streams_free_everything(live_server):
    async def go():
        async with httpx.AsyncClient(timeout=30) as http:
            async def drop_after(k):
                body = {"messages": MESSAGES, "max_tokens": 400, "stream": True, "temperature": 1.0}
                async with http.stream("POST", live_server.url + "/v1/chat/completions", json=body) as r:
                    seen = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            seen += 1
                            if seen > k:
                                return  # leave: the connection closes mid-stream
            await asyncio.gather(*(drop_after(k % 7) for k in range(100)))
    asyncio.run(go())
    assert wait_drained(live_server.url)
    assert metric(live_server.url, "nanoinfer_requests_running") == 0
    assert metric(live_server.url, "nanoinfer_kv_blocks_used") == 0


def test_metrics_exposes_latency_histograms(live_server):
    httpx.post(live_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    text = httpx.get(live_server.url + "/metrics").text
    for name in ("nanoinfer_requests_running", "nanoinfer_requests_waiting", "nanoinfer_kv_blocks_used",
                 "nanoinfer_kv_blocks_total", "nanoinfer_preemptions_total", "nanoinfer_generated_tokens_total",
                 "nanoinfer_time_to_first_token_seconds_bucket", "nanoinfer_inter_token_latency_seconds_count"):
        assert name in text, name
    assert metric(live_server.url, "nanoinfer_time_to_first_token_seconds_count") >= 1


def test_api_key(tiny_chat_model):
    with LiveServer(tiny_chat_model, api_key="s3cret") as server:
        body = {"prompt": "hi", "max_tokens": 2}
        assert httpx.post(server.url + "/v1/completions", json=body).status_code == 401
        wrong = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        right = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert right.status_code == 200
        assert httpx.get(server.url + "/health").status_code == 200  # only /v1/* is guarded
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.models.list().data[0].id == "tiny-chat"


@pytest.mark.slow
def test_full_queue_is_503_with_retry_after(tiny_chat_model):
    with LiveServer(tiny_chat_model, max_pending=2, engine_kw={"max_num_seqs": 1}) as server:
        async def go():
            async with httpx.AsyncClient(timeout=30) as http:
                body = {"prompt": "hi", "max_tokens": 200, "temperature": 1.0}
                return await asyncio.gather(*(http.post(server.url + "/v1/completions", json=body)
                                              for _ in range(6)))
        statuses = [r.status_code for r in asyncio.run(go())]
        busy = [r for r in asyncio.run(go()) if r.status_code == 503]
        assert 503 in statuses and 200 in statuses
        assert busy and busy[0].headers["retry-after"] == "1" and busy[0].json()["error"]["type"] == "overloaded_error"
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_unhealthy_engine_is_503(tiny_chat_model, monkeypatch):
    from runtime.engine.faults import EngineDead

    with LiveServer(tiny_chat_model) as server:
        def broken_step():
            raise EngineDead("the device failed: CUDA error: an illegal memory access was encountered")
        monkeypatch.setattr(server.engine.core, "step", broken_step)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and "illegal memory access" in r.json()["error"]["message"]
        assert httpx.get(server.url + "/health").status_code == 503
        again = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert again.status_code == 503 and again.json()["error"]["type"] == "server_error"


def test_logprobs_in_both_formats_and_penalties(client, live_server):
    r = client.completions.create(model="tiny-chat", prompt="The sea", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    assert all(len(top) <= 3 and max(top.values()) >= v - 1e-6 for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    c = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == c.choices[0].message.content
    streamed = list(client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=4, temperature=0,
                                                   logprobs=True, top_logprobs=2, stream=True))
    got = [t.logprob for ch in streamed if ch.choices and ch.choices[0].logprobs
           for t in ch.choices[0].logprobs.content]
    assert got == pytest.approx([t.logprob for t in content], abs=1e-5)
    # Penalties and bias reach the sampler: a huge bias on one token makes greedy pick it.
    biased = client.completions.create(model="tiny-chat", prompt="The sea", max_tokens=3, temperature=0,
                                       logit_bias={"42": 100})
    assert httpx.post(live_server.url + "/v1/completions", json={"prompt": "x", "presence_penalty": 5}).status_code == 400
    assert biased.choices[0].text == live_server.engine.tokenizer.decode([42, 42, 42])
    # The tiny model's greedy text repeats itself within 60 tokens; a frequency penalty breaks that.
    plain = client.completions.create(model="tiny-chat", prompt="The sea", max_tokens=60, temperature=0)
    pen = client.completions.create(model="tiny-chat", prompt="The sea", max_tokens=60, temperature=0,
                                    frequency_penalty=2.0)
    ids = live_server.engine.tokenizer.encode(plain.choices[0].text)
    assert len(set(ids)) < len(ids), "precondition: the plain output repeats a token"
    assert pen.choices[0].text != plain.choices[0].text


def test_several_token_id_prompts(client):
    r = client.completions.create(model="tiny-chat", prompt=[[1, 2, 3], [4, 5]], max_tokens=2, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.prompt_tokens == 5


def test_response_ids_are_openai_shaped_and_never_repeat(client):
    ids = [client.completions.create(model="tiny-chat", prompt=[1, 2], max_tokens=1).id for _ in range(3)]
    ids.append(client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=1).id)
    assert all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids[:3]), ids
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", ids[3]) and len(set(ids)) == 4, ids


def test_harmless_and_unknown_fields_pass(client, caplog):
    r = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=3, user="u1", store=False,
                                       response_format={"type": "text"}, tool_choice="none",
                                       extra_body={"some_future_field": 1})
    assert r.choices[0].message.content is not None
    assert any("some_future_field" in m for m in caplog.messages)


def test_errors_for_unknown_routes_and_methods_are_json(live_server):
    r = httpx.get(live_server.url + "/v1/nowhere")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(live_server.url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed" and "allow" in r.headers
    assert httpx.get(live_server.url + "/v1/models/tiny-chat").json()["id"] == "tiny-chat"
    r = httpx.get(live_server.url + "/v1/models/gpt-9")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_openai_endpoints_not_served_say_so(client):
    """The official client calling an endpoint a generation server lacks gets it named."""
    with pytest.raises(openai.NotFoundError, match="POST /v1/embeddings: this OpenAI endpoint is not supported by "
                                                   "this server .*POST /v1/chat/completions") as caught:
        client.embeddings.create(model="tiny-chat", input="hello")
    assert caught.value.code == "unsupported_endpoint"


def test_only_json_bodies_are_read(live_server):
    r = httpx.post(live_server.url + "/v1/completions", content=json.dumps({"prompt": "hi"}),
                   headers={"content-type": "text/plain"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    r = httpx.post(live_server.url + "/v1/completions", content=json.dumps({"prompt": "hi", "max_tokens": 2}),
                   headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_a_loopback_server_answers_only_loopback_host_names(tiny_chat_model):
    with LiveServer(tiny_chat_model) as server:
        body = {"prompt": "hi", "max_tokens": 2}
        evil = httpx.post(server.url + "/v1/completions", json=body, headers={"host": "evil.example:8000"})
        assert evil.status_code == 400 and evil.json()["error"]["param"] == "host"
        assert httpx.get(server.url + "/", headers={"host": "evil.example"}).status_code == 400
        assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200
        port = server.url.rsplit(":", 1)[1]
        assert httpx.post(server.url + "/v1/completions", json=body,
                          headers={"host": f"localhost:{port}"}).status_code == 200


def test_the_host_check_covers_every_route_and_parses_the_header_strictly(tiny_chat_model):
    """Issue 31: /static/* and 404 answers took any Host, `127.0.0.1:PORT@evil.example` passed
    (the name was what came before the last colon), and the WebSocket took any."""
    with LiveServer(tiny_chat_model) as server:
        port = server.url.rsplit(":", 1)[1]
        for path in ("/static/vendor/VENDOR.md", "/v1/nowhere", "/nowhere", "/health"):
            r = httpx.get(server.url + path, headers={"host": "evil.example"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "host", (path, r.text)
            assert httpx.get(server.url + path).status_code != 400, path
        for host in (f"127.0.0.1:{port}@evil.example", "evil.example#127.0.0.1", "127.0.0.1:http", "127.0.0.1:",
                     "[::1", "localhost:1:2", "127.0.0.1 :80", "", "::1"):
            r = httpx.get(server.url + "/health", headers={"host": host})
            assert r.status_code == 400 and r.json()["error"]["param"] == "host", (host, r.text)
        for host in (f"127.0.0.1:{port}", "LOCALHOST", f"[::1]:{port}", "[::1]"):
            assert httpx.get(server.url + "/health", headers={"host": host}).status_code == 200, host
        ws = pytest.importorskip("websockets.sync.client")
        with pytest.raises(Exception, match="400"):
            ws.connect(server.url.replace("http", "ws") + "/v1/chat/ws", additional_headers={"host": "evil.example"})
        import socket  # (two Host headers, the allowed one first: httptools passes both, h11 refused them)

        for path in (b"/health", b"/v1/chat/ws"):
            with socket.create_connection(("127.0.0.1", int(port)), timeout=5) as raw:
                raw.sendall(b"GET " + path + b" HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\nUpgrade: "
                            b"websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                            b"Sec-WebSocket-Version: 13\r\n\r\n")
                assert raw.recv(1024).startswith(b"HTTP/1.1 400"), path


def test_allowed_hosts_names_what_a_server_on_other_addresses_answers(tiny_chat_model):
    """Issue 31: binding a non-loopback address turned the check off, with no way to list names."""
    from runtime.serve.server_config import ServerConfig, allowed_hosts

    assert allowed_hosts(ServerConfig()) == ("localhost", "127.0.0.1", "[::1]", "::1")
    assert allowed_hosts(ServerConfig(host="0.0.0.0")) is None  # (any, as before: say which with --allowed-hosts)
    assert allowed_hosts(ServerConfig(host="0.0.0.0", allowed_hosts=("*",))) is None
    assert allowed_hosts(ServerConfig(host="10.1.2.3", allowed_hosts=("llm.lan",))) == (
        "localhost", "127.0.0.1", "[::1]", "::1", "10.1.2.3", "llm.lan")
    with LiveServer(tiny_chat_model, host="0.0.0.0", allowed_hosts=("llm.lan",)) as server:
        assert httpx.get(server.url + "/health", headers={"host": "llm.lan:8000"}).status_code == 200
        assert httpx.get(server.url + "/health", headers={"host": "LLM.lan"}).status_code == 200
        r = httpx.get(server.url + "/health", headers={"host": "evil.example"})
        assert r.status_code == 400 and "--allowed-hosts" in r.json()["error"]["message"]


def test_a_slow_body_is_a_408_and_a_client_that_leaves_is_no_error(tiny_chat_model, caplog):
    """Issue 31: a body announced as 1,000,000 bytes of which 10 came held its connection for
    ever, and each client that left mid-body logged an ERROR traceback."""
    import socket

    with LiveServer(tiny_chat_model, timeout_body=0.5) as server:
        host, port = server.url[len("http://"):].split(":")
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000000\r\n\r\n")
        with socket.create_connection((host, int(port)), timeout=10) as slow:
            slow.sendall(head + b'{"prompt":')
            answer = b""
            while chunk := slow.recv(4096):  # (until the server closes the connection)
                answer += chunk
        status, _, body = answer.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 408"), answer
        assert json.loads(body)["error"]["message"] == ("the request body did not arrive within 0.5 s (10 of 1000000 "
                                                        "bytes came; --timeout-body)")
        with caplog.at_level("INFO", logger="nanoinfer.server"):
            for _ in range(3):
                with socket.create_connection((host, int(port)), timeout=10) as leaving:
                    leaving.sendall(head + b'{"prompt":')
                time.sleep(0.1)
            deadline = time.monotonic() + 10
            while sum("closed the connection" in r.getMessage() for r in caplog.records) < 3:
                assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
                time.sleep(0.05)
        assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_client_that_leaves_a_non_streaming_request_aborts_it(live_server):
    """Issue 10, bug 5: it kept generating (here ~1,900 tokens) for no one."""
    body = {"prompt": "hi", "max_tokens": 1900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live_server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    before = metric(live_server.url, "nanoinfer_generated_tokens_total")
    assert wait_drained(live_server.url, timeout=1.0), "still generating after the client left"
    assert metric(live_server.url, "nanoinfer_generated_tokens_total") - before < 1000
    assert metric(live_server.url, 'nanoinfer_requests_total{finish_reason="abort"}') >= 1


def test_metrics_count_requests_tokens_and_latencies(live_server):
    before = metric(live_server.url, "nanoinfer_prompt_tokens_total")
    r = httpx.post(live_server.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3})
    assert r.status_code == 200
    assert metric(live_server.url, "nanoinfer_prompt_tokens_total") == before + 3
    assert metric(live_server.url, 'nanoinfer_requests_total{finish_reason="length"}') >= 1
    for name in ("nanoinfer_e2e_request_latency_seconds_count", "nanoinfer_request_queue_time_seconds_count"):
        assert metric(live_server.url, name) >= 1


def test_slow_and_oversized_request_heads_are_cut_off(tiny_chat_model):
    """uvicorn has no deadline for a request's head: one byte every few seconds would hold a
    connection for ever (runtime/serve/protocols.py adds one), and httptools no bound on its
    size: a head over --max-header-bytes is refused (431) before it grows further."""
    import socket

    with LiveServer(tiny_chat_model, timeout_headers=0.5, max_header_bytes=4096, max_body_bytes=32768) as server:
        host, port = server.url[len("http://"):].split(":")
        with socket.create_connection((host, int(port)), timeout=5) as slow:
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")  # ...and never the blank line
            time.sleep(1.0)
            slow.sendall(b"X-Late: 1\r\n")  # still trickling in: too late
            assert slow.recv(1024) == b""  # closed
        with socket.create_connection((host, int(port)), timeout=5) as kept:
            # A connection kept alive gets a new deadline for each request's head.
            for _ in range(3):
                kept.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
                assert kept.recv(1024).startswith(b"HTTP/1.1 200")
                time.sleep(0.3)
        with socket.create_connection((host, int(port)), timeout=5) as big:
            # (a head that arrives whole in one read, at most uvicorn's 64 KiB, is parsed before
            # any limit applies: the bound is on what is held unfinished)
            big.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 8192)
            reply = big.recv(1024)
            assert reply.startswith(b"HTTP/1.1 431") and b"4096 bytes" in reply, reply
            assert big.recv(1024) == b""  # closed
        with socket.create_connection((host, int(port)), timeout=5) as endless:
            sent = 0
            with pytest.raises(OSError):  # (reset, or a closed pipe, once the server has closed it)
                while sent < 1 << 20:
                    endless.sendall(b"X-More: " + b"b" * 1000 + b"\r\n")
                    sent += 1010
                    time.sleep(0.001)
        assert sent < 1 << 20
        with socket.create_connection((host, int(port)), timeout=5) as early:
            # A body the server refuses before reading it (over --max-body-bytes) is no head: its answer stands.
            body = b'{"prompt": "' + b"x" * 60_000 + b'"}'
            early.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(body))
            for i in range(0, len(body), 1000):
                early.sendall(body[i:i + 1000])
            answer = b""
            while chunk := early.recv(65536):  # (until the server closes: its answer and nothing after)
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 413") and b"431" not in answer, answer[:300]
        assert httpx.get(server.url + "/health").status_code == 200


def test_a_failed_prompt_aborts_its_siblings(poisoned_server):
    """Review of issue 10: the other prompts of a failed non-streaming request kept generating."""
    from tests.test_faults import POISON

    r = httpx.post(poisoned_server.url + "/v1/completions",
                   json={"prompt": [[POISON, 1, 2], [3, 4, 5]], "max_tokens": 1500, "ignore_eos": True}, timeout=30)
    assert r.status_code == 500
    assert wait_drained(poisoned_server.url, timeout=2.0), "the healthy sibling is still generating"


def test_usage_reports_the_prompt_tokens_found_in_the_prefix_cache(client, live_server):
    messages = [{"role": "system", "content": "You answer in one word. " * 10}, {"role": "user", "content": "Hi"}]
    hits_before = metric(live_server.url, "nanoinfer_prefix_cache_hits_total")
    first = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=2, temperature=0)
    again = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens > 40
    cached = again.usage.prompt_tokens_details.cached_tokens
    # all but the last token's block (at least one token is computed for the logits)
    assert again.usage.prompt_tokens - 16 <= cached < again.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens < cached
    assert metric(live_server.url, "nanoinfer_prefix_cache_hits_total") >= hits_before + cached
    assert metric(live_server.url, "nanoinfer_prefix_cache_queries_total") >= 2 * again.usage.prompt_tokens


@pytest.mark.slow
def test_shutdown_drains_then_ends_what_is_left_with_errors(tiny_chat_model):
    """Issue 31: on SIGTERM a non-streaming request in flight got 200 with finish_reason "abort"
    and a WebSocket's requests only a close 1012. Now the server takes no new requests (503)
    while those in flight get --shutdown-timeout seconds, then ends the rest with an error. The
    server is serve()'s; SIGTERM sets its should_exit, as this test does (no signals in a thread)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from runtime.async_engine import AsyncEngine, engine_config
    from runtime.serve.server_config import ServerConfig
    from runtime.serve.serving import build_server
    from tests.live_server import start_in_thread

    ws_client = pytest.importorskip("websockets.sync.client")
    engine = AsyncEngine(tiny_chat_model, engine_config(num_blocks=2048, block_size=16))
    step = engine.core.step

    def slow_step(*args, **kw):  # (10 ms more a step: 2,000 tokens take over 20 s, 30 well under the grace)
        time.sleep(0.01)
        return step(*args, **kw)
    engine.core.step = slow_step
    server = build_server(engine, ServerConfig(port=0, shutdown_timeout=5.0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    url = start_in_thread(server, thread)
    ws_url = url.replace("http://", "ws://") + "/v1/chat/ws"
    long, short = {"prompt": "hi", "max_tokens": 2000, "ignore_eos": True}, {"prompt": "hi", "max_tokens": 30,
                                                                             "ignore_eos": True}

    def stream() -> list[str]:
        with httpx.stream("POST", url + "/v1/completions", json={**long, "stream": True}, timeout=60) as r:
            return [line for line in r.iter_lines() if line]

    def in_flight(n: int) -> None:
        deadline = time.monotonic() + 30
        while engine.num_in_flight < n:
            assert time.monotonic() < deadline
            time.sleep(0.01)

    try:
        with ThreadPoolExecutor(4) as pool, ws_client.connect(ws_url) as ws:
            ws.send(json.dumps({"type": "request", "id": "ws-long", "body": {
                "messages": MESSAGES, "max_tokens": 2000, "ignore_eos": True}}))
            streamed = pool.submit(stream)
            waited = pool.submit(httpx.post, url + "/v1/completions", json=long, timeout=60)
            in_flight(3)
            finishing = pool.submit(httpx.post, url + "/v1/completions", json=short, timeout=60)
            in_flight(4)
            server.should_exit = True  # (what SIGTERM does)
            deadline = time.monotonic() + 10
            while (health := httpx.get(url + "/health")).status_code == 200:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            # Draining: new requests are refused, on HTTP and on the WebSocket, new and open.
            assert health.status_code == 503 and health.json() == {"status": "shutting down"}
            refused = httpx.post(url + "/v1/completions", json=short)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            ws.send(json.dumps({"type": "request", "id": "ws-late", "body": {"messages": MESSAGES}}))
            with pytest.raises(Exception, match="503"):
                ws_client.connect(ws_url)
            got: dict[str, dict] = {}
            while set(got) != {"ws-long", "ws-late"}:
                message = json.loads(ws.recv(timeout=30))
                if message["type"] != "chunk":
                    got[message["id"]] = message
            # What finishes within the grace period is answered as usual...
            done = finishing.result()
            assert done.status_code == 200 and done.json()["choices"][0]["finish_reason"] == "length"
            assert done.json()["usage"]["completion_tokens"] == 30
            # ...and what does not ends with an error, on each of the three paths.
            cut = waited.result()
            assert cut.status_code == 503 and cut.json()["error"]["code"] == "shutting_down"
            assert "--shutdown-timeout" in cut.json()["error"]["message"]
            lines = streamed.result()
            assert lines[-1] == "data: [DONE]" and lines[-3] == "event: error"
            assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "shutting_down"
            assert got["ws-long"]["type"] == "error" and got["ws-long"]["error"]["code"] == "shutting_down"
            assert got["ws-late"]["type"] == "error" and got["ws-late"]["error"]["code"] == "shutting_down"
        thread.join(30)
        assert not thread.is_alive() and engine.num_in_flight == 0
    finally:
        server.should_exit = True
        thread.join(30)


def test_a_chat_template_that_does_not_compile_stops_the_server_at_start(tiny_chat_model):
    """The template compiles when the app is made (a plain prompt never compiles it): a broken one
    is a CheckpointError naming the tokenizer's file before the server serves anything."""
    import copy
    import types

    from nanoinfer.errors import CheckpointError
    from runtime.serve.server import create_app

    tokenizer = copy.copy(tiny_chat_model.tokenizer)
    tokenizer.chat_template = "{% for message in messages %}"  # (never closed)
    with pytest.raises(CheckpointError, match=tokenizer.source):
        create_app(types.SimpleNamespace(tokenizer=tokenizer))
