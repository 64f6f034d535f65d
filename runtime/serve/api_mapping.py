"""Between OpenAI's API and the engine: requests to prompts and SamplingParams, the engine's
outputs to choices, whole responses and stream chunks (types in runtime/serve/protocol.py)."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from typing import NamedTuple

from nanoinfer.errors import RequestError
from nanoinfer.sampling import SamplingParams
from nanoinfer.sampling_params import MAX_LOGPROBS
from nanoinfer.structured import GrammarSpec
from runtime.serve.tool_calls import ToolCallParser, ToolSetup, new_call_id, parse_reply, tool_setup
from runtime.serve.protocol import (ROLES, AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                              ChatCompletionRequest, ChatCompletionResponse, ChatDelta, ChatLogprobs,
                              ChatTokenLogprob, CompletionChoice, CompletionLogprobs, CompletionRequest,
                              CompletionResponse, FunctionCall, FunctionDelta, PromptLogprob, PromptTokensDetails,
                              SamplingFields, ToolCall, ToolCallDelta, TopLogprob, Usage)


# -- requests -> the engine's inputs --------------------------------------------------------


def param_of(message: str) -> str | None:
    """The top-level field a msgspec validation message points at: "... - at `$.stop[0]`"
    or "Object missing required field `prompt`"."""
    match = re.search(r"at `\$\.(\w+)", message) or re.search(r"missing required field `(\w+)`", message)
    return match.group(1) if match else None


def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's SamplingParams (RequestError, a 400, names a bad value)."""
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
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
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
    elif all(isinstance(t, int) for t in prompt):
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


def completion_params(req: CompletionRequest) -> SamplingParams:
    """A completion request's SamplingParams. `max_tokens` 0 scores the prompt (with `echo`, as
    vLLM and lm-evaluation-harness use it): the engine samples one token that is not returned.
    With `echo` and `logprobs`, the prompt's tokens get logprobs too."""
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise RequestError(f"logprobs={req.logprobs} is invalid: expected 0 to {MAX_LOGPROBS}", param="logprobs")
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    if max_tokens == 0:
        if not req.echo:
            raise RequestError("max_tokens=0 generates nothing: expected max_tokens >= 1, or 0 with echo=true to "
                               "score the prompt", param="max_tokens")
        max_tokens = 1
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo and req.logprobs is not None:
        prompt_logprobs = req.logprobs
    return sampling_params(req, max_tokens, req.logprobs, prompt_logprobs)


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


def chat_inputs(req: ChatCompletionRequest, tokenizer) -> ChatInputs:
    """A chat completion request's inputs (RequestError, a 400, names a bad value)."""
    messages = chat_messages(req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(req, max_tokens, chat_logprobs(req), req.prompt_logprobs)
    # The request's own chat_template_kwargs win over its flags, as in vLLM.
    kwargs = {"add_generation_prompt": req.add_generation_prompt,
              "continue_final_message": req.continue_final_message, **(req.chat_template_kwargs or {})}
    template = tokenizer.chat_template if tokenizer is not None else None
    tools = tool_setup(req.tools, req.tool_choice, messages, template, req.parallel_tool_calls is not False)
    if tools is not None:
        messages, kwargs = tools.messages, {**kwargs, **tools.template_kwargs}
        if tools.grammar is not None:
            if params.structured_outputs is not None:
                raise RequestError(f"tool_choice={req.tool_choice!r} constrains the output, and so does the request's "
                                   f"structured output: expected one", param="tool_choice")
            # (its errors name `tools`: the grammar is built from them)
            params = dataclasses.replace(params, structured_outputs=dataclasses.replace(tools.grammar, param="tools"))
    return ChatInputs(messages, kwargs, params, tools)


# -- the engine's outputs -> responses ---------------------------------------------------------


class _Renderer:
    """Turns the engine's outputs for one request (its prompts' handles, n completions each)
    into OpenAI responses and stream chunk objects (the server encodes them: SSE events or
    WebSocket messages). Choice index = prompt * n + completion."""

    def __init__(self, response_id: str, model: str, handles, req, tokenizer):
        self.id, self.created, self.model = response_id, int(time.time()), model
        self.handles, self.n, self.tokenizer = handles, req.n, tokenizer
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.completion_tokens = 0
        self.want_prompt_logprobs = req.prompt_logprobs is not None
        self.prompt_logprobs: dict[int, tuple] = {}  # prompt position -> its logprobs, once they arrive

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else ""

    def usage(self, completion_tokens: int) -> Usage:
        """Each prompt counts once, however many (n) choices it has."""
        prompt_tokens = sum(len(h.prompt_ids) for h in self.handles)
        cached = PromptTokensDetails(sum(h.cached_tokens for h in self.handles))
        return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens, cached)

    def start(self) -> list:
        return []

    def prompt_logprobs_of(self, position: int) -> list | None:
        """vLLM's `prompt_logprobs` of prompt `position`, keyed by token id."""
        entries = self.prompt_logprobs.get(position)
        if not self.want_prompt_logprobs or entries is None:
            return None
        out = [None]
        for lp in entries[1:]:
            ranked = {t: PromptLogprob(v, rank, self.token_text(t)) for rank, (t, v) in enumerate(lp.top, 1)}
            ranked.setdefault(lp.token_id, PromptLogprob(lp.logprob, None, self.token_text(lp.token_id)))
            out.append(ranked)
        return out

    def choices(self, results) -> list:
        return [self.choice(p * self.n + c.index, c) for p, out in enumerate(results) for c in out.outputs]

    def total_tokens(self, results) -> int:
        return sum(len(c.token_ids) for out in results for c in out.outputs)


