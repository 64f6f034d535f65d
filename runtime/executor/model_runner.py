"""ModelRunner: everything on the device — the KV pools, the input batch, the kernels, the graphs,
and the launch of a step (forward and sampling) whose results come back later.

EngineCore (runtime/engine/engine_core.py) decides what runs; the runner makes it run. It keeps each
running sequence's state in the input batch (runtime/executor/input_batch.py) so a step sends only
what changed, builds the step's index tensors from it with numpy, launches the forward (a
CUDA graph for decode steps where it can) and the sampler, and starts copying the results to
the host without waiting: `InFlightStep.transfer.wait()` is the only place a step blocks.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import numpy as np
import torch

from nanoinfer.batch import Batch, layout
from nanoinfer.graphs import GraphSizes, StepGraphs
from nanoinfer.host_copy import to_device_packed
from nanoinfer.kernels import kernels_for, prepare
from nanoinfer.kv_cache import allocate_kv_pool, copy_blocks, kv_bytes_per_block, kv_dtype, swap_blocks
from nanoinfer.loaders import LoadedModel
from nanoinfer.families import forward_of
from nanoinfer.sampling import compute_logprobs, greedy_and_finite, sample
from nanoinfer.speculative import draft_history, verify
from nanoinfer.structured import Grammars, allocate_bitmask, apply_bitmask
from runtime.executor.draft_runner import DraftRunner, draft_bytes_per_block
from runtime.executor.inflight import DeviceToHost, InFlightStep, PromptLogprobRows, SampledRow, VerifiedRows
from runtime.executor.input_batch import InputBatch
from runtime.executor.kv_budget import kv_blocks_for_memory
from runtime.engine.sequence import Sequence


class Chunk(NamedTuple):
    """`num_tokens` tokens of `seq` from position `start`, computed by one step: its pending
    tokens, then `num_drafts` draft tokens to verify (speculative decoding; the step's
    `draft_tokens`, on the device)."""

    seq: Sequence
    start: int
    num_tokens: int
    num_drafts: int = 0


class StepInput(NamedTuple):
    """What a step computes, in batch order (EngineCore decides it; the runner runs it)."""

    chunks: tuple[Chunk, ...]
    logits_rows: tuple[int, ...]  # token rows whose logits are computed
    samplers: tuple[tuple[Sequence, int], ...]  # (sequence, its index into those logits rows)
    prompt_rows: tuple[tuple[Sequence, int, int, list[int], bool], ...]  # (seq, first logits index, start,
    # the prompt tokens those rows predict, whether the prompt's logprobs are complete after them)
    verifiers: tuple[tuple[Sequence, int, int], ...] = ()  # (seq, first logits index, its number of
    # drafts j): j + 1 logits rows verified (nanoinfer/speculative.py) rather than sampled
    draft_tokens: torch.Tensor | None = None  # [drafts] int64 on the device: the verifiers' drafts, in order
    draft_probs: torch.Tensor | None = None  # [drafts, vocab]: what each draft was drawn from (a draft model's)


class ForwardOutput(NamedTuple):
    """A step's forward, per logits row: the logits (the model's dtype) and what a greedy step
    needs of them, computed in the same CUDA graph."""

    logits: torch.Tensor  # [rows, vocab]
    greedy: torch.Tensor  # [rows] int64: the most likely token
    finite: torch.Tensor  # [rows] bool: every logit finite


def _offsets(counts) -> list[int]:
    """Where each of consecutive runs of `counts` items starts."""
    offsets, at = [], 0
    for n in counts:
        offsets.append(at)
        at += n
    return offsets


def uses_ranks(config) -> bool:
    """Whether the model runs over torch.distributed ranks (tensor parallelism). Tests force
    it at one rank, so that a one-GPU machine runs that path (tests/conftest.py)."""
    return config.tensor_parallel_size > 1


def lookahead(config) -> int:
    """Draft tokens a step may verify per sequence (0 without speculative decoding)."""
    spec = config.speculative_config
    return 0 if spec is None else spec.num_speculative_tokens


class ModelRunner:
    def __init__(self, model: LoadedModel, config, max_model_len: int, draft: LoadedModel | None = None):
        """`config` is an EngineConfig; `draft` the draft model of speculative decoding, if any
        (its KV pool takes its share of the memory: runtime/executor/draft_runner.py)."""
        self.tp = None
        self.grammars = Grammars(model.tokenizer, model.config.vocab_size)  # structured output's masks
        self.constrained: set[int] = set()  # ids of the sequences with rows that a grammar constrains
        if uses_ranks(config):  # (the other ranks start now: runtime/executor/tensor_parallel.py)
            from runtime.executor.tensor_parallel import TensorParallelRanks

            self.tp = TensorParallelRanks(model.config, model.params, config.tensor_parallel_size)
        try:
            self._init(model, config, max_model_len, draft)
        except BaseException:
            self.close()
            raise

    def _init(self, model: LoadedModel, config, max_model_len: int, draft: LoadedModel | None) -> None:
        if self.tp is not None:  # rank 0's heads and units, with the collectives that join the ranks
            local_cfg, local_params = self.tp.local(model.params)
            model = dataclasses.replace(model, config=local_cfg, params=local_params)
        cfg, dtype = model.config, kv_dtype(model.params.dtype, config.kv_cache_dtype)
        self.model, self.config, self.cfg = model, config, cfg
        self.device = model.params.device
        self.block_size = config.block_size
        kernels = kernels_for(cfg, self.device, config.block_size, eager=config.enforce_eager, params=model.params,
                              kv_dtype=dtype)
        if self.tp is not None:
            kernels = kernels._replace(layer_fns=self.tp.layer_functions(kernels.layer_fns))
        self.kernels, self.attention = kernels, kernels.attention
        prepare(kernels, model.params, cfg.vocab_size)
        per_block = kv_bytes_per_block(cfg, config.block_size, dtype)
        if draft is not None:
            per_block += draft_bytes_per_block(draft, config)
        self.num_blocks = config.num_blocks or kv_blocks_for_memory(model, config, max_model_len, per_block,
                                                                    lambda: self.attention)
        self.num_cpu_blocks = config.swap_space // per_block
        max_blocks = -(-max_model_len // config.block_size)
        graph_sizes = None if not kernels.graphs else GraphSizes(
            max_batch=min(config.scheduler.max_num_seqs, 512), max_blocks=max_blocks,
            max_tokens=config.scheduler.max_num_batched_tokens,
            # Steps whose contexts fit one split-K partition get graphs whose attention runs
            # in one pass (no reduce kernel).
            widths=(self.attention.partition_size // config.block_size,), rows_per_seq=1 + lookahead(config))
        if self.tp is not None:  # (the ranks capture their graphs now, in step with ours below)
            from runtime.executor.tensor_parallel import RankSetup

            self.tp.setup(RankSetup(self.num_blocks, self.num_cpu_blocks, config.block_size, dtype,
                                    config.enforce_eager, graph_sizes))
        self.kv = allocate_kv_pool(cfg, self.num_blocks, config.block_size, dtype, self.device)
        # Host blocks for swapped sequences; pinned on CUDA so the copies can run async.
        self.cpu_kv = allocate_kv_pool(cfg, self.num_cpu_blocks, config.block_size, dtype, "cpu")
        if self.device.type == "cuda" and self.num_cpu_blocks:
            self.cpu_kv = self.cpu_kv.pin_memory()
        # (n - 1 forks may take rows in the step their parent's prefill ends, before it is planned)
        self.batch = InputBatch(config.scheduler.max_num_seqs + 8, max_blocks, cfg.vocab_size, cfg.eos_token_ids,
                                self.device)
        self.draft = None if draft is None else DraftRunner(draft, config, self.num_blocks, self.num_cpu_blocks,
                                                            self.batch)
        self.graphs = None
        if graph_sizes is not None:
            self.graphs = StepGraphs(self._eager_forward, self.device, **graph_sizes._asdict())
            self.graphs.capture()

    # -- the KV pools ----------------------------------------------------------------------

    def copy_blocks(self, copies) -> None:
        copy_blocks(self.kv, copies)
        for other in (self.draft, self.tp):
            if other is not None:
                other.copy_blocks(copies)

    def swap_out(self, copies) -> None:
        swap_blocks(self.kv, self.cpu_kv, copies)
        for other in (self.draft, self.tp):
            if other is not None:
                other.swap_out(copies)

    def swap_in(self, copies) -> None:
        swap_blocks(self.cpu_kv, self.kv, copies)
        for other in (self.draft, self.tp):
            if other is not None:
                other.swap_in(copies)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (idempotent)."""
        if self.tp is not None:
            self.tp.close()

    # -- rows --------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """`seq` starts running: give it a row."""
        self.batch.add(seq)
        if seq.constraint is not None:
            self.constrained.add(seq.seq_id)

    def remove(self, seq: Sequence) -> None:
        """`seq` stopped running (finished, preempted): free its row."""
        self.batch.remove(seq)
        self.constrained.discard(seq.seq_id)

    def table_changed(self, seq: Sequence) -> None:
        """`seq`'s block table grew, or a block in its write range was replaced (copy-on-write)."""
        if seq in self.batch:
            self.batch.sync_table(seq, seq.num_computed_tokens // self.block_size)

    # -- a step --------------------------------------------------------------------------------

    def _build(self, inp: StepInput) -> tuple[Batch, np.ndarray, torch.Tensor]:
        """The step's Batch; also the samplers' rows, on the host and the device."""
        rows_of, bs = self.batch.row_of, self.block_size
        self.batch.flush()
        # One pass over the chunks (it runs for every sequence, every step), then numpy.
        meta: list[int] = []  # row, start, tokens, tokens known on the host: per chunk
        host_tokens: list[int] = []
        draft_at: list[int] = []  # batch rows of draft tokens (taken from the device)
        offset = 0
        for seq, start, n, drafts in inp.chunks:
            ids = seq.token_ids
            known = min(start + n - drafts, len(ids)) - start
            if known == 1:
                host_tokens.append(ids[start])
            elif known > 1:
                host_tokens += ids[start:start + known]
            if drafts:
                host_tokens += [0] * drafts  # (placeholders: overwritten from the device below)
                draft_at += range(offset + known, offset + known + drafts)
                known += drafts
            meta += (rows_of[seq.seq_id], start, n, known)
            offset += n
        rows, starts, lens, known = np.array(meta, dtype=np.int64).reshape(-1, 4).T
        at = layout(starts, lens, self.batch.table_np, rows, bs)
        # Tokens known on the host come from it; a chunk that ends at a token still on its way
        # (sampled by the step in flight) takes it from the device, where it already is.
        from_host = at.positions < (starts + known)[at.seq_of_token]
        input_ids = np.zeros(at.positions.shape[0], dtype=np.int64)
        input_ids[from_host] = host_tokens
        fill_at = np.flatnonzero(~from_host)
        fill_rows = rows[at.seq_of_token[fill_at]]
        sampler_meta = [v for seq, _ in inp.samplers
                        for v in (rows_of[seq.seq_id], len(seq.token_ids) - seq.num_prompt_tokens + seq.num_unresolved)]
        sampler_rows, steps = np.array(sampler_meta, dtype=np.int64).reshape(-1, 2).T
        (input_ids_t, positions_t, slots_t, logits_t, rows_t, fill_at_t, fill_rows_t, sampler_rows_t,
         steps_t, draft_at_t) = to_device_packed([input_ids, at.positions, at.slot_mapping, inp.logits_rows, rows,
                                                  fill_at, fill_rows, sampler_rows, steps, draft_at], torch.int64,
                                                 self.device)
        seq_lens, qsl_t = to_device_packed([at.seq_lens, at.query_start_loc], torch.int32, self.device)
        if len(fill_at):
            input_ids_t.index_copy_(0, fill_at_t, self.batch.last_token.index_select(0, fill_rows_t))
        if draft_at:
            input_ids_t.index_copy_(0, draft_at_t, inp.draft_tokens)
        block_tables = self.batch.table_device.index_select(0, rows_t)[:, :at.num_blocks]
        batch = Batch(input_ids_t, positions_t, slots_t, block_tables, seq_lens, qsl_t, logits_t)
        return batch, sampler_rows, (sampler_rows_t, steps_t)

    def _eager_forward(self, batch: Batch) -> ForwardOutput:
        k = self.kernels
        logits = forward_of(self.cfg)(self.model.params, self.kv, batch, self.cfg, k.attention, k.layer_fns, logits_dtype=None)
        return ForwardOutput(logits, *greedy_and_finite(logits))

    def _forward(self, batch: Batch) -> ForwardOutput:
        """The step's forward: a CUDA graph's replay where one fits the batch. (The other
        tensor-parallel ranks receive the batch first and decide alike.)"""
        if self.tp is not None:
            self.tp.forward(batch)
        if self.graphs is not None and self.graphs.can_run(batch):
            return ForwardOutput(*self.graphs.run(batch))
        return self._eager_forward(batch)

    def launch(self, inp: StepInput, forward_done: Callable[[], None] = lambda: None) -> InFlightStep:
        """Queue the step's forward and sampling and start copying the results to the host;
        returns without waiting for the device. Changes no sequence. (`forward_done` is called
        between the two, for the step's phase timings.)"""
        batch, sampler_rows, (sampler_rows_t, steps_t) = self._build(inp)
        host_drafts = self._host_drafts(inp)
        out = self._forward(batch)
        forward_done()
        # Grammar masks are filled on the host while the device runs the forward.
        masks = None if not self.constrained else self._grammar_masks(  # (no pass over rows when none is)
            [(seq, i, ()) for i, (seq, _) in enumerate(inp.samplers)])
        verify_masks = None
        if host_drafts is not None:  # (a verifier's j + 1 rows follow the ones before it; so do its drafts)
            drafts, counts = host_drafts.wait()[0].tolist(), [j for _, _, j in inp.verifiers]
            verify_masks = self._grammar_masks([(seq, row, drafts[at:at + j]) for (seq, _, j), row, at in zip(
                inp.verifiers, _offsets(j + 1 for j in counts), _offsets(counts))])
        full, all_logits = out, out.logits
        sample_at = [i for _, i in inp.samplers]
        if sample_at != list(range(out.logits.shape[0])):  # (a pure decode step needs no gather)
            (index,) = to_device_packed([sample_at], torch.int64, self.device)
            out = ForwardOutput(*(t.index_select(0, index) for t in out))
        st = self.batch.sampling(sampler_rows, sampler_rows_t, steps_t)
        logits = out.logits
        if st.all_greedy and st.penalties is None and masks is None:
            tokens = out.greedy  # (the graph's own argmax: no float copy of the logits, no launch)
        else:
            logits = logits.float()
            tokens = sample(logits if masks is None else apply_bitmask(logits, *masks), st, self.kernels.draw,
                            greedy=out.greedy if masks is None else None)
        self.batch.sampled(sampler_rows_t, tokens)
        # A row whose logits are not finite (NaN, inf) samples garbage: it fails its request alone.
        results = [tokens, out.finite]
        wanted = [s.params.logprobs for s, _ in inp.samplers]
        if any(k is not None for k in wanted):
            results.extend(compute_logprobs(logits, tokens, max(k or 0 for k in wanted)))
        prompt_lp = []
        for seq, first, start, targets, final in inp.prompt_rows:
            prompt_lp.append(PromptLogprobRows(seq, start, targets, final))
            (target_t,) = to_device_packed([targets], torch.int64, self.device)
            results.extend(compute_logprobs(all_logits[first:first + len(targets)], target_t,
                                            seq.params.prompt_logprobs))
        rows = tuple(SampledRow(seq, k) for (seq, _), k in zip(inp.samplers, wanted))
        verified = ()
        if inp.verifiers:
            verified, tensors = self._verify(inp.verifiers, full, inp.draft_tokens, inp.draft_probs, verify_masks)
            results.extend(tensors)
        transfer = DeviceToHost(results)
        if inp.verifiers and self.draft is not None:
            # The next step's catch-up, queued behind this verification and behind the copy of
            # its results: the host learns them while the device runs it.
            starts = {c.seq.seq_id: c.start for c in inp.chunks if c.num_drafts}
            self.draft.prelaunch([(seq, starts[seq.seq_id], j) for seq, _, j in inp.verifiers], inp.draft_tokens,
                                 tensors[1])
        return InFlightStep(rows, tuple(prompt_lp), transfer, verified,
                            constrained=masks is not None or verify_masks is not None)

    def _host_drafts(self, inp: StepInput) -> DeviceToHost | None:
        """The drafts on their way to the host when a constrained sequence verifies some (its
        masks follow them): started before the forward is queued, so waiting for them does not
        wait for it."""
        if not self.constrained or not any(seq.constraint is not None for seq, _, _ in inp.verifiers):
            return None
        return DeviceToHost([inp.draft_tokens])

    def _grammar_masks(self, rows: list[tuple[Sequence, int, list[int]]]
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The bitmask rows of the constrained sequences among `rows` (sequence, first logits
        row, drafts it verifies) and the logits rows they mask, on the device; None if no
        sequence is constrained. (A finished sequence's rows are dropped when the step
        resolves: its grammar is not asked.)"""
        constrained = [(seq, first, drafts) for seq, first, drafts in rows
                       if seq.constraint is not None and not seq.is_finished]
        if not constrained:
            return None
        at = [first + i for _, first, drafts in constrained for i in range(len(drafts) + 1)]
        bitmask = allocate_bitmask(len(at), self.cfg.vocab_size)
        self.grammars.fill([(seq.constraint, row, drafts) for (seq, _, drafts), row in
                            zip(constrained, _offsets(len(drafts) + 1 for _, _, drafts in constrained))], bitmask)
        (at_t,) = to_device_packed([at], torch.int64, self.device)
        return bitmask.to(self.device, non_blocking=True), at_t

    def _verify(self, verifiers, out: ForwardOutput, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                masks: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[tuple[VerifiedRows, ...], list[torch.Tensor]]:
        """Verify each sequence's drafts against its rows of target logits (see
        nanoinfer/speculative.py); the tensors to bring to the host, per row: accepted, token,
        finite (and logprobs when asked for)."""
        rows_of = self.batch.row_of
        index, rows, steps, draft_rows, q_rows, num_drafts = [], [], [], [], [], []
        for seq, first, j in verifiers:
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
            [index, rows, steps, draft_rows, q_rows, history_rows, history_drafts], torch.int64, self.device)
        # Per row, its draft; -1 on each sequence's last row (no draft there).
        drafts_t = torch.full((len(index),), -1, dtype=torch.int64, device=self.device)
        drafts_t.index_copy_(0, draft_rows_t, draft_tokens)
        logits = out.logits.index_select(0, index_t).float()
        st = self.batch.sampling(np.asarray(rows, dtype=np.int64), rows_t, steps_t)
        if st.penalties is not None and len(history_rows):
            # Row i follows drafts 1..i: they count as generated (the gathered rows are copies).
            pen, history_tokens_t = st.penalties, draft_tokens.index_select(0, history_drafts_t)
            pen.output_counts.index_put_((history_rows_t, history_tokens_t),
                                         torch.ones_like(history_tokens_t, dtype=torch.float32), accumulate=True)
            pen.seen[history_rows_t, history_tokens_t] = True
        if draft_probs is not None:  # (a sequence's last row has no draft: its q row is never read)
            draft_probs = draft_probs.index_select(0, q_rows_t)
        v = verify(logits if masks is None else apply_bitmask(logits, *masks), st, drafts_t, draft_probs,
                   draw=self.kernels.draw)
        tensors = [v.accepted, v.tokens, out.finite.index_select(0, index_t)]
        wanted = [seq.params.logprobs for seq, _, _ in verifiers]
        if any(k is not None for k in wanted):
            tensors.extend(compute_logprobs(logits, v.tokens, max(k or 0 for k in wanted)))
        return tuple(VerifiedRows(seq, j, k) for (seq, _, j), k in zip(verifiers, wanted)), tensors

    def emitted(self, seq: Sequence, token_ids: list[int]) -> None:
        """Tokens a verification emitted for `seq`: its penalty counts learn them (a sampled
        step's tokens are counted on the device as they are drawn)."""
        self.batch.emitted(seq, token_ids)

