"""Speculative decoding: greedy outputs equal decoding without it, token for token, wherever
speculation meets the rest of the engine; sampled tokens follow the target's distribution
(chi-square); seeded requests reproduce; rejected drafts give their KV slots back."""

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from nanoinfer import SamplingParams
from nanoinfer.errors import RequestError
from nanoinfer.loaders import LoadedModel
from nanoinfer.sampling.ngram import propose_ngram
from nanoinfer.sampling.sampler import SamplingTensors
from nanoinfer.sampling.rejection import draft_sample, target_distribution, verify
from runtime.async_engine import engine_config
from runtime.engine.engine_core import EngineCore
from tests.tiny import random_params, tiny_config

CFG = tiny_config(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16)
MODEL = LoadedModel(CFG, random_params(CFG, seed=3), None, Path("tiny-random"))
# (`adaptive` off: speculation on every step, whatever this machine's timings say)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}

_rng = random.Random(0)
# Prompts that repeat themselves (and a tiny random model's loops): n-gram lookup finds matches.
PROMPTS = [[_rng.randrange(64) for _ in range(_rng.randrange(3, 30))] * 2 for _ in range(6)]


def perturbed(params, scale: float, seed: int):
    """A draft close to the target: every weight matrix with noise of `scale` times its spread."""
    g = torch.Generator().manual_seed(seed)

    def walk(x):
        if isinstance(x, torch.Tensor):
            return x + scale * x.std() * torch.randn(x.shape, generator=g) if x.is_floating_point() and x.dim() > 1 else x
        if dataclasses.is_dataclass(x):
            return dataclasses.replace(x, **{f.name: walk(getattr(x, f.name)) for f in dataclasses.fields(x)})
        return tuple(walk(v) for v in x) if isinstance(x, tuple) else x

    return walk(params)


NEAR = LoadedModel(CFG, perturbed(MODEL.params, 0.15, seed=5), None, Path("tiny-near"))  # accepts some
OTHER = LoadedModel(CFG, random_params(CFG, seed=11), None, Path("tiny-other"))  # accepts next to nothing


def draft_config(k=4):
    return {"model": "in-memory", "num_speculative_tokens": k, "adaptive": False}


def run(spec, params, prompts=PROMPTS, draft=None, setup=lambda core: None, **engine_args):
    """Per request: output ids and logprobs; and the engine's stats (its pool checked empty).
    `setup(core)` is called before the first request."""
    args = dict(block_size=4, num_blocks=512, speculative_config=spec)
    args.update(engine_args)
    core = EngineCore(MODEL, engine_config(**args), draft_model=draft)
    setup(core)
    seqs, logprobs = [], {}
    for prompt in prompts:
        first = core.add_request(prompt, params)
        seqs += core.scheduler.requests[first.request]
    for _ in range(2000):
        if not core.has_unfinished():
            break
        for out in core.step():
            if out.logprob is not None:
                logprobs.setdefault(out.seq.seq_id, []).append(out.logprob)
        for seq in core.scheduler.running:  # rejected drafts' slots were given back: a table holds its computed tokens
            assert len(seq.block_table) == core.scheduler.blocks.blocks_for(seq.num_computed_tokens)
            assert seq.num_computed_tokens < seq.num_tokens
    assert not core.has_unfinished()
    assert core.scheduler.blocks.num_free_blocks == core.scheduler.blocks.num_blocks  # rejected drafts' blocks came back
    return [(s.output_token_ids, logprobs.get(s.seq_id)) for s in seqs], core.stats()


def assert_same(ref, out):
    assert [ids for ids, _ in out] == [ids for ids, _ in ref]
    for (_, a), (_, b) in zip(ref, out):
        assert (a is None) == (b is None)
        for x, y in zip(a or (), b or ()):
            assert x.token_id == y.token_id and [t for t, _ in x.top] == [t for t, _ in y.top]
            assert abs(x.logprob - y.logprob) < 1e-5
            assert np.allclose([v for _, v in x.top], [v for _, v in y.top], atol=1e-5)