class CompletionRenderer(_Renderer):
    """With `echo`, each choice's text starts with its prompt's, and its logprobs with the
    prompt's tokens; with `max_tokens` 0 (scoring), the one token the engine sampled is left out."""

    def __init__(self, response_id, model, handles, req, tokenizer):
        super().__init__(response_id, model, handles, req, tokenizer)
        self.want_logprobs, self.echo, self.scoring = req.logprobs is not None, req.echo, req.max_tokens == 0
        self.offsets: dict[int, int] = {}  # choice -> text length so far (logprobs' text_offset)

    def top(self, lp) -> dict[str, float]:
        """The alternatives, and the token itself where it is not among them (as vLLM and
        OpenAI's legacy completions list it)."""
        top = {self.token_text(t): v for t, v in lp.top}
        top.setdefault(self.token_text(lp.token_id), lp.logprob)
        return top

    def logprobs(self, token_ids, logprobs, offset: int) -> CompletionLogprobs:
        """`logprobs` holds one TokenLogprob per token id, or None (a prompt's first token)."""
        tokens = [self.token_text(t) for t in token_ids]
        offsets, position = [], offset
        for token in tokens:
            offsets.append(position)
            position += len(token)
        return CompletionLogprobs(tokens, [None if lp is None else lp.logprob for lp in logprobs],
                                  [None if lp is None else self.top(lp) for lp in logprobs], offsets)

    def choice(self, index: int, c, position: int, first: bool, offset: int = 0) -> CompletionChoice:
        """Choice `index` of prompt `position` from completion output `c` (a delta while streaming:
        `first`, its first, carries the echo)."""
        handle = self.handles[position]
        ids, lps, text = ([], [], "") if self.scoring else (list(c.token_ids), list(c.logprobs or ()), c.text)
        if self.echo and first:
            prompt_text = handle.prompt if handle.prompt is not None else (
                self.tokenizer.decode(handle.prompt_ids, skip_special_tokens=False) if self.tokenizer else "")
            text = prompt_text + text
            ids = list(handle.prompt_ids) + ids
            lps = list(self.prompt_logprobs.get(position) or [None] * len(handle.prompt_ids)) + lps
        return CompletionChoice(index, text, c.finish_reason,
                                self.logprobs(ids, lps, offset) if self.want_logprobs else None,
                                self.prompt_logprobs_of(position) if first else None)

    def chunks(self, position: int, delta) -> list:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[position] = delta.prompt_logprobs
        if not self.scoring:
            self.completion_tokens += sum(len(c.token_ids) for c in delta.outputs)
        out = []
        for c in delta.outputs:
            index = position * self.n + c.index
            first = index not in self.offsets
            choice = self.choice(index, c, position, first, self.offsets.get(index, 0))
            self.offsets[index] = self.offsets.get(index, 0) + len(choice.text)
            if choice.text or choice.finish_reason or (choice.logprobs and choice.logprobs.tokens):
                out.append(CompletionResponse(self.id, self.created, self.model, [choice]))
        return out

    def end(self) -> list:
        if not self.include_usage:
            return []
        return [CompletionResponse(self.id, self.created, self.model, [], self.usage(self.completion_tokens))]

    def response(self, results) -> CompletionResponse:
        choices = []
        for position, out in enumerate(results):
            self.prompt_logprobs[position] = out.prompt_logprobs
            choices += [self.choice(position * self.n + c.index, c, position, True) for c in out.outputs]
        tokens = 0 if self.scoring else self.total_tokens(results)
        return CompletionResponse(self.id, self.created, self.model, choices, self.usage(tokens))


