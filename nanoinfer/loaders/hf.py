"""Load a Hugging Face checkpoint directory: config.json (read into a ModelConfig) + safetensors (single or sharded).

FP8 checkpoints in the common form (an e4m3 `weight` with a `weight_scale` beside it, one
scale per tensor or per output row: llm-compressor, fbgemm_fp8, vLLM's own) load as
`Fp8Weight`s, or dequantized to the model's dtype when `fp8` is off. AWQ and GPTQ checkpoints
(4-bit, nanoinfer/loaders/int4.py) load as GroupedWeights that the device's packing keeps
4-bit, or dequantized."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
from safetensors import SafetensorError, safe_open

from nanoinfer.model.config import ModelConfig, RopeScaling, checkpoint_config
from nanoinfer.model.config_checks import (MAX_DIMENSIONS, cut, dimension, heads_share_kv_heads,
                                     positive_number, shown, token_id)
from nanoinfer.errors import CheckpointError
from nanoinfer.json_files import json_kind, read_json_object
from nanoinfer.loaders.params import build_params
from nanoinfer.model.decoder import Params
from nanoinfer.quant.quantized import FP8, Fp8Weight, dequantize

if TYPE_CHECKING:
    from nanoinfer.loaders.int4 import Int4Format

PROBE = "model.layers.0.self_attn.q_proj.weight"  # its type tells whether a checkpoint is FP8
# The types a weight may have in the file (FP8 with its scales); the int4 formats read their
# integer tensors through `read`, not as weights.
WEIGHT_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16, torch.float64, FP8, torch.float8_e5m2))

# HF `architectures[0]` -> our family name. All of them share one forward, driven by flags.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",  # (Phi-3, Phi-4: fused qkv and gate/up projections, longrope)
    "Gemma2ForCausalLM": "gemma2",  # (Gemma 2/3: nanoinfer/loaders/hf_gemma.py reads their flags)
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # (its language model: text_config, the language_model. weights)
    "MixtralForCausalLM": "mixtral",  # (mixtures of experts: nanoinfer/loaders/hf_moe.py reads their fields)
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# Phi-3's fused matrices: each of our separate names -> (the fused tensor's name, its rows [start, stop) for a
# config); read where the separate one is absent
FUSED = {"self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", lambda c: (0, c.q_size)),
         "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", lambda c: (c.q_size, c.q_size + c.kv_size)),
         "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight",
                                     lambda c: (c.q_size + c.kv_size, c.q_size + 2 * c.kv_size)),
         "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", lambda c: (0, c.intermediate_size)),
         "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", lambda c: (c.intermediate_size, 2 * c.intermediate_size))}
# config.json's dimensions -> ModelConfig's fields (whose MAX_DIMENSIONS bound them)
HF_DIMENSIONS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
                 "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
                 "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
                 "max_position_embeddings": "max_position_embeddings"}


def read_hf_config(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(path, "config.json is missing: not a Hugging Face model directory")
    return config_from_hf(read_json_object(path), path)


def _token_ids(name: str, value: Any, path) -> tuple[int, ...]:
    """config.json's `eos_token_id`: none, one id or a list of them."""
    if value is None:
        return ()
    return tuple(token_id(name, v, path) for v in (value if isinstance(value, list) else [value]))


def rope_scaling_from_hf(params: Mapping[str, Any] | None, path, name: str = "rope_scaling",
                         config: Mapping[str, Any] | None = None) -> RopeScaling | None:
    """Read HF's `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5): `name`; `config` (the
    whole config.json) for what longrope reads beside it, as transformers does."""
    if not params:
        return None
    if not isinstance(params, Mapping):
        raise CheckpointError(path, f"{name} is {shown(params)}: expected a JSON object")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "su":  # (Phi-3's first configs' name for it)
        kind = "longrope"
    if kind == "default":
        return None
    if kind not in ("linear", "llama3", "longrope"):
        raise CheckpointError(path, f"rope scaling type {shown(kind)} is not supported (default, linear, llama3, "
                                    "longrope)")
    try:
        if kind == "linear":
            return RopeScaling("linear", float(params["factor"]))
        if kind == "longrope":
            return _longrope(params, config or {})
        return RopeScaling(
            "llama3",
            float(params["factor"]),
            float(params.get("low_freq_factor", 1.0)),
            float(params.get("high_freq_factor", 4.0)),
            int(params.get("original_max_position_embeddings", 8192)),
        )
    except KeyError as exc:
        raise CheckpointError(path, f"{name} of type {kind!r} has no {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise CheckpointError(path, f"{name} {shown(dict(params))} is no usable {kind} scaling: "
                                    f"{cut(str(exc))}") from None


