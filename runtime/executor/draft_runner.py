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

A step whose sequences accepted all their drafts starts with a two-token catch-up (the last
draft, then the target's bonus token) that the host can only build once it has planned the
step. While the draft keeps being accepted in full, that pass is queued at the end of the
step before, right behind the verification, from the verified tokens on the device
(`prelaunch`): the device then goes from one step to the next without waiting for the host.
If the sequences did not accept everything after all, the pass is dropped (its KV lies past
what the draft's cache is known to hold) and the catch-up runs as usual.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple
from typing import Sequence as Seq

import numpy as np
import torch

from nanoinfer.model.batch import Batch, SeqChunk, host_batch
from nanoinfer.errors import RequestError
from nanoinfer.backends.host_copy import to_device_packed
from nanoinfer.model.kv_cache import kv_bytes_per_block, kv_dtype
from nanoinfer.loaders import LoadedModel
from nanoinfer.sampling.sampler import SamplingColumns, greedy_tokens
from nanoinfer.sampling.rejection import draft_sample
from runtime.executor.input_batch import InputBatch
from runtime.executor.device_model import DeviceModel
from runtime.executor.step import Sequence


class Proposal(NamedTuple):
    """A step's drafts, on the device, in the order of its verifying sequences (each its own),
    and how far each sequence's draft cache holds once the step runs (the engine's commit
    records it: `Sequence.num_draft_computed`)."""

    tokens: torch.Tensor | None  # [drafts] int64 (None: nothing to verify)
    probs: torch.Tensor | None  # [drafts, vocab]: q of each draft (None: every row greedy)
    computed: tuple[tuple[Sequence, int], ...] = ()


class Prelaunched(NamedTuple):
    """A catch-up pass queued before the step it serves was planned, and its draws."""

    chunks: tuple[tuple[int, int], ...]  # (seq id, first position) of each sequence's two-token catch-up
    tokens: torch.Tensor  # [seqs] each one's first draft
    probs: torch.Tensor | None  # [seqs, vocab] what it was drawn from (None: all greedy)


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


class DraftRunner(DeviceModel):
    def __init__(self, draft: LoadedModel, config, num_blocks: int, num_cpu_blocks: int, batch: InputBatch):
        """`config` is the EngineConfig; `batch` the target's input batch (the rows' sampling
        parameters)."""
        super().__init__(draft, config)
        self.batch = batch
        self._allocate(num_blocks, num_cpu_blocks)
        if self.kernels.graphs:  # (its passes are decode steps, and a catch-up step of 1-2 tokens each)
            from nanoinfer.backends.cuda.graphs import StepGraphs

            self._capture(max_batch=StepGraphs.batch_cap(config.scheduler.max_num_seqs), max_blocks=batch.max_blocks,
                          max_tokens=config.scheduler.max_num_batched_tokens,
                          widths=self.kernels.attention.graph_widths(config.block_size), rows_per_seq=2,
                          lazy=config.cuda_graph_capture == "lazy")
        # Prelaunching pays where the device would wait for the host (not on the CPU), and
        # while a step that accepted everything is mostly followed by another (`_outcomes`:
        # whether it was, of late; a dropped pass costs more than a used one saves).
        self.prelaunches = self.device.type == "cuda"
        self.prelaunch_when = 0.75  # the share of such steps of late followed by another
        self._prelaunched: Prelaunched | None = None
        self._all_accepted = False  # the last step's verifying sequences all accepted every draft
        self._outcomes: deque[bool] = deque(maxlen=8)
        self.num_prelaunched = self.num_prelaunches_used = 0  # (stats, tests)

    # -- proposing ---------------------------------------------------------------------------

    def _eager_forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits of the batch's logits rows, and their argmax (a greedy draft's proposal,
        inside the graph: its pass needs no other launch)."""
        logits = self._forward_logits(batch)
        return logits, greedy_tokens(logits)

    def _logits(self, chunks: list[SeqChunk], input_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and argmax of the chunks' rows that ask for them; `input_ids` on the device
        replace the chunks' own tokens (a pass's input is the pass before's draw: no trip to
        the host)."""
        batch = host_batch(chunks, self.block_size)
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch, input_ids)  # (the batch moves in one copy)
        batch = batch.to(self.device)
        return self._eager_forward(batch if input_ids is None else batch._replace(input_ids=input_ids))

    def _sample(self, seqs: Seq[Sequence], offsets: Seq[int], logits: torch.Tensor, greedy: torch.Tensor):
        """Each sequence's draft token at its output index + offset, and q (None: all greedy)."""
        rows = np.array([self.batch.row_of[s.seq_id] for s in seqs], dtype=np.int64)
        if self.batch.columns.flags[SamplingColumns.GREEDY, rows].all():  # (the argmax is all there is to it;
            return greedy.clone(), None  # copied out of the graph's output, which its next replay overwrites)
        steps = [len(s.token_ids) - s.num_prompt_tokens + o for s, o in zip(seqs, offsets)]
        rows_t, steps_t = to_device_packed([rows, steps], torch.int64, self.device)
        return draft_sample(logits, self.batch.sampling(rows, rows_t, steps_t), self.kernels.draw)

    def propose(self, step: Seq[tuple[Sequence, int, int]]) -> Proposal:
        """Catch the draft's cache up with the step's `(seq, start, num_tokens)` chunks, and
        propose `num_tokens - 1` drafts for each chunk that is one pending token and drafts."""
        catch_up, verifying = [], []
        computed: dict[Sequence, int] = {}  # (the sequences' draft positions as the passes go)
        for seq, start, n in step:
            j = n - seq.num_pending_tokens
            if j <= 0 and n == 1:
                continue  # a decode without drafts: caught up with when the sequence next drafts
            end = start + (1 if j > 0 else n)
            first = min(seq.num_draft_computed, start)
            catch_up.append(SeqChunk(seq.token_ids[first:end], first, seq.block_table, j > 0))
            computed[seq] = end
            if j > 0:
                verifying.append((seq, j))
        prelaunched, self._prelaunched = self._prelaunched, None
        if not verifying:
            if catch_up:
                self._logits(catch_up)  # (prefill chunks: the draft's prefill, bounded as the target's)
            return Proposal(None, None, tuple(computed.items()))
        # Every sequence accepted all its drafts (its catch-up: the last draft and the bonus token).
        all_accepted = len(catch_up) == len(verifying) and all(len(c.token_ids) == 2 for c in catch_up)
        if self._all_accepted:
            self._outcomes.append(all_accepted)
        self._all_accepted = all_accepted
        row_of: dict[tuple[int, int], int] = {}  # (seq id, draft index) -> its row in the passes' draws
        drawn, probs, active = [], [], verifying  # (`drawn`: each pass's tokens, on the device)
        for i in range(max(j for _, j in verifying)):
            seqs = [s for s, _ in active]
            if i == 0 and all_accepted and prelaunched is not None and prelaunched.chunks == tuple(
                    (s.seq_id, c.start_pos) for s, c in zip(seqs, catch_up)):
                tokens, q = prelaunched.tokens, prelaunched.probs  # (this pass ran behind the last verification)
                self.num_prelaunches_used += 1
            else:
                if i == 0:  # (its logits rows: the verifying sequences', in order)
                    logits, greedy = self._logits(catch_up)
                else:  # one more draft for each sequence still drafting, from the one before (on the device)
                    still = [r for r, (_, j) in enumerate(active) if j > i]
                    active = [active[r] for r in still]
                    seqs = [s for s, _ in active]
                    previous = drawn[-1] if len(still) == len(drawn[-1]) else drawn[-1].index_select(
                        0, to_device_packed([still], torch.int64, self.device)[0])
                    logits, greedy = self._logits(
                        [SeqChunk([0], computed[s], s.block_table, True) for s in seqs], previous)
                    for s in seqs:
                        computed[s] += 1
                tokens, q = self._sample(seqs, [i] * len(seqs), logits, greedy)
            for r, s in enumerate(seqs):
                row_of[s.seq_id, i] = sum(len(t) for t in drawn) + r
            drawn.append(tokens)
            probs.append(q if q is not None else torch.zeros(len(seqs), 0, device=self.device))
        (index,) = to_device_packed([[row_of[s.seq_id, i] for s, j in verifying for i in range(j)]], torch.int64,
                                    self.device)
        tokens = torch.cat(drawn).index_select(0, index)  # (no wait: the target's input takes them as they are)
        if all(p.shape[1] == 0 for p in probs):
            return Proposal(tokens, None, tuple(computed.items()))
        # (a pass of greedy rows only has no q: zeros, which verification never reads for them)
        vocab = max(p.shape[1] for p in probs)
        probs = [p if p.shape[1] else p.new_zeros(p.shape[0], vocab) for p in probs]
        return Proposal(tokens, torch.cat(probs).index_select(0, index), tuple(computed.items()))

    def prelaunch(self, verifiers: Seq[tuple[Sequence, int, int]], draft_tokens: torch.Tensor,
                  verified_tokens: torch.Tensor) -> None:
        """Queue the next step's catch-up as if every verifying sequence, `(seq, start, j)`
        (its pending token at `start`, then j drafts), accepts all its drafts: the last draft
        and the bonus token, taken from the device (`draft_tokens`: j per sequence, in order;
        `verified_tokens`: j + 1). Only while that keeps coming true (see the module's text),
        and where the bonus token's slot is allocated already."""
        paying = sum(self._outcomes) >= self.prelaunch_when * len(self._outcomes)
        if not (self.prelaunches and self._all_accepted and paying):
            return
        chunks, at, drafts, rows = [], [], 0, len(draft_tokens)  # (`at`: into drafts, then verified tokens)
        for seq, start, j in verifiers:
            first = start + j  # the last draft's position; the bonus token's follows
            if (first + 1) // self.block_size >= len(seq.block_table):
                return
            chunks.append(SeqChunk([0, 0], first, seq.block_table, True))
            at += (drafts + j - 1, rows + j)  # its last draft, and its last verified row's token
            drafts, rows = drafts + j, rows + j + 1
        (index,) = to_device_packed([at], torch.int64, self.device)
        logits, greedy = self._logits(chunks, torch.cat([draft_tokens, verified_tokens]).index_select(0, index))
        seqs = [seq for seq, _, _ in verifiers]
        # (drawn at the index of the next step's first draft: its j + 1 tokens are not on the host yet)
        tokens, q = self._sample(seqs, [j + 1 for _, _, j in verifiers], logits, greedy)
        self._prelaunched = Prelaunched(tuple((seq.seq_id, c.start_pos) for seq, c in zip(seqs, chunks)), tokens, q)
        self.num_prelaunched += 1
