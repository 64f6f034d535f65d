"""What structured output costs: a batch of JSON-schema-constrained requests against the same
batch free, each request producing the same number of tokens.

    python bench/structured.py [--model M] [--load-format auto|dummy] [--device auto]
                               [--num-seqs 64] [--max-tokens 160] [--repeat 3]
                               [--schema bounded|plain]

The constrained run goes first (temperature 0.8, seeded); each free request then gets
max_tokens = its constrained twin's output length and ignore_eos, so both runs produce the
same tokens in the same steps. Reported: output tok/s of each, the engine thread's time in
`grammar_masks`, the time llguidance's fill took (with async scheduling on a thread of its own,
beside the engine thread), and a free run without async scheduling. With async scheduling a
constrained step is read during the next step's launch, once its forward is queued: the
grammars consume its tokens, the next masks are filled on their own thread while the engine
thread plans and builds the step after, and that step's launch first queues the masked
sampling (runtime/executor/grammar_masks.py).
"""

from __future__ import annotations

import argparse
import json
import time

# "bounded": lengths and patterns, which make llguidance's masks inside strings expensive
# (~0.1-0.4 ms at a 49k vocabulary); "plain": the same fields without them (~5-15 µs), whose
# strings a random model may never close (the output then ends at --max-tokens).
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "email", "tags", "address"], "additionalProperties": False}
PLAIN = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "email", "tags", "address"]}
SCHEMAS = {"bounded": SCHEMA, "plain": PLAIN}


def timed(cls, name: str) -> list[float]:
    """Patch method `name` of `cls` to sum its host time into the returned one-item list."""
    real, total = getattr(cls, name), [0.0]

    def wrapped(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - start

    setattr(cls, name, wrapped)
    return total


def workload_parser(description: str, num_seqs: int) -> argparse.ArgumentParser:
    """The workload's flags (model, device, sequences, tokens, schema), for this bench and
    bench/step_timeline.py, which times the same workload's calls."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-seqs", type=int, default=num_seqs)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--schema", choices=sorted(SCHEMAS), default="bounded")
    return parser


def main():
    parser = workload_parser(__doc__.splitlines()[0], num_seqs=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    from nanoinfer import LLM, SamplingParams

    from nanoinfer.structured.grammars import Grammars
    from runtime.executor import grammar_masks

    # (the runner imports grammar_masks() from its module at each step: the patch is seen)
    mask_time, fill_time = timed(grammar_masks, "grammar_masks"), timed(Grammars, "fill")
    consume_time = timed(Grammars, "consume")
    results, phases = {}, {}
    for name, engine_args in (("async", {}), ("sync", {"async_scheduling": False})):
        with LLM(args.model, device=args.device, load_format=args.load_format, progress=False,
                 max_num_seqs=max(args.num_seqs, 8), max_model_len=2048, cuda_graph_capture="all",
                 **engine_args) as llm:
            prompts = [[{"role": "user", "content": f"Describe person number {i} as JSON."}]
                       for i in range(args.num_seqs)]
            constrained = [SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens,
                                          structured_outputs={"json": SCHEMAS[args.schema]}) for i in range(args.num_seqs)]
            llm.generate(prompts[:2], constrained[:2], use_tqdm=False)  # warm-up: graphs, compile, grammar
            core = llm.engine.core

            def phases_since(before: tuple[dict, int]) -> dict:
                """Host ms per step in each of the engine's phases since `before`."""
                times, steps = before
                n = max(1, core.step_count - steps)
                return {k: round(1e3 * (v - times.get(k, 0.0)) / n, 2) for k, v in core.timer.phase_times.items()}

            for _ in range(args.repeat):
                if name == "async":
                    before, fill_before, consume_before = mask_time[0], fill_time[0], consume_time[0]
                    mark = (dict(core.timer.phase_times), core.step_count)
                    start = time.perf_counter()
                    outs = llm.generate(prompts, constrained, use_tqdm=False)
                    elapsed = time.perf_counter() - start
                    phases["constrained"] = phases_since(mark)
                    lengths = [len(o.outputs[0].token_ids) for o in outs]
                    valid = sum(1 for o in outs if _parses(o.outputs[0].text))
                    results.setdefault("constrained", []).append(
                        (sum(lengths) / elapsed, mask_time[0] - before, valid, sum(lengths), fill_time[0] - fill_before,
                         consume_time[0] - consume_before))
                free = [SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True)
                        for i, n in enumerate(lengths)]
                mark = (dict(core.timer.phase_times), core.step_count)
                start = time.perf_counter()
                llm.generate(prompts, free, use_tqdm=False)
                phases[f"free-{name}"] = phases_since(mark)
                results.setdefault(f"free-{name}", []).append((sum(lengths) / (time.perf_counter() - start),))
            device = str(llm.engine.model.params.device)
    best = {k: max(v, key=lambda r: r[0]) for k, v in results.items()}
    tok_s, masks, valid, tokens, fills, consumes = best["constrained"]
    print(f"device={device} schema={args.schema} seqs={args.num_seqs} tokens={tokens} (mean {tokens / args.num_seqs:.0f}/request), "
          f"valid JSON {valid}/{args.num_seqs}")
    print(f"constrained: {tok_s:8.1f} tok/s  (grammar masks: {1e6 * masks / tokens:.1f} µs of the engine thread per "
          f"token, llguidance's fill {1e6 * fills / tokens:.1f}; consuming tokens {1e6 * consumes / tokens:.1f})")
    for key in ("free-async", "free-sync"):
        print(f"{key:12s} {best[key][0]:8.1f} tok/s  (constrained at {tok_s / best[key][0]:.2f}x)")
    for key, per_step in phases.items():  # (the last repeat's)
        print(f"host ms per step, {key}: {per_step}")


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