def assert_speculated(stats):
    """Drafts were verified, some accepted and some rejected: both paths ran."""
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("params", [
    GREEDY,
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=0.4, presence_penalty=0.2,
                   repetition_penalty=1.15),
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logit_bias=((5, 3.0),)),
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=0, max_tokens=33, stop_token_ids=(7, 9), min_tokens=5),
], ids=["plain", "penalties", "logit-bias", "logprobs", "stop-ids-min-tokens"])
def test_ngram_greedy_equals_no_speculation(params):
    ref, _ = run(None, params)
    out, stats = run(NGRAM, params)
    assert_same(ref, out)
    assert_speculated(stats)


@pytest.mark.parametrize("engine_args", [
    dict(max_num_batched_tokens=7),  # chunked prefill; the budget cuts lookaheads short
    dict(num_blocks=40),  # preemption by recompute
    dict(num_blocks=40, preemption_mode="swap", swap_space=1 << 20),
    dict(enable_prefix_caching=False),
    dict(max_num_seqs=2),
], ids=["chunked", "recompute", "swap", "no-prefix-cache", "two-at-once"])
def test_ngram_greedy_equal_under_engine_pressure(engine_args):
    ref, _ = run(None, GREEDY, **engine_args)
    out, stats = run(NGRAM, GREEDY, **engine_args)
    assert_same(ref, out)
    assert_speculated(stats)


# -- a draft model -----------------------------------------------------------------------------


