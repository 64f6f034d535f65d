"""Prefix caching through the engine: outputs with the cache equal outputs without it (greedy
tokens, fp32 logprobs within 1e-5) for requests sharing prefixes, under chunked prefill,
preemption by recompute and by swap, forks, prompts ending on a block boundary, complete hits,
multi-turn conversations and prompt logprobs; and what it reports."""

import random
from pathlib import Path

import pytest

from nanoinfer import SamplingParams
from nanoinfer.loaders import LoadedModel
from runtime.async_engine import engine_config
from runtime.engine.engine_core import EngineCore
from tests.tiny import random_params, tiny_config

CFG = tiny_config(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16)
MODEL = LoadedModel(CFG, random_params(CFG, seed=3), None, Path("tiny-random"))
BS = 4


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(CFG.vocab_size) for _ in range(n)]


SYSTEM = tokens(22, seed=1)  # five full blocks and two tokens
PROMPTS = [
    SYSTEM + tokens(5, seed=2),
    SYSTEM + tokens(5, seed=3),
    SYSTEM[:20],  # ends exactly on a block boundary, every block cached by then
    SYSTEM + tokens(5, seed=2),  # the same prompt again: a complete hit (its last token is computed)
    SYSTEM[:8] + tokens(13, seed=4),  # two blocks shared, then apart
    tokens(9, seed=5),  # nothing shared
]


def run(waves, params, caching, **engine_args):
    """Each wave's requests added together and run to the end before the next wave starts
    (later waves find the earlier ones' blocks evictable). Returns per request: tokens,
    logprobs, prompt logprobs, cached tokens; and the engine."""
    args = dict(block_size=BS, num_blocks=256, enable_prefix_caching=caching)
    args.update(engine_args)
    core = EngineCore(MODEL, engine_config(**args))
    results, logprobs = [], {}
    for wave in waves:
        seqs = []
        for prompt in wave:
            first = core.add_request(prompt, params)
            seqs += core.scheduler.requests[first.request]
        for _ in range(1000):  # (a sequence the scheduler never admits would loop forever)
            if not core.has_unfinished():
                break
            for out in core.step():
                if out.logprob is not None:
                    logprobs.setdefault(out.seq.seq_id, []).append(out.logprob)
        assert not core.has_unfinished()
        results += [(s.output_token_ids, s.num_cached_tokens, s, logprobs.get(s.seq_id)) for s in seqs]
    assert core.scheduler.blocks.num_free_blocks == core.scheduler.blocks.num_blocks  # nothing leaked; the cache only evictable
    return results, core


def assert_same_outputs(cached, plain):
    assert [r[0] for r in cached] == [r[0] for r in plain]
    for (_, _, a, log_a), (_, _, b, log_b) in zip(cached, plain):
        assert a.finish_reason == b.finish_reason
        for x, y in zip(log_a or [], log_b or [], strict=True):  # fp32 logprobs, top ones included
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) <= 1e-5
            assert [i for i, _ in x.top] == [i for i, _ in y.top]
            assert all(abs(u - v) <= 1e-5 for (_, u), (_, v) in zip(x.top, y.top))


