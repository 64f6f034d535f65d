"""EngineCore: the synchronous step (plan, apply, batch, forward, sample, finish).

One instance is driven by one thread (the worker). It knows tokens, not text: detokenization
and stop strings happen on the consumer side, which calls `abort` when a stop string ends a
request early.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import NamedTuple, Sequence as Seq

import torch

from nanoinfer.batch import SeqChunk, build_batch
from nanoinfer.errors import RequestError
from nanoinfer.kv_cache import allocate_kv_pool, copy_blocks, kv_bytes_per_block, swap_blocks
from nanoinfer.loaders import LoadedModel
from nanoinfer.model import forward
from nanoinfer.sampling import SamplingParams, SamplingTensors, sample
from runtime.block_manager import BlockManager
from runtime.scheduler import Plan, SchedulerConfig, plan
from runtime.sequence import Sequence, SequenceStatus

CPU_KV_BUDGET_BYTES = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: from kv_cache_memory (CPU) or free GPU memory
    kv_cache_memory: int | None = None  # bytes for the KV pool when num_blocks is None
    swap_space: int = 0  # bytes of host memory for swapped-out KV blocks
    max_model_len: int | None = None  # None: the model's context length
    scheduler: SchedulerConfig = SchedulerConfig()

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise RequestError(f"block_size={self.block_size!r} is invalid: expected an integer >= 1")
        for name in ("num_blocks", "kv_cache_memory", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise RequestError(f"{name}={value!r} is invalid: expected an integer >= 1 or None")
        if not isinstance(self.swap_space, int) or self.swap_space < 0:
            raise RequestError(f"swap_space={self.swap_space!r} is invalid: expected bytes >= 0")
        if self.scheduler.preemption_mode == "swap" and self.swap_space == 0:
            raise RequestError("preemption_mode='swap' needs swap_space > 0 (bytes of host memory for KV blocks)")


class TokenOutput(NamedTuple):
    """One sequence's progress in one step: the token it sampled, and whether it is done."""

    seq: Sequence
    token_id: int
    finished: bool


class EngineCore:
    def __init__(self, model: LoadedModel, config: EngineConfig = EngineConfig()):
        self.model = model
        self.config = config
        cfg = model.config
        self.device = model.params.device
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        dtype = model.params.dtype
        per_block = kv_bytes_per_block(cfg, config.block_size, dtype)
        num_blocks = config.num_blocks or self._blocks_from_memory(per_block)
        num_cpu_blocks = config.swap_space // per_block
        self.kv = allocate_kv_pool(cfg, num_blocks, config.block_size, dtype, self.device)
        # Host blocks for swapped sequences; pinned on CUDA so the copies can run async.
        self.cpu_kv = allocate_kv_pool(cfg, num_cpu_blocks, config.block_size, dtype, "cpu")
        if self.device.type == "cuda" and num_cpu_blocks:
            self.cpu_kv = self.cpu_kv.pin_memory()
        self.blocks = BlockManager(num_blocks, config.block_size, num_cpu_blocks)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.step_count = 0
        self.num_preemptions = 0
        self.generated_tokens = 0
        self._next_id = 0
        self._seed_source = random.Random()

    def _blocks_from_memory(self, per_block: int) -> int:
        budget = self.config.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * 0.8) - (1 << 30)  # leave room for activations
            else:
                budget = CPU_KV_BUDGET_BYTES
        # Never more blocks than all sequences could use at full length.
        cap = self.config.scheduler.max_num_seqs * -(-self.max_model_len // self.config.block_size)
        return max(1, min(budget // per_block, cap))

    # -- requests -------------------------------------------------------------------------

    def check_request(self, prompt_token_ids: Seq[int], params: SamplingParams) -> list[int]:
        """The prompt as a list, or RequestError naming what makes it impossible to serve."""
        vocab = self.model.config.vocab_size
        ids = list(prompt_token_ids)
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
        if self.blocks.blocks_for(self._max_total(ids, params)) > self.blocks.num_blocks:
            raise RequestError(
                f"the request needs up to {self._max_total(ids, params)} tokens of KV cache but the pool holds "
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
        seq = Sequence(self._next_id, ids, params, self._max_total(ids, params), request_id=request_id,
                       priority=priority, arrival=self.step_count)
        self._next_id += 1
        self.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        """Finish `seq` now (a stop string matched, or the caller gave up) and free its blocks."""
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
        p = self.plan()
        self._apply(p)
        self.step_count += 1
        if not p.chunks:
            return []
        cfg = self.model.config
        chunks, sampling_seqs = [], []
        for seq, n in p.chunks:
            end = seq.num_computed_tokens + n
            chunks.append(SeqChunk(seq.token_ids[seq.num_computed_tokens:end], seq.num_computed_tokens,
                                   seq.block_table, end == seq.num_tokens))
            if end == seq.num_tokens:
                sampling_seqs.append(seq)
        batch = build_batch(chunks, self.config.block_size, self.device)
        logits = forward(self.model.params, self.kv, batch, cfg)
        for seq, n in p.chunks:
            seq.num_computed_tokens += n
        st = SamplingTensors.build([s.params for s in sampling_seqs], [s.num_output_tokens for s in sampling_seqs],
                                   cfg.vocab_size, self.device)
        tokens = sample(logits, st).tolist()
        outputs = []
        for seq, token in zip(sampling_seqs, tokens):
            seq.token_ids.append(token)
            self.generated_tokens += 1
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
            outputs.append(TokenOutput(seq, token, reason is not None))
        return outputs

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
