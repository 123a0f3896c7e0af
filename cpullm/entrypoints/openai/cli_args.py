"""Flags of ``cpullm serve``: the engine's plus the HTTP server's, with vLLM's names."""

from __future__ import annotations

import argparse

from cpullm.engine_args import EngineArgs

# Serving favours latency: fewer sequences and smaller steps than offline runs.
SERVE_DEFAULTS = dict(max_num_seqs=128, max_num_batched_tokens=2048)


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model", nargs="?", default=None,
                        help="model folder or GGUF file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="require this bearer key on /v1 routes (or set VLLM_API_KEY)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--disable-log-requests", action="store_true",
                        help="do not log each request's parameters")
    EngineArgs.add_cli_args(parser)
    return parser
