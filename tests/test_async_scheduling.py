"""Async scheduling (step N+1 launched before step N's tokens are read) changes no output.

The overlap logic is device-independent, so the CPU runs it too when asked: every request
kind — greedy and seeded sampling, stop tokens and EOS, logprobs and prompt logprobs, n > 1,
penalties, chunked prefill, preemption by recompute and by swap, aborts — must come out
token for token as in the synchronous loop, with every block freed and no placeholder left.
"""

from pathlib import Path

import pytest

from nanoinfer import SamplingParams
from nanoinfer.loaders import LoadedModel
from runtime.async_engine import engine_config
from runtime.engine.engine_core import EngineCore
from tests.tiny import random_params, tiny_config

CFG = tiny_config(vocab_size=64, hidden_size=48, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=12, eos_token_ids=(5,))
MODEL = LoadedModel(CFG, random_params(CFG, seed=7), None, Path("tiny-random"))


def requests():
    """(prompt, params): one of each kind, several times over with different prompts."""
    kinds = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30),  # ends at EOS (id 5) when the model picks it
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=15, seed=11),
        SamplingParams(temperature=0.7, top_k=8, max_tokens=10, stop_token_ids=(3, 9, 17), seed=2),
        SamplingParams(temperature=0, max_tokens=8, logprobs=3, prompt_logprobs=2, ignore_eos=True),
        SamplingParams(n=3, temperature=1.0, max_tokens=9, seed=5, ignore_eos=True),
        SamplingParams(temperature=0.9, max_tokens=14, repetition_penalty=1.3, presence_penalty=0.5, seed=4),
        SamplingParams(temperature=0, max_tokens=10, min_tokens=6, logit_bias=((7, 3.0),)),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
    ]
    out = []
    for i in range(27):
        prompt = [(i * 7 + j * 13) % CFG.vocab_size for j in range(3 + (i * 5) % 23)]
        out.append((prompt, kinds[i % len(kinds)]))
    return out


def run(async_scheduling, abort_after=None, **engine_args):
    """Every request's completions: (tokens, finish reason, logprobs, prompt logprobs) by
    (request, index); plus the core, to check what it left behind."""
    config = engine_config(block_size=4, async_scheduling=async_scheduling, **engine_args)
    core = EngineCore(MODEL, config)
    assert core.async_scheduling is async_scheduling
    seqs = {}
    for r, (prompt, params) in enumerate(requests()):
        seq = core.add_request(prompt, params, request=r)
        for s in (seq, *seq.forks):
            seqs[(r, s.index)] = s
    results = {key: [[], None, [], None] for key in seqs}
    steps = 0
    while core.has_unfinished():
        for out in core.step():
            res = results[(out.seq.request, out.seq.index)]
            assert res[1] is None, "a token after the finish"
            res[0].append(out.token_id)
            res[2].append(out.logprob)
            if out.prompt_logprobs is not None:
                res[3] = out.prompt_logprobs
            if out.finished:
                res[1] = out.seq.finish_reason
        steps += 1
        if abort_after is not None and steps == abort_after:
            for key in [k for k in seqs if k[0] % 4 == 1]:
                core.abort_request(seqs[key].request, "abort")
                results[key][1] = results[key][1] or "abort"
    for key, seq in seqs.items():
        assert seq.num_unresolved == 0
        assert seq.is_finished
        if results[key][1] != "abort":
            assert seq.output_token_ids == results[key][0]
    assert core.scheduler.blocks.num_free_blocks == core.scheduler.blocks.num_blocks
    assert core.scheduler.blocks.num_free_cpu_blocks == core.scheduler.blocks.host.size
    return {k: (tuple(v[0]), v[1], tuple(v[2]), v[3]) for k, v in results.items()}, core


def logprob_values(entries):
    """The numbers of a list of TokenLogprob (None for rows without), flattened."""
    values = []
    for e in entries or ():
        if e is not None:
            values += [e.logprob, *(v for _, v in e.top)]
    return values


