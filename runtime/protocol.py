"""OpenAI API types as msgspec Structs: request parsing/validation and response encoding.

Types are checked by msgspec on decode; ranges by SamplingParams. Fields whose effect we do
not implement are declared here too (`UNSUPPORTED`), so that a request asking for them gets a
400 naming the field instead of silently getting something else; unknown fields are
ignored (the server logs each name once), so clients that send newer harmless fields keep
working.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal, Union

import msgspec

from nanoinfer.errors import RequestError
from nanoinfer.sampling import SamplingParams

ROLES = ("system", "developer", "user", "assistant", "tool")


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    user: str | None = None
    # vLLM's extensions, accepted the same way
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Known fields with an effect we do not implement (see `unsupported`).
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    best_of: Any = None
    suffix: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # Harmless: accepted, no effect on the output.
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    parallel_tool_calls: Any = None


def _has_effect(name: str, value: Any, req) -> bool:
    """Whether an unsupported field's value asks for something (defaults and no-ops pass)."""
    if value is None or value is False:
        return False
    if name == "response_format":
        return not (isinstance(value, dict) and value.get("type") == "text")
    if name == "tool_choice":
        return value != "none"
    if name in ("tools", "functions"):
        return bool(value)
    if name == "best_of":
        return value != req.n
    if name == "modalities":
        return value != ["text"]
    return True


UNSUPPORTED = ("echo", "response_format", "tools", "tool_choice", "functions", "function_call", "best_of", "suffix", "audio",
               "modalities", "prediction", "reasoning_effort", "web_search_options", "guided_json", "guided_regex",
               "guided_choice", "guided_grammar")


def unsupported(req) -> str | None:
    """The first field of `req` that asks for something this server does not do, if any."""
    return next((name for name in UNSUPPORTED if _has_effect(name, getattr(req, name, None), req)), None)


def known_fields(type_) -> frozenset[str]:
    return frozenset(f.encode_name for f in msgspec.structs.fields(type_))


class CompletionRequest(_SamplingFields, kw_only=True):
    # A string, token ids, or several strings (msgspec allows one array type per union; the
    # server checks that a list is all ints or all strings).
    prompt: Union[str, list[Union[int, str]]]
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(msgspec.Struct):
    role: str
    # A string, or OpenAI's list of content parts ({"type": "text", "text": ...}).
    content: Union[str, list[dict], None] = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


# -- responses ---------------------------------------------------------------------------


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(msgspec.Struct):
    """The legacy completions format: parallel lists, one entry per generated token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class AssistantMessage(msgspec.Struct):
    content: str
    role: str = "assistant"


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    object: str = "model"
    owned_by: str = "nanoinfer"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


ErrorType = Literal["invalid_request_error", "authentication_error", "server_error", "overloaded_error"]


# -- requests -> the engine's inputs --------------------------------------------------------


def param_of(message: str) -> str | None:
    """The top-level field a msgspec validation message points at: "... - at `$.stop[0]`"
    or "Object missing required field `prompt`"."""
    match = re.search(r"at `\$\.(\w+)", message) or re.search(r"missing required field `(\w+)`", message)
    return match.group(1) if match else None


def sampling_params(req: _SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The request's SamplingParams (RequestError, a 400, names a bad value)."""
    kw = dict(n=req.n, max_tokens=max_tokens, stop=req.stop or (), seed=req.seed, logprobs=logprobs,
              presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
              min_tokens=req.min_tokens, stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
              skip_special_tokens=req.skip_special_tokens, include_stop_str_in_output=req.include_stop_str_in_output)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
    if req.logit_bias:
        try:
            kw["logit_bias"] = {int(token): bias for token, bias in req.logit_bias.items()}
        except ValueError as exc:
            raise RequestError(f"logit_bias keys must be token ids: {exc}", param="logit_bias") from exc
    return SamplingParams(**kw)


def completion_prompts(req: CompletionRequest) -> list:
    """The prompts of a completion request: one string or id list, or several strings."""
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts = [prompt]
    elif all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    elif all(isinstance(t, str) for t in prompt):
        prompts = list(prompt)
    else:
        raise RequestError("prompt must be a string, a list of strings or a list of token ids", param="prompt")
    if not prompts or not all(prompts):
        raise RequestError("prompt must be non-empty", param="prompt")
    return prompts


