"""Flags of ``cpullm serve``: the engine's plus the HTTP server's, with vLLM's names."""

from __future__ import annotations

import argparse
import json

from cpullm.engine_args import SERVE_DEFAULTS, EngineArgs
from cpullm.entrypoints.config_file import add_config_arg

SERVE_EPILOG = """\
environment variables (vLLM CPU's names and meanings):
  VLLM_CPU_KVCACHE_SPACE        KV cache size in GiB (--kv-cache-memory-bytes wins)
  VLLM_CPU_OMP_THREADS_BIND     CPUs of the compute threads: auto, nobind, 0-31, 0-31|32-63
  VLLM_CPU_NUM_OF_RESERVED_CPU  CPUs that auto binding leaves to the HTTP front-end
  CPU_VISIBLE_MEMORY_NODES      NUMA nodes auto binding may use, in order
  VLLM_LOGGING_LEVEL            log level (DEBUG, INFO, WARNING, ...)
  VLLM_API_KEY                  bearer key required on /v1 routes when --api-key is unset

Every flag and variable, with the rules behind the defaults: docs/configuration.md"""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _origins(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of origins, got {text!r}")
    return value


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="model folder or GGUF file, the same as --model")
    add_config_arg(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--api-key", nargs="+", default=None,
                        help="require one of these bearer keys on /v1 routes; unset: "
                        "VLLM_API_KEY, or no key")
    parser.add_argument("--shutdown-timeout", type=int, default=0,
                        help="on SIGTERM or SIGINT, seconds the running requests get to "
                             "finish before they are ended (with a 503, or an error event "
                             "for a stream); 0 (vLLM's default): ended at once")
    parser.add_argument("--max-waiting-requests", type=_positive_int, default=None,
                        help="requests that may wait beyond the --max-num-seqs that run; "
                             "more get a 503 with Retry-After at once (default: 8 x "
                             "--max-num-seqs)")
    parser.add_argument("--max-request-body-bytes", type=_positive_int, default=32 << 20,
                        help="larger request bodies get a 413 (default 32 MiB)")
    parser.add_argument("--request-body-timeout", type=float, default=30.0,
                        help="seconds a request body may pause between bytes before a 408")
    parser.add_argument("--allowed-origins", type=_origins, default=None,
                        help='CORS: origins allowed to call the API from a browser, a JSON '
                             'list (\'["https://app.example"]\', \'["*"]\'); unset: no CORS')
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="log level of the HTTP server")
    parser.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction,
                        default=False, help="log each request's parameters")
    parser.add_argument("--disable-log-requests", action="store_true",
                        help="do not log requests (older vLLM's flag; not logging is the default)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let the model decide when to call tools (tool_choice "auto"); '
                             "needs --tool-call-parser")
    parser.add_argument("--tool-call-parser", default=None,
                        choices=["hermes", "llama3_json", "mistral", "pythonic"],
                        help="the format the model writes tool calls in, for tool_choice "
                             '"auto" (hermes: Qwen 2.5/3; llama3_json: Llama 3.1-3.3; '
                             "mistral; pythonic: Llama 4, Llama 3.2 1B/3B)")
    parser.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                        help="keep the model's <think> reasoning apart from its answer, in "
                             "reasoning_content")
    parser.add_argument("--webui", action=argparse.BooleanOptionalAction, default=True,
                        help="serve the chat page at / to browsers (--no-webui: API clients "
                             "and browsers alike get the JSON of the routes)")
    parser.add_argument("--responses-store-size", type=int, default=1000,
                        help="/v1/responses kept in memory for previous_response_id and GET "
                             "(the oldest go first; 0: none kept)")
    parser.add_argument("--responses-store-ttl", type=_positive_int, default=3600,
                        help="seconds a stored /v1/responses response is kept")
    parser.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                        help="chat images may be local files under this folder (file:// "
                        "URLs or paths); unset: none")
    parser.add_argument("--allow-remote-media", action="store_true",
                        help="fetch http(s) image URLs of chat requests (20 MiB, 10 s at most "
                        "each); off by default")
    parser.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                        help='the most images in one request, vLLM\'s \'{"image": N}\' '
                        "(default 8)")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="LoRA adapters to serve (with --enable-lora), each name=path or "
                        'JSON {"name": ..., "path": ..., "base_model_name": ...}; a request '
                        "picks one by its model")
    parser.add_argument("--headless", action="store_true",
                        help="serve nothing: run this node's ranks of a model that spans "
                             "nodes (--nnodes, --node-rank > 0), for the server on node 0")
    EngineArgs.add_cli_args(parser, **SERVE_DEFAULTS)
    return parser
