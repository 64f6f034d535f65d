"""CPU decode speed and memory of the default model: NanoInfer beside llama.cpp and transformers.

    python bench/cpu_decode.py [--new-tokens 128] [--threads 2] [--repeats 3] [--install-llama-cpp]
                               [--cpu-isa avx2] [--no-exact] [--model PATH.gguf]

Every engine runs the same GGUF file, greedy, one sequence, `--threads` threads:
- nanoinfer (gguf): the file's blocks kept packed (the default for a quantized GGUF on the CPU);
- nanoinfer (none): dequantized to fp32, the exact path;
- llama.cpp through llama-cpp-python (`--install-llama-cpp` builds it with pip: minutes);
- transformers, which dequantizes the file to fp32.
Decode tok/s counts the tokens after the first (the prefill and first token are timed
apart), best of `--repeats` runs. A second table times whole requests (prefill + decode) through
the bare engine core's step loop, through `LLM.generate`, which runs that loop on the
caller's thread with its output processing, and through llama-cpp-python's own call
(`Llama.create_completion` on the same token ids). `--cpu-isa avx2` builds NanoInfer's CPU
kernels for AVX2 alone (NANOINFER_CPU_ISA) on a CPU with more, to compare with an AVX2 build of
llama.cpp. Memory: each nanoinfer mode loads in a fresh process,
which reports its resident set after `import torch` and after the engine is up, and the KV
pool's bytes (the issue's bound: RSS growth <= 3x the file + the KV pool); llama.cpp's the same
way (its RSS growth over `import llama_cpp`, n_ctx 512). `--model` runs another GGUF than the
default model's (tools/make_q4_k_m.py writes its Q4_K_M).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

LLAMA_CPP = "llama-cpp-python==0.3.36"


def time_ours(engine, prompt_ids, new_tokens):
    from nanoinfer.sampling.sampling_params import SamplingParams

    engine.add_request(prompt_ids, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    start = time.perf_counter()
    engine.step()  # prefill + first token
    first = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    end = time.perf_counter()
    return first - start, (new_tokens - 1) / (end - first)


def time_core_total(engine, prompt_ids, new_tokens) -> float:
    """Seconds for one whole request through the bare engine core's step loop."""
    from nanoinfer.sampling.sampling_params import SamplingParams

    start = time.perf_counter()
    engine.add_request(prompt_ids, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def time_llm_total(llm, prompt_ids, new_tokens) -> float:
    """Seconds for the same request through `LLM.generate` (its output processing included)."""
    from nanoinfer.sampling.sampling_params import SamplingParams

    start = time.perf_counter()
    llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - start


def time_llama_cpp(llm, prompt_ids, new_tokens):
    llm.reset()
    start = time.perf_counter()
    for n, _ in enumerate(llm.generate(prompt_ids, temp=0.0, reset=True), start=1):
        if n == 1:
            first = time.perf_counter()
        if n == new_tokens:
            break
    end = time.perf_counter()
    return first - start, (new_tokens - 1) / (end - first)


def end_of_generation_ids(llm) -> list[int]:
    """The tokens at which llama-cpp-python's completion ends (llama.cpp's end-of-generation set)."""
    import llama_cpp

    # (what create_completion itself asks, in the version LLAMA_CPP pins)
    return [t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(llm._model.vocab, t)]


def time_llama_cpp_call(llm, prompt_ids, new_tokens) -> float:
    """Seconds for the same request through llama-cpp-python's call (its sampling and detokenizing).
    It has no ignore_eos: its end-of-generation tokens get a -inf bias, as ours are ignored, so that
    both produce `new_tokens` (the bias is a numpy pass over the logits a token: microseconds)."""
    never = {t: float("-inf") for t in end_of_generation_ids(llm)}
    llm.reset()
    start = time.perf_counter()
    out = llm.create_completion(prompt_ids, max_tokens=new_tokens, temperature=0.0, logit_bias=never)
    seconds = time.perf_counter() - start
    if out["usage"]["completion_tokens"] != new_tokens:  # (greedy text that ends early: tok/s would mislead)
        raise StoppedEarly(f"llama.cpp stopped after {out['usage']['completion_tokens']} of {new_tokens} tokens")
    return seconds


class StoppedEarly(RuntimeError):
    """A whole request ended before its tokens (its row of the second table is left out, not the table)."""


def time_transformers(hf_model, prompt_ids, new_tokens):
    ids = torch.tensor([prompt_ids])
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    start = time.perf_counter()
    hf_model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
    first = time.perf_counter()
    hf_model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
    end = time.perf_counter()
    # The second call repeats the prefill; take it out using the first call's time.
    return first - start, (new_tokens - 1) / ((end - first) - (first - start))


def llama_cpp(install: bool):
    try:
        import llama_cpp
    except ImportError:
        if not install:
            return None
        print(f"building {LLAMA_CPP} (minutes)...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", LLAMA_CPP], check=True)
        import llama_cpp
    return llama_cpp


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def memory_child(quantization: str, threads: int, path: str | None) -> None:
    """Run in a fresh process: print the resident set before and after loading, as JSON."""
    torch.set_num_threads(threads)
    if quantization == "llama.cpp":
        import llama_cpp

        from nanoinfer.hub import DEFAULT_MODEL, resolve_model_name

        path = path or str(resolve_model_name(DEFAULT_MODEL, quiet=True))
        before = rss_mib()
        llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_ctx=512, verbose=False)
        llm.eval(llm.tokenize(b"warm up"))
        print(json.dumps(dict(before=before, after=rss_mib(), kv=float("nan"), file=os.path.getsize(path) / 2**20)))
        return
    from nanoinfer.loaders import load_model
    from runtime.engine.engine_core import EngineConfig, EngineCore

    before = rss_mib()
    model = load_model(path, device="cpu", progress=False, quantization=quantization)
    engine = EngineCore(model, EngineConfig(num_blocks=64, block_size=16))
    kv = engine.executor.kv
    kv_mib = kv.numel() * kv.element_size() / 2**20
    print(json.dumps(dict(before=before, after=rss_mib(), kv=kv_mib, file=os.path.getsize(model.path) / 2**20)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", default="Write a haiku about the sea")
    parser.add_argument("--install-llama-cpp", action="store_true", help=f"pip install {LLAMA_CPP} if missing")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--no-exact", action="store_true", help="leave out nanoinfer (none), the fp32 path")
    parser.add_argument("--cpu-isa", default=None, choices=["native", "avx2"],
                        help="the tier NanoInfer's CPU kernels are built for (NANOINFER_CPU_ISA; default native)")
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model's)")
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cpu_isa:
        os.environ["NANOINFER_CPU_ISA"] = args.cpu_isa  # (before the library loads; memory children inherit it)
    if args.memory_child:
        return memory_child(args.memory_child, args.threads, args.model)
    torch.set_num_threads(args.threads)

    from nanoinfer.loaders import load_model
    from runtime.engine.engine_core import EngineConfig, EngineCore

    engines = []  # (name, timing function, engine)
    for quantization in ("gguf",) if args.no_exact else ("gguf", "none"):
        model = load_model(args.model, device="cpu", progress=False, quantization=quantization)
        engines.append((f"nanoinfer ({quantization})", time_ours, EngineCore(model, EngineConfig(num_blocks=64,
                                                                                                 block_size=16))))
    prompt_ids = model.tokenizer.encode(args.prompt)
    lib = llama_cpp(args.install_llama_cpp)
    if lib is not None:
        engines.append((f"llama.cpp {lib.__version__}", time_llama_cpp,
                        lib.Llama(model_path=str(model.path), n_threads=args.threads, n_threads_batch=args.threads,
                                  n_ctx=512, verbose=False)))
    else:
        print(f"(llama.cpp left out: {LLAMA_CPP} is not installed; --install-llama-cpp builds it)")
    if not args.no_transformers:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(model.path.parent, gguf_file=model.path.name,
                                                               dtype=torch.float32).eval()
        engines.append(("transformers", time_transformers, hf))

    results = {name: [] for name, _, _ in engines}
    with torch.inference_mode():
        for name, fn, target in engines:
            fn(target, prompt_ids, 8)  # warm-up
        for _ in range(args.repeats):  # engines interleaved, so a noisy spell hits them all
            for name, fn, target in engines:
                results[name].append(fn(target, prompt_ids, args.new_tokens))
    rows = [(name, min(r[0] for r in runs) * 1e3, max(r[1] for r in runs)) for name, runs in results.items()]
    base = next((tps for name, _, tps in rows if name.startswith("llama.cpp")), None)
    from nanoinfer.backends.cpu import cpu_native

    print(f"model {model.path.name}  prompt {len(prompt_ids)} tokens  new {args.new_tokens}  threads {args.threads}")
    print(f"cpu kernels: {cpu_native.describe(cpu_native.library())}")
    print(f"{'engine':<22}{'prefill ms':>12}{'decode tok/s':>14}{'vs llama.cpp':>14}")
    for name, prefill_ms, tps in rows:
        print(f"{name:<22}{prefill_ms:>12.1f}{tps:>14.1f}" + (f"{tps / base:>13.2f}x" if base else ""))

    # The offline facade against the bare step loop it runs, whole requests (prefill + decode).
    from runtime.llm import LLM

    core = engines[0][2]
    llm = LLM.from_loaded(core.model, num_blocks=64, block_size=16)
    callers = [("engine core step loop", time_core_total, core), ("LLM.generate", time_llm_total, llm)]
    callers += [("llama-cpp-python call", time_llama_cpp_call, target) for name, _, target in engines
                if name.startswith("llama.cpp")]
    totals = {name: [] for name, _, _ in callers}
    with torch.inference_mode():
        for _, fn, target in callers:
            fn(target, prompt_ids, 8)  # warm-up
        for _ in range(args.repeats):  # interleaved, as above
            for name, fn, target in callers:
                if name not in totals:
                    continue
                try:
                    totals[name].append(fn(target, prompt_ids, args.new_tokens))
                except StoppedEarly as exc:  # (a random-weight file's text may end early there: no figure)
                    print(f"({name} left out of the whole-request table: {exc})")
                    del totals[name]
    llm.close()
    base_total = min(totals["engine core step loop"])
    llama_total = min(totals.get("llama-cpp-python call", [float("nan")]))
    print(f"\n{'whole request (gguf)':<22}{'seconds':>12}{'tok/s':>14}{'vs step loop':>14}{'vs llama-cpp':>14}")
    for name, runs in totals.items():
        print(f"{name:<22}{min(runs):>12.3f}{args.new_tokens / min(runs):>14.1f}{base_total / min(runs):>13.2f}x"
              f"{llama_total / min(runs):>13.2f}x")

    print(f"\n{'memory (fresh process)':<22}{'RSS growth MiB':>16}{'KV pool MiB':>13}{'file MiB':>10}{'bound MiB':>11}")
    for quantization in ("gguf", "none") + (("llama.cpp",) if lib is not None else ()):
        model_arg = ["--model", args.model] if args.model else []
        out = subprocess.run([sys.executable, __file__, "--memory-child", quantization, "--threads", str(args.threads),
                              *model_arg], capture_output=True, text=True, check=True).stdout
        m = json.loads(out.strip().splitlines()[-1])
        print(f"{quantization if quantization == 'llama.cpp' else 'nanoinfer (' + quantization + ')':<22}{m['after'] - m['before']:>16.0f}{m['kv']:>13.0f}"
              f"{m['file']:>10.0f}{3 * m['file'] + m['kv']:>11.0f}")


if __name__ == "__main__":
    main()
