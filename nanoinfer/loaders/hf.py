"""Load a Hugging Face checkpoint directory: config.json + safetensors (single or sharded).

FP8 checkpoints in the common form (an e4m3 `weight` with a `weight_scale` beside it, one
scale per tensor or per output row: llm-compressor, fbgemm_fp8, vLLM's own) load as
`Fp8Weight`s, or dequantized to the model's dtype when `fp8` is off."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from nanoinfer.config import ModelConfig, config_from_hf
from nanoinfer.errors import CheckpointError
from nanoinfer.loaders.params import build_params
from nanoinfer.model import Params
from nanoinfer.quantized import FP8, Fp8Weight, dequantize

PROBE = "model.layers.0.self_attn.q_proj.weight"  # its type tells whether a checkpoint is FP8


def read_hf_config(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(path, "config.json is missing: not a Hugging Face model directory")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, f"config.json is not valid JSON: {exc}") from exc
    return config_from_hf(raw, path)


def _weight_map(directory: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file holding it."""
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            mapping = json.loads(index.read_text())["weight_map"]
        except (OSError, KeyError, json.JSONDecodeError) as exc:
            raise CheckpointError(index, f"not a valid safetensors index: {exc!r}") from exc
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


def load_hf_params(directory: Path, cfg: ModelConfig, dtype: torch.dtype, device, progress: bool = True,
                   fp8: bool = True) -> Params:
    files = _weight_map(directory)
    handles = {}

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

    return build_params(get, cfg, dtype, device, directory, progress=progress)
