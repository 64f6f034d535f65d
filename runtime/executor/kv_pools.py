"""KVPools: a model's KV cache on a device, its host blocks for swapped-out sequences, and the pools that follow it.

The block manager (runtime/engine/block_manager.py) decides which blocks a sequence holds;
this applies its copies to the tensors. A draft model's pool and the other tensor-parallel
ranks' pools are indexed by the same block tables: they follow every copy and swap.
"""

from __future__ import annotations

import torch

from nanoinfer.model.config import ModelConfig
from nanoinfer.model.kv_cache import allocate_kv_pool, copy_blocks, swap_blocks


class KVPools:
    def __init__(self, cfg: ModelConfig, num_blocks: int, num_cpu_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.kv = allocate_kv_pool(cfg, num_blocks, block_size, dtype, device)
        # Host blocks for swapped sequences; pinned on CUDA so the copies can run async.
        self.cpu_kv = allocate_kv_pool(cfg, num_cpu_blocks, block_size, dtype, "cpu")
        if device.type == "cuda" and num_cpu_blocks:
            self.cpu_kv = self.cpu_kv.pin_memory()
        self.followers: list = []  # objects with the same three methods, applied after ours

    def copy_blocks(self, copies) -> None:
        if not copies:  # (most new blocks: a copy order to other ranks is a round trip of its own)
            return
        copy_blocks(self.kv, copies)
        for other in self.followers:
            other.copy_blocks(copies)

    def swap_out(self, copies) -> None:
        if not copies:
            return
        swap_blocks(self.kv, self.cpu_kv, copies)
        for other in self.followers:
            other.swap_out(copies)

    def swap_in(self, copies) -> None:
        if not copies:
            return
        swap_blocks(self.cpu_kv, self.kv, copies)
        for other in self.followers:
            other.swap_in(copies)
