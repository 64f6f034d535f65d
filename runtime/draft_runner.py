"""DraftRunner: speculative decoding's draft model — its weights, its own KV pool, its proposals.

The draft's KV pool has as many blocks as the target's and is indexed by the same block
tables, so the block manager's allocations, copy-on-write copies and swaps serve both; only
the bytes per block differ. Its pool trails the target's: in each step, before the target
runs, the draft computes the step's prefill chunks, and for the sequences that verify drafts
their tokens since their last proposal (decode steps without drafts cost the draft nothing:
speculation may be switched off for a while); then it proposes, one forward per draft
token, each pass's input the pass before's draw, on the device. `Sequence.num_draft_computed`
says how far a sequence's draft cache holds. The draft never decides what is emitted
(verification does): a stale cache could lower the acceptance rate, never change an output.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence as Seq

import numpy as np
import torch

from nanoinfer.batch import Batch, SeqChunk, build_batch
from nanoinfer.errors import RequestError
from nanoinfer.host_copy import to_device_packed
from nanoinfer.kernels import kernels_for, prepare
from nanoinfer.kv_cache import allocate_kv_pool, copy_blocks, kv_bytes_per_block, kv_dtype, swap_blocks
from nanoinfer.loaders import LoadedModel
from nanoinfer.model import forward
from nanoinfer.speculative import draft_sample
from runtime.input_batch import InputBatch
from runtime.sequence import Sequence


class Proposal(NamedTuple):
    """A step's drafts, on the device, in the order of its verifying sequences (each its own)."""

    tokens: torch.Tensor | None  # [drafts] int64 (None: nothing to verify)
    probs: torch.Tensor | None  # [drafts, vocab]: q of each draft (None: every row greedy)


def check_draft(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft must speak the target's vocabulary: RequestError otherwise."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise RequestError(f"the draft model {draft.path} has a vocabulary of {draft.config.vocab_size} tokens but the "
                           f"target {target.path} has {target.config.vocab_size}: expected a draft sharing the "
                           f"target's tokenizer", param="speculative_config")
    if draft.params.device != target.params.device:
        raise RequestError(f"the draft model is on {draft.params.device}, the target on {target.params.device}: "
                           f"expected one device", param="speculative_config")


def draft_bytes_per_block(draft: LoadedModel, config) -> int:
    """Bytes of one block of the draft's KV pool (`config`: the EngineConfig)."""
    return kv_bytes_per_block(draft.config, config.block_size, kv_dtype(draft.params.dtype, config.kv_cache_dtype))


