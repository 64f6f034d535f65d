"""Structured output through the engine: constrained greedy is the argmax of the masked logits
(against scripted logits), 50 generated schemas give outputs that parse and validate, and
async scheduling, n > 1, preemption and speculative verification change no constrained token;
a request whose grammar goes wrong fails alone; bad grammars are named at submit."""

import json
import random
import re
import time

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")

from nanoinfer import SamplingParams  # noqa: E402
from nanoinfer.errors import RequestError  # noqa: E402
from nanoinfer.sampling.sampler import greedy_and_finite  # noqa: E402
from nanoinfer.structured.bitmasks import allocate_bitmask, unpack_bitmask
from nanoinfer.structured.grammars import Grammars
from nanoinfer.structured.spec import GrammarSpec
from runtime.async_engine import engine_config  # noqa: E402
from runtime.engine.engine_core import EngineCore  # noqa: E402
from runtime.executor.model_runner import ForwardOutput  # noqa: E402
from tests.test_structured import random_schema  # noqa: E402
from tests.tiny import patch_forward  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def run(model, requests, stats=None, **engine_args):
    """Per sequence (requests in order, their n completions): (output ids, finish reason,
    error); the pool checked empty at the end; the engine's `stats` updated into the dict."""
    args = dict(block_size=16, num_blocks=512)
    args.update(engine_args)
    core = EngineCore(model, engine_config(**args))
    seqs = []
    for prompt, params in requests:
        first = core.add_request(prompt, params)
        seqs += core.scheduler.requests[first.request]
    for _ in range(5000):
        if not core.has_unfinished():
            break
        core.step()
    assert not core.has_unfinished()
    assert core.scheduler.blocks.num_free_blocks == core.scheduler.blocks.num_blocks
    if stats is not None:
        stats.update(core.stats())
    return [(s.output_token_ids, s.finish_reason, s.error) for s in seqs]


def prompts(model, n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(model.config.vocab_size) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def text(model, ids):
    return model.tokenizer.decode(ids)


def test_fifty_generated_schemas_give_valid_json(tiny_chat_model):
    """A random model (it knows no JSON) sampling at temperature 1 in one batch: whatever it
    draws, each output parses and validates against its schema, and ends itself."""
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(50)]
    reqs = [(p, SamplingParams(temperature=1.0, seed=i, max_tokens=400, structured_outputs={"json": s}))
            for i, (p, s) in enumerate(zip(prompts(tiny_chat_model, 50), schemas))]
    outs = run(tiny_chat_model, reqs)
    for (ids, reason, error), schema in zip(outs, schemas):
        assert reason == "stop" and error is None
        jsonschema.validate(json.loads(text(tiny_chat_model, ids)), schema)


def scripted(model):
    """A forward whose logits are a fixed function of each row's token and position (the
    model's own forward runs too, for its KV writes): a constrained greedy step is then
    checkable by hand."""
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    # (low rank: a [vocab, vocab] table would take 9 GB)
    token_in, token_out = torch.randn(vocab, 16, generator=g), torch.randn(16, vocab, generator=g)
    by_position = torch.randn(64, vocab, generator=g)

    def logits_of(token: int, position: int) -> torch.Tensor:
        return token_in[token] @ token_out + by_position[position % 64]

    def forward(batch, real):
        real(batch)
        rows = batch.logits_indices
        logits = token_in[batch.input_ids[rows]] @ token_out + by_position[batch.positions[rows] % 64]
        return ForwardOutput(logits, *greedy_and_finite(logits))

    return forward, logits_of


def masked_greedy(model, grammars, logits_of, prompt, spec, max_tokens):
    """Constrained greedy, step by step: the argmax of the logits among the tokens the grammar
    allows, until the grammar is complete."""
    constraint, ids = grammars.constraint(spec), list(prompt)
    bitmask = allocate_bitmask(1, model.config.vocab_size)
    out = []
    for _ in range(max_tokens):
        constraint.fill(bitmask, 0)
        logits = logits_of(ids[-1], len(ids) - 1)
        allowed = unpack_bitmask(bitmask, logits.shape[0])[0]
        token = int(torch.where(allowed, logits, float("-inf")).argmax())
        out.append(token)
        ids.append(token)
        assert constraint.consume(token)
        if token in model.config.eos_token_ids or constraint.finished:
            break
    return out


