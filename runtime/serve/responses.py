"""Responses: a submitted request answered over HTTP — an SSE stream, or the whole JSON once every prompt is
done — and its one log line and metrics."""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from runtime.async_engine import AsyncEngine, RequestHandle
from runtime.engine.llm_engine import failed
from runtime.serve import protocol as api
from runtime.serve.http_errors import HTTPError
from runtime.serve.metrics import ServerMetrics
from runtime.serve.protocols import WRITE_CHUNK_NOW

log = logging.getLogger("nanoinfer.server")
_encode = msgspec.json.Encoder().encode
_DONE = b"data: [DONE]\n\n"


def _sse(item) -> bytes:
    return b"data: " + _encode(item) + b"\n\n"


def _sse_error(err: HTTPError) -> bytes:
    # OpenAI's clients raise on an `error` event (and on any data carrying "error").
    return b"event: error\ndata: " + _encode(api.ErrorResponse(err.body)) + b"\n\n"


async def _disconnected(receive) -> None:
    """Returns when the client goes away (after the body is read, uvicorn's `receive` waits
    for exactly that)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(Response):
    """A request's SSE stream, written as its outputs arrive: each is rendered and written from the engine's report
    callback on the loop (`RequestHandle.listen`), straight to the connection where the server offers that
    (`write_chunk_now`, runtime/serve/protocols.py) and the client keeps up — no task woken per stream per step,
    the front's largest cost a token at a chunk a step (bench/RESULTS.md, issue 60). What cannot go at once (a
    client that reads slower than we write, a server without the extension) waits here, and one task writes it
    as one chunk when it can: that client's stream falls behind, not the engine. The end (its last chunk, or an
    `error` event for a request the engine failed, then `[DONE]`) goes through that task, as ASGI's last send.
    One idle task waits for the client to leave, which aborts what still runs."""

    media_type = "text/event-stream"

    def __init__(self, responder: Responder, rid: str, handles: list[RequestHandle], out):
        self.status_code, self.background = 200, None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        self.responder, self.rid, self.handles, self.out = responder, rid, handles, out
        self.backlog: list[bytes] = []  # written by the task, in order, before anything written at once
        self.ready = asyncio.Event()  # the backlog has something
        self.sending = False  # the task holds bytes ASGI's send has not taken yet: nothing may pass them
        self.write_now = None
        self.status: int | None = None  # set once the stream has ended (its tail in the backlog)

    async def __call__(self, scope, receive, send) -> None:
        self.write_now = scope.get("extensions", {}).get(WRITE_CHUNK_NOW)
        writer = watch = None
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            self.backlog.append(b"".join(map(_sse, self.out.start())))
            self.ready.set()
            for position, handle in enumerate(self.handles):
                handle.listen(functools.partial(self.on_output, position))
            writer = asyncio.ensure_future(self._write(send))
            watch = asyncio.ensure_future(_disconnected(receive))
            await asyncio.wait((writer, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            tasks = [task for task in (writer, watch) if task is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.status is None:  # (the client left, or the send failed: what still runs is aborted)
                self._end(499, b"")
            for handle in self.handles:
                self.responder.engine.release(handle)
        if writer is not None and writer.done() and not writer.cancelled() and writer.exception() is not None:
            raise writer.exception()

    def on_output(self, position: int, delta) -> None:
        """On the loop, as prompt `position`'s output arrives: its chunk written, at once where it can be."""
        if self.status is not None:
            return  # (ended: an abort's output as the handles are released)
        try:
            if delta.error is not None:
                raise failed(delta)
            body = b"".join(map(_sse, self.out.chunks(position, delta)))
            if delta.finished and all(handle.final_seen for handle in self.handles):  # (this one's set first)
                return self._end(200, body + b"".join(map(_sse, self.out.end())))
        except Exception as exc:  # noqa: BLE001 - reported in the stream: the headers are out
            err = HTTPError.of(exc, self.responder.engine.healthy)
            if err.status >= 500:
                log.error("%s failed: %r", self.rid, exc)
            return self._end(err.status, _sse_error(err))
        if not body:
            return  # (tokens that made no text yet: nothing to write)
        if self.backlog or self.sending or self.write_now is None or not self.write_now(body):
            self.backlog.append(body)
            self.ready.set()

    def _end(self, status: int, tail: bytes) -> None:
        self.status = status
        self.backlog.append(tail + _DONE)
        self.ready.set()
        self.responder.finished(self.rid, self.handles, status)

    async def _write(self, send) -> None:
        """The backlog, whenever it has something, as one chunk; the response's last send once it has the end."""
        while True:
            await self.ready.wait()
            self.ready.clear()
            body, last, self.backlog = b"".join(self.backlog), self.status is not None, []
            self.sending = True
            if body or last:
                await send({"type": "http.response.body", "body": body, "more_body": not last})
            self.sending = False
            if last:
                return


class Responder:
    """Answers requests of `engine`, accounting for each in `metrics`."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics):
        self.engine, self.metrics = engine, metrics

    async def answer(self, request: Request, req, handles: list[RequestHandle], out) -> Response:
        """The SSE stream, or the whole response once every prompt is done."""
        request.state.logged = True  # `finished` writes this request's line
        if req.stream:
            return self.stream(out.id, handles, out)
        status = 500
        try:
            results = await self.collect(request, handles)
            status = 200
        except Exception as exc:
            status = HTTPError.of(exc, self.engine.healthy).status
            raise
        finally:
            self.finished(out.id, handles, status)
        return Response(_encode(out.response(results)), media_type="application/json")

    def stream(self, rid: str, handles: list[RequestHandle], out) -> EventStream:
        """SSE of the renderer's chunks, then `[DONE]` (see EventStream). A request the engine fails ends the
        stream with an `error` event first."""
        return EventStream(self, rid, handles, out)

    async def collect(self, request: Request, handles: list[RequestHandle]):
        """Every prompt's whole output. If one prompt fails, or the client leaves, the others
        are aborted (cancelling a collect() aborts its request): no work for a dead response."""
        work = [asyncio.ensure_future(self.engine.collect(h)) for h in handles]
        watch = asyncio.ensure_future(_disconnected(request.receive))
        try:
            pending = {*work, watch}
            while not watch.done() and not all(t.done() for t in work):
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(t.exception() is not None for t in done if t is not watch):
                    break  # one prompt failed: the response is an error, the rest is wasted work
        finally:
            watch.cancel()
            for task in work:
                task.cancel()
            await asyncio.gather(*work, return_exceptions=True)
        failed = next((t.exception() for t in work if not t.cancelled() and t.exception()), None)
        if failed is not None:
            raise failed
        if any(t.cancelled() for t in work):
            raise HTTPError(499, "the client closed the connection", code="client_closed_request")
        return [t.result() for t in work]

    def finished(self, rid: str, handles: list[RequestHandle], status: int) -> None:
        """One log line and the metrics of a finished request (HTTP's or a WebSocket's)."""
        for handle in handles:
            self.metrics.observe(handle)
        now = time.monotonic()
        arrival = min((h.arrival for h in handles), default=now)
        firsts = [h.first_token_at for h in handles if h.first_token_at is not None]
        log.info("%s: %d, prompt %d tokens, output %d tokens, finish %s, ttft %s, total %.0f ms", rid, status,
                 sum(len(h.prompt_ids) for h in handles), sum(h.num_output_tokens for h in handles),
                 ",".join(str(r) for h in handles for r in h.finish_reasons) or "-",
                 f"{(min(firsts) - arrival) * 1e3:.0f} ms" if firsts else "-", (now - arrival) * 1e3)
