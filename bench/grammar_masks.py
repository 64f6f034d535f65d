"""Structured-output mask cost on the CPU: xgrammar, llguidance and outlines-core computing
next-token masks for one JSON schema, at batch 64 with a 152k byte-level vocabulary.

    python bench/grammar_masks.py [--vocab 152000] [--batch 64] [--seed 0] [--threads N]
                                  [--passes 3] [--libs xgrammar llguidance outlines-core]

No model hub here, so the vocabulary is synthetic and Qwen2-sized: the 256 single bytes,
then distinct multi-byte strings drawn (seeded) to look like byte-level BPE tokens (subwords
with and without a leading space, digits, punctuation runs, JSON pieces such as '":' and
'},{"', whitespace and newline+indent runs, some unicode, a few partial UTF-8 sequences),
and an EOS token last. Every library gets the same bytes: xgrammar as a RAW TokenizerInfo,
llguidance through its TokenizerWrapper (token bytes + EOS), outlines-core as a
Vocabulary of bytes keys.

For each library, one schema (string, bounded integer, enum, nested object, array of
objects, boolean; all required, additionalProperties false) and one compact valid document:
- vocab ms: building the library's tokenizer/vocabulary object (once per model);
- compile ms: schema -> the object that matchers are made from (once per schema). Not the
  same work in each: xgrammar precomputes per-state token masks, outlines-core builds its
  whole state x token index, llguidance only parses the grammar (its lexer is built lazily,
  during the first masks: see "cold");
- the decode loop: `--batch` independent matchers on that grammar; each step fills every
  sequence's row of one int32 bitmask (batch x ceil(V/32)), with the library's batched API
  where it has one, then advances every sequence by the single-byte token of the document's
  next character, and last by EOS. A first pass on fresh matchers warms up (its mean step
  and first step are shown as "cold mean" and "1st step"); the matchers are then reset for
  each of `--passes` timed passes, pooled. `--threads` (default: all cores) goes to the
  batched APIs; outlines-core has none, so it runs a Python loop on one thread.
  Step time = mask fill + advance for the whole batch: median, p90 and mean; µs per
  sequence-token = the mean step over the batch size (the mean, as most of the cost sits in
  the minority of steps inside free-text strings, where ~1/3 of the vocabulary is allowed).
The masks are checked outside the timed region: the token taken must be allowed in every
row, and where the document is outside a string '#' and EOS must be masked out (EOS is
checked allowed at the end); "allowed" is the mean count of allowed tokens in row 0, a
sanity figure (the libraries differ in the whitespace they allow, so it differs a little).
Last, a probe per schema keyword (integer bounds, string pattern, required, no extra
properties): is the byte that would break it masked out on a fresh matcher.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from importlib.metadata import PackageNotFoundError, version

import numpy as np
import torch

EOS_BYTES = b"<|endoftext|>"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "status": {"enum": ["active", "inactive", "pending"]},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "tags": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"key": {"type": "string"}, "weight": {"type": "number"}},
                "required": ["key", "weight"],
                "additionalProperties": False,
            },
        },
        "verified": {"type": "boolean"},
    },
    "required": ["name", "age", "status", "address", "tags", "verified"],
    "additionalProperties": False,
}

# Compact (no whitespace), keys in schema order: outlines-core's regex fixes the order and
# all three accept no whitespace between tokens. ASCII, so one character = one byte token.
DOCUMENT = json.dumps({
    "name": "Ada Lovelace, Countess of Lovelace",
    "age": 36,
    "status": "active",
    "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
    "tags": [{"key": "mathematics", "weight": 0.95}, {"key": "analytical engine", "weight": 1},
             {"key": "poetry", "weight": -0.25}],
    "verified": True,
}, separators=(",", ":")).encode()


# ----------------------------------------------------------------------------- vocabulary

ONSETS = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
          "y", "z", "bl", "br", "ch", "cl", "cr", "dr", "fl", "fr", "gr", "pl", "pr", "sc", "sh",
          "sk", "sl", "sm", "sn", "sp", "st", "str", "sw", "th", "tr", "wh", "qu"]
VOWELS = ["a", "e", "i", "o", "u", "y", "ai", "ea", "ee", "ie", "io", "oo", "ou", "ue"]
CODAS = ["", "", "", "b", "ck", "d", "ft", "g", "l", "ll", "m", "n", "nd", "ng", "nt", "p", "r",
         "rd", "rk", "rn", "rt", "s", "ss", "st", "t", "x"]
SUFFIXES = ["", "", "", "", "s", "ed", "ing", "er", "ly", "tion", "ment", "ness", "able", "al",
            "ive", "ous", "ity", "ize", "es", "est"]
PUNCT = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
JSON_PIECES = ['":', '",', '{"', '}', '],', '":"', '","', '":{"', '":["', '"},{"', '},{"', '"}',
               '"]', ']}', '}}', '}]', '":[', '":[{"', '"},', '},', '"]}', ' {"', '": ', '", "',
               '":"",', '":true', '":false', '":null', '":0', '":1', ': {', ': [', '{\n', '[\n',
               '},\n', '],\n', '"\n', '",\n', '":\n', 'true', 'false', 'null', ' true', ' false',
               ' null', '\\"', '\\n', '\\\\', '\\u', '\\t', '{}', '[]', '""', '{},', '[],']
UNICODE_RANGES = [(0xC0, 0xFF), (0x391, 0x3C9), (0x410, 0x44F), (0x3041, 0x3096), (0x30A1, 0x30FA),
                  (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F600, 0x1F64F), (0x2010, 0x2027)]


def _word(rng: random.Random) -> str:
    # mostly simple syllables, so lengths come out near a real vocabulary's (~6-7 bytes)
    w = "".join(rng.choice(ONSETS[:20] if rng.random() < 0.7 else ONSETS) + rng.choice(VOWELS[:6])
                + rng.choice(CODAS) for _ in range(rng.choice([1, 1, 2, 2, 2, 3])))
    if rng.random() < 0.3:
        w += rng.choice(SUFFIXES)
    r = rng.random()
    if r < 0.22:
        w = w.capitalize()
    elif r < 0.26:
        w = w.upper()
    return w


def build_vocab(size: int, seed: int) -> list[bytes]:
    """`size` distinct tokens: 256 single bytes, BPE-looking multi-byte strings, EOS last."""
    rng = random.Random(seed)
    toks = [bytes([b]) for b in range(256)]
    seen = set(toks) | {EOS_BYTES}
    target = size - 1

    def add(t: bytes) -> None:
        if len(toks) < target and len(t) > 1 and t not in seen:
            seen.add(t)
            toks.append(t)

    for p in JSON_PIECES:
        add(p.encode())
    for k in range(2, 33):  # whitespace runs and newline + indent, as code/JSON vocabularies have
        add(b" " * k)
        add(b"\t" * min(k, 8))
        add(b"\n" + b" " * k)
        add(b"\n" + b"\t" * min(k, 8))
        add(b"\n" * min(k, 4))
        add(b"\r\n" + b" " * k)
    for n in range(1000):  # Qwen2 splits digits singly; GPT-style vocabularies carry runs of 1-3
        add(str(n).encode())
        add(b" " + str(n).encode())
    while len(toks) < target:
        r = rng.random()
        if r < 0.72:  # subwords: half with a leading space, some as continuations
            w = _word(rng)
            if rng.random() < 0.5:
                w = " " + w
            add(w.encode())
        elif r < 0.78:  # code-ish: identifiers with punctuation
            w = _word(rng).lower()
            add(rng.choice(["_", ".", "(", "->", "::", "$", "@", "#", "/", "-"]).encode() + w.encode()
                + rng.choice(["", "", "(", "()", "_", ".", ":", "=", ",", ";"]).encode())
        elif r < 0.84:  # punctuation runs
            run = "".join(rng.choice(PUNCT) for _ in range(rng.randint(2, 5)))
            add((" " * rng.randint(0, 1) + run).encode())
        elif r < 0.88:  # numbers
            add((" " * rng.randint(0, 1) + str(rng.randint(0, 10 ** rng.randint(2, 6)))).encode())
        else:  # unicode: 1-3 characters, sometimes a cut (partial UTF-8) sequence as BPE has
            lo, hi = rng.choice(UNICODE_RANGES)
            s = (" " * (rng.random() < 0.3) + "".join(chr(rng.randint(lo, hi))
                 for _ in range(rng.randint(1, 3)))).encode()
            if rng.random() < 0.1 and len(s) > 2:
                s = s[:-1]
            add(s)
    toks.append(EOS_BYTES)
    return toks


# ----------------------------------------------------------------------------- libraries
# Each adapter: setup_vocab(tokens, eos) / compile(schema) / new_batch(n) -> matchers /
# fill(matchers, bitmask) / advance(matchers, token) / reset(matchers).

class XGrammar:
    name, dist = "xgrammar", "xgrammar"

    def __init__(self, threads: int):
        import xgrammar as xgr
        self.xgr, self.threads = xgr, threads

    def setup_vocab(self, tokens: list[bytes], eos: int) -> None:
        xgr = self.xgr
        self.info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=len(tokens),
                                      stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)
        self.batcher = xgr.BatchGrammarMatcher(max_threads=self.threads)

    def compile(self, schema: dict) -> None:
        # any_whitespace=True (the default) accepts the compact document; strict_mode=True
        # (the default) = no extra properties, matching additionalProperties false anyway.
        self.grammar = self.compiler.compile_json_schema(json.dumps(schema))

    def new_batch(self, n: int):
        return [self.xgr.GrammarMatcher(self.grammar) for _ in range(n)]

    def fill(self, ms, bitmask: torch.Tensor) -> None:
        self.batcher.batch_fill_next_token_bitmask(ms, bitmask)

    def advance(self, ms, token: int) -> None:
        ok = self.xgr.BatchGrammarMatcher.batch_accept_token(ms, [token] * len(ms))
        assert all(ok), f"xgrammar rejected token {token}"

    def reset(self, ms) -> None:
        for m in ms:
            m.reset()

    def threads_note(self) -> str:
        return f"BatchGrammarMatcher(max_threads={self.threads})"


class LLGuidance:
    name, dist = "llguidance", "llguidance"

    def __init__(self, threads: int):
        import llguidance
        import llguidance.torch
        self.llg, self.threads = llguidance, threads

    def setup_vocab(self, tokens: list[bytes], eos: int) -> None:
        llg = self.llg

        class Tok:  # what TokenizerWrapper reads: token bytes, EOS/BOS, special ids, encode
            eos_token_id, bos_token_id, special_token_ids = eos, None, [eos]

            def __init__(self, toks):
                self.tokens = toks

            def __call__(self, s: bytes) -> list[int]:  # only used to tokenize text (not here)
                return list(s)  # token id b = the single byte b

        self.tok = llg.LLTokenizer(llg.TokenizerWrapper(Tok(tokens)))  # default (general) slices
        self.executor = llg.LLExecutor(num_threads=self.threads)

    def compile(self, schema: dict) -> None:
        # Defaults: whitespace_flexible (so compact is accepted), "," and ":" separators.
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        self.template = self.llg.LLMatcher(self.tok, grammar, log_level=1)
        assert not self.template.is_error(), self.template.get_error()

    def new_batch(self, n: int):
        ms = [self.template.deep_copy() for _ in range(n)]
        self._pairs = [(m, i) for i, m in enumerate(ms)]
        return ms

    def fill(self, ms, bitmask: torch.Tensor) -> None:
        self.llg.torch.fill_next_token_bitmask_par(self.executor, self._pairs, bitmask)

    def advance(self, ms, token: int) -> None:
        ok = self.llg.torch.consume_token_par(self.executor, [(m, token) for m in ms])
        assert all(ok), f"llguidance rejected token {token}: {ms[0].get_error()}"

    def reset(self, ms) -> None:
        for m in ms:
            assert m.reset()

    def threads_note(self) -> str:
        return f"LLExecutor(num_threads={self.threads})"


class OutlinesCore:
    name, dist = "outlines-core", "outlines_core"

    def __init__(self, threads: int):
        import outlines_core
        self.oc = outlines_core

    def setup_vocab(self, tokens: list[bytes], eos: int) -> None:
        # bytes keys are taken as the token's bytes; str keys would be taken as their UTF-8
        # bytes (not GPT-2-unmapped), so raw bytes is the exact form. EOS stays out of the map.
        self.vocab = self.oc.Vocabulary(eos, {t: [i] for i, t in enumerate(tokens) if i != eos})

    def compile(self, schema: dict) -> None:
        # Regex with the default whitespace '[ ]?'; the Index is the full state x token table.
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        self.index = self.oc.Index(regex, self.vocab)

    def new_batch(self, n: int):
        return [self.oc.Guide(self.index) for _ in range(n)]

    def fill(self, ms, bitmask: torch.Tensor) -> None:
        # No batched API: one call per sequence into its row, on this thread.
        base, words = bitmask.data_ptr(), bitmask.shape[1]
        for i, g in enumerate(ms):
            g.write_mask_into(base + i * words * 4, words, 4)

    def advance(self, ms, token: int) -> None:
        if token == self.vocab.get_eos_token_id():  # a final state has no EOS transition to take
            assert all(g.is_finished() for g in ms)
            return
        for g in ms:
            g.advance(token, return_tokens=False)

    def reset(self, ms) -> None:
        for g in ms:
            g.reset()

    def threads_note(self) -> str:
        return "Python loop, 1 thread (no batched API)"


LIBS = {c.name: c for c in (XGrammar, LLGuidance, OutlinesCore)}


# ----------------------------------------------------------------------------- measurement

def outside_string(doc: bytes) -> list[bool]:
    """For each position, whether the next byte is read outside a JSON string literal."""
    res, in_str, esc = [], False, False
    for c in doc:
        res.append(not in_str)
        if in_str:
            if esc:
                esc = False
            elif c == ord("\\"):
                esc = True
            elif c == ord('"'):
                in_str = False
        elif c == ord('"'):
            in_str = True
    return res


def bit(bitmask: np.ndarray, tok: int) -> np.ndarray:
    return (bitmask[:, tok >> 5] >> (tok & 31)) & 1


def run_pass(lib, ms, bitmask: torch.Tensor, eos: int):
    """One pass over the document and EOS; per-step seconds (mask, advance), mean allowed."""
    steps = list(DOCUMENT) + [eos]
    outside = outside_string(DOCUMENT) + [True]
    bm = bitmask.numpy()
    t_mask, t_adv, allowed = [], [], []
    for i, tok in enumerate(steps):
        bitmask.fill_(0)  # so a library that skipped a row cannot pass the checks
        t0 = time.perf_counter()
        lib.fill(ms, bitmask)
        t1 = time.perf_counter()
        # checks, outside the timed calls: the token taken is allowed in every row; outside a
        # string '#' (never valid JSON there) and EOS (the document is unfinished) are not
        assert bit(bm, tok).all(), f"{lib.name}: step {i} token {tok} masked out"
        if outside[i] and tok != eos:
            assert not bit(bm, ord("#")).any(), f"{lib.name}: '#' allowed at step {i}"
            assert not bit(bm, eos).any(), f"{lib.name}: EOS allowed at step {i}"
        allowed.append(int(np.unpackbits(bm[0].view(np.uint8)).sum()))
        t2 = time.perf_counter()
        lib.advance(ms, tok)
        t3 = time.perf_counter()
        t_mask.append(t1 - t0)
        t_adv.append(t3 - t2)
    return t_mask, t_adv, statistics.mean(allowed)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


# What the schema asks beyond JSON syntax, probed on one fresh matcher: (prefix, next byte,
# whether that byte must be masked out for the keyword to count as enforced).
PROBES = {
    "int min": (b'{"name":"x","age":', b"-"),
    "int max": (b'{"name":"x","age":15', b"1"),
    "pattern": (b'{"name":"x","age":1,"status":"active","address":{"street":"s","city":"c","zip":"', b"a"),
    "required": (b"{", b"}"),
    "no extra": (b'{"name":"x","age":1,"status":"active","address":{"street":"s","city":"c","zip":"12345"},'
                 b'"tags":[],"verified":true', b","),
}


def probe(lib, vocab_size: int) -> dict:
    """Keyword -> enforced?, plus whether whitespace is allowed after '{' (information only)."""
    res = {}
    bitmask = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32)
    for key, (prefix, nxt) in list(PROBES.items()) + [("ws", (b"{", b" "))]:
        ms = lib.new_batch(1)
        for c in prefix:
            lib.advance(ms, c)
        lib.fill(ms, bitmask)
        allowed = bool(bit(bitmask.numpy(), nxt[0])[0])
        res[key] = allowed if key == "ws" else not allowed
    return res


def measure(name: str, tokens: list[bytes], batch: int, threads: int, passes: int) -> dict:
    eos = len(tokens) - 1
    try:
        ver = version(LIBS[name].dist)
        lib = LIBS[name](threads)
    except (ImportError, PackageNotFoundError) as e:
        return dict(name=name, error=f"not importable: {e}")
    t0 = time.perf_counter()
    lib.setup_vocab(tokens, eos)
    t1 = time.perf_counter()
    lib.compile(SCHEMA)
    t2 = time.perf_counter()
    ms = lib.new_batch(batch)
    bitmask = torch.zeros((batch, (len(tokens) + 31) // 32), dtype=torch.int32)
    cold_mask, cold_adv, _ = run_pass(lib, ms, bitmask, eos)  # warm-up, fresh matchers
    t_mask, t_adv, allowed = [], [], []
    for _ in range(passes):  # timed passes, pooled; the checks run between the timed calls
        lib.reset(ms)
        m, a, al = run_pass(lib, ms, bitmask, eos)
        t_mask += m
        t_adv += a
        allowed.append(al)
    step = [a + b for a, b in zip(t_mask, t_adv)]
    cold = [a + b for a, b in zip(cold_mask, cold_adv)]
    return dict(name=name, version=ver, vocab_ms=(t1 - t0) * 1e3, compile_ms=(t2 - t1) * 1e3,
                med_ms=statistics.median(step) * 1e3, p90_ms=pct(step, 0.9) * 1e3,
                mean_ms=statistics.mean(step) * 1e3, us_tok=statistics.mean(step) / batch * 1e6,
                mask_share=sum(t_mask) / sum(step), cold_mean_ms=statistics.mean(cold) * 1e3,
                cold_first_ms=cold[0] * 1e3, allowed=statistics.mean(allowed), steps=len(cold),
                threads=lib.threads_note(), probes=probe(lib, len(tokens)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=152000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="worker threads for the libraries with a parallel batch API")
    ap.add_argument("--passes", type=int, default=3, help="timed passes over the document, pooled")
    ap.add_argument("--libs", nargs="+", default=list(LIBS), choices=list(LIBS))
    args = ap.parse_args()

    t0 = time.perf_counter()
    tokens = build_vocab(args.vocab, args.seed)
    print(f"vocabulary: {len(tokens)} tokens ({sum(len(t) > 1 for t in tokens) - 1} multi-byte, mean "
          f"{statistics.mean(map(len, tokens)):.1f} bytes, EOS id {len(tokens) - 1}), built in "
          f"{time.perf_counter() - t0:.1f} s; document: {len(DOCUMENT)} bytes + EOS = {len(DOCUMENT) + 1} "
          f"steps x {args.passes} timed passes, batch {args.batch}")
    rows = []
    for name in args.libs:
        t = time.perf_counter()
        rows.append(measure(name, tokens, args.batch, args.threads, args.passes))
        print(f"  {name}: done in {time.perf_counter() - t:.1f} s", flush=True)

    hdr = (f"{'library':<14} {'version':<8} {'vocab ms':>8} {'compile ms':>10} {'step med ms':>11} "
           f"{'p90 ms':>7} {'mean ms':>8} {'us/seq-tok':>10} {'mask %':>6} {'cold mean':>9} "
           f"{'1st step':>8} {'allowed':>7}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<14} {r['error']}")
            continue
        print(f"{r['name']:<14} {r['version']:<8} {r['vocab_ms']:>8.0f} {r['compile_ms']:>10.1f} "
              f"{r['med_ms']:>11.3f} {r['p90_ms']:>7.3f} {r['mean_ms']:>8.3f} {r['us_tok']:>10.2f} "
              f"{r['mask_share'] * 100:>5.0f}% {r['cold_mean_ms']:>9.3f} {r['cold_first_ms']:>8.2f} "
              f"{r['allowed']:>7.0f}")
    print("(step = mask fill + advance for the whole batch; us/seq-tok = mean step / batch; cold mean and "
          "1st step, ms: the warm-up pass on fresh matchers; allowed: mean allowed tokens per row)")
    for r in rows:
        if "error" not in r:
            print(f"{r['name']:<14} enforces: " + ", ".join(
                f"{k} {'yes' if v else 'NO'}" for k, v in r["probes"].items() if k != "ws")
                + f"; whitespace after '{{': {'allowed' if r['probes']['ws'] else 'not allowed'}")
    print(f"threads: {os.cpu_count()} CPU cores, --threads {args.threads}; "
          + "; ".join(f"{r['name']}: {r['threads']}" for r in rows if "error" not in r))


if __name__ == "__main__":
    main()
