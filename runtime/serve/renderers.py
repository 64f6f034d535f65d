"""Between the engine and OpenAI's API, on the way out: a request's outputs to choices, whole
responses and stream chunk objects (types in runtime/serve/protocol.py; the way in is api_mapping.py)."""

from __future__ import annotations

import time

from runtime.serve.tool_calls import ToolCallParser, ToolSetup, new_call_id, parse_reply
from runtime.serve.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                    ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatTokenLogprob,
                                    CompletionChoice, CompletionLogprobs, CompletionResponse, FunctionCall,
                                    FunctionDelta, PromptLogprob, PromptTokensDetails, ToolCall, ToolCallDelta,
                                    TopLogprob, Usage)


class _Renderer:
    """Turns the engine's outputs for one request (its prompts' handles, n completions each)
    into OpenAI responses and stream chunk objects (the server encodes them: SSE events or
    WebSocket messages). Choice index = prompt * n + completion."""

    def __init__(self, response_id: str, model: str, handles, req, tokenizer, fingerprint: str | None = None):
        self.id, self.created, self.model = response_id, int(time.time()), model
        self.fingerprint = fingerprint  # (OpenAI's system_fingerprint: on every response and chunk)
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

    def __init__(self, response_id, model, handles, req, tokenizer, fingerprint=None):
        super().__init__(response_id, model, handles, req, tokenizer, fingerprint)
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
        text, ids, lps = ("", (), ()) if self.scoring else (c.text, c.token_ids, c.logprobs or ())
        if self.echo and first:
            handle = self.handles[position]
            prompt_text = handle.prompt if handle.prompt is not None else (
                self.tokenizer.decode(handle.prompt_ids, skip_special_tokens=False) if self.tokenizer else "")
            text = prompt_text + text
            ids = [*handle.prompt_ids, *ids]
            lps = [*(self.prompt_logprobs.get(position) or [None] * len(handle.prompt_ids)), *lps]
        return CompletionChoice(index, text, c.finish_reason,
                                self.logprobs(ids, lps, offset) if self.want_logprobs else None,
                                self.prompt_logprobs_of(position) if first else None)

    def chunks(self, position: int, delta) -> list:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[position] = delta.prompt_logprobs
        out, offsets = [], self.offsets
        for c in delta.outputs:
            if not self.scoring:
                self.completion_tokens += len(c.token_ids)
            index = position * self.n + c.index
            offset = offsets.get(index)
            choice = self.choice(index, c, position, offset is None, offset or 0)
            offsets[index] = (offset or 0) + len(choice.text)
            if choice.text or choice.finish_reason or (choice.logprobs and choice.logprobs.tokens):
                out.append(self._response([choice]))
        return out

    def end(self) -> list:
        if not self.include_usage:
            return []
        return [self._response([], self.usage(self.completion_tokens))]

    def response(self, results) -> CompletionResponse:
        choices = []
        for position, out in enumerate(results):
            self.prompt_logprobs[position] = out.prompt_logprobs
            choices += [self.choice(position * self.n + c.index, c, position, True) for c in out.outputs]
        tokens = 0 if self.scoring else self.total_tokens(results)
        return self._response(choices, self.usage(tokens))

    def _response(self, choices, usage=None) -> CompletionResponse:
        return CompletionResponse(self.id, self.created, self.model, choices, usage,
                                  system_fingerprint=self.fingerprint)


class ChatRenderer(_Renderer):
    def __init__(self, response_id, model, handles, req, tokenizer, tools: ToolSetup | None = None,
                 fingerprint: str | None = None):
        super().__init__(response_id, model, handles, req, tokenizer, fingerprint)
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
        return ChatCompletionChunk(self.id, self.created, self.model, choices, usage,
                                   system_fingerprint=self.fingerprint)

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
                                      prompt_logprobs=self.prompt_logprobs_of(0), system_fingerprint=self.fingerprint)