def assert_same(got, want):
    """Tokens, finish reasons and logprob token ids exactly; logprob values to fp32 rounding
    (a batch of another shape may sum in another order)."""
    assert got.keys() == want.keys()
    for key in want:
        (tokens, reason, lps, plps), (w_tokens, w_reason, w_lps, w_plps) = got[key], want[key]
        assert (tokens, reason) == (w_tokens, w_reason), key
        for mine, theirs in ((lps, w_lps), (plps, w_plps)):
            strip = [None if e is None else (e.token_id, tuple(t for t, _ in e.top)) for e in theirs or ()]
            assert [None if e is None else (e.token_id, tuple(t for t, _ in e.top)) for e in mine or ()] == strip
            assert logprob_values(mine) == pytest.approx(logprob_values(theirs), abs=1e-5)


CASES = pytest.mark.parametrize("engine_args", [
    dict(num_blocks=512),
    dict(num_blocks=512, max_num_batched_tokens=5),  # chunked prefill, prompt logprobs over chunks
    dict(num_blocks=40, preemption_mode="recompute"),
    dict(num_blocks=40, preemption_mode="swap", swap_space=1 << 20),
    dict(num_blocks=512, max_num_seqs=3),
], ids=["roomy", "chunked", "recompute", "swap", "few-seqs"])


@CASES
def test_async_equals_sync(engine_args):
    sync, _ = run(False, **engine_args)
    overlapped, core = run(True, **engine_args)
    assert_same(overlapped, sync)
    reasons = {v[1] for v in sync.values()}
    assert {"length", "stop"} <= reasons, "the workload must end requests both ways"
    if engine_args["num_blocks"] == 40:
        assert core.scheduler.num_preemptions > 0


def test_aborts_while_a_step_is_in_flight():
    sync, _ = run(False, abort_after=3, num_blocks=512)
    overlapped, _ = run(True, abort_after=3, num_blocks=512)
    aborted = [k for k in sync if k[0] % 4 == 1]
    assert sum(sync[k][1] == overlapped[k][1] == "abort" for k in aborted) >= 4
    # Under overlap an abort lands one step later in what the caller has seen (a token was in
    # flight), so a request may show one token fewer, or finish before the abort: what both
    # showed agrees, and nothing else changed.
    for k in aborted:
        shown = min(len(sync[k][0]), len(overlapped[k][0]))
        assert overlapped[k][0][:shown] == sync[k][0][:shown]
        assert len(sync[k][0]) - len(overlapped[k][0]) in (-1, 0, 1)
    assert_same({k: v for k, v in overlapped.items() if k not in aborted},
                {k: v for k, v in sync.items() if k not in aborted})


def test_outputs_lag_one_step_and_the_next_input_comes_from_the_device():
    core = EngineCore(MODEL, engine_config(block_size=4, num_blocks=64, async_scheduling=True))
    seq = core.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert core.step() == []  # the prefill is launched; its token is still "on the device"
    assert seq.num_unresolved == 1 and seq.token_ids == [1, 2, 3]  # the host never holds a fake token
    first = core.step()  # launches decode 1 with that token as input, then reads it
    assert [o.token_id for o in first] == [seq.token_ids[3]] and seq.num_unresolved == 1
    core.step()
    assert core.has_unfinished()  # the last token is in flight; nothing left to compute
    assert core.scheduler.plan(core.step_count).chunks == ()
    last = core.step()
    assert last[0].finished and seq.finish_reason == "length" and not core.has_unfinished()
    assert len(seq.output_token_ids) == 3 and seq.num_unresolved == 0


def test_bad_async_scheduling_value_is_named():
    from nanoinfer.errors import RequestError

    with pytest.raises(RequestError, match="async_scheduling='yes'"):
        engine_config(async_scheduling="yes")
