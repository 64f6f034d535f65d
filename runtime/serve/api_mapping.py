"""Between OpenAI's API and the engine, on the way in: requests to prompts and SamplingParams
(types in runtime/serve/protocol.py; the way out, outputs to responses, is renderers.py)."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping, NamedTuple

from nanoinfer.errors import RequestError
from nanoinfer.sampling.sampler import SamplingParams
from nanoinfer.sampling.sampling_params import MAX_LOGPROBS
from nanoinfer.structured.spec import GrammarSpec
from runtime.engine.request_limits import all_ints
from runtime.serve.tool_calls import ToolSetup, tool_setup
from runtime.serve.protocol import ROLES, ChatCompletionRequest, CompletionRequest, SamplingFields, TokenizeChatRequest


def param_of(message: str) -> str | None:
    """The top-level field a msgspec validation message points at: "... - at `$.stop[0]`"
    or "Object missing required field `prompt`"."""
    match = re.search(r"at `\$\.(\w+)", message) or re.search(r"missing required field `(\w+)`", message)
    return match.group(1) if match else None


def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None, defaults: Mapping[str, Any]) -> SamplingParams:
    """The request's SamplingParams (RequestError, a 400, names a bad value); a sampling field it
    leaves out takes the model's recommended value in `defaults` (LoadedModel.sampling_defaults)."""
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options is only allowed with stream=true", param="stream_options")
    if req.stream and req.prompt_logprobs is not None:
        raise RequestError("prompt_logprobs cannot be streamed: expected stream=false", param="prompt_logprobs")
    kw = dict(n=req.n, max_tokens=max_tokens, stop=req.stop or (), seed=req.seed, logprobs=logprobs,
              prompt_logprobs=prompt_logprobs,
              presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
              min_tokens=req.min_tokens, stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
              skip_special_tokens=req.skip_special_tokens, include_stop_str_in_output=req.include_stop_str_in_output)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None or name in defaults:
            kw[name] = value if value is not None else defaults[name]
    if req.logit_bias:
        try:
            kw["logit_bias"] = {int(token): bias for token, bias in req.logit_bias.items()}
        except ValueError as exc:
            raise RequestError(f"logit_bias keys must be token ids: {exc}", param="logit_bias") from exc
    return SamplingParams(**kw, structured_outputs=grammar_spec(req))


def grammar_spec(req: SamplingFields) -> GrammarSpec | None:
    """What the request constrains its output to, if anything: OpenAI's `response_format`
    (json_object; json_schema, enforced whether or not `strict`), vLLM's `structured_outputs`
    ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}) or its older `guided_json`,
    `guided_regex`, `guided_choice` and `guided_grammar`. At most one."""
    given = []
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            given.append(("response_format", GrammarSpec("json_object")))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict):
                raise RequestError("response_format.json_schema must be an object with a name and a schema",
                                   param="response_format")
            schema = spec.get("schema")
            given.append(("response_format", GrammarSpec("json_object") if schema is None else
                          GrammarSpec("json_schema", schema)))
        elif kind != "text":
            raise RequestError(f"response_format type {kind!r} is not supported: expected text, json_object or "
                               f"json_schema", param="response_format")
    if req.structured_outputs is not None:
        given.append(("structured_outputs", GrammarSpec.parse(req.structured_outputs)))
    for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            given.append((name, GrammarSpec(kind, getattr(req, name), param=name)))
    if len(given) > 1:
        raise RequestError(f"{given[0][0]} and {given[1][0]} both constrain the output: expected one",
                           param=given[1][0])
    return given[0][1] if given else None


def completion_prompts(req: CompletionRequest) -> list:
    """The prompts of a completion request: one string or id list, or several of either."""
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts = [prompt]
    elif all_ints(prompt):
        prompts = [prompt]
    elif all(isinstance(t, str) for t in prompt) or all(isinstance(t, list) for t in prompt):
        prompts = list(prompt)
    else:
        raise RequestError("prompt must be a string, a list of strings, a list of token ids or a list of token-id "
                           "lists", param="prompt")
    if not prompts or not all(prompts):
        raise RequestError("prompt must be non-empty", param="prompt")
    return prompts


