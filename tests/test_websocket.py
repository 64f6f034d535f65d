"""The chat WebSocket endpoint (runtime/serve/websocket.py) with a real WebSocket client against the
live server: several requests on one connection, the SSE stream's chunk objects, cancel,
bad messages answered without closing, and a closed connection aborting its requests."""

import json
import time

import httpx
import pytest

ws_client = pytest.importorskip("websockets.sync.client")

MESSAGES = [{"role": "user", "content": "Name three colors."}]


def ws_url(live_server) -> str:
    return live_server.url.replace("http://", "ws://") + "/v1/chat/ws"


def body(**kw) -> dict:
    return {"model": "tiny-chat", "messages": MESSAGES, "temperature": 0, "max_tokens": 12, **kw}


def receive_until_done(ws, ids: set[str]) -> dict[str, list[dict]]:
    """Every message per id until each id is done or failed."""
    got: dict[str, list[dict]] = {i: [] for i in ids}
    open_ids = set(ids)
    while open_ids:
        message = json.loads(ws.recv(timeout=60))
        got[message["id"]].append(message)
        if message["type"] in ("done", "error"):
            open_ids.discard(message["id"])
    return got


def text_of(messages: list[dict]) -> str:
    return "".join(m["chunk"]["choices"][0]["delta"].get("content") or ""
                   for m in messages if m["type"] == "chunk" and m["chunk"]["choices"])


def wait_idle(live_server, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while live_server.engine.num_seqs_in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_server.engine.num_seqs_in_flight == 0


def test_two_requests_on_one_connection_stream_what_sse_streams(live_server):
    reference = httpx.post(live_server.url + "/v1/chat/completions", json=body(), timeout=60).json()
    reference_long = httpx.post(live_server.url + "/v1/chat/completions", json=body(max_tokens=20), timeout=60).json()
    with ws_client.connect(ws_url(live_server)) as ws:
        ws.send(json.dumps({"type": "request", "id": "a", "body": body()}))
        ws.send(json.dumps({"type": "request", "id": "b", "body": body(max_tokens=20,
                                                                        stream_options={"include_usage": True})}))
        got = receive_until_done(ws, {"a", "b"})
    for rid, ref in (("a", reference), ("b", reference_long)):
        assert got[rid][-1] == {"type": "done", "id": rid}
        chunks = [m["chunk"] for m in got[rid] if m["type"] == "chunk"]
        assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert text_of(got[rid]) == ref["choices"][0]["message"]["content"]
        assert any(c["choices"] and c["choices"][0]["finish_reason"] == ref["choices"][0]["finish_reason"]
                   for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == reference_long["usage"]["completion_tokens"]


def test_cancel_aborts_one_request_and_bad_messages_are_answered(live_server):
    with ws_client.connect(ws_url(live_server)) as ws:
        ws.send("not json")
        message = json.loads(ws.recv(timeout=30))
        assert message["type"] == "error" and message["id"] is None and "invalid message" in message["error"]["message"]
        ws.send(json.dumps({"type": "request", "id": "bad", "body": body(temperature="hot")}))
        message = json.loads(ws.recv(timeout=30))
        assert (message["type"], message["id"], message["error"]["param"]) == ("error", "bad", "temperature")
        ws.send(json.dumps({"type": "cancel", "id": "nothing"}))
        message = json.loads(ws.recv(timeout=30))
        assert (message["id"], message["error"]["message"]) == ("nothing", "no running request with id 'nothing'")
        ws.send(json.dumps({"type": "request", "id": "long", "body": body(max_tokens=2000, ignore_eos=True)}))
        first = json.loads(ws.recv(timeout=60))
        assert first["type"] == "chunk"
        ws.send(json.dumps({"type": "cancel", "id": "long"}))
        got = receive_until_done(ws, {"long"})["long"]
        assert got[-1]["type"] == "error" and got[-1]["error"]["code"] == "cancelled"
        assert len(text_of(got)) < 2000
        wait_idle(live_server)
        ws.send(json.dumps({"type": "request", "id": "after", "body": body()}))  # (the connection still serves)
        assert receive_until_done(ws, {"after"})["after"][-1]["type"] == "done"


def test_closing_the_connection_aborts_its_requests(live_server):
    with ws_client.connect(ws_url(live_server)) as ws:
        for rid in ("x", "y"):
            ws.send(json.dumps({"type": "request", "id": rid, "body": body(max_tokens=2000, ignore_eos=True)}))
        seen = set()
        while seen != {"x", "y"}:  # (both started: the second may be submitted after the first's first chunk)
            message = json.loads(ws.recv(timeout=60))
            assert message["type"] == "chunk"
            seen.add(message["id"])
        assert live_server.engine.num_seqs_in_flight == 2
    wait_idle(live_server)
