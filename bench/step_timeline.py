"""Where a step's host time goes, per thread: the engine's calls timestamped, constrained and free.

    python -m bench.step_timeline [--model M] [--load-format dummy] [--device cuda]
                                  [--num-seqs 8] [--max-tokens 160] [--schema bounded|plain]

Runs bench/structured.py's workload (JSON-schema-constrained requests, then the same requests
free with as many tokens each) once each, with a fixed list of the engine's calls wrapped to
record when they start and end and on which thread (the engine's, the grammar masks' thread).
Prints, per run: each call's count, mean and total µs per step, sorted by total; then the calls
of three steps from the middle of the run, in start order, µs from the first one's start. The
wrappers cost a few µs a call: the runs are ~15% slower than bench/structured.py's, so read the
shares and the order, and take throughput from that bench. (bench/RESULTS.md, twenty-second
session: what it showed about a masked step's sampling.)
"""

from __future__ import annotations

import collections
import importlib
import threading
import time

from bench.structured import SCHEMAS, workload_parser

# (module, class or None, attribute): what is timed, where it is importable (the Triton ones need CUDA)
CALLS = [
    ("runtime.engine.engine_core", "EngineCore", "step"),
    ("runtime.engine.llm_engine", "LLMEngine", "step_requests"),
    ("runtime.engine.scheduler", "Scheduler", "plan"),
    ("runtime.engine.engine_core", "_ReadBetween", "__call__"),
    ("runtime.executor.model_runner", "ModelRunner", "launch"),
    ("runtime.executor.model_runner", "ModelRunner", "_build"),
    ("runtime.executor.model_runner", "ModelRunner", "queue_pending"),
    ("runtime.executor.model_runner", "ModelRunner", "_forward"),
    ("runtime.executor.model_runner", None, "_sample"),
    ("runtime.executor.model_runner", None, "sample"),
    ("runtime.executor.input_batch", "InputBatch", "sampling"),
    ("runtime.executor.step", "DeviceToHost", "__init__"),
    ("runtime.executor.step", "DeviceToHost", "wait"),
    ("runtime.executor.grammar_masks", None, "grammar_masks"),
    ("runtime.executor.grammar_masks", "StepMasks", "on_device"),
    ("nanoinfer.structured.grammars", "Grammars", "consume"),
    ("nanoinfer.structured.grammars", "Grammars", "fill"),
    ("nanoinfer.structured.grammars", "Grammars", "fill_later"),
    ("nanoinfer.structured.bitmasks", None, "apply_bitmask"),
    ("nanoinfer.backends.cuda.bitmask_triton", None, "masked_float_logits"),
    ("nanoinfer.sampling.draw", None, "processed_probs"),
    ("nanoinfer.backends.cuda.draw_triton", None, "triton_draw"),
]


class Recorder:
    """(thread, call, start, end) of every wrapped call since `clear`."""

    def __init__(self):
        self.events: list[tuple[str, str, float, float]] = []

    def clear(self) -> None:
        self.events = []

    def wrap(self, owner, attr: str, name: str) -> None:
        real = getattr(owner, attr)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.events.append((threading.current_thread().name[:12], name, start, time.perf_counter()))

        setattr(owner, attr, timed)

    def wrap_all(self) -> None:
        """Every call of CALLS that imports here (model_runner imports `sample` by name: wrapped there)."""
        for module, cls, attr in CALLS:
            try:
                owner = importlib.import_module(module)
            except ImportError:  # (a CUDA-only kernel module without Triton)
                continue
            owner = getattr(owner, cls) if cls else owner
            self.wrap(owner, attr, f"{cls}.{attr}" if cls else attr)

    def report(self, label: str, elapsed: float, tokens: int) -> None:
        steps = [e for e in self.events if e[1] == "EngineCore.step"]
        n = max(1, len(steps))
        print(f"=== {label}: {tokens / elapsed:.0f} tok/s, {len(steps)} steps, {1e3 * elapsed / n:.3f} ms a step")
        calls = collections.defaultdict(list)
        for thread, name, start, end in self.events:
            calls[(thread, name)].append(end - start)
        for (thread, name), spans in sorted(calls.items(), key=lambda kv: -sum(kv[1])):
            print(f"  {thread:12s} {name:28s} n={len(spans):5d}  mean {1e6 * sum(spans) / len(spans):8.1f} µs"
                  f"  per step {1e6 * sum(spans) / n:8.1f}")
        if len(steps) < 4:
            return
        mid = min(len(steps) // 2, len(steps) - 4)
        first, last = steps[mid][2], steps[mid + 3][2]
        print("  three steps (µs from the first one's start):")
        for thread, name, start, end in sorted(self.events, key=lambda e: e[2]):
            if first <= start < last:
                print(f"    {thread:12s} {name:28s} {1e6 * (start - first):8.0f} .. {1e6 * (end - first):8.0f}"
                      f"  ({1e6 * (end - start):6.0f})")


def main():
    args = workload_parser(__doc__.splitlines()[0], num_seqs=8).parse_args()

    recorder = Recorder()
    recorder.wrap_all()  # (before the engine is made: the kernels it picks are the wrapped ones)
    from nanoinfer import LLM, SamplingParams

    with LLM(args.model, device=args.device, load_format=args.load_format, progress=False,
             max_num_seqs=max(args.num_seqs, 8), max_model_len=2048, cuda_graph_capture="all") as llm:
        prompts = [[{"role": "user", "content": f"Describe person number {i} as JSON."}] for i in range(args.num_seqs)]
        constrained = [SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens,
                                      structured_outputs={"json": SCHEMAS[args.schema]}) for i in range(args.num_seqs)]
        llm.generate(prompts[:2], constrained[:2], use_tqdm=False)  # warm-up: graphs, compile, grammar
        lengths = None
        for label in ("constrained", "free"):
            params = constrained if lengths is None else [
                SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
            recorder.clear()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            lengths = [len(o.outputs[0].token_ids) for o in outs]
            recorder.report(f"{label}, {args.num_seqs} sequences", elapsed, sum(lengths))


if __name__ == "__main__":
    main()
