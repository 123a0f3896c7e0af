"""The ``cpullm`` command: generate, chat, serve, bench, env."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from cpullm.engine_args import CHAT_DEFAULTS, OFFLINE_DEFAULTS, EngineArgs


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every flag's help line ends with its default; flags left unset say in their help
    what unset means. Descriptions and epilogs keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if (action.default is None or action.default is argparse.SUPPRESS
                or "%(default)" in help_text or not action.option_strings):
            return help_text
        return f"{help_text} (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """cpullm's parsers, sub-command parsers included, format help with HelpFormatter."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256,
                        help="most tokens to generate per answer")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature; 0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus sampling: keep the most likely tokens up to this mass")
    parser.add_argument("--top-k", type=int, default=0,
                        help="keep only the k most likely tokens; 0 keeps all")
    parser.add_argument("--sampling-seed", type=int, default=None,
                        help="seed of the sampled tokens (--seed seeds the engine)")


def _sampling_params(args: argparse.Namespace):
    from cpullm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)


def _cmd_generate(args: argparse.Namespace) -> int:
    from cpullm.entrypoints.llm import LLM

    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    for output in llm.generate(args.prompts, _sampling_params(args)):
        print(output.outputs[0].text)
        if len(args.prompts) > 1:
            print("-" * 40)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from cpullm.entrypoints.chat import run_chat

    engine_args = EngineArgs.from_cli_args(args)
    return run_chat(engine_args, _sampling_params(args), args.message, args.system,
                    args.verbose)


def _cmd_env(args: argparse.Namespace) -> int:
    from cpullm.entrypoints.env_report import collect

    print(collect(EngineArgs.from_cli_args(args)))
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from cpullm.model_executor.layers.quantization import QUANTIZATION_METHODS
    from cpullm.model_executor.models import describe_architectures

    print("Architectures (config.json \"architectures\"):")
    print("\n".join(f"  {line}" for line in describe_architectures()))
    print(f"Quantization formats (--quantization): {', '.join(QUANTIZATION_METHODS)}")
    return 0


def _cmd_recipe(args: argparse.Namespace) -> int:
    from cpullm.recipes import hardware_classes, make_recipe

    if args.list:
        for name, spec in hardware_classes().items():
            print(f"{name:10} {spec['description']}")
        return 0
    recipe = make_recipe(args.model, args.hardware, args.variant)
    for path in recipe.write(args.output_dir):
        print(f"wrote {path}")
    print("\n".join(f"  {note}" for note in recipe.notes))
    print(f"then: source {args.output_dir}/env.sh && cpullm serve --config "
          f"{args.output_dir}/config.yml")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "throughput":
        from cpullm.benchmarks.offline import run_throughput

        run_throughput(args)
    elif args.bench == "latency":
        from cpullm.benchmarks.offline import run_latency

        run_latency(args)
    elif args.bench == "gemm":
        from cpullm.benchmarks.gemm import run_gemm

        run_gemm(args)
    elif args.bench == "allreduce":
        from cpullm.benchmarks.allreduce import run_allreduce

        run_allreduce(args)
    elif args.bench == "suite":
        from cpullm.benchmarks.suite import run_suite

        report = run_suite(args)
        return 1 if report.failed else 0
    elif args.bench == "quality":
        from cpullm.benchmarks.quality import run_quality

        _take_model_tag(args)
        run_quality(args)
    elif args.bench == "soak":
        from cpullm.benchmarks.soak import run_soak

        figures = run_soak(args)
        return 0 if figures["errors"] == 0 and figures["kv_blocks_leaked"] == 0 else 1
    else:
        from cpullm.benchmarks.serve import run_serve_bench

        run_serve_bench(args)
    return 0


def _take_model_tag(args: argparse.Namespace) -> None:
    """`COMMAND MODEL` and `COMMAND --model MODEL` are the same (serve, bench quality)."""
    if args.model_tag is not None:
        from_file = "model" in getattr(args, "config_dests", ())
        if args.model is not None and args.model != args.model_tag and not from_file:
            raise ValueError(f"model: given twice, as {args.model_tag!r} and --model "
                             f"{args.model!r}")
        args.model = args.model_tag


