"""Structured output's grammars: each request's GrammarSpec (spec.py) compiled, cached and copied per sequence,
and its per-step token masks filled (into bitmasks.py's rows, which are applied to the logits on the device).

llguidance computes the masks (picked by measurement and maintenance: bench/grammar_masks.py,
bench/RESULTS.md). A sequence's `Constraint` fills its rows of a packed bitmask (int32 words,
bit t of word t // 32 set: token t allowed) on the host while the device runs the step's
forward; the rows go to the device in one copy and `apply_bitmask` turns the disallowed
logits to -inf there (on CUDA one Triton kernel does: nanoinfer/backends/cuda/bitmask_triton.py, tested
against it), so the sampler needs no per-row round trip. After a token is resolved,
`consume` advances the grammar (runtime/engine/engine_core.py); with async scheduling the next
masks are then filled on a thread of their own (`Grammars.fill_later`) while the engine thread
plans the step after (runtime/executor/grammar_masks.py).

Whitespace inside JSON is not free (`whitespace_flexible` off): OpenAI's strict JSON mode
emits compact JSON, and a model cannot then pad an answer forever. For the same reason a JSON
schema's objects allow only the keys they declare unless the schema says otherwise: the schema
is rewritten before it compiles (nanoinfer/structured/closed_schema.py says how, and what the peers do).

Grammars come from clients, so compiling one must never end the process: llguidance's
compiler recurses once per level of rule or `$ref` nesting (a Lark chain `r0: r1`, `r1: r2`,
... takes ~3 KB of stack a level, a `$ref` chain through object properties ~9 KB), and a
chain of ~2,500 rules overflowed an 8 MB thread stack (a segfault). So every grammar is
compiled on one thread with a COMPILE_STACK_BYTES stack, after `GrammarSpec.check_bounds`
has bounded what may nest there (rules, `$ref`s, bytes, choices: generous for real grammars,
the stack holds ~10x the worst nesting they allow); the compiled grammar is cached, and each
sequence gets a copy (copying, masking and dropping do not recurse). A grammar that is invalid,
or whose first mask shows that no output satisfies it, or a Lark grammar whose start derives no
finite string (nanoinfer/structured/lark_check.py), is a RequestError when it is compiled.

llguidance's copies (`LLMatcher.deep_copy`) share their compiled grammar's lexer, its cache
of lexer states, behind one lock that a mask or a consumed token holds throughout: the copies
of one compilation are masked one at a time whatever the thread count (8 rows of one schema
took 2.5 ms a step on a 16-core host, where one thread does them in ~0.5 ms; two threads
masking copies of one compilation took 2.5x one thread's time, a compilation each 1.1x:
bench/RESULTS.md). So a spec is compiled up to twice per fill
thread (`Grammars.lexers_for`), its sequences' copies are spread over these lexers, and a fill
runs in rounds that each hold at most one row per lexer (`in_rounds`): rows in one round never
wait for each other, and copies still share the lexer states their siblings built. A fill on
its own thread (`fill_later`) is one call instead: between rounds that thread would wait for
the GIL, which the engine thread holds while it plans (measured slower, bench/RESULTS.md).
"""

from __future__ import annotations

import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from nanoinfer.errors import RequestError
from nanoinfer.structured.bitmasks import allocate_bitmask, fill_row
from nanoinfer.structured.spec import GrammarSpec
# Earley items one row may hold: an anyOf, enum or choice of n alternatives makes a row of ~n,
# and llguidance's default (2,000) failed such a grammar at its first token. Each step's work
# stays bounded by llguidance's items-per-step limit (50,000: ~2.5 ms).
MAX_ROW_ITEMS = 20_000
COMPILE_STACK_BYTES = 256 << 20
# The compiled grammars a Grammars keeps, by their specs' text: one takes ~40x its text (a 0.7 MB
# schema ~26 MB), so at most ~300 MB however large the grammars clients send.
CACHE_GRAMMAR_BYTES = 8 << 20  # the compile thread's stack: reserved address space, touched as used
# What a spec's compilations (one per fill thread, see above) may take together: one takes ~40x
# the spec's text, so a large grammar gets fewer lexers than there are threads (a 0.7 MB schema 2).
LEXER_BYTES = 64 << 20
# ... and the time their compiling may take (the engine thread waits for each, as a sequence comes):
# ~0.5 ms each for bench/structured.py's schema, so a grammar that compiles in 20 ms gets one.
LEXER_COMPILE_S = 0.02