@pytest.mark.parametrize("engine_args", [
    dict(),
    dict(max_num_batched_tokens=7),
    dict(num_blocks=40),
    dict(num_blocks=40, preemption_mode="swap", swap_space=1 << 20),
], ids=["plain", "chunked", "recompute", "swap"])
def test_target_as_its_own_draft_accepts_everything(engine_args):
    """Only if the draft's own KV pool keeps up with every sequence (prefill chunks, catch-up
    after a full acceptance, recompute, swap, cached prefixes) does it propose the target's
    tokens every time."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref, _ = run(None, params, **engine_args)
    out, stats = run(draft_config(), params, draft=MODEL, **engine_args)
    assert_same(ref, out)
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 100
    sampled = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=3, n=2)
    _, stats = run(draft_config(), sampled, draft=MODEL, **engine_args)  # p = q: every draft passes
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 100


@pytest.mark.parametrize("draft", [NEAR, OTHER], ids=["near", "other"])
@pytest.mark.parametrize("params", [
    GREEDY,
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=0.4, presence_penalty=0.2,
                   logprobs=2),
    SamplingParams(temperature=0, max_tokens=23, stop_token_ids=(7, 9), min_tokens=3),
], ids=["plain", "penalties-logprobs", "stops"])
def test_draft_model_greedy_equals_no_speculation(draft, params):
    ref, _ = run(None, params)
    out, stats = run(draft_config(), params, draft=draft)
    assert_same(ref, out)
    assert stats["spec_draft_tokens"] > 0
    if draft is NEAR:
        assert_speculated(stats)


def test_draft_model_under_engine_pressure_and_sampling():
    for engine_args in (dict(max_num_batched_tokens=7), dict(num_blocks=40),
                        dict(num_blocks=40, preemption_mode="swap", swap_space=1 << 20)):
        ref, _ = run(None, GREEDY, **engine_args)
        out, stats = run(draft_config(3), GREEDY, draft=NEAR, **engine_args)
        assert_same(ref, out)
        assert_speculated(stats)
    params = SamplingParams(temperature=0.9, top_k=20, max_tokens=40, ignore_eos=True, seed=7, n=2)
    a, stats = run(draft_config(), params, draft=NEAR)
    b, _ = run(draft_config(), params, draft=NEAR)
    assert [ids for ids, _ in a] == [ids for ids, _ in b]
    assert_speculated(stats)


def prelaunching(drafts: list, on: bool = True, when: float | None = None):
    """A `run` setup: the catch-up queued behind each verification on or off (on the CPU too),
    optionally after every fully accepted step (`when` 0); the draft runners go to `drafts`."""
    def setup(core):
        core.executor.draft.prelaunches = on
        if when is not None:
            core.executor.draft.prelaunch_when = when
        drafts.append(core.executor.draft)
    return setup


LONGER = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)


@pytest.mark.parametrize("engine_args", [
    dict(block_size=16),  # (a catch-up is prelaunched where the bonus token's block is there already)
    dict(block_size=16, num_blocks=12),
    dict(block_size=16, num_blocks=12, preemption_mode="swap", swap_space=1 << 20),
    dict(block_size=16, max_num_seqs=2, max_num_batched_tokens=7),
], ids=["plain", "recompute", "swap", "chunked-two-at-once"])
def test_prelaunched_catch_up_is_used_while_everything_is_accepted(engine_args):
    """The target drafting for itself: after a step that accepted everything, the next one's
    catch-up is queued behind the verification and used (dropped only where the batch
    changed: a sequence finished, was preempted, or another one joined)."""
    drafts = []
    ref, _ = run(None, LONGER, prompts=PROMPTS[:2], **engine_args)
    out, stats = run(draft_config(), LONGER, prompts=PROMPTS[:2], draft=MODEL, setup=prelaunching(drafts),
                     **engine_args)
    assert_same(ref, out)
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 100
    assert drafts[0].num_prelaunched > 10 and drafts[0].num_prelaunches_used >= 0.75 * drafts[0].num_prelaunched


def test_prelaunched_catch_up_changes_no_token():
    """A draft accepted ~80% of the time, one sequence at a time, prelaunching after every
    fully accepted step: some of those passes are used, some dropped, and no token changes:
    greedy outputs equal decoding without speculation, seeded sampled ones (the first draft
    drawn at the next step's index) equal speculating without prelaunches."""
    close = LoadedModel(CFG, perturbed(MODEL.params, 0.03, seed=5), None, Path("tiny-close"))
    drafts = []
    ref, _ = run(None, LONGER, prompts=PROMPTS[:1], block_size=16)
    out, stats = run(draft_config(), LONGER, prompts=PROMPTS[:1], draft=close, setup=prelaunching(drafts, when=0),
                     block_size=16)
    assert_same(ref, out)
    assert_speculated(stats)
    sampled = SamplingParams(temperature=0.9, top_k=20, max_tokens=80, ignore_eos=True, seed=7)
    on, stats = run(draft_config(), sampled, prompts=PROMPTS[:1], draft=close, setup=prelaunching(drafts, when=0),
                    block_size=16)
    off, _ = run(draft_config(), sampled, prompts=PROMPTS[:1], draft=close, setup=prelaunching(drafts, False),
                 block_size=16)
    assert [ids for ids, _ in on] == [ids for ids, _ in off]
    assert_speculated(stats)
    for used in drafts[:2]:
        assert 0 < used.num_prelaunches_used < used.num_prelaunched
    assert drafts[2].num_prelaunched == 0


def test_draft_model_must_share_the_vocabulary():
    small = tiny_config(vocab_size=32, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                        num_kv_heads=2, head_dim=16)
    with pytest.raises(RequestError, match="vocabulary of 32 tokens"):
        EngineCore(MODEL, engine_config(speculative_config=draft_config()),
                   draft_model=LoadedModel(small, random_params(small), None, Path("small")))
    with pytest.raises(RequestError, match="does not ask for one"):
        EngineCore(MODEL, engine_config(speculative_config=NGRAM), draft_model=NEAR)


def test_policy_switches_speculation_off_while_it_is_slower():
    from runtime.engine.speculative import SpeculationPolicy

    policy = SpeculationPolicy(explore_every=4, window=4)
    choices = []
    for _ in range(40):
        speculate = policy.choose()
        choices.append(speculate)
        # Speculative steps: 1.2 tokens in 10 ms (drafts rejected); plain: 1 token in 5 ms.
        policy.record(speculate, 1.2 if speculate else 1, 0.010 if speculate else 0.005)
    assert choices[:2] == [True, False]  # both measured first
    # then only tries, every 4 x ceil(200 / 120) = 8 steps
    assert [i + 1 for i, c in enumerate(choices) if c][1:] == list(range(8, 41, 8))
    for _ in range(40):  # the draft starts agreeing: 4 tokens per 10 ms
        speculate = policy.choose()
        policy.record(speculate, 4 if speculate else 1, 0.010 if speculate else 0.005)
    assert [policy.choose() for _ in range(8)].count(True) == 7  # plain tried once in 4 x ceil(400 / 200)
    assert SpeculationPolicy(adaptive=False).choose() and SpeculationPolicy(adaptive=False).choose()


def test_adaptive_speculation_changes_no_token():
    """Whichever steps the policy speculates in (this machine's timings decide), with async
    scheduling between them, greedy tokens are those of decoding without speculation."""
    for spec in ({"method": "ngram", "num_speculative_tokens": 3}, {"model": "x", "num_speculative_tokens": 3}):
        for async_scheduling in (False, True):
            ref, _ = run(None, GREEDY)
            out, _ = run(spec, GREEDY, draft=NEAR if "model" in spec else None, async_scheduling=async_scheduling)
            assert_same(ref, out)


def test_max_tokens_mid_draft():
    """A draft is never longer than what the length limit leaves: every request ends at exactly max_tokens."""
    for max_tokens in (1, 2, 3, 5):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        ref, _ = run(None, params)
        out, _ = run(NGRAM, params)
        assert_same(ref, out)
        assert all(len(ids) == max_tokens for ids, _ in out)


def test_seeded_sampling_reproduces_and_forks():
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=40, ignore_eos=True, seed=7, n=3)
    a, stats = run(NGRAM, params)
    b, _ = run(NGRAM, params)
    # (The same engine settings: another token budget cuts other drafts short, and which
    # tokens were drafted changes which draws decide; each run's tokens still follow the target.)
    assert [ids for ids, _ in a] == [ids for ids, _ in b]
    assert len({tuple(ids) for ids, _ in a[:3]}) > 1  # the n completions differ
    assert_speculated(stats)


