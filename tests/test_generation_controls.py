"""Generation controls: each logit processor against a per-row Python reference, sampling
statistics (chi-square), seeds independent of batch-mates, n > 1 sharing one prefill,
logprobs and prompt logprobs against transformers."""

import asyncio
import math
from pathlib import Path

import pytest
import torch
import transformers
from hypothesis import given, settings, strategies as st

from nanoinfer import AsyncEngine, SamplingParams
from nanoinfer.loaders import LoadedModel
from nanoinfer.loaders.hf import load_hf_params, read_hf_config
from nanoinfer.sampling.penalties import Penalties, apply_penalties
from nanoinfer.sampling.sampler import SamplingTensors, sample
from runtime.async_engine import engine_config
from runtime.engine.engine_core import EngineConfig, EngineCore
from tests.tiny import patch_forward, random_params, tiny_config

V = 16


@st.composite
def penalty_rows(draw):
    rows = draw(st.integers(1, 4))
    out = []
    for _ in range(rows):
        params = SamplingParams(
            presence_penalty=draw(st.sampled_from([0.0, 0.5, -1.0, 2.0])),
            frequency_penalty=draw(st.sampled_from([0.0, 0.3, -0.7])),
            repetition_penalty=draw(st.sampled_from([1.0, 1.3, 0.8])),
            logit_bias={t: draw(st.floats(-100, 100)) for t in draw(st.sets(st.integers(0, V - 1), max_size=3))},
            min_tokens=draw(st.integers(0, 5)), max_tokens=10, stop_token_ids=draw(st.sets(st.integers(0, V - 1),
                                                                                            max_size=2)),
            ignore_eos=draw(st.booleans()))
        prompt = draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=8))
        output = draw(st.lists(st.integers(0, V - 1), max_size=8))
        logits = draw(st.lists(st.floats(-10, 10), min_size=V, max_size=V))
        out.append((params, prompt, output, logits))
    return out


def reference_row(params, prompt, output, logits, eos_ids):
    """The rules spelled out one token at a time."""
    logits = list(logits)
    if len(output) < params.min_tokens:
        for t in (*(() if params.ignore_eos else eos_ids), *params.stop_token_ids):
            logits[t] = -math.inf
    for t, b in params.logit_bias:
        logits[t] += b
    for t in set(prompt) | set(output):
        if params.repetition_penalty != 1:
            logits[t] = logits[t] / params.repetition_penalty if logits[t] > 0 else logits[t] * params.repetition_penalty
    for t in set(output):
        logits[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return logits


@settings(max_examples=200, deadline=None)
@given(penalty_rows())
def test_penalties_match_a_per_row_reference(rows):
    eos = (3,)
    params, prompts, outputs, logits = zip(*rows)
    pen = Penalties.build(params, prompts, outputs, V, eos, "cpu")
    if pen is None:
        assert not any(p.has_penalties for p in params)
        return
    got = apply_penalties(torch.tensor(logits, dtype=torch.float32), pen)
    for i, row in enumerate(rows):
        expected = torch.tensor(reference_row(*row, eos), dtype=torch.float32)
        torch.testing.assert_close(got[i], expected, atol=1e-4, rtol=1e-5)


def chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    keep = expected_probs > 0
    n = observed.sum()
    exp = expected_probs[keep] * n
    stat = ((observed[keep] - exp) ** 2 / exp).sum()
    dof = int(keep.sum()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2).item()


PROBS = torch.tensor([0.22, 0.18, 0.15, 0.12, 0.1, 0.08, 0.06, 0.04, 0.03, 0.02])
N = 20000


def draw(params):
    logits = PROBS.log().expand(N, len(PROBS)).contiguous()
    tokens = sample(logits, SamplingTensors.build([params] * N, range(N), len(PROBS), "cpu"))
    return torch.bincount(tokens, minlength=len(PROBS)).float()


def renormalized(keep):
    p = PROBS * keep
    return p / p.sum()


@pytest.mark.parametrize("name,params,expected", [
    ("temperature 0.7", SamplingParams(temperature=0.7, seed=1), (PROBS ** (1 / 0.7)) / (PROBS ** (1 / 0.7)).sum()),
    ("top-k 4", SamplingParams(top_k=4, seed=2), renormalized(torch.arange(10) < 4)),
    ("top-p 0.5", SamplingParams(top_p=0.5, seed=3), renormalized(torch.arange(10) < 3)),
    ("min-p 0.3", SamplingParams(min_p=0.3, seed=4), renormalized(PROBS >= 0.3 * 0.22)),
])
def test_draws_pass_a_chi_square_test(name, params, expected):
    observed = draw(params)
    assert observed[expected == 0].sum() == 0, "a masked token was drawn"
    assert chi_square_p_value(observed, expected) > 1e-3, (name, observed / N, expected)


def test_the_chi_square_test_can_fail():
    # Draws at temperature 1 tested against the temperature-0.7 distribution must be rejected.
    observed = draw(SamplingParams(temperature=1.0, seed=5))
    wrong = (PROBS ** (1 / 0.7)) / (PROBS ** (1 / 0.7)).sum()
    assert chi_square_p_value(observed, wrong) < 1e-6


CFG = tiny_config(vocab_size=128, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16)
TINY = LoadedModel(CFG, random_params(CFG, seed=11), None, Path("tiny"))


def test_seeded_request_alone_equals_inside_a_batch_of_16():
    target = [5, 9, 33, 2, 71]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=1234, ignore_eos=True,
                            presence_penalty=0.5, repetition_penalty=1.2)

    async def go():
        async with AsyncEngine(TINY, engine_config(block_size=16, num_blocks=512)) as eng:
            alone = await eng.generate(target, params)
        # Inside a batch of 16 unrelated requests, with other blocks and 3-token prefill chunks.
        async with AsyncEngine(TINY, engine_config(block_size=4, num_blocks=512, max_num_batched_tokens=3)) as eng:
            others = [eng.generate([i + 1] * (i + 2), SamplingParams(temperature=0.8, max_tokens=30, seed=i,
                                                                     ignore_eos=True)) for i in range(16)]
            together = await asyncio.gather(*others[:8], eng.generate(target, params), *others[8:])
            return alone, together[8]
    alone, together = asyncio.run(go())
    assert alone.token_ids == together.token_ids


