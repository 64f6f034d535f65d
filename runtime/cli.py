"""The `nanoinfer` command line: generate (stream one completion), serve (the OpenAI-compatible
server) and chat (an interactive terminal chat)."""

from __future__ import annotations

import argparse
import sys

from nanoinfer.errors import NanoInferError
from nanoinfer.loaders.hub import DEFAULT_MODEL


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help=f"a known name, an HF directory or a .gguf file (default: {DEFAULT_MODEL})")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")


def _sampling_args(parser: argparse.ArgumentParser, temperature: float) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeating tokens")


def _engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from memory)")
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-num-batched-tokens", type=int, default=4096)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    group.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    group.add_argument("--swap-space", type=float, default=0, help="GiB of host memory for swapped KV blocks")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="share of the GPU for weights, activations and the KV pool")
    group.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs and no torch.compile")
    group.add_argument("--nvtx", action="store_true", help="NVTX ranges around step phases (for Nsight Systems)")
    group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="launch each step before reading the last one's tokens (default: on with CUDA)")


def _engine_kwargs(args) -> dict:
    return dict(block_size=args.block_size, num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                scheduling_policy=args.scheduling_policy, preemption_mode=args.preemption_mode,
                swap_space=int(args.swap_space * (1 << 30)), gpu_memory_utilization=args.gpu_memory_utilization,
                enforce_eager=args.enforce_eager, nvtx=args.nvtx, async_scheduling=args.async_scheduling)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoinfer", description="From checkpoint to conversation.")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="complete one prompt, streaming the text to stdout")
    gen.add_argument("prompt")
    _model_args(gen)
    _sampling_args(gen, temperature=0.0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn in the chat template")

    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _model_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    serve.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/*")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--cors-origin", action="append", default=[], help="allow this origin (repeatable; off by default)")
    serve.add_argument("--max-pending", type=int, default=1024, help="queued requests before 503")
    _engine_args(serve)

    chat = commands.add_parser("chat", help="chat with the model in the terminal")
    _model_args(chat)
    _sampling_args(chat, temperature=0.7)
    chat.add_argument("--system", default=None, help="a system message to start the conversation with")
    return parser


def _sampling(args):
    from nanoinfer.sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.seed,
                          repetition_penalty=args.repetition_penalty)


def _generate(args) -> int:
    from runtime.llm import LLM

    params = _sampling(args)
    with LLM(args.model, device=args.device, dtype=args.dtype) as llm:
        for delta in llm.stream(args.prompt, params, chat=args.chat):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _serve(args) -> int:
    import uvicorn

    from runtime.engine import AsyncEngine
    from runtime.server import create_app

    engine = AsyncEngine.from_model(args.model, device=args.device, dtype=args.dtype, **_engine_kwargs(args))
    name = args.served_model_name or (args.model and str(args.model)) or DEFAULT_MODEL
    app = create_app(engine, model_name=name, api_key=args.api_key, cors_origins=args.cors_origin,
                     max_pending=args.max_pending)

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                port = self.servers[0].sockets[0].getsockname()[1]
                print(f"nanoinfer: serving {name} at http://{args.host}:{port}  (chat page at /, API at /v1)",
                      flush=True)

        async def shutdown(self, sockets=None):
            # SIGINT/SIGTERM: abort what is in flight first, so that every open stream ends
            # properly (finish_reason "abort", then [DONE]) before uvicorn closes connections.
            engine.abort_all()
            await super().shutdown(sockets)

        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal after its graceful stop, so the process would die
            # by SIGTERM; a clean stop on request is a normal exit here (status 0).
            self._captured_signals.clear()

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=10)
    Server(config).run()
    return 0


def _chat(args) -> int:
    from runtime.llm import LLM

    params = _sampling(args)
    with LLM(args.model, device=args.device, dtype=args.dtype) as llm:
        system = [{"role": "system", "content": args.system}] if args.system else []
        history = list(system)
        print("nanoinfer chat — /reset starts over, /exit quits, Ctrl-C stops a reply", flush=True)
        while True:
            try:
                line = input(">>> ")
            except EOFError:
                print()
                return 0
            except KeyboardInterrupt:
                print("\n(type /exit to quit)")
                continue
            if line.strip() == "/exit":
                return 0
            if line.strip() == "/reset":
                history = list(system)
                print("(conversation cleared)")
                continue
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            reply = []
            stream = llm.stream(history, params)
            try:
                for delta in stream:
                    reply.append(delta.text)
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
                print()
            except KeyboardInterrupt:
                stream.close()  # aborts the request; what arrived stays in the history
                print(" [stopped]")
            history.append({"role": "assistant", "content": "".join(reply)})


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handlers = {"generate": _generate, "serve": _serve, "chat": _chat}
    try:
        return handlers[args.command](args)
    except NanoInferError as exc:
        print(f"nanoinfer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