# What a grammar's fill raises when the grammar fails (`Constraint._check`), or llguidance refuses
# a call (its Python layer's errors); anything else is a bug of ours, not contained as a grammar's.
GRAMMAR_ERRORS = (RequestError, ValueError, RuntimeError)

# llguidance's errors when one of its parser limits is reached (they say "items", "fuel" or "TooComplex")
_TOO_COMPLEX = re.compile(r"Too many items|has \d+ items; max is|TooComplex|fuel|lexer states")


def grammar_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of a model's tokenizer (each token's bytes, EOS), masks `vocab_size`
    wide (the model's logits: a padded vocabulary's extra ids are never allowed). Expensive
    (~1 s for a large vocabulary): once per model."""
    from llguidance import LLTokenizer

    spec = tokenizer.tokenizers_json()
    if spec is None:
        raise RequestError(f"structured output needs a Hugging Face `tokenizers` vocabulary; {tokenizer.source} "
                           "has another kind", param="response_format")
    return LLTokenizer(spec, n_vocab=vocab_size, eos_token=list(tokenizer.eos_token_ids) or None)


@dataclass
class _Compiled:
    """A spec's compilations: independent matchers that have consumed nothing (`lexers`: the
    first checked when compiled, more made as sequences come, one lexer-state cache each), and
    how many copies of them were handed out (spread round-robin)."""

    grammar: str
    lexers: list
    compile_s: float  # (the first's)
    handed: int = 0


def fill_threads() -> int:
    """llguidance's own default: 80% of the usable cores, 1 to 32."""
    return min(32, max(1, len(os.sched_getaffinity(0)) * 80 // 100))


class Grammars:
    """A model's grammar compiler: llguidance's view of its tokenizer (built on first use),
    and the compiled grammars of recent specs (a request is checked where it is submitted,
    then each of its sequences constrained by a copy where they run). Compiling runs on one
    thread of its own (its stack: COMPILE_STACK_BYTES), queued: callers wait on a future
    (`compile`), or block (`check`, `constraint`). Masks are filled on `threads` threads
    (default: llguidance's), now or on a thread of their own (`fill_later`), a spec's sequences
    spread over up to `lexers` compilations of it (default: two per thread, so that a round has
    rows to balance over the threads; the module's docstring says why); tokens are consumed on
    the caller's thread."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 64, cache_bytes: int = CACHE_GRAMMAR_BYTES,
                 threads: int | None = None, lexers: int | None = None):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.cache_size, self.cache_bytes = cache_size, cache_bytes
        self.threads = threads or fill_threads()
        self.lexers = lexers or (1 if self.threads == 1 else 2 * self.threads)
        self._cached_bytes = 0  # the cached specs' sizes (CACHE_GRAMMAR_BYTES says why)
        self._llm_tokenizer = None  # (written and read on the compile thread only)
        # spec -> its compilations, or the message saying why it cannot be compiled
        self._compiled: dict[GrammarSpec, _Compiled | str] = {}
        self._lock = threading.Lock()  # guards _compiled and _compiler (the engine thread and the server's use them)
        self._compiler: ThreadPoolExecutor | None = None
        self._executor = None  # llguidance's thread pool, made on first use
        self._filler: ThreadPoolExecutor | None = None  # fill_later's thread, made on first use

    def compile(self, spec: GrammarSpec) -> "Future[None]":
        """Compile `spec` on the compile thread unless it is cached: a future whose result()
        is None, or raises RequestError naming what makes it unusable (a refusal is cached
        too). The first compile also builds llguidance's tokenizer (~0.3 s), unless `prepare`
        did."""
        with self._lock:
            hit = self._compiled.get(spec)
        if hit is not None:
            future = Future()
            if isinstance(hit, str):
                future.set_exception(RequestError(hit, param=spec.param))
            else:
                future.set_result(None)
            return future
        return self._compiler_().submit(self._compile, spec)

    def check(self, spec: GrammarSpec) -> None:
        """`compile(spec)`, waited for."""
        self.compile(spec).result()

    def constraint(self, spec: GrammarSpec) -> "Constraint":
        """A fresh Constraint for `spec` (compiled first if need be): a copy of one of its
        compilations, the next in turn (compiled now if it is new, up to `lexers_for(spec)`);
        RequestError naming what makes it unusable."""
        self.check(spec)
        with self._lock:
            compiled = self._compiled.get(spec)
            if isinstance(compiled, _Compiled):
                at = compiled.handed % self.lexers_for(spec, compiled.compile_s)
                compiled.handed += 1
                lexer = compiled.lexers[at] if at < len(compiled.lexers) else None
        if not isinstance(compiled, _Compiled):  # (the cache dropped it meanwhile: one of its own)
            lexer = self._compiler_().submit(self._compile, spec, True).result().lexers[0]
            return Constraint.of(spec, lexer, lexer)
        if lexer is None:
            lexer = self._compiler_().submit(self._lexer, spec, compiled, at).result()
        return Constraint.of(spec, lexer.deep_copy(), lexer)

    def lexers_for(self, spec: GrammarSpec, compile_s: float = 0.0) -> int:
        """How many compilations of `spec` (one taking `compile_s`) its sequences are spread
        over (LEXER_BYTES, LEXER_COMPILE_S)."""
        return max(1, min(self.lexers, LEXER_BYTES // max(1, 40 * spec.size), int(LEXER_COMPILE_S // compile_s)
                          if compile_s else self.lexers))

    def prepare(self) -> None:
        """Build llguidance's view of the tokenizer now (~0.3 s, holding the GIL: a server
        calls this before it serves), and its token tables on the compile thread, which the
        first structured request would otherwise wait for. Nothing when this model cannot have
        structured output."""
        try:
            tokenizer = self._new_tokenizer("response_format")
        except RequestError:
            return
        self._compiler_().submit(self._warm, tokenizer)

    def _compiler_(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._compiler is None:
                # One thread, started now so that it is made with the big stack (the setting is
                # process-wide: restored at once; a thread started meanwhile gets a big stack too).
                previous = threading.stack_size(COMPILE_STACK_BYTES)
                try:
                    self._compiler = ThreadPoolExecutor(1, thread_name_prefix="nanoinfer-grammars")
                    self._compiler.submit(lambda: None).result()
                finally:
                    threading.stack_size(previous)
            return self._compiler

    def _lexer(self, spec: GrammarSpec, compiled: _Compiled, at: int):
        """On the compile thread: `compiled`'s compilation `at`, made now if it is new (the
        grammar compiled before: it cannot fail now)."""
        if at < len(compiled.lexers):  # (appended on this thread only: no lock needed to read)
            return compiled.lexers[at]
        while len(compiled.lexers) <= at:
            lexer = Constraint(self._llm_tokenizer, spec, compiled.grammar).matcher
            with self._lock:
                compiled.lexers.append(lexer)
        return compiled.lexers[at]

    def _compile(self, spec: GrammarSpec, fresh: bool = False) -> _Compiled:
        """On the compile thread: `spec`'s compilations, cached (a fresh one, not cached, with
        `fresh`: the cache dropped it meanwhile); RequestError, cached too, naming what makes
        it unusable."""
        with self._lock:
            hit = self._compiled.get(spec)
        if hit is not None and not fresh:
            if isinstance(hit, str):
                raise RequestError(hit, param=spec.param)
            return hit
        if self._llm_tokenizer is None:
            self._warm(self._new_tokenizer(spec.param))
        try:
            start = time.perf_counter()
            grammar = spec.grammar()
            matcher = Constraint(self._llm_tokenizer, spec, grammar).matcher
            compile_s = time.perf_counter() - start
            # llguidance finds no token to start an empty language with (a regex [^\s\S], a rule
            # that only calls itself): better a 400 now than a failure once generation started.
            first = torch.zeros((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
            fill_row(matcher, first, 0)
            if matcher.is_error() or not (matcher.is_accepting() or first.any()):
                raise RequestError(f"the {spec.kind} cannot constrain generation: no output satisfies it "
                                   f"(not even its first token)", param=spec.param)
            # (one that starts but never ends, `a: "x" a`, llguidance meets only once output started)
            unproductive = None
            if spec.kind == "grammar":  # (nanoinfer/structured/lark_check.py: imported only when a Lark grammar comes)
                from nanoinfer.structured.lark_check import unproductive_start

                unproductive = unproductive_start(spec.value)
            if unproductive:
                raise RequestError(f"the grammar cannot constrain generation: no output satisfies it (no finite "
                                   f"string derives from rule {', '.join(unproductive[:5])})", param=spec.param)
            compiled = _Compiled(grammar, [matcher], compile_s)
        except RequestError as exc:
            compiled = str(exc)
        if not fresh:
            with self._lock:
                while self._compiled and (len(self._compiled) >= self.cache_size
                                          or self._cached_bytes + spec.size > self.cache_bytes):
                    oldest = next(iter(self._compiled))
                    del self._compiled[oldest]
                    self._cached_bytes -= oldest.size
                self._compiled[spec] = compiled
                self._cached_bytes += spec.size
        if isinstance(compiled, str):
            raise RequestError(compiled, param=spec.param)
        return compiled

    def _new_tokenizer(self, param: str):
        if self.tokenizer is None:
            raise RequestError("structured output needs the model's tokenizer, and this model has none", param=param)
        return grammar_tokenizer(self.tokenizer, self.vocab_size)

    def _warm(self, tokenizer) -> None:
        """On the compile thread: use `tokenizer` from now on, its token tables built (on
        the first mask: here, with any grammar)."""
        if self._llm_tokenizer is None:
            Constraint(tokenizer, GrammarSpec("regex", "a")).fill(allocate_bitmask(1, self.vocab_size), 0)
            self._llm_tokenizer = tokenizer

    def consume(self, pairs: list[tuple["Constraint", int]]) -> list[bool]:
        """`Constraint.consume` for each (constraint, token): whether each token continued its
        grammar. On this thread, one after the other: a token takes ~5 µs, and llguidance's
        parallel call cost 2-4x that a row in the engine (measured on a 16-core H100 host)."""
        return [c.consume(token) for c, token in pairs]

    def _executor_(self):
        from llguidance import LLExecutor

        if self._executor is None:
            self._executor = LLExecutor(num_threads=self.threads)
        return self._executor

    def fill(self, rows: list[tuple["Constraint", int, list[int]]], bitmask: torch.Tensor,
             rounds: bool = True) -> None:
        """Fill host `bitmask`'s rows as `Constraint.fill` does for each (constraint, row,
        drafts), in parallel on llguidance's threads (without the GIL: a mask over a large
        vocabulary inside a JSON string takes ~0.05-0.3 ms), in rounds (`in_rounds`), or
        without (`rounds=False`: one call, where the rows of one lexer wait for each other)."""
        executor = self._executor_()
        assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and not bitmask.is_cuda
        where = (bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
        for batch in in_rounds(self.threads, rows) if rounds else [rows] if rows else []:
            plain = [(c.matcher, row) for c, row, drafts in batch if not drafts]
            drafting = [(c.matcher, row, list(drafts)) for c, row, drafts in batch if drafts]
            if plain:
                executor.unsafe_compute_mask_ptr(plain, *where)
            if drafting:  # (llguidance refuses an empty draft list there)
                executor.unsafe_compute_mask_ptr_with_draft_token(drafting, *where)
        for c, _, _ in rows:
            c._check("computing the next tokens")

    def fill_later(self, rows: list[tuple["Constraint", int, list[int]]], bitmask: torch.Tensor) -> Future:
        """`fill`, on a thread of its own (llguidance's threads do the masking, without the GIL,
        while the caller goes on): a future whose result() is None once every row is filled.
        Never an error: a row whose fill fails allows every token and its constraint keeps the
        error (`Constraint.failure`), so that the token sampled from it fails that request alone
        when it is consumed. Nothing else may use these constraints until the future is done.

        The GIL decides how soon that thread starts: asked for while the caller runs Python, it
        comes after up to 5 ms (the interpreter's switch interval). So the caller waits here
        until the fill has started (it then holds the GIL only to enter llguidance), and the
        rows go in one call: between rounds the thread would wait for the GIL again."""
        with self._lock:
            if self._filler is None:
                self._filler = ThreadPoolExecutor(1, thread_name_prefix="nanoinfer-masks")
        started = threading.Event()

        @torch.inference_mode()  # (as the engine thread that made the bitmask)
        def contained() -> None:
            started.set()
            try:
                self.fill(rows, bitmask, rounds=False)
            except GRAMMAR_ERRORS:  # each row again, alone, to find whose grammar failed
                for item in rows:
                    try:
                        self.fill([item], bitmask)
                    except GRAMMAR_ERRORS as exc:  # kept for the request it belongs to
                        constraint, row, drafts = item
                        constraint.failure = exc
                        bitmask.numpy()[row:row + len(drafts) + 1] = -1

        future = self._filler.submit(contained)
        started.wait(0.1)
        return future


class Constraint:
    """One sequence's grammar state: the tokens it has consumed so far."""

    def __init__(self, llm_tokenizer, spec: GrammarSpec, grammar: str | None = None):
        """`spec` compiled here, on this thread (`Grammars.constraint` compiles on its own
        thread, once per spec)."""
        from llguidance import LLMatcher, LLParserLimits

        self.spec = spec
        self.lexer = self  # (`Constraint.of`'s: the compilation whose lexer its matcher shares)
        self.failure: Exception | None = None  # why a mask could not be filled (`Grammars.fill_later`)
        # (terse errors: a verbose one holds the parser's state and the whole grammar, for every log line)
        self.matcher = LLMatcher(llm_tokenizer, grammar if grammar is not None else spec.grammar(), log_level=0,
                                 limits=LLParserLimits(verbose_errors=False, max_items_in_row=MAX_ROW_ITEMS))
        if self.matcher.is_error():
            raise RequestError(f"the {spec.kind} cannot constrain generation: {self.error}", param=spec.param)

    @classmethod
    def of(cls, spec: GrammarSpec, matcher, lexer) -> "Constraint":
        """Over a compiled matcher (that has consumed nothing): `spec`'s, a copy of `lexer`
        (which it shares lexer states with, behind one lock: `Grammars` masks them one at a time)."""
        constraint = cls.__new__(cls)
        constraint.spec, constraint.matcher, constraint.lexer = spec, matcher, lexer
        constraint.failure = None
        return constraint

    def _check(self, doing: str) -> None:
        if self.matcher.is_error():
            raise RequestError(f"{self.spec.kind} constraint failed {doing}: {self.matcher.get_error()}",
                               param=self.spec.param)

    def fill(self, bitmask: torch.Tensor, row: int, drafts: list[int] = ()) -> None:
        """Row `row` of host `bitmask`: the tokens the grammar allows next; with `drafts` (a
        speculative step's), rows row + 1.. too, each allowing what may follow the drafts
        before it. Rows past a draft the grammar rejects are left as they are: verification
        rejects that draft (its probability is 0), so they are never read. (One row at a
        time, on this thread: the reference for `Grammars.fill`, which the engine uses.)"""
        valid = self.matcher.validate_tokens(drafts) if drafts else 0
        for i in range(valid + 1):
            fill_row(self.matcher, bitmask, row + i)
            self._check("computing the next tokens")
            if i < valid:
                self.matcher.consume_token(drafts[i])
        if valid:
            self.matcher.rollback(valid)

    def consume(self, token: int) -> bool:
        """Advance past a sampled `token`; False if the grammar does not allow it (only when
        the mask left nothing to sample, min_tokens banning the end the grammar requires), or
        if its mask could not be filled (`failure`)."""
        return self.failure is None and self.matcher.consume_token(token) and not self.matcher.is_error()

    @property
    def error(self) -> str:
        error = self.matcher.get_error().replace("<non-verbose/>", "").strip()
        return error or "the token does not continue it"

    @property
    def too_complex(self) -> bool:
        """llguidance gave up on the grammar at this point of the output: one of its limits
        (Earley items in a row or a step, lexer states or fuel) was reached."""
        return self.matcher.is_error() and bool(_TOO_COMPLEX.search(self.matcher.get_error()))

    @property
    def finished(self) -> bool:
        """Nothing may follow but the end of the sequence (a complete JSON document, say)."""
        return self.matcher.is_stopped()

    @property
    def done(self) -> bool:
        """The output may end here (more may follow: a regex `[0-9]+`, say)."""
        return self.matcher.is_stopped() or self.matcher.is_accepting()


def in_rounds(threads: int, items: list) -> list[list]:
    """`items` (a Constraint first in each) in rounds that each hold at most one constraint per
    lexer (the copies of one compilation wait for each other's lock: see the module's
    docstring), each lexer's items in their order. All in one round on one thread (nothing runs
    beside it)."""
    if threads == 1:
        return [items] if items else []
    rounds, seen = [], {}
    for item in items:
        k = seen[id(item[0].lexer)] = seen.get(id(item[0].lexer), -1) + 1
        if k == len(rounds):
            rounds.append([])
        rounds[k].append(item)
    return rounds
