"""EngineCore: the synchronous step (plan, apply, batch, forward, sample, finish).

One instance is driven by one thread (the worker). It knows tokens, not text: detokenization
and stop strings happen on the consumer side, which calls `abort` when a stop string ends a
request early.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import NamedTuple, Sequence as Seq

import torch

from nanoinfer.batch import SeqChunk, build_batch
from nanoinfer.errors import RequestError
from nanoinfer.kv_cache import allocate_kv_pool, copy_blocks, kv_bytes_per_block, swap_blocks
from nanoinfer.loaders import LoadedModel
from nanoinfer.loaders.hub import cache_dir
from nanoinfer.model import EAGER, compiled_layer_functions, forward
from nanoinfer.sampling import SamplingParams, SamplingTensors, compute_logprobs, sample
from runtime.block_manager import BlockManager
from runtime.kv_budget import kv_blocks_for_memory
from runtime.outputs import TokenLogprob
from runtime.scheduler import Plan, SchedulerConfig, plan
from runtime.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: from kv_cache_memory (CPU) or free GPU memory
    kv_cache_memory: int | None = None  # bytes for the KV pool when num_blocks is None
    swap_space: int = 0  # bytes of host memory for swapped-out KV blocks
    max_model_len: int | None = None  # None: the model's context length
    gpu_memory_utilization: float = 0.9  # share of the GPU the weights, activations and KV pool may use
    enforce_eager: bool = False  # no CUDA graphs and no torch.compile
    nvtx: bool = False  # NVTX ranges around each step phase, for Nsight Systems (CUDA only)
    scheduler: SchedulerConfig = SchedulerConfig()

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise RequestError(f"block_size={self.block_size!r} is invalid: expected an integer >= 1")
        for name in ("num_blocks", "kv_cache_memory", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise RequestError(f"{name}={value!r} is invalid: expected an integer >= 1 or None")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise RequestError(f"gpu_memory_utilization={self.gpu_memory_utilization!r} is invalid: expected (0, 1]")
        if not isinstance(self.swap_space, int) or self.swap_space < 0:
            raise RequestError(f"swap_space={self.swap_space!r} is invalid: expected bytes >= 0")
        if self.scheduler.preemption_mode == "swap" and self.swap_space == 0:
            raise RequestError("preemption_mode='swap' needs swap_space > 0 (bytes of host memory for KV blocks)")


class TokenOutput(NamedTuple):
    """One sequence's progress in one step: the token it sampled, and whether it is done."""

    seq: Sequence
    token_id: int
    finished: bool
    logprob: TokenLogprob | None = None  # when the request asked for logprobs
    prompt_logprobs: tuple | None = None  # with a sequence's first token, when asked for