SPECS = [GrammarSpec("json_schema", PERSON), GrammarSpec("choice", ("red", "green", "blue")),
         GrammarSpec("regex", r"[a-z]{2,6}-[0-9]{1,3}"), GrammarSpec("json_object")]


@pytest.mark.parametrize("engine_args", [{}, {"async_scheduling": True},
                                         {"num_blocks": 40, "block_size": 4, "swap_space": 0},
                                         {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                                 "adaptive": False}},
                                         {"async_scheduling": True, "max_num_batched_tokens": 20},
                                         {"async_scheduling": True, "speculative_config": {
                                             "method": "ngram", "num_speculative_tokens": 3}}],
                         ids=["plain", "async", "preempting", "ngram", "async-chunked", "async-ngram-adaptive"])
def test_constrained_greedy_is_the_masked_argmax(tiny_chat_model, monkeypatch, engine_args):
    """Constrained and free requests in one batch: each constrained output is the reference's,
    token for token; each free one is what it is without the constrained ones."""
    model = tiny_chat_model
    forward, logits_of = scripted(model)
    patch_forward(monkeypatch, forward)
    ps = prompts(model, 2 * len(SPECS), seed=1)
    reqs = []
    for i, spec in enumerate(SPECS):
        reqs.append((ps[2 * i], SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec)))
        reqs.append((ps[2 * i + 1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
    stats = {}
    outs = run(model, reqs, stats, **engine_args)
    if "num_blocks" in engine_args:
        assert stats["num_preemptions"] > 0
    if "speculative_config" in engine_args:
        assert stats["spec_draft_tokens"] > 0
    grammars = Grammars(model.tokenizer, model.config.vocab_size)
    for i, spec in enumerate(SPECS):
        ids, reason, error = outs[2 * i]
        assert error is None
        assert ids == masked_greedy(model, grammars, logits_of, ps[2 * i], spec, 40), spec
        if spec.kind != "json_object":  # (any object: it may run to max_tokens)
            assert reason == "stop"
    free = run(model, reqs[1::2], **engine_args)
    assert outs[1::2] == free


def test_sampling_n_async_and_preemption_change_no_token(tiny_chat_model):
    """Seeded sampled completions (n = 3) under a grammar: the same tokens with async
    scheduling, with a pool small enough to preempt, and every one valid."""
    ps = prompts(tiny_chat_model, 6, seed=2)
    reqs = [(p, SamplingParams(temperature=0.9, seed=i, n=3, max_tokens=60, structured_outputs={"json": PERSON}))
            for i, p in enumerate(ps)]
    base = run(tiny_chat_model, reqs)
    assert run(tiny_chat_model, reqs, async_scheduling=True) == base
    stats = {}
    assert run(tiny_chat_model, reqs, stats, num_blocks=60, block_size=4, swap_space=0) == base
    assert stats["num_preemptions"] > 0
    for ids, reason, _ in base:
        assert reason == "stop"
        jsonschema.validate(json.loads(text(tiny_chat_model, ids)), PERSON)


def test_draft_model_verification_keeps_the_grammar(tiny_chat_model):
    """The target drafting for itself (its drafts ignore the grammar, so the masks reject
    some): greedy outputs equal those without speculation; sampled ones stay valid."""
    ps = prompts(tiny_chat_model, 4, seed=3)
    greedy = [(p, SamplingParams(temperature=0, max_tokens=80, structured_outputs={"json": PERSON})) for p in ps]
    sampled = [(p, SamplingParams(temperature=1.0, seed=i, max_tokens=80, structured_outputs={"regex": r"[a-f]{3,9}"}))
               for i, p in enumerate(ps)]
    spec = {"model": "in-memory", "num_speculative_tokens": 3, "adaptive": False}
    core_args = dict(block_size=16, num_blocks=512, speculative_config=spec)
    core = EngineCore(tiny_chat_model, engine_config(**core_args), draft_model=tiny_chat_model)
    seqs = [core.add_request(p, params) for p, params in greedy + sampled]
    while core.has_unfinished():
        core.step()
    assert core.stats()["spec_draft_tokens"] > core.stats()["spec_accepted_tokens"] > 0
    assert [(s.output_token_ids, s.finish_reason) for s in seqs[:4]] == [(ids, r) for ids, r, _ in
                                                                         run(tiny_chat_model, greedy)]
    for s in seqs[:4]:
        jsonschema.validate(json.loads(text(tiny_chat_model, s.output_token_ids)), PERSON)
    for s in seqs[4:]:
        assert re.fullmatch(r"[a-f]{3,9}", text(tiny_chat_model, s.output_token_ids)), s.output_token_ids


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_grammar_that_goes_wrong_fails_its_request_alone(tiny_chat_model, monkeypatch, async_scheduling):
    """A mask that let a token through which the grammar then refuses (here: masks broken on
    purpose) fails that request with its reason; the others finish."""
    from nanoinfer.structured import grammars as structured

    def allow_all(self, rows, bitmask, **kwargs):
        for _, row, _ in rows:
            bitmask[row] = -1

    monkeypatch.setattr(structured.Grammars, "fill", allow_all)
    ps = prompts(tiny_chat_model, 2, seed=4)
    outs = run(tiny_chat_model, [(ps[0], SamplingParams(temperature=0, max_tokens=20,
                                                        structured_outputs={"regex": "x{5}"})),
                                 (ps[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))],
               async_scheduling=async_scheduling)
    (_, reason, error), (ids, free_reason, free_error) = outs
    assert reason == "error" and "does not continue this request's regex" in str(error)
    assert free_reason == "length" and free_error is None and len(ids) == 20


@pytest.mark.parametrize("value, message", [
    ({"json": {"type": "frobnicate"}}, "json_schema cannot constrain generation"),
    ({"regex": "(unclosed"}, "regex cannot constrain generation"),
    ({"choice": []}, "choice must be a non-empty list of strings"),
    ({"grammar": "start: missing_rule"}, "grammar cannot constrain generation"),
    ({"json": "{not json"}, "json_schema=.* is not valid JSON"),
    ({"regex": "a", "choice": ["b"]}, "exactly one of"),
    ({"xml": "<a/>"}, "exactly one of"),
    ("json", "expected an object with one of"),
])
def test_bad_grammars_are_named_at_submit(tiny_chat_model, value, message):
    core = EngineCore(tiny_chat_model, engine_config(block_size=16, num_blocks=64))
    with pytest.raises(RequestError, match=message):
        core.check_request([1, 2, 3], SamplingParams(structured_outputs=value))
    assert not core.has_unfinished()


def test_a_model_without_a_tokenizer_says_so(tiny_chat_model):
    import dataclasses

    core = EngineCore(dataclasses.replace(tiny_chat_model, tokenizer=None), engine_config(block_size=16,
                                                                                         num_blocks=64))
    with pytest.raises(RequestError, match="structured output needs the model's tokenizer"):
        core.check_request([1, 2, 3], SamplingParams(structured_outputs={"regex": "a+"}))


def test_default_model_answers_in_the_schema(smollm2_gguf):
    """The default model asked for a person as JSON: greedy and sampled answers validate."""
    from nanoinfer import LLM

    messages = [{"role": "user", "content": "Describe a person named Ann, aged 31, as JSON."}]
    with LLM(smollm2_gguf, progress=False) as llm:
        outs = [llm.chat(messages, SamplingParams(temperature=t, seed=1, n=2, max_tokens=60,
                                                  structured_outputs={"json": PERSON})) for t in (0, 0.8)]
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop"
            person = json.loads(c.text)
            jsonschema.validate(person, PERSON)
            assert person["name"].startswith("Ann")


# -- the OpenAI-compatible server ----------------------------------------------------------------


@pytest.fixture(scope="module")
def client(live_server):
    from openai import OpenAI

    return OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0)


MESSAGES = [{"role": "user", "content": "Who is Ann?"}]


def test_response_format_json_schema_streamed_and_whole(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kw = dict(model="tiny-chat", messages=MESSAGES, max_tokens=80, seed=3, temperature=1.0, response_format=fmt, n=2)
    whole = client.chat.completions.create(**kw)
    streamed = ["", ""]
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == [c.message.content for c in whole.choices]
    for c in whole.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), PERSON)
    obj = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=300, seed=4,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_the_openai_clients_parse_helper(client):
    """`client.chat.completions.parse` with a Pydantic model: its strict schema, parsed back."""
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=120)

    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    r = parse(model="tiny-chat", messages=MESSAGES, max_tokens=80, seed=5, response_format=Person)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_vllm_extensions_on_completions(client):
    choice = client.completions.create(model="tiny-chat", prompt="Sentiment:", max_tokens=10, seed=1,
                                       extra_body={"guided_choice": ["positive", "negative"]})
    assert choice.choices[0].text in ("positive", "negative")
    regex = client.completions.create(model="tiny-chat", prompt="Code:", max_tokens=10, seed=1,
                                      extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{2}"}})
    assert re.fullmatch("[A-Z]{2}-[0-9]{2}", regex.choices[0].text)
    as_json = client.completions.create(model="tiny-chat", prompt="Person:", max_tokens=80, seed=1,
                                        extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(as_json.choices[0].text), PERSON)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_mask_that_cannot_be_computed_fails_its_request_alone(tiny_chat_model, monkeypatch, async_scheduling):
    """llguidance failing on one grammar (here: on purpose, at its third mask): that request
    fails, the others finish."""
    from nanoinfer.structured import grammars as structured

    real, calls = structured.Grammars.fill, []

    def fill(self, rows, bitmask, **kwargs):
        if any(c.spec.kind == "regex" for c, _, _ in rows):
            calls.append(rows)
            if len(calls) >= 3:
                raise RequestError("regex constraint failed computing the next tokens: broken on purpose")
        return real(self, rows, bitmask, **kwargs)

    monkeypatch.setattr(structured.Grammars, "fill", fill)
    ps = prompts(tiny_chat_model, 3, seed=5)
    outs = run(tiny_chat_model, [
        (ps[0], SamplingParams(temperature=0, max_tokens=50, structured_outputs={"regex": "[0-9]{40}"})),
        (ps[1], SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": PERSON})),
        (ps[2], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))], async_scheduling=async_scheduling)
    assert outs[0][1] == "error" and "broken on purpose" in str(outs[0][2])
    assert len(calls) >= 3  # (broken mid-output, not at the first token; retried while it is narrowed down)
    assert outs[1][1] == "stop" and outs[1][2] is None
    jsonschema.validate(json.loads(text(tiny_chat_model, outs[1][0])), PERSON)
    assert outs[2][1] == "length" and len(outs[2][0]) == 20


def mixed_requests(model):
    """Constrained requests (that end by their grammar, at max_tokens, or fail) beside free
    ones, greedy and seeded sampling, n > 1: one batch."""
    ps = prompts(model, 10, seed=6)
    return [
        (ps[0], SamplingParams(temperature=0, max_tokens=40, structured_outputs={"choice": ["red", "green", "blue"]})),
        (ps[1], SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)),
        (ps[2], SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=60, structured_outputs={"json": PERSON})),
        (ps[3], SamplingParams(temperature=1.0, seed=8, max_tokens=30, ignore_eos=True)),
        (ps[4], SamplingParams(temperature=0.8, seed=1, max_tokens=12, structured_outputs={"regex": "[a-z]{20,30}"})),
        (ps[5], SamplingParams(temperature=0, max_tokens=50, structured_outputs={"regex": "[0-9]{2,4}-x"})),
        (ps[6], SamplingParams(temperature=0.7, top_k=20, seed=5, max_tokens=40, logprobs=2,
                               structured_outputs={"json_object": True})),
        (ps[7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
        (ps[8], SamplingParams(temperature=0, max_tokens=3, structured_outputs={"regex": "[a-z]{10,20}"})),
        (ps[9], SamplingParams(temperature=0.9, seed=9, max_tokens=20, repetition_penalty=1.2,
                               structured_outputs={"regex": "(ab|cd)+"})),
    ]


@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 24}, {"max_num_seqs": 4},
                                         {"num_blocks": 40, "block_size": 4, "swap_space": 0}],
                         ids=["roomy", "chunked", "few-seqs", "preempting"])
