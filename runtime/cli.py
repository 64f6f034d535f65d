"""The `nanoinfer` command line: `nanoinfer generate PROMPT` streams a completion to stdout."""

from __future__ import annotations

import argparse
import sys

from nanoinfer.errors import NanoInferError
from nanoinfer.loaders.hub import DEFAULT_MODEL


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoinfer", description="From checkpoint to conversation.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="complete one prompt, streaming the text to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None,
                     help=f"a known name, an HF directory or a .gguf file (default: {DEFAULT_MODEL})")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn in the chat template")
    gen.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    gen.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    return parser


def _generate(args) -> int:
    from nanoinfer.sampling import SamplingParams
    from runtime.llm import LLM

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed)
    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    for delta in llm.stream(args.prompt, params, chat=args.chat):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
    except NanoInferError as exc:
        print(f"nanoinfer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
