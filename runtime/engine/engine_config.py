"""EngineConfig: the engine's settings (each a keyword, a CLI flag and a check; see nanoinfer/settings.py)."""

from __future__ import annotations

from dataclasses import dataclass

from nanoinfer.errors import RequestError
from nanoinfer.kv_cache import KV_CACHE_DTYPES
from nanoinfer.loaders import LoadConfig
from nanoinfer.settings import check_settings, setting, split_kwargs
from runtime.engine.scheduler import SchedulerConfig
from runtime.engine.speculative import SpeculativeConfig


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = setting(16, "tokens per KV block", minimum=1)
    num_blocks: int | None = setting(None, "KV blocks in the pool (default: from kv_cache_memory on the CPU, from "
                                           "free memory on a GPU)", minimum=1, optional=True)
    kv_cache_memory: int | None = setting(None, "bytes for the KV pool when num_blocks is not given (CPU default: "
                                                "1GiB)", minimum=1, optional=True, size=True)
    swap_space: int = setting(0, "bytes of host memory for swapped-out KV blocks (preemption_mode swap)", minimum=0,
                              size=True)
    max_model_len: int | None = setting(None, "longest prompt + output (default: the model's context length)",
                                        minimum=1, optional=True)
    gpu_memory_utilization: float = setting(0.9, "share of the GPU the weights, activations and KV pool may use",
                                            above=0, maximum=1)
    kv_cache_dtype: str = setting("auto", "KV cache element type: auto (the model's dtype) or fp8 (e4m3, half the "
                                          "bytes of bf16; values saturate at +-448, unscaled)", choices=KV_CACHE_DTYPES)
    enable_prefix_caching: bool = setting(True, "keep computed prompt blocks and reuse them for requests that share "
                                                "a prefix (a system prompt, a conversation's history)")
    enforce_eager: bool = setting(False, "no CUDA graphs and no torch.compile")
    tensor_parallel_size: int = setting(1, "ranks the model's heads and units are split over, one process each "
                                           "(gloo on the CPU, NCCL over GPUs; steps run eagerly)", minimum=1)
    nvtx: bool = setting(False, "NVTX ranges around each step phase, for Nsight Systems (CUDA only)")
    async_scheduling: bool | None = setting(None, "launch step N+1 before reading step N's tokens (default: on with "
                                                  "CUDA)", optional=True)
    speculative_config: SpeculativeConfig | None = setting(
        None, 'speculative decoding, as vLLM configures it: {"method": "ngram", "num_speculative_tokens": 4, '
              '"prompt_lookup_max": 4} or {"model": PATH, "num_speculative_tokens": 4}', parse=SpeculativeConfig.parse)
    scheduler: SchedulerConfig = SchedulerConfig()

    def __post_init__(self):
        check_settings(self)
        if self.scheduler.preemption_mode == "swap" and self.swap_space == 0:
            raise RequestError("preemption_mode='swap' needs swap_space > 0 (bytes of host memory for KV blocks)",
                               param="swap_space")


def engine_config(**engine_args) -> EngineConfig:
    """EngineConfig from the flat engine arguments users pass to LLM/AsyncEngine: the settings
    of EngineConfig and SchedulerConfig (an unknown name is a RequestError listing them)."""
    engine, scheduler = split_kwargs(engine_args, EngineConfig, SchedulerConfig, what="engine")
    return EngineConfig(**engine, scheduler=SchedulerConfig(**scheduler))


def load_and_engine_configs(**kwargs) -> tuple[LoadConfig, EngineConfig]:
    """The LoadConfig and EngineConfig of the flat keywords `LLM(...)` and `from_model(...)`
    take: each name is a setting of LoadConfig, EngineConfig or SchedulerConfig (an unknown one
    is a RequestError listing them), all checked before minutes of loading."""
    load, engine, scheduler = split_kwargs(kwargs, LoadConfig, EngineConfig, SchedulerConfig, what="engine")
    return LoadConfig(**load), EngineConfig(**engine, scheduler=SchedulerConfig(**scheduler))
