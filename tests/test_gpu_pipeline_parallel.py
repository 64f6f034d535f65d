"""Several GPUs (skipped with fewer than two): pipeline stages over NCCL, each replaying its CUDA
graphs per micro-batch size with the sends and receives between replays, emit the greedy
tokens of the same stages run eagerly and of one GPU, through chunked prefills and forks; with
two steps in flight (async scheduling, the default on CUDA: rank 0 samples on a side stream,
runtime/executor/sample_stream.py) and with one, and with rows reused under penalties while
the step before still samples into its rows."""

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA devices", allow_module_level=True)
pytest.importorskip("triton")

from pathlib import Path  # noqa: E402

from nanoinfer.loaders import LoadedModel  # noqa: E402
from nanoinfer.model.decoder import map_params  # noqa: E402
from nanoinfer.sampling.sampler import SamplingParams  # noqa: E402
from tests.test_tensor_parallel import engine_outputs  # noqa: E402
from tests.tiny import random_params, tiny_config  # noqa: E402

# Lengths 5 to 300 (over the step's 256 tokens: a chunked prefill), forks of two of them.
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate([5, 40, 130, 300, 17])]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2)
CONFIG = dict(block_size=16, num_blocks=256, max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def model():
    """fp32 (greedy tokens then agree across batch shapes and kernels), four layers: 2 + 2 stages."""
    cfg = tiny_config(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=64, max_position_embeddings=2048)
    return LoadedModel(cfg, map_params(lambda t: t.to("cuda:0"), random_params(cfg, seed=5)), None, Path("tiny"))


@pytest.fixture(scope="module")
def one_gpu(model):
    tokens, _ = engine_outputs(model, PROMPTS, GREEDY, **CONFIG)
    return tokens


@pytest.mark.parametrize("sizes", [
    dict(pipeline_parallel_size=2),
    dict(pipeline_parallel_size=2, pipeline_overlap=True),
    dict(pipeline_parallel_size=2, enforce_eager=True),
    dict(pipeline_parallel_size=2, pipeline_micro_batches=4),
    dict(pipeline_parallel_size=2, async_scheduling=False),
    pytest.param(dict(pipeline_parallel_size=2, tensor_parallel_size=2), marks=pytest.mark.skipif(
        torch.cuda.device_count() < 4, reason="needs 4 CUDA devices")),
], ids=["pp2-graphs", "pp2-graphs-two-steps-in-flight", "pp2-eager", "pp2-graphs-4-micro-batches",
        "pp2-graphs-one-step-in-flight", "tp2xpp2-eager-stages"])
def test_stages_emit_what_one_gpu_does(model, one_gpu, sizes, monkeypatch):
    """Rank 0 (the first stage) captures decode and mixed graphs of its activations per token
    where its stage has one rank and graphs are not turned off."""
    from runtime.executor import pipeline_parallel

    capture, captured = pipeline_parallel.capture_stage, []

    def recording(*args, **kwargs):
        captured.append(capture(*args, **kwargs))
        return captured[-1]

    monkeypatch.setattr(pipeline_parallel, "capture_stage", recording)
    tokens, stats = engine_outputs(model, PROMPTS, GREEDY, **CONFIG, **sizes)
    assert tokens == one_gpu
    assert stats["num_preemptions"] == 0
    eager = sizes.get("enforce_eager") or sizes.get("tensor_parallel_size", 1) > 1
    assert [bool(g.graphs and g.mixed and g.per_token and g.hidden is None) for g in captured] == \
        ([] if eager else [True])


def test_two_steps_in_flight_reuse_rows_under_penalties(model):
    """Many requests of different lengths through a batch of 4 rows: rows freed by a finished
    sequence are taken by a new one while the other group's step is in flight (the side stream
    must not write a stale token or penalty count into the new row), greedy over penalized
    logits, 2 micro-batches: one GPU's tokens."""
    prompts = [[(11 * i + j) % 250 + 3 for j in range(3 + 7 * i)] for i in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * (i % 4), ignore_eos=True, repetition_penalty=1.3,
                             presence_penalty=0.5, frequency_penalty=0.2) for i in range(len(prompts))]
    config = dict(CONFIG, max_num_seqs=4)
    runs = []
    for sizes in ({}, dict(pipeline_parallel_size=2, pipeline_overlap=True)):
        from runtime.async_engine import engine_config
        from runtime.engine.engine_core import EngineCore

        core = EngineCore(model, engine_config(**config, **sizes))
        try:
            assert core.steps_in_flight == (2 if sizes else 1)
            seqs = [core.add_request(p, sp) for p, sp in zip(prompts, params)]
            while core.has_unfinished():
                core.step()
            runs.append([seq.output_token_ids for seq in seqs])
        finally:
            core.close()
    assert runs[1] == runs[0]
