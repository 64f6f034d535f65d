"""EngineCore: requests in, one step at a time, tokens out — the scheduler, the executor and the resolver joined.

One instance is driven by one thread. A step: the scheduler plans and applies (runtime/engine/
scheduler.py), the executor launches (runtime/executor/), the scheduler commits, and the
resolver applies the tokens (runtime/engine/resolve.py). It knows tokens, not text:
detokenization and stop strings happen in LLMEngine, which calls `abort_request` when a stop
string ends a request early. On CUDA a step launches its work and returns the tokens of the
step before (async scheduling, runtime/executor/step.py), so host work overlaps the device's.
A step that a grammar constrained is read during the next one's launch, once that forward is
queued: its grammars consume its tokens while the device runs, then fill the next masks.
Features plug in where a step has a seam: speculative decoding before the plan and after the
resolve (runtime/engine/speculative.py), structured output at submit and resolve
(runtime/engine/structured_output.py), fault containment in the `except` clauses
(runtime/engine/faults.py). A request that uses none of them runs none of their code.
"""

from __future__ import annotations

import dataclasses
import gc
import random
from collections import deque
from typing import Hashable, Sequence as Seq

import torch

from nanoinfer.errors import RequestError
from nanoinfer.loaders import LoadedModel
from nanoinfer.sampling.sampler import SamplingParams
from runtime.engine_config import EngineConfig
from runtime.engine.block_manager import BlockManager
from runtime.engine.outputs import TokenOutput
from runtime.engine.policy import Plan
from runtime.engine.request_limits import RequestLimits
from runtime.engine.resolve import Resolver
from runtime.engine.scheduler import Scheduler
from runtime.engine.sequence import Sequence
from runtime.engine.step_timer import StepTimer
from runtime.executor.make_executor import make_executor
from runtime.executor.step import InFlightStep

__all__ = ["EngineConfig", "EngineCore", "TokenOutput"]


CLOSED = "the engine is closed (its memory given back): make a new one"


