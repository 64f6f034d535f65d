"""The OpenAI-compatible HTTP server: create_app(engine, config) -> a Starlette app with SSE streaming.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{id}], POST /tokenize and
POST /detokenize (vLLM's), GET /health, GET /metrics, GET / (the chat page). Every error is
OpenAI-shaped JSON and the server keeps serving: a bad request is a 4xx naming the field, a
request the engine fails ends alone (a 500 or, mid-stream, an SSE `error` event then `[DONE]`),
and only a dead device makes it 503.
A client that disconnects, streaming or not, aborts its requests. A Host header the server
does not answer is refused before any route (DNS rebinding); a shutdown drains (Shutdown.drain).

This file is the routes and the app; the rest of the HTTP side has a file each under runtime/serve/:
host_check.py (the Host header), admission.py (reading and checking a request, queueing its prompts),
responses.py (SSE or JSON, the log line and metrics), shutdown.py (draining), websocket.py, tokenization.py
(the tokenizer endpoints). The API's types are in protocol.py, their mapping to the engine's prompts and
SamplingParams in api_mapping.py, and the engine's outputs back to them in renderers.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import html
import importlib.metadata
import logging
import time
from importlib import resources

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from runtime.async_engine import AsyncEngine
from runtime.serve import protocol as api
from runtime.serve.admission import Admission
from runtime.serve.server_config import ServerConfig
from runtime.serve.host_check import HostCheck
from runtime.serve.http_errors import HTTPError, error_response
from runtime.serve.metrics import ServerMetrics
from runtime.serve.responses import Responder
from runtime.serve.shutdown import Shutdown
from runtime.serve.tokenization import Tokenization, request_type
from runtime.serve.websocket import ChatSocket

log = logging.getLogger("nanoinfer.server")
_encode = msgspec.json.Encoder().encode
# OpenAI's endpoints a client may try that a generation server does not have: named as such.
OPENAI_ROUTES_NOT_SERVED = ("/v1/embeddings", "/v1/responses", "/v1/audio", "/v1/images", "/v1/moderations",
                            "/v1/files", "/v1/batches", "/v1/fine_tuning", "/v1/assistants", "/v1/threads",
                            "/v1/vector_stores", "/v1/edits", "/v1/uploads", "/v1/realtime")
ROUTES_SERVED = ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /v1/models/{id}",
                 "WebSocket /v1/chat/ws", "POST /tokenize", "POST /detokenize")


class _Server:
    """The routes of one app, and the parts they share: the engine, its name, the settings, the
    admission of requests, their responses and metrics, and the shutdown state."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig):
        self.engine, self.config = engine, config
        self.model_name = config.served_model_name or engine.model.model_id
        self.fingerprint = system_fingerprint(engine.model.model_id)
        self.cors_origins = frozenset(o.lower() for o in config.cors_origin)
        self.created = int(time.time())
        self.metrics = ServerMetrics(engine)
        self.shutdown = Shutdown(engine)
        self.admission = Admission(engine, config, self.model_name, self.shutdown, self.fingerprint)
        self.responder = Responder(engine, self.metrics)
        self.tokenization = Tokenization(engine.tokenizer, engine.max_model_len)

    def routes(self) -> list:
        """The app's routes (ROUTES_SERVED and the rest), each guarded."""
        g = self.guarded
        return [Route("/v1/completions", g(self.completions), methods=["POST"]),
                Route("/v1/chat/completions", g(self.chat_completions), methods=["POST"]),
                Route("/v1/models", g(self.models), methods=["GET"]),
                Route("/v1/models/{model_id:path}", g(self.model), methods=["GET"]),
                Route("/tokenize", g(self.tokenize), methods=["POST"]),
                Route("/detokenize", g(self.detokenize), methods=["POST"]),
                Route("/health", g(self.health), methods=["GET"]),
                Route("/metrics", g(self.render_metrics), methods=["GET"]),
                Route("/", g(self.chat_page), methods=["GET"]),
                WebSocketRoute("/v1/chat/ws", lambda websocket: ChatSocket(self, websocket).serve()),
                # The chat page's vendored libraries (runtime/serve/static/vendor/VENDOR.md): no CDN.
                Mount("/static", StaticFiles(packages=[("runtime.serve", "static")]), name="static")]

    def guarded(self, handler):
        """Checks common to every route, and our errors as OpenAI-shaped responses."""
        async def endpoint(request: Request) -> Response:
            try:
                self.admission.check_access(request)
                return await handler(request)
            except Exception as exc:  # noqa: BLE001 - answered, and the server keeps serving
                err = HTTPError.of(exc, self.engine.healthy)
                if err.status == 500:
                    log.exception("error serving %s", request.url.path)
                elif not getattr(request.state, "logged", False):  # (refused before any work: its one line)
                    log.info("%s %s: %d, %s", request.method, request.url.path, err.status, err.body.message)
                return error_response(err)
        return endpoint

    async def completions(self, request: Request) -> Response:
        req = await self.admission.read(request, api.CompletionRequest)
        handles, out = await self.admission.submit_completion(self.admission.new_id("cmpl"), req)
        return await self.responder.answer(request, req, handles, out)

    async def chat_completions(self, request: Request) -> Response:
        req = await self.admission.read(request, api.ChatCompletionRequest)
        handles, out = await self.admission.submit_chat(self.admission.new_id("chatcmpl"), req)
        return await self.responder.answer(request, req, handles, out)

    async def tokenize(self, request: Request) -> Response:
        raw = await self.admission.read_json(request)
        req = self.admission.parse(raw, request_type(raw))
        self.shutdown.check_open()
        return Response(_encode(await self.tokenization.tokenize(req)), media_type="application/json")

    async def detokenize(self, request: Request) -> Response:
        req = await self.admission.read(request, api.DetokenizeRequest)
        self.shutdown.check_open()
        return Response(_encode(await self.tokenization.detokenize(req)), media_type="application/json")

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
        draining = self.shutdown.draining
        ok = self.engine.healthy and not draining  # (a load balancer stops sending work to a draining server)
        status = "shutting down" if draining else "ok" if ok else "unhealthy"
        return JSONResponse({"status": status}, status_code=200 if ok else 503)

    async def render_metrics(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def chat_page(self, request: Request) -> Response:
        page = resources.files("runtime.serve").joinpath("static/chat.html").read_text(encoding="utf-8")
        return HTMLResponse(page.replace("{{MODEL}}", html.escape(self.model_name)))


def system_fingerprint(model_id: str) -> str:
    """OpenAI's `system_fingerprint`: "fp_" and 10 hex digits of this nanoinfer's version and the
    model served, the same on every response of a server (and of another one with the same
    version and model), so that a client can tell when the backend changed."""
    try:
        version = importlib.metadata.version("nanoinfer")
    except importlib.metadata.PackageNotFoundError:  # (run from a source tree that was never installed)
        version = "unknown"
    return "fp_" + hashlib.sha256(f"nanoinfer {version}\n{model_id}".encode()).hexdigest()[:10]


async def _log_throughput(engine: AsyncEngine, every: float) -> None:
    """A line every `every` seconds while there is work: tokens per second and the queues."""
    last_tokens, last_time = engine.stats().get("generated_tokens", 0), time.monotonic()
    while True:
        await asyncio.sleep(every)
        s, now = engine.stats(), time.monotonic()
        tokens = s.get("generated_tokens", 0)
        if tokens != last_tokens or s.get("running") or s.get("waiting"):
            log.info("throughput: %.1f tokens/s generated; running %d, waiting %d, swapped %d; KV blocks %d/%d "
                     "used", (tokens - last_tokens) / (now - last_time), s["running"], s["waiting"], s["swapped"],
                     s["total_blocks"] - s["free_blocks"], s["total_blocks"])
        last_tokens, last_time = tokens, now


def create_app(engine: AsyncEngine, config: ServerConfig = ServerConfig(), *, manage_engine: bool = True) -> Starlette:
    """The app serving `engine` with `config`'s name, access rules, limits and timeouts (the
    binding and the connection timeouts are the server process's: runtime/serve/serving.py).
    With `manage_engine`, the app's lifespan starts the engine in the server's event loop and
    shuts it down (aborting what is in flight) on exit. `app.state.drain(grace)` is the
    graceful stop (see Shutdown.drain), for the server process to await before it closes
    connections; `app.state.model_name` the model id it serves."""
    # A served model's chat template compiles now, as the server starts, not at its first chat
    # request (a plain prompt never compiles it; a server would then fail every chat instead).
    engine.tokenizer.check_chat_template()
    srv = _Server(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if manage_engine:
            engine.start()
        # Structured output's token tables, built (on the grammars' thread) while the server waits
        # for its first request.
        engine.grammars.prepare()
        # What startup made lives as long as the server: out of the collector's way, or every full
        # collection walks it (~0.2 s with a vocabulary's objects, holding the GIL: /health waits).
        gc.freeze()
        ticker = asyncio.create_task(_log_throughput(engine, config.log_interval))
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

    middleware = [Middleware(HostCheck, config=config)]
    if config.cors_origin:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(config.cors_origin), allow_methods=["*"],
                                     allow_headers=["*"]))
    app = Starlette(routes=srv.routes(), middleware=middleware, lifespan=lifespan,
                    exception_handlers={404: not_found, 405: not_found})
    app.state.drain, app.state.model_name = srv.shutdown.drain, srv.model_name
    return app