# -- n-gram lookup ----------------------------------------------------------------------------


@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 9, 1, 2, 3], 3, [9, 1, 2]),  # the 3-gram matched, what followed it proposed
    ([1, 2, 3, 9, 8, 1, 2, 3], 2, [9, 8]),
    ([5, 1, 2, 7, 1, 2], 4, [7, 1, 2]),  # fewer than k follow
    ([4, 2, 6, 3, 2, 7, 5, 2], 2, [7, 5]),  # the latest of several matches
    ([1, 2, 3, 4], 3, []),  # nothing recurs
    ([7], 3, []),
])
def test_propose_ngram(tokens, k, expected):
    assert propose_ngram(np.array(tokens, dtype=np.int64), k, 3, 1) == expected


def test_propose_ngram_prefers_the_longest_match():
    # The 1-gram [3] last occurred before 5; the 2-gram [2, 3] occurred before 8.
    tokens = np.array([2, 3, 8, 0, 3, 5, 1, 2, 3], dtype=np.int64)
    assert propose_ngram(tokens, 1, 2, 1) == [8]
    assert propose_ngram(tokens, 1, 1, 1) == [5]
    assert propose_ngram(tokens, 1, 4, 3) == []  # no 3-gram recurs


# -- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize("value, message", [
    ("{", "not valid JSON"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens=0"),
    ('{"method": "ngram"}', "num_speculative_tokens=None"),
    ('{"num_speculative_tokens": 2, "foo": 1}', "unknown key 'foo'"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs a 'model'"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method='eagle'"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min=5"),
    ("[4]", "expected a JSON object"),
])
def test_bad_speculative_config(value, message):
    with pytest.raises(RequestError, match="speculative_config") as info:
        engine_config(speculative_config=value)
    assert message in str(info.value)


