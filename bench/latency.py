"""Batch-1 decode speed on the GPU: random bf16 weights in real shapes, NanoInfer beside
transformers (eager) in the same run.

    python bench/latency.py [--shapes qwen3-0.6b llama-3.2-1b llama-3.1-8b] [--new-tokens 200]
                            [--quantization none int8 fp8 int4 gpt-fast-int8 gpt-fast-int4]
                            [--tensor-parallel-size 1 2] [--variants overlap no-overlap eager]
                            [--plot FILE.png]

5-token prompt, greedy, `ignore_eos`. Decode tok/s counts the tokens after the first; achieved
bandwidth = weight bytes read per token x tok/s. Also prints where a NanoInfer step's host
time goes (schedule / batch / forward launch / sample launch / resolve, which waits for the
device: with overlap, for the step before).

`--quantization` quantizes the random weights at load (nanoinfer.loaders.quantize) and times
the graphs path for each. `gpt-fast-int8` is gpt-fast's int8 weight-only method inside our
engine, as the baseline for ours: the same int8 weights, but every projection computed as
`F.linear(x, w.to(bf16)) * scale` in the compiled graph (gpt-fast's WeightOnlyInt8Linear),
where ours runs the Triton GEMV at batch 1. `gpt-fast-int4` likewise runs the projections of
`int4` (groups of 128) through torch's `_weight_int4pack_mm`, gpt-fast's int4 kernel
(bench/gpt_fast_int4.py), where ours runs nanoinfer.backends.cuda.int4_gemv's `int4_mm`, and its LM head in int4
too, as gpt-fast's method has it (ours: int8).

`--tensor-parallel-size` times the engine at each size given (its graphs and eager paths:
one GPU per rank); a size of 1 is the plain engine.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch


def time_ours(model, new_tokens, enforce_eager=False, async_scheduling=None, tensor_parallel_size=1, peer_sums=True,
              deterministic=False):
    from nanoinfer.sampling.sampler import SamplingParams
    from runtime.engine.engine_core import EngineConfig, EngineCore

    engine = EngineCore(model, EngineConfig(block_size=16, num_blocks=256, max_model_len=2048,
                                            enforce_eager=enforce_eager, async_scheduling=async_scheduling,
                                            tensor_parallel_size=tensor_parallel_size, peer_sums=peer_sums,
                                            deterministic=deterministic,
                                            cuda_graph_capture="all"))  # (none captured in the timed steps)
    prompt = [11, 22, 33, 44, 55]
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    while engine.has_unfinished():
        engine.step()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    engine.step()
    torch.cuda.synchronize()
    engine.timer.phase_times.clear()
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    elapsed = time.perf_counter() - start
    phases = {k: v / (new_tokens - 1) * 1e3 for k, v in engine.timer.phase_times.items()}
    links = getattr(getattr(engine.executor, "tp", None), "links", None)
    phases["peer sums"] = links is not None and links.ready  # (the first TP engine of a process only)
    engine.close()
    del engine
    return (new_tokens - 1) / elapsed, phases


def time_transformers(name, new_tokens):
    import transformers

    from bench.shapes import HF_CONFIGS

    cls, fields = HF_CONFIGS[name]
    config = getattr(transformers, cls)(**fields)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ids = torch.tensor([[11, 22, 33, 44, 55]], device="cuda")
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
    del model
    return (new_tokens - 1) / ((t2 - t1) - (t1 - t0))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "llama-3.2-1b", "llama-3.1-8b"])
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--quantization", nargs="+", default=["none"],
                        choices=["none", "int8", "fp8", "int4", "gpt-fast-int8", "gpt-fast-int4"])
    parser.add_argument("--tensor-parallel-size", type=int, nargs="+", default=[1])
    parser.add_argument("--peer-sums", action=argparse.BooleanOptionalAction, default=True,
                        help="TP's one-token sums over peer memory (--no-peer-sums: NCCL's)")
    parser.add_argument("--variants", nargs="+", default=["overlap", "no-overlap", "eager"],
                        choices=["overlap", "no-overlap", "eager", "deterministic"],
                        help="which of our engine's paths to time (deterministic: graphs, overlap and the "
                             "batch-invariant kernels)")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="tok/s bars per shape and variant, with each one's speedup over our eager path")
    args = parser.parse_args()
    figures: dict[str, dict[str, float]] = {}  # shape -> variant -> tok/s

    import dataclasses

    import nanoinfer.backends.cuda.linear
    from bench.shapes import random_model, weight_bytes
    from nanoinfer.quant import quantized
    from nanoinfer.loaders.quantize import quantize_params

    print(f"device {torch.cuda.get_device_name()}  new tokens {args.new_tokens}  prompt 5")
    print(f"{'shape':<14}{'engine':<30}{'tok/s':>9}{'GB/s':>9}   host ms/token: schedule batch forward sample resolve")
    for name in args.shapes:
        # (one quantization asked for: the layers quantized as they are made, for shapes whose bf16 weights do not fit)
        made = args.quantization[0] if len(args.quantization) == 1 and args.quantization[0] in ("int8", "fp8",
                                                                                                  "int4") else "none"
        dense = random_model(name, quantization=made)
        for quant in args.quantization:
            form = quant.removeprefix("gpt-fast-")
            if quant == "gpt-fast-int4":
                from bench.gpt_fast_int4 import tinygemm_params

                model = dataclasses.replace(dense, params=tinygemm_params(dense.params), quantization="none")
            else:
                model = dense if form == "none" else dataclasses.replace(
                    dense, params=quantize_params(dense.params, form), quantization=form)
            nbytes = weight_bytes(model)
            variants = [v for key, v in (("overlap", ("graphs, overlap", False, True, False)),
                                         ("no-overlap", ("graphs, no overlap", False, False, False)),
                                         ("eager", ("eager", True, True, False)),
                                         ("deterministic", ("deterministic", False, True, True)))
                        if key in args.variants]
            linear = nanoinfer.backends.cuda.linear.linear
            if quant == "gpt-fast-int8":  # (kernels_for reads nanoinfer.backends.cuda.linear.linear when the engine starts)
                nanoinfer.backends.cuda.linear.linear = quantized.linear
            elif quant == "gpt-fast-int4":
                from bench.gpt_fast_int4 import with_tinygemm

                nanoinfer.backends.cuda.linear.linear = with_tinygemm(linear)
            runs = [(label, eager, overlap, det, size) for size in args.tensor_parallel_size
                    for label, eager, overlap, det in (variants if quant == "none" else variants[:1])]
            for label, eager, overlap, det, size in runs:
                tps, phases = time_ours(model, args.new_tokens, enforce_eager=eager, async_scheduling=overlap,
                                        tensor_parallel_size=size, peer_sums=args.peer_sums, deterministic=det)
                breakdown = " ".join(f"{phases.get(k, 0):.3f}" for k in ("schedule", "batch", "forward", "sample",
                                                                          "resolve"))
                sums = ", peer sums" if phases.pop("peer sums") else ", NCCL sums"
                label += f", tp={size}{sums}" if size > 1 else ""
                label = f"nanoinfer ({label})" if quant == "none" else f"{quant} ({label})"
                figures.setdefault(name, {})[label] = tps
                print(f"{name:<14}{label:<30}{tps:>9.1f}{nbytes * tps / 1e9:>9.0f}   {breakdown}")
            nanoinfer.backends.cuda.linear.linear = linear
            del model
            gc.collect()
            torch.cuda.empty_cache()
        del dense
        gc.collect()
        torch.cuda.empty_cache()
        if not args.no_baseline:
            tps = time_transformers(name, args.new_tokens)
            figures.setdefault(name, {})["transformers (eager)"] = tps
            print(f"{name:<14}{'transformers (eager)':<30}{tps:>9.1f}{nbytes * tps / 1e9:>9.0f}")
        gc.collect()
        torch.cuda.empty_cache()
    if args.plot:
        plot(figures, args.plot, torch.cuda.get_device_name())


def plot(figures: dict[str, dict[str, float]], path: str, device: str) -> None:
    """Batch-1 decode tok/s per shape and variant: what each optimisation buys over eager."""
    from runtime.eval.plots import bars, pyplot, save

    plt = pyplot()
    first = next(iter(figures.values()), {})  # (variants slowest first: each bar one more optimisation)
    figures = {shape: dict(sorted(group.items(), key=lambda kv: first.get(kv[0], kv[1])))
               for shape, group in figures.items()}
    fig, ax = plt.subplots(figsize=(4 + 3 * len(figures), 4.5))
    bars(ax, figures, f"batch-1 decode, {device}", "tokens / s", baseline="nanoinfer (eager)")
    save(fig, path)
    plt.close(fig)


if __name__ == "__main__":
    main()
