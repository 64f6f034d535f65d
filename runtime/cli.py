"""The `nanoinfer` command line: generate (stream one completion), serve (the OpenAI-compatible
server), chat (an interactive terminal chat) and eval (perplexity of a text, accuracy on a
CORE-format task, generated answers scored against references, throughput and latency).

Engine and server flags come from their settings dataclasses (nanoinfer/settings.py): the
flag, the keyword argument and the check are one declaration. `--config FILE` (JSON or YAML,
keys = flag names) sets any of them; flags given on the command line win.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import metadata
from pathlib import Path

from nanoinfer.errors import NanoInferError, RequestError
from nanoinfer.flags import add_flags, from_namespace, parse_config_file
from nanoinfer.hub import DEFAULT_MODEL
from nanoinfer.loaders import LoadConfig
from runtime.engine_config import EngineConfig, SchedulerConfig
from runtime.launch import LaunchConfig, LocalRanks, is_launched
from runtime.serve.server_config import ServerConfig


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help=f"a known name, an HF directory, a .gguf file, a nanochat checkpoint, a llama2.c .bin "
                             f"or a Hugging Face Hub id org/name[@revision] (default: {DEFAULT_MODEL})")
    add_flags(parser, LoadConfig)
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="JSON or YAML file of flag names to values; flags on the command line win")


SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "min_tokens", "ignore_eos", "skip_special_tokens")


# The sampling settings a checkpoint may recommend (nanoinfer/sampling/sampling_defaults.py): a flag left
# unset takes the model's recommendation (--generation-config), else the command's own default.
RECOMMENDABLE = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _sampling_args(parser: argparse.ArgumentParser, temperature: float, recommended: bool = True) -> None:
    """The sampling flags; `recommended`: those a model recommends values for follow its recommendation
    when not given (generate and chat; an evaluation keeps its own, greedy, defaults)."""
    from nanoinfer.sampling.sampler import SamplingParams

    own = {"max_tokens": 256, "temperature": temperature}
    unset = {name: f"the model's recommendation, else {own.get(name, getattr(SamplingParams, name))}"
             for name in RECOMMENDABLE} if recommended else None
    parser.set_defaults(own_sampling=own)
    add_flags(parser.add_argument_group("sampling"), SamplingParams, only=SAMPLING_FLAGS, defaults=own,
              unset=unset)
    group = parser.add_argument_group("structured output (one at most; llama.cpp's and vLLM's names)")
    group.add_argument("--json-schema", default=None, metavar="SCHEMA",
                       help="the output is JSON following this schema (JSON text, or @FILE)")
    group.add_argument("--regex", default=None, help="the output matches this regular expression")
    group.add_argument("--choice", nargs="+", default=None, metavar="TEXT", help="the output is one of these")
    group.add_argument("--grammar", default=None, metavar="LARK",
                       help="the output follows this Lark grammar (llguidance's dialect; text, or @FILE)")


def _engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    add_flags(group, EngineConfig)
    add_flags(group, SchedulerConfig)
    add_flags(parser.add_argument_group("several machines (or torchrun's variables)"), LaunchConfig)


def _engine_kwargs(args) -> dict:
    return {**from_namespace(EngineConfig, args), **from_namespace(SchedulerConfig, args)}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in --help, unless its help already says it."""

    def _get_help_string(self, action):
        return action.help if "(default" in (action.help or "") else super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoinfer", description="From checkpoint to conversation.",
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="complete one prompt, streaming the text to stdout",
                              formatter_class=_HelpFormatter)
    gen.add_argument("prompt", help="the prompt, or - to read it from standard input")
    _model_args(gen)
    _sampling_args(gen, temperature=0.0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn in the chat template")
    _engine_args(gen)

    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server", formatter_class=_HelpFormatter)
    _model_args(serve)
    server = serve.add_argument_group("server")
    add_flags(server, ServerConfig)
    _engine_args(serve)

    chat = commands.add_parser("chat", help="chat with the model in the terminal", formatter_class=_HelpFormatter,
                               description="Chat with the model in the terminal. At the >>> prompt: /reset starts "
                                           "the conversation over (keeping --system), /exit or Ctrl-D quits, Ctrl-C "
                                           "stops a reply as it streams.")
    _model_args(chat)
    _sampling_args(chat, temperature=0.7)
    chat.add_argument("--system", default=None, help="a system message to start the conversation with")
    _engine_args(chat)

    commands.add_parser("env", help="what this machine runs: versions, the CPU's SIMD features and the chosen "
                        "kernels (paste it into a bug report)", formatter_class=_HelpFormatter)
    evaluate = commands.add_parser("eval", help="numbers about a model", formatter_class=_HelpFormatter)
    # (parse_args finds each command's parser here, to check a --config file's keys against its flags)
    parser.subcommands = {"generate": gen, "serve": serve, "chat": chat,
                          "eval": _eval_parsers(evaluate.add_subparsers(dest="task", required=True))}
    return parser


def _eval_parsers(tasks) -> dict[str, argparse.ArgumentParser]:
    """`nanoinfer eval`'s tasks, by name."""
    from runtime.eval.choice import DELIMITER, SHOTS, TASK_TYPES

    ppl = tasks.add_parser("perplexity", help="perplexity and bits per byte of a text file (sliding window)",
                           formatter_class=_HelpFormatter)
    ppl.add_argument("text_file", help="a UTF-8 text file")
    ppl.add_argument("--context", type=int, default=1024, help="tokens per window")
    ppl.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: context / 2)")
    ppl.add_argument("--json", default=None, metavar="FILE", help="also write the numbers to FILE as JSON")
    _model_args(ppl)
    _engine_args(ppl)
    choice = tasks.add_parser("choice", help="accuracy on a CORE-format task (JSONL) by continuation likelihood",
                              formatter_class=_HelpFormatter)
    choice.add_argument("task_file", help="JSONL, one item per line (runtime/eval/choice.py says the fields)")
    choice.add_argument("--task-type", default=TASK_TYPES[0], help=f"one of {', '.join(TASK_TYPES)}")
    choice.add_argument("--shots", type=int, default=SHOTS, help="few-shot examples before each item")
    choice.add_argument("--delimiter", default=DELIMITER, help="between a context and its continuation")
    choice.add_argument("--json", default=None, metavar="FILE", help="also write the numbers to FILE as JSON")
    _model_args(choice)
    _engine_args(choice)
    answers = tasks.add_parser("generate", help="generate answers to a task's prompts (JSONL) and score them against "
                                                "its references: BLEU, ROUGE, exact match", formatter_class=_HelpFormatter)
    answers.add_argument("task_file", help='JSONL, one {"prompt": ..., "reference": ...} per line')
    answers.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn in the chat template")
    answers.add_argument("--json", default=None, metavar="FILE", help="also write the numbers to FILE as JSON")
    _model_args(answers)
    _sampling_args(answers, temperature=0.0, recommended=False)
    _engine_args(answers)
    speed = tasks.add_parser("speed", help="throughput and latency (TTFT, ITL) per batch size, synthetic prompts",
                             formatter_class=_HelpFormatter)
    speed.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="concurrent requests")
    speed.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    speed.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    speed.add_argument("--plot", default=None, metavar="FILE.png", help="throughput vs batch size, latency CDFs")
    speed.add_argument("--json", default=None, metavar="FILE", help="also write the numbers to FILE as JSON")
    _model_args(speed)
    _engine_args(speed)
    return {"perplexity": ppl, "choice": choice, "generate": answers, "speed": speed}