def test_draft_quantization_is_checked():
    spec = {"model": "d", "num_speculative_tokens": 2}
    assert engine_config(speculative_config={**spec, "quantization": "int8"}).speculative_config.quantization == "int8"
    with pytest.raises(RequestError, match="quantization='int3' is invalid"):
        engine_config(speculative_config={**spec, "quantization": "int3"})
    with pytest.raises(RequestError, match="applies to a draft model, not to n-gram"):
        engine_config(speculative_config={"num_speculative_tokens": 2, "quantization": "int8"})


def test_speculative_config_defaults():
    config = engine_config(speculative_config='{"num_speculative_tokens": 3, "prompt_lookup_max": 5}').speculative_config
    assert (config.method, config.prompt_lookup_max, config.prompt_lookup_min) == ("ngram", 5, 1)
    assert engine_config(speculative_config={"model": "d", "num_speculative_tokens": 2}).speculative_config.method \
        == "draft_model"


# -- verification keeps the target distribution ------------------------------------------------

VOCAB = 8
CHI2_CRITICAL = 24.32  # chi-square, 7 degrees of freedom, p = 0.001 (the draws are seeded: no flakes)


def tensors(rows, temperature=1.0, top_k=0, seed0=0, steps=None):
    st = SamplingTensors.build([SamplingParams(temperature=temperature, top_k=top_k, seed=seed0 + i)
                                for i in range(rows)], steps if steps is not None else [0] * rows, VOCAB, "cpu")
    return st


def chi_square(counts, probs):
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0  # nothing outside the support
    expected = n * probs[keep]
    return float(((counts[keep] - expected) ** 2 / expected).sum())


@pytest.mark.slow
@pytest.mark.parametrize("top_k", [0, 5])
@pytest.mark.parametrize("proposal", ["draft-model", "point-mass", "bad-point-mass"])
def test_first_emitted_token_follows_the_target(proposal, top_k):
    """Sequences of one draft each: the first emitted token (accepted draft, or the residual's
    draw) is distributed as the target's p, whatever q proposed it."""
    n = 20000
    g = torch.Generator().manual_seed(0)
    target = torch.randn(VOCAB, generator=g) * 1.5
    draft = torch.randn(VOCAB, generator=g) * 1.5
    st_rows = tensors(2 * n, top_k=top_k, steps=[0, 1] * n)  # row 0: the draft's position; row 1: after it
    st_rows = st_rows._replace(seeds=torch.arange(n).repeat_interleave(2))
    p = target_distribution(target[None, :], tensors(1, top_k=top_k))[0]
    if proposal == "draft-model":
        q_logits = draft.expand(n, VOCAB)
        d, q = draft_sample(q_logits, tensors(n, seed0=0)._replace(seeds=torch.arange(n)))
        draft_probs = torch.stack([q, q], dim=1).reshape(2 * n, VOCAB)
    else:
        # A point mass on the target's likeliest token, or on one outside its top-k.
        token = int(target.argmax()) if proposal == "point-mass" else int(target.argmin())
        d, draft_probs = torch.full((n,), token), None
    drafts = torch.stack([d, torch.full((n,), -1)], dim=1).reshape(-1)
    v = verify(target.expand(2 * n, VOCAB).clone(), st_rows, drafts, draft_probs)
    first = v.tokens.reshape(n, 2)[:, 0]  # accepted: the draft; rejected: the residual's draw
    counts = torch.bincount(first, minlength=VOCAB).double()
    assert chi_square(counts.numpy(), p.double().numpy()) < CHI2_CRITICAL
    accepted = v.accepted.reshape(n, 2)
    assert not accepted[:, 1].any()  # the row after the last draft never accepts
    if proposal == "bad-point-mass" and top_k:
        assert not accepted[:, 0].any()  # a draft the target cannot emit is always rejected