def test_mixed_constrained_batches_are_the_same_with_async_scheduling(tiny_chat_model, monkeypatch, engine_args):
    """Constrained steps overlap the next step's forward (their grammars fed meanwhile): every
    token, finish reason and error is as in the synchronous loop. One grammar's masks break
    after its third (all allowed): the token it then refuses fails that request alone."""
    from nanoinfer.structured import grammars as structured

    fill, fills = structured.Grammars.fill, {}

    def breaking(self, rows, bitmask, **kwargs):
        fill(self, rows, bitmask, **kwargs)
        for constraint, row, _ in rows:
            if constraint.spec.kind == "regex" and "-x" in str(constraint.spec.value):
                fills[id(constraint)] = fills.get(id(constraint), 0) + 1
                if fills[id(constraint)] > 3:
                    bitmask[row] = -1

    monkeypatch.setattr(structured.Grammars, "fill", breaking)
    reqs = mixed_requests(tiny_chat_model)
    sync = run(tiny_chat_model, reqs, async_scheduling=False, **engine_args)
    # (counted afresh: the second run's constraint may sit where the first's was, under its id,
    # and would then break at its first mask; a CI run saw that)
    fills.clear()
    overlapped = run(tiny_chat_model, reqs, async_scheduling=True, **engine_args)
    assert [(ids, reason, str(error)) for ids, reason, error in overlapped] == \
        [(ids, reason, str(error)) for ids, reason, error in sync]
    reasons = [reason for _, reason, _ in sync]
    assert reasons[0] == "stop" and reasons[1] == "length" and reasons[9] == "length", reasons
    assert reasons[6] == "error" and "does not continue this request's regex" in str(sync[6][2])
    assert len(sync[6][0]) >= 3  # (it failed mid-output)


