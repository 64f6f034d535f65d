"""Host time of a decode step, with a stub forward: what the engine costs beyond the model.

    python bench/step_overhead.py [--src OLD_CHECKOUT ...] [--batch 1 64 256] [--context 512]

Runs EngineCore's step loop on the CPU over a tiny model whose forward is replaced by a stub
(logits of zeros: no model work), so the time per step is the engine's own host work:
scheduling, building the batch, sampling set-up, launching, reading results back. Each
checkout given with --src (e.g. an older commit, for the old path beside the new) runs in
its own process with the same workload; the last row is this checkout. Prints one table:
microseconds per decode step (the median of the timed steps) at each batch size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(batch: int, context: int, steps: int) -> float:
    """Median host µs of a decode step at `batch` sequences of `context` tokens."""
    import torch

    import nanoinfer.model.decoder
    from nanoinfer import SamplingParams
    from nanoinfer.loaders import LoadedModel
    from runtime.async_engine import engine_config
    from runtime.engine.engine_core import EngineCore
    from tests.tiny import random_params, tiny_config

    real = nanoinfer.model.decoder.forward
    cfg = tiny_config(vocab_size=64, max_position_embeddings=8192)  # (the stub's "device" work: next to nothing)

    def stub(params, kv, batch_, cfg_, *args, **kw):
        return torch.zeros(batch_.logits_indices.shape[0], cfg_.vocab_size)

    for module in list(sys.modules.values()):  # every `from nanoinfer.model.decoder import forward`
        if module is not None and getattr(module, "forward", None) is real:
            module.forward = stub
    model = LoadedModel(cfg, random_params(cfg), None, Path("stub"))
    core = EngineCore(model, engine_config(block_size=16, num_blocks=batch * (-(-(context + steps + 8) // 16)) + 8,
                                           max_num_seqs=max(batch, 1), max_num_batched_tokens=max(4096, context)))
    # Greedy: on the CPU the sampler's own arithmetic would count as host time (on a GPU it is not).
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        core.add_request([1 + (i + j) % 60 for j in range(context)], params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in core.scheduler.running) or core.scheduler.waiting:
        core.step()  # prefill everything first: only decode steps are timed
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", action="append", default=[], help="another checkout to measure (repeatable)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # (a worker process)
    args = parser.parse_args()
    if args.one:
        import torch

        torch.set_num_threads(1)
        print(json.dumps([measure(b, args.context, args.steps) for b in args.batch]))
        return
    rows = []
    for src in [*args.src, str(ROOT)]:
        env = {**os.environ, "PYTHONPATH": src}
        out = subprocess.run([sys.executable, str(ROOT / "bench" / "step_overhead.py"), "--one", "--batch",
                              *map(str, args.batch), "--context", str(args.context), "--steps", str(args.steps)],
                             cwd=src, env=env, capture_output=True, text=True, check=True).stdout
        commit = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", src, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        rows.append((commit + ("+" if dirty else ""), json.loads(out.strip().splitlines()[-1])))
    print(f"host µs per decode step, stub forward, context {args.context} (median of {args.steps - 2} steps)")
    print("| checkout | " + " | ".join(f"batch {b}" for b in args.batch) + " |")
    print("|---|" + "---|" * len(args.batch))
    for name, values in rows:
        print(f"| {name} | " + " | ".join(f"{v:,.0f}" for v in values) + " |")


if __name__ == "__main__":
    main()
