"""load_model: a short name, an HF directory or a .gguf path -> config, params, tokenizer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from nanoinfer.config import ModelConfig
from nanoinfer.errors import CheckpointError, RequestError
from nanoinfer.loaders.dummy import dummy_params
from nanoinfer.loaders.hub import DEFAULT_MODEL, KNOWN_MODELS, resolve_model_name
from nanoinfer.model import Params
from nanoinfer.placement import resolve_device, resolve_dtype

if TYPE_CHECKING:
    from nanoinfer.tokenizer import Tokenizer


LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    params: Params
    tokenizer: "Tokenizer | None"  # None when an HF directory ships no tokenizer files
    path: Path
    name: str | None = None  # how users named it, when that was a short name

    @property
    def model_id(self) -> str:
        """What a server calls it: the short name, else the directory's name or the file's
        without .gguf (never a path: that would tell every client where the weights live)."""
        name = self.path.name
        return self.name or (name[:-len(".gguf")] if name.endswith(".gguf") else name)


def load_model(
    model: str | Path | None = None,
    *,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    progress: bool = True,
    load_format: str = "auto",
) -> LoadedModel:
    """Load `model` (None = the default model) onto `device` in `dtype`. `load_format`
    "dummy" reads the config and tokenizer only and makes random weights (vLLM's option).

    Raises CheckpointError naming the file for anything wrong with the checkpoint."""
    from nanoinfer.loaders.gguf import gguf_config, load_gguf_params, open_gguf
    from nanoinfer.loaders.hf import load_hf_params, read_hf_config
    from nanoinfer.tokenizer import Tokenizer

    if load_format not in LOAD_FORMATS:
        raise RequestError(f"load_format={load_format!r} is invalid: expected one of {list(LOAD_FORMATS)}",
                           param="load_format")
    dummy = load_format == "dummy"
    name = DEFAULT_MODEL if model is None else str(model)
    path = resolve_model_name(name, quiet=not progress) if name in KNOWN_MODELS else Path(name).expanduser()
    dev = resolve_device(device)
    if path.is_dir():
        cfg = read_hf_config(path)
        torch_dtype = resolve_dtype(dtype, cfg, dev)
        params = dummy_params(cfg, torch_dtype, dev) if dummy else load_hf_params(path, cfg, torch_dtype, dev,
                                                                                progress=progress)
        tokenizer = Tokenizer.from_hf_dir(path)
    elif path.suffix == ".gguf" or path.is_file():
        reader = open_gguf(path)
        cfg = gguf_config(reader, path)
        torch_dtype = resolve_dtype(dtype, cfg, dev)
        params = dummy_params(cfg, torch_dtype, dev) if dummy else load_gguf_params(reader, cfg, torch_dtype, dev,
                                                                                  path, progress=progress)
        tokenizer = Tokenizer.from_gguf(reader, path)
    else:
        raise CheckpointError(
            path, f"not found: expected a known model name {sorted(KNOWN_MODELS)}, a Hugging Face "
                  "model directory or a .gguf file"
        )
    if tokenizer is not None:
        # Generation ends at any EOS either side declares (chat models often end turns with a
        # token the config names but the tokenizer does not, or the other way round).
        eos = tuple(dict.fromkeys(cfg.eos_token_ids + tokenizer.eos_token_ids))
        cfg = dataclasses.replace(cfg, eos_token_ids=eos)
    return LoadedModel(cfg, params, tokenizer, path, name if name in KNOWN_MODELS else None)
