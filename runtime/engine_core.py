"""EngineCore: the synchronous step loop over the paged cache (admit, batch, forward, sample).

It knows tokens, not text: detokenization and stop strings happen on the output side.
Admission here is conservative, with no preemption yet: a request is admitted only when
the blocks its longest possible output could need are still unpromised, so a running
sequence never finds the pool dry. Blocks are still taken one at a time as tokens arrive.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import NamedTuple, Sequence as Seq

import torch

from nanoinfer.batch import SeqChunk, build_batch
from nanoinfer.errors import RequestError
from nanoinfer.kv_cache import allocate_kv_pool, kv_bytes_per_block
from nanoinfer.loaders import LoadedModel
from nanoinfer.model import forward
from nanoinfer.sampling import SamplingParams, SamplingTensors, sample
from runtime.block_manager import BlockManager
from runtime.sequence import Sequence, SequenceStatus

CPU_KV_BUDGET_BYTES = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: from kv_cache_memory (CPU) or free GPU memory
    kv_cache_memory: int | None = None  # bytes for the KV pool when num_blocks is None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096  # tokens per step; longer prompts prefill in chunks
    max_model_len: int | None = None  # None: the model's context length

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise RequestError(f"{name}={value!r} is invalid: expected an integer >= 1")
        for name in ("num_blocks", "kv_cache_memory", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise RequestError(f"{name}={value!r} is invalid: expected an integer >= 1 or None")


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
        num_blocks = config.num_blocks or self._blocks_from_memory()
        self.kv = allocate_kv_pool(cfg, num_blocks, config.block_size, model.params.dtype, self.device)
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._promised_blocks = 0  # blocks the running sequences may still grow into, in all
        self._next_id = 0
        self._seed_source = random.Random()

    def _blocks_from_memory(self) -> int:
        per_block = kv_bytes_per_block(self.model.config, self.config.block_size, self.model.params.dtype)
        budget = self.config.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * 0.8) - (1 << 30)  # leave room for activations
            else:
                budget = CPU_KV_BUDGET_BYTES
        # Never more blocks than all sequences could use at full length.
        cap = self.config.max_num_seqs * -(-self.max_model_len // self.config.block_size)
        return max(1, min(budget // per_block, cap))

    # -- requests -------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: Seq[int], params: SamplingParams) -> Sequence:
        """Validate and queue a request; raises RequestError naming the bad value."""
        vocab = self.model.config.vocab_size
        ids = list(prompt_token_ids)
        if not ids:
            raise RequestError("the prompt is empty: expected at least one token")
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise RequestError(f"prompt token id {bad[0]!r} is out of range: expected 0 <= id < {vocab}")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens: expected fewer than max_model_len={self.max_model_len}")
        max_total = min(len(ids) + (params.max_tokens or self.max_model_len), self.max_model_len)
        if self.blocks.blocks_for(max_total) > self.blocks.num_blocks:
            raise RequestError(
                f"the request needs up to {max_total} tokens of KV cache but the pool holds "
                f"{self.blocks.num_blocks * self.blocks.block_size}: lower max_tokens or raise num_blocks")
        if params.seed is None:
            # Unseeded requests draw a seed here, so the sampler itself is always deterministic.
            params = params.with_seed(self._seed_source.getrandbits(48))
        seq = Sequence(self._next_id, ids, params, max_total)
        self._next_id += 1
        self.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        """Finish `seq` now (a stop string matched, or the caller gave up) and free its blocks."""
        if seq.is_finished:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, reason)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step -------------------------------------------------------------------------

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            need = self.blocks.blocks_for(seq.max_total_tokens)
            if self._promised_blocks + need > self.blocks.num_blocks:
                break  # FCFS: later requests wait behind the head of the queue
            self.waiting.pop(0)
            self._promised_blocks += need
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)

    def _schedule(self) -> list[SeqChunk]:
        """Every running sequence gets its pending tokens, in order, up to the step budget:
        decodes (one token) and prefill chunks alike."""
        budget = self.config.max_num_batched_tokens
        chunks, self._scheduled = [], []
        for seq in self.running:
            pending = seq.num_tokens - seq.num_computed_tokens
            take = min(pending, budget)
            if take == 0:
                continue
            end = seq.num_computed_tokens + take
            self.blocks.append_slots(seq, end)
            chunks.append(SeqChunk(seq.token_ids[seq.num_computed_tokens:end], seq.num_computed_tokens,
                                   seq.block_table, end == seq.num_tokens))
            self._scheduled.append((seq, end))
            budget -= take
            if budget == 0:
                break
        return chunks

    def step(self) -> list[TokenOutput]:
        """Run one forward over every scheduled sequence; return the sampled tokens."""
        self._admit()
        chunks = self._schedule()
        if not chunks:
            return []
        cfg = self.model.config
        batch = build_batch(chunks, self.config.block_size, self.device)
        logits = forward(self.model.params, self.kv, batch, cfg)
        sampling_seqs = []
        for seq, end in self._scheduled:
            seq.num_computed_tokens = end
            if end == seq.num_tokens:
                sampling_seqs.append(seq)
        st = SamplingTensors.build([s.params for s in sampling_seqs], [s.num_output_tokens for s in sampling_seqs],
                                   cfg.vocab_size, self.device)
        tokens = sample(logits, st).tolist()
        outputs = []
        for seq, token in zip(sampling_seqs, tokens):
            seq.token_ids.append(token)
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
        if seq in self.running:
            self.running.remove(seq)
            self._promised_blocks -= self.blocks.blocks_for(seq.max_total_tokens)
        self.blocks.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
