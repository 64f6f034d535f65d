"""Does a token score the same however it was computed? The default model, teacher-forced.

    python bench/cpu_determinism.py [--prompt TEXT] [--prefill 8] [--chunk 7] [--quantization auto]

Each token of the prompt is scored three ways: inside one prefill of the whole prompt, in
decode steps after a prefill of the first `--prefill` tokens, and in chunks of `--chunk`.
Prints the largest |difference| of the logits against the one prefill, and of the next
token's negative log-likelihood (the packed CPU path: bit-equal since issue 36).
"""

from __future__ import annotations

import argparse

import torch

PROMPT = ('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2: return n\n'
          '    return fibonacci(n - 1) + fibonacci(n - 2)\n')


def main() -> None:
    from nanoinfer.model.batch import SeqChunk, build_batch
    from nanoinfer.backends.choose import kernels_for
    from nanoinfer.model.kv_cache import allocate_kv_pool
    from nanoinfer.loaders import load_model
    from nanoinfer.model.decoder import forward

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--prefill", type=int, default=8, help="tokens prefilled before the decode steps")
    parser.add_argument("--chunk", type=int, default=7, help="the chunked prefill's chunk size")
    parser.add_argument("--quantization", default="auto", help="auto (packed), none (exact fp32), int8...")
    args = parser.parse_args()
    model = load_model(None, device="cpu", quantization=args.quantization, progress=False)
    cfg, block = model.config, 16
    tokens = model.tokenizer.encode(args.prompt)
    n, blocks = len(tokens), list(range(-(-len(tokens) // block)))
    if not 0 < args.prefill < n or args.chunk < 1:
        parser.error(f"--prefill must be in 1..{n - 1} (the prompt's tokens) and --chunk at least 1")
    kernels = kernels_for(cfg, torch.device("cpu"), block, params=model.params)

    def scored(chunks):
        kv = allocate_kv_pool(cfg, len(blocks), block, model.params.dtype, "cpu")
        out = []
        for start, end in chunks:
            batch = build_batch([SeqChunk(tokens[start:end], start, blocks, True)], block)
            batch = batch._replace(logits_indices=torch.arange(end - start))
            out.append(forward(model.params, kv, batch, cfg, kernels.attention, kernels.layer_fns))
        return torch.cat(out)

    whole = scored([(0, n)])
    ways = {"decode steps": scored([(0, args.prefill)] + [(i, i + 1) for i in range(args.prefill, n)]),
            f"chunks of {args.chunk}": scored([(i, min(i + args.chunk, n)) for i in range(0, n, args.chunk)])}
    following = torch.tensor(tokens[1:])

    def nll(logits):
        return -logits[:-1].log_softmax(-1).gather(1, following[:, None])[:, 0]

    print(f"{n} tokens, {type(kernels.attention).__name__}, {type(model.params.layers[0].qkv_proj).__name__}")
    for name, logits in ways.items():
        diff = (logits - whole).abs().max(-1).values
        dnll = (nll(logits) - nll(whole)).abs()
        print(f"{name} vs one prefill: max |Δlogit| {diff.max():.4g} (mean over tokens {diff.mean():.4g}); "
              f"|Δ NLL| max {dnll.max():.4g} mean {dnll.mean():.4g} nats; bit-equal {torch.equal(logits, whole)}")


if __name__ == "__main__":
    main()
