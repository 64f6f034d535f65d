"""How many KV blocks fit: a byte budget on the CPU, or on a GPU what the allowed share of its
memory leaves after the weights and a profiling forward at the largest step."""

from __future__ import annotations

from typing import Callable

import torch

from nanoinfer.attention import AttentionBackend
from nanoinfer.batch import Batch
from nanoinfer.kv_cache import allocate_kv_pool
from nanoinfer.loaders import LoadedModel
from nanoinfer.model import forward

CPU_KV_BUDGET_BYTES = 1 << 30


def kv_blocks_for_memory(model: LoadedModel, config, max_model_len: int, bytes_per_block: int,
                         make_backend: Callable[[], AttentionBackend]) -> int:
    """Blocks for `config.kv_cache_memory` bytes, else for the device's default budget; never
    more than all sequences could use at full length. `config` is an EngineConfig."""
    budget = config.kv_cache_memory
    device = model.params.device
    if budget is None:
        budget = gpu_kv_budget(model, config, make_backend()) if device.type == "cuda" else CPU_KV_BUDGET_BYTES
    cap = config.scheduler.max_num_seqs * -(-max_model_len // config.block_size)
    return max(1, min(budget // bytes_per_block, cap))


def gpu_kv_budget(model: LoadedModel, config, backend: AttentionBackend) -> int:
    """Bytes left for the KV pool: `gpu_memory_utilization` of the GPU, less the weights (already
    allocated) and the activation peak of the largest step, measured by running it."""
    cfg, sched, dev = model.config, config.scheduler, model.params.device
    tokens = sched.max_num_batched_tokens
    seqs = max(1, min(sched.max_num_seqs, tokens))
    bs = config.block_size
    # The largest step: `tokens` tokens over `seqs` sequences, all pages pointing at one
    # scratch block and no KV written (slot -1): only the activation peak matters here.
    per_seq = -(-tokens // seqs)
    lens = [min(per_seq, tokens - i * per_seq) for i in range(seqs) if tokens - i * per_seq > 0]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    scratch = allocate_kv_pool(cfg, 1, bs, model.params.dtype, dev)
    batch = Batch(torch.zeros(tokens, dtype=torch.int64, device=dev),
                  torch.cat([torch.arange(n, device=dev) for n in lens]),
                  torch.full((tokens,), -1, dtype=torch.int64, device=dev),
                  torch.zeros(len(lens), -(-per_seq // bs), dtype=torch.int32, device=dev),
                  torch.tensor(lens, dtype=torch.int32, device=dev),
                  torch.tensor(starts, dtype=torch.int32, device=dev),
                  torch.tensor(starts[1:], dtype=torch.int64, device=dev) - 1)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    with torch.inference_mode():
        forward(model.params, scratch, batch, cfg, backend)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    del scratch, batch
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info(dev)
    # Headroom for CUDA graphs, the sampler and allocator fragmentation.
    return int(total * config.gpu_memory_utilization) - peak - (512 << 20)
