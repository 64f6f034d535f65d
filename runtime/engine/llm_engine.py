"""LLMEngine: the engine on the caller's thread — `add_request`, `step() -> [RequestOutput]`,
`abort_request`, as in vLLM and nano-vllm.

It is the engine core (requests, plan, device; runtime/engine/engine_core.py) plus what turns its
tokens into outputs (runtime/engine/request_state.py): prompts rendered and tokenized, text
detokenized, stop strings matched, n completions gathered. `LLM` runs it on the caller's
thread; `AsyncEngine`'s worker thread runs the same `step`.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path
from typing import Sequence, Union

from nanoinfer.errors import NanoInferError, RequestError
from nanoinfer.loaders import LoadedModel, load_model
from nanoinfer.sampling.sampler import SamplingParams
from nanoinfer.sampling.sampling_defaults import default_params
from runtime.engine_config import EngineConfig, load_and_engine_configs
from runtime.engine.engine_core import CLOSED, EngineCore
from runtime.engine.outputs import Progress, RequestOutput, TokenOutput
from runtime.engine.request_limits import all_ints
from runtime.engine.request_state import RequestState

log = logging.getLogger("nanoinfer.engine")

# A prompt is text, token ids, or chat messages ({"role", "content"} dicts).
Prompt = Union[str, Sequence[int], Sequence[dict]]
# The most a prompt may hold to be checked on the caller's thread (`cheap_to_prepare`): each takes well under
# a millisecond (a text tokenized, ids' types gathered in C).
CHEAP_TEXT = 4096  # characters
CHEAP_IDS = 65536  # token ids


def cheap_to_prepare(prompt: Prompt, params: SamplingParams | None = None) -> bool:
    """Whether making `prompt`'s request costs less than handing it to a thread (a hop and a GIL handoff, ~0.1 ms
    a request: a tenth of a server's admission of a burst, issue 60): token ids in a list or tuple, or a short
    text. Chat messages (a template to render, tools to format) and a request with a grammar (its compile, or a
    replica's answer about it, may take seconds) are never cheap; nor is anything else (an array, a generator)."""
    if params is not None and params.structured_outputs is not None:
        return False
    if isinstance(prompt, str):
        return len(prompt) <= CHEAP_TEXT
    if not isinstance(prompt, (list, tuple)):
        return False
    return len(prompt) <= CHEAP_IDS and not (prompt and isinstance(prompt[0], dict))


class EngineError(NanoInferError, RuntimeError):
    """A request failed inside the engine (its own fault, or the engine's: `__cause__` says);
    other requests went on, unless the engine is no longer healthy."""


def failed(out: RequestOutput) -> EngineError:
    """The error to raise for an output whose request the engine failed."""
    error = EngineError(f"request {out.request_id} failed: {out.error}")
    error.__cause__ = out.error
    return error


def _check_one_replica(config: EngineConfig) -> None:
    """An engine is one replica: several are the server's (runtime/engine_process/data_parallel.py)."""
    n = config.data_parallel_size
    if n > 1:
        raise RequestError(f"data_parallel_size={n} is a server setting (`nanoinfer serve --data-parallel-size {n}`, "
                           f"or DataParallelEngine in runtime/engine_process/data_parallel.py): LLM, LLMEngine and AsyncEngine run "
                           f"one engine; offline, run one per process", param="data_parallel_size")


class LLMEngine:
    """One model's engine, driven by whoever calls `step`."""

    def __init__(self, model: LoadedModel, config: EngineConfig = EngineConfig()):
        _check_one_replica(config)
        self.model = model
        self.core = EngineCore(model, config)
        self.requests: dict[str, RequestState] = {}  # `add_request`'s, by id, until handed out or aborted
        self.fatal: BaseException | None = None  # set once the engine cannot serve again
        self._ids = itertools.count()

    @classmethod
    def from_model(cls, model: str | Path | None = None, **kwargs) -> "LLMEngine":
        """Load `model` (a short name, HF directory, .gguf or Hub id; None = the default model);
        the keywords are the settings of LoadConfig, EngineConfig and SchedulerConfig."""
        load, config = load_and_engine_configs(**kwargs)  # (checked before minutes of loading)
        _check_one_replica(config)
        return cls(load_model(model, load), config)

    @property
    def tokenizer(self):
        return self.model.tokenizer

    # -- requests ------------------------------------------------------------------------------

    def new_request(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                    priority: int = 0, chat_template_kwargs: dict | None = None, stream: bool = True) -> RequestState:
        """A request checked (RequestError names what is wrong) and ready for `add`. It reads
        nothing a step changes, so another thread may call it while the engine runs.
        `chat_template_kwargs`: variables for a messages prompt's chat template (`tools`,
        `enable_thinking`, ...) and its flags `add_generation_prompt` (default true) and
        `continue_final_message` (the prompt ends inside the last message, which the reply
        continues). `stream`: outputs as deltas at every step, else one at the end."""
        if self.fatal is not None:
            raise EngineError(f"the engine is unhealthy (restart it): {self.fatal!r}") from self.fatal
        if self.core.closed:
            raise EngineError(CLOSED)
        params = params if params is not None else default_params(self.model.sampling_defaults)
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise RequestError(f"priority={priority!r} is invalid: expected an integer")
        text, ids = self._tokenize(prompt, chat_template_kwargs)
        ids = self.core.check_request(ids, params)
        if params.stop and self.tokenizer is None:
            raise RequestError(f"{self.model.path} has no tokenizer, so stop strings cannot be matched: use "
                               f"stop_token_ids", param="stop")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        return RequestState(request_id, text, ids, params, self.tokenizer, priority=priority, stream=stream)

    def _tokenize(self, prompt: Prompt, chat_template_kwargs: dict | None) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"{self.model.path} has no tokenizer: pass the prompt as token ids")
            return prompt, self.tokenizer.encode(prompt)
        items = list(prompt)
        if items and all(isinstance(m, dict) for m in items):
            if self.tokenizer is None:
                raise RequestError(f"{self.model.path} has no tokenizer, so no chat template")
            # The request's variables win, the template flags included (vLLM merges them the same way).
            variables = {"add_generation_prompt": True, **(chat_template_kwargs or {})}
            text = self.tokenizer.apply_chat_template(items, **variables)
            # The template writes BOS itself where the model wants one: add no specials again.
            return text, self.tokenizer.encode(text, add_special_tokens=False)
        if not all_ints(items):
            raise RequestError("prompt must be a string, a list of token ids, or a list of chat messages (dicts)")
        return None, items

    def add(self, state: RequestState) -> None:
        """Queue a request made by `new_request` (on the engine's thread)."""
        self.core.add_request(state.prompt_ids, state.params, request=state, priority=state.priority)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                    priority: int = 0, chat_template_kwargs: dict | None = None, stream: bool = False) -> str:
        """Check and queue a request; its id. Its outputs come from `step`: one when it ends, or
        with `stream` a delta at every step."""
        if request_id is not None and str(request_id) in self.requests:
            raise RequestError(f"request_id {request_id!r} is already in flight", param="request_id")
        state = self.new_request(prompt, params, request_id=request_id, priority=priority,
                                 chat_template_kwargs=chat_template_kwargs, stream=stream)
        self.add(state)
        self.requests[state.request_id] = state
        return state.request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks (unknown or finished ids are ignored)."""
        state = self.requests.pop(str(request_id), None)
        if state is not None:
            self.abort(state)

    def abort(self, state: RequestState, reason: str = "abort") -> None:
        self.core.abort_request(state, reason)
        state.end(reason)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished()

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs it produced (deltas of streaming requests, whole outputs
        of those that ended)."""
        return [out for _, out in self.step_requests()]

    def step_tokens(self) -> list[TokenOutput]:
        """One engine step's TokenOutputs as the core made them (an engine process sends them to its front,
        which files them: runtime/engine_process/replica.py); a failure the core could not contain fails every request."""
        try:
            return self.core.step()
        except Exception as exc:  # noqa: BLE001 - the core contains what it can; this it could not
            log.exception("the engine step failed; failing every request in flight")
            from runtime.engine.faults import EngineDead, RequestFailed

            outputs = self.core.fail_all(exc if isinstance(exc, EngineDead) else RequestFailed.because(
                "the engine step failed outside any one request", exc))
            # A dead device, or books that no longer balance, cannot serve anything again.
            blocks = self.core.scheduler.blocks
            if isinstance(exc, EngineDead) or blocks.num_free_blocks != blocks.num_blocks:
                self.fatal = exc
            return outputs

    def step_requests(self) -> list[tuple[RequestState, RequestOutput]]:
        """`step`, each output with its request."""
        outputs = self.step_tokens()
        now = time.monotonic()
        touched: dict[int, RequestState] = {}
        for out in outputs:
            state: RequestState = out.seq.request
            state.file(Progress.of(out), now)
            touched[id(state)] = state
        results = []
        for state in touched.values():  # (every running request, every step: kept lean)
            out = state.take()
            if state.stopped:  # a stop string ended a completion: finish it here, free its blocks
                for index in state.stopped:
                    self.core.abort_request(state, "stop", index)
                state.stopped.clear()
            if out is not None:
                results.append((state, out))
                if out.finished and self.requests.get(state.request_id) is state:
                    del self.requests[state.request_id]
        return results

    def stats(self) -> dict:
        """Counts from the engine core (running, waiting, free_blocks, ...), and healthy."""
        return {**self.core.stats(), "healthy": self.fatal is None}

    def close(self) -> None:
        """Give back the other tensor-parallel ranks and the device's memory (EngineCore.close; idempotent)."""
        self.core.close()
        self.model = self.core.model  # (its config and tokenizer: no weights)
