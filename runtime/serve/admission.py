"""Admission: what a request passes before it runs — its API key, its body (size, time, JSON), its fields and
the server's limits — and its prompts queued in the engine, all or none."""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import uuid
from typing import Sequence

import msgspec
from starlette.requests import ClientDisconnect, HTTPConnection, Request

from runtime.async_engine import AsyncEngine, RequestHandle
from runtime.serve import protocol as api
from runtime.serve.api_mapping import chat_inputs, completion_params, completion_prompts, param_of
from runtime.serve.server_config import ServerConfig
from runtime.serve.http_errors import HTTPError
from runtime.serve.renderers import ChatRenderer, CompletionRenderer
from runtime.serve.shutdown import Shutdown

log = logging.getLogger("nanoinfer.server")
MAX_UNKNOWN_FIELDS_LOGGED = 100
# What --api-key guards: the API and vLLM's tokenizer endpoints (/health, /metrics and the chat page stay open).
KEYED_PATHS = ("/v1/", "/tokenize", "/detokenize")


class Admission:
    """From an HTTP request (or a WebSocket message) to the handles of its requests in the engine."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig, model_name: str, shutdown: Shutdown,
                 fingerprint: str | None = None):
        self.engine, self.config, self.model_name, self.shutdown = engine, config, model_name, shutdown
        self.fingerprint = fingerprint  # (the responses' system_fingerprint)
        self._unknown_fields_logged: set[str] = set()
        # Each request type's field names, read once: msgspec resolves the type's annotations on each call
        # (~5% of a busy server's event loop at 256 streams, issue 60's profile).
        self._known_fields: dict[type, frozenset[str]] = {}
        # Response ids: this process's random prefix and a count (unique across the API servers of one port;
        # a uuid4 a request cost a urandom call and, under load, a wait for the interpreter lock after it).
        self._id_prefix, self._id_count = uuid.uuid4().hex[:16], itertools.count()

    def new_id(self, kind: str) -> str:
        """A new response's id, OpenAI's shape: `kind`-32 hex digits (`cmpl-…`, `chatcmpl-…`)."""
        return f"{kind}-{self._id_prefix}{next(self._id_count):016x}"

    def check_access(self, connection: HTTPConnection) -> None:
        if self.config.api_key is not None and connection.url.path.startswith(KEYED_PATHS):
            given = connection.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.config.api_key}".encode()):
                raise HTTPError(401, "missing or wrong API key (expected `Authorization: Bearer <key>`)",
                                type_="authentication_error", code="invalid_api_key")

    async def read(self, request: Request, type_):
        """The request of type `type_` in the body, checked (`parse`)."""
        return self.parse(await self.read_json(request), type_)

    async def read_json(self, request: Request):
        """The body's JSON, decoded: a JSON body within the size and time limits, or an HTTPError."""
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
        return raw

    def parse(self, raw, type_):
        """The request of type `type_` that decoded JSON `raw` holds, checked (an HTTP body or
        a WebSocket message's)."""
        if not isinstance(raw, dict):
            raise HTTPError(400, f"the body must be a JSON object, got {type(raw).__name__}")
        known = self._known_fields.get(type_) or self._known_fields.setdefault(type_, api.known_fields(type_))
        for name in set(raw) - known - self._unknown_fields_logged:
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
        if not isinstance(req, api.SamplingFields):  # (a tokenizer request: nothing generated)
            return req
        if (name := api.unsupported(req)) is not None:
            raise HTTPError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")
        if req.n > (max_n := self.config.max_n):
            raise HTTPError(400, f"n={req.n} is more than this server allows: expected n <= {max_n}", param="n")
        return req

    async def submit_completion(self, rid: str, req: api.CompletionRequest
                                ) -> tuple[list[RequestHandle], CompletionRenderer]:
        """Submit a completion request; its handles and renderer."""
        params = completion_params(req, self.engine.model.sampling_defaults)
        handles = await self.submit_all(rid, completion_prompts(req), params, stream=req.stream)
        return handles, CompletionRenderer(rid, self.model_name, handles, req, self.engine.tokenizer, self.fingerprint)

    async def submit_chat(self, rid: str, req: api.ChatCompletionRequest) -> tuple[list[RequestHandle], ChatRenderer]:
        """Submit a chat completion request (HTTP's or a WebSocket's); its handles and renderer."""
        inputs = chat_inputs(req, self.engine.tokenizer, self.engine.model.sampling_defaults)
        handles = await self.submit_all(rid, [inputs.messages], inputs.params,
                                        chat_template_kwargs=inputs.template_kwargs, stream=req.stream)
        return handles, ChatRenderer(rid, self.model_name, handles, req, self.engine.tokenizer, inputs.tools,
                                     self.fingerprint)

    async def submit_all(self, rid: str, prompts: Sequence, params, chat_template_kwargs: dict | None = None,
                         stream: bool = True) -> list[RequestHandle]:
        """Submit every prompt now so that a bad one is a 400, not a broken stream. Its grammar
        is compiled first, off the event loop (submit then finds it compiled). Without
        `stream`, each request's output comes once, at its end."""
        self.shutdown.check_open()
        if params.structured_outputs is not None:
            await asyncio.wrap_future(self.engine.grammars.compile(params.structured_outputs))
        wanted, most = len(prompts) * params.n, self.config.max_pending
        if wanted > most:
            raise HTTPError(400, f"the request has {wanted} sequences ({len(prompts)} prompts x n={params.n}): "
                                 f"more than this server admits at once ({most})", param="n")
        # Rendered and tokenized off the event loop, every prompt checked before any is queued.
        states = [await self.engine.prepare(prompt, params, rid if len(prompts) == 1 else f"{rid}-{i}",
                                            chat_template_kwargs=chat_template_kwargs, stream=stream)
                  for i, prompt in enumerate(prompts)]
        for state in states:
            state.stream_interval = self.config.stream_interval
        self.shutdown.check_open()
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