def _version() -> str:
    try:
        return metadata.version("nanoinfer")
    except metadata.PackageNotFoundError:
        return "unknown"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse, with `--config FILE` values as defaults under the command line's own flags."""
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        sub = parser.subcommands[args.command]
        sub = sub[args.task] if isinstance(sub, dict) else sub
        valid = {a.dest for a in sub._actions if a.dest not in ("help", "config", "prompt")}
        sub.set_defaults(**parse_config_file(args.config, valid))
        args = parser.parse_args(argv)
    return args


def _sampling(args):
    """The flags' SamplingParams: those given, else the command's own defaults (checked before a model loads;
    `_recommended` then puts the model's recommendation in place of the defaults)."""
    from nanoinfer.sampling.sampler import SamplingParams

    given = {key: value for key, value in (("json", getattr(args, "json_schema", None)),
                                           ("regex", getattr(args, "regex", None)),
                                           ("choice", getattr(args, "choice", None)),
                                           ("grammar", getattr(args, "grammar", None))) if value is not None}
    for key in ("json", "grammar"):  # (@FILE: read from the file)
        if isinstance(given.get(key), str) and given[key].startswith("@"):
            try:
                given[key] = Path(given[key][1:]).read_text(encoding="utf-8")
            except OSError as exc:
                raise RequestError(f"--{'json-schema' if key == 'json' else key} {given[key]}: cannot read the file "
                                   f"({exc.strerror})", param=key) from exc
    return SamplingParams(**{**args.own_sampling, **from_namespace(SamplingParams, args)},
                          structured_outputs=given or None)


