"""Tune the GEMV kernels on this GPU for given model shapes and write their winners as the GPU's shipped table.

    python tools/dump_tuned_configs.py --shape qwen3-0.6b llama-3.2-1b llama-3.1-8b [--quantization none int8]
                                       [--device cuda] [--out nanoinfer/backends/cuda/tuned]

For each shape (bench/shapes.py, random weights made on the device) and weight form, an engine
starts as a server's does (its graph capture runs every GEMV variant it will run) and answers one
request, with NANOINFER_AUTOTUNE=full: every key tunes over all its configs, whatever tables
ship. Then each nanoinfer.backends.cuda.gemv Autotuner's cache (key -> the winning Config) is merged into
`<out>/<device file stem>.json` (nanoinfer.backends.cuda.tuned_configs), which a start on the same GPU model
reads to compile one config per key instead of all of them. Keys already in the file and not
tuned here are kept; keys tuned here replace theirs. The file is written after each shape.

Triton's own autotune cache (TRITON_CACHE_DIR) may answer a key from an earlier full tuning on
this machine; that is a full tuning's winner too. Needs a CUDA GPU; stops at the first error.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # (bench.shapes, and this tree's nanoinfer when run from a checkout)

# Before nanoinfer.backends.cuda.gemv's hooks first run: tune every key over all configs, whatever tables ship.
os.environ["NANOINFER_AUTOTUNE"] = "full"


# Kernels whose choices tools/sweep_int4_gemv.py writes, timed as a decode step runs them: the
# tuner's 20 ms picks here would overwrite them with slower ones (bench/RESULTS.md, twenty-fifth session).
SWEPT = ("_int4_gemv_kernel",)


def say(message: str) -> None:
    print(f"[dump_tuned_configs {time.strftime('%H:%M:%S')}] {message}", flush=True)


def gemv_autotuners() -> dict:
    """The Autotuners of nanoinfer.backends.cuda.gemv and int4_gemv by the kernel name their ShippedChoice hook
    looks tables up by."""
    from triton.runtime.autotuner import Autotuner

    from nanoinfer.backends.cuda import gemv, int4_gemv
    from nanoinfer.backends.cuda.tuned_configs import ShippedChoice

    found = {}
    for module in (gemv, int4_gemv):
        for attr, value in vars(module).items():
            if not isinstance(value, Autotuner):
                continue
            hook = value.early_config_prune
            if not isinstance(hook, ShippedChoice) or hook.kernel != value.base_fn.__name__:
                raise SystemExit(f"{module.__name__}.{attr}: expected prune_configs_by={{'early_config_prune': "
                                 f"ShippedChoice({value.base_fn.__name__!r})}}, found {hook!r}")
            found[hook.kernel] = value
    if not found:
        raise SystemExit("nanoinfer.backends.cuda.gemv and int4_gemv have no Triton Autotuner: nothing to dump")
    return found


def warm_up(shape: str, quantization: str, device: str) -> None:
    """Start an engine on `shape` as a server does (graph capture included) and answer one request."""
    import dataclasses

    import torch

    from bench.shapes import random_model
    from nanoinfer.loaders.quantize import quantize_params
    from nanoinfer.sampling.sampler import SamplingParams
    from runtime.engine_config import engine_config
    from runtime.engine.engine_core import EngineCore

    model = random_model(shape, device=device)
    if quantization != "none":
        model = dataclasses.replace(model, params=quantize_params(model.params, quantization),
                                    quantization=quantization)
    torch.cuda.synchronize()
    core = EngineCore(model, engine_config(max_model_len=4096))
    try:
        core.add_request(list(range(100, 120)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        while core.has_unfinished():
            core.step()
        torch.cuda.synchronize()
    finally:
        core.close()
        del core, model
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    from nanoinfer.backends.cuda.tuned_configs import TUNED_DIR  # (the tables the package ships)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", nargs="+", required=True, help="bench/shapes.py names, e.g. qwen3-0.6b")
    parser.add_argument("--quantization", nargs="+", default=["none"], choices=["none", "int8", "fp8", "int4"],
                        help="weight forms to tune for (each has GEMV keys of its own); default none (bf16)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=TUNED_DIR, help="the tables' directory")
    args = parser.parse_args()

    import torch

    from bench.shapes import SHAPES
    from nanoinfer.backends.cuda.tuned_configs import (KernelTable, choices_from_cache, merge, read_table, table_path,
                                                       write_table)

    unknown = [s for s in args.shape if s not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown --shape {', '.join(unknown)}: expected some of {', '.join(SHAPES)}")
    if not torch.cuda.is_available() or not args.device.startswith("cuda"):
        raise SystemExit(f"--device {args.device}: a CUDA GPU is needed (torch.cuda.is_available() is "
                         f"{torch.cuda.is_available()})")
    import triton

    device_name = torch.cuda.get_device_name(torch.device(args.device))
    path = table_path(device_name, args.out)
    _, before = read_table(path)  # (a malformed file stops us here, before minutes of tuning)
    tuners = gemv_autotuners()
    say(f"device {device_name!r}, triton {triton.__version__}, torch {torch.__version__}; table {path} "
        f"({sum(len(k.choices) for k in before.values())} choices now); kernels {', '.join(tuners)}")

    start = time.perf_counter()
    for shape in args.shape:
        for quantization in args.quantization:
            t = time.perf_counter()
            say(f"{shape} ({quantization}): starting an engine, tuning every GEMV key it runs ...")
            warm_up(shape, quantization, args.device)
            tuned = {name: KernelTable(tuple(tuner.keys), choices_from_cache(tuner.cache))
                     for name, tuner in tuners.items() if tuner.cache and name not in SWEPT}
            if not tuned:
                raise SystemExit(f"{shape} ({quantization}): no GEMV key was tuned: the engine never ran a Triton "
                                 "GEMV (weights the kernels do not take?); nothing written")
            # (written after each shape: a run cut short keeps what it tuned)
            table = merge(before, tuned)
            write_table(path, device_name, table, triton.__version__)
            counts = ", ".join(f"{name} {len(tuner.cache)}" for name, tuner in tuners.items())
            say(f"{shape} ({quantization}): done in {time.perf_counter() - t:.1f} s; keys tuned so far: {counts}; "
                f"{path} holds {sum(len(k.choices) for k in table.values())} choices")
    say(f"done in {time.perf_counter() - start:.1f} s: {path}")

if __name__ == "__main__":
    main()