class EngineCore:
    def __init__(self, model: LoadedModel, config: EngineConfig = EngineConfig()):
        self.model = model
        self.config = config
        cfg = model.config
        self.device = model.params.device
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        dtype = model.params.dtype
        per_block = kv_bytes_per_block(cfg, config.block_size, dtype)
        num_blocks = config.num_blocks or kv_blocks_for_memory(model, config, self.max_model_len, per_block,
                                                               self._attention_backend)
        num_cpu_blocks = config.swap_space // per_block
        self.kv = allocate_kv_pool(cfg, num_blocks, config.block_size, dtype, self.device)
        # Host blocks for swapped sequences; pinned on CUDA so the copies can run async.
        self.cpu_kv = allocate_kv_pool(cfg, num_cpu_blocks, config.block_size, dtype, "cpu")
        if self.device.type == "cuda" and num_cpu_blocks:
            self.cpu_kv = self.cpu_kv.pin_memory()
        self.blocks = BlockManager(num_blocks, config.block_size, num_cpu_blocks)
        self.attention = self._attention_backend()
        self.layer_fns, self.graphs = EAGER, None
        if self.device.type == "cuda" and not config.enforce_eager:
            from nanoinfer.graphs import DecodeGraphs

            # Keep Inductor's compiled kernels beside the models, so a second start is fast.
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
            self.layer_fns = compiled_layer_functions()
            self.graphs = DecodeGraphs(model.params, self.kv, cfg, self.attention,
                                       max_batch=min(config.scheduler.max_num_seqs, 512),
                                       max_blocks=-(-self.max_model_len // config.block_size),
                                       layer_fns=self.layer_fns)
            self.graphs.capture()
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.step_count = 0
        self.phase_times: dict[str, float] = {}  # host seconds per step phase, summed (benchmarks read it)
        self._nvtx_open = False  # an NVTX range is open (config.nvtx on CUDA)
        self.num_preemptions = 0
        self.generated_tokens = 0
        self._next_id = 0
        self._seed_source = random.Random()

    def _attention_backend(self):
        """Triton kernels on CUDA; batched torch ops on the CPU. Both are tested against the
        reference backend, which stays the oracle."""
        if self.device.type == "cuda":
            from nanoinfer.attention.triton_paged import TritonPagedAttention

            return TritonPagedAttention(self.model.config, device=self.device)
        from nanoinfer.attention.torch_paged import TorchPagedAttention

        return TorchPagedAttention(self.config.block_size)

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
        prompt_blocks = len(ids) // self.blocks.block_size  # full blocks the n completions share
        need = prompt_blocks + params.n * (self.blocks.blocks_for(self._max_total(ids, params)) - prompt_blocks)
        if need > self.blocks.num_blocks:
            raise RequestError(
                f"the request needs up to {need * self.blocks.block_size} tokens of KV cache "
                f"(n={params.n}, {self._max_total(ids, params)} each) but the pool holds "
                f"{self.blocks.num_blocks * self.blocks.block_size}: lower max_tokens or raise num_blocks",
                param="max_tokens")
        return ids

    def _max_total(self, ids: list[int], params: SamplingParams) -> int:
        if params.max_tokens is None:  # as much as fits: the context, and the pool
            return min(self.max_model_len, self.blocks.num_blocks * self.blocks.block_size)
        return min(len(ids) + params.max_tokens, self.max_model_len)

    def add_request(self, prompt_token_ids: Seq[int], params: SamplingParams, *, request_id: str = "",
                    priority: int = 0) -> Sequence:
        """Validate and queue a request; raises RequestError naming the bad value."""
        ids = self.check_request(prompt_token_ids, params)
        if params.seed is None:
            # Unseeded requests draw a seed here, so the sampler itself is always deterministic.
            params = params.with_seed(self._seed_source.getrandbits(48))
        seqs = []
        for i in range(params.n):
            # Completion i draws with seed + i: different samples, each reproducible.
            seqs.append(Sequence(self._next_id, ids, params.with_seed(params.seed + i), self._max_total(ids, params),
                                 request_id=request_id, priority=priority, arrival=self.step_count, index=i))
            self._next_id += 1
        seq, seq.forks = seqs[0], seqs[1:]
        self.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        """Finish `seq` now (a stop string matched, or the caller gave up) and free its blocks;
        completions not yet forked off it end with it."""
        for fork in seq.forks:
            self._finish(fork, reason)
        seq.forks = []
        if not seq.is_finished:
            self._finish(seq, reason)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def stats(self) -> dict:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "swapped": len(self.swapped),
            "free_blocks": self.blocks.num_free_blocks,
            "total_blocks": self.blocks.num_blocks,
            "num_preemptions": self.num_preemptions,
            "generated_tokens": self.generated_tokens,
            "steps": self.step_count,
        }

    # -- the step -------------------------------------------------------------------------

    def plan(self) -> Plan:
        return plan(self.waiting, self.running, self.swapped, self.blocks, self.config.scheduler, self.step_count)

    def _apply(self, p: Plan) -> None:
        """Carry out the plan's preemptions, swaps and allocations, in that order."""
        for seq in p.preempt:
            self.running.remove(seq)
            seq.num_preemptions += 1
            self.num_preemptions += 1
            if seq in p.swap_out:
                swap_blocks(self.kv, self.cpu_kv, self.blocks.swap_out(seq))
                seq.status = SequenceStatus.SWAPPED
                self.swapped.append(seq)
            else:
                self.blocks.free(seq)
                seq.num_computed_tokens = 0  # its prompt and output so far are prefilled again
                seq.status = SequenceStatus.WAITING
                self.waiting.append(seq)
        for seq in p.swap_in:
            swap_blocks(self.cpu_kv, self.kv, self.blocks.swap_in(seq))
            self.swapped.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        for seq, n in p.chunks:
            if seq.status is SequenceStatus.WAITING:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
            copy_blocks(self.kv, self.blocks.append_slots(seq, seq.num_computed_tokens + n))

    def step(self) -> list[TokenOutput]:
        """Plan and run one forward over every scheduled sequence; return the sampled tokens."""
        clock = time.perf_counter()
        self._nvtx_next("schedule")
        p = self.plan()
        self._apply(p)
        self.step_count += 1
        if not p.chunks:
            self._nvtx_next(None)
            return []
        clock = self._phase("schedule", clock)
        cfg = self.model.config
        chunks, logits_rows, samplers, prompt_rows = [], [], [], []
        row = 0
        for seq, n in p.chunks:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            chunks.append(SeqChunk(seq.token_ids[start:end], start, seq.block_table, end == seq.num_tokens))
            if seq.params.prompt_logprobs is not None and len(seq.prompt_logprobs or ()) < seq.num_prompt_tokens:
                # Row j (position start + j) predicts token start + j + 1 of the prompt.
                last = min(end, seq.num_prompt_tokens - 1)
                prompt_rows.append((seq, len(logits_rows), start, last))
                logits_rows.extend(range(row, row + max(0, last - start)))
            if end == seq.num_tokens:
                samplers.append((seq, len(logits_rows)))
                logits_rows.append(row + n - 1)
            row += n
        batch = build_batch(chunks, self.config.block_size, self.device)
        batch = batch._replace(logits_indices=torch.tensor(logits_rows, dtype=torch.int64).to(self.device))
        clock = self._phase("batch", clock)
        if self.graphs is not None and self.graphs.can_run(batch):
            logits = self.graphs.run(batch)
        else:
            logits = forward(self.model.params, self.kv, batch, cfg, self.attention, self.layer_fns)
        clock = self._phase("forward", clock)
        for seq, n in p.chunks:
            seq.num_computed_tokens += n
        prompt_logprobs = self._prompt_logprobs(logits, prompt_rows)
        # A finished prefill with pending forks: the n - 1 other completions share its blocks
        # and sample their first token from the same logits row.
        for seq, logits_row in list(samplers):
            for fork in seq.forks:
                self.blocks.fork(seq, fork)
                fork.status = SequenceStatus.RUNNING
                self.running.append(fork)
                samplers.append((fork, logits_row))
            seq.forks = []
        sampling_seqs = [seq for seq, _ in samplers]
        logits = logits[torch.tensor([r for _, r in samplers], dtype=torch.int64, device=logits.device)]
        params = [s.params for s in sampling_seqs]
        history = any(p.has_penalties for p in params)
        st = SamplingTensors.build(params, [s.num_output_tokens for s in sampling_seqs], cfg.vocab_size, self.device,
                                   prompts=[s.prompt_token_ids for s in sampling_seqs] if history else (),
                                   outputs=[s.output_token_ids for s in sampling_seqs] if history else (),
                                   eos_token_ids=cfg.eos_token_ids)
        token_tensor = sample(logits, st)
        tokens = token_tensor.tolist()
        logprobs = self._logprobs(logits, token_tensor, params)
        self._phase("sample", clock)  # on a GPU this includes waiting for the step to finish
        outputs = []
        for i, (seq, token) in enumerate(zip(sampling_seqs, tokens)):
            seq.token_ids.append(token)
            self.generated_tokens += 1
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
            outputs.append(TokenOutput(seq, token, reason is not None, logprobs[i], prompt_logprobs.get(seq.seq_id)))
        return outputs

    # Phases in order; each `_phase(name)` call ends `name` and starts the next.
    _NEXT_PHASE = {"schedule": "batch", "batch": "forward", "forward": "sample", "sample": None}

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

    def _logprobs(self, logits, tokens, params) -> list[TokenLogprob | None]:
        wanted = [p.logprobs for p in params]
        if all(k is None for k in wanted):
            return [None] * len(params)
        lp = compute_logprobs(logits, tokens, max(k or 0 for k in wanted))
        chosen, top_ids, top_values = lp.token_logprobs.tolist(), lp.top_ids.tolist(), lp.top_logprobs.tolist()
        return [None if k is None else TokenLogprob(int(t), chosen[i], tuple(zip(top_ids[i][:k], top_values[i][:k])))
                for i, (k, t) in enumerate(zip(wanted, tokens.tolist()))]

    def _prompt_logprobs(self, logits, prompt_rows) -> dict:
        """Extend each asking sequence's prompt logprobs with this chunk's rows; return the
        finished lists by sequence id (None first: the first token has no context)."""
        done = {}
        for seq, first_row, start, last in prompt_rows:
            if start == 0:  # (again, after a recompute preemption mid-prompt)
                seq.prompt_logprobs = [None]
            collected = seq.prompt_logprobs
            if last > start:
                rows = logits[first_row:first_row + last - start]
                targets = torch.tensor(seq.prompt_token_ids[start + 1:last + 1], device=logits.device)
                k = seq.params.prompt_logprobs
                lp = compute_logprobs(rows, targets, k)
                for t, v, ids, vals in zip(targets.tolist(), lp.token_logprobs.tolist(), lp.top_ids.tolist(),
                                           lp.top_logprobs.tolist()):
                    collected.append(TokenLogprob(t, v, tuple(zip(ids, vals))))
            seq.prompt_logprobs = collected
            if len(collected) == seq.num_prompt_tokens:
                done[seq.seq_id] = tuple(collected)
        return done

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if token in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token in self.model.config.eos_token_ids:
            return "stop"
        if seq.num_tokens >= seq.max_total_tokens:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
