"""LLM: the synchronous offline facade (prompts in, one output per prompt out)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator, Sequence, Union

import torch
from tqdm.auto import tqdm

from nanoinfer.errors import RequestError
from nanoinfer.loaders import load_model
from nanoinfer.sampling import SamplingParams
from runtime.detokenizer import IncrementalDetokenizer
from runtime.engine_core import EngineConfig, EngineCore
from runtime.outputs import CompletionOutput, RequestOutput
from runtime.sequence import Sequence as Seq

Prompt = Union[str, Sequence[int]]


class _Tracked:
    """A request in flight: its sequence, its detokenizer, what it was asked."""

    def __init__(self, request_id: str, prompt: str | None, seq: Seq, detok: IncrementalDetokenizer | None):
        self.request_id, self.prompt, self.seq, self.detok = request_id, prompt, seq, detok
        self.sent_tokens = 0

    def output(self, delta: bool) -> RequestOutput:
        """The whole result so far, or only what is new since the last delta."""
        seq = self.seq
        final = seq.is_finished
        ids = seq.output_token_ids
        if delta:
            text = self.detok.take_delta(final) if self.detok else ""
            ids, self.sent_tokens = ids[self.sent_tokens:], len(ids)
        else:
            if self.detok:
                self.detok.take_delta(final)
            text = self.detok.text if self.detok else ""
        completion = CompletionOutput(0, text, tuple(ids), seq.finish_reason)
        return RequestOutput(self.request_id, self.prompt, tuple(seq.prompt_token_ids), (completion,), final)


class LLM:
    """Load a model once, then generate for batches of prompts on the paged cache.

    `model` is a short name (default: smollm2-135m-instruct), an HF directory or a .gguf path.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 4096,
        max_model_len: int | None = None,
        progress: bool = True,
    ):
        engine_config = EngineConfig(block_size=block_size, num_blocks=num_blocks, kv_cache_memory=kv_cache_memory,
                                     max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     max_model_len=max_model_len)
        self.model = load_model(model, device=device, dtype=dtype, progress=progress)
        self.engine = EngineCore(self.model, engine_config)
        self._next_request = 0

    @property
    def tokenizer(self):
        return self.model.tokenizer

    def _submit(self, prompt: Prompt, params: SamplingParams, add_special_tokens: bool = True) -> _Tracked:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"{self.model.path} has no tokenizer: pass prompts as token id lists")
            text, ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            text, ids = None, list(prompt)
        seq = self.engine.add_request(ids, params)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens,
                                           stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
        tracked = _Tracked(str(self._next_request), text, seq, detok)
        self._next_request += 1
        return tracked

    def _step(self, live: dict[int, _Tracked]) -> list[_Tracked]:
        """One engine step; returns the requests that made progress."""
        progressed = []
        for out in self.engine.step():
            tracked = live[out.seq.seq_id]
            if tracked.detok is not None:
                tracked.detok.add([out.token_id])
                if tracked.detok.stopped and not out.finished:
                    self.engine.abort(out.seq, reason="stop")
            progressed.append(tracked)
        return progressed

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion in shared batches; outputs keep the prompts' order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"got {len(params)} SamplingParams for {len(prompts)} prompts: expected one or one each")
        requests = []
        try:
            for prompt, p in zip(prompts, params):
                requests.append(self._submit(prompt, p))
        except Exception:
            for tracked in requests:  # nothing half-submitted stays queued
                self.engine.abort(tracked.seq)
            raise
        live = {t.seq.seq_id: t for t in requests}
        bar = tqdm(total=len(requests), desc="generating", unit="prompt", disable=not use_tqdm, file=sys.stderr)
        with bar:
            while self.engine.has_unfinished():
                for tracked in self._step(live):
                    if tracked.seq.is_finished:
                        bar.update(1)
        return [t.output(delta=False) for t in requests]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *,
               chat: bool = False) -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding deltas (new text and ids) as tokens arrive.
        `chat` wraps the prompt as a user message in the chat template first."""
        if chat:
            prompt = self.render_chat([{"role": "user", "content": prompt}])
        tracked = self._submit(prompt, params or SamplingParams(), add_special_tokens=not chat)
        live = {tracked.seq.seq_id: tracked}
        try:
            while not tracked.seq.is_finished:
                if tracked in self._step(live):
                    out = tracked.output(delta=True)
                    if out.text or out.token_ids or out.finished:
                        yield out
        finally:
            self.engine.abort(tracked.seq)  # a consumer that stops early frees the blocks

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        """Render `messages` with the chat template and generate the assistant's reply."""
        text = self.render_chat(messages)
        # The template already writes BOS where the model wants it: add no specials again.
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        out = self.generate([ids], params, use_tqdm=False)[0]
        return RequestOutput(out.request_id, text, out.prompt_token_ids, out.outputs, out.finished)

    def render_chat(self, messages: list[dict]) -> str:
        if self.tokenizer is None:
            raise RequestError(f"{self.model.path} has no tokenizer, so no chat template")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
