"""Cold start: seconds from process start to the first token, with the compile cache cold and
warm, and where they go (imports, load, the engine's kernels, draw compile, KV pool sizing, graph
capture at start, first token and the graphs its steps captured on first use).

    python bench/cold_start.py CHECKPOINT_DIR [--load-format dummy] [--device cuda] [--cuda-graph-capture all]

`--cuda-graph-capture` is the engine's setting: lazy (the default: the largest buckets at start,
each other on its first use, inside the first request where it needs one) or all (every bucket
at start, as before lazy capture).

Each start is a new process (`--one`) with TRITON_CACHE_DIR (and TORCHINDUCTOR_CACHE_DIR, should
anything still use Inductor) pointing at a fresh directory (cold), then the same directory again
(warm: Triton's compiled kernels are on disk). Make a weightless checkpoint with
bench/dummy_checkpoint.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START = time.perf_counter()  # (as early as this process's own code can see)
ROOT = Path(__file__).resolve().parent.parent


def one(model: str, load_format: str, device: str, graph_capture: str) -> dict:
    marks = {}

    def mark(name: str, since: float) -> float:
        now = time.perf_counter()
        marks[name] = now - since
        return now

    clock = time.perf_counter()
    import torch

    from nanoinfer import SamplingParams
    from nanoinfer.loaders import load_model
    from runtime.executor import model_runner
    from runtime.async_engine import engine_config
    from runtime.engine.engine_core import EngineCore

    clock = mark("imports", clock)
    model = load_model(model, device=device, load_format=load_format, progress=False)
    if model.params.device.type == "cuda":
        torch.cuda.synchronize()
    clock = mark("load weights", clock)
    # Split the engine's start: its kernels (Triton and torch.compile set up), the sampler
    # draw's compile, KV pool sizing (a profiling step), graph capture (the layers' Triton
    # kernels compiled and the GEMVs autotuned), the rest; and from the first request the
    # graphs its steps captured on first use (the same compiles, for their buckets).
    from nanoinfer.backends.cuda.graphs import StepGraphs
    from runtime.executor import device_model

    phases = {}
    timed = {"engine: kernels (imports, compile setup)": (device_model, "kernels_for"),
             "engine: sampler draw compile": (device_model, "prepare"),
             "engine: KV sizing (profiling step)": (model_runner, "kv_blocks_for_memory"),
             "graph capture at start": (StepGraphs, "capture"),
             "first request: graph capture on first use": (StepGraphs, "_capture_on_first_use")}

    def timing(label, real):
        def run(*args, **kw):
            t = time.perf_counter()
            try:
                return real(*args, **kw)
            finally:
                phases[label] = phases.get(label, 0.0) + time.perf_counter() - t
        return run
    for label, (owner, name) in timed.items():
        setattr(owner, name, timing(label, getattr(owner, name)))
    core = EngineCore(model, engine_config(max_model_len=4096, cuda_graph_capture=graph_capture))
    clock = mark("engine: rest", clock)
    marks["engine: rest"] -= sum(phases.values())
    marks.update(phases)
    phases.clear()
    core.add_request(list(range(100, 120)), SamplingParams(temperature=0, max_tokens=1))
    while core.has_unfinished():
        core.step()
    mark("first request (prefill, first token)", clock)
    marks["first token at (epoch)"] = time.time()
    late = phases.get("first request: graph capture on first use", 0.0)
    marks["first request (prefill, first token)"] -= late
    marks["first request: graph capture on first use"] = late
    return marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cuda-graph-capture", default="lazy", choices=("lazy", "all"))
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.model, args.load_format, args.device, args.cuda_graph_capture)))
        return
    runs = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
               "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        for name in ("cold", "warm"):
            spawned = time.time()
            out = subprocess.run([sys.executable, str(ROOT / "bench" / "cold_start.py"), args.model, "--one",
                                  "--load-format", args.load_format, "--device", args.device,
                                  "--cuda-graph-capture", args.cuda_graph_capture],
                                 env=env, capture_output=True, text=True, check=True).stdout
            marks = json.loads(out.strip().splitlines()[-1])
            first = marks.pop("first token at (epoch)")
            marks["interpreter start"] = first - spawned - sum(marks.values())
            marks["total: process start to first token"] = first - spawned
            runs[name] = marks
    print(f"model {args.model}  load format {args.load_format}  device {args.device}  "
          f"cuda_graph_capture {args.cuda_graph_capture}")
    print(f"{'seconds':<42}{'cold cache':>12}{'warm cache':>12}")
    for key in runs["cold"]:
        print(f"{key:<42}{runs['cold'][key]:>12.2f}{runs['warm'].get(key, float('nan')):>12.2f}")


if __name__ == "__main__":
    main()
