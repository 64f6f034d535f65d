"""Sampler v1: greedy, temperature, top-k, top-p, min-p and seeds, vectorized over rows."""

import dataclasses
import math
import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

from nanoinfer.errors import RequestError
from nanoinfer.sampling.draw import apply_top_k_top_p, exponential_race, uniform_noise, uniform_noise_from_bits
from nanoinfer.sampling.sampler import SamplingParams, SamplingTensors, greedy_and_finite, sample

V = 12
PROBS = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.08, 0.06, 0.04, 0.03, 0.02, 0.01, 0.007, 0.003])
LOGITS = PROBS.log()


def draws(params: SamplingParams, n: int = 20000, logits=LOGITS) -> torch.Tensor:
    """Frequencies of n draws: one row per draw, the step counter giving fresh noise."""
    st_ = SamplingTensors.build([params] * n, range(n), V, "cpu")
    return torch.bincount(sample(logits.expand(n, V).contiguous(), st_), minlength=V).float() / n


def expected(keep: torch.Tensor, probs=PROBS) -> torch.Tensor:
    p = probs * keep
    return p / p.sum()


def assert_close_freq(freq, exp, n=20000):
    # 5 sigma of a binomial proportion per token; zero-probability tokens must never appear.
    tol = 5 * torch.sqrt(exp * (1 - exp) / n) + 1e-9
    assert torch.all((freq - exp).abs() <= tol), (freq, exp)
    assert torch.all(freq[exp == 0] == 0)


