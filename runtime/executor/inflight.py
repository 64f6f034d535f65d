"""InFlightStep: a launched step whose sampled tokens are still on their way to the host.

With async scheduling the step loop plans, builds and launches step N+1 while the GPU still
runs step N, and reads step N's tokens only afterwards. Meanwhile:

- each sequence that sampled in step N counts one unresolved token (`Sequence.num_unresolved`);
  if step N+1 computes it, the input comes straight from the device, where the sampler left it
  in the input batch (`InputBatch.last_token`), never through the host;
- step N's results go to the host as non-blocking copies into pinned buffers, with an event
  recorded after them, so `DeviceToHost.wait` blocks for step N alone. (`.tolist()` on a
  CUDA tensor would also wait for step N+1, which is queued behind it: no overlap left.)
"""

from __future__ import annotations

from typing import NamedTuple, Sequence as Seq

import torch

from runtime.engine.sequence import Sequence


class DeviceToHost:
    """Copies of some device tensors on the host, complete once `wait()` returns.
    On the CPU the tensors are the copies; nothing is waited for."""

    def __init__(self, tensors: Seq[torch.Tensor]):
        self.event = None
        if not any(t.is_cuda for t in tensors):
            self.host = list(tensors)
            return
        # Pinned memory: what makes a device-to-host copy asynchronous. PyTorch's caching host
        # allocator keeps these buffers, so a step pays for no cudaHostAlloc after the first.
        self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, t in zip(self.host, tensors):
            host.copy_(t, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def wait(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.host


class SampledRow(NamedTuple):
    """Row i of a step's sampled tokens: which sequence it extends."""

    seq: Sequence
    logprobs: int | None  # top-k logprobs it asked for


class PromptLogprobRows(NamedTuple):
    """A prefill chunk's prompt logprobs: rows for prompt tokens start+1 .. last."""

    seq: Sequence
    start: int
    targets: list[int]
    final: bool  # the chunk reaches the end of the prompt: the list is complete after it


class VerifiedRows(NamedTuple):
    """A sequence whose `num_drafts` drafts a step verified in num_drafts + 1 rows (a row's
    token is its draft where accepted: the host needs no other copy of the drafts)."""

    seq: Sequence
    num_drafts: int
    logprobs: int | None  # top-k logprobs it asked for


class InFlightStep(NamedTuple):
    rows: tuple[SampledRow, ...]
    prompt_logprobs: tuple[PromptLogprobRows, ...]
    # Host copies, in this order: tokens; whether each row's logits were finite; then
    # chosen/top ids/top values when any row asked for logprobs; then chosen/top ids/top
    # values of each PromptLogprobRows; then, when the step verifies drafts, per verification
    # row: accepted, token, finite, and chosen/top ids/top values when any asked for logprobs.
    transfer: DeviceToHost
    verified: tuple[VerifiedRows, ...] = ()
    constrained: bool = False  # some row was masked by its sequence's grammar (runtime/engine/engine_core.py waits
    # for such a step before the next is planned: the grammar must see its tokens first)
