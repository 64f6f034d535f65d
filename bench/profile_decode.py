"""Where a decode step's GPU time goes: a kernel table from torch.profiler, per step.

    python bench/profile_decode.py [--shape qwen3-0.6b] [--batch 1 256] [--context 100 600] [--steps 20]

For each (batch, context) pair: random bf16 weights in the shape, `batch` sequences with
`context`-token random prompts, prefilled, then `--steps` decode steps under the profiler.
Prints the wall time per step, the GPU kernel time per step (sum over kernels, so the gap
between the two is host time the GPU waited for), the host phases, the top kernels, and
the top host-side ops (CUDA runtime calls included).
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import torch


def profile(model, batch, context, steps, rows):
    from nanoinfer.sampling.sampler import SamplingParams
    from runtime.engine.engine_core import EngineConfig, EngineCore
    from runtime.engine_config import SchedulerConfig

    engine = EngineCore(model, EngineConfig(block_size=16, max_model_len=max(2048, context + 4 * steps + 64),
                                            gpu_memory_utilization=0.8, cuda_graph_capture="all",
                                            scheduler=SchedulerConfig(max_num_seqs=max(batch, 1),
                                                                      max_num_batched_tokens=8192)))
    rng = random.Random(0)
    for _ in range(batch):
        engine.add_request([rng.randrange(100, 10000) for _ in range(context)],
                           SamplingParams(temperature=0, max_tokens=4 * steps + 64, ignore_eos=True))
    while any(seq.num_output_tokens == 0 for seq in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    engine.timer.phase_times.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps * 1e3
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu = sum(e.self_device_time_total for e in kernels) / steps / 1e3
    phases = "  ".join(f"{k} {v / steps * 1e3:.3f}" for k, v in engine.timer.phase_times.items())
    print(f"\n== batch {batch}  context {context}: wall {wall:.3f} ms/step  GPU kernels {gpu:.3f} ms/step  "
          f"host phases (ms/step): {phases}")
    print(f"{'kernel':<90}{'calls/step':>11}{'us/step':>10}{'us/call':>9}")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:rows]:
        per_step = e.self_device_time_total / steps
        print(f"{e.key[:88]:<90}{e.count / steps:>11.1f}{per_step:>10.1f}{per_step * steps / e.count:>9.2f}")
    # Host side: where the step loop's own time goes, CUDA runtime calls included (a
    # cudaStreamSynchronize or cudaHostAlloc here is the host waiting on the device).
    host = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
    print(f"{'host op':<90}{'calls/step':>11}{'us/step':>10}")
    for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:rows]:
        print(f"{e.key[:88]:<90}{e.count / steps:>11.1f}{e.self_cpu_time_total / steps:>10.1f}")
    del engine


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--context", type=int, nargs="+", default=[100, 600])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=20)
    args = parser.parse_args()
    from bench.shapes import random_model

    model = random_model(args.shape)
    print(f"device {torch.cuda.get_device_name()}  shape {args.shape}")
    for batch, context in zip(args.batch, args.context):
        profile(model, batch, context, args.steps, args.rows)
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
