"""The OpenAI-compatible HTTP server: create_app(engine, config) -> a Starlette app with SSE streaming.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{id}], GET /health,
GET /metrics, GET / (the chat page). Every error is OpenAI-shaped JSON and the server keeps
serving: a bad request is a 4xx naming the field, a request the engine fails ends alone (a
500 or, mid-stream, an SSE `error` event then `[DONE]`), and only a dead device makes it 503.
A client that disconnects, streaming or not, aborts its requests. A Host header the server
does not answer is refused before any route (DNS rebinding); a shutdown drains (_Server.drain).

The API's types are in runtime/serve/protocol.py and their mapping to the engine's SamplingParams
and outputs in runtime/serve/api_mapping.py; this file is the HTTP side: reading, checking,
routing, streaming.
"""

from __future__ import annotations

import asyncio
import gc
import contextlib
import hmac
import html
import logging
import re
import time
import uuid
from importlib import resources
from typing import Callable, Sequence

import msgspec
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from runtime.serve.api_mapping import (ChatRenderer, CompletionRenderer, chat_inputs, completion_params,
                                       completion_prompts, param_of)
from runtime.serve import protocol as api
from runtime.async_engine import AsyncEngine, RequestHandle
from runtime.serve.config import ServerConfig, allowed_hosts
from runtime.serve.http_errors import HTTPError, error_response
from runtime.serve.metrics import ServerMetrics
from runtime.serve.websocket import ChatSocket, refuse

log = logging.getLogger("nanoinfer.server")
_encode = msgspec.json.Encoder().encode
# A Host header as RFC 9110 has it: a name or IPv4 address, or an IPv6 address in brackets, then
# an optional numeric port. Anything else (`127.0.0.1:80@evil.example`) is refused, not guessed at.
_HOST = re.compile(r"(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9._-]+))(?::[0-9]{1,5})?")
MAX_UNKNOWN_FIELDS_LOGGED = 100
# OpenAI's endpoints a client may try that a generation server does not have: named as such.
OPENAI_ROUTES_NOT_SERVED = ("/v1/embeddings", "/v1/responses", "/v1/audio", "/v1/images", "/v1/moderations",
                            "/v1/files", "/v1/batches", "/v1/fine_tuning", "/v1/assistants", "/v1/threads",
                            "/v1/vector_stores", "/v1/edits", "/v1/uploads", "/v1/realtime")
ROUTES_SERVED = ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /v1/models/{id}",
                 "WebSocket /v1/chat/ws")


def _sse(item) -> bytes:
    return b"data: " + _encode(item) + b"\n\n"