def _recommended(params, args, recommended: dict):
    """`params` with the model's `recommended` sampling settings for the flags not given."""
    import dataclasses

    from nanoinfer.sampling.sampler import SamplingParams

    given = from_namespace(SamplingParams, args)  # (a flag a model may recommend is absent unless given)
    return dataclasses.replace(params, **{k: v for k, v in recommended.items() if k not in given})


def _llm(args):
    from runtime.llm import LLM

    _say_if_default(args)
    return LLM(args.model, **_load_kwargs(args), **_engine_kwargs(args))


def _say_if_default(args) -> None:
    """Without --model, a line on stderr: the default is a tiny model for trying nanoinfer out, not
    one to judge answers by (greedy, it loops on simple questions)."""
    if args.model is None:
        print(f"nanoinfer: no --model given, so the default model runs: {DEFAULT_MODEL}, 135M parameters, for "
              f"trying nanoinfer out (it repeats itself easily); --model takes an HF directory, a .gguf file or a "
              f"Hub id org/name", file=sys.stderr, flush=True)


def _load_kwargs(args) -> dict:
    """The flags `load_model` takes."""
    return from_namespace(LoadConfig, args)


def _generate(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:
        raise RequestError("the prompt is empty (from standard input: nothing was read)", param="prompt")
    params = _sampling(args)  # (a bad flag fails before the model loads)
    with _llm(args) as llm:
        params = _recommended(params, args, llm.model.sampling_defaults)
        for delta in llm.stream(prompt, params, chat=args.chat):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _async_engine(args):
    """The engine a server runs: an AsyncEngine in this process, or engine processes behind this one as their
    front (runtime/engine_process/data_parallel.py): one with --engine-process, N with --data-parallel-size N > 1."""
    kwargs = {**_load_kwargs(args), **_engine_kwargs(args)}
    _say_if_default(args)
    if kwargs.get("data_parallel_size", 1) > 1 or _engine_process(args, kwargs):
        from runtime.engine_process.data_parallel import data_parallel_from_model

        return data_parallel_from_model(args.model, fronts=getattr(args, "api_server_count", 1), **kwargs)
    from runtime.async_engine import AsyncEngine

    return AsyncEngine.from_model(args.model, **kwargs)


def _engine_process(args, kwargs: dict) -> bool:
    """Whether `serve` runs its engine in a process of its own (--engine-process; auto: with CUDA, unless the
    engine's ranks are pipeline stages or torchrun's, which an engine process does not run yet). Other commands
    (eval speed) keep it in process: they measure the engine, not a server."""
    choice = getattr(args, "engine_process", "off")
    if getattr(args, "api_server_count", 1) > 1:  # (several fronts share one engine: it runs apart from them all)
        if choice == "off":
            raise RequestError(f"--api-server-count {args.api_server_count} needs the engine in a process of its own: "
                               f"expected --engine-process on or auto, not off", param="api_server_count")
        return True
    if choice == "auto":
        from nanoinfer.loaders import resolve_device

        if kwargs.get("pipeline_parallel_size", 1) > 1 or is_launched():
            return False
        return resolve_device(kwargs.get("device", "auto")).type == "cuda"
    return choice == "on"


def _serve(args) -> int:
    from runtime.serve.serving import check_port_free, serve

    config = ServerConfig(**from_namespace(ServerConfig, args))
    check_port_free(config.host, config.port)
    serve(_async_engine(args), config)
    return 0


def _read(path: str, param: str) -> str:

    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RequestError(f"cannot read {path!r}: {exc}", param=param) from exc


def _eval(args) -> int:
    import json

    if args.task == "speed":
        return _eval_speed(args)
    if args.task == "perplexity":
        from runtime.eval.perplexity import perplexity

        text = _read(args.text_file, "text_file")
        with _llm(args) as llm:
            ids = llm.tokenizer.encode(text, add_special_tokens=True)
            result = perplexity(llm, ids, context=args.context, stride=args.stride or max(1, args.context // 2),
                                num_bytes=len(text.encode("utf-8")), use_tqdm=True)
        print(f"{'perplexity':<15}{result.perplexity:.4f}\n{'bits per byte':<15}{result.bits_per_byte:.4f}\n"
              f"{'tokens scored':<15}{result.tokens}")
    else:
        lines = [line for line in _read(args.task_file, "task_file").splitlines() if line.strip()]
        try:
            items = [json.loads(line) for line in lines]
        except ValueError as exc:
            raise RequestError(f"{args.task_file!r} is not JSONL (one JSON object per line): {exc}",
                               param="task_file") from exc
        if args.task == "choice":
            from runtime.eval.choice import evaluate

            with _llm(args) as llm:
                result, _ = evaluate(llm, items, args.task_type, delimiter=args.delimiter, shots=args.shots,
                                     use_tqdm=True)
            print(f"{'accuracy':<10}{result.accuracy:.4f}\n{'items':<10}{result.n}")
        else:
            from runtime.eval import generate

            generate.check_items(items)
            with _llm(args) as llm:
                result, _ = generate.evaluate(llm, items, _sampling(args), chat=args.chat, use_tqdm=True)
            print("\n".join(f"{name:<13}{value:.4f}" for name, value in result._asdict().items() if name != "n")
                  + f"\n{'items':<13}{result.n}")
    if args.json:
        Path(args.json).write_text(json.dumps(result._asdict(), indent=2) + "\n")
    return 0


def _eval_speed(args) -> int:
    import asyncio
    import json

    from runtime.eval.speed import measure, plot

    if args.plot:  # (a missing matplotlib is said now, not after minutes of benchmark)
        from runtime.eval.plots import pyplot

        pyplot()
    engine = _async_engine(args)

    async def run():
        async with engine:
            return await measure(engine, args.batch_sizes, args.input_len, args.output_len,
                                 engine.model.config.vocab_size)

    points = asyncio.run(run())
    print(f"{'batch':>6}{'tok/s':>10}{'TTFT p50':>10}{'p90':>8}{'p99':>8}{'ITL p50':>9}{'p90':>8}{'p99':>8}  (ms)")
    for p in points:
        print(f"{p.batch:>6}{p.output_tokens_per_s:>10.1f}" + "".join(
            f"{p.ttft_ms[q]:>{w}.1f}" for q, w in (("p50", 10), ("p90", 8), ("p99", 8)))
              + "".join(f"{p.itl_ms[q]:>{w}.2f}" for q, w in (("p50", 9), ("p90", 8), ("p99", 8))))
    if args.plot:
        plot(points, args.plot)
    if args.json:
        rows = [{k: v for k, v in p._asdict().items() if k not in ("ttfts", "itls")} for p in points]
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def _chat(args) -> int:
    try:
        import readline  # noqa: F401 - input() gets line editing and history
    except ImportError:  # (not on every platform)
        pass
    params = _sampling(args)  # (a bad flag fails before the model loads)
    with _llm(args) as llm:
        params = _recommended(params, args, llm.model.sampling_defaults)
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
            reply, finish = [], None
            stream = llm.stream(history, params)
            try:
                for delta in stream:
                    reply.append(delta.text)
                    finish = delta.finish_reason or finish
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
                print()
                if finish == "length":
                    print(f"[the reply hit --max-tokens {params.max_tokens}]")
            except KeyboardInterrupt:
                stream.close()  # aborts the request; what arrived stays in the history
                print(" [stopped]")
            history.append({"role": "assistant", "content": "".join(reply)})


def _tensor_parallel_rank(args) -> int:
    """A rank other than 0 of a torchrun launch: the same command line, but this process only
    computes its shard (its stage) of each step that rank 0 (the engine) sends (runtime/executor/tensor_parallel.py)."""
    import torch

    from nanoinfer.loaders import load_model
    from runtime.executor.tp_follower import serve_rank
    from runtime.executor.tp_grid import Grid

    kwargs = _load_kwargs(args)
    if kwargs["device"] in ("auto", "cuda") and torch.cuda.is_available():
        kwargs["device"] = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    model = load_model(args.model, **{**kwargs, "progress": False}).for_context(args.max_model_len)  # (as rank 0's)
    serve_rank(model.config, model.params, Grid(args.tensor_parallel_size, args.pipeline_parallel_size))
    return 0


def _env(args) -> int:
    from runtime.env_report import report

    print("\n".join(report()))
    return 0


def main(argv: list[str] | None = None) -> int:
    handlers = {"generate": _generate, "serve": _serve, "chat": _chat, "eval": _eval, "env": _env}
    local = None
    try:
        args = parse_args(argv)
        launch = LaunchConfig(**from_namespace(LaunchConfig, args)) if hasattr(args, "nnodes") else None
        if launch is not None and launch.nnodes > 1 and not is_launched():  # this node's ranks, started here
            local = LocalRanks(launch, args.tensor_parallel_size * args.pipeline_parallel_size,
                               sys.argv[1:] if argv is None else list(argv))
        if is_launched() and os.environ["RANK"] != "0":  # torchrun's (or LocalRanks') other ranks
            return _tensor_parallel_rank(args)
        return handlers[args.command](args)
    except NanoInferError as exc:
        print(f"nanoinfer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    finally:
        if local is not None:
            local.close()


if __name__ == "__main__":
    sys.exit(main())
