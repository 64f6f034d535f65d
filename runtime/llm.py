"""LLM: the synchronous offline facade over AsyncEngine (prompts in, one output per prompt out).

It owns an event loop in a background thread and runs the same AsyncEngine there, so there
is one step loop whichever API a user picks.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
from pathlib import Path
from typing import Iterator, Sequence

from tqdm.auto import tqdm

from nanoinfer.errors import RequestError
from nanoinfer.loaders import load_model
from nanoinfer.sampling import SamplingParams
from runtime.engine import AsyncEngine, Prompt, engine_config
from runtime.outputs import RequestOutput

_DONE = object()


class LLM:
    """Load a model once, then generate for batches of prompts with continuous batching.

    `model` is a short name (default: smollm2-135m-instruct), an HF directory, a .gguf
    path or a Hub id `org/name[@revision]` (`gguf_file` picks a GGUF repository's file); `engine_args` are the settings of EngineConfig and SchedulerConfig (see
    `runtime.engine.engine_config`; an unknown name is a RequestError listing them).
    """

    def __init__(self, model: str | Path | None = None, *, device: str = "auto", dtype: str = "auto",
                 progress: bool = True, load_format: str = "auto", quantization: str = "auto",
                 gguf_file: str | None = None, **engine_args):
        config = engine_config(**engine_args)  # (checked before minutes of loading)
        self._init_with(load_model(model, device=device, dtype=dtype, progress=progress, load_format=load_format,
                                   quantization=quantization, gguf_file=gguf_file), config)

    @classmethod
    def from_loaded(cls, model, **engine_args) -> "LLM":
        """The facade over a LoadedModel made in memory (benchmarks build random ones)."""
        llm = cls.__new__(cls)
        llm._init_with(model, engine_config(**engine_args))
        return llm

    def _init_with(self, model, config) -> None:
        self.model = model
        self.engine = AsyncEngine(self.model, config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="nanoinfer-llm-loop", daemon=True)
        self._thread.start()
        self._call(self._start())

    async def _start(self):
        self.engine.start()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        """Stop the engine and its threads (also done at interpreter exit)."""
        if self._loop.is_running():
            self._call(self.engine.shutdown())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()

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
        params = params if params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"got {len(params)} SamplingParams for {len(prompts)} prompts: expected one or one each")
        return self._call(self._generate_all(list(prompts), list(params), use_tqdm))

    async def _generate_all(self, prompts, params, use_tqdm) -> list[RequestOutput]:
        # Submit everything before awaiting anything: a bad prompt fails the whole call
        # before any work is done, and the batch fills at once.
        requests = []
        try:
            for prompt, p in zip(prompts, params):
                requests.append(self.engine.submit(prompt, p))
        except BaseException:
            for request in requests:
                self.engine.release(request)
            raise
        bar = tqdm(total=len(requests), desc="generating", unit="prompt", disable=not use_tqdm, file=sys.stderr)

        async def one(request):
            out = await self.engine.collect(request)
            bar.update(1)
            return out

        with bar:
            tasks = [asyncio.ensure_future(one(request)) for request in requests]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:
                for task in tasks:  # cancelling a task aborts its request and frees its blocks
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, chat: bool = False
               ) -> Iterator[RequestOutput]:
        """Yield deltas (new text and ids) as tokens arrive. `chat` wraps the prompt as a
        user message in the chat template first."""
        if chat:
            prompt = [{"role": "user", "content": prompt}]
        items: queue.SimpleQueue = queue.SimpleQueue()

        async def pump():
            try:
                async for out in self.engine.stream(prompt, params):
                    items.put(out)
            except BaseException as exc:  # noqa: BLE001 - handed to the consuming thread
                items.put(exc)
            finally:
                items.put(_DONE)

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := items.get()) is not _DONE:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()  # a consumer that stops early aborts the request
            try:
                future.result()
            except BaseException:  # noqa: BLE001 - cancelled, or the error already raised above
                pass

    def chat(self, messages: list[dict], params: SamplingParams | None = None, *, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> RequestOutput:
        """Render `messages` with the chat template and generate the assistant's reply. As in
        vLLM, `tools` (OpenAI's function objects) are rendered for the model (through the
        template, or in its system message where the template has none) and the reply comes
        back as text; the server parses calls out of it (runtime/tool_calls.py)."""
        kwargs = dict(chat_template_kwargs or {})
        if tools:
            from runtime.tool_calls import tool_setup

            setup = tool_setup(tools, "auto", list(messages), self.tokenizer.chat_template if self.tokenizer else None)
            messages, kwargs = setup.messages, {**kwargs, **setup.template_kwargs}
        return self._call(self.engine.generate(messages, params, chat_template_kwargs=kwargs or None))
