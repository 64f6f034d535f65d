"""EngineCore: the requests — queues, the plan and how it is applied, forks, finishing.

One instance is driven by one thread (the worker). It decides each step's work and hands it
to the ModelRunner (runtime/executor/model_runner.py), which owns everything on the device. It knows
tokens, not text: detokenization and stop strings happen on the consumer side, which calls
`abort_request` when a stop string ends a request early. On CUDA a step launches its work and
returns the tokens of the step before (async scheduling, runtime/executor/inflight.py), so host work
overlaps the device's. A failed step is contained (runtime/engine/faults.py).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from typing import Hashable, NamedTuple, Sequence as Seq

import torch

from nanoinfer.errors import RequestError
from nanoinfer.host_copy import to_device_packed
from nanoinfer.loaders import LoadedModel
from nanoinfer.sampling import SamplingParams
from runtime.engine.block_manager import BlockManager
from runtime.executor.draft_runner import check_draft
from runtime.engine.engine_config import EngineConfig
from runtime.engine.faults import Fault, Isolation, RequestFailed, classify
from runtime.executor.inflight import InFlightStep, PromptLogprobRows
from runtime.executor.model_runner import Chunk, ModelRunner, StepInput
from runtime.engine.outputs import TokenLogprob
from runtime.engine.scheduler import Plan, WaitingQueue, decode_plan, plan
from runtime.engine.sequence import Sequence, SequenceStatus
from runtime.engine.speculative import Speculator

__all__ = ["EngineConfig", "EngineCore", "EngineDead", "TokenOutput"]

log = logging.getLogger("nanoinfer.engine")


class TokenOutput(NamedTuple):
    """One sequence's progress in one step: the token it sampled, and whether it is done. A
    sequence the engine failed reports once with no token and `seq.error` set."""

    seq: Sequence
    token_id: int | None
    finished: bool
    logprob: TokenLogprob | None = None  # when the request asked for logprobs
    prompt_logprobs: tuple | None = None  # with a sequence's first token, when asked for


class EngineDead(RuntimeError):
    """The device failed in a way nothing on it survives: every request fails, the engine stops."""


class EngineCore:
    def __init__(self, model: LoadedModel, config: EngineConfig = EngineConfig(), draft_model: LoadedModel | None = None):
        """`draft_model`: speculative decoding's draft, made in memory (default: loaded from
        `config.speculative_config.model` when its method is draft_model)."""
        self.model = model
        self.config = config
        cfg = model.config
        self.device = model.params.device
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model":
            if draft_model is None:
                from nanoinfer.loaders import load_model

                draft_model = load_model(spec.model, device=str(self.device), progress=False,
                                         dtype=str(model.params.dtype).removeprefix("torch."),
                                         quantization=spec.quantization)
            check_draft(model, draft_model)
        elif draft_model is not None:
            raise RequestError("a draft model was given but speculative_config does not ask for one: expected "
                               "method 'draft_model'", param="speculative_config")
        self.runner = ModelRunner(model, config, self.max_model_len, draft_model)
        self.grammars = self.runner.grammars  # structured output's compiler (the runner fills the masks)
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, self.runner.num_cpu_blocks,
                                   prefix_caching=config.enable_prefix_caching)
        self.waiting = WaitingQueue(config.scheduler)
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.requests: dict[Hashable, list[Sequence]] = {}  # request key -> its n sequences, until all finish
        self.isolation = Isolation(config.scheduler.max_num_batched_tokens)
        self.step_count = 0
        self.phase_times: dict[str, float] = {}  # host seconds per step phase, summed (benchmarks read it)
        self._nvtx_open = False  # an NVTX range is open (config.nvtx on CUDA)
        self.num_preemptions = 0
        self.generated_tokens = 0
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        self._next_id = 0
        self._seed_source = random.Random()
        # Speculative decoding (runtime/engine/speculative.py): the drafts of the step being planned.
        self.speculator = Speculator(config.speculative_config) if config.speculative_config else None
        self._drafts: dict[Sequence, list[int]] = {}
        # Overlap host and device where the device runs asynchronously (see runtime/executor/inflight.py).
        # A step that verifies drafts is resolved at once (the next one's drafts depend on it).
        self.async_scheduling = (self.device.type == "cuda" if config.async_scheduling is None
                                 else config.async_scheduling)
        self._timed: tuple | None = None  # (speculated, tokens, start) of the step before, for the policy
        self._in_flight: InFlightStep | None = None  # launched, results not yet applied

    # -- requests -------------------------------------------------------------------------

    def check_request(self, prompt_token_ids: Seq[int], params: SamplingParams) -> list[int]:
        """The prompt as a list, or RequestError naming what makes it impossible to serve."""
        vocab = self.model.config.vocab_size
        ids = list(prompt_token_ids)
        bad_bias = [t for t, _ in params.logit_bias if t >= vocab] + [t for t in params.stop_token_ids if t >= vocab]
        if bad_bias:
            raise RequestError(f"token id {bad_bias[0]} in logit_bias/stop_token_ids is out of range: expected "
                               f"0 <= id < {vocab}", param="logit_bias")
        if not ids:
            raise RequestError("the prompt is empty: expected at least one token", param="prompt")
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise RequestError(f"prompt token id {bad[0]!r} is out of range: expected 0 <= id < {vocab}",
                               param="prompt")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens: expected fewer than max_model_len={self.max_model_len}",
                param="prompt")
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            # As vLLM (and OpenAI) answer: never cut the completion short without saying so.
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, {params.max_tokens} in the "
                f"completion): reduce the prompt or max_tokens", param="max_tokens")
        if params.n > self.config.scheduler.max_num_seqs:
            raise RequestError(f"n={params.n} is more than this engine runs at once: expected n <= max_num_seqs="
                               f"{self.config.scheduler.max_num_seqs}", param="n")
        prompt_blocks = len(ids) // self.blocks.block_size  # full blocks the n completions share
        need = prompt_blocks + params.n * (self.blocks.blocks_for(self._max_total(ids, params)) - prompt_blocks)
        if need > self.blocks.num_blocks:
            raise RequestError(
                f"the request needs up to {need * self.blocks.block_size} tokens of KV cache "
                f"(n={params.n}, {self._max_total(ids, params)} each) but the pool holds "
                f"{self.blocks.num_blocks * self.blocks.block_size}: lower max_tokens or raise num_blocks",
                param="max_tokens")
        if params.structured_outputs is not None:
            self.grammars.check(params.structured_outputs)  # (compiled and cached; a bad one is named)
        return ids

    def _max_total(self, ids: list[int], params: SamplingParams) -> int:
        if params.max_tokens is None:  # as much as fits: the context, and the pool
            return min(self.max_model_len, self.blocks.num_blocks * self.blocks.block_size)
        return len(ids) + params.max_tokens

    def add_request(self, prompt_token_ids: Seq[int], params: SamplingParams, *, request: Hashable = None,
                    priority: int = 0) -> Sequence:
        """Validate and queue a request; raises RequestError naming the bad value. `request` is
        the key `abort_request` and the outputs' `seq.request` know it by (default: a new one)."""
        ids = self.check_request(prompt_token_ids, params)
        if params.seed is None:
            # Unseeded requests draw a seed here, so the sampler itself is always deterministic.
            params = params.with_seed(self._seed_source.getrandbits(48))
        key = request if request is not None else ("seq", self._next_id)
        if key in self.requests:
            raise RequestError(f"request {key!r} is already running", param="request_id")
        seqs = []
        for i in range(params.n):
            # Completion i draws with seed + i: different samples, each reproducible.
            seqs.append(Sequence(self._next_id, ids, params.with_seed(params.seed + i), self._max_total(ids, params),
                                 request=key, priority=priority, arrival=self.step_count, index=i))
            if params.structured_outputs is not None:
                seqs[-1].constraint = self.grammars.constraint(params.structured_outputs)
            self._next_id += 1
        seq, seq.forks = seqs[0], seqs[1:]
        self.requests[key] = seqs
        self.waiting.add(seq)
        return seq

    def abort_request(self, request: Hashable, reason: str = "abort", index: int | None = None) -> None:
        """Finish a request's sequences now (all, or completion `index`: its stop string
        matched) and free their blocks; unknown or finished requests are ignored."""
        for seq in list(self.requests.get(request, ())):
            if index is None or seq.index == index:
                self.abort(seq, reason)

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        """Finish `seq` now (a stop string matched, or the caller gave up) and free its blocks;
        completions not yet forked off it end with it."""
        for fork in seq.forks:
            self._finish(fork, reason)
        seq.forks = []
        if not seq.is_finished:
            self._finish(seq, reason)

    def fail_all(self, error: Exception) -> list[TokenOutput]:
        """Fail every request (the device is gone, or the step loop met an error it cannot
        place); one output per failed sequence."""
        outputs = []
        self._in_flight = None
        for seqs in list(self.requests.values()):
            outputs += self._fail(seqs[0], error)
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.requests or self._in_flight)

    def close(self) -> None:
        """Release what outlives a step loop: the other tensor-parallel ranks (idempotent)."""
        self.runner.close()

    def stats(self) -> dict:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "swapped": len(self.swapped),
            "free_blocks": self.blocks.num_free_blocks,
            "total_blocks": self.blocks.num_blocks,
            "num_preemptions": self.num_preemptions,
            "generated_tokens": self.generated_tokens,
            # prefix cache: prompt tokens new sequences looked up, and those found computed
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "cached_blocks": self.blocks.num_cached_blocks,
            # speculative decoding: draft tokens verified, and accepted
            "spec_draft_tokens": self.speculator.num_proposed if self.speculator else 0,
            "spec_accepted_tokens": self.speculator.num_accepted if self.speculator else 0,
            "steps": self.step_count,
        }

    # -- the step -------------------------------------------------------------------------

    def plan(self) -> Plan:
        # A sequence whose last token (still in flight) reaches its length limit has nothing
        # left to compute; it only waits for that token (and keeps its place in the batch).
        running = [s for s in self.running if s.num_tokens < s.max_total_tokens]
        num_idle = len(self.running) - len(running)
        config = self.config.scheduler
        if self.isolation.token_cap is not None:
            config = dataclasses.replace(config, max_num_batched_tokens=self.isolation.token_cap)
        if self.isolation.active:  # narrowing a failure down: only the suspects run, nothing new starts
            allowed = self.isolation.restrict(running)
            return plan((), allowed, (), self.blocks, config, self.step_count, num_idle + len(running) - len(allowed))
        if not self.waiting and not self.swapped and (p := decode_plan(running, self.blocks, config)) is not None:
            return p
        return plan(self.waiting.in_rank_order(self.step_count), running, self.swapped, self.blocks, config,
                    self.step_count, num_idle)

    def _apply(self, p: Plan) -> tuple[Plan, list[TokenOutput]]:
        """Carry out the plan's preemptions, swaps and allocations, in that order; the part of
        the plan that was carried out. A sequence whose part fails (a copy of its blocks) fails
        its request; the rest of the plan then waits for the next step, where it is planned
        again from what did happen. A fatal device error raises (EngineDead)."""
        swap_out = {id(s) for s in p.swap_out}
        seq = None  # the one being worked on, when something fails
        try:
            for seq in p.preempt:
                self.running.remove(seq)
                self.runner.remove(seq)
                seq.num_preemptions += 1
                self.num_preemptions += 1
                if id(seq) in swap_out:
                    seq.status = SequenceStatus.SWAPPED
                    self.swapped.append(seq)
                    self.runner.swap_out(self.blocks.swap_out(seq))
                else:
                    self.blocks.free(seq)
                    seq.num_computed_tokens = seq.num_draft_computed = 0  # prefilled again, output and all
                    seq.status = SequenceStatus.WAITING
                    self.waiting.add(seq)
            # Cached prefixes first: once held, no allocation below can evict them. (Admitted
            # sequences come last in a plan: the loop reads only them, not every running one.)
            for seq, _, cached in reversed(p.chunks) if self.blocks.prefix_caching else ():
                if seq.status is not SequenceStatus.WAITING:
                    break
                self.blocks.attach(seq, cached)
                seq.num_draft_computed = seq.num_computed_tokens  # (a draft model's pool was written with it)
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += seq.num_computed_tokens
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = seq.num_computed_tokens
            for seq in p.swap_in:
                self.swapped.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                self.runner.swap_in(self.blocks.swap_in(seq))
                self.runner.add(seq)
            blocks, runner, rows = self.blocks, self.runner, self.runner.batch.row_of  # (every sequence, every step)
            for seq, n, _ in p.chunks:
                if seq.status is SequenceStatus.WAITING:
                    self.waiting.remove(seq)
                    seq.status = SequenceStatus.RUNNING
                    self.running.append(seq)
                    if seq.scheduled_at is None:
                        seq.scheduled_at = time.monotonic()
                if blocks.needs_slots(seq, seq.num_computed_tokens + n):
                    runner.copy_blocks(blocks.append_slots(seq, seq.num_computed_tokens + n))
                    runner.table_changed(seq)
                if seq.seq_id not in rows:
                    runner.add(seq)
        except Exception as exc:  # noqa: BLE001 - contained: the sequence it happened to fails
            if classify(exc) is Fault.FATAL:
                raise EngineDead(f"the device failed: {exc!r}") from exc
            log.warning("preparing a step failed at sequence %d (%r): failing its request", seq.seq_id, exc)
            return Plan((), (), (), ()), self._fail(seq, RequestFailed.because(
                "internal error while preparing this request's step", exc))
        return p, []

    @torch.inference_mode()
    def step(self) -> list[TokenOutput]:
        """Plan and launch one forward over the scheduled sequences; return the tokens sampled
        by the step before it (async scheduling) or by this one (synchronous), and the
        sequences failed meanwhile. A failed launch is contained (runtime/engine/faults.py); only a
        fatal device error raises (EngineDead)."""
        clock = start = time.perf_counter()
        self._nvtx_next("schedule")
        previous, self._in_flight = self._in_flight, None
        outputs_before = []
        if previous is not None and previous.constrained:  # its grammars must see its tokens before masking again
            outputs_before, previous = self._resolve(previous), None
        if self.speculator is not None:
            speculate = self.speculator.policy.choose()
            if speculate and previous is not None:  # drafts come from the tokens so far: all on the host
                outputs_before, previous = self._resolve(previous), None
                start = time.perf_counter()  # (the step before ends here, not when this one began)
            self._note_step_time(start)
            if speculate:
                self._drafts = self.speculator.lookahead(self.running)
        timed = False
        try:
            p, outputs = self._apply(self.plan())
            timed = self.speculator is not None and self._decode_only(p)
            self.step_count += 1
            clock = self._phase("schedule", clock)
            if p.chunks:
                try:
                    self._in_flight = self._launch(p, clock)
                    self.isolation.succeeded()
                except Exception as exc:  # noqa: BLE001 - contained, see runtime/engine/faults.py
                    outputs += self._launch_failed(p, exc, previous)
                clock = time.perf_counter()
        finally:
            for seq in self._drafts:  # (a lookahead holds for the step it was planned for only)
                seq.num_lookahead = 0
            self._drafts = {}
        if previous is not None:
            outputs += self._resolve(previous)
        step = self._in_flight
        if step is not None and (not self.async_scheduling or step.verified):
            before = self.generated_tokens
            outputs += self._resolve(step)
            self._in_flight = None
            tokens = self.generated_tokens - before
        else:
            tokens = len(step.rows) if step is not None else 0
        if timed and step is not None:
            self._timed = (bool(step.verified), tokens, start, time.perf_counter())
        self._phase("resolve", clock)
        return outputs_before + outputs

    def _note_step_time(self, now: float) -> None:
        """Tell the speculation policy how fast the step before emitted tokens: from its start
        to this one's (async, a step's call waits for the step before it). Not when something
        else came between its call and this one (an idle engine, a slow consumer)."""
        if self._timed is not None:
            speculated, tokens, began, ended = self._timed
            if now - ended <= ended - began:
                self.speculator.policy.record(speculated, tokens, now - began)
            self._timed = None

    @staticmethod
    def _decode_only(p: Plan) -> bool:
        """Whether a plan only decodes (and verifies drafts): the steps whose speed the
        speculation policy compares. A prefill chunk's time says nothing about decoding."""
        return bool(p.chunks) and all(n == 1 or seq.num_pending_tokens == 1 for seq, n, _ in p.chunks)

    def _launch_failed(self, p: Plan, exc: Exception, previous: InFlightStep | None) -> list[TokenOutput]:
        """Contain a failed launch: nothing of it was committed, so its sequences simply run
        again, narrowed down until the failure is placed (see runtime/engine/faults.py)."""
        kind = classify(exc)
        if kind is Fault.FATAL:
            raise EngineDead(f"the device failed: {exc!r}") from exc
        if previous is not None:
            previous.transfer.wait()  # (its tokens are still read below: it ran before the failure)
        if kind is Fault.OUT_OF_MEMORY and self.device.type == "cuda":
            torch.cuda.empty_cache()  # the allocator's cached, fragmented blocks go first
        seqs = [c.seq for c in p.chunks]
        culprit = self.isolation.failed(seqs, p.num_tokens, exc, kind)
        log.warning("a step of %d tokens over %d sequences failed (%r): %s", p.num_tokens, len(seqs), exc,
                    "failing the request it belongs to" if culprit else
                    f"retrying its sequences in smaller steps (token budget {self.isolation.step_budget()})")
        return [] if culprit is None else self._fail(*culprit)

    def _launch(self, p: Plan, clock: float) -> InFlightStep:
        """Decide what the step computes (the rows whose logits are wanted, who samples from
        which), have the runner launch it, and commit its effect on the sequences. Sequences
        change only in `_commit`, once nothing can fail: a launch that raises leaves them as
        planned."""
        chunks, logits_rows, samplers, prompt_rows, verifiers, host_drafts = [], [], [], [], [], []
        draft_tokens = draft_probs = None
        if self.runner.draft is not None:  # a draft model proposes now that the plan gave its slots
            draft_tokens, draft_probs = self.runner.draft.propose(
                [(c.seq, c.seq.num_computed_tokens, c.num_tokens) for c in p.chunks])
        row = 0
        for seq, n, _ in p.chunks:  # (every sequence, every step: kept lean)
            start = seq.num_computed_tokens
            end = start + n
            if n > seq.num_pending_tokens:  # its pending token, then drafts to verify
                j = n - seq.num_pending_tokens
                if self.runner.draft is None:  # (n-gram drafts, from the host)
                    host_drafts += self._drafts[seq][:j]
                chunks.append(Chunk(seq, start, n, j))
                verifiers.append((seq, len(logits_rows), j))
                logits_rows.extend(range(row, row + n))
                row += n
                continue
            chunks.append(Chunk(seq, start, n))
            if seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_done:
                # Row j (position start + j) predicts token start + j + 1 of the prompt; the list
                # is complete once the chunk reaches the prompt's end, where the sequence samples
                # its first token: it goes out with that token.
                last = min(end, seq.num_prompt_tokens - 1)
                prompt_rows.append((seq, len(logits_rows), start, seq.prompt_token_ids[start + 1:last + 1],
                                    end >= seq.num_prompt_tokens))
                logits_rows.extend(range(row, row + max(0, last - start)))
            if end == seq.num_tokens:
                samplers.append((seq, len(logits_rows)))
                if seq.forks:
                    # A finished prefill with pending forks: the n - 1 other completions share
                    # its blocks and sample their first token from the same logits row.
                    forks = [fork for fork in seq.forks if not fork.is_finished]
                    for fork in forks:
                        self.runner.add(fork)  # (a row, for its own sampling parameters)
                    samplers.extend((fork, len(logits_rows)) for fork in forks)
                logits_rows.append(row + n - 1)
            row += n
        clock = self._phase("batch", clock)
        clocks = [clock]

        def forward_done() -> None:  # (the runner's own phases: forward launched, then sampling)
            clocks[0] = self._phase("forward", clocks[0])

        if host_drafts:
            (draft_tokens,) = to_device_packed([host_drafts], torch.int64, self.device)
        step = self.runner.launch(StepInput(tuple(chunks), tuple(logits_rows), tuple(samplers), tuple(prompt_rows),
                                            tuple(verifiers), draft_tokens, draft_probs), forward_done)
        self._phase("sample", clocks[0])
        self._commit(p, prompt_rows, samplers)
        return step

    def _commit(self, p: Plan, prompt_rows: list, samplers: list) -> None:
        """The launched step's effect on its sequences (nothing here can fail)."""
        # A block just filled goes into the prefix cache (a decode fills one every block_size steps).
        register, bs = self.blocks.register, (self.blocks.block_size if self.blocks.prefix_caching else 1 << 62)
        for seq, n, _ in p.chunks:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens // bs > seq.num_registered_blocks:
                register(seq)
        for seq, _, _, _, final in prompt_rows:
            seq.prompt_logprobs_done = final  # (a recompute won't redo them)
        for seq, _, _ in p.chunks:
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            for fork in seq.forks:
                if fork.is_finished:
                    continue
                self.blocks.fork(seq, fork)
                fork.num_draft_computed = seq.num_draft_computed
                self.runner.table_changed(fork)
                fork.status = SequenceStatus.RUNNING
                fork.prompt_logprobs_done = True  # the request's prompt logprobs come with the first completion
                self.running.append(fork)
            seq.forks = []
        for seq, _ in samplers:
            seq.num_unresolved += 1  # known once this step is resolved

    def _resolve(self, step: InFlightStep) -> list[TokenOutput]:
        """Wait for a launched step's results and apply them: tokens appended, stop and length
        checked. Rows of sequences that finished meanwhile (an abort, or a stop token found
        in the step before) are dropped: their one extra row of work is the price of overlap.
        A row that cannot be applied fails its own request, no other."""
        try:
            host = step.transfer.wait()
        except Exception as exc:  # noqa: BLE001 - errors of the device surface here, asynchronously
            if classify(exc) is Fault.FATAL:
                raise EngineDead(f"the device failed: {exc!r}") from exc
            raise
        tokens, finite = host[0].tolist(), host[1].tolist()
        logprobs = [None] * len(tokens)
        rest = 2
        if any(r.logprobs is not None for r in step.rows):
            chosen, top_ids, top_values = (t.tolist() for t in host[2:5])
            logprobs = [None if r.logprobs is None else
                        TokenLogprob(tokens[i], chosen[i], tuple(zip(top_ids[i][:r.logprobs], top_values[i][:r.logprobs])))
                        for i, r in enumerate(step.rows)]
            rest = 5
        outputs = []
        prompt_done = {}
        for j, entry in enumerate(step.prompt_logprobs):
            chosen, top_ids, top_values = (t.tolist() for t in host[rest + 3 * j:rest + 3 * j + 3])
            try:
                done = self._extend_prompt_logprobs(entry, chosen, top_ids, top_values)
            except Exception as exc:  # noqa: BLE001 - this request's bookkeeping: it fails alone
                outputs += self._fail(entry.seq, RequestFailed.because("internal error while running this request",
                                                                       exc))
                continue
            if done is not None:
                prompt_done[entry.seq.seq_id] = done
        finished, take = SequenceStatus.FINISHED, self._take
        off_grammar = self._consume(step, tokens) if step.constrained else ()
        for i, (row, token, ok) in enumerate(zip(step.rows, tokens, finite)):  # (every sequence, every step)
            seq = row.seq
            if seq.status is finished:
                continue
            seq.num_unresolved -= 1
            if not ok:
                outputs += self._fail(seq, self._non_finite())
                continue
            if i in off_grammar:
                outputs += self._fail(seq, self._off_grammar(seq, token))
                continue
            outputs.append(take(seq, token, logprobs[i], prompt_done.get(seq.seq_id)))
        if step.verified:
            outputs += self._apply_verified(step.verified, host[rest + 3 * len(step.prompt_logprobs):])
        return outputs

    def _consume(self, step: InFlightStep, tokens: list[int]) -> set[int]:
        """The grammars of the step's constrained rows consume their tokens (in parallel); the
        rows whose token their grammar refused."""
        rows = [i for i, row in enumerate(step.rows) if row.seq.constraint is not None and not row.seq.is_finished]
        ok = self.grammars.consume([(step.rows[i].seq.constraint, tokens[i]) for i in rows])
        return {i for i, accepted in zip(rows, ok) if not accepted}

    def _take(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None,
              prompt_logprobs: tuple | None = None) -> TokenOutput:
        """A resolved token joins its sequence; a stop token or the length limit finishes it."""
        ids, params = seq.token_ids, seq.params
        ids.append(token)
        self.generated_tokens += 1
        if token in params.stop_token_ids or (token in self.model.config.eos_token_ids and not params.ignore_eos):
            reason = "stop"
        elif seq.constraint is not None and seq.constraint.finished:  # (only the end may follow: it is here)
            reason = "stop"
        elif len(ids) >= seq.max_total_tokens:
            reason = "length"
        else:
            return TokenOutput(seq, token, False, logprob, prompt_logprobs)
        self._finish(seq, reason)
        return TokenOutput(seq, token, True, logprob, prompt_logprobs)

    @staticmethod
    def _off_grammar(seq: Sequence, token: int) -> Exception:
        constraint = seq.constraint
        if constraint.too_complex:  # the client's grammar, not our fault (a 400)
            return RequestError(f"the {constraint.spec.kind} is too complex to follow after {seq.num_output_tokens} "
                                f"output tokens ({constraint.error}): simplify it", param=constraint.spec.param)
        return RequestFailed(f"token {token} does not continue this request's {seq.constraint.spec.kind} "
                             f"({seq.constraint.error}): its grammar left nothing to sample (min_tokens, logit_bias "
                             f"or stop_token_ids against what the grammar requires?)")

    @staticmethod
    def _non_finite() -> RequestFailed:
        return RequestFailed("the model produced non-finite logits (NaN or inf) for this request: its output would "
                             "be garbage, so it was stopped")

    def _apply_verified(self, verified, host: list) -> list[TokenOutput]:
        """Apply a step's verifications: each sequence takes its accepted drafts and the token
        after them, one by one as a sampled token is taken (a stop or the length limit ends it
        there); the KV slots of its rejected drafts are given back."""
        accepted, tokens, finite = (t.tolist() for t in host[:3])
        logprobs = [None] * len(tokens)
        if any(v.logprobs is not None for v in verified):
            chosen, top_ids, top_values = (t.tolist() for t in host[3:6])
            logprobs = [TokenLogprob(tokens[i], chosen[i], tuple(zip(top_ids[i], top_values[i])))
                        for i in range(len(tokens))]
        outputs, first = [], 0
        for seq, j, k in verified:
            row = first
            first += j + 1
            if seq.status is SequenceStatus.FINISHED:
                continue
            if not all(finite[row:row + j + 1]):
                outputs += self._fail(seq, self._non_finite())
                continue
            a = 0
            while a < j and accepted[row + a]:
                a += 1
            self.speculator.num_proposed += j
            self.speculator.num_accepted += a
            seq.num_computed_tokens -= j - a  # the rejected drafts' keys and values are garbage
            seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)
            emitted = tokens[row:row + a + 1]  # (an accepted row's token is its draft)
            self.runner.emitted(seq, emitted)
            for i, token in enumerate(emitted):
                if seq.constraint is not None and not seq.constraint.consume(token):
                    outputs += self._fail(seq, self._off_grammar(seq, token))
                    break
                lp = logprobs[row + i]
                outputs.append(self._take(seq, token, None if k is None else lp._replace(top=lp.top[:k])))
                if seq.is_finished:  # (a stop token or the length limit among the drafts)
                    break
            if not seq.is_finished:
                self.blocks.trim(seq, seq.num_computed_tokens)
                if seq.num_computed_tokens // self.blocks.block_size > seq.num_registered_blocks:
                    self.blocks.register(seq)
        return outputs

    # Phases in order; each `_phase(name)` call ends `name` and starts the next.
    _NEXT_PHASE = {"schedule": "batch", "batch": "forward", "forward": "sample", "sample": "resolve", "resolve": None}

    def _phase(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self.phase_times[name] = self.phase_times.get(name, 0.0) + now - since
        self._nvtx_next(self._NEXT_PHASE[name])
        return now

    def _nvtx_next(self, name: str | None) -> None:
        """Close the open NVTX range (if any) and open `name` (if any)."""
        if not (self.config.nvtx and self.device.type == "cuda"):
            return
        if self._nvtx_open:
            torch.cuda.nvtx.range_pop()
        self._nvtx_open = name is not None
        if name is not None:
            torch.cuda.nvtx.range_push(f"nanoinfer.{name}")

    def _extend_prompt_logprobs(self, entry: PromptLogprobRows, chosen, top_ids, top_values) -> tuple | None:
        """Add a chunk's prompt logprobs to its sequence's list; the whole list once complete
        (None first: the first token has no context)."""
        seq = entry.seq
        if seq.is_finished:
            return None
        if entry.start == 0:  # (again, after a recompute preemption mid-prompt)
            seq.prompt_logprobs = [None]
        for t, v, ids, vals in zip(entry.targets, chosen, top_ids, top_values):
            seq.prompt_logprobs.append(TokenLogprob(t, v, tuple(zip(ids, vals))))
        return tuple(seq.prompt_logprobs) if entry.final else None

    def _fail(self, seq: Sequence, error: Exception) -> list[TokenOutput]:
        """Fail `seq`'s whole request with `error`: every completion ends ("error"), its blocks
        are freed; one output per completion that was still unfinished."""
        outputs = []
        for other in list(self.requests.get(seq.request, (seq,))):
            if not other.is_finished:
                self.blocks.uncache(other)  # (what its steps wrote is not to be shared)
                other.error = error
                self._finish(other, "error")
                outputs.append(TokenOutput(other, None, True))
        return outputs

    def _finish(self, seq: Sequence, reason: str) -> None:
        """The one way a sequence ends: out of its queue, blocks freed, its request forgotten
        once all its completions have ended. (`_apply` keeps a sequence's status and queue in
        step even when it fails half way.)"""
        if seq.status is SequenceStatus.RUNNING and seq in self.running:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED and seq in self.swapped:
            self.swapped.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.discard(seq)  # (a completion not yet forked off was never queued)
        self.blocks.free(seq)
        self.runner.remove(seq)
        seq.num_unresolved = 0  # (tokens of a step still in flight are dropped when it resolves)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seqs = self.requests.get(seq.request)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self.requests[seq.request]