def test_greedy_is_argmax_for_every_row():
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    st_ = SamplingTensors.build([SamplingParams(temperature=0)] * 64, [0] * 64, 1000, "cpu")
    assert torch.equal(sample(logits, st_), logits.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_and_finite_on_the_models_dtype_equals_argmax_of_the_float_copy(dtype):
    """The graph's greedy head reads the logits as the LM head left them: same tokens as the
    argmax of their fp32 copy (ties included: bf16 rows repeat values), and a row with any
    NaN or inf is flagged, whatever else it holds."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 3000, generator=g) * 4).to(dtype)
    logits[1, 7] = logits[1].max()  # a tie: the first index wins, as on the float copy
    logits[2, 10], logits[3, 2999], logits[4, 0] = float("nan"), float("inf"), float("-inf")
    tokens, finite = greedy_and_finite(logits)
    ok = torch.tensor([True, True, False, False, False, True])
    assert torch.equal(tokens[ok], logits.float().argmax(dim=-1)[ok])
    assert torch.equal(finite, ok) and tokens.dtype == torch.int64


def test_temperature_one_follows_the_distribution():
    assert_close_freq(draws(SamplingParams(temperature=1.0, seed=1)), PROBS)


def test_temperature_sharpens():
    t = 0.5
    exp = PROBS ** (1 / t)
    assert_close_freq(draws(SamplingParams(temperature=t, seed=2)), exp / exp.sum())


def test_top_k():
    keep = torch.zeros(V)
    keep[:3] = 1
    assert_close_freq(draws(SamplingParams(top_k=3, seed=3)), expected(keep))


def test_top_p_keeps_the_smallest_set_reaching_p():
    # 0.30 + 0.20 + 0.15 = 0.65 >= 0.6: three tokens survive.
    keep = torch.zeros(V)
    keep[:3] = 1
    assert_close_freq(draws(SamplingParams(top_p=0.6, seed=4)), expected(keep))


def test_min_p_is_relative_to_the_top_token():
    keep = (PROBS >= 0.25 * PROBS.max()).float()  # 0.075 and above: five tokens
    assert keep.sum() == 5
    assert_close_freq(draws(SamplingParams(min_p=0.25, seed=5)), expected(keep))


def test_top_k_then_top_p_renormalized():
    # top-k 4 renormalizes to .3/.75, .2/.75, .15/.75, .1/.75; top-p .6 then keeps 2 (.4 + .267 >= .6).
    keep = torch.zeros(V)
    keep[:2] = 1
    assert_close_freq(draws(SamplingParams(top_k=4, top_p=0.6, seed=6)), expected(keep))


def test_mixed_rows_in_one_batch_follow_their_own_params():
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1, seed=9), SamplingParams(top_k=2, seed=9)]
    logits = LOGITS.expand(3, V).contiguous()
    counts = torch.zeros(3, V)
    for step in range(400):
        tokens = sample(logits, SamplingTensors.build(params, [step] * 3, V, "cpu"))
        counts[torch.arange(3), tokens] += 1
    assert counts[0, 0] == 400 and counts[1, 0] == 400
    assert counts[2, :2].sum() == 400 and counts[2, 1] > 100


def test_a_step_without_greedy_rows_is_the_draw_alone_and_computes_no_argmax(monkeypatch):
    import nanoinfer.sampling.sampler as sampling
    from nanoinfer.sampling.draw import processed_probs, random_draw

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3))
    sampled = [SamplingParams(temperature=0.7, seed=s) for s in range(6)]
    st_ = SamplingTensors.build(sampled, range(6), 300, "cpu")
    assert not st_.any_greedy and not st_.all_greedy
    reference = random_draw(processed_probs(logits, st_), st_.seeds, st_.steps)

    def no_argmax(_):
        raise AssertionError("a step of sampled rows computed an argmax")

    monkeypatch.setattr(sampling, "greedy_tokens", no_argmax)
    assert sample(logits, st_).tolist() == reference.tolist()
    monkeypatch.undo()
    mixed = SamplingTensors.build([SamplingParams(temperature=0)] + sampled[1:], range(6), 300, "cpu")
    assert mixed.any_greedy
    tokens = sample(logits, mixed)
    assert tokens[0] == logits[0].argmax() and tokens[1:].tolist() == reference[1:].tolist()


def test_seed_decides_the_draw_whatever_the_batch():
    logits = torch.randn(40, 500, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s) for s in range(40)]
    steps = list(range(40))
    together = sample(logits, SamplingTensors.build(params, steps, 500, "cpu"))
    alone = [sample(logits[i : i + 1], SamplingTensors.build(params[i : i + 1], steps[i : i + 1], 500, "cpu")).item()
             for i in range(40)]
    assert together.tolist() == alone
    shuffled = torch.randperm(40, generator=torch.Generator().manual_seed(2))
    again = sample(logits[shuffled], SamplingTensors.build([params[i] for i in shuffled], [steps[i] for i in shuffled],
                                                            500, "cpu"))
    assert again.tolist() == together[shuffled].tolist()


def test_different_seeds_differ_and_noise_is_uniform():
    u = uniform_noise(torch.tensor([1, 2]), torch.tensor([0, 0]), 100_000)
    assert not torch.equal(u[0], u[1])
    assert 0 < u.min() and u.max() < 1
    for row in u:  # mean 1/2 and variance 1/12 within a few standard errors
        assert abs(row.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / 100_000)
        assert abs(row.var().item() - 1 / 12) < 0.002


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=2, max_size=30), st.integers(1, 40), st.floats(0.01, 1.0))
def test_top_k_top_p_mask_matches_a_per_row_reference(values, k, p):
    logits = torch.tensor([values])
    masked = apply_top_k_top_p(logits, torch.tensor([k]), torch.tensor([p]))[0]
    # Reference: walk the tokens in order of probability, keep while rank < k and the mass
    # of the tokens already kept is below p (after renormalizing over the top-k).
    order = sorted(range(len(values)), key=lambda i: -values[i])
    top = order[:k]
    probs = torch.tensor([values[i] for i in top]).softmax(0).tolist()
    kept, mass = set(), 0.0
    for i, pr in zip(top, probs):
        if mass >= p - 1e-6 and kept:
            break
        kept.add(i)
        mass += pr
    finite = {i for i in range(len(values)) if math.isfinite(masked[i].item())}
    # Ties at the boundary may legitimately resolve either way; compare the decided tokens.
    boundary = {i for i in range(len(values)) if any(abs(values[i] - values[j]) < 1e-6 for j in kept ^ finite)}
    assert finite - boundary == kept - boundary
    for i in finite:
        assert masked[i].item() == values[i] or abs(masked[i].item() - values[i]) < 1e-6


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
                                         ("min_p", 2.0), ("max_tokens", 0), ("n", 0), ("stop", [""]),
                                         ("presence_penalty", 3.0), ("repetition_penalty", 0.0), ("logprobs", 21),
                                         ("logit_bias", {5: 200.0}), ("min_tokens", -1)])
def test_bad_params_name_the_field(field, value):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value})


# 100 seeds x 1000 steps x 32 tokens: the grid holds (seed 44, step 450, token 26), whose hash
# lands in the top 2**-24 bucket, the one that used to round to u = 1.0 (E = -log u = 0).
GRID_SEEDS, GRID_STEPS, GRID_V = 100, 1000, 32


def grid_rows(params_cycle):
    n = GRID_SEEDS * GRID_STEPS
    params = [dataclasses.replace(params_cycle[i % len(params_cycle)], seed=i // GRID_STEPS) for i in range(n)]
    logits = torch.randn(n, GRID_V, generator=torch.Generator().manual_seed(0)) * 2
    return params, [i % GRID_STEPS for i in range(n)], logits


def test_the_grid_holds_a_top_bucket_hash():
    u = uniform_noise(torch.tensor([44]), torch.tensor([450]), GRID_V)
    assert u[0, 26] == u.max() and u.max() > 1 - 2**-23  # the largest uniform the sampler can draw


def test_noise_is_strictly_inside_the_unit_interval_in_float32():
    # Every hash value, from 0 to 2**32 - 1, must map strictly inside (0, 1) after rounding.
    bits = torch.cat([torch.arange(0, 1 << 12), torch.arange((1 << 32) - (1 << 12), 1 << 32)])
    u = uniform_noise_from_bits(bits)
    assert u.dtype == torch.float32 and 0 < u.min() and u.max() < 1
    assert torch.isfinite(-torch.log(u)).all() and (-torch.log(u) > 0).all()


@pytest.mark.slow
def test_top_k_one_is_greedy_over_100k_draws():
    params, steps, logits = grid_rows([SamplingParams(temperature=1.0, top_k=1)])
    tokens = sample(logits, SamplingTensors.build(params, steps, GRID_V, "cpu"))
    assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.slow
def test_no_draw_falls_outside_the_kept_set():
    # Row kinds cycle: top-k 3, top-p 0.5, min-p 0.3, tokens 0..15 banned (min_tokens).
    kinds = [SamplingParams(top_k=3), SamplingParams(top_p=0.5), SamplingParams(min_p=0.3),
             SamplingParams(min_tokens=1, stop_token_ids=tuple(range(16)))]
    params, steps, logits = grid_rows(kinds)
    st_ = SamplingTensors.build(params, steps, GRID_V, "cpu", outputs=[()] * len(params))
    tokens = sample(logits, st_)
    probs = logits.softmax(-1)
    order = probs.argsort(-1, descending=True)
    rank = order.argsort(-1)
    mass_before = probs.gather(1, order).cumsum(-1).gather(1, rank) - probs
    kept = torch.stack([rank < 3, mass_before < 0.5, probs >= 0.3 * probs.max(-1, keepdim=True).values,
                        torch.arange(GRID_V)[None, :].expand_as(probs) >= 16])  # [kinds, rows, vocab]
    kind = torch.arange(len(params)) % 4
    kept = kept[kind, torch.arange(len(params))]
    assert kept[torch.arange(len(params)), tokens].all()


def test_a_masked_token_never_wins_the_race_whatever_the_noise():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 1.0, 0.0, 0.0], [0.2, 0.0, 0.8, 0.0]])
    for bad in (0.0, -0.0, float("nan"), float("inf"), -1.0):
        exponential = torch.ones_like(probs).masked_fill(probs == 0, bad)
        tokens = exponential_race(probs, exponential)
        assert (probs[torch.arange(3), tokens] > 0).all(), bad


def test_top_p_one_filters_nothing_beside_top_k():
    # A long tail: the fp32 cumsum of the sorted probabilities reaches 1 well before rank K,
    # and `mass_before >= 1.0` would trim the rest of the top-k.
    logits = torch.cat([torch.tensor([12.0]), torch.linspace(0, -8, 4095)])[None, :]
    for k in (100, 1000, 4000):
        masked = apply_top_k_top_p(logits, torch.tensor([k]), torch.tensor([1.0]))
        assert torch.isfinite(masked).sum() == k


@pytest.mark.parametrize("field,value,expected", [
    ("top_p", 1e-50, r"\(0, 1\]"),  # 0 in float32, the sampler's precision
    ("top_p", float("nan"), r"\(0, 1\]"),
    ("repetition_penalty", 1e-50, r"\[0.01, 100\]"),  # 0 in float32: logits / 0
    ("repetition_penalty", 1e-40, r"\[0.01, 100\]"),  # subnormal in float32: logits / r overflows
    ("repetition_penalty", float("inf"), r"\[0.01, 100\]"),
    ("repetition_penalty", 1e39, r"\[0.01, 100\]"),  # finite in float64, inf in float32
    ("temperature", float("inf"), ">= 0"),
    ("temperature", 1e39, ">= 0"),
    ("temperature", float("nan"), ">= 0"),
    ("min_p", float("nan"), r"\[0, 1\]"),
    ("presence_penalty", float("nan"), r"\[-2, 2\]"),
    ("frequency_penalty", float("-inf"), r"\[-2, 2\]"),
])
def test_values_the_sampler_cannot_represent_are_rejected(field, value, expected):
    message = rf"{field}={re.escape(repr(value))} is invalid: expected .*{expected}"
    with pytest.raises(RequestError, match=message) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_float32_range_helper():
    from nanoinfer.settings import float32_in

    assert float32_in(0.5, 0, 1, low_open=True) and float32_in(1, 0, 1) and float32_in(-2.0, -2, 2)
    assert not float32_in(1e-50, 0, 1, low_open=True) and float32_in(1e-40, 0, 1, low_open=True)  # subnormal
    assert not float32_in(3.5e38) and float32_in(3.4e38) and not float32_in(10**400)
    assert not float32_in(float("nan")) and not float32_in(True) and not float32_in("1")


def test_logprobs_in_slices_equal_logprobs_at_once():
    from nanoinfer.sampling.sampler import compute_logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 500, generator=g) * 3
    tokens = torch.randint(0, 500, (37,), generator=g)
    whole = compute_logprobs(logits, tokens, 4)
    sliced = compute_logprobs(logits, tokens, 4, max_bytes=5 * 500 * 4)  # 5 rows at a time
    for a, b in zip(whole, sliced):
        assert torch.equal(a, b)
    assert sliced.top_ids.shape == (37, 4)
