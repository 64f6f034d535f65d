"""Shared fixtures: the default model's GGUF (fetched once per machine) and torch settings."""

from pathlib import Path

import pytest
import torch

from nanoinfer.hub import DEFAULT_MODEL, resolve_model_name

torch.set_num_threads(max(1, torch.get_num_threads()))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF (the default model)."""
    return resolve_model_name(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tiny_chat_model(smollm2_gguf):
    """A tiny random model with the default model's tokenizer and chat template."""
    from tests.live_server import tiny_chat_model

    return tiny_chat_model(smollm2_gguf)


@pytest.fixture(scope="module")
def live_server(tiny_chat_model):
    """The server on 127.0.0.1 (random port) over the tiny chat model; `.url`, `.engine`."""
    from tests.live_server import LiveServer

    with LiveServer(tiny_chat_model) as server:
        yield server


@pytest.fixture(scope="module")
def poisoned_server(tiny_chat_model):
    """The live server over the tiny chat model with one token's embedding set to NaN (any
    prompt holding tests.test_faults.POISON makes non-finite logits)."""
    import dataclasses

    from tests.live_server import LiveServer
    from tests.test_faults import POISON

    embed = tiny_chat_model.params.embed.clone()
    embed[POISON] = float("nan")
    model = dataclasses.replace(tiny_chat_model, params=dataclasses.replace(tiny_chat_model.params, embed=embed))
    with LiveServer(model) as server:
        yield server


def pytest_addoption(parser):
    parser.addoption("--tensor-parallel-path", action="store_true",
                     help="run every engine's model through the tensor-parallel path at one rank (on a GPU: an "
                          "NCCL world of one, graphs capturing its collectives), as a one-GPU machine can")


@pytest.fixture(autouse=True)
def tensor_parallel_path(request, monkeypatch):
    """With --tensor-parallel-path, the engine takes the ranks' executor whatever the size; a
    test that failed before closing its engine leaves no process group to the next."""
    if not request.config.getoption("--tensor-parallel-path"):
        yield
        return
    import torch.distributed as dist

    from runtime.executor import make_executor as executor

    monkeypatch.setattr(executor, "uses_ranks", lambda config: True)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