DEFAULT_MAX_TOKENS = SamplingParams.max_tokens  # (OpenAI's for completions too; chat has none)


def completion_params(req: CompletionRequest, defaults: Mapping[str, Any]) -> SamplingParams:
    """A completion request's SamplingParams. `max_tokens` 0 scores the prompt (with `echo`, as
    vLLM and lm-evaluation-harness use it): the engine samples one token that is not returned.
    With `echo` and `logprobs`, the prompt's tokens get logprobs too."""
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise RequestError(f"logprobs={req.logprobs} is invalid: expected 0 to {MAX_LOGPROBS}", param="logprobs")
    max_tokens = defaults.get("max_tokens", DEFAULT_MAX_TOKENS) if req.max_tokens is None else req.max_tokens
    if max_tokens == 0:
        if not req.echo:
            raise RequestError("max_tokens=0 generates nothing: expected max_tokens >= 1, or 0 with echo=true to "
                               "score the prompt", param="max_tokens")
        max_tokens = 1
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo and req.logprobs is not None:
        prompt_logprobs = req.logprobs
    return sampling_params(req, max_tokens, req.logprobs, prompt_logprobs, defaults)


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None and not (req.logprobs and 0 <= req.top_logprobs <= MAX_LOGPROBS):
        raise RequestError(f"top_logprobs={req.top_logprobs} needs logprobs=true and 0 to {MAX_LOGPROBS}",
                           param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """The conversation as dicts for the chat template: role and content, and an assistant
    turn's `tool_calls` (arguments as objects, as templates expect them) or a tool turn's
    `tool_call_id`."""
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
        message = {"role": m.role, "content": content}
        if m.tool_calls:
            message["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        messages.append(message)
    return messages


def _template_call(call: dict) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(f"a message's tool call must hold a function with a name, got {call!r:.200}",
                           param="messages")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # (kept as the client wrote it)
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


class ChatInputs(NamedTuple):
    """What a chat completion request submits: the messages, the chat template's extra
    variables, the sampling parameters, and its tool setup (None without tools)."""

    messages: list[dict]
    template_kwargs: dict
    params: SamplingParams
    tools: ToolSetup | None


def chat_prompt(req: ChatCompletionRequest | TokenizeChatRequest, tokenizer, tool_choice=None,
                parallel: bool = True) -> tuple[list[dict], dict, ToolSetup | None]:
    """What a chat request's template renders (a chat completion's, or /tokenize's): the
    messages, the template's variables (the request's own chat_template_kwargs win over its
    flags, as in vLLM), and the tool setup (None without tools), which may rewrite both."""
    messages = chat_messages(req)
    kwargs = {"add_generation_prompt": req.add_generation_prompt,
              "continue_final_message": req.continue_final_message, **(req.chat_template_kwargs or {})}
    template = tokenizer.chat_template if tokenizer is not None else None
    tools = tool_setup(req.tools, tool_choice, messages, template, parallel)
    if tools is not None:
        messages, kwargs = tools.messages, {**kwargs, **tools.template_kwargs}
    return messages, kwargs, tools


def chat_inputs(req: ChatCompletionRequest, tokenizer, defaults: Mapping[str, Any]) -> ChatInputs:
    """A chat completion request's inputs (RequestError, a 400, names a bad value); `defaults`, the
    model's recommended sampling settings."""
    messages, kwargs, tools = chat_prompt(req, tokenizer, req.tool_choice, req.parallel_tool_calls is not False)
    max_tokens = next((m for m in (req.max_completion_tokens, req.max_tokens) if m is not None),
                      defaults.get("max_tokens"))
    params = sampling_params(req, max_tokens, chat_logprobs(req), req.prompt_logprobs, defaults)
    if tools is not None and tools.grammar is not None:
        if params.structured_outputs is not None:
            raise RequestError(f"tool_choice={req.tool_choice!r} constrains the output, and so does the request's "
                               f"structured output: expected one", param="tool_choice")
        # (its errors name `tools`: the grammar is built from them)
        params = dataclasses.replace(params, structured_outputs=dataclasses.replace(tools.grammar, param="tools"))
    return ChatInputs(messages, kwargs, params, tools)
