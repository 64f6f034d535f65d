"""Rank 0's orders to the other ranks on the wire: the setup, and a step's Batch as a header of int64s and one
flat tensor (its Cut with it where the ranks cut micro-batches).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from nanoinfer.backends.cuda.graphs import GraphSizes
from nanoinfer.model.batch import Batch


class RankSetup(NamedTuple):
    """What a rank needs besides the weights, sent once rank 0 has sized its KV pool."""

    num_blocks: int
    num_cpu_blocks: int
    block_size: int
    kv_dtype: torch.dtype
    eager: bool  # kernels_for's (enforce_eager): no fused layers, no graphs
    graphs: GraphSizes | None  # the CUDA graphs rank 0 captures, which every rank captures alike
    micro_batches: int = 1  # pipeline parallelism: the most micro-batches a step is cut into
    peer_sums: bool = False  # one-token sums over NVLink peer memory (nanoinfer.backends.cuda.peer_sum), connected now
    deterministic: bool = False  # kernels_for's: the batch-invariant parts

# Every order starts with a fixed header of int64s: its kind and, for a forward (every step),
# each batch tensor's rows, columns (-1: 1-D) and dtype, so that the step's path pickles
# nothing; the batch's tensors then follow as one int64 broadcast (on CUDA over NCCL). A forward
# with its cut (FORWARD_CUT) sends the batch's Cut too. Any other order follows its kind as a
# pickled (kind, body). Over the control channel an order is one message (the header, then the
# cut's int64s or the pickle); over the control group (torchrun's ranks) a broadcast each.
FORWARD, OBJECT, FORWARD_CUT = 0, 1, 2
DTYPES = (torch.int32, torch.int64)
HEADER = 1 + 3 * len(Batch._fields)
OBJECT_BYTES = np.int64(OBJECT).tobytes()


class Cut(NamedTuple):
    """A batch's query_start_loc and logits_indices on the host: the ranks that cut a step into
    micro-batches take them from rank 0 rather than from their GPU copies, whose reading would
    wait for the work queued before (a rank's host then launched a step only once its GPU had
    finished the last one)."""

    query_start_loc: list[int]
    logits_indices: list[int]


def forward_header(batch: Batch, cut: bool = False) -> list[int]:
    fields = [FORWARD_CUT if cut else FORWARD]
    for t in batch:
        fields += (t.shape[0], t.shape[1] if t.dim() == 2 else -1, DTYPES.index(t.dtype))
    return fields


def layout_of(header: list[int]) -> list[tuple[int, int, int, int]]:
    """Per batch tensor of a forward's header: rows, columns (-1: 1-D), dtype index, elements."""
    return [(rows, cols, dtype, rows if cols < 0 else rows * cols)
            for rows, cols, dtype in zip(header[1:HEADER:3], header[2:HEADER:3], header[3:HEADER:3])]


def unpack_batch(layout: list[tuple[int, int, int, int]], flat: torch.Tensor) -> Batch:
    """The Batch of a forward's `layout_of` and its flattened tensors."""
    tensors, at = [], 0
    for rows, cols, dtype, n in layout:
        part = flat[at:at + n]
        tensors.append((part if cols < 0 else part.view(rows, cols)).to(DTYPES[dtype]))
        at += n
    return Batch(*tensors)
