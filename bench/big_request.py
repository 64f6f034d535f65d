"""A huge request beside a small one (issue 10, finding 6): does the big one stall the server?

    python bench/big_request.py [--src DIR] [--prompts 100] [--n 128] [--max-tokens 16]

Serves a tiny random Llama (HF directory made here, no tokenizer: token-id prompts) with
`nanoinfer serve` from the checkout `--src` (default: this one; pass an older checkout to
measure before/after in one run), sends one completion request of `--prompts` prompts x
`--n` completions, and a second later a small request; then reports what became of both,
the most sequences running at once (limit: --max-num-seqs), how long until both were answered
and the tokens per second generated meanwhile. Everything runs on the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def tiny_checkpoint(path: Path) -> None:
    """A random 2-layer Llama and a word-level tokenizer ("w0".."w510"): servable by any version."""
    import tokenizers
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                      eos_token_id=511)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(511)}}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else float("nan")


async def scenario(url: str, prompts: int, n: int, max_tokens: int, timeout: float) -> dict:
    async with httpx.AsyncClient(timeout=timeout) as http:
        big_body = {"prompt": [f"w7 w8 w{9 + i % 100}" for i in range(prompts)], "n": n, "max_tokens": max_tokens,
                    "temperature": 1.0}
        start = time.monotonic()
        big = asyncio.create_task(http.post(url + "/v1/completions", json=big_body))
        await asyncio.sleep(1.0)
        max_running, tokens0 = 0.0, metric((await http.get(url + "/metrics")).text, "nanoinfer_generated_tokens_total")
        small_start = time.monotonic()
        small = asyncio.create_task(http.post(url + "/v1/completions", json={"prompt": "w1 w2 w3", "max_tokens": 4}))
        unanswered = 0  # /metrics polls the server did not answer within 5 s (a stalled event loop)
        while not small.done() and time.monotonic() - small_start < timeout:
            try:
                text = (await http.get(url + "/metrics", timeout=5)).text
                max_running = max(max_running, metric(text, "nanoinfer_requests_running"))
            except httpx.TimeoutException:
                unanswered += 1
            await asyncio.sleep(0.2)
        small_latency = time.monotonic() - small_start
        small_status = small.result().status_code if small.done() and not small.exception() else "timeout"
        try:
            big_response = await asyncio.wait_for(big, timeout=max(1.0, timeout - (time.monotonic() - start)))
            big_status = big_response.status_code
        except (asyncio.TimeoutError, httpx.HTTPError):
            big_status = "timeout"
        try:
            text = (await http.get(url + "/metrics", timeout=5)).text
        except httpx.TimeoutException:
            text = ""
        return {"unanswered": unanswered, "big": big_status, "small": small_status, "small_s": small_latency, "max_running": max_running,
                "big_s": time.monotonic() - start,
                "tokens": metric(text, "nanoinfer_generated_tokens_total") - tokens0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", default=str(ROOT), help="checkout whose `nanoinfer serve` to run")
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--num-blocks", type=int, default=65536, help="KV blocks of 16 tokens (fewer: preemption)")
    parser.add_argument("--timeout", type=float, default=300.0, help="give up on a request after this many seconds")
    parser.add_argument("--port", type=int, default=8177)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny-llama"
        tiny_checkpoint(model)
        env = {**os.environ, "PYTHONPATH": args.src}
        server = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "--model", str(model), "--device",
                                   "cpu", "--port", str(args.port), "--num-blocks", str(args.num_blocks), "--block-size", "16",
                                   "--max-num-seqs", str(args.max_num_seqs)], cwd=args.src, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            server.stdout.readline()  # the "serving ... at" line
            url = f"http://127.0.0.1:{args.port}"
            result = asyncio.run(scenario(url, args.prompts, args.n, args.max_tokens, args.timeout))
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:  # a stalled server may not even stop
                server.kill()
                server.wait()
    commit = subprocess.run(["git", "-C", args.src, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"| {commit} | {args.prompts} x n={args.n} | {result['big']} | {result['small']} | "
          f"{result['small_s']:.1f} | {result['max_running']:.0f} / {args.max_num_seqs} | "
          f"{result['big_s']:.1f} | {result['tokens'] / max(result['big_s'] - 1, 1e-9):.0f} | {result['unanswered']} |")


if __name__ == "__main__":
    main()
