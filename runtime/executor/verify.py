"""Verification: a step's drafts checked against the target's logits (speculative decoding, on the device).

Each verifying sequence computes its pending token and its j drafts in j + 1 rows; its rows'
target distributions accept a leading run of the drafts and draw one token of their own after
them (nanoinfer/sampling/rejection.py). The runner (runtime/executor/model_runner.py) makes one of
these per step that verifies: its results join the step's as `StepTensors.verified`.
"""

from __future__ import annotations

import numpy as np
import torch

from nanoinfer.backends.host_copy import to_device_packed
from nanoinfer.sampling.sampler import compute_logprobs
from nanoinfer.sampling.rejection import draft_history, verify
from runtime.executor.step import DeviceToHost, StepInput, VerifiedTensors


class Verification:
    def __init__(self, runner, inp: StepInput, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None):
        """Made before the step's forward is queued: a constrained sequence's masks follow its
        drafts, which start their way to the host now, so waiting for them does not wait for
        the forward."""
        self.runner, self.inp = runner, inp
        self.draft_tokens, self.draft_probs = draft_tokens, draft_probs
        self.masks = None
        self._host_drafts = None
        if runner.constrained and any(v.seq.constraint is not None for v in inp.verifiers):
            self._host_drafts = DeviceToHost([draft_tokens])

    def _grammar_masks(self):
        if self._host_drafts is None:
            return None
        from runtime.executor.grammar_masks import grammar_masks, offsets

        drafts, counts = self._host_drafts.wait()[0].tolist(), [v.num_drafts for v in self.inp.verifiers]
        # (a verifier's j + 1 rows follow the ones before it; so do its drafts)
        return grammar_masks(self.runner, [(v.seq, row, drafts[at:at + v.num_drafts]) for v, row, at in zip(
            self.inp.verifiers, offsets(j + 1 for j in counts), offsets(counts))])

    def run(self, out) -> VerifiedTensors:
        """Verify each sequence's drafts against its rows of target logits (`out`: the step's
        ForwardOutput); per row: accepted, token, finite (and logprobs when asked for)."""
        runner, verifiers, draft_tokens = self.runner, self.inp.verifiers, self.draft_tokens
        self.masks = self._grammar_masks()
        rows_of, device = runner.batch.row_of, runner.device
        index, rows, steps, draft_rows, q_rows, num_drafts = [], [], [], [], [], []
        for seq, first, j, _ in verifiers:
            done, row0 = len(q_rows) - len(num_drafts), len(index)  # drafts and rows so far
            q_rows += (*range(done, done + j), 0)
            draft_rows += range(row0, row0 + j)
            produced = len(seq.token_ids) - seq.num_prompt_tokens + seq.num_unresolved
            index += range(first, first + j + 1)
            rows += [rows_of[seq.seq_id]] * (j + 1)
            steps += range(produced, produced + j + 1)
            num_drafts.append(j)
        history_rows, history_drafts = draft_history(num_drafts)
        index_t, rows_t, steps_t, draft_rows_t, q_rows_t, history_rows_t, history_drafts_t = to_device_packed(
            [index, rows, steps, draft_rows, q_rows, history_rows, history_drafts], torch.int64, device)
        # Per row, its draft; -1 on each sequence's last row (no draft there).
        drafts_t = torch.full((len(index),), -1, dtype=torch.int64, device=device)
        drafts_t.index_copy_(0, draft_rows_t, draft_tokens)
        logits = out.logits.index_select(0, index_t).float()
        st = runner.batch.sampling(np.asarray(rows, dtype=np.int64), rows_t, steps_t)
        if st.penalties is not None and len(history_rows):
            # Row i follows drafts 1..i: they count as generated (the gathered rows are copies).
            pen, history_tokens_t = st.penalties, draft_tokens.index_select(0, history_drafts_t)
            pen.output_counts.index_put_((history_rows_t, history_tokens_t),
                                         torch.ones_like(history_tokens_t, dtype=torch.float32), accumulate=True)
            pen.seen[history_rows_t, history_tokens_t] = True
        draft_probs = self.draft_probs
        if draft_probs is not None:  # (a sequence's last row has no draft: its q row is never read)
            draft_probs = draft_probs.index_select(0, q_rows_t)
        masked = logits
        if self.masks is not None:
            masked = self.masks.applied(logits, runner.device, runner.kernels.mask)
        v = verify(masked, st, drafts_t, draft_probs, draw=runner.kernels.draw)
        wanted = [r.logprobs for r in verifiers]
        logprobs = None
        if any(k is not None for k in wanted):
            logprobs = compute_logprobs(logits, v.tokens, max(k or 0 for k in wanted))
        return VerifiedTensors(v.accepted, v.tokens, out.finite.index_select(0, index_t), logprobs)

    def after_transfer(self, verified: VerifiedTensors) -> None:
        """With a draft model: the next step's catch-up, queued behind this verification and
        behind the copy of its results: the host learns them while the device runs it."""
        draft = self.runner.draft
        if draft is not None:
            starts = {c.seq.seq_id: c.start for c in self.inp.chunks if c.num_drafts}
            draft.prelaunch([(v.seq, starts[v.seq.seq_id], v.num_drafts) for v in self.inp.verifiers],
                            self.draft_tokens, verified.tokens)
