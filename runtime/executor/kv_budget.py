"""How many KV blocks fit: a byte budget on the CPU, or on a GPU what the allowed share of its
memory leaves after the weights and a profiling run of the costliest step (forward, sampling,
logprobs)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from nanoinfer.model.batch import Batch
from nanoinfer.backends.choose import forward_of
from nanoinfer.model.decoder import EAGER, LayerFunctions
from nanoinfer.model.kv_cache import allocate_kv_pool, kv_dtype
from nanoinfer.loaders import LoadedModel
from nanoinfer.sampling.sampler import SamplingParams, SamplingTensors, compute_logprobs, sample
from nanoinfer.sampling.sampling_params import MAX_LOGPROBS
from runtime.engine_config import PROMPT_LOGPROB_ROWS

if TYPE_CHECKING:
    from nanoinfer.attention import AttentionBackend

CPU_KV_BUDGET_BYTES = 1 << 30


def kv_blocks_for_memory(model: LoadedModel, config, max_model_len: int, bytes_per_block: int,
                         make_backend: Callable[[], AttentionBackend], layer_fns: LayerFunctions = EAGER) -> int:
    """Blocks for `config.kv_cache_memory` bytes, else for the device's default budget; never
    more than all sequences could use at full length. `config` is an EngineConfig; `layer_fns` what the
    profiling step runs (run_peak_step)."""
    budget = config.kv_cache_memory
    device = model.params.device
    if budget is None:
        budget = (gpu_kv_budget(model, config, make_backend(), layer_fns) if device.type == "cuda"
                  else CPU_KV_BUDGET_BYTES)
    cap = config.scheduler.max_num_seqs * -(-max_model_len // config.block_size)
    return max(1, min(budget // bytes_per_block, cap))


def gpu_kv_budget(model: LoadedModel, config, backend: AttentionBackend, layer_fns: LayerFunctions = EAGER) -> int:
    """Bytes left for the KV pool: `gpu_memory_utilization` of the GPU, less the weights (already
    allocated) and the memory peak of the largest step, measured by running it."""
    dev = model.params.device
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    run_peak_step(model, config, backend, layer_fns)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info(dev)
    # Headroom for CUDA graphs and allocator fragmentation. (The graphs' pool is taken after the KV
    # pool, its largest graphs at start, which settle its size even where the others are captured
    # on first use: nanoinfer/backends/cuda/graphs.py.)
    return int(total * config.gpu_memory_utilization) - peak - (512 << 20)


def run_peak_step(model: LoadedModel, config, backend: AttentionBackend, layer_fns: LayerFunctions = EAGER) -> None:
    """The most memory one step can take: `max_num_batched_tokens` tokens over `max_num_seqs`
    sequences, logits for every sequence and for a step's worth of prompt-logprob rows, and
    every row through the sampler's costliest path (top-k/top-p sort, min-p, penalties with
    their dense [rows, vocab] tables) and MAX_LOGPROBS logprobs, the layers through `layer_fns`.
    `config` is an EngineConfig."""
    cfg, sched, dev = model.config, config.scheduler, model.params.device
    tokens = sched.max_num_batched_tokens
    seqs = max(1, min(sched.max_num_seqs, tokens))
    bs = config.block_size
    # All pages point at one scratch block and no KV is written (slot -1): only the
    # activations' peak matters here.
    per_seq = -(-tokens // seqs)
    lens = [min(per_seq, tokens - i * per_seq) for i in range(seqs) if tokens - i * per_seq > 0]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    # Every sampler (speculative decoding: every verification row), and the prompt-logprob rows.
    spec = config.speculative_config
    per_sampler = 1 + (spec.num_speculative_tokens if spec is not None else 0)
    logits_rows = min(tokens, len(lens) * per_sampler + PROMPT_LOGPROB_ROWS)
    scratch = allocate_kv_pool(cfg, 1, bs, kv_dtype(model.params.dtype, config.kv_cache_dtype), dev)
    batch = Batch(torch.zeros(tokens, dtype=torch.int64, device=dev),
                  torch.cat([torch.arange(n, device=dev) for n in lens]),
                  torch.full((tokens,), -1, dtype=torch.int64, device=dev),
                  torch.zeros(len(lens), -(-per_seq // bs), dtype=torch.int32, device=dev),
                  torch.tensor(lens, dtype=torch.int32, device=dev),
                  torch.tensor(starts, dtype=torch.int32, device=dev),
                  torch.arange(tokens - logits_rows, tokens, dtype=torch.int64, device=dev))
    costly = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                            presence_penalty=0.5, logit_bias={0: 1.0}, min_tokens=1, logprobs=MAX_LOGPROBS)
    rows = min(tokens, len(lens) * per_sampler)
    with torch.inference_mode():
        logits = forward_of(cfg)(model.params, scratch, batch, cfg, backend, layer_fns)
        if model.params.lm_head is None:  # (a pipeline's first stage: the last one's logits come back to sample)
            logits = torch.zeros(logits_rows, cfg.vocab_size, dtype=model.params.dtype, device=dev)
        if logits.shape[-1] < cfg.vocab_size:  # (a tensor-parallel rank's share: a real step gathers them all)
            logits = torch.nn.functional.pad(logits, (0, cfg.vocab_size - logits.shape[-1]))
        st = SamplingTensors.build([costly] * rows, [0] * rows, cfg.vocab_size, dev, prompts=[[0]] * rows,
                                   outputs=[[]] * rows, eos_token_ids=cfg.eos_token_ids)
        sampled = sample(logits[:rows], st)
        compute_logprobs(logits[:rows], sampled, MAX_LOGPROBS)
        compute_logprobs(logits, torch.zeros(logits_rows, dtype=torch.int64, device=dev), MAX_LOGPROBS)
