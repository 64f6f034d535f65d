"""EventStream: a request's SSE chunks written from the engine's report callback, at once where the connection takes
them, else through one task, in order either way (runtime/serve/responses.py, runtime/serve/protocols.py)."""

from __future__ import annotations

import asyncio
import types

import pytest

from runtime.engine.outputs import CompletionOutput, RequestOutput
from runtime.request_book import RequestHandle
from runtime.serve.protocols import WRITE_CHUNK_NOW, write_chunk_now
from runtime.serve.responses import EventStream


class Renderer:
    """Each delta's text as one event's data; `end` a last event."""

    def start(self):
        return []

    def chunks(self, position, delta):
        return [f"{position}:{c.text}" for c in delta.outputs]

    def end(self):
        return ["end"]


class Responder:
    def __init__(self):
        self.released, self.finished_with = [], []
        self.engine = types.SimpleNamespace(release=self.released.append, healthy=True)

    def finished(self, rid, handles, status):
        self.finished_with.append(status)


def handle() -> RequestHandle:
    state = types.SimpleNamespace(finished=False)
    return RequestHandle(state)


def output(text: str, finished: bool = False, error=None) -> RequestOutput:
    return RequestOutput("r", None, (), (CompletionOutput(0, text, (1,), "stop" if finished else None),), finished,
                         None, 0, error)


def event(data: str) -> bytes:
    return b'data: "' + data.encode() + b'"\n\n'


class Connection:
    """The ASGI side: what `send` got, what `write_now` wrote (while `accepting`), all in one byte order."""

    def __init__(self, with_write_now: bool = True):
        self.wire: list[tuple[str, bytes]] = []
        self.accepting = True
        self.more_body = None
        self.left = asyncio.Event()
        self.scope = {"extensions": {WRITE_CHUNK_NOW: self.write_now}} if with_write_now else {}

    def write_now(self, body: bytes) -> bool:
        if not self.accepting:
            return False
        self.wire.append(("now", body))
        return True

    async def send(self, message):
        if message["type"] == "http.response.body":
            await asyncio.sleep(0)  # (ASGI's send may wait: anything written meanwhile must queue behind it)
            self.wire.append(("send", message["body"]))
            self.more_body = message["more_body"]

    async def receive(self):
        await self.left.wait()
        return {"type": "http.disconnect"}

    def text(self) -> bytes:
        return b"".join(body for _, body in self.wire)


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_chunks_go_out_at_once_and_in_order_when_the_connection_waits():
    async def main():
        responder, h, conn = Responder(), handle(), Connection()
        stream = EventStream(responder, "r", [h], Renderer())
        task = asyncio.ensure_future(stream(conn.scope, conn.receive, conn.send))
        await _settle()
        h.put(output("a"))  # the connection takes it: written from here, no task woken
        assert conn.wire[-1] == ("now", event("0:a"))
        conn.accepting = False  # the client reads slower than we write
        h.put(output("b"))
        h.put(output("c"))
        conn.accepting = True
        h.put(output("d"))  # (taken now, but "b" and "c" wait: it queues behind them)
        assert [body for how, body in conn.wire if how == "now"] == [event("0:a")]
        await _settle()
        h.put(output("e", finished=True))
        await asyncio.wait_for(task, 5)
        assert conn.text() == b"".join(map(event, ["0:a", "0:b", "0:c", "0:d", "0:e", "end"])) + b"data: [DONE]\n\n"
        assert conn.more_body is False and responder.finished_with == [200] and responder.released == [h]

    asyncio.run(main())


@pytest.mark.parametrize("with_write_now", [True, False])
def test_the_same_bytes_with_or_without_the_servers_writer_and_outputs_before_the_stream_started(with_write_now):
    async def main():
        responder, handles, conn = Responder(), [handle(), handle()], Connection(with_write_now)
        handles[1].put(output("early"))  # (arrived before the response ran: kept, then written first)
        stream = EventStream(responder, "r", handles, Renderer())
        task = asyncio.ensure_future(stream(conn.scope, conn.receive, conn.send))
        await _settle()
        handles[0].put(output("x"))
        handles[1].put(output("y", finished=True))
        await _settle()
        handles[0].put(output("z", finished=True))
        await asyncio.wait_for(task, 5)
        assert conn.text() == b"".join(map(event, ["1:early", "0:x", "1:y", "0:z", "end"])) + b"data: [DONE]\n\n"
        assert responder.finished_with == [200]

    asyncio.run(main())


def test_a_failed_request_ends_with_an_error_event_and_a_client_that_leaves_aborts():
    async def main():
        responder, h, conn = Responder(), handle(), Connection()
        task = asyncio.ensure_future(EventStream(responder, "r", [h], Renderer())(conn.scope, conn.receive, conn.send))
        await _settle()
        h.put(output("a"))
        h.put(output("", finished=True, error=RuntimeError("the device failed")))
        await asyncio.wait_for(task, 5)
        assert b"event: error\n" in conn.text() and conn.text().endswith(b"data: [DONE]\n\n")
        assert responder.finished_with == [500]

        responder, h, conn = Responder(), handle(), Connection()
        task = asyncio.ensure_future(EventStream(responder, "r", [h], Renderer())(conn.scope, conn.receive, conn.send))
        await _settle()
        h.put(output("a"))
        conn.left.set()
        await asyncio.wait_for(task, 5)
        h.put(output("b"))  # (an abort's output as it is released: nothing more is written)
        assert responder.finished_with == [499] and responder.released == [h]
        assert conn.text() == event("0:a")  # (nobody is left to read an end)

    asyncio.run(main())


class Transport:
    def __init__(self):
        self.written = []

    def write(self, data):
        self.written.append(data)


def test_write_chunk_now_writes_a_chunk_only_where_uvicorns_send_would_at_once():
    def cycle(**changes):
        fields = dict(disconnected=False, flow=types.SimpleNamespace(write_paused=False), response_started=True,
                      response_complete=False, chunked_encoding=True, transport=Transport())
        return types.SimpleNamespace(**{**fields, **changes})

    ok = cycle()
    assert write_chunk_now(ok, b"data: 1\n\n") and ok.transport.written == [b"9\r\ndata: 1\n\n\r\n"]
    assert write_chunk_now(ok, b"") and len(ok.transport.written) == 1  # (an empty chunk would end the response)
    for refused in (dict(disconnected=True), dict(flow=types.SimpleNamespace(write_paused=True)),
                    dict(response_started=False), dict(response_complete=True), dict(chunked_encoding=False)):
        c = cycle(**refused)
        assert not write_chunk_now(c, b"x") and c.transport.written == [], refused
