"""Where and in what precision a model runs: resolve device="auto" and dtype="auto"."""

from __future__ import annotations

import torch

from nanoinfer.config import ModelConfig
from nanoinfer.errors import RequestError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


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
