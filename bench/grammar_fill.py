"""What one row of a grammar mask costs in llguidance, the way the engine fills them: µs per row
for bench/structured.py's schema over token streams like that bench's, by how the sequences'
matchers are made and filled.

    python bench/grammar_fill.py [--model DIR] [--vocab 151936] [--seqs 8 64] [--threads 1 2]
                                 [--modes fresh copy same engine] [--schema bounded] [--tokens 160]
                                 [--streams FILE.json] [--lexers N]

DIR: a checkpoint directory with an HF tokenizer (`bench/dummy_checkpoint.py qwen3-0.6b DIR`:
the default model's SmolLM2 tokenizer, masks 151,936 wide as in bench/structured.py's runs);
without it, the default model's GGUF tokenizer. Token streams: each sequence takes, from a
mask, a seeded random token the grammar allows until the grammar ends or --tokens (a random
model at temperature 0.8 writes text like that: bounded strings of odd tokens), or the token
ids in --streams (a JSON list of lists: the outputs of a real run). Modes, each replaying the
same streams (a step: every live row's mask filled in one go, timed, then its token consumed):
- fresh: one matcher compiled per sequence (no lexer state shared), one llguidance call;
- copy: `deep_copy`s of one compilation, one call (the engine before the rounds; copies share
  one lexer behind a lock, so they are masked one at a time whatever the threads);
- same: copies that all follow stream 0 (every row at the same state);
- engine: nanoinfer.structured.grammars.Grammars (`constraint` per sequence, `fill`: --lexers
  compilations per spec, default two per thread, filled in rounds of one row per lexer).
Reported per mode and thread count: µs of wall time per row (all steps' fill time over all rows
filled), and the median and p90 of a step's wall time per row.

With --lock-check instead: do copies of one compilation mask in parallel? Python threads (llguidance
drops the GIL while masking) each replay their share of the streams, a matcher per stream, all
copies of one compilation or copies of a compilation per thread, against one thread doing one
share (wall time; 1.0x: the threads ran in parallel, N x: one at a time).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import numpy as np

from bench.structured import SCHEMAS


def tokenizer_of(model: str | None):
    from nanoinfer.text.tokenizer import Tokenizer

    if model:
        return Tokenizer.from_hf_dir(model)
    from nanoinfer.hub import DEFAULT_MODEL, resolve_model_name
    from nanoinfer.loaders.gguf import open_gguf

    path = Path(resolve_model_name(DEFAULT_MODEL))
    return Tokenizer.from_gguf(open_gguf(path), path)


def random_streams(new, vocab: int, seqs: int, tokens: int, seed: int) -> list[list[int]]:
    """Each sequence: a random token its mask allows at each step, until the grammar ends."""
    from nanoinfer.structured.bitmasks import allocate_bitmask, unpack_bitmask

    rng, mask, streams = np.random.default_rng(seed), allocate_bitmask(1, vocab), []
    for _ in range(seqs):
        m, out = new(), []
        while len(out) < tokens and not m.is_stopped():
            m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.shape[1] * 4)
            out.append(int(rng.choice(np.flatnonzero(unpack_bitmask(mask, vocab)[0].numpy()))))
            assert m.consume_token(out[-1]), m.get_error()
        streams.append(out)
    return streams


def replay(mode: str, threads: int, streams: list[list[int]], new, spec, tokenizer, vocab: int,
           lexers: int | None) -> tuple[np.ndarray, float, int]:
    """Replaying `streams` in `mode`: each step's fill time per row, all steps' fill time, rows filled."""
    from llguidance import LLExecutor

    from nanoinfer.structured.bitmasks import allocate_bitmask
    from nanoinfer.structured.grammars import Grammars

    n = len(streams)
    if mode == "same":
        streams = [streams[0]] * n
    mask = allocate_bitmask(n, vocab)
    if mode == "engine":
        grammars = Grammars(tokenizer, vocab, threads=threads, lexers=lexers)
        constraints = [grammars.constraint(spec) for _ in range(n)]

        def fill(live):
            grammars.fill([(constraints[i], i, ()) for i in live], mask)

        def consume(i, token):
            return constraints[i].consume(token)
    else:
        executor = LLExecutor(num_threads=threads)
        if mode == "fresh":
            matchers = [new() for _ in range(n)]
        else:
            template = new()
            template.unsafe_compute_mask_ptr(mask.data_ptr(), mask.shape[1] * 4)  # (as compiling does)
            matchers = [template.deep_copy() for _ in range(n)]

        def fill(live):
            executor.unsafe_compute_mask_ptr([(matchers[i], i) for i in live], mask.data_ptr(), mask.shape[1] * 4, n)

        def consume(i, token):
            return matchers[i].consume_token(token)
    per_row, total, rows = [], 0.0, 0
    for step in range(max(len(s) for s in streams)):
        live = [i for i, s in enumerate(streams) if step < len(s)]
        start = time.perf_counter()
        fill(live)
        took = time.perf_counter() - start
        per_row.append(took / len(live))
        total, rows = total + took, rows + len(live)
        for i in live:
            assert consume(i, streams[i][step])
    return np.array(per_row), total, rows


def lock_check(new, streams: list[list[int]], threads: int, vocab: int) -> None:
    from nanoinfer.structured.bitmasks import allocate_bitmask

    def replay_share(root, share):
        mask = allocate_bitmask(1, vocab)
        for stream in share:
            m = root.deep_copy()
            for token in stream:
                m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.shape[1] * 4)
                assert m.consume_token(token)

    def wall(roots, shares) -> float:
        workers = [threading.Thread(target=replay_share, args=(r, s)) for r, s in zip(roots, shares)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return time.perf_counter() - start

    shares = [streams[i::threads] for i in range(threads)]
    for _ in range(3):
        one = wall([new()], shares[:1])
        shared = new()
        copies = wall([shared] * threads, shares)
        own = wall([new() for _ in range(threads)], shares)
        print(f"  {threads} threads: copies of one compilation {copies / one:.2f}x one thread's share, "
              f"a compilation each {own / one:.2f}x (one share: {1e3 * one:.0f} ms)", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--seqs", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--modes", nargs="+", default=["fresh", "copy", "same", "engine"],
                        choices=["fresh", "copy", "same", "engine"])
    parser.add_argument("--schema", choices=sorted(SCHEMAS), default="bounded")
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--streams", default=None)
    parser.add_argument("--lexers", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lock-check", action="store_true")
    args = parser.parse_args()

    from llguidance import LLMatcher, LLParserLimits

    from nanoinfer.structured.grammars import MAX_ROW_ITEMS, grammar_tokenizer
    from nanoinfer.structured.spec import GrammarSpec

    tokenizer = tokenizer_of(args.model)
    llm_tokenizer = grammar_tokenizer(tokenizer, args.vocab)
    spec = GrammarSpec("json_schema", SCHEMAS[args.schema])
    grammar = spec.grammar()

    def new():  # (as nanoinfer.structured.grammars.Constraint compiles)
        return LLMatcher(llm_tokenizer, grammar, log_level=0,
                         limits=LLParserLimits(verbose_errors=False, max_items_in_row=MAX_ROW_ITEMS))

    recorded = json.loads(Path(args.streams).read_text()) if args.streams else None
    for seqs in args.seqs:
        streams = recorded[:seqs] if recorded else random_streams(new, args.vocab, seqs, args.tokens, args.seed)
        print(f"{len(streams)} sequences, {np.mean([len(s) for s in streams]):.0f} tokens each "
              f"(first: {tokenizer.decode(streams[0])[:80]!r})")
        if args.lock_check:
            for threads in args.threads:
                lock_check(new, streams, threads, args.vocab)
            continue
        for threads in args.threads:
            for mode in args.modes:
                per_row, total, rows = replay(mode, threads, streams, new, spec, tokenizer, args.vocab, args.lexers)
                print(f"  seqs={len(streams):3d} threads={threads:2d} {mode:6s}: {1e6 * total / rows:6.1f} µs/row  "
                      f"(step median {1e6 * np.median(per_row):5.1f}, p90 {1e6 * np.percentile(per_row, 90):5.1f})",
                      flush=True)


if __name__ == "__main__":
    main()