def _cmd_serve(args: argparse.Namespace) -> int:
    from cpullm.entrypoints.openai.api_server import run_server

    _take_model_tag(args)
    return run_server(args)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="cpullm", description="LLM inference and serving on CPUs, "
                            "with vLLM's flags and environment variables")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="what to do; `cpullm COMMAND --help` for its flags")
    commands: dict[str, Callable[[argparse.Namespace], int]] = {}

    gen = sub.add_parser("generate", help="complete prompts offline and print the text",
                         description="Complete prompts offline and print the text.")
    gen.add_argument("prompts", nargs="+", help="the prompts, each completed on its own")
    _add_sampling_args(gen)
    EngineArgs.add_cli_args(gen, **OFFLINE_DEFAULTS)
    commands["generate"] = _cmd_generate

    chat = sub.add_parser("chat", help="chat with a model in the terminal",
                          description="Chat with a model in the terminal; the answer streams "
                          "as it is made.")
    chat.add_argument("message", nargs="?", default=None,
                      help="answer this one message and exit; unset: chat interactively")
    chat.add_argument("--system", default=None, help="system prompt; unset: none")
    chat.add_argument("-v", "--verbose", action="store_true",
                      help="print the engine's INFO log lines too (unset: only warnings and "
                      "errors, unless VLLM_LOGGING_LEVEL says otherwise)")
    _add_sampling_args(chat)
    EngineArgs.add_cli_args(chat, **CHAT_DEFAULTS)
    commands["chat"] = _cmd_chat

    from cpullm.entrypoints.openai.cli_args import SERVE_EPILOG, add_serve_args

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                           description="Serve the OpenAI-compatible HTTP API "
                           "(/v1/completions, /v1/chat/completions, /v1/models, ...).",
                           epilog=SERVE_EPILOG)
    add_serve_args(serve)
    commands["serve"] = _cmd_serve

    from cpullm.benchmarks.offline import add_latency_args, add_throughput_args
    from cpullm.benchmarks.serve import add_serve_bench_args

    bench = sub.add_parser("bench", help="measure throughput and latency",
                           description="Measure throughput and latency, with the figures and "
                           "flags of vLLM's bench commands.")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK",
                                     help="what to measure")
    add_throughput_args(bench_sub.add_parser(
        "throughput", help="offline batch throughput",
        description="Offline batch throughput of the engine on a synthetic or ShareGPT "
        "workload."))
    add_latency_args(bench_sub.add_parser(
        "latency", help="latency of one batch",
        description="Latency of one batch, prompt and generation, over several iterations."))
    add_serve_bench_args(bench_sub.add_parser(
        "serve", help="load an OpenAI-compatible server",
        description="Load an OpenAI-compatible server (cpullm's or vLLM's) with streamed "
        "requests and report TTFT, TPOT, ITL and throughput."))
    from cpullm.benchmarks.gemm import add_gemm_args

    add_gemm_args(bench_sub.add_parser(
        "gemm", help="one decoder layer's bf16 GEMMs on every path this CPU runs, and the peak",
        description="Time one decoder layer's bfloat16 GEMMs on each path the engine can "
        "pick on this CPU (AVX-512 BF16, AMX tiles, oneDNN) at several row counts, print "
        "GMAC/s and the peak; with --prompt-tokens, one prompt step through the engine "
        "against that peak."))
    from cpullm.benchmarks.allreduce import add_allreduce_args

    add_allreduce_args(bench_sub.add_parser(
        "allreduce", help="the cost of one tensor-parallel all-reduce, gloo and shared memory",
        description="Time the all-reduce of a layer's hidden states over tensor-parallel "
        "ranks on this host, through gloo and through shared memory."))
    from cpullm.benchmarks.soak import add_soak_args

    add_soak_args(bench_sub.add_parser(
        "soak", help="many streaming clients for a long time, some vanishing mid-stream",
        description="Soak a running server: concurrent streaming clients for a set time, a "
        "share of them disconnecting mid-stream; then report errors, leaked KV blocks, "
        "resident memory and latency percentiles. Exits 1 on any error or leaked block."))
    from cpullm.benchmarks.quality import add_quality_args

    add_quality_args(bench_sub.add_parser(
        "quality", help="perplexity, KL divergence and top-1 agreement against float32",
        description="Score fixed windows of a text with the model as configured and with "
        "the same weights in float32 (or a saved reference); print the perplexity of each, "
        "the KL divergence of the run from the reference and how often their most likely "
        "tokens agree, as llama-perplexity's --kl-divergence does."))
    from cpullm.benchmarks.suite import add_suite_args

    add_suite_args(bench_sub.add_parser(
        "suite", help="serving benchmark cases from a JSON file (vLLM CPU's suite shape)",
        description="Run serving benchmark cases from a JSON file shaped like vLLM CPU's "
        "serving-tests-cpu.json: per case start the server, wait for /health, run the "
        "clients, stop it; write the commands, the results, a markdown table and PNG plots. "
        "DRY_RUN=1 writes the commands only; SERVING_JSON, MODEL_FILTER and DTYPE_FILTER as "
        "in vLLM's script."))
    commands["bench"] = _cmd_bench

    recipe = sub.add_parser(
        "recipe", help="write config.yml and env.sh for a model on a hardware class",
        description="Plan a model on a hardware class (ranks per NUMA node, thread binding, KV "
        "cache, batch budgets) from the recipes shipped with cpullm, and write vLLM's "
        "config.yml (for `cpullm serve --config`) and env.sh.")
    recipe.add_argument("--model", default=None,
                        help="model folder, GGUF file or hub name (a name not on this machine "
                        "is planned from what it says: family, size); unset: the default model")
    recipe.add_argument("--hardware", default="auto",
                        help="hardware class (--list shows them), or auto: this machine")
    recipe.add_argument("--variant", default=None,
                        help="a variant of the recipe (latency, or a quantization format); "
                        "unset: the model's quantization format where the recipe has one")
    recipe.add_argument("--output-dir", default=".", help="folder of config.yml and env.sh")
    recipe.add_argument("--list", action="store_true", help="list the hardware classes")
    commands["recipe"] = _cmd_recipe

    env = sub.add_parser("env", help="print the platform, configuration and library versions",
                         description="Print the platform, the effective configuration and "
                         "library versions, for bug reports.")
    EngineArgs.add_cli_args(env, **OFFLINE_DEFAULTS)
    commands["env"] = _cmd_env

    sub.add_parser("models", help="list the supported architectures and quantization formats",
                   description="List the model architectures and quantization formats this "
                   "cpullm runs.")
    commands["models"] = _cmd_models

    parser.set_defaults(_commands=commands)
    return parser


def _with_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """``COMMAND --config FILE``: the file's flags become that command's defaults."""
    from cpullm.entrypoints.config_file import CONFIG_FLAG, apply_config_file, config_path

    path = config_path(argv)
    if path is None or not argv:
        return
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command = subparsers.choices.get(argv[0])
    if command is None or CONFIG_FLAG not in command._option_string_actions:
        return  # argparse says the flag is unknown there
    command.set_defaults(config_dests=apply_config_file(command, path))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        _with_config_file(parser, argv)
    except ValueError as e:
        parser.exit(2, f"cpullm: error: {e}\n")
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
