"""Responses: a submitted request answered over HTTP — an SSE stream, or the whole JSON once every prompt is
done — and its one log line and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from runtime.async_engine import AsyncEngine, RequestHandle
from runtime.serve import protocol as api
from runtime.serve.http_errors import HTTPError
from runtime.serve.metrics import ServerMetrics

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
    """An SSE response: each item of `events` (bytes: every event ready at one wake-up) written with one ASGI
    send. Starlette's StreamingResponse costs an anyio task group and a send per event, per token of every
    stream; this is one task writing and one (idle) waiting for the client to leave, which stops the writer:
    a generator's `finally` runs, and its requests are released."""

    media_type = "text/event-stream"

    def __init__(self, events, unstarted=None):
        """`events`: an async generator of bytes; `unstarted`: called if it never ran (cancelled first), to
        release what it would have (its own `finally` runs only where it started)."""
        self.events, self.unstarted, self.status_code, self.background = events, unstarted, 200, None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        self._started = False

    async def __call__(self, scope, receive, send) -> None:
        writer = watch = None
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            writer = asyncio.ensure_future(self._write(send))
            watch = asyncio.ensure_future(_disconnected(receive))
            await asyncio.wait((writer, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            tasks = [task for task in (writer, watch) if task is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.events.aclose()  # (where a send was cut short: its requests released now, not at collection)
            if not self._started and self.unstarted is not None:
                self.unstarted()
        if writer.done() and not writer.cancelled() and writer.exception() is not None:
            raise writer.exception()

    async def _write(self, send) -> None:
        self._started = True
        async for body in self.events:
            if body:  # (a wake-up whose tokens make no text yet: nothing to write)
                await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


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
        """SSE of the renderer's chunks, then `[DONE]`: what each wake-up brings (a delta of one
        prompt, several tokens of a stream that fell behind) is one write. A request the engine
        fails ends the stream with an `error` event first."""
        async def events():
            status, tail = 499, b""  # until it ends: a client that leaves mid-stream closes it here
            try:
                yield b"".join(map(_sse, out.start()))
                # (closed with this generator, wherever it stops: the requests are released at once)
                async with contextlib.aclosing(self.engine.merge(handles)) as deltas:
                    async for position, delta in deltas:
                        yield b"".join(map(_sse, out.chunks(position, delta)))
                tail = b"".join(map(_sse, out.end()))
                status = 200
            except Exception as exc:  # noqa: BLE001 - reported in the stream: the headers are out
                err = HTTPError.of(exc, self.engine.healthy)
                status = err.status
                if status >= 500:
                    log.error("%s failed: %r", rid, exc)
                tail = _sse_error(err)
            finally:
                self.finished(rid, handles, status)
            yield tail + _DONE

        def unstarted() -> None:  # (cancelled before it ran: as a client that left)
            for handle in handles:
                self.engine.release(handle)
            self.finished(rid, handles, 499)
        return EventStream(events(), unstarted)

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