def test_a_constrained_step_is_planned_before_the_step_before_it_resolves(tiny_chat_model, monkeypatch):
    """Async scheduling with a grammar: step N+1 is planned and its forward launched while step
    N's token is still in flight; its mask is filled only after the grammar consumed that token."""
    from nanoinfer.structured import grammars as structured

    core = EngineCore(tiny_chat_model, engine_config(block_size=16, num_blocks=64, async_scheduling=True))
    seq = core.add_request(prompts(tiny_chat_model, 1, seed=7)[0],
                           SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": "[a-z]{30}"}))
    planned, filled = [], []
    plan, fill = core.scheduler.plan, structured.Grammars.fill

    def planning(*args):
        planned.append(seq.num_unresolved)
        return plan(*args)

    def filling(self, rows, bitmask, **kwargs):
        filled.append(len(seq.output_token_ids))
        return fill(self, rows, bitmask, **kwargs)

    monkeypatch.setattr(core.scheduler, "plan", planning)
    monkeypatch.setattr(structured.Grammars, "fill", filling)
    while core.has_unfinished():
        core.step()
    assert seq.finish_reason == "stop" and re.fullmatch("[a-z]{30}", text(tiny_chat_model, seq.output_token_ids))
    # Every plan after the first sees the constrained token in flight...
    # (the last plan comes after the end: nothing in flight, nothing to run)
    assert len(planned) > 3 and planned[0] == planned[-1] == 0 and set(planned[1:-1]) == {1}, planned
    # ...and every mask is filled from all the tokens before it: the k-th after k tokens.
    assert filled == list(range(len(filled))), filled


def test_masks_are_filled_while_the_next_step_is_planned(tiny_chat_model, monkeypatch):
    """Async scheduling: a constrained step's masks are filled on a thread of their own while
    the engine thread plans the next step (its sampling queued by the next launch). Each fill
    here waits for that plan: filled on the engine thread, it would wait in vain."""
    from nanoinfer.structured import grammars as structured

    core = EngineCore(tiny_chat_model, engine_config(block_size=16, num_blocks=64, async_scheduling=True))
    seq = core.add_request(prompts(tiny_chat_model, 1, seed=7)[0],
                           SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": "[a-z]{30}"}))
    plans, submitted, seen = [0], {}, []
    plan, fill, fill_later = core.scheduler.plan, structured.Grammars.fill, structured.Grammars.fill_later

    def planning(*args):
        plans[0] += 1
        return plan(*args)

    def filling_later(self, rows, bitmask):
        submitted[bitmask.data_ptr()] = plans[0]
        return fill_later(self, rows, bitmask)

    def filling(self, rows, bitmask, **kwargs):  # (the plans made since the launch that asked for these masks)
        before = submitted.get(bitmask.data_ptr(), plans[0])
        deadline = time.monotonic() + (2 if all(seen) else 0)
        while plans[0] == before and time.monotonic() < deadline:
            time.sleep(0.001)
        seen.append(plans[0] > before)
        assert kwargs == {"rounds": False} and len(rows) == 1  # (one call: not the fallback row by row)
        return fill(self, rows, bitmask, **kwargs)

    monkeypatch.setattr(structured.Grammars, "fill_later", filling_later)
    monkeypatch.setattr(core.scheduler, "plan", planning)
    monkeypatch.setattr(structured.Grammars, "fill", filling)
    while core.has_unfinished():
        core.step()
    assert seq.finish_reason == "stop" and re.fullmatch("[a-z]{30}", text(tiny_chat_model, seq.output_token_ids))
    assert len(seen) == len(seq.output_token_ids) and all(seen), seen


def test_a_deferred_sampling_that_fails_fails_that_steps_sequences_alone(tiny_chat_model, monkeypatch):
    """With async scheduling a masked step's sampling is queued by the next launch: if it raises
    (here: the third, on purpose), that step's sequences fail with the error when it is read (not
    the next launch's, which goes on), the sampling is not run again, and the engine serves on."""
    from runtime.executor import model_runner

    real, sampled = model_runner._sample, []

    def broken_once(runner, inp, *args):
        sampled.append(inp)
        if len(sampled) == 3:
            raise RuntimeError("broken on purpose")
        return real(runner, inp, *args)

    monkeypatch.setattr(model_runner, "_sample", broken_once)
    core = EngineCore(tiny_chat_model, engine_config(block_size=16, num_blocks=64, async_scheduling=True))
    ps = prompts(tiny_chat_model, 2, seed=3)
    regex = SamplingParams(temperature=0, max_tokens=30, structured_outputs={"regex": "[a-z]{20}"})
    first = core.add_request(ps[0], regex)
    while core.has_unfinished():
        core.step()
    assert first.finish_reason == "error" and "internal error while sampling" in str(first.error)
    assert "broken on purpose" in str(first.error) and len(first.output_token_ids) == 2
    later = core.add_request(ps[1], regex)
    while core.has_unfinished():
        core.step()
    assert later.finish_reason == "stop" and re.fullmatch("[a-z]{20}", text(tiny_chat_model, later.output_token_ids))
    assert len({id(inp) for inp in sampled}) == len(sampled)  # (each step's sampling ran once)
    assert core.scheduler.blocks.num_free_blocks == 64
