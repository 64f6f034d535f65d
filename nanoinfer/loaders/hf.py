"""Load a Hugging Face checkpoint directory: config.json + safetensors (single or sharded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from nanoinfer.config import ModelConfig, config_from_hf
from nanoinfer.errors import CheckpointError
from nanoinfer.loaders.params import build_params
from nanoinfer.model import Params


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


def load_hf_params(directory: Path, cfg: ModelConfig, dtype: torch.dtype, device, progress: bool = True) -> Params:
    files = _weight_map(directory)
    handles = {}

    def get(name: str):
        path = files.get(name)
        if path is None:
            return None
        if path not in handles:
            handles[path] = _open(path)
        try:
            return handles[path].get_tensor(name)
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(path, f"cannot read tensor {name!r} (truncated or corrupt?): {exc}") from exc

    return build_params(get, cfg, dtype, device, directory, progress=progress)