def test_bonus_token_is_the_plain_samplers_draw():
    """A row without a draft draws exactly what the sampler draws at that (seed, step)."""
    from nanoinfer.sampling.sampler import sample

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(50, VOCAB, generator=g)
    st = tensors(50, temperature=0.7, steps=list(range(50)))
    v = verify(logits, st, torch.full((50,), -1))
    assert torch.equal(v.tokens, sample(logits, st))
    assert not v.accepted.any()


def test_greedy_rows_accept_exactly_the_argmax():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, VOCAB, generator=g)
    best = logits.argmax(dim=-1)
    drafts = torch.tensor([best[0], (best[1] + 1) % VOCAB, best[2], -1, best[4], (best[5] + 3) % VOCAB])
    v = verify(logits, tensors(6, temperature=0), drafts)
    assert v.accepted.tolist() == [True, False, True, False, True, False]
    assert torch.equal(v.tokens, best)


# -- the default model, the offline facade and the server ------------------------------------

COPY_PROMPTS = [
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "def add(a, b):\n    return a + b\n\n# the same function again:\ndef add(a, b):\n",
    "Names: Alice, Bob, Carol, Dave, Erin. The names again: Alice, Bob,",
]


@pytest.mark.slow
def test_default_model_greedy_equals_no_speculation(smollm2_gguf):
    """In fp32 (the exact path; the packed path is held to the same in
    tests/test_cpu_determinism.py), n-gram lookup and the model drafting for itself, through the
    offline facade; stop strings cut multi-token steps."""
    from nanoinfer import LLM

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = {}
    self_draft = {"model": str(smollm2_gguf), "num_speculative_tokens": 3, "adaptive": False}
    for name, spec in (("none", None), ("ngram", NGRAM), ("self", self_draft),
                       ("self-int8", {**self_draft, "quantization": "int8"})):
        with LLM(smollm2_gguf, device="cpu", progress=False, dtype="float32", num_blocks=128, block_size=8,
                 speculative_config=spec) as llm:
            outs = llm.generate(COPY_PROMPTS, params, use_tqdm=False)
            stop = outs[0].text[6:10]
            stopped = llm.generate(COPY_PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop=stop),
                                   use_tqdm=False)[0]
            runs[name] = ([o.token_ids for o in outs], stopped.text, llm.stats())
    assert runs["ngram"][:2] == runs["none"][:2] == runs["self"][:2] == runs["self-int8"][:2]
    stats = runs["ngram"][2]
    assert stats["spec_accepted_tokens"] > 5  # the copies were drafted and accepted
    assert runs["self"][2]["spec_accepted_tokens"] >= 0.9 * runs["self"][2]["spec_draft_tokens"] > 0
    # Its own weights in int8 (the packed CPU path) draft for the fp32 model: mostly agreeing.
    assert runs["self-int8"][2]["spec_accepted_tokens"] >= 0.5 * runs["self-int8"][2]["spec_draft_tokens"] > 0


def test_server_streams_speculated_tokens(tiny_chat_model):
    """Streamed chat through the server, with and without n-gram speculation: the same text
    (greedy), the counters in /metrics."""
    from openai import OpenAI

    from tests.live_server import LiveServer
    from tests.test_server import metric

    messages = [{"role": "user", "content": "one two three one two three one two three one two"}]
    texts = []
    for spec in (None, NGRAM):
        with LiveServer(tiny_chat_model, engine_kw={"speculative_config": spec}) as server:
            client = OpenAI(base_url=server.url + "/v1", api_key="none")
            stream = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=200,
                                                    temperature=0, stream=True)
            texts.append("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))
            drafted = metric(server.url, "nanoinfer_spec_decode_draft_tokens_total")
            accepted = metric(server.url, "nanoinfer_spec_decode_accepted_tokens_total")
    assert texts[0] == texts[1] and texts[0]
    assert drafted > 0 and 0 <= accepted <= drafted
