"""Shared fixtures: the default model's GGUF (fetched once per machine) and torch settings."""

from pathlib import Path

import pytest
import torch

from nanoinfer.loaders.hub import DEFAULT_MODEL, resolve_model_name

torch.set_num_threads(max(1, torch.get_num_threads()))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF (the default model)."""
    return resolve_model_name(DEFAULT_MODEL)