class ChatRenderer(_Renderer):
    def __init__(self, response_id, model, handles, req, tokenizer, tools: ToolSetup | None = None):
        super().__init__(response_id, model, handles, req, tokenizer)
        self.want_logprobs = req.logprobs
        self.tools = tools
        self.parsers: dict[int, ToolCallParser] = {}  # per choice, while it streams
        self.num_calls: dict[int, int] = {}  # per choice: tool calls streamed so far

    def logprobs(self, logprobs) -> ChatLogprobs:
        def entry(token_id, value):
            text = self.token_text(token_id)
            return text, value, list(text.encode("utf-8"))

        return ChatLogprobs([ChatTokenLogprob(*entry(lp.token_id, lp.logprob),
                                              [TopLogprob(*entry(t, v)) for t, v in lp.top]) for lp in logprobs])

    def _chunk(self, choices, usage=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.id, self.created, self.model, choices, usage)

    def start(self) -> list:
        return [self._chunk([ChatChunkChoice(i, ChatDelta("assistant", ""))])
                for i in range(len(self.handles) * self.n)]

    def chunks(self, position: int, delta) -> list:
        self.completion_tokens += sum(len(c.token_ids) for c in delta.outputs)
        out = []
        for c in delta.outputs:
            index = position * self.n + c.index
            text, calls = c.text, []
            if self.tools is not None:  # (text that may be a call is held back until it is known)
                parser = self.parsers.setdefault(index, self.tools.parser())
                text, calls = parser.feed(c.text)
                if c.finish_reason:
                    more, later = parser.finish()
                    text, calls = (text + more, calls + later) if not self.cut_off(c.finish_reason) else ("", [])
            if text or c.logprobs:
                out.append(self._chunk([ChatChunkChoice(index, ChatDelta(content=text), None,
                                                        self.logprobs(c.logprobs) if self.want_logprobs else None)]))
            if calls:
                first = self.num_calls.get(index, 0)
                self.num_calls[index] = first + len(calls)
                out.append(self._chunk([ChatChunkChoice(index, ChatDelta(tool_calls=[
                    ToolCallDelta(first + k, new_call_id(), "function", FunctionDelta(call.name, call.arguments))
                    for k, call in enumerate(calls)]))]))
            if c.finish_reason:
                reason = self._finish_reason(c.finish_reason, self.num_calls.get(index))
                out.append(self._chunk([ChatChunkChoice(index, ChatDelta(), reason)]))
        return out

    @staticmethod
    def _finish_reason(reason: str, num_calls: int | None) -> str:
        return "tool_calls" if num_calls and reason == "stop" else reason

    def end(self) -> list:
        return [self._chunk([], self.usage(self.completion_tokens))] if self.include_usage else []

    def cut_off(self, finish_reason: str | None) -> bool:
        """A forced call (required, named) that `max_tokens` ended: its JSON is incomplete, so
        the reply has neither calls nor content, as OpenAI and vLLM answer."""
        return finish_reason == "length" and self.tools is not None and self.tools.mode in ("required", "named")

    def choice(self, index: int, c) -> ChatChoice:
        if self.cut_off(c.finish_reason):
            content, calls = "", []
        else:
            content, calls = (c.text, []) if self.tools is None else parse_reply(self.tools, c.text)
        tool_calls = [ToolCall(new_call_id(), FunctionCall(call.name, call.arguments)) for call in calls] or None
        return ChatChoice(index, AssistantMessage("assistant", content, tool_calls),
                          self._finish_reason(c.finish_reason, len(calls)),
                          self.logprobs(c.logprobs or ()) if self.want_logprobs else None)

    def response(self, results) -> ChatCompletionResponse:
        self.prompt_logprobs[0] = results[0].prompt_logprobs
        return ChatCompletionResponse(self.id, self.created, self.model, self.choices(results),
                                      self.usage(self.total_tokens(results)),
                                      prompt_logprobs=self.prompt_logprobs_of(0))
