"""The engine's settings: EngineConfig, with the scheduler's and speculative decoding's.

Each setting is a keyword, a CLI flag and a check (nanoinfer/settings.py). The engine
(runtime/engine/) and the executor (runtime/executor/) both read them, so they live above both.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoinfer.errors import RequestError
from nanoinfer.model.kv_cache import KV_CACHE_DTYPES
from nanoinfer.loaders import QUANTIZATIONS, LoadConfig
from nanoinfer.settings import check_settings, json_object, setting, setting_names, split_kwargs

POLICIES = ("fcfs", "priority")
# Prompt tokens per step whose logprobs are computed: each needs a [vocab] row of logits, so a
# whole 4,096-token chunk at a 152k vocabulary would hold 2.5 GB of them at once. The pool
# sizing (runtime/executor/kv_budget.py) reserves room for this many rows.
PROMPT_LOGPROB_ROWS = 512
PREEMPTION_MODES = ("recompute", "swap")
GRAPH_CAPTURES = ("lazy", "all")  # cuda_graph_capture's (nanoinfer/backends/cuda/graphs.py: StepGraphs' `lazy`)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = setting(256, "sequences in the batch at once (a request with n completions counts n)",
                                minimum=1)
    max_num_batched_tokens: int = setting(4096, "tokens per step; longer prompts prefill in chunks", minimum=1)
    scheduling_policy: str = setting("fcfs", "fcfs, or priority (lower `priority` runs sooner, with aging)",
                                     choices=POLICIES)
    preemption_mode: str = setting("recompute", "how a sequence makes room when the KV pool runs dry",
                                   choices=PREEMPTION_MODES)
    aging_steps: int = setting(64, "steps of waiting that raise a request's priority by one", minimum=1)

    def __post_init__(self):
        check_settings(self)


METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: {"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_max": 4} or {"model": PATH, "num_speculative_tokens": 4}."""

    num_speculative_tokens: int = setting(None, "draft tokens verified per step", minimum=1, maximum=64)
    method: str | None = setting(None, "ngram, or draft_model (the default when `model` is given)", choices=METHODS,
                                 optional=True)
    model: str | None = setting(None, "the draft model (a path or short name, loaded like the target; it must "
                                      "share the target's tokenizer)", optional=True)
    prompt_lookup_max: int | None = setting(None, "ngram: the longest n-gram matched (default: "
                                                  "prompt_lookup_min, or 4)", minimum=1, optional=True)
    prompt_lookup_min: int | None = setting(None, "ngram: the shortest n-gram matched (default: 1)", minimum=1,
                                            optional=True)
    quantization: str = setting("auto", "the draft model's weights, as the engine's `quantization` (int8: a "
                                        "cheaper draft, its proposals still verified exactly)", choices=QUANTIZATIONS)
    adaptive: bool = setting(True, "speculate only while it emits tokens faster than decoding without it "
                                   "(measured; a draft the target keeps rejecting switches it off)")

    def __post_init__(self):
        check_settings(self)
        method = self.method or ("draft_model" if self.model is not None else "ngram")
        object.__setattr__(self, "method", method)
        if method == "draft_model" and self.model is None:
            raise RequestError("speculative_config: method 'draft_model' needs a 'model' (the draft's path)",
                               param="speculative_config")
        if method == "ngram" and self.quantization != "auto":
            raise RequestError(f"speculative_config: quantization={self.quantization!r} applies to a draft model, "
                               f"not to n-gram lookup", param="speculative_config")
        if method == "ngram":
            high = self.prompt_lookup_max or self.prompt_lookup_min or 4
            low = self.prompt_lookup_min or 1
            if low > high:
                raise RequestError(f"speculative_config: prompt_lookup_min={low} is above prompt_lookup_max={high}",
                                   param="speculative_config")
            object.__setattr__(self, "prompt_lookup_max", high)
            object.__setattr__(self, "prompt_lookup_min", low)

    @classmethod
    def parse(cls, name: str, value) -> "SpeculativeConfig | None":
        """From a mapping, a JSON object (the CLI flag) or a SpeculativeConfig; RequestError
        naming what is wrong."""
        if value is None or isinstance(value, cls):
            return value
        value = json_object(value, name, 'a JSON object such as {"method": "ngram", "num_speculative_tokens": 4}')
        unknown = sorted(set(value) - set(setting_names(cls)))
        if unknown:
            raise RequestError(f"{name}: unknown key {unknown[0]!r}: expected some of {setting_names(cls)}",
                               param=name)
        try:
            return cls(**value)
        except RequestError as exc:
            message = str(exc) if str(exc).startswith(name) else f"{name}: {exc}"
            raise RequestError(message, param=name) from exc


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
    enforce_eager: bool = setting(False, "no CUDA graphs; the dense layer parts and the sampler's draw in torch ops")
    deterministic: bool = setting(False, "on CUDA, a request's tokens and logprobs bit-identical whether it runs alone "
                                         "or batched with any others, chunked, preempted or cached: every row count "
                                         "through the same kernels (nanoinfer/backends/cuda/invariant.py; a cost "
                                         "at batch 1 and over long contexts). The CPU's kernels are so already; "
                                         "tensor parallelism over more than two GPUs is not")
    cuda_graph_capture: str = setting("lazy", "when CUDA graphs are captured: lazy (the largest batch sizes at "
                                              "start, each other on the first step that needs it: a shorter start) "
                                              "or all (every size at start: no capture mid-run, as benchmarks want)",
                                      choices=GRAPH_CAPTURES)
    tensor_parallel_size: int = setting(1, "ranks the model's heads and units are split over, one process each "
                                           "(gloo on the CPU, NCCL over GPUs; steps run eagerly)", minimum=1)
    pipeline_parallel_size: int = setting(1, "stages the model's layers are split over, one process each (times "
                                             "tensor_parallel_size); each step's sequences go through them as "
                                             "micro-batches, activations sent point to point (steps run eagerly)",
                                          minimum=1)
    peer_sums: bool = setting(True, "under tensor parallelism on GPUs of one host, a one-token step's sums over "
                                    "the ranks go through NVLink peer memory, written by the projections "
                                    "themselves, instead of NCCL's all-reduce (8B at batch 1: 1.10x on 2x H100, "
                                    "1.25x on 4x); for a 16-bit model without pipeline stages or "
                                    "enforce_eager, in the first such engine of a process (torch's symmetric "
                                    "memory), where the GPUs reach each other's memory")
    pipeline_micro_batches: int | None = setting(None, "the most micro-batches a step's sequences are cut into "
                                                       "under pipeline parallelism (default: "
                                                       "pipeline_parallel_size, or 1 with pipeline_overlap)", minimum=1, optional=True)
    pipeline_overlap: bool = setting(True, "under pipeline parallelism with async scheduling, two steps of "
                                           "disjoint sequences in flight over the stages (virtual engines); off: "
                                           "one step at a time, cut into micro-batches (faster where the host "
                                           "bounds the step: a small model)")
    data_parallel_size: int = setting(1, "engine replicas behind one server, each a whole engine on its own "
                                         "GPU(s) (replica i from cuda:i*tensor_parallel_size); a request goes to the "
                                         "replica holding the longest cached prefix of its prompt, else the least "
                                         "loaded. A server setting: LLM runs one engine", minimum=1)
    step_timeout: float = setting(600.0, "seconds one step of an engine process (--engine-process, data "
                                         "parallelism) may run before the server kills it as hung; its requests "
                                         "fail (a first step that compiles kernels may take a minute)", above=0)
    nvtx: bool = setting(False, "NVTX ranges around each step phase, for Nsight Systems (CUDA only)")
    async_scheduling: bool | None = setting(None, "launch step N+1 before reading step N's tokens (default: on with "
                                                  "CUDA)", optional=True)
    speculative_config: SpeculativeConfig | None = setting(
        None, 'speculative decoding, as vLLM configures it: {"method": "ngram", "num_speculative_tokens": 4, '
              '"prompt_lookup_max": 4} or {"model": PATH, "num_speculative_tokens": 4}', parse=SpeculativeConfig.parse)
    scheduler: SchedulerConfig = SchedulerConfig()

    def __post_init__(self):
        check_settings(self)
        if self.pipeline_parallel_size > 1 and self.speculative_config is not None:
            raise RequestError(f"pipeline_parallel_size={self.pipeline_parallel_size} with speculative_config: "
                               f"speculative decoding does not run over pipeline stages yet: expected "
                               f"pipeline_parallel_size=1, or no speculative_config", param="pipeline_parallel_size")
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