def completion_logprobs(req: CompletionRequest) -> int | None:
    if req.logprobs is not None and not 0 <= req.logprobs <= 5:
        raise RequestError(f"logprobs={req.logprobs} is invalid: expected 0 to 5", param="logprobs")
    return req.logprobs


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None and not (req.logprobs and 0 <= req.top_logprobs <= 20):
        raise RequestError(f"top_logprobs={req.top_logprobs} needs logprobs=true and 0 to 20", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """The conversation as {"role", "content"} dicts for the chat template."""
    if not req.messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    messages = []
    for m in req.messages:
        if m.role not in ROLES:
            raise RequestError(f"message role {m.role!r} is unknown: expected one of {list(ROLES)}", param="messages")
        content = m.content or ""
        if isinstance(content, list):
            if any(not isinstance(part, dict) or part.get("type") != "text" for part in content):
                raise RequestError("only text content parts are supported", param="messages")
            content = "".join(str(part.get("text", "")) for part in content)
        messages.append({"role": m.role, "content": content})
    return messages


# -- the engine's outputs -> responses ---------------------------------------------------------


class _Renderer:
    """Turns the engine's outputs for one HTTP request (its prompts' handles, n completions
    each) into OpenAI responses and stream chunks. Choice index = prompt * n + completion."""

    prefix = ""

    def __init__(self, model: str, handles, req, tokenizer):
        self.id, self.created, self.model = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time()), model
        self.handles, self.n, self.tokenizer = handles, req.n, tokenizer
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.completion_tokens = 0

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else ""

    def usage(self, completion_tokens: int) -> Usage:
        """Each prompt counts once, however many (n) choices it has."""
        prompt_tokens = sum(len(h.prompt_ids) for h in self.handles)
        return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)

    def start(self) -> list[bytes]:
        return []

    def chunks(self, position: int, delta) -> list[bytes]:
        self.completion_tokens += sum(len(c.token_ids) for c in delta.outputs)
        return [self.chunk(position * self.n + c.index, c) for c in delta.outputs]

    def choices(self, results) -> list:
        return [self.choice(p * self.n + c.index, c) for p, out in enumerate(results) for c in out.outputs]

    def total_tokens(self, results) -> int:
        return sum(len(c.token_ids) for out in results for c in out.outputs)


def _sse(item) -> bytes:
    return b"data: " + msgspec.json.encode(item) + b"\n\n"


class CompletionRenderer(_Renderer):
    prefix = "cmpl"

    def __init__(self, model, handles, req, tokenizer):
        super().__init__(model, handles, req, tokenizer)
        self.want_logprobs = req.logprobs is not None
        self.offsets: dict[int, int] = {}  # choice -> text length so far (logprobs' text_offset)

    def logprobs(self, logprobs, offset: int) -> CompletionLogprobs:
        tokens = [self.token_text(lp.token_id) for lp in logprobs]
        offsets, position = [], offset
        for token in tokens:
            offsets.append(position)
            position += len(token)
        return CompletionLogprobs(tokens, [lp.logprob for lp in logprobs],
                                  [{self.token_text(t): v for t, v in lp.top} for lp in logprobs], offsets)

    def choice(self, index: int, c, offset: int = 0) -> CompletionChoice:
        return CompletionChoice(index, c.text, c.finish_reason,
                                self.logprobs(c.logprobs or (), offset) if self.want_logprobs else None)

    def chunk(self, index: int, c) -> bytes:
        offset = self.offsets.get(index, 0)
        self.offsets[index] = offset + len(c.text)
        return _sse(CompletionResponse(self.id, self.created, self.model, [self.choice(index, c, offset)]))

    def end(self) -> list[bytes]:
        if not self.include_usage:
            return []
        return [_sse(CompletionResponse(self.id, self.created, self.model, [], self.usage(self.completion_tokens)))]

    def response(self, results) -> CompletionResponse:
        return CompletionResponse(self.id, self.created, self.model, self.choices(results),
                                  self.usage(self.total_tokens(results)))


class ChatRenderer(_Renderer):
    prefix = "chatcmpl"

    def __init__(self, model, handles, req, tokenizer):
        super().__init__(model, handles, req, tokenizer)
        self.want_logprobs = req.logprobs

    def logprobs(self, logprobs) -> ChatLogprobs:
        def entry(token_id, value):
            text = self.token_text(token_id)
            return text, value, list(text.encode("utf-8"))

        return ChatLogprobs([ChatTokenLogprob(*entry(lp.token_id, lp.logprob),
                                              [TopLogprob(*entry(t, v)) for t, v in lp.top]) for lp in logprobs])

    def _chunk(self, choices, usage=None) -> bytes:
        return _sse(ChatCompletionChunk(self.id, self.created, self.model, choices, usage))

    def start(self) -> list[bytes]:
        return [self._chunk([ChatChunkChoice(i, ChatDelta("assistant", ""))])
                for i in range(len(self.handles) * self.n)]

    def chunks(self, position: int, delta) -> list[bytes]:
        self.completion_tokens += sum(len(c.token_ids) for c in delta.outputs)
        out = []
        for c in delta.outputs:
            index = position * self.n + c.index
            if c.text or c.logprobs:
                out.append(self._chunk([ChatChunkChoice(index, ChatDelta(content=c.text), None,
                                                        self.logprobs(c.logprobs) if self.want_logprobs else None)]))
            if c.finish_reason:
                out.append(self._chunk([ChatChunkChoice(index, ChatDelta(), c.finish_reason)]))
        return out

    def end(self) -> list[bytes]:
        return [self._chunk([], self.usage(self.completion_tokens))] if self.include_usage else []

    def choice(self, index: int, c) -> ChatChoice:
        return ChatChoice(index, AssistantMessage(c.text), c.finish_reason,
                          self.logprobs(c.logprobs or ()) if self.want_logprobs else None)

    def response(self, results) -> ChatCompletionResponse:
        return ChatCompletionResponse(self.id, self.created, self.model, self.choices(results),
                                      self.usage(self.total_tokens(results)))