def _longrope(params: Mapping[str, Any], config: Mapping[str, Any]) -> RopeScaling:
    """Phi-3's longrope as transformers computes it: the context it was trained on (`original_max_position_
    embeddings`, in the scaling or beside it), the factor to the full context, and cos and sin scaled by
    sqrt(1 + ln(factor) / ln(original)) unless an `attention_factor` is given."""
    original = dimension("original_max_position_embeddings", params.get("original_max_position_embeddings")
                         or config["original_max_position_embeddings"])
    if original < 2:  # (its logarithm divides the attention factor's)
        raise ValueError(f"original_max_position_embeddings={original} is too small: expected at least 2")
    factor = float(params.get("factor") or int(config.get("max_position_embeddings", original)) / original)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling("longrope", factor, original_max_position_embeddings=original,
                       short_factor=tuple(map(float, params["short_factor"])),
                       long_factor=tuple(map(float, params["long_factor"])), attention_factor=float(attention))


def _rope_from_hf(cfg: Mapping[str, Any], path) -> tuple[RopeScaling | None, Any, Any]:
    """(scaling, theta, partial_rotary_factor, as the file has them): transformers 5 keeps them in `rope_parameters`."""
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    params = cfg.get(key)
    if isinstance(params, Mapping) and "full_attention" in params:  # (transformers 5's by layer type: Gemma 3's)
        params = params["full_attention"]
    partial = (params if isinstance(params, Mapping) else {}).get("partial_rotary_factor",
                                                                  cfg.get("partial_rotary_factor"))
    scaling = rope_scaling_from_hf(params, path, key, cfg)
    theta = next((t for t in (cfg.get("rope_theta"), (params or {}).get("rope_theta")) if t is not None), 1e4)
    return scaling, theta, partial


def _rotary_dim(partial: Any, head_dim: int, path) -> int | None:
    """The rotated width of a head by `partial_rotary_factor` (transformers' int(head_dim * factor)); None: all."""
    if partial is None or partial == 1:
        return None
    rotary = int(head_dim * partial) if isinstance(partial, (int, float)) and 0 < partial <= 1 else 0
    if rotary < 2 or rotary % 2:
        raise CheckpointError(path, f"partial_rotary_factor {shown(partial)} gives a rotated width of {rotary} of "
                                    f"head_dim {head_dim}: expected a factor in (0, 1] giving an even width >= 2")
    return rotary


