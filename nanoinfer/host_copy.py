"""to_device: host values onto a device without waiting for the work already queued there.

CUDA copies from pageable host memory to the GPU first wait for the stream to drain, so
every `torch.tensor(list).to("cuda", non_blocking=True)` in a step would stall the host until
the step before it finishes, undoing the overlap of host and GPU work (runtime/inflight.py).
Staging through pinned memory makes the copy truly asynchronous; PyTorch's caching host
allocator recycles the pinned buffers and reuses one only once its copy has completed.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` (a list, numpy array or CPU tensor) as a `dtype` tensor on `device`."""
    t = torch.from_numpy(np.ascontiguousarray(values)) if isinstance(values, np.ndarray) else torch.as_tensor(values)
    t = t.to(dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