class DraftRunner:
    def __init__(self, draft: LoadedModel, config, num_blocks: int, num_cpu_blocks: int, batch: InputBatch):
        """`config` is the EngineConfig; `batch` the target's input batch (the rows' sampling
        parameters)."""
        cfg, dtype = draft.config, kv_dtype(draft.params.dtype, config.kv_cache_dtype)
        self.draft, self.cfg, self.batch = draft, cfg, batch
        self.device = draft.params.device
        self.block_size = config.block_size
        self.kernels = kernels_for(cfg, self.device, config.block_size, eager=config.enforce_eager,
                                   params=draft.params, kv_dtype=dtype)
        prepare(self.kernels, draft.params, cfg.vocab_size)
        self.kv = allocate_kv_pool(cfg, num_blocks, config.block_size, dtype, self.device)
        self.cpu_kv = allocate_kv_pool(cfg, num_cpu_blocks, config.block_size, dtype, "cpu")
        if self.device.type == "cuda" and num_cpu_blocks:
            self.cpu_kv = self.cpu_kv.pin_memory()
        self.graphs = None
        if self.kernels.graphs:  # (its passes are decode steps, and a catch-up step of 1-2 tokens each)
            from nanoinfer.graphs import StepGraphs

            self.graphs = StepGraphs(self._eager_forward, self.device, max_batch=min(config.scheduler.max_num_seqs, 512),
                                     max_blocks=batch.max_blocks, max_tokens=config.scheduler.max_num_batched_tokens,
                                     widths=(self.kernels.attention.partition_size // config.block_size,),
                                     rows_per_seq=2)
            self.graphs.capture()

    # -- the pool follows the target's -----------------------------------------------------

    def copy_blocks(self, copies) -> None:
        copy_blocks(self.kv, copies)

    def swap_out(self, copies) -> None:
        swap_blocks(self.kv, self.cpu_kv, copies)

    def swap_in(self, copies) -> None:
        swap_blocks(self.cpu_kv, self.kv, copies)

    # -- proposing ---------------------------------------------------------------------------

    def _eager_forward(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        k = self.kernels
        return (forward(self.draft.params, self.kv, batch, self.cfg, k.attention, k.layer_fns, logits_dtype=None),)

    def _logits(self, chunks: list[SeqChunk], input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the chunks' rows that ask for them; `input_ids` on the device replace the
        chunks' own tokens (a pass's input is the pass before's draw: no trip to the host)."""
        batch = build_batch(chunks, self.block_size, self.device)
        if input_ids is not None:
            batch = batch._replace(input_ids=input_ids)
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)[0]
        return self._eager_forward(batch)[0]

    def _sample(self, seqs: Seq[Sequence], offsets: Seq[int], logits: torch.Tensor):
        """Each sequence's draft token at its output index + offset, and q (None: all greedy)."""
        rows = np.array([self.batch.row_of[s.seq_id] for s in seqs], dtype=np.int64)
        steps = [len(s.token_ids) - s.num_prompt_tokens + o for s, o in zip(seqs, offsets)]
        rows_t, steps_t = to_device_packed([rows, steps], torch.int64, self.device)
        return draft_sample(logits, self.batch.sampling(rows, rows_t, steps_t), self.kernels.draw)

    def propose(self, step: Seq[tuple[Sequence, int, int]]) -> Proposal:
        """Catch the draft's cache up with the step's `(seq, start, num_tokens)` chunks, and
        propose `num_tokens - 1` drafts for each chunk that is one pending token and drafts."""
        catch_up, verifying = [], []
        for seq, start, n in step:
            j = n - seq.num_pending_tokens
            if j <= 0 and n == 1:
                continue  # a decode without drafts: caught up with when the sequence next drafts
            end = start + (1 if j > 0 else n)
            first = min(seq.num_draft_computed, start)
            catch_up.append(SeqChunk(seq.token_ids[first:end], first, seq.block_table, j > 0))
            seq.num_draft_computed = end
            if j > 0:
                verifying.append((seq, j))
        if not verifying:
            if catch_up:
                self._logits(catch_up)  # (prefill chunks: the draft's prefill, bounded as the target's)
            return Proposal(None, None)
        row_of: dict[tuple[int, int], int] = {}  # (seq id, draft index) -> its row in the passes' draws
        drawn, probs, active = [], [], verifying  # (`drawn`: each pass's tokens, on the device)
        logits = self._logits(catch_up)  # (its logits rows: the verifying sequences', in order)
        for i in range(max(j for _, j in verifying)):
            if i:  # one more draft for each sequence still drafting, from the one before (on the device)
                still = [r for r, (_, j) in enumerate(active) if j > i]
                active = [active[r] for r in still]
                previous = drawn[-1] if len(still) == len(drawn[-1]) else drawn[-1].index_select(
                    0, to_device_packed([still], torch.int64, self.device)[0])
                logits = self._logits([SeqChunk([0], s.num_draft_computed, s.block_table, True) for s, _ in active],
                                      previous)
                for s, _ in active:
                    s.num_draft_computed += 1
            seqs = [s for s, _ in active]
            tokens, q = self._sample(seqs, [i] * len(seqs), logits)
            for r, s in enumerate(seqs):
                row_of[s.seq_id, i] = sum(len(t) for t in drawn) + r
            drawn.append(tokens)
            probs.append(q if q is not None else logits.new_zeros(len(seqs), 0))
        (index,) = to_device_packed([[row_of[s.seq_id, i] for s, j in verifying for i in range(j)]], torch.int64,
                                    self.device)
        tokens = torch.cat(drawn).index_select(0, index)  # (no wait: the target's input takes them as they are)
        if all(p.shape[1] == 0 for p in probs):
            return Proposal(tokens, None)
        # (a pass of greedy rows only has no q: zeros, which verification never reads for them)
        vocab = max(p.shape[1] for p in probs)
        probs = [p if p.shape[1] else p.new_zeros(p.shape[0], vocab) for p in probs]
        return Proposal(tokens, torch.cat(probs).index_select(0, index))
