"""LLM: the synchronous offline facade (prompts in, one output per prompt out), running the
LLMEngine's step loop on the caller's thread: no event loop, no worker thread."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator, Sequence

from tqdm.auto import tqdm

from nanoinfer.errors import RequestError
from nanoinfer.loaders import load_model
from nanoinfer.sampling.sampler import SamplingParams
from nanoinfer.sampling.sampling_defaults import default_params
from runtime.engine_config import engine_config, load_and_engine_configs
from runtime.engine.llm_engine import LLMEngine, Prompt, failed
from runtime.engine.outputs import RequestOutput
from runtime.engine.request_state import RequestState


class LLM:
    """Load a model once, then generate for batches of prompts with continuous batching.

    `model` is a short name (default: smollm2-135m-instruct), an HF directory, a .gguf
    path or a Hub id `org/name[@revision]`; the keywords are the settings of LoadConfig
    (device, dtype, quantization, load_format, gguf_file, progress), EngineConfig and
    SchedulerConfig (an unknown name is a RequestError listing them).
    """

    def __init__(self, model: str | Path | None = None, **kwargs):
        load, config = load_and_engine_configs(**kwargs)
        self._init_with(load_model(model, load), config)

    @classmethod
    def from_loaded(cls, model, **engine_args) -> "LLM":
        """The facade over a LoadedModel made in memory (benchmarks build random ones)."""
        llm = cls.__new__(cls)
        llm._init_with(model, engine_config(**engine_args))
        return llm

    def _init_with(self, model, config) -> None:
        self.model = model
        self.engine = LLMEngine(model, config)
        # Outputs a step produced for requests other than the ones being waited for (an open
        # `stream` while `generate` runs), until their consumer takes them.
        self._inbox: dict[RequestState, list[RequestOutput]] = {}

    def close(self) -> None:
        """Give back the engine's other processes (tensor-parallel ranks) and its memory: the weights, the KV
        pool, the CUDA graphs (idempotent). `with LLM(...) as llm:` closes at the end of the block; a closed LLM
        takes no more prompts."""
        self.engine.close()
        self.model = self.engine.model

    def _pump(self) -> None:
        """One engine step, its outputs filed by request."""
        for state, out in self.engine.step_requests():
            self._inbox.setdefault(state, []).append(out)

    def _take(self, state: RequestState) -> list[RequestOutput]:
        outputs = self._inbox.pop(state, [])
        for out in outputs:
            if out.error is not None:
                raise failed(out)
        return outputs

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.model.tokenizer

    def stats(self) -> dict:
        return self.engine.stats()

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion in shared batches; outputs keep the prompts' order.
        A prompt is a string or a list of token ids."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if params is not None else default_params(self.model.sampling_defaults)
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"got {len(params)} SamplingParams for {len(prompts)} prompts: expected one or one each")
        # Every prompt is checked before any is queued: a bad one fails the call before any work.
        states = [self.engine.new_request(prompt, p, stream=False) for prompt, p in zip(prompts, params)]
        return self._run(states, use_tqdm)

    def _run(self, states: list[RequestState], use_tqdm: bool = False) -> list[RequestOutput]:
        """Step until every request has its output; a request the engine failed raises."""
        results: list[RequestOutput | None] = [None] * len(states)
        waiting = set(range(len(states)))
        bar = tqdm(total=len(states), desc="generating", unit="prompt", disable=not use_tqdm, file=sys.stderr)
        try:
            for state in states:
                self.engine.add(state)
            with bar:
                while True:
                    for i in [i for i in waiting if states[i] in self._inbox]:
                        (results[i],) = self._take(states[i])  # (not streamed: one output, at the end)
                        waiting.discard(i)
                        bar.update(1)
                    if not waiting:
                        break
                    self._pump()
        finally:
            for state in states:  # (an error or an interrupt: what is left stops and frees its blocks)
                if not state.finished:
                    self.engine.abort(state)
                self._inbox.pop(state, None)
        return results

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, chat: bool = False
               ) -> Iterator[RequestOutput]:
        """Yield deltas (new text and ids) as tokens arrive. `chat` wraps the prompt as a
        user message in the chat template first. Stopping early aborts the request."""
        if chat:
            prompt = [{"role": "user", "content": prompt}]
        state = self.engine.new_request(prompt, params, stream=True)
        self.engine.add(state)
        try:
            while True:
                yield from self._take(state)
                if state.done:
                    break
                self._pump()
        finally:
            if not state.finished:
                self.engine.abort(state)
            self._inbox.pop(state, None)

    def chat(self, messages: list[dict], params: SamplingParams | None = None, *, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> RequestOutput:
        """Render `messages` with the chat template and generate the assistant's reply. As in
        vLLM, `tools` (OpenAI's function objects) are rendered for the model (through the
        template, or in its system message where the template has none) and the reply comes
        back as text; the server parses calls out of it (runtime/serve/tool_calls.py)."""
        kwargs = dict(chat_template_kwargs or {})
        if tools:
            from runtime.serve.tool_calls import tool_setup

            setup = tool_setup(tools, "auto", list(messages), self.tokenizer.chat_template if self.tokenizer else None)
            messages, kwargs = setup.messages, {**kwargs, **setup.template_kwargs}
        state = self.engine.new_request(messages, params, chat_template_kwargs=kwargs or None, stream=False)
        return self._run([state])[0]