def _sse_error(err: HTTPError) -> bytes:
    # OpenAI's clients raise on an `error` event (and on any data carrying "error").
    return b"event: error\ndata: " + _encode(api.ErrorResponse(err.body)) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (after the body is read, uvicorn's `receive` waits
    for exactly that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Server:
    """The state one app serves from: the engine, its name, settings (limits) and metrics."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig):
        self.engine, self.config = engine, config
        self.model_name = config.served_model_name or engine.model.model_id
        hosts = allowed_hosts(config)
        self.allowed_hosts = None if hosts is None else \
            {f"[{h}]" if ":" in h and not h.startswith("[") else h for h in map(str.lower, hosts)}
        self.cors_origins = frozenset(o.lower() for o in config.cors_origin)
        self.metrics = ServerMetrics(engine)
        self.created = int(time.time())
        self._unknown_fields_logged: set[str] = set()
        self.draining = False  # shutting down: new requests get 503 (see drain)
        self.sockets: set[ChatSocket] = set()  # the open chat WebSockets, whose requests a drain waits for

    # -- checks before any work ------------------------------------------------------------

    def check_host(self, host: str | None) -> None:
        """The Host header is one this server answers (a request without one is no browser's)."""
        if self.allowed_hosts is None or host is None:
            return
        match = _HOST.fullmatch(host)
        if match is None:
            raise HTTPError(400, f"Host {host!r} is malformed: expected host[:port] (an IPv6 address in brackets)",
                            param="host")
        name = f"[{match['ipv6']}]" if match["ipv6"] is not None else match["name"]
        if name.lower() not in self.allowed_hosts:
            # A page on another site that resolves its name to this server's address (DNS
            # rebinding) would otherwise reach it from the user's browser.
            raise HTTPError(400, f"Host {host!r} is not allowed: this server answers only "
                                 f"{sorted(self.allowed_hosts)} (--allowed-hosts adds names)", param="host")

    def check_access(self, request: Request) -> None:
        if self.config.api_key is not None and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.config.api_key}".encode()):
                raise HTTPError(401, "missing or wrong API key (expected `Authorization: Bearer <key>`)",
                                type_="authentication_error", code="invalid_api_key")

    async def read(self, request: Request, type_):
        content_type = request.headers.get("content-type", "")
        if content_type.split(";")[0].strip().lower() != "application/json":
            raise HTTPError(415, f"content type {content_type or '(none)'!r} is not supported: expected "
                                 f"application/json", code="unsupported_media_type")
        length, limit = request.headers.get("content-length"), self.config.max_body_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            raise HTTPError(413, f"request body of {length} bytes exceeds the limit of {limit}")
        body = bytearray()

        async def receive() -> None:
            async for chunk in request.stream():
                body.extend(chunk)
                if len(body) > limit:
                    raise HTTPError(413, f"request body exceeds the limit of {limit} bytes")
        try:  # (a body trickling in would hold a connection for ever)
            await asyncio.wait_for(receive(), self.config.timeout_body)
        except asyncio.TimeoutError as exc:
            raise HTTPError(408, f"the request body did not arrive within {self.config.timeout_body:g} s ({len(body)} "
                                 f"of {length or 'unknown'} bytes came; --timeout-body)", code="request_timeout",
                            headers={"Connection": "close"}) from exc
        except ClientDisconnect as exc:
            raise HTTPError(499, f"the client closed the connection while sending the body ({len(body)} of "
                                 f"{length or 'unknown'} bytes came)", code="client_closed_request") from exc
        try:
            raw = msgspec.json.decode(bytes(body))
        except msgspec.DecodeError as exc:
            raise HTTPError(400, f"the body is not valid JSON: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise HTTPError(400, f"the body is not valid UTF-8: {exc}") from exc
        except RecursionError as exc:
            raise HTTPError(400, "the body nests JSON too deeply") from exc
        return self.parse(raw, type_)

    def parse(self, raw, type_):
        """The request of type `type_` that decoded JSON `raw` holds, checked (an HTTP body or
        a WebSocket message's)."""
        if not isinstance(raw, dict):
            raise HTTPError(400, f"the body must be a JSON object, got {type(raw).__name__}")
        for name in set(raw) - api.known_fields(type_) - self._unknown_fields_logged:
            if len(self._unknown_fields_logged) >= MAX_UNKNOWN_FIELDS_LOGGED:
                break  # (clients choose these names: the set, and the log, must stay bounded)
            self._unknown_fields_logged.add(name)
            log.warning("ignoring unknown request field %r (logged once)", name)
        try:
            req = msgspec.convert(raw, type_)
        except msgspec.ValidationError as exc:
            raise HTTPError(400, f"invalid request: {exc}", param=param_of(str(exc))) from exc
        if req.model is not None and req.model != self.model_name:
            raise HTTPError(404, f"model {req.model!r} is not served here; available: [{self.model_name!r}]",
                            param="model", code="model_not_found")
        if (name := api.unsupported(req)) is not None:
            raise HTTPError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")
        if req.n > (max_n := self.config.max_n):
            raise HTTPError(400, f"n={req.n} is more than this server allows: expected n <= {max_n}", param="n")
        return req

    async def submit_all(self, rid: str, prompts: Sequence, params, chat_template_kwargs: dict | None = None,
                         stream: bool = True) -> list[RequestHandle]:
        """Submit every prompt now so that a bad one is a 400, not a broken stream. Its grammar
        is compiled first, off the event loop (submit then finds it compiled). Without
        `stream`, each request's output comes once, at its end."""
        self.check_open()
        if params.structured_outputs is not None:
            await asyncio.wrap_future(self.engine.core.executor.grammars.compile(params.structured_outputs))
        wanted, most = len(prompts) * params.n, self.config.max_pending
        if wanted > most:
            raise HTTPError(400, f"the request has {wanted} sequences ({len(prompts)} prompts x n={params.n}): "
                                 f"more than this server admits at once ({most})", param="n")
        # Rendered and tokenized off the event loop, every prompt checked before any is queued.
        states = [await self.engine.prepare(prompt, params, rid if len(prompts) == 1 else f"{rid}-{i}",
                                            chat_template_kwargs=chat_template_kwargs, stream=stream)
                  for i, prompt in enumerate(prompts)]
        self.check_open()
        if self.engine.num_seqs_in_flight + wanted > most:
            raise HTTPError(503, f"the server is at its limit of {most} queued sequences; retry later",
                            type_="overloaded_error", headers={"Retry-After": "1"})
        handles = []
        try:
            for state in states:
                handles.append(self.engine.enqueue(state))
        except BaseException:
            for handle in handles:
                self.engine.release(handle)
            raise
        return handles

    # -- shutting down -----------------------------------------------------------------------

    def check_open(self) -> None:
        if self.draining:
            raise HTTPError(503, "the server is shutting down and takes no new requests", type_="server_error",
                            code="shutting_down")

    def idle(self) -> bool:
        """Nothing in flight: no request in the engine, none of a WebSocket's still answering."""
        return self.engine.num_in_flight == 0 and not any(s.running for s in self.sockets)

    async def drain(self, grace: float, give_up: Callable[[], bool] = lambda: False) -> None:
        """Shutdown: refuse new requests (503), let those in flight finish for up to `grace`
        seconds, then end the rest with a 503 (an error response, an SSE `error` event, a
        WebSocket `error` per id) and wait a little for those answers to go out. `give_up`:
        stop waiting (a second Ctrl-C)."""
        self.draining = True
        if await self._wait_idle(grace, give_up):
            return
        log.warning("shutting down: %d requests still running after %g s end with an error", self.engine.num_in_flight,
                    grace)
        self.engine.abort_all(error=HTTPError(503, f"the server shut down before this request finished (it waited "
                                                   f"{grace:g} s: --shutdown-timeout)", type_="server_error",
                                              code="shutting_down"))
        await self._wait_idle(5.0, give_up)  # (an error each: written at once, unless a client stopped reading)

    async def _wait_idle(self, seconds: float, give_up: Callable[[], bool]) -> bool:
        deadline = time.monotonic() + seconds
        while not self.idle():
            if give_up() or time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    # -- running ---------------------------------------------------------------------------

    async def collect(self, request: Request, handles: list[RequestHandle]):
        """Every prompt's whole output. If one prompt fails, or the client leaves, the others
        are aborted (cancelling a collect() aborts its request): no work for a dead response."""
        work = [asyncio.ensure_future(self.engine.collect(h)) for h in handles]
        watch = asyncio.ensure_future(_disconnected(request))
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
        """One log line and the metrics of a finished HTTP request."""
        for handle in handles:
            self.metrics.observe(handle)
        now = time.monotonic()
        arrival = min((h.arrival for h in handles), default=now)
        firsts = [h.first_token_at for h in handles if h.first_token_at is not None]
        log.info("%s: %d, prompt %d tokens, output %d tokens, finish %s, ttft %s, total %.0f ms", rid, status,
                 sum(len(h.prompt_ids) for h in handles), sum(h.num_output_tokens for h in handles),
                 ",".join(str(r) for h in handles for r in h.finish_reasons) or "-",
                 f"{(min(firsts) - arrival) * 1e3:.0f} ms" if firsts else "-", (now - arrival) * 1e3)

    def stream(self, rid: str, handles: list[RequestHandle], out) -> StreamingResponse:
        """SSE of the renderer's chunks, then `[DONE]`. A request the engine fails ends the
        stream with an `error` event first."""
        async def events():
            status = 499  # until it ends: a client that leaves mid-stream closes it here
            try:
                for chunk in out.start():
                    yield _sse(chunk)
                async for position, delta in self.engine.merge(handles):
                    for chunk in out.chunks(position, delta):
                        yield _sse(chunk)
                for chunk in out.end():
                    yield _sse(chunk)
                status = 200
            except Exception as exc:  # noqa: BLE001 - reported in the stream: the headers are out
                err = HTTPError.of(exc, self.engine.healthy)
                status = err.status
                if status >= 500:
                    log.error("%s failed: %r", rid, exc)
                yield _sse_error(err)
            finally:
                self.finished(rid, handles, status)
            yield _DONE
        return StreamingResponse(events(), media_type="text/event-stream")

    # -- routes ----------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        req = await self.read(request, api.CompletionRequest)
        prompts = completion_prompts(req)
        params = completion_params(req)
        rid = f"cmpl-{uuid.uuid4().hex}"
        handles = await self.submit_all(rid, prompts, params, stream=req.stream)
        out = CompletionRenderer(rid, self.model_name, handles, req, self.engine.tokenizer)
        return await self.answer(request, req, handles, out)

    async def chat_completions(self, request: Request) -> Response:
        req = await self.read(request, api.ChatCompletionRequest)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        handles, out = await self.submit_chat(rid, req)
        return await self.answer(request, req, handles, out)

    async def submit_chat(self, rid: str, req) -> tuple[list[RequestHandle], ChatRenderer]:
        """Submit a chat completion request (HTTP's or a WebSocket's); its handles and renderer."""
        inputs = chat_inputs(req, self.engine.tokenizer)
        handles = await self.submit_all(rid, [inputs.messages], inputs.params,
                                        chat_template_kwargs=inputs.template_kwargs, stream=req.stream)
        return handles, ChatRenderer(rid, self.model_name, handles, req, self.engine.tokenizer, inputs.tools)

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

    async def models(self, request: Request) -> Response:
        return Response(_encode(api.ModelList([api.ModelCard(self.model_name, self.created)])),
                        media_type="application/json")

    async def model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if model_id != self.model_name:
            raise HTTPError(404, f"model {model_id!r} is not served here; available: [{self.model_name!r}]",
                            param="model", code="model_not_found")
        return Response(_encode(api.ModelCard(self.model_name, self.created)), media_type="application/json")

    async def health(self, request: Request) -> Response:
        ok = self.engine.healthy and not self.draining  # (a load balancer stops sending work to a draining server)
        status = "shutting down" if self.draining else "ok" if ok else "unhealthy"
        return JSONResponse({"status": status}, status_code=200 if ok else 503)

    async def render_metrics(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def chat_page(self, request: Request) -> Response:
        page = resources.files("runtime.serve").joinpath("static/chat.html").read_text(encoding="utf-8")
        return HTMLResponse(page.replace("{{MODEL}}", html.escape(self.model_name)))

    def guarded(self, handler):
        """Checks common to every route, and our errors as OpenAI-shaped responses."""
        async def endpoint(request: Request) -> Response:
            try:
                self.check_access(request)
                return await handler(request)
            except Exception as exc:  # noqa: BLE001 - answered, and the server keeps serving
                err = HTTPError.of(exc, self.engine.healthy)
                if err.status == 500:
                    log.exception("error serving %s", request.url.path)
                elif not getattr(request.state, "logged", False):  # (refused before any work: its one line)
                    log.info("%s %s: %d, %s", request.method, request.url.path, err.status, err.body.message)
                return error_response(err)
        return endpoint

    async def log_throughput(self, every: float) -> None:
        """A line every `every` seconds while there is work: tokens per second and the queues."""
        last_tokens, last_time = self.engine.stats().get("generated_tokens", 0), time.monotonic()
        while True:
            await asyncio.sleep(every)
            s, now = self.engine.stats(), time.monotonic()
            tokens = s.get("generated_tokens", 0)
            if tokens != last_tokens or s.get("running") or s.get("waiting"):
                log.info("throughput: %.1f tokens/s generated; running %d, waiting %d, swapped %d; KV blocks %d/%d "
                         "used", (tokens - last_tokens) / (now - last_time), s["running"], s["waiting"], s["swapped"],
                         s["total_blocks"] - s["free_blocks"], s["total_blocks"])
            last_tokens, last_time = tokens, now


class _HostCheck:
    """ASGI middleware: a Host the server does not answer is refused before any route runs, so
    the API, the page, static files, 404s and the WebSocket handshake are all covered."""

    def __init__(self, app, srv: _Server):
        self.app, self.srv = app, srv

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            try:
                self.srv.check_host(Headers(scope=scope).get("host"))
            except HTTPError as err:
                log.info("%s %s: %d, %s", scope.get("method", "WebSocket"), scope["path"], err.status, err.body.message)
                if scope["type"] == "websocket":
                    await refuse(WebSocket(scope, receive, send), err.status, _encode(api.ErrorResponse(err.body)))
                else:
                    await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine: AsyncEngine, config: ServerConfig = ServerConfig(), *, manage_engine: bool = True) -> Starlette:
    """The app serving `engine` with `config`'s name, access rules, limits and timeouts (the
    binding and the connection timeouts are the server process's: runtime/serve/serving.py).
    With `manage_engine`, the app's lifespan starts the engine in the server's event loop and
    shuts it down (aborting what is in flight) on exit. `app.state.drain(grace)` is the
    graceful stop (see _Server.drain), for the server process to await before it closes
    connections; `app.state.model_name` the model id it serves."""
    srv = _Server(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if manage_engine:
            engine.start()
        # Structured output's token tables, built (on the grammars' thread) while the server waits
        # for its first request.
        engine.core.executor.grammars.prepare()
        # What startup made lives as long as the server: out of the collector's way, or every full
        # collection walks it (~0.2 s with a vocabulary's objects, holding the GIL: /health waits).
        gc.freeze()
        ticker = asyncio.create_task(srv.log_throughput(config.log_interval))
        try:
            yield
        finally:
            ticker.cancel()
            if manage_engine:
                await engine.shutdown()

    async def not_found(request: Request, exc: HTTPException) -> Response:
        allowed = exc.headers or None
        path = request.url.path
        if exc.status_code == 404 and path.startswith(OPENAI_ROUTES_NOT_SERVED):
            return error_response(HTTPError(404, f"{request.method} {path}: this OpenAI endpoint is not supported by "
                                                  f"this server (it serves {', '.join(ROUTES_SERVED)})",
                                             code="unsupported_endpoint"))
        return error_response(HTTPError(exc.status_code, f"{request.method} {path}: {exc.detail}",
                                         code="not_found" if exc.status_code == 404 else "method_not_allowed",
                                         headers=allowed))

    g = srv.guarded
    routes = [Route("/v1/completions", g(srv.completions), methods=["POST"]),
              Route("/v1/chat/completions", g(srv.chat_completions), methods=["POST"]),
              Route("/v1/models", g(srv.models), methods=["GET"]),
              Route("/v1/models/{model_id:path}", g(srv.model), methods=["GET"]),
              Route("/health", g(srv.health), methods=["GET"]),
              Route("/metrics", g(srv.render_metrics), methods=["GET"]),
              Route("/", g(srv.chat_page), methods=["GET"]),
              WebSocketRoute("/v1/chat/ws", lambda websocket: ChatSocket(srv, websocket).serve()),
              # The chat page's vendored libraries (runtime/serve/static/vendor/VENDOR.md): no CDN.
              Mount("/static", StaticFiles(packages=[("runtime.serve", "static")]), name="static")]
    middleware = [Middleware(_HostCheck, srv=srv)]
    if config.cors_origin:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(config.cors_origin), allow_methods=["*"],
                                     allow_headers=["*"]))
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={404: not_found, 405: not_found})
    app.state.drain, app.state.model_name = srv.drain, srv.model_name
    return app
