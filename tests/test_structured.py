"""Structured output's machinery (nanoinfer/structured/grammars.py) over the default model's vocabulary:
50 generated JSON schemas, each constraining random logits to a document that parses and
validates (jsonschema); regex and choice; the device-side mask against a reference; bad
grammars named."""

import json
import random
import re

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")

from nanoinfer.errors import RequestError  # noqa: E402
from nanoinfer.structured.bitmasks import allocate_bitmask, apply_bitmask
from nanoinfer.structured.grammars import Constraint, grammar_tokenizer
from nanoinfer.structured.spec import GrammarSpec


@pytest.fixture(scope="module")
def vocab(smollm2_gguf):
    """(our tokenizer, llguidance's view of it, the model's vocabulary size)."""
    from nanoinfer.loaders.gguf import open_gguf
    from nanoinfer.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(open_gguf(smollm2_gguf), smollm2_gguf)
    size = tokenizer.vocab_size
    return tokenizer, grammar_tokenizer(tokenizer, size), size


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema of a few properties, each a bounded string (some enums or patterns),
    a bounded integer, a boolean, a short array or (shallowly) a nested object; some required.
    Bounded, so that any document the grammar allows ends."""
    props = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(["string", "enum", "pattern", "integer", "boolean", "array"] + (["object"] if depth < 2 else []))
        if kind == "string":
            prop = {"type": "string", "maxLength": rng.randint(1, 10)}
        elif kind == "enum":
            prop = {"type": "string", "enum": rng.sample(["red", "green", "blue", "a b", "x\"y", "é"], rng.randint(1, 3))}
        elif kind == "pattern":
            prop = {"type": "string", "pattern": "^[a-z]{2,5}-[0-9]{1,3}$"}
        elif kind == "integer":
            low = rng.randint(-50, 50)
            prop = {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
        elif kind == "boolean":
            prop = {"type": "boolean"}
        elif kind == "array":
            prop = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": rng.randint(0, 3)}
        else:
            prop = random_schema(rng, depth + 1)
        props[f"k{i}_{kind}"] = prop
    required = [k for k in props if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def generate(tokenizer, lltok, size: int, spec: GrammarSpec, seed: int, steps: int = 300) -> str:
    """Random logits (a model that knows nothing) sampled under the constraint until the
    grammar is complete and EOS is sampled: the text."""
    constraint = Constraint(lltok, spec)
    g = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, size)
    eos = tokenizer.eos_token_ids[0]
    tokens = []
    for _ in range(steps):
        constraint.fill(bitmask, 0)
        logits = apply_bitmask(torch.randn(1, size, generator=g), bitmask)
        token = int(torch.multinomial(logits.softmax(-1), 1, generator=g))
        if token == eos:
            assert constraint.done
            return tokenizer.decode(tokens)
        constraint.consume(token)
        tokens.append(token)
    raise AssertionError(f"no end after {steps} tokens: {tokenizer.decode(tokens)!r}")


def test_fifty_generated_schemas_constrain_random_logits_to_valid_json(vocab):
    tokenizer, lltok, size = vocab
    rng = random.Random(0)
    for i in range(50):
        schema = random_schema(rng)
        text = generate(tokenizer, lltok, size, GrammarSpec("json_schema", schema), seed=i)
        jsonschema.validate(json.loads(text), schema)  # parses, and is what the schema says
    text = generate(tokenizer, lltok, size, GrammarSpec("json_object"), seed=99, steps=2000)
    assert isinstance(json.loads(text), dict)


def test_regex_and_choice(vocab):
    tokenizer, lltok, size = vocab
    for seed in range(5):
        assert re.fullmatch(r"[A-Z][a-z]{1,6} [0-9]{2}", generate(tokenizer, lltok, size,
                                                                   GrammarSpec("regex", r"[A-Z][a-z]{1,6} [0-9]{2}"),
                                                                   seed))
        assert generate(tokenizer, lltok, size, GrammarSpec("choice", ("positive", "negative", "neutral ☺")),
                        seed) in ("positive", "negative", "neutral ☺")


def test_a_steps_masks_name_their_rows_unless_they_are_every_row_in_order():
    from runtime.executor.grammar_masks import StepMasks

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 64, generator=g)
    words = torch.randint(-2**31, 2**31 - 1, (3, 2), generator=g, dtype=torch.int64).to(torch.int32)
    every = StepMasks(words, [0, 1, 2], None)
    assert every.on_device(torch.device("cpu"), 3)[1] is None
    assert torch.equal(every.applied(logits, torch.device("cpu")), apply_bitmask(logits, words))
    for at in ([0, 2, 1], [1, 2]):  # (out of order; a row unconstrained)
        some = StepMasks(words[:len(at)], at, None)
        assert some.on_device(torch.device("cpu"), 3)[1].tolist() == at
        assert torch.equal(some.applied(logits, torch.device("cpu")), apply_bitmask(logits, words[:len(at)],
                                                                                   torch.tensor(at)))
    assert StepMasks(words[:2], [0, 1], None).on_device(torch.device("cpu"), 3)[1].tolist() == [0, 1]


def test_apply_bitmask_matches_bit_by_bit_reference():
    g = torch.Generator().manual_seed(0)
    rows, vocab = 3, 100  # (4 words: 28 bits of the last past the vocabulary)
    words = torch.randint(-2**31, 2**31 - 1, (rows, 4), generator=g, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(rows, vocab + 5, generator=g)  # (5 columns past the mask: never allowed)
    got = apply_bitmask(logits, words)
    for r in range(rows):
        for t in range(vocab + 5):
            allowed = t < 128 and (int(words[r, t // 32]) >> (t % 32)) & 1
            assert (got[r, t] == logits[r, t]) if allowed else got[r, t] == float("-inf"), (r, t)


def test_bad_grammars_are_named(vocab):
    _, lltok, _ = vocab
    with pytest.raises(RequestError, match="json_schema cannot constrain generation"):
        Constraint(lltok, GrammarSpec("json_schema", {"type": "frobnicate"}))
    with pytest.raises(RequestError, match="regex cannot constrain generation"):
        Constraint(lltok, GrammarSpec("regex", "(unclosed"))
    with pytest.raises(RequestError, match="choice must be a non-empty list of strings"):
        GrammarSpec("choice", ()).grammar()


def test_parallel_fill_with_drafts_equals_one_row_at_a_time(vocab):
    """`Grammars.fill` (llguidance's threads, drafts included) against `Constraint.fill` per row:
    the same masks, the matchers where they were."""
    from nanoinfer.structured.grammars import Grammars

    tokenizer, _, size = vocab
    grammars = Grammars(tokenizer, size)
    rng = random.Random(1)
    specs = [GrammarSpec("json_schema", random_schema(rng)) for _ in range(6)] + [GrammarSpec("regex", "[a-z]{3,8}")]
    pairs = [(grammars.constraint(s), grammars.constraint(s)) for s in specs]
    prefix = tokenizer.encode('{"k', add_special_tokens=False)
    rows, offset = [], 0
    for i, (a, b) in enumerate(pairs):
        if a.spec.kind == "json_schema" and i % 2:  # (some advanced first, some drafting a valid prefix)
            assert all(a.consume(t) and b.consume(t) for t in prefix[:1])
        drafts = prefix[1:] if a.spec.kind == "json_schema" else [] if i % 2 else [rng.randrange(size)]
        rows.append((a, b, offset, drafts))
        offset += len(drafts) + 1
    parallel, reference = allocate_bitmask(offset, size), allocate_bitmask(offset, size)
    grammars.fill([(a, row, drafts) for a, _, row, drafts in rows], parallel)
    for _, b, row, drafts in rows:
        b.fill(reference, row, drafts)
    assert torch.equal(parallel, reference)
    assert not torch.equal(parallel[0], torch.full_like(parallel[0], -1))  # (something was masked)
    for a, b, _, _ in rows:  # rolled back: both accept the same next token
        token = tokenizer.encode('"', add_special_tokens=False)[0]
        assert a.matcher.validate_tokens([token]) == b.matcher.validate_tokens([token])


def test_fill_in_rounds_over_several_lexers_equals_one_row_at_a_time(vocab, monkeypatch):
    """A Grammars on 3 threads spreads each spec's sequences over 2 compilations (copies of one
    share its lexer: filled in rounds, one row per lexer): step after step, over random token
    streams the grammars allow, its masks (`fill`) and verdicts (`consume`) are those of a
    Constraint per sequence filled and fed one row at a time."""
    from nanoinfer.structured import grammars as structured
    from nanoinfer.structured.bitmasks import unpack_bitmask
    from nanoinfer.structured.grammars import Grammars, in_rounds

    tokenizer, lltok, size = vocab
    monkeypatch.setattr(structured, "LEXER_COMPILE_S", 60.0)  # (however slowly this machine compiles)
    grammars = Grammars(tokenizer, size, threads=3, lexers=2)
    rng = random.Random(2)
    specs = [GrammarSpec("json_schema", random_schema(rng)) for _ in range(2)] + [GrammarSpec("regex", "[a-z]{3,40}")]
    seqs = [(grammars.constraint(spec), Constraint(lltok, spec)) for spec in specs for _ in range(4)]
    assert len({id(ours.lexer) for ours, _ in seqs}) == 6 and len({id(ours.matcher) for ours, _ in seqs}) == 12
    assert [len(batch) for batch in in_rounds(3, [(ours,) for ours, _ in seqs])] == [6, 6]
    for step in range(100):
        live = [(ours, ref) for ours, ref in seqs if not ref.finished]
        if not live:
            break
        masks, reference = allocate_bitmask(len(live), size), allocate_bitmask(len(live), size)
        rows = [(ours, row, ()) for row, (ours, _) in enumerate(live)]
        if step % 3 == 0:
            grammars.fill(rows, masks)
        elif step % 3 == 1:  # (one call, rows of one lexer waiting for each other)
            grammars.fill(rows, masks, rounds=False)
        else:  # (on the grammars' own thread, as the engine fills with async scheduling)
            assert grammars.fill_later(rows, masks).result() is None
        for row, (_, ref) in enumerate(live):
            ref.fill(reference, row)
        assert torch.equal(masks, reference), step
        allowed = unpack_bitmask(masks, size)
        tokens = [rng.choice(allowed[row].nonzero().flatten().tolist()) for row in range(len(live))]
        assert grammars.consume([(ours, t) for (ours, _), t in zip(live, tokens)]) == [True] * len(live)
        assert all(ref.consume(t) for (_, ref), t in zip(live, tokens))
    else:
        pytest.fail("the grammars never ended")
    # a refused token is refused in its row alone, whatever round it shares
    fresh = [grammars.constraint(specs[0]) for _ in range(4)]
    quote = tokenizer.encode("{", add_special_tokens=False)[0]
    assert grammars.consume([(c, quote if i != 2 else tokenizer.encode("x", add_special_tokens=False)[0])
                             for i, c in enumerate(fresh)]) == [True, True, False, True]
    # fill_later never raises: the row whose grammar failed allows every token and its constraint
    # keeps the error (its next token is refused); the other rows are filled as `fill` fills them
    masks, reference = allocate_bitmask(4, size, every_token=False), allocate_bitmask(4, size)
    grammars.fill_later([(c, row, ()) for row, c in enumerate(fresh)], masks).result()
    grammars.fill([(c, row, ()) for row, c in enumerate(fresh) if row != 2], reference)
    assert torch.equal(masks[[0, 1, 3]], reference[[0, 1, 3]]) and bool((masks[2] == -1).all())
    assert [c.failure is None for c in fresh] == [True, True, False, True]
    assert "constraint failed computing the next tokens" in str(fresh[2].failure)
    allowed = unpack_bitmask(reference, size)[0].nonzero().flatten().tolist()
    assert fresh[2].consume(allowed[0]) is False and fresh[0].consume(allowed[0]) is True


def test_a_spec_gets_compilations_by_threads_size_and_compile_time():
    """Two per fill thread by default (one on one thread), fewer for a large grammar (each takes
    ~40x its text) or a slow one (the engine thread waits for each)."""
    from nanoinfer.structured.grammars import LEXER_BYTES, LEXER_COMPILE_S, Grammars

    small, large = GrammarSpec("regex", "[a-z]+"), GrammarSpec("regex", "a" * (LEXER_BYTES // 40 // 3))
    assert Grammars(None, 100, threads=1).lexers_for(small) == 1
    grammars = Grammars(None, 100, threads=6)
    assert grammars.lexers_for(small, 0.0005) == 12
    assert grammars.lexers_for(large, 0.0005) == 3
    assert grammars.lexers_for(small, LEXER_COMPILE_S / 4) == 4 and grammars.lexers_for(small, 1.0) == 1


def test_bounds_are_checked_before_anything_native():
    """A grammar's size, rules, $refs and choices are bounded in Python, the bound named with
    the field the client sent (llguidance's compiler recursed once per nested rule or $ref, and
    overflowed its stack on a few thousand: see nanoinfer/structured/grammars.py)."""
    from nanoinfer.structured import spec as structured

    chain = "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(structured.MAX_GRAMMAR_RULES)) + '\nr_end: "x"'
    with pytest.raises(RequestError, match=r"defines 10,00\d rules: expected at most 10,000") as e:
        GrammarSpec("grammar", chain, param="guided_grammar").check_bounds()
    assert e.value.param == "guided_grammar"
    GrammarSpec("grammar", chain.split("\nr9990:")[0]).check_bounds()
    refs = {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(structured.MAX_SCHEMA_REFS + 1)}}
    with pytest.raises(RequestError, match=r"10,001 \$refs: expected at most 10,000"):
        GrammarSpec.parse({"json": refs}).check_bounds()
    choices = [str(i) for i in range(structured.MAX_CHOICES)]
    GrammarSpec("choice", choices).check_bounds()
    with pytest.raises(RequestError, match=r"10,001 strings: expected at most 10,000") as e:
        GrammarSpec("choice", choices + ["x"]).check_bounds()
    assert e.value.param == "choice"
    with pytest.raises(RequestError, match=r"regex is 2,097,153 bytes: expected at most 2,097,152") as e:
        GrammarSpec.parse({"regex": "a" * (structured.MAX_GRAMMAR_BYTES + 1)}).check_bounds()
    assert e.value.param == "structured_outputs"


def test_grammars_compile_once_and_name_the_field(vocab):
    """Grammars compiles on its own thread, once per spec (a refusal too), and names the field
    the spec came from; a language with no string is refused when compiled."""
    from nanoinfer.structured.grammars import Grammars

    tokenizer, _, size = vocab
    grammars = Grammars(tokenizer, size)
    spec = GrammarSpec("regex", "[a-c]{2}", param="guided_regex")
    grammars.check(spec)
    a, b = grammars.constraint(spec), grammars.constraint(GrammarSpec("regex", "[a-c]{2}"))
    assert a.matcher is not b.matcher  # (copies of one compiled grammar)
    assert a.consume(tokenizer.encode("a", add_special_tokens=False)[0]) and not b.done
    for bad, message in [(r"[^\s\S]", "no output satisfies it"), ("(unclosed", "cannot constrain generation")]:
        for param in ("guided_regex", "structured_outputs"):  # (the second from the cache)
            with pytest.raises(RequestError, match=message) as e:
                grammars.compile(GrammarSpec("regex", bad, param=param)).result()
            assert e.value.param == param


@pytest.mark.parametrize("grammar, unproductive", [
    ('start: a\na: "x" a', ["start", "a"]),
    ('start: start "x"', ["start"]),
    ('start: start "x" | "y"', []),
    ('start: e\ne: e e | e "+" e | "a" | e*', []),
    ('start: a b\na: "x"\nb: b "y"\n  | c\nc: ("z" c)+', ["start", "b", "c"]),
    ('start: a b\na: "x"\nb: b "y"\n  | c\nc: ("z" c)*', []),
    ('?start: sum\n?sum: product\n  | sum "+" product -> add\n?product: NUMBER | "(" sum ")"\nNUMBER: /[0-9]+/\n'
     'WS: / +/\n%ignore WS', []),
    ('start: value\nvalue: dict | list | STRING\nlist : "[" [value ("," value)*] "]"\n'
     'dict : "{" [pair ("," pair)*] "}"\npair : STRING ":" value\nSTRING: /"[^"]*"/', []),
    ('start: x~1..3\nx: x "a"', ["start", "x"]),
    ('start: x~0..3\nx: x "a"', []),
    ('start: <[128000]> "x" // a comment', []),
    ('start: NUMBER\n%import common.NUMBER', None),  # (not followed: no verdict)
    ('start: %json {"type": "object"}', None),
])
def test_lark_grammars_whose_start_derives_no_string(grammar, unproductive):
    from nanoinfer.structured.lark_check import unproductive_start

    assert unproductive_start(grammar) == unproductive


def test_the_compiled_grammars_kept_are_bounded_by_their_text(vocab):
    """A Grammars keeps compiled grammars up to `cache_bytes` of spec text (one compiled takes
    ~40x its text); one dropped is compiled again when a sequence needs it."""
    from nanoinfer.structured.grammars import Grammars

    tokenizer, _, size = vocab
    grammars = Grammars(tokenizer, size, cache_bytes=20)
    specs = [GrammarSpec("regex", f"[a-c]{{{i}}}xyz") for i in range(1, 5)]  # 10 bytes each
    for spec in specs:
        grammars.check(spec)
    a = tokenizer.encode("a", add_special_tokens=False)[0]
    for spec in specs:
        constraint = grammars.constraint(spec)
        assert constraint.consume(a) and not constraint.done