class EngineCore:
    def __init__(self, model: LoadedModel, config: EngineConfig = EngineConfig(), draft_model: LoadedModel | None = None):
        """`draft_model`: speculative decoding's draft, made in memory (default: loaded from
        `config.speculative_config.model` when its method is draft_model)."""
        self.model, self.config = model, config
        cfg = model.config
        self.device = model.params.device
        max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        model = self.model = model.for_context(max_model_len)  # (longrope: the context's frequencies)
        self.executor = make_executor(model, config, max_model_len, draft_model)
        self.max_model_len = self.executor.max_model_len  # (at most what its KV pool holds)
        blocks = BlockManager(self.executor.num_blocks, config.block_size, self.executor.num_cpu_blocks,
                              prefix_caching=config.enable_prefix_caching)
        # Overlap host and device where the device runs asynchronously (see runtime/executor/step.py):
        # the executor's steps_in_flight stay launched and unread between steps (2: the pipeline's
        # stages overlap two steps of disjoint sequences, runtime/engine/virtual_engines.py).
        # A step that verifies drafts is resolved at once (the next one's drafts depend on it).
        self.async_scheduling = (self.device.type == "cuda" if config.async_scheduling is None
                                 else config.async_scheduling)
        self.steps_in_flight = self.executor.steps_in_flight if self.async_scheduling else 0
        self.scheduler = Scheduler(config.scheduler, blocks, self.executor, self.steps_in_flight)
        self.limits = RequestLimits(cfg.vocab_size, self.max_model_len, config.scheduler.max_num_seqs,
                                    blocks.block_size, blocks.num_blocks,
                                    max_model_len if max_model_len > self.max_model_len else None)
        self.resolver = Resolver(self.scheduler, cfg.eos_token_ids)
        self.timer = StepTimer(config.nvtx and self.device.type == "cuda")
        self.speculator = None
        if config.speculative_config is not None:
            from runtime.engine.speculative import Speculator

            self.speculator = self.resolver.speculator = Speculator(config.speculative_config)
        self.structured = None  # runtime/engine/structured_output.py, from the first request that asks for it
        self.step_count = 0
        self.closed = False
        self._next_id = 0
        self._seed_source = random.Random()
        self._in_flight: deque[InFlightStep] = deque()  # launched, results not yet applied: oldest first

    # -- requests -------------------------------------------------------------------------

    def check_request(self, prompt_token_ids: Seq[int], params: SamplingParams) -> list[int]:
        """The prompt as a list, or RequestError naming what makes it impossible to serve."""
        ids = self.limits.check(prompt_token_ids, params)
        if params.structured_outputs is not None:
            self._structured().check(params.structured_outputs)
        return ids

    def _max_total(self, ids: list[int], params: SamplingParams) -> int:
        return self.limits.max_total(ids, params)

    def _structured(self):
        if self.structured is None:
            from runtime.engine.structured_output import StructuredOutput

            self.structured = self.resolver.grammars = StructuredOutput(self.executor.grammars)
        return self.structured

    def add_request(self, prompt_token_ids: Seq[int], params: SamplingParams, *, request: Hashable = None,
                    priority: int = 0) -> Sequence:
        """Validate and queue a request; raises RequestError naming the bad value. `request` is
        the key `abort_request` and the outputs' `seq.request` know it by (default: a new one)."""
        if self.closed:
            raise RuntimeError(CLOSED)
        ids = self.check_request(prompt_token_ids, params)
        if params.seed is None:
            # Unseeded requests draw a seed here, so the sampler itself is always deterministic.
            params = params.with_seed(self._seed_source.getrandbits(48))
        key = request if request is not None else ("seq", self._next_id)
        if key in self.scheduler.requests:
            raise RequestError(f"request {key!r} is already running", param="request_id")
        # Completion i draws with seed + i: different samples, each reproducible.
        seqs = [Sequence(self._next_id + i, ids, params.with_seed(params.seed + i), self._max_total(ids, params),
                         request=key, priority=priority, arrival=self.step_count, index=i) for i in range(params.n)]
        self._next_id += params.n
        if params.structured_outputs is not None:
            self._structured().constrain(seqs, params.structured_outputs)
        self.scheduler.add(seqs)
        return seqs[0]

    def abort_request(self, request: Hashable, reason: str = "abort", index: int | None = None) -> None:
        """Finish a request's sequences now (all, or completion `index`: its stop string
        matched) and free their blocks; unknown or finished requests are ignored."""
        self.scheduler.abort(request, reason, index)

    def fail_all(self, error: Exception) -> list[TokenOutput]:
        """Fail every request (the device is gone, or the step loop met an error it cannot
        place); one output per failed sequence."""
        outputs = []
        self._in_flight.clear()
        for seqs in list(self.scheduler.requests.values()):
            outputs += self.scheduler.fail(seqs[0], error)
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.requests or self._in_flight)

    def close(self) -> None:
        """Give back what the engine holds (idempotent): the other tensor-parallel ranks, and the device's memory
        — weights, KV pool, CUDA graphs — as a closed file gives back its handle, so that a notebook or an
        evaluation loop can load the next model in the same process. It takes no request after."""
        if self.closed:
            return
        self.closed = True
        if self.device.type == "cuda":  # (the steps in flight finish before their buffers are let go)
            torch.cuda.synchronize(self.device)
        self._in_flight.clear()
        self.executor.close()
        self.model = dataclasses.replace(self.model, params=None)
        gc.collect()  # (the steps' objects in reference cycles hold device tensors too)
        if self.device.type == "cuda":
            # cuBLAS keeps a 32 MiB workspace a stream, inside the allocator's segments: while one lives, its
            # segment (1.5 GiB of a Qwen3-0.6B engine's, measured on an H100) cannot go back to the device.
            # (The process's: another engine alive in it makes new ones at its next matmul.)
            if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
                torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()  # (the caching allocator's blocks, back to the device)
        else:  # (the heap keeps freed buffers for the next op: runtime/executor/host_heap.py)
            from runtime.executor import host_heap

            host_heap.give_back()

    def stats(self) -> dict:
        spec = self.speculator
        return {**self.scheduler.stats(), "generated_tokens": self.resolver.generated_tokens,
                # speculative decoding: draft tokens verified, and accepted
                "spec_draft_tokens": spec.num_proposed if spec else 0,
                "spec_accepted_tokens": spec.num_accepted if spec else 0, "steps": self.step_count}

    # -- the step -------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[TokenOutput]:
        """Plan and launch one forward over the scheduled sequences; return the tokens sampled
        by the oldest step in flight (async scheduling: `steps_in_flight` stay unread) or by
        this one (synchronous), and the sequences failed meanwhile. A failed launch is contained
        (runtime/engine/faults.py); only a fatal device error raises (EngineDead)."""
        start = self.timer.start()
        fifo = self._in_flight
        previous = fifo.popleft() if fifo and len(fifo) >= self.steps_in_flight else None
        outputs, drafts, chunks, step = [], {}, (), None
        if self.speculator is not None:
            before, previous, start, drafts = self.speculator.begin_step(self.scheduler.running, previous,
                                                                         self.resolver, start)
            outputs += before
        try:
            p, failed = self.scheduler.apply(self.scheduler.plan(self.step_count))
            outputs += failed
            self.step_count += 1
            chunks = p.chunks
            if fifo:  # (two steps in flight)
                previous = self._to_resolve(previous, bool(chunks), outputs)
            if chunks:
                step, failed, previous = self._launch(p, drafts, previous)
                outputs += failed
        finally:
            if drafts:
                self.speculator.forget(drafts)
        self.timer.next("resolve")
        if previous is not None:
            outputs += self.resolver.resolve(previous)
        before, unread = self.resolver.generated_tokens, False
        if step is not None:
            if not self.async_scheduling or step.verified:
                outputs += self.resolver.resolve(step)
            else:
                fifo.append(step)
                unread = True
        if self.speculator is not None:
            tokens = len(step.rows) if unread else self.resolver.generated_tokens - before
            self.speculator.end_step(chunks, step, tokens, start)
        self.timer.end()
        return outputs

    def _to_resolve(self, previous: InFlightStep | None, launching: bool,
                    outputs: list[TokenOutput]) -> InFlightStep | None:
        """With two steps in flight, the step this call reads after its launch. Without a launch,
        the oldest. A plan of the same group as the newest step (runtime/engine/virtual_engines.py:
        its own group had nothing to run) needs that step's tokens: the older steps are read now,
        and the newest as with one step in flight (after the launch, or during it if constrained)."""
        fifo = self._in_flight
        if not launching:
            return previous if previous is not None else fifo.popleft()
        if self.scheduler.lanes is not None and self.scheduler.lanes.serial:
            while fifo:
                if previous is not None:
                    outputs += self.resolver.resolve(previous)
                previous = fifo.popleft()
        return previous

    def _launch(self, p: Plan, drafts: dict,
                previous: InFlightStep | None) -> tuple[InFlightStep | None, list, InFlightStep | None]:
        """Have the executor launch the plan's step, and commit its effect on the sequences: a
        launch that raises leaves them as planned (and is contained: runtime/engine/faults.py).
        Returns the step, outputs, and the step before it if still unread: a constrained one is
        read during the launch, once this step's forward is queued (its grammars must consume
        its tokens before they mask this step's logits; the forward needs no mask)."""
        self.timer.next("batch")
        inp = self.scheduler.step_input(p, drafts)
        self.timer.next("forward")
        early = _ReadBetween(self, previous) if previous is not None and previous.constrained else None
        try:
            step = self.executor.launch(inp, lambda: self.timer.next("sample"), early or (lambda: None))
        except Exception as exc:  # noqa: BLE001 - contained, see runtime/engine/faults.py
            from runtime.engine.faults import launch_failed

            if early is None or not early.started:
                return None, launch_failed(self.scheduler, p, exc, previous, self.device), previous
            if early.outputs is None:
                raise  # (reading the step before failed, not this launch: as where it is read otherwise)
            return None, early.outputs + launch_failed(self.scheduler, p, exc, None, self.device), None
        outputs = []
        if early is not None:
            outputs, previous = early.outputs, None
        isolation = self.scheduler.isolation
        if isolation is not None:  # the step that narrows a failure down passed
            isolation.succeeded()
            if isolation.done:
                self.scheduler.isolation = None
        self.scheduler.commit(inp, step)
        return step, outputs, previous


class _ReadBetween:
    """A constrained step in flight, read between the next step's forward and its sampling
    (the executor's `before_sampling`): the host feeds the grammars while the device runs."""

    def __init__(self, core: EngineCore, step: InFlightStep):
        self.core, self.step = core, step
        self.started = False
        self.outputs: list[TokenOutput] | None = None  # once read

    def __call__(self) -> None:
        self.started = True
        self.core.timer.next("resolve")
        self.outputs = self.core.resolver.resolve(self.step)
        self.core.timer.next("sample")
