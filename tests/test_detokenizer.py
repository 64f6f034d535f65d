"""Incremental detokenization: deltas never split a character, add up to the full decode,
and stop strings cut the text wherever they fall."""

import pytest
from hypothesis import given, settings, strategies as st

from nanoinfer.loaders.gguf import open_gguf
from nanoinfer.text.tokenizer import Tokenizer
from runtime.engine.detokenizer import IncrementalDetokenizer

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40) | st.sampled_from(
    ["héllo wörld 😀👍🏽 日本語のテキスト", "emoji 🧑‍🚀 zwj and ñ", "  spaces\n\nand\ttabs 123456"])


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    return Tokenizer.from_gguf(open_gguf(smollm2_gguf), smollm2_gguf)


def stream(tokenizer, ids, prompt=(), window=False, **kw):
    """Each token's delta; `window`: the window decode (the reference) in place of the stream decoder."""
    detok = IncrementalDetokenizer(tokenizer, list(prompt), **kw)
    if window:
        detok._step = None
    deltas = []
    for i, token in enumerate(ids):
        detok.add([token])
        deltas.append(detok.take_delta(final=detok.stopped or i == len(ids) - 1))
        if detok.stopped:
            break
    return deltas, detok


@settings(max_examples=150, deadline=None)
@given(TEXT, TEXT)
def test_deltas_add_up_and_never_split_a_character(tokenizer, prompt, text):
    ids = tokenizer.encode(text)
    deltas, _ = stream(tokenizer, ids, tokenizer.encode(prompt))
    assert "".join(deltas) == tokenizer.decode(ids)
    full = tokenizer.decode(ids)
    for d in deltas[:-1]:
        # A delta never ends in a replacement character unless the full text has one there.
        assert "\ufffd" not in d or "\ufffd" in full


@settings(max_examples=150, deadline=None)
@given(TEXT, TEXT, st.sampled_from([(), ("ö",), ("\n\n", "wor"), ("😀",)]))
def test_the_stream_decoder_gives_the_windows_deltas(tokenizer, prompt, text, stop):
    """tokenizers' DecodeStream (the fast path) against the window decode, delta for delta, stop strings included;
    ids past the vocabulary (a model's padded rows) make no text in either."""
    assert IncrementalDetokenizer(tokenizer, [])._step is not None  # (the default model's vocabulary has one)
    ids = tokenizer.encode(text) + [tokenizer.vocab_size + 5] + tokenizer.encode(text[:3])
    fast, fast_state = stream(tokenizer, ids, tokenizer.encode(prompt), stop=stop)
    ref, ref_state = stream(tokenizer, ids, tokenizer.encode(prompt), window=True, stop=stop)
    assert fast == ref and fast_state.unsent == ref_state.unsent and fast_state.stopped == ref_state.stopped


def test_multibyte_character_split_over_tokens_is_held_back(tokenizer):
    ids = tokenizer.encode("🧑‍🚀")
    assert len(ids) > 2  # byte-level BPE splits it
    deltas, _ = stream(tokenizer, ids)
    assert "".join(deltas) == "🧑‍🚀" and all("\ufffd" not in d for d in deltas)
    assert deltas[0] == ""  # the first byte alone is no character yet


@settings(max_examples=100, deadline=None)
@given(TEXT, st.integers(0, 30), st.integers(1, 6), st.booleans())
def test_stop_strings_cut_at_the_first_match(tokenizer, text, start, length, include):
    text = "abc " + text + " xyz"
    full = tokenizer.decode(tokenizer.encode(text))
    stop = full[start % len(full):][:length]
    deltas, detok = stream(tokenizer, tokenizer.encode(text), stop=[stop], include_stop_str_in_output=include)
    cut = full.index(stop) + (len(stop) if include else 0)
    assert detok.stopped and "".join(deltas) == full[:cut]


def test_stop_string_across_multibyte_tokens(tokenizer):
    text = "Le café coûte 3€ 😀 merci"
    deltas, detok = stream(tokenizer, tokenizer.encode(text), stop=["€ 😀"])
    assert detok.stopped and "".join(deltas) == "Le café coûte 3"


def test_text_handed_out_is_not_kept(tokenizer):
    """A long stream holds only what it has not handed out (a stop string's length less one, held back) and the ids
    of its decode window, not its whole text and ids: appending to the whole text copied it at every token."""
    ids = tokenizer.encode("a few words of text " * 200)
    detok = IncrementalDetokenizer(tokenizer, [], stop=("never there",))
    out = []
    for token in ids:
        detok.add([token])
        out.append(detok.take_delta())
        assert len(detok.unsent) <= len("never there") - 1 + 8  # (the hold-back, and at most one token's text)
        assert len(detok.ids) <= 8  # (the ids of the window the next token's text is decoded in)
    assert "".join(out) + detok.take_delta(final=True) == tokenizer.decode(ids)
