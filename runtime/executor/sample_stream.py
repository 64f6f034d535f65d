"""SampleStream: rank 0's second CUDA stream under pipeline parallelism, where a step's logits are received and sampled.

With two steps of disjoint sequences in flight (runtime/engine/virtual_engines.py), rank 0
must compute stage 0 of step N+1 while the last stage computes step N. On one stream the
receive of step N's logits, its sampling and the copy of its tokens to the host would sit
between them, and stage 0 of N+1 would wait for the last stage of N. So a launch queues its
own inputs and stage 0 on the main stream, then switches to this side stream (which first
waits for the main stream's work so far) for everything after: the waits for the sends and
the batch's broadcast, the receive of the logits, sampling, the results' copy to the host.

Cross-stream rules, each kept in one place here:
- the side stream waits for the main one (`switch`): a step's sampling reads what its
  launch built there (sampler rows, the sampling tensors of rows that joined);
- the main stream waits (`before_launch`) for the sampling of every earlier step still in
  flight except the newest, and for the newest too when the step being launched shares a
  sequence with it (its input token is that step's sample, InputBatch.last_token) or a row
  joins (its row may be one whose earlier occupant the newest step still samples into:
  last_token, penalty counts); so a step reads no row that a sampling still writes;
- a tensor made on the main stream and read on the side one is marked as used there
  (`hand_over`: record_stream), so the allocator reuses its memory only after that use.
On the CPU (gloo ranks) there are no streams: every method is a no-op but for the waits for
the collectives, which block as before.
"""

from __future__ import annotations

from collections import deque

import torch


class SampleStream:
    def __init__(self, device: torch.device, enabled: bool = True):
        """`enabled` False: one stream, as without two steps in flight (every method a no-op but
        the collectives' waits)."""
        self.cuda = enabled and device.type == "cuda"
        self.main = torch.cuda.current_stream(device) if self.cuda else None
        self.side = torch.cuda.Stream(device) if self.cuda else None
        # The last two launches' side-stream work: (an event recorded after it, the ids of the
        # sequences it computed or sampled). (Older steps are read: the host waited for them.)
        self.sampled: deque[tuple[torch.cuda.Event, frozenset[int]]] = deque(maxlen=2)
        self.switched = False  # the launch in progress queues on the side stream

    def before_launch(self, seq_ids: frozenset[int], joining: bool) -> None:
        """The main stream waits for the earlier steps' sampling that this launch may read or
        overwrite (see the module's docstring). Call before the launch builds its inputs."""
        for i, (event, sampled) in enumerate(self.sampled):
            newest = i == len(self.sampled) - 1
            if not newest or joining or not sampled.isdisjoint(seq_ids):
                self.main.wait_event(event)

    def hand_over(self, *tensors: torch.Tensor) -> None:
        """Tensors made on the main stream that the side stream reads."""
        if self.cuda:
            for t in tensors:
                t.record_stream(self.side)

    def switch(self) -> None:
        """From here on the launch queues on the side stream, after the main stream's work so far."""
        if self.cuda:
            self.side.wait_stream(self.main)
            torch.cuda.set_stream(self.side)
            self.switched = True

    def wait(self, work, tensor: torch.Tensor) -> None:
        """Once switched: a collective that the side stream (not the main one) waits for, and the
        tensor it reads (made on the main stream)."""
        work.wait()  # (NCCL: the current stream waits, not the host; gloo: the host)
        self.hand_over(tensor)

    def done(self, seq_ids: frozenset[int]) -> None:
        """The launch returned (or failed): what it queued on the side stream is remembered for
        later launches to wait for where they must, and the main stream is current again."""
        if self.switched:
            event = torch.cuda.Event()
            event.record(self.side)
            self.sampled.append((event, seq_ids))
            torch.cuda.set_stream(self.main)
            self.switched = False
