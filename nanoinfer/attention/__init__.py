"""The attention-backend interface: prepare per-step metadata, write KV, attend over pages.

A backend is any object with these three methods; `forward` receives one explicitly.

- `prepare(batch, cfg, window) -> metadata`: once per step for each kind of layer, whatever
  the backend needs in those layers; `window` is their sliding window (None: full causal).
- `write_kv(kv_layer, k, v, slot_mapping)`: store k, v: [tokens, kv_heads, head_dim] into
  kv_layer: [2, num_blocks, block_size, kv_heads, head_dim] at the flat slots; slot -1 skips.
- `attention(q, kv_layer, metadata) -> out`: q, out: [tokens, heads, head_dim]; each query
  attends causally to its own sequence's cached context (which includes itself).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from nanoinfer.model.batch import Batch
from nanoinfer.model.config import ModelConfig


class AttentionBackend(Protocol):
    def prepare(self, batch: Batch, cfg: ModelConfig, window: int | None) -> Any: ...

    def write_kv(self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None: ...

    def attention(self, q: torch.Tensor, kv_layer: torch.Tensor, metadata: Any) -> torch.Tensor: ...
