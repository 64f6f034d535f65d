"""load_model: a short name, an HF directory or a .gguf path -> config, params, tokenizer.

Each format's loader (loaders/gguf.py, hf.py, llama2c.py, nanochat.py) is imported by the
branch that reads that format, and the rest (Hub downloads, random weights, int8/fp8
quantization) only when a load asks for them: loading one model imports one format's code.
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple

import torch

from nanoinfer.model.config import ModelConfig
from nanoinfer.errors import CheckpointError, RequestError
from nanoinfer.hub import DEFAULT_MODEL, KNOWN_MODELS, resolve_model_name
from nanoinfer.sampling import sampling_defaults
from nanoinfer.model.decoder import Params
from nanoinfer.model.layers import rope_inv_freq
from nanoinfer.settings import check_settings, setting, split_kwargs

if TYPE_CHECKING:
    from nanoinfer.text.tokenizer import Tokenizer


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
LOAD_FORMATS = ("auto", "dummy")
# none: dequantize everything to `dtype` (the exact path); gguf: a quantized GGUF's matrices
# stay packed (4-bit ones on CUDA too); int8, fp8: per-row int8 or e4m3 matrices from any
# checkpoint (fp8 wants Hopper or Ada; on the CPU it runs its slow reference); int4: groups of
# 128 (round to nearest, with a min) from any checkpoint; awq, gptq: such a checkpoint's
# 4-bit matrices kept; auto: gguf for a quantized GGUF on the CPU, as llama.cpp runs it
# (unless a float dtype is asked for: then its exact weights in that dtype), fp8 for an FP8
# checkpoint, awq or gptq for theirs, else none.
QUANTIZATIONS = ("auto", "none", "gguf", "int8", "fp8", "int4", "awq", "gptq")


@dataclass(frozen=True)
class LoadConfig:
    """How a checkpoint is loaded: `load_model`'s options, declared once (each a keyword of
    load_model, LLM and AsyncEngine.from_model, a CLI flag, and a check)."""

    device: str = setting("auto", "auto, cpu, cuda or cuda:N")
    dtype: str = setting("auto", "auto (fp32 on the CPU, the checkpoint's half type on a GPU), float32, bfloat16 or "
                                 "float16", choices=("auto", *DTYPES))
    quantization: str = setting("auto", "how matrices are held: auto (a quantized GGUF stays packed on the CPU, as "
                                        "llama.cpp runs it, unless --dtype names a float type; an FP8 checkpoint "
                                        "stays fp8, an AWQ or GPTQ one 4-bit), none (dequantized to --dtype: the exact "
                                        "path), gguf, int8 or fp8 (per row, any checkpoint), int4 (groups of 128, any "
                                        "checkpoint), awq, gptq", choices=QUANTIZATIONS)
    load_format: str = setting("auto", "dummy: the checkpoint's config and tokenizer with random weights (benchmarks)",
                               choices=LOAD_FORMATS)
    gguf_file: str | None = setting(None, "which .gguf of a Hub repository (or local directory) holding several",
                                    optional=True)
    generation_config: str = setting("auto", "sampling settings for requests that set none of their own: auto (the "
                                             "model's recommendation: its generation_config.json, or a GGUF's "
                                             "general.sampling.* keys), none (NanoInfer's defaults), or a folder "
                                             "holding a generation_config.json (vLLM's --generation-config)",
                                     check=sampling_defaults.check_setting)
    progress: bool = setting(True, "progress bars while loading", flag=False)

    def __post_init__(self):
        check_settings(self)


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    params: Params
    tokenizer: "Tokenizer | None"  # None when an HF directory ships no tokenizer files
    path: Path
    name: str | None = None  # how users named it, when that was a short name or a Hub id
    quantization: str = "none"  # how the matrices are held: QUANTIZATIONS less "auto"
    # SamplingParams keywords for requests that name no params of their own (nanoinfer/sampling/sampling_defaults.py)
    sampling_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def for_context(self, max_model_len: int | None) -> "LoadedModel":
        """The model with the RoPE frequencies of the context an engine runs it at (`max_model_len`, at most
        its own; None, its own): longrope's long factors past the original context (nanoinfer.model.layers'
        rope_inv_freq). Every process that runs the forward of one engine takes the same (the engine's core,
        a torchrun rank, a speculative draft); any other model as it is."""
        cfg, params = self.config, self.params
        if cfg.rope_scaling is None or cfg.rope_scaling.kind != "longrope" or params is None:
            return self
        context = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        inv_freq = rope_inv_freq(cfg, context).to(params.rope_inv_freq.device)
        return dataclasses.replace(self, params=dataclasses.replace(params, rope_inv_freq=inv_freq))

    @property
    def model_id(self) -> str:
        """What a server calls it: the short name, else the directory's name or the file's
        without .gguf (never a path: that would tell every client where the weights live)."""
        name = self.path.name
        return self.name or (name[:-len(".gguf")] if name.endswith(".gguf") else name)


def _load_device(config: LoadConfig) -> torch.device:
    """The device `config` loads onto; on CUDA, Triton's own set-up begins meanwhile on a thread
    (nanoinfer/backends/cuda/triton_setup.py), so that it overlaps the load."""
    dev = resolve_device(config.device)
    if dev.type == "cuda":
        from nanoinfer.backends.cuda import triton_setup

        triton_setup.begin()
    return dev


def load_model(model: str | Path | None = None, config: LoadConfig | None = None, **load_args) -> LoadedModel:
    """Load `model` (None = the default model) as `config` says, or LoadConfig's `load_args`
    (device, dtype, quantization, load_format, gguf_file, progress; an unknown one is a
    RequestError naming it): onto `device` in `dtype`, its matrices held as `quantization` says
    (QUANTIZATIONS). `load_format` "dummy" reads the config and tokenizer only and makes
    random weights (vLLM's option).

    Raises CheckpointError naming the file for anything wrong with the checkpoint."""
    if config is None:
        (args,) = split_kwargs(load_args, LoadConfig, what="load")
        config = LoadConfig(**args)
    elif load_args:
        raise RequestError(f"load_model got a LoadConfig and {sorted(load_args)}: expected one of them")
    name = DEFAULT_MODEL if model is None else str(model)
    path = resolve_model_name(name, quiet=not config.progress) if name in KNOWN_MODELS else Path(name).expanduser()
    hub_id = None
    if not path.exists():  # org/name[@revision] on the Hugging Face Hub?
        from nanoinfer.loaders import hf_hub

        if hf_hub.is_hub_id(name):
            path, hub_id = hf_hub.resolve_hub_model(name, config.gguf_file), name.partition("@")[0]
    if hub_id is None and config.gguf_file is not None:  # (a local directory of GGUF files)
        path = path / config.gguf_file
    dev = _load_device(config)
    loaded = _load_format(path, config, dev)
    cfg, params, tokenizer, quantization = loaded.config, loaded.params, loaded.tokenizer, loaded.quantization
    layer_form = _layer_form(quantization, dev, loaded.dtype)
    if params is None:  # load_format="dummy"
        from nanoinfer.loaders.dummy import dummy_params

        params = dummy_params(cfg, loaded.dtype, dev, layer_form=layer_form)
    if layer_form is not None:  # (the layers read or made were quantized one by one: the head is left)
        from nanoinfer.loaders.quantize import quantize_head, quantize_params

        whole = loaded.layers_quantized or loaded.params is None
        params = quantize_head(params, quantization) if whole else quantize_params(params, quantization)
    if tokenizer is not None:
        # Generation ends at any EOS either side declares (chat models often end turns with a
        # token the config names but the tokenizer does not, or the other way round).
        eos = tuple(dict.fromkeys(cfg.eos_token_ids + tokenizer.eos_token_ids))
        cfg = dataclasses.replace(cfg, eos_token_ids=eos)
    if dev.type == "cpu":
        _return_freed_memory()
    return LoadedModel(cfg, params, tokenizer, path, hub_id or (name if name in KNOWN_MODELS else None), quantization,
                       sampling_defaults.resolve(config.generation_config, loaded.recommended))


def _return_freed_memory() -> None:
    """Hand the heap's free pages back to the system after a load. glibc keeps what the loader's
    copies of each matrix freed (the file's bytes, then the kernels' layout of them): ~90 MiB of a
    1B GGUF's resident memory. A no-op where the C library has no malloc_trim."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _Loaded(NamedTuple):
    """What a format's branch of `load_model` read: params None for load_format="dummy"."""

    config: ModelConfig
    dtype: torch.dtype  # the activations' (`dtype` resolved for this checkpoint and device)
    params: Params | None
    tokenizer: "Tokenizer | None"
    quantization: str  # QUANTIZATIONS less "auto"
    recommended: Callable[[], dict[str, Any]] = dict  # the checkpoint's recommended sampling settings, read on demand
    layers_quantized: bool = False  # each layer quantized as it was read (`_layer_form`): the head is left


def _load_format(path: Path, config: LoadConfig, dev: torch.device) -> _Loaded:
    """The branch of `load_model` that reads `path`'s format."""
    # A nanochat checkpoint is a model_<step>.pt, or a directory holding them (and perhaps HF files too).
    nanochat_files = None
    if path.is_dir() or (path.suffix == ".pt" and path.is_file()):
        from nanoinfer.loaders import nanochat_checkpoint as nanochat

        nanochat_files = nanochat.checkpoint_files(path)
    if nanochat_files is not None:  # model_<step>.pt + meta_<step>.json, its tokenizer.pkl above
        return _load_nanochat(*nanochat_files, config, dev)
    if path.is_dir():
        return _load_hf(path, config, dev)
    if path.suffix == ".bin" and path.is_file():  # llama2.c, its tokenizer.bin beside it (if there)
        return _load_llama2c(path, config, dev)
    if path.suffix == ".gguf" or path.is_file():
        return _load_gguf(path, config, dev)
    raise CheckpointError(path, f"not found: expected a known model name {sorted(KNOWN_MODELS)}, a Hugging Face "
                                "model directory, a .gguf file or a llama2.c .bin")


def _load_nanochat(model_file: Path, meta_file: Path, config: LoadConfig, dev: torch.device) -> _Loaded:
    from nanoinfer.loaders import nanochat_checkpoint as nanochat
    from nanoinfer.text.nanochat_tokenizer import nanochat_tokenizer

    if config.load_format == "dummy":
        raise RequestError("load_format='dummy' makes Llama-family weights: a nanochat checkpoint loads "
                           "with load_format='auto'", param="load_format")
    cfg = nanochat.nanochat_config(meta_file)
    torch_dtype = resolve_dtype(config.dtype, cfg, dev)
    quantization = _resolve_quantization(config.quantization, dev, gguf=False, quantized_file=False)
    if quantization != "none":
        raise RequestError(f"quantization={quantization!r}: a nanochat model runs unquantized (expected 'none' "
                           "or 'auto')", param="quantization")
    params = nanochat.load_nanochat_params(model_file, cfg, torch_dtype, dev)
    vocab = nanochat.tokenizer_file(model_file)
    tokenizer = nanochat_tokenizer(vocab) if vocab is not None else None
    if tokenizer is not None and tokenizer.vocab_size != cfg.vocab_size:
        raise CheckpointError(vocab, f"{tokenizer.vocab_size} tokens where the model's meta says vocab_size="
                                     f"{cfg.vocab_size}: not this model's tokenizer")
    return _Loaded(cfg, torch_dtype, params, tokenizer, quantization)


def _layer_form(quantization: str, dev: torch.device, dtype: torch.dtype) -> Callable | None:
    """What quantizes one layer where `quantization` is done at load (int8, fp8, int4), else None: the
    formats' loaders apply it to each layer as they read it, so a model whose float weights would not fit the
    device loads (Mixtral-8x7B's 93 GB of bf16 in fp8 on an 80 GB GPU)."""
    if quantization not in ("int8", "fp8", "int4"):
        return None
    from nanoinfer.loaders.quantize import quantize_layer

    return lambda lp: quantize_layer(lp, quantization, dev, dtype)


def _refuse_quantized_experts(cfg: ModelConfig, quantization: str,
                              kept: tuple[str, ...] = ("none", "int8", "fp8")) -> None:
    """Before any weight is read: a mixture-of-experts model's matrices held as `quantization` only where that is
    one of `kept` (its experts: float stacks, int8 or fp8 ones (nanoinfer.quant.quantized.ExpertStack), or a
    GGUF's packed blocks on the CPU)."""
    if cfg.num_experts and quantization not in kept:
        raise RequestError(f"quantization={quantization!r} of a mixture-of-experts model ({cfg.architecture}) is not "
                           f"supported yet: its experts run in float, int8 or fp8 stacks (expected one of {list(kept)})",
                           param="quantization")


def _load_hf(path: Path, config: LoadConfig, dev: torch.device) -> _Loaded:
    from nanoinfer.loaders.hf import has_fp8_weights, load_hf_params, read_hf_config
    from nanoinfer.text.tokenizer import Tokenizer

    from nanoinfer.loaders.int4 import read_int4_format

    dummy = config.load_format == "dummy"
    cfg = read_hf_config(path)
    torch_dtype = resolve_dtype(config.dtype, cfg, dev)
    int4 = read_int4_format(path)
    fp8_file = not dummy and int4 is None and has_fp8_weights(path)
    quantization = _resolve_quantization(config.quantization, dev, gguf=False, quantized_file=False,
                                         fp8_file=fp8_file, int4_method=int4 and int4.method)
    _refuse_quantized_experts(cfg, quantization)
    layer_form = _layer_form(quantization, dev, torch_dtype)
    params = None if dummy else load_hf_params(path, cfg, torch_dtype, dev, progress=config.progress,
                                               fp8=quantization == "fp8", int4=int4,
                                               packed=int4 is not None and quantization == int4.method,
                                               layer_form=layer_form)
    from nanoinfer.sampling.sampling_defaults import from_generation_config

    return _Loaded(cfg, torch_dtype, params, Tokenizer.from_hf_dir(path), quantization,
                   lambda: from_generation_config(path), layers_quantized=layer_form is not None)


def _load_llama2c(path: Path, config: LoadConfig, dev: torch.device) -> _Loaded:
    from nanoinfer.loaders.llama2c import llama2c_config, load_llama2c_params
    from nanoinfer.text.tokenizer import Tokenizer

    cfg, offset, shared = llama2c_config(path)
    torch_dtype = resolve_dtype(config.dtype, cfg, dev)
    quantization = _resolve_quantization(config.quantization, dev, gguf=False, quantized_file=False)
    params = None if config.load_format == "dummy" else load_llama2c_params(
        path, cfg, offset, shared, torch_dtype, dev, progress=config.progress)
    vocab = path.parent / "tokenizer.bin"
    tokenizer = Tokenizer.from_llama2c(vocab, cfg.vocab_size) if vocab.is_file() and vocab != path else None
    return _Loaded(cfg, torch_dtype, params, tokenizer, quantization)


def _load_gguf(path: Path, config: LoadConfig, dev: torch.device) -> _Loaded:
    from nanoinfer.loaders.gguf import gguf_config, is_quantized, load_gguf_params, open_gguf
    from nanoinfer.text.tokenizer import Tokenizer

    header = open_gguf(path)
    cfg = gguf_config(header, path)
    torch_dtype = resolve_dtype(config.dtype, cfg, dev)
    quantization = _resolve_quantization(config.quantization, dev, gguf=True, quantized_file=is_quantized(header),
                                         dtype_asked=config.dtype != "auto")
    # (a quantized GGUF's experts stay packed on the CPU, as its other matrices: nanoinfer/loaders/gguf_moe.py; CUDA's
    # expert kernels read float, int8 or fp8 stacks)
    _refuse_quantized_experts(cfg, quantization, ("none", "int8", "fp8") + (() if dev.type == "cuda" else ("gguf",)))
    layer_form = _layer_form(quantization, dev, torch_dtype)
    params = None if config.load_format == "dummy" else load_gguf_params(
        header, cfg, torch_dtype, dev, path, progress=config.progress, packed=quantization == "gguf",
        layer_form=layer_form)
    from nanoinfer.sampling.sampling_defaults import from_gguf

    return _Loaded(cfg, torch_dtype, params, Tokenizer.from_gguf(header, path), quantization,
                   lambda: from_gguf(lambda key: header.scalar(key, None), path),
                   layers_quantized=layer_form is not None)


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """"auto" picks CUDA when present, else the CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise RequestError(f"device {device!r} is not a torch device (expected auto, cpu, cuda, cuda:N)") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise RequestError(f"device {device!r} asked for, but CUDA is not available on this machine")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """"auto": fp32 on the CPU (exact, and bf16 matmuls are slow there); on a GPU the
    checkpoint's half type, bf16 when it has none (quantized GGUF, fp32 checkpoints)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.float16 if cfg.torch_dtype in ("float16", "fp16") else torch.bfloat16
    if dtype not in DTYPES:
        raise RequestError(f"dtype {dtype!r} is not supported (expected auto or one of {sorted(DTYPES)})")
    return DTYPES[dtype]


def _resolve_quantization(quantization: str, device: torch.device, *, gguf: bool, quantized_file: bool,
                          fp8_file: bool = False, dtype_asked: bool = False, int4_method: str | None = None) -> str:
    if quantization == "auto":
        packed = gguf and quantized_file and device.type == "cpu" and not dtype_asked
        return "gguf" if packed else "fp8" if fp8_file else int4_method or "none"
    if quantization in ("awq", "gptq") and quantization != int4_method:
        raise RequestError(f"quantization={quantization!r} keeps a {quantization.upper()} checkpoint's 4-bit "
                           f"matrices: this model is {'a ' + int4_method.upper() + ' checkpoint' if int4_method else 'not one'}",
                           param="quantization")
    if quantization == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise RequestError(f"quantization='fp8' needs fp8 tensor cores (compute capability 8.9 or newer): "
                           f"{torch.cuda.get_device_name(device)} has {torch.cuda.get_device_capability(device)}",
                           param="quantization")
    if quantization == "gguf" and not (gguf and quantized_file):
        raise RequestError("quantization='gguf' keeps a quantized GGUF file's blocks: this model is "
                           f"{'a GGUF file with no quantized matrix' if gguf else 'not a GGUF file'}",
                           param="quantization")
    return quantization
