"""The ``cpullm`` command: generate, chat, serve, bench, env."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from cpullm.engine_args import EngineArgs

# Scheduling budgets differ by job, as in vLLM: large batches offline, latency when serving.
OFFLINE_DEFAULTS = dict(max_num_seqs=256, max_num_batched_tokens=4096)
CHAT_DEFAULTS = dict(max_num_seqs=1, max_num_batched_tokens=4096)


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None,
                        help="seed of the sampled tokens (--seed seeds the engine)")


def _sampling_params(args: argparse.Namespace):
    from cpullm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)


def _cmd_generate(args: argparse.Namespace) -> int:
    from cpullm.entrypoints.llm import LLM

    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args, **OFFLINE_DEFAULTS))
    for output in llm.generate(args.prompts, _sampling_params(args)):
        print(output.outputs[0].text)
        if len(args.prompts) > 1:
            print("-" * 40)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from cpullm.entrypoints.chat import run_chat

    engine_args = EngineArgs.from_cli_args(args, **CHAT_DEFAULTS)
    return run_chat(engine_args, _sampling_params(args), args.message, args.system)


def _cmd_env(args: argparse.Namespace) -> int:
    from cpullm.entrypoints.env_report import collect

    print(collect(EngineArgs.from_cli_args(args, **OFFLINE_DEFAULTS)))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "throughput":
        from cpullm.benchmarks.offline import run_throughput

        run_throughput(args)
    elif args.bench == "latency":
        from cpullm.benchmarks.offline import run_latency

        run_latency(args)
    else:
        from cpullm.benchmarks.serve import run_serve_bench

        run_serve_bench(args)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from cpullm.entrypoints.openai.api_server import run_server

    return run_server(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cpullm", description="LLM inference on CPUs")
    sub = parser.add_subparsers(dest="command", required=True)
    commands: dict[str, Callable[[argparse.Namespace], int]] = {}

    gen = sub.add_parser("generate", help="complete prompts offline and print the text")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--model", default=None, help="model folder or GGUF file "
                     "(default: SmolLM2-135M-Instruct)")
    _add_sampling_args(gen)
    EngineArgs.add_cli_args(gen)
    commands["generate"] = _cmd_generate

    chat = sub.add_parser("chat", help="chat with a model in the terminal")
    chat.add_argument("message", nargs="?", default=None,
                      help="answer this one message and exit (default: interactive)")
    chat.add_argument("--model", default=None, help="model folder or GGUF file "
                      "(default: SmolLM2-135M-Instruct)")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_sampling_args(chat)
    EngineArgs.add_cli_args(chat)
    commands["chat"] = _cmd_chat

    from cpullm.entrypoints.openai.cli_args import add_serve_args

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_serve_args(serve)
    commands["serve"] = _cmd_serve

    from cpullm.benchmarks.offline import add_latency_args, add_throughput_args
    from cpullm.benchmarks.serve import add_serve_bench_args

    bench = sub.add_parser("bench", help="measure throughput and latency")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    add_throughput_args(bench_sub.add_parser("throughput", help="offline batch throughput"))
    add_latency_args(bench_sub.add_parser("latency", help="latency of one batch"))
    add_serve_bench_args(bench_sub.add_parser("serve", help="load an OpenAI-compatible server"))
    commands["bench"] = _cmd_bench

    env = sub.add_parser("env", help="print the platform, configuration and library versions")
    env.add_argument("--model", default=None)
    EngineArgs.add_cli_args(env)
    commands["env"] = _cmd_env

    parser.set_defaults(_commands=commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args._commands[args.command](args)
    except ValueError as e:
        print(f"cpullm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
