"""Offline throughput on nano-vllm's workload: N sequences, random prompt and output lengths.

    python bench/throughput.py [--num-seqs 16] [--input-len 16 64] [--output-len 16 64]
                               [--model M] [--device cpu] [--baseline-batch 16] [--temperature 0]
                               [--kv-cache-dtype auto|fp8] [--quantization none|int8|fp8|int4]
                               [--pipeline-parallel-size P] [--pipeline-micro-batches M] [--pipeline-overlap]
                               [--tensor-parallel-size T] [--enforce-eager]

Prompts are random token ids, lengths uniform in the given ranges (fixed seed), generation
with ignore_eos so every request produces exactly its output length. Output tok/s counts
those requested tokens. The baseline is transformers `generate` on the same prompts in
left-padded batches of --baseline-batch, each batch run to its longest output.
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import torch


def workload(num_seqs, input_len, output_len, vocab, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(*input_len))] for _ in range(num_seqs)]
    outputs = [rng.randint(*output_len) for _ in range(num_seqs)]
    return prompts, outputs


def run_ours(llm, prompts, outputs, temperature=0.0):
    from nanoinfer import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=i)
              for i, n in enumerate(outputs)]
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(r.token_ids) for r in results] == outputs
    return elapsed


def run_transformers(hf_model, prompts, outputs, batch, pad_id):
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group, lens = prompts[i:i + batch], outputs[i:i + batch]
        width = max(map(len, group))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        hf_model.generate(input_ids=ids.to(hf_model.device), attention_mask=mask.to(hf_model.device),
                          max_new_tokens=max(lens), min_new_tokens=max(lens), do_sample=False,
                          eos_token_id=None, pad_token_id=pad_id)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--shape", default=None, help="random bf16 weights in a real shape (bench/shapes.py), GPU")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-seqs", type=int, default=16)
    parser.add_argument("--input-len", type=int, nargs=2, default=(16, 64))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 64))
    parser.add_argument("--baseline-batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; nano-vllm's bench samples at 0.6")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--quantization", default="auto", help="as load_model takes it (with --shape: int8, fp8 "
                                                                 "or int4 quantize the random weights)")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1,
                        help="stages over GPUs cuda:0.. (each replays CUDA graphs where T=1)")
    parser.add_argument("--pipeline-micro-batches", type=int, default=None,
                        help="default: the pipeline's size, or 1 with two steps in flight")
    parser.add_argument("--pipeline-overlap", action=argparse.BooleanOptionalAction, default=None,
                        help="two steps of disjoint sequences in flight over the stages (virtual engines); "
                             "default: the engine's")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs, no fused layers")
    parser.add_argument("--deterministic", action="store_true", help="the batch-invariant kernels (issue 65)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    parallel = dict(pipeline_parallel_size=args.pipeline_parallel_size,
                    pipeline_micro_batches=args.pipeline_micro_batches,
                    tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager,
                    deterministic=args.deterministic)
    if args.pipeline_overlap is not None:
        parallel["pipeline_overlap"] = args.pipeline_overlap

    from nanoinfer import LLM

    # Every CUDA graph at start: the timed run's batch sizes are not all in the warm-up's, and a
    # graph captured on first use (the engine's default) would be captured inside the timed run.
    parallel["cuda_graph_capture"] = "all"

    if args.shape:
        import dataclasses

        from bench.shapes import random_model
        from nanoinfer.loaders.quantize import quantize_params

        quantized = args.quantization in ("int8", "fp8", "int4")
        model = random_model(args.shape, device=args.device, quantization=args.quantization if quantized else "none")
        if quantized:  # (the LM head: the layers were quantized as they were made)
            model = dataclasses.replace(model, params=quantize_params(model.params, args.quantization),
                                        quantization=args.quantization)
        llm = LLM.from_loaded(model, max_model_len=4096, max_num_seqs=args.num_seqs,
                              kv_cache_dtype=args.kv_cache_dtype, **parallel)
    else:
        llm = LLM(args.model, device=args.device, dtype=args.dtype, progress=False, quantization=args.quantization,
                  kv_cache_dtype=args.kv_cache_dtype, **parallel)
    prompts, outputs = workload(args.num_seqs, args.input_len, args.output_len, llm.model.config.vocab_size)
    # Warm-up over prompts of the workload's own lengths: the first prefill of each shape JIT-
    # compiles Triton kernels and Inductor code (cold start is bench/cold_start.py's business).
    warm = min(32, len(prompts))
    run_ours(llm, prompts[:warm], [8] * warm, args.temperature)
    ours = run_ours(llm, prompts, outputs, args.temperature)
    total = sum(outputs)
    rows = [("nanoinfer", ours, total / ours)]
    core = llm.engine.core
    steps = max(1, core.step_count)
    phases = "  ".join(f"{k} {v / steps * 1e3:.2f}" for k, v in core.timer.phase_times.items())
    del core  # (it holds the KV pool, most of the GPU: the baseline needs it back)
    model_path, dtype, device = llm.model.path, llm.model.params.dtype, llm.model.params.device
    llm.close()  # give the GPU back (the KV pool takes most of it) before the baseline loads
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if not args.no_baseline:
        import transformers

        path = model_path
        if args.shape:
            from bench.shapes import HF_CONFIGS

            cls, fields = HF_CONFIGS[args.shape]
            with torch.device(args.device):
                hf_model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**fields),
                                                                         dtype=torch.bfloat16)
        elif path.suffix == ".gguf":
            hf_model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                         dtype=dtype)
        else:
            hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        hf_model = hf_model.to(device).eval()
        run_transformers(hf_model, prompts[:2], [4, 4], 2, 0)  # warm-up
        with torch.inference_mode():
            theirs = run_transformers(hf_model, prompts, outputs, args.baseline_batch, 0)
        rows.append((f"transformers (batch {args.baseline_batch}, padded)", theirs, total / theirs))
    print(f"model {model_path.name}  device {args.device}  tp {args.tensor_parallel_size}  pp "
          f"{args.pipeline_parallel_size} (micro-batches {args.pipeline_micro_batches}, overlap "
          f"{args.pipeline_overlap})  eager {args.enforce_eager}  deterministic {args.deterministic}  "
          f"kv cache {args.kv_cache_dtype}  quantization "
          f"{args.quantization}  temperature {args.temperature}  seqs {args.num_seqs}  "
          f"input {args.input_len}  "
          f"output {args.output_len}  output tokens {total}")
    print(f"{'engine':<36}{'seconds':>10}{'output tok/s':>14}{'vs baseline':>13}")  # (last row = baseline)
    for name, seconds, tps in rows:
        print(f"{name:<36}{seconds:>10.2f}{tps:>14.1f}{tps / rows[-1][2]:>12.2f}x")
    print(f"nanoinfer host ms per step ({steps} steps, warm-up included; sample includes waiting for the GPU): "
          f"{phases}")


if __name__ == "__main__":
    main()
