"""The OpenAI-compatible HTTP server: create_app(engine) -> a Starlette app with SSE streaming.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics, GET / (the chat page). Bad requests get OpenAI-shaped 4xx errors and the
server keeps serving; a client that disconnects mid-stream aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import html
import logging
import re
import time
import uuid
from importlib import resources
from typing import AsyncIterator, Sequence

import msgspec
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from nanoinfer.errors import RequestError
from nanoinfer.sampling import SamplingParams
from runtime import protocol as api
from runtime.engine import AsyncEngine, EngineError
from runtime.metrics import ServerMetrics
from runtime.outputs import CompletionOutput

_encode = msgspec.json.Encoder().encode


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        self.status, self.body, self.headers = status, api.ErrorBody(message, type_, param, code), headers
        super().__init__(message)


def _error_response(err: HTTPError) -> Response:
    return Response(_encode(api.ErrorResponse(err.body)), err.status, headers=err.headers,
                    media_type="application/json")


def _param_of(message: str) -> str | None:
    """The top-level field a msgspec validation message points at: "... - at `$.stop[0]`"
    or "Object missing required field `prompt`"."""
    match = re.search(r"at `\$\.(\w+)", message) or re.search(r"missing required field `(\w+)`", message)
    return match.group(1) if match else None


def _sse(item) -> bytes:
    return b"data: " + _encode(item) + b"\n\n"


class _Server:
    """The state one app serves from: the engine, its name, limits and metrics."""

    def __init__(self, engine: AsyncEngine, model_name: str, api_key: str | None, max_body_bytes: int,
                 max_pending: int):
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        self.max_body_bytes, self.max_pending = max_body_bytes, max_pending
        self.metrics = ServerMetrics(engine)
        self.created = int(time.time())

    # -- request parsing ----------------------------------------------------------------------

    async def read(self, request: Request, type_):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise HTTPError(413, f"request body of {length} bytes exceeds the limit of {self.max_body_bytes}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise HTTPError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes")
        try:
            return msgspec.json.decode(bytes(body), type=type_)
        except msgspec.ValidationError as exc:
            raise HTTPError(400, f"invalid request: {exc}", param=_param_of(str(exc))) from exc
        except msgspec.DecodeError as exc:
            raise HTTPError(400, f"the body is not valid JSON: {exc}") from exc

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise HTTPError(400, f"model {model!r} is not served here; available: [{self.model_name!r}]",
                            param="model", code="model_not_found")

    def check_capacity(self, wanted: int) -> None:
        if not self.engine.healthy:
            raise HTTPError(503, "the engine is unhealthy", type_="server_error")
        if self.engine.num_in_flight + wanted > self.max_pending:
            raise HTTPError(503, f"the server is at its limit of {self.max_pending} queued requests; retry later",
                            type_="overloaded_error", headers={"Retry-After": "1"})

    @staticmethod
    def sampling(req, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The request's SamplingParams (RequestError, a 400, names a bad value)."""
        kw = dict(n=req.n, max_tokens=max_tokens, stop=req.stop or (), seed=req.seed, logprobs=logprobs,
                  presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                  min_tokens=req.min_tokens)
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(req, name) is not None:
                kw[name] = getattr(req, name)
        if req.logit_bias:
            try:
                kw["logit_bias"] = {int(token): bias for token, bias in req.logit_bias.items()}
            except ValueError as exc:
                raise HTTPError(400, f"logit_bias keys must be token ids: {exc}", param="logit_bias") from exc
        return SamplingParams(**kw)

    def submit_all(self, prompts: Sequence, params: SamplingParams):
        """Submit every prompt now so that a bad one is a 400, not a broken stream."""
        self.check_capacity(len(prompts))
        handles = []
        try:
            for prompt in prompts:
                handles.append(self.engine.submit(prompt, params))
        except BaseException:
            for handle in handles:
                self.engine.abort(handle.request_id)
            raise
        return handles

    # -- running -------------------------------------------------------------------------------

    async def deltas(self, handles, arrival: float) -> AsyncIterator[tuple[int, CompletionOutput]]:
        """(choice index, completion delta) from all prompts' n completions as they come;
        leaving early aborts them all. Choice index = prompt index * n + completion index."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(prompt_index, handle):
            n, first, last = len(handle.completions), True, arrival
            try:
                async for out in self.engine.follow(handle):
                    now = time.monotonic()
                    tokens = sum(len(c.token_ids) for c in out.outputs)
                    if tokens:
                        if first:
                            self.metrics.ttft.observe(now - arrival)
                            first = False
                        else:
                            for _ in range(tokens):
                                self.metrics.itl.observe((now - last) / tokens)
                        last = now
                    for completion in out.outputs:
                        await queue.put((prompt_index * n + completion.index, completion))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
                await queue.put((prompt_index, exc))
            finally:
                await queue.put((prompt_index, done))

        tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
        remaining = len(tasks)
        try:
            while remaining:
                index, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()  # a departed client: each follow() aborts its request
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, handles, arrival):
        """Whole choices: index -> (text, token count, finish reason, logprobs)."""
        choices: dict[int, list] = {}
        async for i, out in self.deltas(handles, arrival):
            text, count, reason, logprobs = choices.setdefault(i, ["", 0, None, []])
            choices[i] = [text + out.text, count + len(out.token_ids), out.finish_reason or reason,
                          logprobs + list(out.logprobs or ())]
        return dict(sorted(choices.items()))

    def token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False) if self.engine.tokenizer else ""

    def completion_logprobs(self, logprobs, offset: int) -> api.CompletionLogprobs:
        tokens = [self.token_text(lp.token_id) for lp in logprobs]
        offsets, position = [], offset
        for token in tokens:
            offsets.append(position)
            position += len(token)
        return api.CompletionLogprobs(tokens, [lp.logprob for lp in logprobs],
                                      [{self.token_text(t): v for t, v in lp.top} for lp in logprobs], offsets)

    def chat_logprobs(self, logprobs) -> api.ChatLogprobs:
        def entry(token_id, value):
            text = self.token_text(token_id)
            return text, value, list(text.encode("utf-8"))

        return api.ChatLogprobs([api.ChatTokenLogprob(*entry(lp.token_id, lp.logprob),
                                                      [api.TopLogprob(*entry(t, v)) for t, v in lp.top])
                                 for lp in logprobs])

    @staticmethod
    def usage(handles, n: int, completion_tokens: int) -> api.Usage:
        """Each prompt counts once, however many (n) choices it has."""
        prompt_tokens = sum(len(h.prompt_ids) for h in handles)
        return api.Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


def create_app(engine: AsyncEngine, *, model_name: str | None = None, api_key: str | None = None,
               cors_origins: Sequence[str] = (), max_body_bytes: int = 1 << 20, max_pending: int = 1024,
               manage_engine: bool = True) -> Starlette:
    """The app serving `engine`. With `manage_engine`, the app's lifespan starts the engine in
    the server's event loop and shuts it down (aborting what is in flight) on exit."""
    name = model_name or engine.model.path.stem
    srv = _Server(engine, name, api_key, max_body_bytes, max_pending)

    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        req = await srv.read(request, api.CompletionRequest)
        srv.check_model(req.model)
        if isinstance(req.prompt, str) or all(isinstance(t, int) for t in req.prompt):
            prompts = [req.prompt]
        elif all(isinstance(t, str) for t in req.prompt):
            prompts = list(req.prompt)
        else:
            raise HTTPError(400, "prompt must be a string, a list of strings or a list of token ids", param="prompt")
        if not prompts or req.echo:
            raise HTTPError(400, "prompt must be non-empty" if not prompts else "echo is not supported",
                            param="prompt" if not prompts else "echo")
        if req.logprobs is not None and not 0 <= req.logprobs <= 5:
            raise HTTPError(400, f"logprobs={req.logprobs} is invalid: expected 0 to 5", param="logprobs")
        params = srv.sampling(req, 16 if req.max_tokens is None else req.max_tokens, req.logprobs)
        handles = srv.submit_all(prompts, params)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        want_logprobs = req.logprobs is not None

        def choice(i, text, reason, logprobs, offset=0):
            return api.CompletionChoice(i, text, reason,
                                        srv.completion_logprobs(logprobs, offset) if want_logprobs else None)

        if req.stream:
            async def events():
                tokens, offsets = 0, {}
                async for i, out in srv.deltas(handles, arrival):
                    tokens += len(out.token_ids)
                    yield _sse(api.CompletionResponse(rid, created, name, [
                        choice(i, out.text, out.finish_reason, out.logprobs or (), offsets.get(i, 0))]))
                    offsets[i] = offsets.get(i, 0) + len(out.text)
                if req.stream_options and req.stream_options.include_usage:
                    yield _sse(api.CompletionResponse(rid, created, name, [], srv.usage(handles, params.n, tokens)))
                yield b"data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        results = await srv.collect(handles, arrival)
        choices = [choice(i, text, reason, logprobs) for i, (text, _, reason, logprobs) in results.items()]
        usage = srv.usage(handles, params.n, sum(r[1] for r in results.values()))
        return Response(_encode(api.CompletionResponse(rid, created, name, choices, usage)),
                        media_type="application/json")

    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        req = await srv.read(request, api.ChatCompletionRequest)
        srv.check_model(req.model)
        if not req.messages:
            raise HTTPError(400, "messages must be a non-empty list", param="messages")
        messages = []
        for m in req.messages:
            if m.role not in api.ROLES:
                raise HTTPError(400, f"message role {m.role!r} is unknown: expected one of {list(api.ROLES)}",
                                param="messages")
            content = m.content or ""
            if isinstance(content, list):
                if any(part.get("type") != "text" for part in content):
                    raise HTTPError(400, "only text content parts are supported", param="messages")
                content = "".join(str(part.get("text", "")) for part in content)
            messages.append({"role": m.role, "content": content})
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.top_logprobs is not None and not (req.logprobs and 0 <= req.top_logprobs <= 20):
            raise HTTPError(400, f"top_logprobs={req.top_logprobs} needs logprobs=true and 0 to 20",
                            param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = srv.sampling(req, max_tokens, logprobs)
        handles = srv.submit_all([messages], params)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(choices, usage=None):
            return _sse(api.ChatCompletionChunk(rid, created, name, choices, usage))

        if req.stream:
            async def events():
                tokens = 0
                for i in range(params.n):
                    yield chunk([api.ChatChunkChoice(i, api.ChatDelta("assistant", ""))])
                async for i, out in srv.deltas(handles, arrival):
                    tokens += len(out.token_ids)
                    if out.text or out.logprobs:
                        yield chunk([api.ChatChunkChoice(i, api.ChatDelta(content=out.text), None,
                                                         srv.chat_logprobs(out.logprobs) if req.logprobs else None)])
                    if out.finish_reason:
                        yield chunk([api.ChatChunkChoice(i, api.ChatDelta(), out.finish_reason)])
                if req.stream_options and req.stream_options.include_usage:
                    yield chunk([], srv.usage(handles, params.n, tokens))
                yield b"data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        results = await srv.collect(handles, arrival)
        choices = [api.ChatChoice(i, api.AssistantMessage(text), reason,
                                  srv.chat_logprobs(logprobs) if req.logprobs else None)
                   for i, (text, _, reason, logprobs) in results.items()]
        usage = srv.usage(handles, params.n, sum(r[1] for r in results.values()))
        return Response(_encode(api.ChatCompletionResponse(rid, created, name, choices, usage)),
                        media_type="application/json")

    async def models(request: Request) -> Response:
        return Response(_encode(api.ModelList([api.ModelCard(name, srv.created)])), media_type="application/json")

    async def health(request: Request) -> Response:
        ok = engine.healthy
        return JSONResponse({"status": "ok" if ok else "unhealthy"}, status_code=200 if ok else 503)

    async def metrics(request: Request) -> Response:
        return Response(srv.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def chat_page(request: Request) -> Response:
        page = resources.files("runtime").joinpath("static/chat.html").read_text(encoding="utf-8")
        return HTMLResponse(page.replace("{{MODEL}}", html.escape(name)))

    def guarded(handler):
        """Map our errors to OpenAI-shaped responses; check the API key on /v1/*."""
        async def endpoint(request: Request) -> Response:
            try:
                if api_key is not None and request.url.path.startswith("/v1/"):
                    given = request.headers.get("authorization", "")
                    if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                        raise HTTPError(401, "missing or wrong API key (expected `Authorization: Bearer <key>`)",
                                        type_="authentication_error", code="invalid_api_key")
                return await handler(request)
            except HTTPError as err:
                return _error_response(err)
            except RequestError as err:
                return _error_response(HTTPError(400, str(err), param=err.param))
            except EngineError as err:
                return _error_response(HTTPError(503, str(err), type_="server_error"))
            except Exception as err:  # a bug of ours: answer 500 and keep serving
                logging.getLogger("nanoinfer.server").exception("error serving %s", request.url.path)
                return _error_response(HTTPError(500, f"internal error: {err!r}", type_="server_error"))
        return endpoint

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            if manage_engine:
                await engine.shutdown()

    routes = [Route("/v1/completions", guarded(completions), methods=["POST"]),
              Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
              Route("/v1/models", guarded(models), methods=["GET"]),
              Route("/health", guarded(health), methods=["GET"]),
              Route("/metrics", guarded(metrics), methods=["GET"]),
              Route("/", guarded(chat_page), methods=["GET"])]
    middleware = [Middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"],
                             allow_headers=["*"])] if cors_origins else []
    return Starlette(routes=routes, middleware=middleware, lifespan=lifespan)