def greedy(n=8, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_shared_prefixes_compute_once_and_change_nothing():
    waves = [PROMPTS[:2], PROMPTS[2:], PROMPTS]
    plain, _ = run(waves, greedy(logprobs=3), caching=False)
    cached, core = run(waves, greedy(logprobs=3), caching=True)
    assert_same_outputs(cached, plain)
    assert all(r[3] is not None and len(r[3]) == 8 for r in cached)
    hits = [r[1] for r in cached]
    # wave 1: nothing cached yet, but the second prompt shares the first's computed blocks only
    # once they are registered (the same step: no hit); wave 2 finds SYSTEM's five blocks
    assert hits[0] == 0
    assert hits[2] == 16, "a prompt ending on a block boundary recomputes its last block"
    assert hits[3] == 24, "a complete hit still computes the prompt's last token (its block recomputed)"
    assert hits[4] == 8 and hits[5] == 0
    assert all(h == 24 for h in hits[6:8]) and hits[8] == 16
    stats = core.stats()
    assert stats["prefix_cache_hits"] == sum(hits) and stats["prefix_cache_queries"] == sum(map(len, waves[0] + waves[1] + waves[2]))
    assert stats["cached_blocks"] > 0


@pytest.mark.parametrize("engine_args", [
    dict(max_num_batched_tokens=6),  # chunked prefill: a hit's remainder in chunks
    dict(num_blocks=14),  # preemption by recompute: re-admitted sequences find their own blocks
    dict(num_blocks=14, preemption_mode="swap", swap_space=1 << 20),
    dict(num_blocks=14, max_num_batched_tokens=5, async_scheduling=True),
], ids=["chunked", "recompute", "swap", "async-chunked-recompute"])
def test_outputs_equal_without_the_cache_under_pressure(engine_args):
    waves = [PROMPTS[:3], PROMPTS, PROMPTS[::-1]]
    plain, _ = run(waves, greedy(12), caching=False, **engine_args)
    cached, core = run(waves, greedy(12), caching=True, **engine_args)
    assert_same_outputs(cached, plain)
    assert core.stats()["prefix_cache_hits"] > 0
    if "num_blocks" in engine_args:
        assert core.scheduler.num_preemptions > 0


def test_forks_and_sampling_with_seeds_are_unchanged():
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, n=3, seed=7, ignore_eos=True)
    waves = [PROMPTS[:2], PROMPTS[:4]]
    plain, _ = run(waves, params, caching=False)
    cached, core = run(waves, params, caching=True)
    assert_same_outputs(cached, plain)
    assert core.stats()["prefix_cache_hits"] > 0


def test_a_conversation_reuses_its_history_and_its_replies():
    turn = SYSTEM + tokens(3, seed=9)
    plain_core = EngineCore(MODEL, engine_config(block_size=BS, num_blocks=256, enable_prefix_caching=False))
    cached_core = EngineCore(MODEL, engine_config(block_size=BS, num_blocks=256))
    histories = {}
    for core in (plain_core, cached_core):
        history, cached = list(turn), []
        for t in range(4):
            seq = core.add_request(history, greedy(6))
            while core.has_unfinished():
                core.step()
            cached.append(seq.num_cached_tokens)
            history = history + seq.output_token_ids + tokens(3, seed=10 + t)
        histories[core is cached_core] = (history, cached)
    assert histories[True][0] == histories[False][0]
    cached = histories[True][1]
    # each turn finds the previous turn's prompt and reply cached, less the reply's last
    # token (sampled, never fed back) and the partial block at the end
    assert cached[0] == 0 and all(c >= len(turn) - len(turn) % BS for c in cached[1:])
    assert cached[3] > cached[2] > cached[1]


def test_prompt_logprobs_are_all_computed_even_when_cached():
    want = greedy(4, prompt_logprobs=2)
    plain, _ = run([[PROMPTS[0]], [PROMPTS[0], PROMPTS[1]]], want, caching=False)
    cached, core = run([[PROMPTS[0]], [PROMPTS[0], PROMPTS[1]]], want, caching=True)
    for (_, hit, a, _), (_, _, b, _) in zip(cached, plain):
        assert hit == 0  # asking for prompt logprobs skips the cache
        assert len(a.prompt_logprobs) == len(a.prompt_token_ids)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) <= 1e-5
    assert_same_outputs(cached, plain)


@pytest.mark.parametrize("steps_before_abort", [1, 3])
def test_an_aborted_request_leaves_only_computed_blocks_in_the_cache(steps_before_abort):
    """Aborted mid-prefill (chunked) or mid-decode: what it registered is what it computed, so
    the requests after it read the same as without the cache."""
    outputs = []
    for caching in (False, True):
        core = EngineCore(MODEL, engine_config(block_size=BS, num_blocks=256, max_num_batched_tokens=6,
                                               enable_prefix_caching=caching))
        doomed = core.add_request(PROMPTS[0] + tokens(7, seed=11), greedy(20))
        for _ in range(steps_before_abort):
            core.step()
        core.abort_request(doomed.request)
        seqs = [core.add_request(p, greedy(8)) for p in PROMPTS]
        while core.has_unfinished():
            core.step()
        assert core.scheduler.blocks.num_free_blocks == core.scheduler.blocks.num_blocks
        outputs.append([s.output_token_ids for s in seqs])
        if caching:
            assert core.stats()["prefix_cache_hits"] > 0
    assert outputs[0] == outputs[1]