def test_n4_shares_one_prefill(monkeypatch):
    prompt = list(range(1, 23))  # 22 tokens: 5 full blocks of 4 and a partial one
    core = EngineCore(TINY, EngineConfig(block_size=4, num_blocks=64))
    parent = core.add_request(prompt, SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=3, ignore_eos=True))
    forks = list(parent.forks)
    computed = []

    def counting_forward(batch, real):
        computed.append(batch.num_tokens)
        return real(batch)

    patch_forward(monkeypatch, counting_forward)
    core.step()
    tables = [s.block_table for s in (parent, *forks)]
    assert all(t[:5] == tables[0][:5] for t in tables)  # the prompt's full blocks, shared
    assert all(core.scheduler.blocks.ref_counts[b] == 4 for b in tables[0][:5])
    while core.has_unfinished():
        core.step()
    assert computed[0] == 22, "one prefill of the prompt, not four"
    assert sum(computed) == 22 + 4 * 5  # then each completion decodes its own tokens
    outs = [s.output_token_ids for s in (parent, *forks)]
    assert all(len(o) == 6 for o in outs) and len({tuple(o) for o in outs}) > 1
    assert core.scheduler.blocks.num_free_blocks == 64


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("hf-tiny")
    model.save_pretrained(path)
    cfg = read_hf_config(path)
    return model, LoadedModel(cfg, load_hf_params(path, cfg, torch.float32, "cpu", progress=False), None, path)


@pytest.mark.parametrize("chunk", [4, 1000])
def test_prompt_and_output_logprobs_match_transformers(hf_tiny, chunk):
    hf_model, ours = hf_tiny
    prompt = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    core = EngineCore(ours, EngineConfig(block_size=4, num_blocks=64,
                                         scheduler=engine_config(max_num_batched_tokens=chunk).scheduler))
    seq = core.add_request(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3,
                                                  prompt_logprobs=2))
    outputs = []
    while core.has_unfinished():
        outputs += core.step()
    prompt_lp = next(o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None)
    full = prompt + seq.output_token_ids
    with torch.no_grad():
        ref = hf_model(torch.tensor([full])).logits[0].float().log_softmax(-1)
    assert prompt_lp[0] is None and len(prompt_lp) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = prompt_lp[pos]
        assert entry.token_id == prompt[pos]
        assert abs(entry.logprob - ref[pos - 1, prompt[pos]].item()) <= 1e-4
        top = ref[pos - 1].topk(2)
        assert [t for t, _ in entry.top] == top.indices.tolist()
    for i, out in enumerate(outputs):
        pos = len(prompt) - 1 + i
        assert out.logprob.token_id == out.token_id == full[pos + 1]
        assert abs(out.logprob.logprob - ref[pos, out.token_id].item()) <= 1e-4
        assert out.logprob.top[0][0] == out.token_id  # greedy: the chosen token is the top one
