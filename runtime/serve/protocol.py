"""OpenAI API types as msgspec Structs: request parsing/validation and response encoding.

Types are checked by msgspec on decode; ranges by SamplingParams. Fields whose effect we do
not implement are declared here too (`UNSUPPORTED`), so that a request asking for them gets a
400 naming the field instead of silently getting something else; unknown fields are
ignored (the server logs each name once), so clients that send newer harmless fields keep
working.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

from nanoinfer.sampling.sampling_params import SamplingParams

ROLES = ("system", "developer", "user", "assistant", "tool")


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """The fields both endpoints share. A sampling field's default is SamplingParams': named
    here (`SamplingParams.n`), or None for one passed on only when given (temperature, top_p,
    top_k, min_p, repetition_penalty)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = SamplingParams.n
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = SamplingParams.presence_penalty
    frequency_penalty: float = SamplingParams.frequency_penalty
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    user: str | None = None
    # vLLM's: each prompt token's logprob and this many alternatives (the first token has none);
    # on completions with `echo`, `logprobs` asks for them too.
    prompt_logprobs: int | None = None
    # vLLM's extensions, accepted the same way
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = SamplingParams.min_tokens
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = SamplingParams.ignore_eos
    skip_special_tokens: bool = SamplingParams.skip_special_tokens
    include_stop_str_in_output: bool = SamplingParams.include_stop_str_in_output
    # Structured output (runtime/api_mapping.grammar_spec): OpenAI's, and vLLM's extensions.
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # Tool calling (runtime/serve/tool_calls.py; chat completions only: `unsupported` on completions)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # false: at most one call (what `required` forces)
    # Known fields with an effect we do not implement (see `unsupported`).
    functions: Any = None
    function_call: Any = None
    best_of: Any = None
    suffix: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    use_beam_search: Any = None
    verbosity: Any = None
    # Harmless: accepted, no effect on the output.
    store: Any = None
    metadata: Any = None
    service_tier: Any = None


def _has_effect(name: str, value: Any, req) -> bool:
    """Whether an unsupported field's value asks for something (absent, empty, "none" and the
    values that mean the default pass)."""
    if value in (None, False, "", "none", [], {}):
        return False
    if name == "best_of":
        return value != req.n
    if name == "modalities":
        return value != ["text"]
    if name == "verbosity":
        return value != "medium"
    return True


UNSUPPORTED = ("use_beam_search", "verbosity", "functions", "function_call", "best_of",
               "suffix", "audio", "modalities", "prediction", "reasoning_effort", "web_search_options")


def unsupported(req) -> str | None:
    """The first field of `req` that asks for something this server does not do, if any."""
    if not hasattr(req, "messages"):  # (tools are for chat completions)
        chat_only = [name for name in ("tools", "tool_choice") if _has_effect(name, getattr(req, name), req)]
        if chat_only:
            return chat_only[0]
    return next((name for name in UNSUPPORTED if _has_effect(name, getattr(req, name, None), req)), None)


def known_fields(type_) -> frozenset[str]:
    return frozenset(f.encode_name for f in msgspec.structs.fields(type_))


class CompletionRequest(SamplingFields, kw_only=True):
    # A string, token ids, several strings or several token-id lists (msgspec allows one array
    # type per union; api_mapping checks that a list holds one kind).
    prompt: Union[str, list[Union[int, str, list[int]]]]
    logprobs: int | None = None
    echo: bool = False  # the prompt's text (and with logprobs, its tokens' logprobs) before the completion


class ChatMessage(msgspec.Struct):
    role: str
    # A string, or OpenAI's list of content parts ({"type": "text", "text": ...}).
    content: Union[str, list[dict], None] = None
    tool_calls: list[dict] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn's: the call it answers
    name: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    chat_template_kwargs: dict | None = None  # vLLM's: extra variables for the chat template (they win)
    # vLLM's template flags: a new assistant turn opened after the messages, or the last
    # message continued (its reply prefilled); not both.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


# -- responses ---------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # served from the prefix cache


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = msgspec.field(default_factory=PromptTokensDetails)


class CompletionLogprobs(msgspec.Struct):
    """The legacy completions format: parallel lists, one entry per token (with `echo`, the
    prompt's first: its first token has no logprob, null). Each `top_logprobs` entry holds the
    `logprobs` most likely tokens and the token itself where it is not among them."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    """vLLM's Logprob, in `prompt_logprobs` (keyed by token id): `rank` 1 is the most likely
    token; null for the prompt's own token when it is not among the alternatives asked for."""

    logprob: float
    rank: int | None
    decoded_token: str


PromptLogprobs = list[dict[int, PromptLogprob] | None]  # per prompt token; the first is null


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
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when asked for


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"
    system_fingerprint: str | None = None  # (the server's: runtime/serve/server.py)


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None  # (null when the reply is only tool calls)
    tool_calls: list[ToolCall] | None = None


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """A streamed tool call: its first delta has the id, type and name; `index` says which."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


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
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when asked for
    system_fingerprint: str | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


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
    system_fingerprint: str | None = None


# -- vLLM's tokenizer endpoints (runtime/serve/tokenization.py) --------------------------------


class TokenizeCompletionRequest(msgspec.Struct, kw_only=True):
    """POST /tokenize of a prompt: its ids as a completion would run it."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # (BOS, where the model's tokenizer adds one)
    return_token_strs: bool = False


class TokenizeChatRequest(msgspec.Struct, kw_only=True):
    """POST /tokenize of a conversation: its ids as a chat completion would run it (the chat
    template rendered with these flags, variables and tools)."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # (on top of what the template writes)
    return_token_strs: bool = False
    chat_template_kwargs: dict | None = None
    tools: Any = None


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # each token's text, with return_token_strs


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct):
    prompt: str


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


# -- the WebSocket endpoint's messages (runtime/serve/websocket.py) ----------------------------------


class WsClientMessage(msgspec.Struct, forbid_unknown_fields=True):
    """From the client: `request` starts a chat completion (`body`: the same object POST
    /v1/chat/completions takes) under the client's `id`; `cancel` aborts the one with `id`."""

    type: Literal["request", "cancel"]
    id: str
    body: dict | None = None


class WsServerMessage(msgspec.Struct, omit_defaults=True):
    """To the client, per request `id`: each `chunk` (the SSE stream's chat.completion.chunk
    objects), then `done`; or an `error` (OpenAI's error object), after which nothing more
    comes for that id. `id` is null for an error about a message that could not be read."""

    type: Literal["chunk", "done", "error"]
    id: str | None
    chunk: ChatCompletionChunk | None = None
    error: ErrorBody | None = None