def sliding_window_from_hf(cfg: Mapping[str, Any], arch: str, num_layers: int,
                           path) -> tuple[int | None, tuple[bool, ...] | None]:
    """(sliding_window, windowed_layers) as transformers applies them: Mistral windows every
    layer; Qwen2/Qwen3 only with `use_sliding_window`, and then only the layers `layer_types`
    names "sliding_attention" (derived when absent: the layers from `max_window_layers` on);
    Llama never. No windowed layer gives (None, None); all of them (window, None)."""
    window = cfg.get("sliding_window")
    if not window or arch == "llama" or (arch in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window")):
        return None, None
    window = dimension("sliding_window", window, path)
    if arch in ("mistral", "phi3", "mixtral", "qwen3_moe"):  # (transformers' ignore layer_types: every layer)
        return window, None
    layer_types = cfg.get("layer_types")
    if layer_types is None and arch in ("gemma2", "gemma3"):  # (transformers' default: every pattern-th layer global)
        pattern = 2 if arch == "gemma2" else int(cfg.get("sliding_window_pattern", 6))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if layer_types is None:
        first = cfg.get("max_window_layers")
        first = 28 if first is None else int(first)  # transformers' default
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise CheckpointError(path, f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise CheckpointError(path, f"layer type {shown(unknown[0])} is not supported (full_attention, "
                                    "sliding_attention)")
    windowed = tuple(t == "sliding_attention" for t in layer_types)
    if not any(windowed):
        return None, None
    return window, None if all(windowed) else windowed


def _windows(cfg: Mapping[str, Any], arch: str, num_layers: int, path) -> tuple[int | None, tuple[bool, ...] | None]:
    """sliding_window_from_hf's answer; fields of the wrong kind a CheckpointError naming them."""
    try:
        return sliding_window_from_hf(cfg, arch, num_layers, path)
    except (KeyError, TypeError, ValueError) as exc:  # (max_window_layers, layer_types of the wrong kind)
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(path, f"its sliding window fields are of the wrong kind: {cut(str(exc))}") from exc


def _family(cfg: Mapping[str, Any], arch: str, path) -> tuple[Mapping[str, Any], dict[str, Any]]:
    """(the language model's config, its family's fields of the shared forward): Gemma 2/3's
    (nanoinfer/loaders/hf_gemma.py: a multimodal Gemma 3's text_config, its flags), a mixture of experts' (Mixtral,
    Qwen3-MoE: nanoinfer/loaders/hf_moe.py); (cfg, {}) for the other families."""
    if arch in ("mixtral", "qwen3_moe"):
        from nanoinfer.loaders.hf_moe import moe_fields

        return cfg, moe_fields(cfg, arch, path)
    if arch not in ("gemma2", "gemma3"):
        return cfg, {}
    from nanoinfer.loaders import hf_gemma

    text = hf_gemma.text_config(cfg, path)
    return text, hf_gemma.gemma_fields(text, arch, path)


def _architecture(cfg: Mapping[str, Any], path) -> str:
    """Our family name for config.json's `architectures`; one we do not run a CheckpointError naming it."""
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list):
        raise CheckpointError(path, f"architectures is {shown(archs)}: expected a list of class names")
    arch = next((HF_ARCHITECTURES[a] for a in archs if isinstance(a, str) and a in HF_ARCHITECTURES), None)
    if arch is None and "Qwen2MoeForCausalLM" in archs:
        raise CheckpointError(path, f"architecture {shown(archs)} is not supported: Qwen2-MoE's shared expert "
                                    "(shared_expert, shared_expert_gate) is not in the mixture-of-experts layer "
                                    "(supported: Mixtral, Qwen3-MoE)")
    if arch is None:
        raise CheckpointError(path, f"architecture {shown(archs)} is not supported (expected one of "
                                    f"{sorted(HF_ARCHITECTURES)})")
    return arch


def config_from_hf(cfg: Mapping[str, Any], path) -> ModelConfig:
    """Build a ModelConfig from a parsed HF `config.json`; `path` is named in errors."""
    if not isinstance(cfg, Mapping):
        raise CheckpointError(path, f"config.json holds {json_kind(cfg)}, expected a JSON object")
    arch = _architecture(cfg, path)
    cfg, family = _family(cfg, arch, path)

    def whole(name: str, default: int | None = None) -> int:
        """A dimension of config.json; absent (or null), `default` when it has one."""
        value = cfg.get(name)
        if value is None and default is None:
            raise CheckpointError(path, f"config.json has no {name!r}")
        return default if value is None else dimension(name, value, path, MAX_DIMENSIONS.get(HF_DIMENSIONS[name]))

    hidden, num_heads = whole("hidden_size"), whole("num_attention_heads")
    num_kv_heads = whole("num_key_value_heads", num_heads)
    heads_share_kv_heads(path, "num_attention_heads", num_heads, "num_key_value_heads", num_kv_heads)
    if cfg.get("head_dim") is None and hidden % num_heads:
        raise CheckpointError(path, f"hidden_size {hidden} is not a multiple of num_attention_heads {num_heads}, "
                                    "and no head_dim says how wide a head is")
    rope_scaling, theta, partial = _rope_from_hf(cfg, path)
    eps = cfg.get("rms_norm_eps")
    num_layers = whole("num_hidden_layers")
    window, windowed_layers = _windows(cfg, arch, num_layers, path)
    if cfg.get("mlp_bias") or (arch != "qwen2" and cfg.get("attention_bias")):
        raise CheckpointError(path, "attention_bias/mlp_bias on this architecture is not supported")
    return checkpoint_config(
        path,
        architecture=arch,
        vocab_size=whole("vocab_size"),
        hidden_size=hidden,
        intermediate_size=whole("intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=(head_dim := whole("head_dim", hidden // num_heads)),
        rotary_dim=_rotary_dim(partial, head_dim, path),
        rms_norm_eps=positive_number("rms_norm_eps", 1e-6 if eps is None else eps, path),
        rope_theta=positive_number("rope_theta", theta, path),
        max_position_embeddings=whole("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling=rope_scaling,
        qkv_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "gemma3", "qwen3_moe"),
        sliding_window=window,
        windowed_layers=windowed_layers,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_token_ids("eos_token_id", cfg.get("eos_token_id"), path),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        **family,
    )


def _weight_map(directory: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file holding it."""
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        raw = read_json_object(index, "a JSON object with a weight_map")
        mapping = raw.get("weight_map")
        if not isinstance(mapping, dict):
            raise CheckpointError(index, f"weight_map is {'missing' if mapping is None else json_kind(mapping)}, "
                                         "expected an object of tensor name -> shard file")
        for name, shard in mapping.items():
            # (a shard is a file of this directory: an index must not reach beyond it)
            if not isinstance(shard, str) or Path(shard).is_absolute() or ".." in Path(shard).parts:
                raise CheckpointError(index, f"weight_map gives {shown(name)} the shard {shown(shard)}: expected a "
                                             "file name inside the model's directory")
        files = {name: directory / shard for name, shard in mapping.items()}
        for shard in set(files.values()):
            if not shard.is_file():
                raise CheckpointError(shard, "shard named in model.safetensors.index.json is missing")
        return files
    if single.is_file():
        return {name: single for name in _open(single).keys()}
    found = sorted(p.name for p in directory.iterdir())
    raise CheckpointError(directory, f"no model.safetensors or model.safetensors.index.json (found: {found})")


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(path, f"truncated or corrupt safetensors file: {exc}") from exc


def has_fp8_weights(directory: Path) -> bool:
    files = _weight_map(directory)
    return PROBE in files and _open(files[PROBE]).get_slice(PROBE).get_dtype() == "F8_E4M3"


def _fused_part(read, name: str, cfg: ModelConfig):
    """`name`'s rows of the fused matrix that holds it (Phi-3's qkv_proj, gate_up_proj), or None."""
    for part, (fused, rows) in FUSED.items():
        if name.endswith(part):
            whole = read(name.removesuffix(part) + fused)
            if whole is None:
                return None
            start, stop = rows(cfg)
            return whole[start:stop]
    return None


def load_hf_params(directory: Path, cfg: ModelConfig, dtype: torch.dtype, device, progress: bool = True,
                   fp8: bool = True, int4: "Int4Format | None" = None, packed: bool = True,
                   layer_form=None) -> Params:
    """`fp8`: an FP8 checkpoint's matrices stay fp8. `int4`: the checkpoint's AWQ or GPTQ
    format (nanoinfer/loaders/int4.py), its matrices kept 4-bit where `packed`, else
    dequantized to `dtype`."""
    files = _weight_map(directory)
    handles = {}
    if int4 is not None and cfg.architecture == "phi3":
        raise CheckpointError(directory, "Phi-3's fused matrices in AWQ or GPTQ are not supported: expected a "
                                         "float16, bfloat16 or float32 checkpoint")

    def read(name: str):
        path = files.get(name)
        if path is None:
            return None
        if path not in handles:
            handles[path] = _open(path)
        try:
            return handles[path].get_tensor(name)
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(path, f"cannot read tensor {name!r} (truncated or corrupt?): {exc}") from exc

    def get(name: str):
        tensor = read(name)
        if tensor is None and cfg.architecture == "phi3":
            tensor = _fused_part(read, name, cfg)
            if tensor is not None and tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise CheckpointError(directory, f"Phi-3's fused matrices in {str(tensor.dtype).removeprefix('torch.')}"
                                                 " are not supported: expected float32, float16 or bfloat16")
        if tensor is not None and tensor.dtype not in WEIGHT_DTYPES:  # (int, bool or complex data: not weights)
            kinds = sorted(str(d).removeprefix("torch.") for d in WEIGHT_DTYPES)
            raise CheckpointError(files[name], f"tensor {name!r} holds {str(tensor.dtype).removeprefix('torch.')}, "
                                               f"expected one of {kinds}")
        if tensor is None and int4 is not None and name.endswith(".weight"):
            from nanoinfer.loaders.int4 import read_int4_matrix

            w = read_int4_matrix(int4, read, name.removesuffix(".weight"), directory)
            return w if w is None or packed else dequantize(w)
        if tensor is None or tensor.dtype != FP8:
            return tensor
        scale = read(name + "_scale")
        if scale is None:
            raise CheckpointError(files[name], f"fp8 tensor {name!r} has no {name + '_scale'!r} beside it")
        if scale.numel() not in (1, tensor.shape[0]):
            raise CheckpointError(files[name], f"{name + '_scale'!r} has shape {tuple(scale.shape)}: supported are "
                                               f"one scale per tensor or per row ({tensor.shape[0]}), not blocks")
        w = Fp8Weight(tensor, scale.float().reshape(-1).expand(tensor.shape[0]).contiguous())
        return w if fp8 else dequantize(w)

    return build_params(_family_tensors(get, cfg, files, directory), cfg, dtype, device, directory,
                        progress=progress, layer_form=layer_form)


def _family_tensors(get: Callable, cfg: ModelConfig, files: dict[str, Path], directory: Path) -> Callable:
    """`get` as the families whose tensors differ from the common layout need it (each imported only for them)."""
    if cfg.architecture in ("gemma2", "gemma3"):  # (norms as 1 + w; a multimodal directory's language model)
        from nanoinfer.loaders.hf_gemma import gemma_tensors

        get = gemma_tensors(get, files)
    if cfg.num_experts:  # (a sparse layer's experts stacked, as the layer holds them)
        from nanoinfer.loaders.hf_moe import expert_tensors

        get = expert_tensors(get, cfg.architecture, cfg.num_experts, directory)
    if cfg.rotary_dim is not None and cfg.rotary_dim < cfg.head_dim:  # (Phi-4-mini)
        from nanoinfer.loaders.partial_rotary import rotate_half_rows

        get = rotate_half_rows(get, cfg, directory)
    return get
